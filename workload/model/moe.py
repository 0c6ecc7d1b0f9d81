"""Mixture-of-experts feed-forward: top-k router, dropless grouped matmuls, expert parallelism.

Dimension letters: B batch, T length, D model dim, F expert MLP dim, E experts, X local experts
(E / P), P expert-parallel peers (the `expert` degree), k experts per token, M tokens of one
device, R = M*k routed rows, C rows one device can receive.

Dropless routing: every (token, choice) row is sorted by expert, the experts run as one grouped
matmul over contiguous groups, each row's hidden activation weighted by its router weight before the
down projection, and the rows are unsorted and summed per token.

Expert parallelism (the batch is split over `expert` too, so each device holds its own tokens):
each device sends every routed row to the peer holding its expert with one ragged all-to-all, in
the compute dtype, runs its X experts on what it received, and a second ragged all-to-all brings
the results back. No token is gathered to every peer. A device can receive at most
C = P * M * min(k, X) rows (every token of its P peers routed to it, each at most min(k, X) times:
its experts are distinct), the receive buffer's size (MaxText's worst case too, never more than
M * E rows); the grouped matmuls run only over the rows that arrived. XLA:CPU has no ragged
all-to-all, so off TPU the same exchange runs as a dense all-to-all of per-peer blocks padded to
M * min(k, X) rows, then placed where the ragged one puts them: the same values, forward and
backward, which the tests hold against the every-expert reference.

Grouped matmul `gmm`: tokamax's Mosaic kernel (Megablox) through tokamax's public `ragged_dot`, with
the job's tiles per pass (forward, tokens' gradient, weights' gradient), bf16 out with f32
accumulation; with fp8 the same kernel quantises its operands to e4m3 (per row, and per expert and
column: every expert has its own scales), in the backward too. `ragged_dot` is XLA's, the reference
(fp8 there: qwix's quantised ragged_dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tpu_operator.api.contract import GmmSpec, GmmTiles

from . import chunked, sharding


def route(x_BTD, router_DE, k: int):
    """Top-k routing: weights (renormalised over the k choices), expert ids, load-balancing loss."""
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD, router_DE.astype(x_BTD.dtype), preferred_element_type=jnp.float32)
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    weights_BTk, experts_BTk = jax.lax.top_k(probs_BTE, k)
    weights_BTk = weights_BTk / jnp.sum(weights_BTk, axis=-1, keepdims=True)
    E = router_DE.shape[1]
    # Switch-style auxiliary loss: E * sum_e (fraction of routed rows to e) * (mean router prob of e).
    fraction_E = jnp.mean(jax.nn.one_hot(experts_BTk, E, dtype=jnp.float32), axis=(0, 1, 2))
    aux = E * jnp.sum(fraction_E * jnp.mean(probs_BTE, axis=(0, 1)))
    return weights_BTk, experts_BTk, aux


# ---------------------------------------------------------------------------------------------
# The grouped matmul


@dataclasses.dataclass(frozen=True)
class Matmul:
    """How the experts' grouped matmuls run: static under jit."""

    impl: str = "ragged_dot"  # "gmm" (tokamax Mosaic) or "ragged_dot" (XLA, the reference)
    tiles: GmmSpec = GmmSpec()
    interpret: bool = True  # the Mosaic kernel in Pallas interpret mode (off TPU)
    fp8: bool = False
    # The layer is rematerialised: received rows run in chunks, each recomputed in the backward pass.
    recompute: bool = True


def _fit(tile: int, dim: int) -> int:
    """Largest multiple of 128 not above `tile` dividing `dim`; the whole dim when none does."""
    for t in range(min(tile, dim) // 128 * 128, 0, -128):
        if dim % t == 0:
            return t
    return dim


@functools.cache
def _mosaic_ops(tiles: GmmSpec, m: int, k: int, n: int, interpret: bool, fp8: bool):
    """tokamax's Mosaic ragged dot for lhs [m, k] x rhs [G, k, n], each pass with its own fitted
    tiles (tokamax's own VJP builds its backward ops with default tiles)."""
    # tokamax exports ragged_dot and takes an op instance as its implementation; the op classes are
    # in _src. Pinned (pyproject); the interpret-mode reference tests and the Mosaic compile tests hold
    # them. supported_on is widened: tokamax asks the process's default device, which is a CPU both
    # in interpret mode and when compiling ahead of time for a TPU (tpu_workload.performance.plan).
    from tokamax._src.ops.ragged_dot import base
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as mosaic

    class Op(mosaic.PallasMosaicTpuRaggedDot):
        def supported_on(self, device) -> bool:
            return True

    if interpret:
        _tpu_info_for_cpu()

    def op(t: GmmTiles, rows: int, inner: int, cols: int, **kw):
        config = mosaic.Config(tile_m=_fit(t.m, rows), tile_k=_fit(t.k, inner), tile_n=_fit(t.n, cols))
        return Op(config=config, qdtype=jnp.float8_e4m3fn if fp8 else None, interpret=interpret, **kw)

    # dlhs: dY [m, n] x rhs^T -> [m, k] (contracting n); drhs: lhs^T [k, m] x dY [m, n] -> [G, k, n].
    dlhs = op(tiles.lhs_gradient, m, n, k)
    rhs_gradient = tiles.rhs_gradient
    if fp8:  # tokamax's fp8 weight gradient scales dY per column over all m rows: its k tile may not pass m
        rhs_gradient = rhs_gradient.model_copy(update={"k": min(rhs_gradient.k, max(128, m // 128 * 128))})
    drhs = op(rhs_gradient, m, k, n)
    return op(tiles.forward, m, k, n, vjp=functools.partial(base.vjp, dlhs_ragged_dot=dlhs, drhs_ragged_dot=drhs))


@functools.cache
def _tpu_info_for_cpu() -> None:
    """Let the Mosaic kernel run in Pallas interpret mode on a CPU: tokamax's kernel pipelines its
    blocks with `emit_pipeline`, which asks Pallas for the chip's memory tiling, and off TPU Pallas
    asks the CPU. Its registry of device kinds (private, pinned jax) then answers with TPU7x."""
    from jax._src.pallas.mosaic import tpu_info

    tpu_info.registry.setdefault("cpu", lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_7X, 1))


def grouped_matmul(lhs_RD, rhs_XDF, group_sizes_X, mm: Matmul):
    """Rows of group g times rhs[g], in lhs's dtype (f32 accumulation); rows past sum(group_sizes)
    come back as zeros.

    Megablox leaves rows outside every group unwritten (forward and in its lhs gradient), so the
    input and output are both masked: `where`'s gradient zeroes those rows' cotangents.
    """
    R, D = lhs_RD.shape
    valid_R = jnp.arange(R) < jnp.sum(group_sizes_X)
    lhs_RD = jnp.where(valid_R[:, None], lhs_RD, 0)
    group_sizes_X = group_sizes_X.astype(jnp.int32)
    if mm.impl == "gmm":
        import tokamax

        op = _mosaic_ops(mm.tiles, R, D, rhs_XDF.shape[2], mm.interpret, mm.fp8)
        out = tokamax.ragged_dot(
            lhs_RD, rhs_XDF, group_sizes_X, preferred_element_type=lhs_RD.dtype, implementation=(op,)
        )
    elif mm.impl != "ragged_dot":
        raise ValueError(f"unknown moe matmul {mm.impl!r}")
    elif mm.fp8:
        out = _fp8_ragged_dot(lhs_RD, rhs_XDF, group_sizes_X)
    else:
        out = jax.lax.ragged_dot(lhs_RD, rhs_XDF, group_sizes_X, preferred_element_type=jnp.float32)
    return jnp.where(valid_R[:, None], out, 0).astype(lhs_RD.dtype)


def _fp8_ragged_dot(lhs_RD, rhs_XDF, group_sizes_X):
    """The reference's fp8: qwix's ragged_dot with a custom VJP, e4m3 operands, e5m2 output gradients.

    Its VJP returns gradients in the output type, so the operands go in as f32 (the casts' VJPs
    bring the gradients back to the callers' dtypes); they are quantised to fp8 inside.
    """
    # Private, as in model._fp8_dot_general: the trainable fp8 ragged_dot is not exported (pinned qwix).
    from qwix._src.core import ragged_dot_qt

    qt = ragged_dot_qt.RaggedDotQtConfig(
        lhs_qtype=jnp.float8_e4m3fn,
        rhs_qtype=jnp.float8_e4m3fn,
        dlhs_grad_qtype=jnp.float8_e5m2,
        drhs_grad_qtype=jnp.float8_e5m2,
    )
    f32 = jnp.float32
    return ragged_dot_qt.ragged_dot_qt(lhs_RD.astype(f32), rhs_XDF.astype(f32), group_sizes_X, qt, None, f32)


def _swiglu(x_RD, w_R, group_sizes_X, gate_XDF, up_XDF, down_XFD, mm: Matmul):
    """The experts' SwiGLU over rows grouped by (local) expert, each row's output weighted by its router
    weight `w_R` (f32). The weight scales the row's hidden activation before the down projection (the
    same product: the projection is linear), so its gradient comes from the activation the backward
    pass has anyway, never from the experts' output: a rematerialised layer's recomputation then has no
    use for the experts' output and skips them (as a weighted sum of outputs, the router's gradient
    needed the output, which made the recomputation run every grouped matmul forward once more)."""
    dt = x_RD.dtype
    gate, up, down = (w.astype(dt) for w in (gate_XDF, up_XDF, down_XFD))
    h_RF = jax.nn.silu(grouped_matmul(x_RD, gate, group_sizes_X, mm)) * grouped_matmul(x_RD, up, group_sizes_X, mm)
    h_RF = (h_RF.astype(jnp.float32) * w_R[:, None]).astype(dt)
    return grouped_matmul(h_RF, down, group_sizes_X, mm)


def _swiglu_in_slices(x_CD, w_C, group_sizes_X, gate_XDF, up_XDF, down_XFD, mm: Matmul, slices: int):
    """`_swiglu` over `slices` slices of the experts' hidden dimension F at a time (every row in each),
    so its MLP-wide intermediates ([rows, F / slices]: the gate and up outputs, their product, their
    gradients) exist for one slice, not for the whole [rows, F]; the outputs are summed in f32
    (chunked.sum_over_slices). Each slice's weight gradient is complete when the slice is done: no
    gradient of the whole local experts is accumulated across chunks.

    With a rematerialised layer (`mm.recompute`) the backward pass recomputes one slice at a time from
    the rows, and the layer's own recomputation skips the experts: each grouped matmul runs once
    forward, gate and up once more to recompute, and every matmul's two gradients once. Without remat
    every slice's intermediates are kept, as one whole pass keeps them.
    """
    if slices == 1:
        return _swiglu(x_CD, w_C, group_sizes_X, gate_XDF, up_XDF, down_XFD, mm)
    swiglu = functools.partial(_swiglu, mm=mm)
    return chunked.sum_over_slices(
        swiglu, (x_CD, w_C, group_sizes_X), (gate_XDF, up_XDF, down_XFD), (2, 2, 1), slices, recompute=mm.recompute
    )


def hidden_slices(rows: int, share: int, hidden: int, itemsize: int = 2) -> int:
    """Slices of the experts' hidden dimension (`hidden` per device) for a buffer of `rows` rows: one
    where its [rows, hidden] activation is small (EXPERT_CHUNK_BYTES), else enough that one slice's
    activation is no larger than a device's own routed rows' (`share`, the balanced load) whole
    [share, hidden]: no MLP-wide buffer grows with the expert degree. Powers of two dividing
    `hidden`, each slice at least 128 wide."""
    slices = 1
    if rows * hidden * itemsize <= EXPERT_CHUNK_BYTES:
        return slices
    while rows // slices > share and hidden % (2 * slices) == 0 and hidden // (2 * slices) >= 128:
        slices *= 2
    return slices


# ---------------------------------------------------------------------------------------------
# Routing rows to experts


def _sort_rows(x_MD, weights_Mk, experts_Mk, num_experts: int):
    """Every (token, choice) row, sorted by expert: rows [R, D], their router weights [R] (f32), the
    order, rows per expert [E]."""
    k = experts_Mk.shape[1]
    flat_R = experts_Mk.reshape(-1)
    order_R = jnp.argsort(flat_R, stable=True)
    w_R = weights_Mk.reshape(-1).astype(jnp.float32)[order_R]
    return x_MD[order_R // k], w_R, order_R, jnp.bincount(flat_R, length=num_experts)


def _combine(y_RD, order_R, k: int):
    """Sorted rows (already weighted by the router) back to their tokens, summed (f32)."""
    y_MkD = jnp.zeros_like(y_RD).at[order_R].set(y_RD).reshape(-1, k, y_RD.shape[-1])
    return jnp.sum(y_MkD.astype(jnp.float32), axis=1)


def _local_experts(x_MD, weights_Mk, experts_Mk, gate_XDF, up_XDF, down_XFD, *, first_expert, num_experts, mm: Matmul):
    """Run local experts [first_expert, first_expert + X) on the rows routed to them; others give 0."""
    X = gate_XDF.shape[0]
    x_RD, w_R, order_R, sizes_E = _sort_rows(x_MD, weights_Mk, experts_Mk, num_experts)
    local_X = jax.lax.dynamic_slice_in_dim(sizes_E, first_expert, X)
    shift = jnp.sum(jnp.where(jnp.arange(num_experts) < first_expert, sizes_E, 0))
    x_RD, w_R = jnp.roll(x_RD, -shift, axis=0), jnp.roll(w_R, -shift)  # local experts' rows first
    y_RD = jnp.roll(_swiglu(x_RD, w_R, local_X, gate_XDF, up_XDF, down_XFD, mm), shift, axis=0)
    return _combine(y_RD, order_R, weights_Mk.shape[1])


# ---------------------------------------------------------------------------------------------
# Expert parallelism: two ragged all-to-alls


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Offsets and sizes of the exchange over the `expert` axis, from every peer's rows per expert."""

    send_P: jax.Array  # rows this device sends to each peer (its sorted rows, peer-major)
    send_offset_P: jax.Array  # where they start in this device's sorted rows
    recv_P: jax.Array  # rows it receives from each peer
    recv_offset_P: jax.Array  # where they land in its receive buffer (peer-major)
    remote_offset_P: jax.Array  # where this device's rows land in each peer's receive buffer
    home_offset_P: jax.Array  # where each peer's rows sit in that peer's sorted rows (for the way back)
    local_PX: jax.Array  # rows each peer sends for each local expert


def _exchange(sizes_E, peers: int, axis) -> Exchange:
    me = jax.lax.axis_index(axis)
    X = sizes_E.shape[0] // peers
    sizes_PE = jax.lax.all_gather(sizes_E, axis)  # row p: peer p's rows per expert
    rows_PP = sizes_PE.reshape(peers, peers, X).sum(-1)  # [source, destination]

    def before(a, axis):  # exclusive prefix sum
        return jnp.cumsum(a, axis=axis) - a

    return Exchange(
        send_P=rows_PP[me],
        send_offset_P=before(rows_PP[me], 0),
        recv_P=rows_PP[:, me],
        recv_offset_P=before(rows_PP[:, me], 0),
        remote_offset_P=before(rows_PP, 0)[me],
        home_offset_P=before(rows_PP, 1)[:, me],
        local_PX=jax.lax.dynamic_slice_in_dim(sizes_PE, me * X, X, axis=1),
    )


def _ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis, max_rows: int, ragged: bool
):
    """jax.lax.ragged_all_to_all; or (`ragged` False: XLA:CPU has none) the same exchange as a dense
    all-to-all of per-peer blocks of `max_rows` rows (at least any send size), placed as it places them."""
    if ragged:
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis
        )
    i = jnp.arange(max_rows)
    take_PI = jnp.clip(input_offsets[:, None] + i, 0, operand.shape[0] - 1)
    blocks = jnp.where((i < send_sizes[:, None])[..., None], operand[take_PI], 0)
    got = jax.lax.all_to_all(blocks, axis, 0, 0, tiled=True)  # got[p]: peer p's block for this device
    where_P = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # where peer p puts it here
    put_PI = jnp.where(i < recv_sizes[:, None], where_P[:, None] + i, output.shape[0])  # past the end: dropped
    return output.at[put_PI.reshape(-1)].set(got.reshape(-1, got.shape[-1]), mode="drop")


def _by_local_expert(buffer_CD, w_C, local_PX):
    """The receive buffer (peer-major, then expert) regrouped by local expert: rows, their router
    weights, their order, and rows per local expert."""
    P, X = local_PX.shape
    C = buffer_CD.shape[0]
    if X == 1:  # one local expert: already one group
        return buffer_CD, w_C, None, local_PX.sum(0)
    expert_C = jnp.repeat(jnp.tile(jnp.arange(X), P), local_PX.reshape(-1), total_repeat_length=C)
    expert_C = jnp.where(jnp.arange(C) < local_PX.sum(), expert_C, X)  # empty rows last
    order_C = jnp.argsort(expert_C, stable=True)
    return buffer_CD[order_C], w_C[order_C], order_C, local_PX.sum(0)


# The received rows of expert parallelism run over slices of F where their [rows, F] activation per
# device would pass this (bf16); the dense MLP's threshold (train.MLP_CHUNK_BYTES) too.
EXPERT_CHUNK_BYTES = 128 << 20


def receive_rows(tokens: int, k: int, local_experts: int, peers: int) -> int:
    """Rows a device's grouped matmuls run over: its own tokens' M*k routed rows, or, exchanging with
    P > 1 peers, the receive buffer P * M * min(k, X)."""
    return peers * tokens * min(k, local_experts) if peers > 1 else tokens * k


def _expert_parallel(
    x_MD,
    weights_Mk,
    experts_Mk,
    gate_XDF,
    up_XDF,
    down_XFD,
    *,
    num_experts,
    ex,
    mlp,
    peers: int,
    mm: Matmul,
    ragged: bool,
):
    """This device's tokens through the experts spread over the `ex` axes (see module docstring)."""
    M, D = x_MD.shape
    k, X = experts_Mk.shape[1], gate_XDF.shape[0]
    x_RD, w_R, order_R, sizes_E = _sort_rows(x_MD, weights_Mk, experts_Mk, num_experts)
    plan = _exchange(sizes_E, peers, ex)
    block = M * min(k, X)  # the most rows one device sends one peer
    a2a = functools.partial(_ragged_all_to_all, axis=ex, max_rows=block, ragged=ragged)
    C = receive_rows(M, k, X, peers)
    forward = (plan.send_offset_P, plan.send_P, plan.remote_offset_P, plan.recv_P)
    buffer_CD = a2a(x_RD, jnp.zeros((C, D), x_RD.dtype), *forward)
    # Each row's router weight travels with it (4 bytes beside its D values): the experts apply it.
    w_C = a2a(w_R[:, None], jnp.zeros((C, 1), w_R.dtype), *forward)[:, 0]
    rows_CD, w_C, order_C, sizes_X = _by_local_expert(buffer_CD, w_C, plan.local_PX)
    slices = hidden_slices(C, M * k, gate_XDF.shape[-1], x_MD.dtype.itemsize)
    y_CD = _swiglu_in_slices(rows_CD, w_C, sizes_X, gate_XDF, up_XDF, down_XFD, mm, slices)
    if mlp:  # F split over `tensor`: partial sums
        y_CD = jax.lax.psum(y_CD, mlp)
    if order_C is not None:
        y_CD = jnp.zeros_like(y_CD).at[order_C].set(y_CD)
    y_RD = a2a(y_CD, jnp.zeros_like(x_RD), plan.recv_offset_P, plan.recv_P, plan.home_offset_P, plan.send_P)
    return _combine(y_RD, order_R, k)


def experts(x_BTD, weights_BTk, experts_BTk, gate_EDF, up_EDF, down_EFD, *, mm: Matmul):
    """Dropless experts, sharded: tokens over batch/length, experts over `expert`, F over `tensor`."""
    E = gate_EDF.shape[0]
    # In the compute dtype before they are gathered (over the weights' fsdp/context axes): half the bytes.
    gate_EDF, up_EDF, down_EFD = (w.astype(x_BTD.dtype) for w in (gate_EDF, up_EDF, down_EFD))
    sh = sharding.current()
    if sh is None:  # single device: every expert is local
        B, T, D = x_BTD.shape
        y = _local_experts(
            x_BTD.reshape(B * T, D),
            weights_BTk.reshape(B * T, -1),
            experts_BTk.reshape(B * T, -1),
            gate_EDF,
            up_EDF,
            down_EFD,
            first_expert=0,
            num_experts=E,
            mm=mm,
        )
        return y.reshape(B, T, D).astype(x_BTD.dtype)
    tok = sh.spec(("batch", "length", None), x_BTD.shape)
    # Weights enter whole along embed (gathered over fsdp/context): experts over `exp`, F over `mlp` axes.
    w_in, w_out = sh.spec(("exp", None, "mlp"), gate_EDF.shape), sh.spec(("exp", "mlp", None), down_EFD.shape)
    ex = sharding.spec_axes(w_in[0])  # mesh axes the experts are split over
    mlp = sharding.spec_axes(w_in[2])  # and their MLP dimension
    # Experts split over axes the batch is split over too: each device exchanges its own tokens'
    # rows. Otherwise (a batch too small to split over `expert`) every device holds the same tokens
    # and adds up its own experts' share.
    exchanges = bool(ex) and set(ex) <= set(sharding.spec_axes(tok[0]))
    ragged = sh.mesh.devices.flat[0].platform == "tpu"

    @functools.partial(
        jax.shard_map, mesh=sh.mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out), out_specs=tok, check_vma=False
    )
    def run(x_btD, w_btk, e_btk, gate, up, down):
        b, t, D = x_btD.shape
        x_MD, w_Mk, e_Mk = x_btD.reshape(b * t, D), w_btk.reshape(b * t, -1), e_btk.reshape(b * t, -1)
        if exchanges:
            y = _expert_parallel(
                x_MD, w_Mk, e_Mk, gate, up, down, num_experts=E, ex=ex, mlp=mlp, peers=sh.size(ex), mm=mm, ragged=ragged
            )
        else:
            first = jax.lax.axis_index(ex) * gate.shape[0] if ex else 0
            y = _local_experts(x_MD, w_Mk, e_Mk, gate, up, down, first_expert=first, num_experts=E, mm=mm)
            if mlp or ex:
                y = jax.lax.psum(y, mlp + ex)
        return y.reshape(b, t, D).astype(x_btD.dtype)

    return run(x_BTD, weights_BTk, experts_BTk, gate_EDF, up_EDF, down_EFD)


def reference_experts(x_BTD, weights_BTk, experts_BTk, gate_EDF, up_EDF, down_EFD):
    """Every expert on every token, then pick the routed ones: the definition, for tests."""
    dt = x_BTD.dtype
    h = jax.nn.silu(jnp.einsum("btd,edf->btef", x_BTD, gate_EDF.astype(dt), preferred_element_type=jnp.float32))
    h = h * jnp.einsum("btd,edf->btef", x_BTD, up_EDF.astype(dt), preferred_element_type=jnp.float32)
    y_BTED = jnp.einsum("btef,efd->bted", h.astype(dt), down_EFD.astype(dt), preferred_element_type=jnp.float32)
    picked_BTkD = jnp.take_along_axis(y_BTED, experts_BTk[..., None], axis=2)
    return jnp.einsum("btkd,btk->btd", picked_BTkD, weights_BTk.astype(jnp.float32)).astype(dt)
