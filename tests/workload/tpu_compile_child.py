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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_operator.api.catalogue import generation
from tpu_operator.api.contract import SplashSpec, TrainerConfig
from tpu_operator.api.spec import RuntimeSpec
from tpu_operator.rendering.libtpu import libtpu_init_args
from tpu_workload.model import attention, moe, sharding
from tpu_workload.performance import plan


def _sharder(**axes) -> sharding.Sharder:
    """A mesh over the 8 devices of a TPU7x 2x2x1 slice (FSDP over what `axes` leave), made by libtpu
    with the pods' v7x flags."""
    os.environ.setdefault("LIBTPU_INIT_ARGS", " ".join(libtpu_init_args(generation("v7x"), RuntimeSpec())))
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags
    devices = plan.topology_devices("v7x", "2x2x1", 1)
    shape = dict(data=1, fsdp=1, context=1, expert=1, tensor=1) | axes
    shape["fsdp"] = 8 // (shape["context"] * shape["expert"] * shape["tensor"])
    return sharding.Sharder(sharding.make_mesh(shape, 1, devices))


def _compiled(lowered) -> dict:
    text = lowered.as_text()  # (the compiled module's text is not asked for: libtpu 0.0.52 fails a RET_CHECK)
    return {
        "custom_call": "tpu_custom_call" in text,  # the Mosaic kernels, not an XLA fallback
        "temp_bytes": lowered.compile().memory_analysis().temp_size_in_bytes,
        "ragged_all_to_all": "ragged_all_to_all" in text,
    }


def _splash(spec: SplashSpec, T: int) -> dict:
    sharder = _sharder()
    B, N, K, H = 8, 8, 2, 128  # GQA
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))

    def loss(q, k, v):
        with sharding.use(sharder):
            return attention.splash_attention(q, k, v, spec=spec, interpret=False).astype(jnp.float32).sum()

    return _compiled(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv))


def splash(_: TrainerConfig) -> dict:
    """JAX's Splash with the default blocks over 1024 tokens: two 512-token blocks."""
    return _splash(SplashSpec(), 1024)


def splash_long(_: TrainerConfig) -> dict:
    """4096 tokens, 8 key/value blocks: JAX's Splash, and tokamax's (maxLogitConst), whose fused
    backward writes one f32 dQ per key/value block."""
    return {"jax": _splash(SplashSpec(), 4096), "tokamax": _splash(SplashSpec(max_logit_const=30.0), 4096)}


def _experts(expert: int, D: int = 256, F: int = 512, E: int = 4) -> dict:
    sharder = _sharder(expert=expert)
    B, T, k = 8, 256, 2
    x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16, sharding=sharder.named(("batch", None, None)))
    w = jax.ShapeDtypeStruct((E, D, F), jnp.float32, sharding=sharder.named(("exp", "embed", "mlp")))
    w_down = jax.ShapeDtypeStruct((E, F, D), jnp.float32, sharding=sharder.named(("exp", "mlp", "embed")))
    router = jax.ShapeDtypeStruct((D, E), jnp.float32, sharding=NamedSharding(sharder.mesh, P()))
    mm = moe.Matmul(impl="gmm", interpret=False)

    def loss(x, router, gate, up, down):
        with sharding.use(sharder):
            weights, experts, aux = moe.route(x, router, k)
            y = moe.experts(x, weights, experts, gate, up, down, mm=mm)
            return y.astype(jnp.float32).sum() + aux

    return _compiled(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, router, w, w, w_down))


def megablox(_: TrainerConfig) -> dict:
    """The experts on tokamax's Mosaic grouped matmul, FSDP only (every expert on every device)."""
    return _experts(1)


def expert_parallel(_: TrainerConfig) -> dict:
    """Expert parallelism 2 and 4 (fsdp 4 and 2): rows exchanged by ragged all-to-all."""
    return {"expert2": _experts(2), "expert4": _experts(4)}


def expert_degree_growth(_: TrainerConfig) -> dict:
    """8 experts (top 2), 256 tokens a device, D 128 and F 2048, at expert 2 and 4: the receive buffer
    doubles (1024 -> 2048 rows); the [rows, F] activations are sliced along F to the size of a device's own 512 rows'."""
    moe.EXPERT_CHUNK_BYTES = 0  # sliced, as at full size (this child runs one case at a time)
    return {"expert2": _experts(2, D=128, F=2048, E=8), "expert4": _experts(4, D=128, F=2048, E=8)}


def unknown_generation(cfg: TrainerConfig) -> dict:
    result = plan.plan(cfg.model_copy(update={"generation": "v2x"}), capacity_gib=96, headroom=0.1)
    return {"verdict": result.verdict, "fits": result.fits, "exit_code": result.exit_code, "message": result.message}


CASES = (splash, splash_long, megablox, expert_parallel, expert_degree_growth, unknown_generation)


def main(config_path: str) -> None:
    cfg = TrainerConfig.model_validate_json(open(config_path).read())
    found: dict[str, dict] = {"devices": {"kinds": [d.device_kind for d in _sharder().mesh.devices.flat]}}
    for case in CASES:
        try:
            found[case.__name__] = case(cfg)
        except Exception:
            found[case.__name__] = {"error": traceback.format_exc(limit=3)}
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
