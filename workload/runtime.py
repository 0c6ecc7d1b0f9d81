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
Without coordinator variables: jax.distributed.initialize() auto-detects on TPU; elsewhere a
single process.
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)

# Nominal per-device peak of a CPU "device", used only so MFU is defined on CPU runs.
CPU_PEAK_FLOPS_PER_DEVICE = 5e10


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


def _int(env, name):
    v = env.get(name)
    return int(v) if v not in (None, "") else None


def read_env(env=None) -> Env:
    env = os.environ if env is None else env
    pid = _int(env, "TPUJOB_PROCESS_ID")
    if pid is None and env.get("TPUJOB_SLICE_ID") not in (None, ""):
        pid = _int(env, "TPUJOB_SLICE_ID") * _int(env, "TPUJOB_HOSTS_PER_SLICE") + _int(env, "TPUJOB_HOST_ID")
    peak = env.get("TPUJOB_PEAK_FLOPS_PER_DEVICE")
    return Env(coordinator=env.get("TPUJOB_COORDINATOR_ADDRESS") or None,
               num_processes=_int(env, "TPUJOB_NUM_PROCESSES"), process_id=pid,
               platform=env.get("TPUJOB_PLATFORM") or None, cpu_devices=_int(env, "TPUJOB_CPU_DEVICES"),
               metrics_port=_int(env, "TPUJOB_METRICS_PORT"), peak_flops=float(peak) if peak else None,
               run_dir=env.get("TPUJOB_RUN_DIR") or None,
               linger_s=float(env.get("TPUJOB_LINGER_SECONDS") or 0))


def start(env: Env) -> None:
    """Configure the platform and join the other processes. Call before touching devices."""
    import jax

    if env.platform:
        jax.config.update("jax_platforms", env.platform)
    if env.cpu_devices:
        jax.config.update("jax_num_cpu_devices", env.cpu_devices)
    if env.coordinator:
        if env.num_processes is None or env.process_id is None:
            raise ValueError("TPUJOB_COORDINATOR_ADDRESS needs TPUJOB_NUM_PROCESSES and TPUJOB_PROCESS_ID "
                             "(or TPUJOB_SLICE_ID, TPUJOB_HOST_ID, TPUJOB_HOSTS_PER_SLICE)")
        jax.distributed.initialize(coordinator_address=env.coordinator, num_processes=env.num_processes,
                                   process_id=env.process_id)
    elif on_tpu_host(env):
        jax.distributed.initialize()
    log.info("process %d of %d: %d local / %d global devices (%s)", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count(), jax.default_backend())


def on_tpu_host(env: Env) -> bool:
    if env.platform and env.platform != "tpu":
        return False
    return bool(os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_WORKER_ID")
                or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"))


def peak_flops_per_device(env: Env, config_peak: float) -> float:
    import jax

    if env.peak_flops:
        return env.peak_flops
    return config_peak if jax.default_backend() == "tpu" else CPU_PEAK_FLOPS_PER_DEVICE
