"""The TPU compiles of test_tpu_kernels.py, run in a child process of their own.

libtpu, once a topology has loaded it into a process, stays there, and jax.profiler (which the tuning
tests use through tune_jax) then crashes that process; the pytest process must never load it. This
module compiles each case for a TPU7x 2x2x1 slice (libtpu, no TPU; the v7x flags the pods get in
LIBTPU_INIT_ARGS, read once at the first topology) and prints one JSON object of what each case
found, or the error it raised, for the tests to assert on.

    python -m tests.workload.tpu_compile_child TRAINER_CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from tpu_operator.api.catalogue import generation
from tpu_operator.api.contract import SplashSpec, TrainerConfig
from tpu_operator.api.models import RuntimeSpec
from tpu_operator.rendering.libtpu import libtpu_init_args
from tpu_workload import attention, moe, plan, sharding


def _sharder() -> sharding.Sharder:
    """FSDP over the 8 devices of a TPU7x 2x2x1 slice, made by libtpu with the pods' v7x flags."""
    os.environ.setdefault("LIBTPU_INIT_ARGS", " ".join(libtpu_init_args(generation("v7x"), RuntimeSpec())))
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags
    devices = plan.topology_devices("v7x", "2x2x1", 1)
    return sharding.Sharder(sharding.make_mesh(dict(data=1, fsdp=8, context=1, expert=1, tensor=1), 1, devices))


def _compiled(lowered) -> dict:
    return {"custom_call": "tpu_custom_call" in lowered.as_text(),  # the Mosaic kernels, not an XLA fallback
            "temp_bytes": lowered.compile().memory_analysis().temp_size_in_bytes}


def splash(sharder: sharding.Sharder, _: TrainerConfig) -> dict:
    B, T, N, K, H = 8, 1024, 8, 2, 128  # GQA, 1024 tokens: two of the default 512-token blocks
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))

    def loss(q, k, v):
        with sharding.use(sharder):
            return attention.splash_attention(q, k, v, spec=SplashSpec(), interpret=False).astype(jnp.float32).sum()

    return _compiled(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv))


def megablox(sharder: sharding.Sharder, _: TrainerConfig) -> dict:
    B, T, D, F, E, k = 8, 256, 256, 512, 4, 2
    mesh = sharder.mesh
    x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16, sharding=sharder.named(("batch", None, None)))
    w = jax.ShapeDtypeStruct((E, D, F), jnp.float32, sharding=NamedSharding(mesh, P()))
    w_down = jax.ShapeDtypeStruct((E, F, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    router = jax.ShapeDtypeStruct((D, E), jnp.float32, sharding=NamedSharding(mesh, P()))

    def loss(x, router, gate, up, down):
        with sharding.use(sharder):
            weights, experts, aux = moe.route(x, router, k)
            y = moe.experts(x, weights, experts, gate, up, down, impl="gmm", interpret=False)
            return y.astype(jnp.float32).sum() + aux

    return _compiled(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, router, w, w, w_down))


def unknown_generation(_: sharding.Sharder, cfg: TrainerConfig) -> dict:
    result = plan.plan(cfg.model_copy(update={"generation": "v2x"}), capacity_gib=96, headroom=0.1)
    return {"verdict": result.verdict, "fits": result.fits, "exit_code": result.exit_code, "message": result.message}


CASES = (splash, megablox, unknown_generation)


def main(config_path: str) -> None:
    cfg = TrainerConfig.model_validate_json(open(config_path).read())
    sharder = _sharder()
    found: dict[str, dict] = {"devices": {"kinds": [d.device_kind for d in sharder.mesh.devices.flat]}}
    for case in CASES:
        try:
            found[case.__name__] = case(sharder, cfg)
        except Exception:
            found[case.__name__] = {"error": traceback.format_exc(limit=3)}
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
