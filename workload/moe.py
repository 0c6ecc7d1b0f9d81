"""Mixture-of-experts feed-forward: top-k router, dropless grouped matmuls, expert parallelism.

Dimension letters: B batch, T length, D model dim, F expert MLP dim, E experts, X local experts
(E / expert-parallel degree), k experts per token, M tokens, R = M*k routed rows.

Dropless routing: every (token, choice) row is sorted by expert, the experts run as one grouped
matmul over contiguous groups, and the rows are unsorted and combined with the router weights.
With expert parallelism, each `expert` shard gathers the tokens of its expert group, runs its
X local experts on the rows routed to them, and a reduce-scatter returns each shard its tokens.

fp8: the expert matmuls run qwix's quantised XLA ragged_dot (e4m3 forward, e5m2 gradients)
whatever the matmul implementation, because the Megablox kernel takes only bf16/f32 operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import sharding


def route(x_BTD, router_DE, k: int):
    """Top-k routing: weights (renormalised over the k choices), expert ids, load-balancing loss."""
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD, router_DE.astype(x_BTD.dtype),
                            preferred_element_type=jnp.float32)
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    weights_BTk, experts_BTk = jax.lax.top_k(probs_BTE, k)
    weights_BTk = weights_BTk / jnp.sum(weights_BTk, axis=-1, keepdims=True)
    E = router_DE.shape[1]
    # Switch-style auxiliary loss: E * sum_e (fraction of routed rows to e) * (mean router prob of e).
    fraction_E = jnp.mean(jax.nn.one_hot(experts_BTk, E, dtype=jnp.float32), axis=(0, 1, 2))
    aux = E * jnp.sum(fraction_E * jnp.mean(probs_BTE, axis=(0, 1)))
    return weights_BTk, experts_BTk, aux


def grouped_matmul(lhs_RD, rhs_XDF, group_sizes_X, impl: str, interpret: bool, fp8: bool = False):
    """Rows of group g times rhs[g]; rows past sum(group_sizes) come back as zeros.

    Megablox leaves rows outside every group (forward and in its lhs gradient) unwritten, so the
    input and output are both masked: `where`'s gradient zeroes those rows' cotangents. With fp8
    the XLA ragged_dot runs on fp8 operands instead of `impl` (Megablox takes no fp8).
    """
    valid_R = jnp.arange(lhs_RD.shape[0]) < jnp.sum(group_sizes_X)
    lhs_RD = jnp.where(valid_R[:, None], lhs_RD, 0)
    if fp8:
        out = _fp8_ragged_dot(lhs_RD, rhs_XDF, group_sizes_X)
    elif impl == "ragged_dot":
        out = jax.lax.ragged_dot(lhs_RD, rhs_XDF, group_sizes_X, preferred_element_type=jnp.float32)
    elif impl == "gmm":
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        R, D = lhs_RD.shape
        F = rhs_XDF.shape[2]
        tm = 128 if R >= 128 else max(8, -(-R // 8) * 8)
        pad = -R % tm
        lhs = jnp.pad(lhs_RD, ((0, pad), (0, 0)))
        tiling = (tm, min(128, D) if D % min(128, D) == 0 else D, min(128, F) if F % min(128, F) == 0 else F)
        out = gmm(lhs, rhs_XDF, group_sizes_X.astype(jnp.int32), preferred_element_type=jnp.float32,
                  tiling=tiling, interpret=interpret)[:R]
    else:
        raise ValueError(f"unknown moe matmul {impl!r}")
    return jnp.where(valid_R[:, None], out, 0.0)


def _fp8_ragged_dot(lhs_RD, rhs_XDF, group_sizes_X):
    """qwix's ragged_dot with a custom VJP: e4m3 operands scaled per lhs row and per rhs column
    (shared by the X experts), e5m2 output gradients; f32 out.

    Its VJP returns gradients in the output type, so the operands go in as f32 (the casts' VJPs
    bring the gradients back to the callers' dtypes); they are quantised to fp8 inside.
    """
    # Private, as in model._fp8_dot_general: the trainable fp8 ragged_dot is not exported (pinned qwix).
    from qwix._src.core import ragged_dot_qt

    qt = ragged_dot_qt.RaggedDotQtConfig(lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn,
                                         dlhs_grad_qtype=jnp.float8_e5m2, drhs_grad_qtype=jnp.float8_e5m2)
    f32 = jnp.float32
    return ragged_dot_qt.ragged_dot_qt(lhs_RD.astype(f32), rhs_XDF.astype(f32), group_sizes_X, qt, None, f32)


def _local_experts(x_MD, weights_Mk, experts_Mk, gate_XDF, up_XDF, down_XFD, *, first_expert, num_experts,
                   impl, interpret, fp8):
    """Run local experts [first_expert, first_expert + X) on the rows routed to them; others give 0."""
    M, D = x_MD.shape
    k = experts_Mk.shape[1]
    X = gate_XDF.shape[0]
    flat_R = experts_Mk.reshape(-1)
    order_R = jnp.argsort(flat_R, stable=True)
    x_RD = x_MD[order_R // k]
    sizes_E = jnp.bincount(flat_R, length=num_experts)
    local_X = jax.lax.dynamic_slice_in_dim(sizes_E, first_expert, X)
    shift = jnp.sum(jnp.where(jnp.arange(num_experts) < first_expert, sizes_E, 0))
    x_RD = jnp.roll(x_RD, -shift, axis=0)  # local experts' rows first
    mm = functools.partial(grouped_matmul, group_sizes_X=local_X, impl=impl, interpret=interpret, fp8=fp8)
    dt = x_MD.dtype
    h_RF = jax.nn.silu(mm(x_RD, gate_XDF.astype(dt))) * mm(x_RD, up_XDF.astype(dt))
    y_RD = mm(h_RF.astype(dt), down_XFD.astype(dt))
    y_RD = jnp.roll(y_RD, shift, axis=0)
    y_MkD = jnp.zeros_like(y_RD).at[order_R].set(y_RD).reshape(M, k, D)
    return jnp.einsum("mkd,mk->md", y_MkD, weights_Mk.astype(jnp.float32))


def experts(x_BTD, weights_BTk, experts_BTk, gate_EDF, up_EDF, down_EFD, *, impl: str, interpret: bool,
            fp8: bool = False):
    """Dropless experts, sharded: tokens over batch/length, experts over `expert`, F over `tensor`."""
    E = gate_EDF.shape[0]
    sh = sharding.current()
    if sh is None:  # single device: every expert is local
        B, T, D = x_BTD.shape
        y = _local_experts(x_BTD.reshape(B * T, D), weights_BTk.reshape(B * T, -1),
                           experts_BTk.reshape(B * T, -1), gate_EDF, up_EDF, down_EFD, first_expert=0,
                           num_experts=E, impl=impl, interpret=interpret, fp8=fp8)
        return y.reshape(B, T, D).astype(x_BTD.dtype)
    tok = sh.spec(("batch", "length", None), x_BTD.shape)
    # Weights enter whole along embed (gathered over fsdp): experts over `exp`, F over `mlp` axes.
    w_in, w_out = sh.spec(("exp", None, "mlp"), gate_EDF.shape), sh.spec(("exp", "mlp", None), down_EFD.shape)
    ex = _spec_axes(w_in[0])  # mesh axes the experts are split over
    mlp = _spec_axes(w_in[2])  # and their MLP dimension
    # With experts split over axes the batch is split over too, each shard gathers its expert
    # group's tokens (and scatters the results back); otherwise every shard holds all the tokens.
    ep_gathers = bool(ex) and set(ex) <= set(_spec_axes(tok[0]))

    @functools.partial(jax.shard_map, mesh=sh.mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out),
                       out_specs=tok, check_vma=False)
    def run(x_btD, w_btk, e_btk, gate, up, down):
        if ep_gathers:  # the expert group's tokens
            x_btD, w_btk, e_btk = (jax.lax.all_gather(a, ex, axis=0, tiled=True) for a in (x_btD, w_btk, e_btk))
        b, t, D = x_btD.shape
        X = gate.shape[0]
        first = jax.lax.axis_index(ex) * X if ex else 0
        y = _local_experts(x_btD.reshape(b * t, D), w_btk.reshape(b * t, -1), e_btk.reshape(b * t, -1),
                           gate, up, down, first_expert=first, num_experts=E, impl=impl, interpret=interpret,
                           fp8=fp8)
        if mlp:
            y = jax.lax.psum(y, mlp)
        y = y.reshape(b, t, D)
        if ep_gathers:
            y = jax.lax.psum_scatter(y, ex, scatter_dimension=0, tiled=True)
        elif ex:
            y = jax.lax.psum(y, ex)
        return y.astype(x_btD.dtype)

    return run(x_BTD, weights_BTk, experts_BTk, gate_EDF, up_EDF, down_EFD)


def _spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def reference_experts(x_BTD, weights_BTk, experts_BTk, gate_EDF, up_EDF, down_EFD):
    """Every expert on every token, then pick the routed ones: the definition, for tests."""
    dt = x_BTD.dtype
    h = jax.nn.silu(jnp.einsum("btd,edf->btef", x_BTD, gate_EDF.astype(dt), preferred_element_type=jnp.float32))
    h = h * jnp.einsum("btd,edf->btef", x_BTD, up_EDF.astype(dt), preferred_element_type=jnp.float32)
    y_BTED = jnp.einsum("btef,efd->bted", h.astype(dt), down_EFD.astype(dt), preferred_element_type=jnp.float32)
    picked_BTkD = jnp.take_along_axis(y_BTED, experts_BTk[..., None], axis=2)
    return jnp.einsum("btkd,btk->btd", picked_BTkD, weights_BTk.astype(jnp.float32)).astype(dt)
