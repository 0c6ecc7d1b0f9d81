"""The chunked cross entropy equals the whole-vocabulary one: the loss to f32 rounding, the gradients of
everything but the unembedding bit for bit, the unembedding's within bf16 rounding (its gradient is
summed over chunks in f32 instead of rounded to bf16 once)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import trainer_config
from tpu_operator.api.contract import KernelsSpec, ModelDims, RematSpec
from tpu_workload import model as model_lib, sharding, train


@pytest.mark.parametrize("context", [1, 2])
def test_chunked_cross_entropy_matches_the_whole_vocabulary(context):
    dims = ModelDims(layers=2, model_dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=512)
    base = model_lib.ModelConfig(dims=dims, kernels=KernelsSpec(attention="xla"), remat=RematSpec(policy="full"))
    sh = sharding.Sharder(sharding.make_mesh(dict(data=1, fsdp=8 // context, context=context, expert=1, tensor=1)))
    params = nnx.split(model_lib.Decoder(base, nnx.Rngs(0)))[1].to_pure_dict()
    rng = np.random.default_rng(1)
    tokens_BT = jnp.asarray(rng.integers(0, dims.vocab, (8, 256), dtype=np.int32))
    targets_BT = jnp.roll(tokens_BT, -1, axis=1)
    pos_BT = jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32), (8, 256))

    def value_and_grad(chunks):
        graphdef = nnx.split(model_lib.Decoder(dataclasses.replace(base, loss_chunks=chunks), nnx.Rngs(0)))[0]

        @jax.jit
        def f(p):
            with sharding.use(sh):
                return jax.value_and_grad(
                    lambda q: model_lib.loss_fn(nnx.merge(graphdef, q), tokens_BT, targets_BT, pos_BT)[0])(p)

        return f(params)

    loss1, grads1 = value_and_grad(1)
    loss4, grads4 = value_and_grad(4)
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-6)
    for (path, g1), g4 in zip(jax.tree_util.tree_flatten_with_path(grads1)[0], jax.tree.leaves(grads4)):
        g1, g4 = np.asarray(g1), np.asarray(g4)
        tol = 2**-7 * np.abs(g1).max() if "unembed" in jax.tree_util.keystr(path) else 0
        np.testing.assert_allclose(g4, g1, rtol=0, atol=tol, err_msg=jax.tree_util.keystr(path))


def test_loss_chunks_bound_the_logits_per_device():
    cfg = trainer_config("tiny", batch=8, seq=128)
    assert train.loss_chunks(cfg) == 1  # 8 x 128 x 256 f32 logits: far under the bound, the unchunked path
    big = cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"vocab": 128256}),
        "training": cfg.training.model_copy(update={"global_batch": 256, "sequence_length": 8192}),
        "mesh": cfg.mesh.model_copy(update={"fsdp": 128})})
    assert train.loss_chunks(big) == 4  # Llama-3-8B on v7x 4x4x4: 2 x 8192 x 128256 x 4 B = 7.8 GiB -> 4 chunks
