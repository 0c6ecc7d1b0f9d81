"""One layer's weights gathered in one collective per pass, on the CPU.

Under FSDP each weight of a layer is all-gathered where it is used and its gradient reduced back to
its shards. On TPU, XLA does this well by itself: it casts the shards to bf16 before gathering, turns
the gradient's all-reduce into a reduce-scatter, and overlaps both with the layer's matmuls (the plan's
collective bytes, docs/plan.md), so a step compiled for TPU is left to it. XLA:CPU does none of that:
each weight is gathered in f32 in its own collective (the convert to f32 that its dots need is moved
before the gather), and each gradient is all-reduced whole, then sliced. With the local run's virtual devices sharing a few cores, every
collective is also a rendezvous of all of them, so the count matters as much as the bytes.

`gathered(weights, axes, dtype)` does the gathering by hand there: inside `shard_map`, each device
flattens its shards of the layer's weights, cast to `dtype` (bf16 in training: the rounding the matmuls
do anyway), into one buffer; one all-gather of its 16-bit words (XLA:CPU widens a bf16 collective to
f32) brings every device's buffer, and the whole weights are cut from it. One collective per layer and
pass instead of one per matrix (seven), and half the bytes. The gradients still come back through XLA:
the whole weights leave `shard_map` replicated, so XLA sums each device's gradient of them in its one
all-reduce of the layer, as before, and each device keeps its own slices. The loss is the same bits;
the gradients the same up to where XLA, allowed excess precision, skips a bf16 rounding of a weight's
gradient on its own path (tests/workload/test_layer_gather.py).

Only where it applies: an active sharder over CPU devices and every weight split along one dimension
over the same mesh axes (FSDP, the embed dimension); anything else (TPU, tensor parallelism, a weight
split twice, no sharder) returns the weights as they are and leaves the collectives to XLA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .sharding import Logical, current, spec_axes


def gathered(weights: Sequence[jax.Array], axes: Sequence[Logical], dtype) -> list[jax.Array] | None:
    """The layer's `weights` (f32 shards) whole and in `dtype`, gathered in one collective (see the module
    docstring); None where the plan does not apply, and the caller uses the weights as they are."""
    sh = current()
    if sh is None or not weights or sh.mesh.devices.flat[0].platform != "cpu":
        return None
    specs = [sh.spec(a, w.shape) for a, w in zip(axes, weights)]
    split = [[(d, spec_axes(e)) for d, e in enumerate(s) if spec_axes(e)] for s in specs]
    if any(len(s) != 1 for s in split) or len({s[0][1] for s in split}) != 1:
        return None
    group = split[0][0][1]
    n = math.prod(sh.mesh.shape[a] for a in group)
    gather = jax.shard_map(
        functools.partial(_gather, group=group, dims=tuple(s[0][0] for s in split), n=n, dtype=jnp.dtype(dtype)),
        mesh=sh.mesh,
        in_specs=(tuple(specs),),
        out_specs=tuple(P(*([None] * w.ndim)) for w in weights),
        check_vma=False,
    )
    like = tuple((NamedSharding(sh.mesh, s), w.dtype) for s, w in zip(specs, weights))
    return list(_whole(tuple(weights), gather, like))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _whole(weights, gather, like):
    return gather(weights)


def _whole_forward(weights, gather, like):
    return gather(weights), None


def _whole_backward(gather, like, _, grads):
    # The whole weights are replicated, so their gradients arrive whole and summed over the devices (XLA
    # reduces the layer's gradients in one all-reduce): each weight's shards are slices of them.
    return (tuple(jax.lax.with_sharding_constraint(g.astype(dt), sharding) for g, (sharding, dt) in zip(grads, like)),)


_whole.defvjp(_whole_forward, _whole_backward)


def _gather(shards, group, dims, n, dtype):
    """Inside shard_map: this device's shards, cast to `dtype` and packed in one buffer, all-gathered; each
    weight cut whole from the [n, total] result (its dimension `dims[i]` is split in n blocks)."""
    flat = jnp.concatenate([s.astype(dtype).reshape(-1) for s in shards])
    # As bits: XLA:CPU widens a bf16 collective to f32 (its float normalisation), doubling the bytes.
    bits = jnp.dtype(f"uint{8 * dtype.itemsize}")
    every = jax.lax.bitcast_convert_type(
        jax.lax.all_gather(jax.lax.bitcast_convert_type(flat, bits), group, axis=0, tiled=False), dtype
    )
    out, at = [], 0
    for s, d in zip(shards, dims):
        part = every[:, at : at + s.size].reshape((n,) + s.shape)
        at += s.size
        out.append(jnp.moveaxis(part, 0, d).reshape(s.shape[:d] + (n * s.shape[d],) + s.shape[d + 1 :]))
    return tuple(out)
