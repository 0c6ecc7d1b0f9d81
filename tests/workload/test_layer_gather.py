"""On the CPU a layer's weights are gathered in one collective per pass, as bf16 bits, with the same
loss and gradients as XLA's own gathers (model/layer_gather.py).

The decoder's loss and gradients on 8 CPU devices, parameters sharded as the trainer shards them (FSDP,
and FSDP x context), with the hand-made gather and without it (layer_gather.gathered answering None,
which leaves the collectives to XLA), under remat none and full: the same loss, bit for bit (the same
bf16 weights meet the same activations), and gradients as close to the same model computed in f32 as
XLA's are (XLA, allowed excess precision, skips some of the bf16 roundings of a weight's gradient
before its all-reduce, so the two differ by a bf16 rounding here and there, each about 1% off f32). And the compiled step itself:
each pass over the layers (the forward, and the backward's recomputation) all-gathers once, 16-bit words,
where XLA alone gathered each weight in f32.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tpu_operator.api.contract import KernelsSpec, ModelDims, RematSpec
from tpu_workload.model import decoder as model_lib
from tpu_workload.model import layer_gather, sharding

DIMS = ModelDims(layers=2, model_dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256)
MESHES = {"fsdp": dict(fsdp=8), "fsdp-context": dict(fsdp=4, context=2)}


def step(remat: str, mesh: dict[str, int], compute: str = "bf16"):
    """(jitted loss-and-gradients, sharded parameters) of a small decoder on 8 CPU devices."""
    cfg = model_lib.ModelConfig(
        dims=DIMS, kernels=KernelsSpec(attention="xla"), remat=RematSpec(policy=remat), compute=compute
    )
    sh = sharding.Sharder(sharding.make_mesh(dict(data=1, fsdp=1, context=1, expert=1, tensor=1) | mesh))
    graphdef, state = nnx.split(model_lib.Decoder(cfg, nnx.Rngs(0)))
    logical = nnx.get_partition_spec(state).to_pure_dict()
    params = jax.tree.map(
        lambda spec, a: jax.device_put(a, sh.named(tuple(spec), a.shape)),
        logical,
        state.to_pure_dict(),
        is_leaf=lambda x: isinstance(x, P),
    )
    seq = 64
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, DIMS.vocab, (8, seq), dtype=np.int32))
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (8, seq))

    @jax.jit
    def f(p):
        with sharding.use(sh):
            loss = lambda q: model_lib.loss_fn(nnx.merge(graphdef, q), tokens, jnp.roll(tokens, -1, 1), pos)[0]  # noqa: E731
            return jax.value_and_grad(loss)(p)

    return f, params


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("remat", ["none", "full"])
def test_one_gather_per_layer_gives_the_loss_and_gradients_of_xlas_gathers(remat, mesh, monkeypatch):
    f, params = step(remat, MESHES[mesh])
    loss, grads = f(params)
    with monkeypatch.context() as m:
        m.setattr(layer_gather, "gathered", lambda *a: None)
        xla_loss, xla_grads = step(remat, MESHES[mesh])[0](params)
    _, exact = step(remat, MESHES[mesh], compute="f32")[0](params)
    assert float(loss) == float(xla_loss)
    for (path, g), g_xla, g_f32 in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(xla_grads), jax.tree.leaves(exact)
    ):
        ours, theirs = (np.linalg.norm(np.asarray(a) - g_f32) / np.linalg.norm(g_f32) for a in (g, g_xla))
        assert ours < 0.02 and ours <= 1.25 * theirs, (jax.tree_util.keystr(path), ours, theirs)


def _gathers_in_loops(hlo: str) -> list[str]:
    """The result types of the all-gathers inside the layer loops' bodies (not the LM head's tile loop)."""
    found = re.findall(r"= (\w+)\[[\d,]*\]\{[^}]*\} all-gather\([^\n]*op_name=\"([^\"]*)\"", hlo)
    return [kind for kind, op in found if "while/body" in op and "lm_head_loss" not in op]


def test_each_pass_gathers_the_layer_once_as_16_bit_words(monkeypatch):
    f, params = step("full", MESHES["fsdp"])
    ours = _gathers_in_loops(f.lower(params).compile().as_text())
    assert ours == ["u16", "u16"], ours  # the forward pass, and the backward's recomputation of the layer
    monkeypatch.setattr(layer_gather, "gathered", lambda *a: None)
    xla = _gathers_in_loops(step("full", MESHES["fsdp"])[0].lower(params).compile().as_text())
    assert len(xla) == 2 * 7 and set(xla) == {"f32"}, xla  # each of the 7 matrices, per pass, in f32
