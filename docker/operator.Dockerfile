# The tpu-operator controller: `tpujob operator` (kopf), without the JAX workload stack.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/tpu-operator/operator:0.1.0 .
# Without Docker or a registry: scripts/build-images.sh (podman, on a debootstrapped bookworm base
# passed as PYTHON_IMAGE); tests/images run what it builds.
# Reproducible: a pinned base tag (override PYTHON_IMAGE with a tag@sha256 digest to pin fully),
# no pip cache, the build context limited by .dockerignore.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# python3: a plain Debian base (python3 + python3-venv) has no `python`; the python images have both.
RUN python3 -m venv /opt/venv
WORKDIR /src
# setuptools maps operator/, templates/, crds/ and workload/ to packages: all four must be present.
COPY pyproject.toml README.md ./
COPY operator operator
COPY templates templates
COPY crds crds
COPY workload workload
# The `operator` extra (kopf, kubernetes_asyncio, ...); the `workload` extra (JAX) is for the
# trainer image only.
RUN /opt/venv/bin/pip install --no-cache-dir ".[operator]" \
 && /opt/venv/bin/tpujob --help >/dev/null \
 && /opt/venv/bin/python -c "import tpu_operator.controller.handlers"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tpu-operator" \
      org.opencontainers.image.description="Turns TPUTrainingJobs into JobSets on Cloud TPU v7x" \
      org.opencontainers.image.source="https://github.com/tpu-operator/tpu-operator" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed non-root UID/GID that the Helm chart's securityContext also names (runAsNonRoot needs a number).
RUN groupadd --gid 65532 tpujob && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin tpujob
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["tpujob", "operator"]
