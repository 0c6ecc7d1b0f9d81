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


def reference_attention(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, kv_pos_BS):
    """Causal softmax attention on positions (so any token order works), f32 softmax."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    logits_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) * H**-0.5
    mask_BTS = q_pos_BT[:, :, None] >= kv_pos_BS[:, None, :]
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, NEG_INF)
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(B, T, N, H)


# ---------------------------------------------------------------------------------------------
# Splash


def _splash_lib():
    # tokamax exports Splash only behind dot_product_attention(implementation="mosaic"), which takes no
    # block sizes, no SplashConfig and no context-sharded (load-balanced) mask; the kernel module is in
    # _src. tokamax is pinned (pyproject); the Mosaic compile tests (tests/workload/test_tpu_kernels.py)
    # and the interpret-mode reference tests hold its behaviour.
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as kernel
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask
    return kernel, mask


@functools.cache
def _load_balanced_mask_cls():
    _, mask_lib = _splash_lib()

    class LoadBalancedCausalMask(mask_lib._ComputableMask):
        """Causal mask over tokens stored in load-balanced order (see module docstring)."""

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


def _fit_block(block: int, n: int) -> int:
    """Largest multiple of 128 not above `block` that divides n (n itself if n < 128)."""
    for b in range(min(block, n) // 128 * 128, 0, -128):
        if n % b == 0:
            return b
    return n


def make_splash_kernel(seq_len: int, context: int, spec, interpret: bool):
    """Splash kernel for a causal (load-balanced when context > 1) mask, q sharded `context` ways."""
    kernel_lib, mask_lib = _splash_lib()
    if context > 1:
        mask = _load_balanced_mask_cls()((seq_len, seq_len), context)
    else:
        mask = mask_lib.CausalMask((seq_len, seq_len))
    q_len = seq_len // context
    fq = lambda b: _fit_block(b, q_len)  # noqa: E731
    fk = lambda b: _fit_block(b, seq_len)  # noqa: E731
    block_kv = fk(spec.block_kv)
    block_kv_dkv = fk(spec.block_kv_dkv)
    config = kernel_lib.SplashConfig(
        block_q=fq(spec.block_q), block_kv=block_kv,
        block_kv_compute=_fit_block(spec.block_kv_compute, block_kv),
        block_q_dkv=fq(spec.block_q_dkv), block_kv_dkv=block_kv_dkv,
        block_kv_dkv_compute=_fit_block(spec.block_kv_dkv_compute, block_kv_dkv),
        block_q_dq=fq(spec.block_q_dq), block_kv_dq=fk(spec.block_kv_dq),
        max_logit_const=spec.max_logit_const, interpret=interpret)
    return kernel_lib.make_splash_mha(mask, config=config, q_seq_shards=context)


def splash_attention(q_BTNH, k_BSKH, v_BSKH, *, spec, interpret: bool):
    """Splash attention under shard_map with the kernel's manual sharding.

    q keeps its sequence sharded over `context`; K/V enter with the full sequence (shard_map
    all-gathers them over `context`). Heads are sharded over `tensor`; K/V heads are repeated to
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
    kernel = make_splash_kernel(T, context, spec, interpret)
    kernel_spec = kernel.manual_sharding_spec(sh.named(("length",)))
    q_spec = sh.spec(("batch", "length", "act_heads", None), q_BTNH.shape)
    kv_spec = sh.spec(("batch", None, "act_kv_heads", None), k_BSKH.shape)  # the whole sequence

    @functools.partial(jax.shard_map, mesh=sh.mesh, in_specs=(kernel_spec, q_spec, kv_spec, kv_spec),
                       out_specs=q_spec, check_vma=False)
    def run(kernel, q_BTNH, k_BSKH, v_BSKH):
        q_BNTH = jnp.swapaxes(q_BTNH * H**-0.5, 1, 2)
        out_BNTH = jax.vmap(kernel)(q_BNTH, jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2))
        return jnp.swapaxes(out_BNTH, 1, 2).astype(q_BTNH.dtype)

    return run(kernel, q_BTNH, k_BSKH, v_BSKH)
