"""The tiled cross entropy's hand-written gradient equals autodiff's, and tiles change nothing but sums.

The LM head and loss run over sequence chunks by vocabulary tiles with a backward written by hand
(loss.py: an online logsumexp over tiles; the softmax gradient from the saved logsumexp, rounded to
bf16 once before both matmuls, as the bf16 logits' cast rounds it under autodiff). It equals autodiff
of the plain whole-vocabulary cross entropy within bf16 rounding; and 4 chunks x 4 tiles equal 1 x 1:
the loss to f32 rounding, the gradients within bf16 rounding (the softmax, summed online over tiles,
rounds to bf16 a little differently; each chunk's share of the unembedding's gradient is rounded to
bf16 before it is summed across devices, as autodiff rounds a bf16 weight's gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import loss_and_grads, trainer_config

from tpu_operator.api.contract import KernelsSpec, ModelDims, RematSpec
from tpu_workload.loop import train
from tpu_workload.model import decoder as model_lib
from tpu_workload.model import loss, sharding


@pytest.mark.parametrize("context", [1, 2])
def test_tiled_cross_entropy_matches_the_whole_head(context):
    dims = ModelDims(layers=2, model_dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=512)
    base = model_lib.ModelConfig(dims=dims, kernels=KernelsSpec(attention="xla"), remat=RematSpec(policy="full"))
    sh = sharding.Sharder(sharding.make_mesh(dict(data=1, fsdp=8 // context, context=context, expert=1, tensor=1)))
    value_and_grad = loss_and_grads(base, sh, 256)

    loss1, grads1 = value_and_grad(loss_chunks=1, vocab_tiles=1)
    loss4, grads4 = value_and_grad(loss_chunks=4, vocab_tiles=4)
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-6)
    for (path, g1), g4 in zip(jax.tree_util.tree_flatten_with_path(grads1)[0], jax.tree.leaves(grads4)):
        g1, g4 = np.asarray(g1), np.asarray(g4)
        assert np.linalg.norm(g4 - g1) <= 2**-7 * np.linalg.norm(g1), jax.tree_util.keystr(path)


@pytest.mark.parametrize("tiles", [1, 4])
def test_the_hand_written_gradient_equals_autodiff_of_the_plain_cross_entropy(tiles):
    """[2, 4, 128] hidden states in 2 chunks, a 512-word vocabulary in `tiles` tiles: loss and both
    gradients against jax.grad of logits -> log-softmax with bf16 logits cast to f32 (autodiff's own
    bf16 rounding)."""
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (2, 4, 128), jnp.float32).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(ks[1], (128, 512), jnp.float32)
    targets = jax.random.randint(ks[2], (2, 4), 0, 512)

    def plain(x, w):
        logits = jnp.einsum("btd,dv->btv", x, w.astype(jnp.bfloat16)).astype(jnp.float32)
        return jnp.mean(loss.token_losses(logits, targets))

    def tiled(x, w):
        return loss.cross_entropy(x, targets, w, chunks=2, tiles=tiles)[0]

    (l0, g0), (l1, g1) = (jax.value_and_grad(f, argnums=(0, 1))(x, w) for f in (plain, tiled))
    np.testing.assert_allclose(float(l1), float(l0), rtol=2**-7)  # the plain logits are rounded to bf16
    for a, b in zip(g1, g0):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2**-7 * np.linalg.norm(b)


@pytest.mark.parametrize("tiles", [1, 4])
def test_masked_tokens_and_the_z_loss_have_the_gradient_of_their_definition(tiles):
    """Packing masks padding and documents' last tokens out of the loss; the z-loss adds a weighted
    mean of logsumexp^2. Both, through the hand-written backward, against jax.grad of the definition:
    sum(mask * ce) / sum(mask) + 0.5 * sum(mask * logz^2) / sum(mask)."""
    ks = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(ks[0], (2, 8, 128), jnp.float32).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(ks[1], (128, 512), jnp.float32)
    targets = jax.random.randint(ks[2], (2, 8), 0, 512)
    mask = (jax.random.uniform(ks[3], (2, 8)) > 0.4).astype(jnp.float32)

    def plain(x, w):
        logits = jnp.einsum("btd,dv->btv", x, w.astype(jnp.bfloat16)).astype(jnp.float32)
        logz = jax.nn.logsumexp(logits, axis=-1)
        n = jnp.sum(mask)
        return jnp.sum(mask * loss.token_losses(logits, targets)) / n + 0.5 * jnp.sum(mask * logz**2) / n

    def tiled(x, w):
        ce, z = loss.cross_entropy(x, targets, w, chunks=2, tiles=tiles, mask_BT=mask, z_loss=True)
        return ce + 0.5 * z

    (l0, g0), (l1, g1) = (jax.value_and_grad(f, argnums=(0, 1))(x, w) for f in (plain, tiled))
    np.testing.assert_allclose(float(l1), float(l0), rtol=2**-7)
    for a, b in zip(g1, g0):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2**-7 * np.linalg.norm(b)
    # A masked-out token's hidden state gets no gradient at all.
    dx = np.asarray(g1[0], np.float32)
    assert np.all(dx[np.asarray(mask) == 0] == 0) and np.any(dx[np.asarray(mask) == 1] != 0)


def test_tiles_then_chunks_bound_the_logits_and_the_weight_per_device():
    cfg = trainer_config("tiny", batch=8, seq=128)
    assert train.loss_tiling(cfg) == (1, 1)  # far under both bounds: the whole head
    big = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update={"vocab": 128256, "model_dim": 4096}),
            "training": cfg.training.model_copy(update={"global_batch": 256, "sequence_length": 8192}),
            "mesh": cfg.mesh.model_copy(update={"fsdp": 128}),
        }
    )
    # Llama-3-8B on v7x 4x4x4: a device's 2 x 8192 tokens x 128256 words of f32 logits (7.8 GiB) in 16
    # vocabulary tiles of 8016 words (501 MiB), each over the whole sequence: no sequence chunks.
    assert train.loss_tiling(big) == (1, 16)
    # Tensor parallelism splits each tile's words: with the same tokens per device, 8 tiles do it.
    tp = big.model_copy(
        update={
            "mesh": big.mesh.model_copy(update={"fsdp": 64, "tensor": 2}),
            "training": big.training.model_copy(update={"global_batch": 128}),
        }
    )
    assert train.loss_tiling(tp) == (1, 8)
    # A vocabulary the tiles cannot split further: chunks of the sequence then.
    odd = big.model_copy(update={"model": big.model.model_copy(update={"vocab": 128257})})
    assert train.loss_tiling(odd) == (16, 1)
    assert not train.keeps_logits(big) and not train.keeps_logits(odd)  # never past the tiles' bounds


@pytest.mark.parametrize("masked", [False, True])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit(masked):
    """A small head keeps its logits for the backward (one head matmul fewer per step); the backward
    then reads the very values it would have recomputed, so loss and gradients are the same bits."""
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (2, 8, 128), jnp.float32).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(ks[1], (128, 512), jnp.float32)
    targets = jax.random.randint(ks[2], (2, 8), 0, 512)
    mask = (jax.random.uniform(ks[3], (2, 8)) > 0.4).astype(jnp.float32) if masked else None

    def head(keep):
        def f(x, w):
            ce, z = loss.cross_entropy(x, targets, w, chunks=1, tiles=1, mask_BT=mask, z_loss=masked, keep=keep)
            return ce + 0.5 * z

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)

    (l0, g0), (l1, g1) = head(False), head(True)
    assert float(l1) == float(l0)
    for a, b in zip(g1, g0):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert train.keeps_logits(trainer_config("tiny", batch=8, seq=128))
    with pytest.raises(ValueError, match="whole head"):
        loss.cross_entropy(x, targets, w, chunks=2, tiles=1, keep=True)
