"""precision fp8 covers the MoE experts: qwix's quantised ragged_dot in the expert matmuls.

The fp8 experts stay close to the reference, forward and gradients, with and without expert
parallelism; the MoE layer's gradient jaxpr holds fp8 ragged_dots (never Megablox); a tiny MoE
trains under fp8.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import trainer_config
from tpu_workload import model, moe, sharding, train

# Measured relative errors (Frobenius) of e4m3 forward / e5m2 gradients against the reference:
# forward 0.061-0.063, gradients 0.073-0.089.
FORWARD_RTOL, GRAD_RTOL = 0.1, 0.15


def _mesh(**axes):
    shape = dict(dict(data=1, fsdp=1, context=1, expert=1, tensor=1), **axes)
    shape["fsdp"] = 8 // int(np.prod(list(shape.values())))
    return sharding.Sharder(sharding.make_mesh(shape))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("impl,axes", [("ragged_dot", {}), ("gmm", dict(expert=2)),
                                       ("ragged_dot", dict(context=2, expert=2)), ("gmm", dict(expert=4, tensor=2))])
def test_fp8_experts_close_to_reference(impl, axes):
    B, T, D, F, E, top = 8, 32, 64, 128, 4, 2
    ks = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(ks[0], (B, T, D))
    router = jax.random.normal(ks[1], (D, E))
    gate, up = (0.1 * jax.random.normal(k, (E, D, F)) for k in ks[2:4])
    down = 0.1 * jax.random.normal(ks[4], (E, F, D))
    ct = jax.random.normal(ks[5], (B, T, D))
    sh = _mesh(**axes) if axes else None

    def value_and_grads(fn):
        def f(x, gate, up, down):
            weights, experts, _ = moe.route(x, router, top)
            with sharding.use(sh):
                return fn(x, weights, experts, gate, up, down)
        out, vjp = jax.vjp(jax.jit(f), x, gate, up, down)
        return [out, *vjp(ct)]

    want = value_and_grads(moe.reference_experts)
    got = value_and_grads(lambda *a: moe.experts(*a, impl=impl, interpret=True, fp8=True))
    errors = [_rel(g, w) for g, w in zip(got, want)]
    assert 0.01 < errors[0] < FORWARD_RTOL, errors  # > 0.01: quantised, not the bf16 path
    assert all(0.01 < e < GRAD_RTOL for e in errors[1:]), errors


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
