"""How many times each kernel runs in one training step, per remat policy, read from the step's jaxpr
(after dead-code elimination, as XLA would run it): attention kept means attention not recomputed.

The Splash kernel names its residuals (output and logsumexp) `attention_out` inside its shard_map, so
a policy that keeps `attention_out` never reruns the kernel's forward pass in the backward; `full`
and `minimal` rerun it once per layer; keeping only `qkv_proj` keeps the kernel's inputs, not its
output, so its forward runs again (from the kept projections). The grouped matmuls of an MoE layer:
see test_grouped_matmul_runs.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src.interpreters import partial_eval as pe

from tests.workload.blocks import SMALLEST_BLOCKS
from tpu_operator.api.contract import KernelsSpec, ModelDims, RematSpec
from tpu_operator.api.presets import PRESETS
from tpu_workload.model import decoder as model
from tpu_workload.model import moe, sharding

SPLASH_FWD, SPLASH_DKV, SPLASH_DQ = (
    "splash_mha_fwd_residuals",
    "splash_mha_dkv_no_residuals",
    "splash_mha_dq_no_residuals",
)
# An MoE layer the Mosaic grouped matmul takes (every dimension >= 128), one layer.
MOE = dict(
    layers=1, model_dim=128, heads=2, kv_heads=1, head_dim=64, mlp_dim=256, vocab=256, experts=4, experts_per_token=2
)


def kernel_runs(dims: dict, remat: RematSpec, mesh: dict, seq: int = 256) -> Counter:
    """Pallas kernels by name in the jaxpr of one step's loss and gradient, dead code removed; a kernel
    inside the scanned layer counts once (it runs once per layer)."""
    cfg = model.ModelConfig(
        dims=ModelDims(**dims),
        remat=remat,
        interpret=True,
        kernels=KernelsSpec(attention="splash", splash=SMALLEST_BLOCKS, moe_matmul="gmm"),
    )
    sh = sharding.Sharder(sharding.make_mesh(dict(data=1, fsdp=1, context=1, expert=1, tensor=1) | mesh))
    graphdef, params = nnx.split(model.Decoder(cfg, nnx.Rngs(0)))
    tokens = jnp.zeros((8, seq), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(seq), (8, seq))

    def loss(p):
        with sharding.use(sh):
            return model.loss_fn(nnx.merge(graphdef, p), tokens, tokens, pos)[0]

    closed = jax.make_jaxpr(jax.value_and_grad(loss))(params)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return _count(jaxpr, Counter())


def _count(jaxpr, found: Counter) -> Counter:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found[str(eqn.params["name"])] += 1
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _count(sub, found)
    return found


def splash(runs: Counter) -> tuple[int, int, int]:
    return runs[SPLASH_FWD], runs[SPLASH_DKV], runs[SPLASH_DQ]


@pytest.mark.parametrize(
    "remat,forward",
    [
        (RematSpec(policy="none"), 1),
        (RematSpec(policy="full"), 2),
        (RematSpec(policy="minimal"), 2),
        (RematSpec(policy="custom", tensors={"attention_out": "device"}), 1),
        (
            RematSpec(
                policy="custom",
                tensors={
                    "decoder_layer_input": "device",
                    "qkv_proj": "remat",
                    "attention_out": "device",
                    "mlp_in": "remat",
                },
            ),
            1,
        ),
        (RematSpec(policy="custom", tensors={"qkv_proj": "device"}), 2),
    ],
)
def test_splash_forward_runs_once_per_layer_when_attention_is_kept(remat, forward):
    assert splash(kernel_runs(PRESETS["tiny"], remat, dict(fsdp=8))) == (forward, 1, 1)


def test_kept_attention_is_not_recomputed_with_context_parallelism_either():
    """The long-context example's policy, on fsdp 4 x context 2 (the kernel under shard_map with a
    context-sharded, load-balanced mask)."""
    remat = RematSpec(policy="custom", tensors={"decoder_layer_input": "offload", "attention_out": "device"})
    assert splash(kernel_runs(PRESETS["tiny"], remat, dict(fsdp=4, context=2))) == (1, 1, 1)


@pytest.mark.parametrize("remat,forward", [(RematSpec(policy="none"), 3), (RematSpec(policy="full"), 6)])
def test_grouped_matmul_runs(remat, forward, monkeypatch):
    """Gate, up, down: 3 forward and 6 backward (tokens' and weights' gradients) grouped matmuls.

    Under full remat the experts run over slices of F that the backward recomputes one at a time
    (moe._swiglu_in_slices), and the layer's own recomputation skips them (the router weights scale
    the rows inside the experts, so nothing outside needs their output): the jaxpr holds each slice's
    forward twice, the primal and the backward's recomputation (whose down projection is dead: its
    output is not needed; XLA drops it, test_step_costs.py counts what the TPU compile runs)."""
    monkeypatch.setattr(moe, "EXPERT_CHUNK_BYTES", 0)  # sliced, as at full size
    runs = kernel_runs(MOE, remat, dict(fsdp=4, expert=2), seq=128)
    assert runs["gmm_megablox"] == forward, runs
    assert runs["gmm_megablox_transpose_rhs"] == runs["tgmm_megablox"] == 3, runs
