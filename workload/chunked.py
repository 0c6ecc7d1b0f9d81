"""A function mapped over chunks whose backward pass recomputes one chunk at a time.

`map_recompute(fn, chunks, consts)` is `jax.lax.map(lambda c: fn(*c, *consts), chunks)` whose only
residuals are its inputs: the backward pass recomputes each chunk's forward and pulls its gradient
back before the next, so a chunk's intermediates (an MLP's [tokens, F] activations, say) exist for
one chunk, never for all of them. The gradients of `consts` (weights) are summed over chunks in f32.

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


def map_recompute(fn: Callable, chunks: tuple, consts: tuple, like_consts: Callable | None = None):
    """`fn(*chunk, *consts)` for each chunk (the leading axis of every array in `chunks`), stacked.
    `like_consts(i, a)`, if given, lays out an f32 gradient accumulator `a` as consts[i] is laid out
    (a sharding constraint: an accumulator left to XLA may be replicated)."""
    return _map((fn, like_consts or (lambda i, a: a)), tuple(chunks), tuple(consts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map(fns, chunks, consts):
    return jax.lax.map(lambda c: fns[0](*c, *consts), chunks)


def _forward(fns, chunks, consts):
    return _map(fns, chunks, consts), (chunks, consts)


def _backward(fns, residuals, dy):
    fn, like_consts = fns
    chunks, consts = residuals
    floats = [i for i, c in enumerate(chunks) if jnp.issubdtype(c.dtype, jnp.inexact)]

    def one(dconsts, xs):
        chunk, dy_chunk = xs

        def f(float_args, *consts):
            args = list(chunk)
            for i, a in zip(floats, float_args):
                args[i] = a
            return fn(*args, *consts)

        _, pull = jax.vjp(f, [chunk[i] for i in floats], *consts)
        dfloats, *dc = pull(dy_chunk)
        return tuple(like_consts(i, a + b.astype(jnp.float32)) for i, (a, b) in enumerate(zip(dconsts, dc))), dfloats

    zeros = tuple(like_consts(i, jnp.zeros(c.shape, jnp.float32)) for i, c in enumerate(consts))
    dconsts, dfloats = jax.lax.scan(one, zeros, (chunks, dy))
    dchunks = [np.zeros(c.shape, jax.dtypes.float0) for c in chunks]  # integer inputs have no gradient
    for i, d in zip(floats, dfloats):
        dchunks[i] = d
    return tuple(dchunks), tuple(d.astype(c.dtype) for d, c in zip(dconsts, consts))


_map.defvjp(_forward, _backward)


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
