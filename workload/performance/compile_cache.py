"""JAX's persistent compilation cache beside the checkpoints, so a restarted job skips compiling.

The directory is `<checkpoint directory>/compilation-cache` (a path or gs://; Orbax ignores
non-numeric entries there), unless the pod's environment names one in JAX_COMPILATION_CACHE_DIR (a
user's setting: a node-local disk, a bucket shared by a team's jobs; the test suite shares one between
all its runs): then that one, with or without a checkpoint directory. Every program is cached however
small or quick to compile (the thresholds are lowered), so CPU test runs use it too.
TPUJOB_COMPILATION_CACHE=0 turns it off (for measuring what it saves); a job with neither directory
has none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from tpu_operator.api.contract import TrainerConfig

log = logging.getLogger(__name__)
SUBDIRECTORY = "compilation-cache"


def directory(cfg: TrainerConfig, env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    if env.get("TPUJOB_COMPILATION_CACHE", "1") == "0":
        return None
    # JAX reads this variable itself at import; setting the job's directory over it would drop the user's.
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return env["JAX_COMPILATION_CACHE_DIR"]
    if not cfg.checkpoint.directory:
        return None
    return f"{cfg.checkpoint.directory.rstrip('/')}/{SUBDIRECTORY}"


def enable(cfg: TrainerConfig) -> str | None:
    """Point JAX's persistent cache at the job's directory; call before the first compilation."""
    import jax

    path = directory(cfg)
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    log.info("compilation cache: %s", path)
    return path
