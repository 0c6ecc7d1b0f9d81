"""precision fp8 covers the MoE experts: qwix's quantised ragged_dot in the expert matmuls.

The MoE layer's gradient jaxpr holds fp8 ragged_dots (never Megablox), and a tiny MoE trains
under fp8. (Closeness to the reference, with and without expert parallelism: test_kernels.py.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import trainer_config
from tpu_workload import model, train


def _eqns(jaxpr):
    """Every equation, inside shard_map / jit / scan bodies too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


@pytest.mark.parametrize("moe_matmul", ["ragged_dot", "gmm"])
def test_fp8_reaches_the_expert_matmuls(moe_matmul):
    def primitives(precision):
        mcfg = train.model_config(trainer_config("tiny-moe", precision=precision, moe=moe_matmul), interpret=True)
        layer = model.MoE(mcfg, nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(0), (2, 16, mcfg.dims.model_dim)).astype(jnp.bfloat16)

        def loss(layer, x):
            return jnp.sum(layer(x)[0].astype(jnp.float32) ** 2)

        jaxpr = jax.make_jaxpr(nnx.grad(loss, argnums=(0, 1)))(layer, x).jaxpr
        eqns = list(_eqns(jaxpr))
        dots = [tuple(v.aval.dtype.name for v in e.invars[:2])
                for e in eqns if e.primitive.name == "ragged_dot_general"]
        return dots, {e.primitive.name for e in eqns}

    dots, names = primitives("fp8")
    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    # gate, up, down forward on e4m3; each backward: an e5m2 gradient against an e4m3 operand.
    assert sorted(dots) == sorted([(e4, e4)] * 3 + [(e5, e4), (e4, e5)] * 3), dots
    assert "pallas_call" not in names  # Megablox takes no fp8 operands, whatever moe_matmul says
    dots, names = primitives("bf16")
    assert not any("float8" in t for d in dots for t in d), dots
    assert (moe_matmul == "gmm") == ("pallas_call" in names)


def test_fp8_moe_loss_falls(capsys):
    cfg = trainer_config("tiny-moe", mesh=dict(data=1, fsdp=4, context=1, expert=2, tensor=1), steps=6,
                         precision="fp8")
    train.run(cfg, peak_flops_per_device=5e10)
    losses = {r["step"]: r["loss"] for r in map(json.loads, capsys.readouterr().out.splitlines())
              if not r.get("summary")}
    assert min(losses[5], losses[6]) < losses[1] - 0.5, losses  # measured: 6.07 -> 5.19, 4.62
