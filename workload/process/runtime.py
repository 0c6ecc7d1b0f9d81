"""The environment contract and multi-controller start-up.

Environment (set by the rendered pods and by the local runner):
  TPUJOB_COORDINATOR_ADDRESS   host:port of process 0's JAX coordinator
  TPUJOB_NUM_PROCESSES         number of processes
  TPUJOB_PROCESS_ID            this process, or derived as
                               TPUJOB_SLICE_ID * TPUJOB_HOSTS_PER_SLICE + TPUJOB_HOST_ID
  TPUJOB_PLATFORM              e.g. cpu (sets jax_platforms)
  TPUJOB_CPU_DEVICES           virtual CPU devices per process
  TPUJOB_METRICS_PORT          overrides config metricsPort; 0 picks a free port (logged)
  TPUJOB_PEAK_FLOPS_PER_DEVICE overrides the peak used for MFU
  TPUJOB_RUN_DIR               TensorBoard goes here when there is no checkpoint directory
  TPUJOB_LINGER_SECONDS        keep serving metrics this long after completion (default 0)
  TPUJOB_INIT_TIMEOUT_SECONDS  limit on jax.distributed start-up and on the first collective after
                               it (default 300); past it the trainer exits 42 (exits.py)
  TPUJOB_TERMINATION_LOG       where the exit record goes (default /dev/termination-log; exits.py)
  TPUJOB_SLICES                the slices that run, for an elastic job on fewer than its config's
                               (TrainerConfig.at_slices; docs/elastic.md)

How the process joins the others (`join_plan`, a pure function of `Env`):
  1. TPUJOB_COORDINATOR_ADDRESS set: jax.distributed.initialize with it, the process count and id.
     The rendered pods always take this path (MEGASCALE_* there is for libtpu's DCN transport).
  2. Else, on a TPU host (`TPU_SIGN_VARIABLES` set or `TPU_DEVICE_GLOBS` present) and unless
     TPUJOB_PLATFORM names a platform list without tpu: jax.distributed.initialize() with no
     arguments, so JAX's own cluster detection (GKE: TPU_WORKER_*, MEGASCALE_*; GCE: metadata)
     finds the others.
  3. Else a single process.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import logging
import os
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

DEFAULT_INIT_TIMEOUT_S = 300
INIT_TIMEOUT_MARGIN_S = 30
# Nominal per-device peak of a CPU "device", used only so MFU is defined on CPU runs.
CPU_PEAK_FLOPS_PER_DEVICE = 5e10

# Variables that only TPU hosts carry: GKE's webhook injects TPU_WORKER_ID and TPU_WORKER_HOSTNAMES
# (TPU_PROCESS_ADDRESSES, which JAX reads first, in newer versions); multi-slice JobSets set MEGASCALE_*.
TPU_SIGN_VARIABLES = (
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
)
# TPU chips as device nodes: /dev/accel<N> (accel driver) or /dev/vfio/<group> (v5p and later).
# /dev/vfio/vfio, the VFIO container node, exists on any host with the vfio module: not a sign.
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")


@dataclasses.dataclass(frozen=True)
class Env:
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    platform: str | None
    cpu_devices: int | None
    metrics_port: int | None
    peak_flops: float | None
    run_dir: str | None
    linger_s: float
    tpu_signs: tuple[str, ...] = ()  # the TPU variables set and TPU device nodes found
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S
    slices: int | None = None  # TPUJOB_SLICES


@dataclasses.dataclass(frozen=True)
class Join:
    """How this process joins the others: `kind` is explicit, tpu-auto or single."""

    kind: str
    kwargs: dict
    reason: str


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


def _process_id(env: Mapping[str, str]) -> int | None:
    pid = _int(env, "TPUJOB_PROCESS_ID")
    if pid is not None or env.get("TPUJOB_SLICE_ID") in (None, ""):
        return pid
    parts = {n: _int(env, n) for n in ("TPUJOB_SLICE_ID", "TPUJOB_HOSTS_PER_SLICE", "TPUJOB_HOST_ID")}
    missing = [n for n, v in parts.items() if v is None]
    if missing:
        raise ValueError(
            f"TPUJOB_SLICE_ID is set but {', '.join(missing)} is not: the process id is "
            "TPUJOB_SLICE_ID * TPUJOB_HOSTS_PER_SLICE + TPUJOB_HOST_ID"
        )
    return parts["TPUJOB_SLICE_ID"] * parts["TPUJOB_HOSTS_PER_SLICE"] + parts["TPUJOB_HOST_ID"]


def tpu_signs(env: Mapping[str, str], glob: Callable[[str], list[str]] = globlib.glob) -> tuple[str, ...]:
    """The TPU-only variables set in `env` and the TPU device nodes `glob` finds."""
    names = tuple(n for n in TPU_SIGN_VARIABLES if env.get(n))
    return names + tuple(p for pattern in TPU_DEVICE_GLOBS for p in sorted(glob(pattern)))


def read_env(env: Mapping[str, str] | None = None, *, glob: Callable[[str], list[str]] = globlib.glob) -> Env:
    """Parse the contract from `env` (default os.environ); `glob` finds device nodes."""
    env = os.environ if env is None else env
    peak = env.get("TPUJOB_PEAK_FLOPS_PER_DEVICE")
    return Env(
        coordinator=env.get("TPUJOB_COORDINATOR_ADDRESS") or None,
        num_processes=_int(env, "TPUJOB_NUM_PROCESSES"),
        process_id=_process_id(env),
        platform=env.get("TPUJOB_PLATFORM") or None,
        cpu_devices=_int(env, "TPUJOB_CPU_DEVICES"),
        metrics_port=_int(env, "TPUJOB_METRICS_PORT"),
        peak_flops=float(peak) if peak else None,
        run_dir=env.get("TPUJOB_RUN_DIR") or None,
        linger_s=float(env.get("TPUJOB_LINGER_SECONDS") or 0),
        tpu_signs=tpu_signs(env, glob),
        init_timeout_s=_int(env, "TPUJOB_INIT_TIMEOUT_SECONDS") or DEFAULT_INIT_TIMEOUT_S,
        slices=_int(env, "TPUJOB_SLICES"),
    )


def on_tpu_host(env: Env) -> bool:
    """TPU signs were found and TPUJOB_PLATFORM (a jax_platforms list) does not rule the TPU out."""
    if env.platform and "tpu" not in env.platform.split(","):
        return False
    return bool(env.tpu_signs)


def join_plan(env: Env) -> Join:
    """Decide how to join the other processes; raises ValueError for an incomplete contract."""
    if env.coordinator:
        if env.num_processes is None or env.process_id is None:
            raise ValueError(
                "TPUJOB_COORDINATOR_ADDRESS needs TPUJOB_NUM_PROCESSES and TPUJOB_PROCESS_ID "
                "(or TPUJOB_SLICE_ID, TPUJOB_HOST_ID, TPUJOB_HOSTS_PER_SLICE)"
            )
        if not 0 <= env.process_id < env.num_processes:
            raise ValueError(
                f"process id {env.process_id} is outside 0..{env.num_processes - 1} (TPUJOB_NUM_PROCESSES)"
            )
        return Join(
            "explicit",
            dict(coordinator_address=env.coordinator, num_processes=env.num_processes, process_id=env.process_id),
            "TPUJOB_COORDINATOR_ADDRESS",
        )
    if on_tpu_host(env):
        return Join("tpu-auto", {}, ", ".join(env.tpu_signs))
    why = f"TPUJOB_PLATFORM={env.platform}" if env.platform and env.tpu_signs else "no coordinator, no TPU"
    return Join("single", {}, why)


def start(env: Env) -> None:
    """Configure the platform and join the other processes. Call before touching devices."""
    import jax

    plan = join_plan(env)  # before any side effect: a bad contract fails fast
    if env.platform:
        jax.config.update("jax_platforms", env.platform)
    if env.cpu_devices:
        jax.config.update("jax_num_cpu_devices", env.cpu_devices)
    log.info("joining: %s (%s)", plan.kind, plan.reason)
    if plan.kind != "single":
        # The caller's watchdog (exits.deadline) fires at init_timeout_s and exits 42 with a message;
        # JAX's own timeout, later, would abort the process (SIGABRT) without one.
        jax.distributed.initialize(**plan.kwargs, initialization_timeout=env.init_timeout_s + INIT_TIMEOUT_MARGIN_S)
    log.info(
        "process %d of %d: %d local / %d global devices (%s)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.default_backend(),
    )


def peak_flops_per_device(env: Env, config_peak: float) -> float:
    import jax

    if env.peak_flops:
        return env.peak_flops
    return config_peak if jax.default_backend() == "tpu" else CPU_PEAK_FLOPS_PER_DEVICE
