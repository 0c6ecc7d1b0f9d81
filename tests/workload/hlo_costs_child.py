"""The TPU compiles of test_hlo_costs_tpu.py, in a child process of their own (libtpu must not be loaded
into the pytest process: see tpu_compile_child.py). Each case is compiled for TPU7x by libtpu, its
optimized module dumped by XLA and walked by hlo_costs; the child prints one JSON object of the costs
each case found (or the error it raised) for the tests to compare with their hand counts.

    python -m tests.workload.hlo_costs_child DUMP_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback

DUMP = sys.argv[1] if __name__ == "__main__" else ""
# Read once by XLA, before the first compile: dump every case's optimized module.
os.environ["XLA_FLAGS"] = f"--xla_dump_to={DUMP} --xla_dump_hlo_module_re=.*hlo_costs_.*"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests.workload.tpu_compile_child import _sharder  # noqa: E402
from tpu_operator.api.contract import SplashSpec  # noqa: E402
from tpu_workload.model import attention, moe, sharding  # noqa: E402
from tpu_workload.performance import hlo_costs, plan  # noqa: E402

LAYERS, OUTER, INNER, B, D = 4, 2, 3, 256, 1024  # B rows over the 8 devices of a 2x2x1 slice
# Splash: per device one sequence of T tokens, N query heads, K key/value heads, head dim H.
T, N, K, H = 1024, 8, 2, 128
# Grouped matmul: per device M rows over G groups, K_ inner, N_ outer.
M, G, K_, N_ = 1024, 4, 256, 512


def _walked(name: str, fn, *args) -> dict:
    """`fn` compiled for TPU7x under the name hlo_costs_<name>, its dumped module walked."""
    fn.__name__ = f"hlo_costs_{name}"
    jax.jit(fn).lower(*args).compile()
    path = hlo_costs.step_module(DUMP, f"*jit_hlo_costs_{name}.*")
    costs = hlo_costs.dump_costs(DUMP, f"*jit_hlo_costs_{name}.*")
    text = open(path).read()
    return {
        **costs.summary(),
        "matmul_flops": costs.matmul_flops,
        "kernel_flops": costs.kernel_flops,
        "ici_bytes": costs.ici_bytes,
        "dcn_bytes": costs.dcn_bytes,
        "kernel_calls": costs.kernel_calls,
        "gathers": sorted(s.count for s in costs.top("ici", 50) if s.what.startswith("all-gather")),
        "known_trip_count_in_module": "known_trip_count" in text,
        "while_loops": text.count(" while("),
    }


def _mesh(slices: int = 1, topology: str = "2x2x1") -> Mesh:
    _sharder()  # sets the pods' v7x flags before libtpu's first topology
    return Mesh(np.array(plan.topology_devices("v7x", topology, slices)).reshape(slices, -1), ("data", "fsdp"))


def _gather(mesh, w):
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))


def scan() -> dict:
    """LAYERS [D, D] bf16 weights, FSDP-sharded, each gathered in the scan's body for x @ w."""
    mesh = _mesh()

    def step(w, x):
        return jax.lax.scan(lambda x, w_i: (jnp.tanh(x @ _gather(mesh, w_i)), None), x, w)[0].astype(jnp.float32).sum()

    w = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp", None)))
    x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    return _walked("scan", step, w, x)


def nested() -> dict:
    """OUTER x INNER layers in nested scans, each inner weight gathered in the inner body."""
    mesh = _mesh()

    def step(w, x):
        def block(x, w_j):
            return jax.lax.scan(lambda x, w_i: (jnp.tanh(x @ _gather(mesh, w_i)), None), x, w_j)[0], None

        return jax.lax.scan(block, x, w)[0].astype(jnp.float32).sum()

    w = jax.ShapeDtypeStruct(
        (OUTER, INNER, D, D), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "fsdp", None))
    )
    x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    return _walked("nested", step, w, x)


def windowed() -> dict:
    """x @ w over 16 devices (2x2x2), w FSDP-sharded on its rows, no constraint: the TPU compiler fuses the
    gather of w with the matmul (a windowed einsum: a loop of collective-permutes and partial matmuls)."""
    mesh = _mesh(topology="2x2x2")

    def step(w, x):
        return jnp.tanh(x @ w).astype(jnp.float32).sum()

    w = jax.ShapeDtypeStruct((D, 4 * D), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    x = jax.ShapeDtypeStruct((16 * 1024, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    return _walked("windowed", step, w, x)


def two_slices() -> dict:
    """Data parallel over two slices: each device's [D, D] f32 gradient summed across the slices (DCN)."""
    mesh = _mesh(slices=2)

    def step(w, x):
        return jax.lax.with_sharding_constraint(jnp.einsum("bd,be->de", x, x) + w, NamedSharding(mesh, P()))

    w = jax.ShapeDtypeStruct((D, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))
    return _walked("two_slices", step, w, x)


def splash() -> dict:
    """JAX's Splash forward and backward (the trainer's wrapper), causal, one sequence per device."""
    sharder = _sharder()
    q = jax.ShapeDtypeStruct((8, T, N, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))
    kv = jax.ShapeDtypeStruct((8, T, K, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))

    def loss(q, k, v):
        with sharding.use(sharder):
            return attention.splash_attention(q, k, v, spec=SplashSpec(), interpret=False).astype(jnp.float32).sum()

    return _walked("splash", jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)


def grouped_matmul() -> dict:
    """tokamax's Mosaic grouped matmul (the trainer's `gmm`) forward and backward, M rows a device."""
    mesh = _mesh()
    mm = moe.Matmul(impl="gmm", interpret=False)

    def loss(lhs, rhs):
        def local(lhs, rhs):
            sizes = jnp.full((G,), M // G, jnp.int32)
            return jnp.square(moe.grouped_matmul(lhs, rhs, sizes, mm).astype(jnp.float32)).sum()[None]

        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(("data", "fsdp")), P()), out_specs=P(("data", "fsdp")), check_vma=False
        )(lhs, rhs).sum()

    lhs = jax.ShapeDtypeStruct((8 * M, K_), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    rhs = jax.ShapeDtypeStruct((G, K_, N_), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    return _walked("grouped_matmul", jax.grad(loss, argnums=(0, 1)), lhs, rhs)


CASES = (scan, nested, windowed, two_slices, splash, grouped_matmul)


def main() -> None:
    found: dict[str, dict] = {}
    for case in CASES:
        try:
            found[case.__name__] = case()
        except Exception:
            found[case.__name__] = {"error": traceback.format_exc(limit=4)}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
