# The JAX trainer the TPUTrainingJob pods run: `python -m tpu_workload`.
#   TPU (default): docker build -f docker/workload.Dockerfile -t ghcr.io/tpu-operator/workload:0.1.0 .
#   CPU (kind suite, tests): docker build -f docker/workload.Dockerfile --build-arg VARIANT=cpu \
#                              -t ghcr.io/tpu-operator/workload:0.1.0-cpu .
# The JAX stack is pinned by pyproject's `workload` extra (jax/jaxlib 0.10.2, flax 0.12.8, ...);
# the TPU variant adds jax[tpu]==0.10.2, which brings the matching libtpu from PyPI; the CPU variant adds
# the `plan` extra (libtpu, pinned), so both can run the operator's pre-flight, `python -m tpu_workload.performance.plan`,
# which compiles for a TPU slice without one.
# Without Docker or a registry: scripts/build-images.sh (podman, on a debootstrapped bookworm base
# passed as PYTHON_IMAGE); tests/images run what it builds.
# Reproducible: a pinned base tag (override PYTHON_IMAGE with a tag@sha256 digest to pin fully),
# pinned JAX, no pip cache, the build context limited by .dockerignore.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# tpu | cpu
ARG VARIANT=tpu

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT
ARG JAX_VERSION=0.10.2
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# python3: a plain Debian base (python3 + python3-venv) has no `python`; the python images have both.
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator operator
COPY templates templates
COPY crds crds
COPY workload workload
RUN case "${VARIANT}" in \
      tpu) extra="jax[tpu]==${JAX_VERSION}" ;; \
      cpu) extra="" plan=",plan" ;; \
      *) echo "VARIANT must be tpu or cpu, not ${VARIANT}" >&2; exit 2 ;; \
    esac \
 && /opt/venv/bin/pip install --no-cache-dir ${extra:+"$extra"} ".[workload${plan:-}]" \
 && /opt/venv/bin/python -c "import jax, tpu_workload; print('jax', jax.__version__)"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.description="JAX trainer for TPUTrainingJobs" \
      org.opencontainers.image.source="https://github.com/tpu-operator/tpu-operator" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 65532 tpujob && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin tpujob
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The pod's container ports as the operator renders them (templates/jobset.yaml.j2): JAX
# coordinator, TPU runtime, megascale, and the trainer's /status and /metrics (the default
# spec.runtime.metricsPort). Informational: the pods use host networking.
EXPOSE 8476 8471 8080 9431
ENTRYPOINT ["python", "-m", "tpu_workload"]

# No USER in the TPU variant: libtpu opens the TPU devices, which GKE's known-good TPU pods reach as
# root (../shared/TPU.md), and a checkpoint PVC mounted without an fsGroup is root's. The operator
# renders no securityContext; a pod may still set runAsUser: 65532 (the image's tpujob user).
FROM runtime AS variant-tpu
LABEL org.opencontainers.image.title="tpu-operator workload (TPU)"

# The CPU build stands in for a TPU host: each pod's 4 chips become 8 virtual CPU devices (v7x: 2
# JAX devices per chip). These variables are reserved in spec.runtime.env (the operator owns
# TPUJOB_*), so the CPU image carries them. The trainer keeps serving its final metrics for
# LINGER_SECONDS after the last step, so the operator reads them before the pod exits.
FROM runtime AS variant-cpu
ARG CPU_DEVICES=8
ARG LINGER_SECONDS=30
LABEL org.opencontainers.image.title="tpu-operator workload (CPU, for tests)"
ENV JAX_PLATFORMS=cpu \
    TPUJOB_PLATFORM=cpu \
    TPUJOB_CPU_DEVICES=${CPU_DEVICES} \
    TPUJOB_LINGER_SECONDS=${LINGER_SECONDS}
# No device to open: the operator chart's non-root UID (HOME=/tmp).
USER 65532:65532

FROM variant-${VARIANT}
