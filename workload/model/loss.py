"""The LM head and cross entropy, tiled over the sequence and the vocabulary, with a hand-written backward.

Dimension letters: B batch, T length, D model dim, V vocab; N sequence chunks of t tokens, J vocab
tiles of v = V / J words.

Every device holds its tokens' hidden states and a D-shard of the unembedding [D, V] (FSDP). Computed
whole, the loss holds [b, T, V] f32 logits per device (7.8 GiB for Llama 3 at 16k tokens) and, in its
gradient, several gathered [D, V] copies of the weight (1 GiB each in bf16: XLA keeps one per matmul
layout) plus its [D, V] gradient. Here the head runs one vocabulary tile at a time (the words v = a J
+ j of tile j, interleaved so a tensor-sharded vocabulary stays evenly split), and within a tile one
sequence chunk at a time (one chunk, the whole sequence, unless the tiles cannot shrink enough:
`tiling`): one gathered tile of the weight and one chunk's logits exist at a time. The
forward keeps an online logsumexp per token across tiles (running max and sum, as flash attention
does) and the target's logit; the backward recomputes each chunk's logits from the saved logsumexp,
rounds the softmax gradient to bf16 once (as autodiff rounds bf16 logits' cotangent) for both
matmuls, accumulates the hidden states' gradient in f32 across tiles, and scatters each chunk's
weight gradient straight to the parameter's shards (bf16, as autodiff does for a bf16 weight).

Per-token losses are exactly those of the whole head; only the order of f32 sums changes. Each
sequence chunk stays sharded as the sequence is (chunked.split_sequence). The head's matmuls run in the
hidden states' dtype: bf16 in training, also under fp8 (as MaxText's head does); f32 for a model computed
in f32 (decoder.ModelConfig.compute).

Where the whole head runs at once (one chunk, one tile) and its f32 logits are small (`logits_kept`),
the forward keeps them for the backward instead of recomputing them: three head matmuls per step, not
four, for what autodiff would have kept anyway. The kept logits are the very values the backward would
recompute, so the gradients are the same bits. The weight gathered for them is kept too: one gather per
step, not two (on the CPU through layer_gather, whose one collective of bf16 bits XLA:CPU would make f32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import chunked, layer_gather
from .sharding import constrain, current

# One chunk's f32 logits tile and one gathered bf16 weight tile per device stay under these.
LOGITS_TILE_BYTES = 512 << 20
WEIGHT_TILE_BYTES = 256 << 20
# Whole-head f32 logits per device up to this are kept for the backward rather than recomputed (a
# quarter of the head's FLOPs): small models' heads, never a large vocabulary at a long sequence.
KEPT_LOGITS_BYTES = 64 << 20


def token_losses(logits_BTV, targets_BT):
    """Per-token cross entropy (f32) of whole logits: the definition."""
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logz_BT - target_logit_BT


def logits(x_BTD, w_DV):
    """f32 logits of hidden states against the (f32) unembedding, in bf16 matmuls."""
    return _logits(x_BTD, _gathered(w_DV, x_BTD.dtype))


def tiling(batch: int, local_seq: int, model_dim: int, vocab: int, tensor: int = 1) -> tuple[int, int]:
    """(sequence chunks, vocabulary tiles) of one device's head: one gathered bf16 tile of the weight
    under WEIGHT_TILE_BYTES and one chunk's f32 logits tile under LOGITS_TILE_BYTES.

    Tiles first (powers of two dividing the vocabulary, each tile's words split evenly over `tensor`,
    at least 128 per device): a tile over the whole sequence is gathered once per pass and its weight
    gradient is complete when the tile is done, so it is reduced to the weight's shards once. Within
    a tile, sequence chunks would reduce each chunk's share of that gradient on its own, and XLA sinks
    the tile's gather into the chunk loop (measured on the 8B: 16 gathers of each tile's [4096, 32064]
    in the forward pass, for 4 tiles x 4 chunks), so chunks are the last resort, where the tiles cannot
    shrink further: Llama 3 8B's 2 x 8192 tokens per device run in 16 tiles of 8016 words (501 MiB of
    logits, 63 MiB of weight), Mixtral's 8192 in 2 tiles of 16000.
    """
    per_device = vocab // tensor

    def logits_too_big(tiles: int, chunks: int) -> bool:
        return batch * (local_seq // chunks) * (per_device // tiles) * 4 > LOGITS_TILE_BYTES

    tiles = 1
    while (
        (model_dim * vocab // tiles * 2 > WEIGHT_TILE_BYTES or logits_too_big(tiles, 1))
        and vocab % (2 * tiles * tensor) == 0
        and per_device // (2 * tiles) >= 128
    ):
        tiles *= 2
    chunks = 1
    while logits_too_big(tiles, chunks) and local_seq % (2 * chunks) == 0 and local_seq // (2 * chunks) >= 128:
        chunks *= 2
    return chunks, tiles


def logits_kept(batch: int, local_seq: int, vocab: int, tensor: int, chunks: int, tiles: int) -> bool:
    """Whether one device's head keeps its logits for the backward (the module docstring): the whole
    head at once, its f32 logits under KEPT_LOGITS_BYTES."""
    return chunks == tiles == 1 and batch * local_seq * (vocab // tensor) * 4 <= KEPT_LOGITS_BYTES


def cross_entropy(
    x_BTD, targets_BT, w_DV, *, chunks: int, tiles: int, mask_BT=None, z_loss: bool = False, keep: bool = False
):
    """(mean next-token cross entropy, mean z-loss) of hidden states `x_BTD` (bf16) under the
    unembedding `w_DV` (the f32 parameter), `chunks` sequence chunks by `tiles` vocabulary tiles at a
    time. `mask_BT` (f32, 1 where a target counts; None: all do) weights the tokens; the means are over
    the tokens that count. The z-loss is logsumexp(logits)^2 per token (PaLM's; 0 unless `z_loss`).
    `keep` (one chunk and one tile only; `logits_kept`): the backward reuses the forward's logits."""
    if w_DV.shape[1] % tiles:
        raise ValueError(f"vocabulary {w_DV.shape[1]} does not split into {tiles} tiles")
    if keep and (chunks, tiles) != (1, 1):
        raise ValueError(f"logits are kept only for the whole head at once, not {chunks} chunks x {tiles} tiles")
    x_NBtD, targets_NBt = (chunked.split_sequence(a, chunks) for a in (x_BTD, targets_BT))
    mask_NBt = None if mask_BT is None else chunked.split_sequence(mask_BT, chunks)
    count = targets_BT.size if mask_BT is None else jnp.maximum(jnp.sum(mask_BT), 1.0)
    ce, z = _tiled_ce(x_NBtD, targets_NBt, mask_NBt, w_DV, tiles, z_loss, keep)
    return ce / count, z / count


def _gathered(w_DV, dtype):
    """A weight (tile) in `dtype` (the hidden states': bf16 in training), whole along D (all-gathered
    over the weights' axes) for one matmul."""
    return constrain(w_DV.astype(dtype), (None, "vocab"))


def _wide_dot(eq: str, a, b):
    """A head matmul with an f32 result, of bf16 operands in training. On TPU the MXU takes bf16 with f32
    accumulation as it is; XLA:CPU runs such a dot in an emulated bf16 kernel on hosts without bf16
    instructions (1.6x the time of the same dot in f32, measured on this AVX2 EPYC), so the CPU lowering
    widens the operands first: the same products (a product of two bf16 values is exact in f32) and
    f32 sums, in another order."""
    return jax.lax.platform_dependent(
        a,
        b,
        cpu=lambda a, b: jnp.einsum(eq, a.astype(jnp.float32), b.astype(jnp.float32)),
        default=lambda a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32),
    )


def _logits(x_BtD, w_Dv):
    return constrain(_wide_dot("btd,dv->btv", x_BtD, w_Dv), ("batch", "length", "act_vocab"))


def _tile(w_DV, j, tiles: int, dtype):
    """Tile j of the unembedding: the words a * tiles + j, [D, V / tiles], gathered in `dtype`."""
    D, V = w_DV.shape
    return _gathered(jax.lax.dynamic_index_in_dim(w_DV.reshape(D, V // tiles, tiles), j, axis=2, keepdims=False), dtype)


def _whole_weight(w_DV, dtype):
    """The whole unembedding in `dtype`, gathered once: in one collective of its bits where
    layer_gather applies (XLA:CPU would gather it in f32), as one tile elsewhere."""
    return (layer_gather.gathered([w_DV], [("embed", "vocab")], dtype) or [_tile(w_DV, 0, 1, dtype)])[0]


def _in_tile(targets, j, tiles: int):
    """(whether each target word is in tile j, its index within the tile)."""
    return targets % tiles == j, targets // tiles


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_ce(x_NBtD, targets_NBt, mask_NBt, w_DV, tiles: int, z_loss: bool, keep: bool):
    """(summed cross entropy, summed z-loss) over the chunks of hidden states, weighted by the mask
    (see the module docstring)."""
    return _ce_forward(x_NBtD, targets_NBt, mask_NBt, w_DV, tiles, z_loss, keep)[0]


def _online(logits_Btv, targets_Bt, j, tiles: int, max_Bt, sum_Bt, target_Bt):
    """One tile's logits folded into the running max, the running sum and the target's logit."""
    new_max = jnp.maximum(max_Bt, jnp.max(logits_Btv, axis=-1))
    new_sum = sum_Bt * jnp.exp(max_Bt - new_max) + jnp.sum(jnp.exp(logits_Btv - new_max[..., None]), -1)
    hit, index = _in_tile(targets_Bt, j, tiles)
    picked = jnp.take_along_axis(logits_Btv, jnp.where(hit, index, 0)[..., None], -1)[..., 0]
    return new_max, new_sum, jnp.where(hit, picked, target_Bt)


def _ce_forward(x_NBtD, targets_NBt, mask_NBt, w_DV, tiles: int, z_loss: bool, keep: bool):
    start = (jnp.full(targets_NBt.shape, -jnp.inf), jnp.zeros(targets_NBt.shape), jnp.zeros(targets_NBt.shape))
    kept = None
    if keep:  # one chunk, one tile: no loops; the logits and the gathered weight stay for the backward
        w_Dv = _whole_weight(w_DV, x_NBtD.dtype)
        kept = (_logits(x_NBtD[0], w_Dv)[None], w_Dv)
        max_NBt, sum_NBt, target_NBt = _online(kept[0], targets_NBt, 0, 1, *start)
    else:

        def tile(carry, j):
            w_Dv = _tile(w_DV, j, tiles, x_NBtD.dtype)

            def chunk(_, xs):
                x_BtD, targets_Bt, *running = xs
                return None, _online(_logits(x_BtD, w_Dv), targets_Bt, j, tiles, *running)

            return jax.lax.scan(chunk, None, (x_NBtD, targets_NBt, *carry))[1], None

        (max_NBt, sum_NBt, target_NBt), _ = jax.lax.scan(tile, start, jnp.arange(tiles))
    logz_NBt = max_NBt + jnp.log(sum_NBt)
    weigh = (lambda a: a) if mask_NBt is None else (lambda a: a * mask_NBt)  # noqa: E731
    z = jnp.sum(weigh(jnp.square(logz_NBt))) if z_loss else jnp.zeros((), jnp.float32)
    return (jnp.sum(weigh(logz_NBt - target_NBt)), z), (x_NBtD, targets_NBt, mask_NBt, w_DV, logz_NBt, kept)


def _ce_backward(tiles: int, z_loss: bool, keep: bool, residuals, gs):
    x_NBtD, targets_NBt, mask_NBt, w_DV, logz_NBt, kept = residuals
    g, g_z = gs
    D, V = w_DV.shape
    sh = current()
    as_param = (
        (lambda a: jax.lax.with_sharding_constraint(a, sh.named(("embed", "vocab"), a.shape)))
        if sh is not None
        else (lambda a: a)
    )

    def gradients(x_BtD, targets_Bt, mask_Bt, logz_Bt, logits_Btv, w_Dv, j):
        """One chunk of one tile: (its share of the tile's weight gradient, of the hidden states')."""
        p_Btv = jnp.exp(logits_Btv - logz_Bt[..., None])
        hit, index = _in_tile(targets_Bt, j, tiles)
        is_target = hit[..., None] & (jnp.arange(logits_Btv.shape[-1]) == index[..., None])
        if not z_loss and mask_Bt is None:
            dlogits_Btv = g * jnp.where(is_target, p_Btv - 1, p_Btv)
        else:  # d/dlogits of a token's weighted loss: w (softmax - one-hot) + w g_z 2 logz softmax
            scale_Bt = g + g_z * 2 * logz_Bt if z_loss else jnp.broadcast_to(g, logz_Bt.shape)
            one_Bt = jnp.broadcast_to(g, logz_Bt.shape)
            if mask_Bt is not None:
                scale_Bt, one_Bt = scale_Bt * mask_Bt, one_Bt * mask_Bt
            scaled_Btv = scale_Bt[..., None] * p_Btv
            dlogits_Btv = jnp.where(is_target, scaled_Btv - one_Bt[..., None], scaled_Btv)
        dlogits_Btv = dlogits_Btv.astype(x_BtD.dtype)
        # Summed over the devices' tokens straight into the parameter's shards (a reduce-scatter).
        dw = as_param(jnp.einsum("btd,btv->dv", x_BtD, dlogits_Btv))
        return dw.astype(jnp.float32), _wide_dot("btv,dv->btd", dlogits_Btv, w_Dv)

    if keep:  # one chunk, one tile, the forward's logits
        mask = None if mask_NBt is None else mask_NBt[0]
        dw_Dv, dx_BtD = gradients(x_NBtD[0], targets_NBt[0], mask, logz_NBt[0], kept[0][0], kept[1], 0)
        dx_NBtD, dw_JDv = dx_BtD[None], dw_Dv[None]
    else:

        def tile(dx_NBtD, j):
            w_Dv = _tile(w_DV, j, tiles, x_NBtD.dtype)

            def chunk(dw_Dv, xs):
                x_BtD, targets_Bt, mask_Bt, logz_Bt, dx_BtD = xs
                dw, dx = gradients(x_BtD, targets_Bt, mask_Bt, logz_Bt, _logits(x_BtD, w_Dv), w_Dv, j)
                return dw_Dv + dw, dx_BtD + dx

            dw_Dv, dx_NBtD = jax.lax.scan(
                chunk,
                as_param(jnp.zeros((D, V // tiles), jnp.float32)),
                (x_NBtD, targets_NBt, mask_NBt, logz_NBt, dx_NBtD),
            )
            return dx_NBtD, dw_Dv

        dx_NBtD, dw_JDv = jax.lax.scan(tile, jnp.zeros(x_NBtD.shape, jnp.float32), jnp.arange(tiles))
    dw_DV = jnp.moveaxis(dw_JDv, 0, -1).reshape(D, V)  # tile j holds the words a * tiles + j
    # Cast here, once: left to itself XLA fuses the cast into the layers' backward and keeps the f32
    # accumulator (512 MiB per device for 70B) alive through it.
    dmask = None if mask_NBt is None else jnp.zeros_like(mask_NBt)
    return jax.lax.optimization_barrier(dx_NBtD.astype(x_NBtD.dtype)), None, dmask, dw_DV


_tiled_ce.defvjp(_ce_forward, _ce_backward)
