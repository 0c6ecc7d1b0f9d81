"""Causal grouped-query attention: the XLA reference and the Splash kernel.

Dimension letters: B batch, T query length, S key/value length, N query heads, K key/value
heads, G = N / K query heads per key/value head, H head dim.

Context parallelism shards the sequence over the `context` mesh axis in load-balanced order:
the sequence is cut into 2C chunks and shard s holds chunks s and 2C-1-s, so every shard gets
one early (cheap) and one late (expensive) chunk of the causal triangle. The permutation is
applied to the tokens by the data pipeline; attention masks on original positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import sharding

NEG_INF = -0.7 * float(np.finfo(np.float32).max)


def load_balance_order(seq_len: int, shards: int):
    """order[i] = original position of the token at (permuted) index i."""
    return _original_position(np.arange(seq_len), seq_len, shards)


def _original_position(i, seq_len: int, shards: int):
    """Arithmetic form of the load-balanced order; works on numpy and jax arrays (inside kernels)."""
    if shards == 1:
        return i
    chunk = seq_len // (2 * shards)
    c, within = i // chunk, i % chunk
    s, late = c // 2, c % 2
    orig_chunk = s + late * (2 * shards - 1 - 2 * s)
    return orig_chunk * chunk + within


def reference_attention(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, kv_pos_BS, q_seg_BT=None, kv_seg_BS=None):
    """Causal softmax attention on positions (so any token order works), f32 softmax; with segment ids
    (packed documents) a query sees only keys of its own segment."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    # Heads ahead of positions before the matmuls: each (b, k) is then a plain [G T, H] x [H, S] matmul whose
    # output is already [B, K, G, T, S]. Left in token order, XLA:CPU computed the logits as [K, T, S G] and
    # transposed them, a strided copy of the largest tensor of the layer (10% of the small preset's CPU step).
    q_BKGTH = q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    k_BKSH, v_BKSH = (a.transpose(0, 2, 1, 3) for a in (k_BSKH, v_BSKH))
    logits_BKGTS = jnp.einsum("bkgth,bksh->bkgts", q_BKGTH, k_BKSH, preferred_element_type=jnp.float32) * H**-0.5
    mask_BTS = q_pos_BT[:, :, None] >= kv_pos_BS[:, None, :]
    if q_seg_BT is not None:
        mask_BTS = mask_BTS & (q_seg_BT[:, :, None] == kv_seg_BS[:, None, :])
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, NEG_INF)
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BKGTH = jnp.einsum("bkgts,bksh->bkgth", probs_BKGTS, v_BKSH)
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


# ---------------------------------------------------------------------------------------------
# Splash
#
# Two builds of the same kernel. By default JAX's public Pallas Splash
# (`jax.experimental.pallas.ops.tpu.splash_attention`, MaxText's default too): its backward runs a
# dK/dV kernel and a separate dQ kernel that accumulates dQ in VMEM, so the backward's only HBM
# outputs are dQ, dK, dV in the input dtype. tokamax's Splash has `max_logit_const` (a fixed softmax
# max: no running max, about 4 % faster on v7x) but only a fused backward that writes dQ once per
# key/value block, in f32: [S / block_kv_dkv, N, T, H] per sequence (64 GiB a device at 128k
# tokens). So tokamax's build is used only when a job sets `maxLogitConst`, and `tpujob plan` shows
# what it costs.

RESIDUALS = "attention_out"  # the name of the kernel's saved residuals (output, logsumexp) for remat


def _jax_splash():
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask

    return splash, mask


def _tokamax_splash():
    # tokamax exports Splash only behind dot_product_attention(implementation="mosaic"), which takes no
    # block sizes, no SplashConfig and no context-sharded (load-balanced) mask; the kernel module is in
    # _src. tokamax is pinned (pyproject); the Mosaic compile tests (tests/workload/test_tpu_kernels.py)
    # and the interpret-mode reference tests hold its behaviour.
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as kernel
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask

    return kernel, mask


@functools.cache
def _load_balanced_mask_cls(computable_mask):
    """A causal mask over tokens stored in load-balanced order (module docstring), as a subclass of
    the Splash build's `_ComputableMask` (each build has its own; a computed mask never materialises
    the [T, T] array, which at 128k tokens would be 16 G entries)."""

    class LoadBalancedCausalMask(computable_mask):
        def __init__(self, shape, shards: int, shard_count: int = 1):
            self.shards = shards
            seq = shape[0]

            def fn(q_ids, kv_ids):
                return _original_position(q_ids, seq, shards) >= _original_position(kv_ids, seq, shards)

            super().__init__(shape=shape, mask_function=fn, shard_count=shard_count)

        def __eq__(self, other):
            return type(self) is type(other) and self.shape == other.shape and self.shards == other.shards

        def __hash__(self):
            return hash((type(self), self.shape, self.shards))

    return LoadBalancedCausalMask


def _causal_mask(mask_lib, seq_len: int, context: int):
    if context > 1:
        return _load_balanced_mask_cls(mask_lib._ComputableMask)((seq_len, seq_len), context)
    return mask_lib.CausalMask((seq_len, seq_len))


def _fit_block(block: int, n: int) -> int:
    """Largest multiple of 128 not above `block` that divides n (n itself if n < 128)."""
    for b in range(min(block, n) // 128 * 128, 0, -128):
        if n % b == 0:
            return b
    return n


def fitted_blocks(spec, seq_len: int, context: int) -> dict[str, int]:
    """The spec's block sizes fitted to the kernel's shapes: query blocks to the per-shard length,
    key/value blocks to the whole sequence, compute blocks to their blocks."""
    q_len = seq_len // context
    fq = lambda b: _fit_block(b, q_len)  # noqa: E731
    fk = lambda b: _fit_block(b, seq_len)  # noqa: E731
    block_kv, block_kv_dkv = fk(spec.block_kv), fk(spec.block_kv_dkv)
    return dict(
        block_q=fq(spec.block_q),
        block_kv=block_kv,
        block_kv_compute=_fit_block(spec.block_kv_compute, block_kv),
        block_q_dkv=fq(spec.block_q_dkv),
        block_kv_dkv=block_kv_dkv,
        block_kv_dkv_compute=_fit_block(spec.block_kv_dkv_compute, block_kv_dkv),
        block_q_dq=fq(spec.block_q_dq),
        block_kv_dq=fk(spec.block_kv_dq),
    )


@functools.cache
def make_splash_kernel(seq_len: int, context: int, heads: int, spec, interpret: bool):
    """Splash kernel over `heads` (the heads of one shard) for a causal mask (load-balanced when
    context > 1) with q sharded `context` ways; saves its residuals under RESIDUALS.

    Cached across traces (the step, its eval_shape, the evaluation step): its mask arrays are made
    concrete, never tracers of the trace that first asked for it."""
    with jax.ensure_compile_time_eval():
        return _make_splash_kernel(seq_len, context, heads, spec, interpret)


def _make_splash_kernel(seq_len: int, context: int, heads: int, spec, interpret: bool):
    blocks = fitted_blocks(spec, seq_len, context)
    if spec.max_logit_const is None:
        splash, mask_lib = _jax_splash()
        mask = mask_lib.MultiHeadMask([_causal_mask(mask_lib, seq_len, context)] * heads)
        return splash.make_splash_mha(
            mask,
            block_sizes=splash.BlockSizes(**blocks),
            head_shards=1,
            q_seq_shards=context,
            residual_checkpoint_name=RESIDUALS,
            interpret=interpret,
        )
    kernel_lib, mask_lib = _tokamax_splash()
    del blocks["block_q_dq"], blocks["block_kv_dq"]  # tokamax's backward is fused: no dQ pass
    config = kernel_lib.SplashConfig(
        **blocks, max_logit_const=spec.max_logit_const, residual_checkpoint_name=RESIDUALS, interpret=interpret
    )
    return kernel_lib.make_splash_mha(_causal_mask(mask_lib, seq_len, context), config=config, q_seq_shards=context)


def _kernel_sharding(mesh, q_axes, spec) -> jax.sharding.NamedSharding:
    """How the kernel's mask data is split: along the query sequence over `q_axes` (JAX's build also
    names a head axis, which stays whole: every shard builds its kernel for its own heads)."""
    return jax.sharding.NamedSharding(mesh, P(None, q_axes) if spec.max_logit_const is None else P(q_axes))


def one_shard(kernel, spec, context: int):
    """The kernel as the first of `context` query shards runs it under shard_map, its mask data cut
    the same way: one device's work, to time outside shard_map (tuning)."""
    if context == 1:
        return kernel
    mesh = jax.sharding.AbstractMesh((context,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = kernel.manual_sharding_spec(_kernel_sharding(mesh, "context", spec))

    def first(part, leaf):
        for axis, entry in enumerate(part or ()):
            if entry is not None:
                leaf = jax.lax.slice_in_dim(leaf, 0, leaf.shape[axis] // context, axis=axis)
        return leaf

    return jax.tree.map(first, specs, kernel, is_leaf=lambda x: x is None or isinstance(x, P))


def splash_attention(q_BTNH, k_BSKH, v_BSKH, *, spec, interpret: bool, segments_BT=None):
    """Splash attention under shard_map with the kernel's manual sharding.

    q keeps its sequence sharded over `context`; K/V enter with the full sequence (shard_map
    all-gathers them over `context`). `segments_BT` (packed documents) go to the kernel as its
    segment ids: the query shard's own, and the whole sequence's for the keys. Heads are sharded over `tensor`; K/V heads are repeated to
    the query heads first when `tensor` does not divide them.
    """
    sh = sharding.current()
    if sh is None:
        raise RuntimeError("splash attention needs an active sharding.Sharder (sharding.use)")
    context, tensor = sh.degree("length"), sh.degree("act_heads")
    _, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if tensor > 1 and K % tensor:
        k_BSKH = jnp.repeat(k_BSKH, N // K, axis=2)
        v_BSKH = jnp.repeat(v_BSKH, N // K, axis=2)
    q_spec = sh.spec(("batch", "length", "act_heads", None), q_BTNH.shape)
    kv_spec = sh.spec(("batch", None, "act_kv_heads", None), k_BSKH.shape)  # the whole sequence
    kernel = make_splash_kernel(T, context, N // sh.size(q_spec[2]), spec, interpret)
    kernel_spec = kernel.manual_sharding_spec(_kernel_sharding(sh.mesh, sh.spec(("length",))[0], spec))
    seg_specs = (None, None) if segments_BT is None else (P(*q_spec[:2]), P(*kv_spec[:2]))

    @functools.partial(
        jax.shard_map,
        mesh=sh.mesh,
        in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, *seg_specs),
        out_specs=q_spec,
        check_vma=False,
    )
    def run(kernel, q_BTNH, k_BSKH, v_BSKH, q_seg_BT, kv_seg_BS):
        q_BNTH = jnp.swapaxes(q_BTNH * H**-0.5, 1, 2)
        k_BNSH, v_BNSH = jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2)
        if q_seg_BT is None:
            out_BNTH = jax.vmap(kernel)(q_BNTH, k_BNSH, v_BNSH)
        else:
            segment_ids = _segment_ids_cls(spec)
            out_BNTH = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=segment_ids(qs, ks)))(
                q_BNTH, k_BNSH, v_BNSH, q_seg_BT, kv_seg_BS
            )
        return jnp.swapaxes(out_BNTH, 1, 2).astype(q_BTNH.dtype)

    return run(kernel, q_BTNH, k_BSKH, v_BSKH, segments_BT, segments_BT)


def _segment_ids_cls(spec):
    """The Splash build's SegmentIds(q, kv) (each kernel module exports its own)."""
    return (_jax_splash() if spec.max_logit_const is None else _tokamax_splash())[0].SegmentIds
