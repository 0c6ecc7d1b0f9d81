"""Work split so that one piece's intermediates exist at a time, with a backward pass that recomputes
one piece at a time.

`sum_over_slices(fn, args, weights, axes, n)` runs a function linear in a hidden dimension of its
weights (an MLP's F: gate and up [D, F], down [F, D]) as the sum over n slices of that dimension. Its only residuals are its inputs: the backward pass recomputes each slice's forward and
pulls its gradient back before the next, so a slice's intermediates ([tokens, F / n]) exist for one
slice, never for all of them. Slicing the hidden dimension rather than the tokens means every weight
byte is used (and gathered, under FSDP) once per pass, and each slice's weight gradient is whole when
the slice is done, so it is reduced to the weight's shards once; the price is an f32 accumulator
shaped like the output (and like the input's gradient, in the backward pass).

Inside a rematerialised layer this costs no extra compute: residuals that are inputs are forwarded,
so the layer's own recomputation skips `fn` (it ran `fn` only to get its intermediates), and `fn`
still runs twice forward and once backward, as under plain remat.

Sequence chunks (`split_sequence`, `join_sequence`) keep each chunk sharded as the sequence is: with
context parallelism the sequence is sharded in C contiguous blocks, so chunk k takes the k-th
sub-block of every block ([B, C, N, L], L = T / (C N)).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .sharding import constrain, current


def sum_over_slices(
    fn: Callable,
    args: tuple,
    weights: tuple,
    axes: tuple[int, ...],
    slices: int,
    like_weight: Callable | None = None,
    like_out: Callable | None = None,
    recompute: bool = True,
    groups: int = 1,
):
    """`fn(*args, *weights)`, for a function linear in a hidden dimension that the weights share (each
    at its own axis in `axes`), computed as the sum over `slices` slices of that dimension. The hidden
    dimension is split in `groups` equal blocks (its shards, where it is sharded over `tensor`), and
    slice j is the j-th contiguous part of every block: each slice stays evenly split over the shards,
    and the weights keep their layout (no slice is strided along the minor dimension, which the TPU
    pads: a layout with the 64-row shard of the 70B's D minor took twice the memory). One slice's
    intermediates ([tokens, F / slices]) and one slice of each weight, as its use gathers it, exist at
    a time; every weight byte is gathered once per pass, and each slice's gradient is complete (over
    this device's tokens) when the slice is done, so it is reduced to the weight's shards once. The
    outputs are summed in f32.

    With `recompute` the backward pass recomputes each slice's forward from the inputs, its only
    residuals (inside a rematerialised layer this costs no extra compute: the layer's recomputation
    skips `fn`, whose outputs its backward does not need); without, autodiff keeps every slice's
    intermediates. Integer `args` (group sizes, say) get no gradient.

    `like_weight(i, a)` lays out a slice of weights[i] (or its gradient) as weights[i] is laid out;
    `like_out(a)` lays out an f32 accumulator shaped like the output or like args[0], as they are.
    """
    fns = (fn, like_weight or (lambda i, a: a), like_out or (lambda a: a))
    split = (tuple(axes), slices, groups)
    if recompute:
        return _sum(fns, split, tuple(args), tuple(weights))
    return _sum_forward(fns, split, tuple(args), tuple(weights))[0]


def _blocks(shape: tuple, axis: int, slices: int, groups: int) -> tuple:
    """`shape` with dimension `axis` as [groups, slices, rest]."""
    return shape[:axis] + (groups, slices, shape[axis] // (groups * slices)) + shape[axis + 1 :]


def _slice(w, axis: int, slices: int, groups: int, j):
    """Slice j of `w` along `axis`: the j-th part of each of its `groups` blocks."""
    part = jax.lax.dynamic_index_in_dim(
        w.reshape(_blocks(w.shape, axis, slices, groups)), j, axis=axis + 1, keepdims=False
    )
    return part.reshape(w.shape[:axis] + (w.shape[axis] // slices,) + w.shape[axis + 1 :])


def _unslice_into(acc, w, axis: int, slices: int, groups: int, j):
    """`acc` (shaped like the weight) with slice j set to `w`, in place: the gradient is assembled in
    the weight's own layout."""
    blocks = _blocks(acc.shape, axis, slices, groups)
    part = w.reshape(blocks[: axis + 1] + blocks[axis + 2 :])
    return jax.lax.dynamic_update_index_in_dim(acc.reshape(blocks), part, j, axis=axis + 1).reshape(acc.shape)


def _slices_of(fns, split, weights, j):
    axes, slices, groups = split
    like_weight = fns[1]
    return [like_weight(i, _slice(w, a, slices, groups, j)) for i, (w, a) in enumerate(zip(weights, axes))]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sum(fns, split, args, weights):
    return _sum_forward(fns, split, args, weights)[0]


def _sum_forward(fns, split, args, weights):
    fn, _, like_out = fns

    def one(acc, j):
        return like_out(acc + fn(*args, *_slices_of(fns, split, weights, j)).astype(jnp.float32)), None

    out = jax.eval_shape(fn, *args, *_slices_of(fns, split, weights, 0))
    acc, _ = jax.lax.scan(one, like_out(jnp.zeros(out.shape, jnp.float32)), jnp.arange(split[1]))
    return acc.astype(out.dtype), (args, weights)


def _sum_backward(fns, split, residuals, dy):
    fn, like_weight, like_out = fns
    axes, slices, groups = split
    args, weights = residuals
    floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact)]

    def one(carry, j):
        dargs, dweights = carry

        def f(float_args, *ws):
            full = list(args)
            for i, a in zip(floats, float_args):
                full[i] = a
            return fn(*full, *ws)

        _, pull = jax.vjp(f, [args[i] for i in floats], *_slices_of(fns, split, weights, j))
        dfloats, *dws = pull(dy)
        dargs = [
            like_out(d + e.astype(jnp.float32)) if args[i].shape == dy.shape else d + e.astype(jnp.float32)
            for i, d, e in zip(floats, dargs, dfloats)
        ]
        dweights = [
            like_weight(i, _unslice_into(acc, d.astype(acc.dtype), a, slices, groups, j))
            for i, (acc, d, a) in enumerate(zip(dweights, dws, axes))
        ]
        return (dargs, dweights), None

    zeros = (
        [jnp.zeros(args[i].shape, jnp.float32) for i in floats],
        [like_weight(i, jnp.zeros(w.shape, w.dtype)) for i, w in enumerate(weights)],
    )
    (dfloats, dweights), _ = jax.lax.scan(one, zeros, jnp.arange(slices))
    dargs = [np.zeros(a.shape, jax.dtypes.float0) for a in args]  # integer inputs have no gradient
    for i, d in zip(floats, dfloats):
        dargs[i] = d.astype(args[i].dtype)
    return tuple(dargs), tuple(dweights)


_sum.defvjp(_sum_forward, _sum_backward)


def split_sequence(a_BT, chunks: int):
    """[B, T, ...] -> [N, B, T / N, ...], each chunk sharded over batch and context as the sequence is."""
    sh = current()
    B, T, *rest = a_BT.shape
    C = sh.degree("length") if sh is not None else 1
    L = T // (C * chunks)
    if L * C * chunks != T:
        raise ValueError(f"sequence {T} does not split into {chunks} chunks x {C} context shards")
    a = jnp.moveaxis(a_BT.reshape(B, C, chunks, L, *rest), 2, 0).reshape(chunks, B, C * L, *rest)
    return constrain(a, (None, "batch", "length") + (("act_embed",) if rest else ()))


def join_sequence(a_NBt):
    """The inverse of split_sequence."""
    sh = current()
    N, B, t, *rest = a_NBt.shape
    C = sh.degree("length") if sh is not None else 1
    a = jnp.moveaxis(a_NBt.reshape(N, B, C, t // C, *rest), 0, 2).reshape(B, N * t, *rest)
    return constrain(a, ("batch", "length") + (("act_embed",) if rest else ()))
