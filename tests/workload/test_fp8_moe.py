"""precision fp8 covers the MoE experts: the Mosaic grouped matmul on fp8 operands (moeMatmul gmm),
qwix's quantised ragged_dot on the reference path (ragged_dot).

The MoE layer's gradient jaxpr holds the fp8 kernels, forward and backward, and a tiny MoE trains
under fp8. (Closeness to the reference, with and without expert parallelism: test_kernels.py.)
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from conftest import trainer_config
from flax import nnx

from tpu_operator.api.contract import ModelDims
from tpu_workload.loop import train
from tpu_workload.model import decoder as model


def _eqns(jaxpr):
    """Every equation, inside shard_map / jit / scan bodies too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


# One MoE layer wide enough for the Mosaic kernel (every dimension >= 128).
WIDE_MOE = dict(
    layers=1, model_dim=128, heads=2, kv_heads=1, head_dim=64, mlp_dim=256, vocab=256, experts=4, experts_per_token=2
)


def _moe_gradient_eqns(moe_matmul: str, precision: str) -> list:
    cfg = trainer_config("tiny-moe", precision=precision, moe=moe_matmul)
    mcfg = dataclasses.replace(train.model_config(cfg, interpret=True), dims=ModelDims(**WIDE_MOE))
    layer = model.MoE(mcfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 128, mcfg.dims.model_dim)).astype(jnp.bfloat16)

    def loss(layer, x):
        return jnp.sum(layer(x)[0].astype(jnp.float32) ** 2)

    return list(_eqns(jax.make_jaxpr(nnx.grad(loss, argnums=(0, 1)))(layer, x).jaxpr))


def _operand_types(eqns, primitive: str) -> list[tuple[str, ...]]:
    return [
        tuple(sorted({v.aval.dtype.name for v in e.invars if "float" in v.aval.dtype.name}))
        for e in eqns
        if e.primitive.name == primitive
    ]


def test_fp8_reaches_the_reference_expert_matmuls():
    dots = [t for t in _operand_types(_moe_gradient_eqns("ragged_dot", "fp8"), "ragged_dot_general")]
    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    # gate, up, down forward on e4m3; each backward: an e5m2 gradient against an e4m3 operand.
    assert sorted(dots) == sorted([(e4,)] * 3 + [(e4, e5)] * 6), dots


def test_fp8_runs_the_mosaic_grouped_matmul_on_fp8_operands_forward_and_backward():
    eqns = _moe_gradient_eqns("gmm", "fp8")
    kernels = _operand_types(eqns, "pallas_call")
    # gate, up, down: forward, tokens' gradient and weights' gradient, each a Mosaic kernel on e4m3
    # operands (quantised per row, and per expert and column), never XLA's ragged_dot instead.
    assert len(kernels) == 9 and all("float8_e4m3fn" in k for k in kernels), kernels
    assert not any(e.primitive.name == "ragged_dot_general" for e in eqns)
    bf16 = _operand_types(_moe_gradient_eqns("gmm", "bf16"), "pallas_call")
    assert len(bf16) == 9 and not any("float8" in t for k in bf16 for t in k), bf16


@pytest.mark.long  # six fp8 steps of the MoE model compiled and run (about 40 s); the fp8 matmuls above are quick
def test_fp8_moe_loss_falls(capsys):
    cfg = trainer_config("tiny-moe", mesh=dict(data=1, fsdp=4, context=1, expert=2, tensor=1), steps=6, precision="fp8")
    train.run(cfg, peak_flops_per_device=5e10)
    losses = {
        r["step"]: r["loss"] for r in map(json.loads, capsys.readouterr().out.splitlines()) if not r.get("summary")
    }
    assert min(losses[5], losses[6]) < losses[1] - 0.5, losses  # measured: 6.07 -> 5.19, 4.62
