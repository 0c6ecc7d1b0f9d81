"""Kernels equal their references, forward and gradients, on CPU (Pallas interpret mode).

Splash attention vs reference causal attention, with and without context parallelism (load-
balanced order) and head sharding; Megablox gmm / ragged_dot vs every-expert-on-every-token,
with and without expert parallelism, and the fp8 experts within quantisation error of it.
"""

from __future__ import annotations

import absl.flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.workload.blocks import SMALLEST_BLOCKS
from tpu_workload.model import attention, moe, sharding

absl.flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags


def _mesh(**axes):
    shape = dict(dict(data=1, fsdp=1, context=1, expert=1, tensor=1), **axes)
    shape["fsdp"] = 8 // int(np.prod(list(shape.values())))
    return sharding.Sharder(sharding.make_mesh(shape))


def _value_and_grads(f, *args, ct):
    out, vjp = jax.vjp(jax.jit(f), *args)
    return out, vjp(ct)


def _assert_close(got, want, atol):
    out, grads = got
    out0, grads0 = want
    np.testing.assert_allclose(out, out0, atol=atol)
    for g, g0 in zip(grads, grads0):
        np.testing.assert_allclose(g, g0, atol=atol * 10)


@pytest.fixture(autouse=True)
def chunked_experts(monkeypatch):
    """The received rows over slices of F, each the size of a device's own rows' [rows, F], as at full size
    (these shapes are small)."""
    monkeypatch.setattr(moe, "EXPERT_CHUNK_BYTES", 0)


def test_load_balanced_order():
    assert attention.load_balance_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert attention.load_balance_order(8, 1).tolist() == list(range(8))


@pytest.mark.parametrize("context,tensor", [(1, 1), (2, 1), (2, 2)])
def test_splash_matches_reference(context, tensor):
    B, T, N, K, H = 8, 256, 4, 2, 32
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k, v = (jax.random.normal(x, (B, T, K, H)) for x in ks[1:3])
    ct = jax.random.normal(ks[3], (B, T, N, H))
    pos = jnp.broadcast_to(jnp.asarray(attention.load_balance_order(T, context)), (B, T))
    sh = _mesh(context=context, tensor=tensor)

    def splash(q, k, v):
        with sharding.use(sh):
            return attention.splash_attention(q, k, v, spec=SMALLEST_BLOCKS, interpret=True)

    want = _value_and_grads(lambda q, k, v: attention.reference_attention(q, k, v, pos, pos), q, k, v, ct=ct)
    _assert_close(_value_and_grads(splash, q, k, v, ct=ct), want, atol=1e-5)


def _packed_rows(B, T, context):
    """Rows of documents of random lengths then padding, as data packing lays them out (positions
    restart at 0 per document, segment ids 1.. per row, 0 on padding), in load-balanced order."""
    rng = np.random.default_rng(0)
    seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b in range(B):
        t, d = 0, 1
        while t < T - 40:
            n = int(rng.integers(10, 90))
            n = min(n, T - 40 - t)
            seg[b, t : t + n], pos[b, t : t + n] = d, np.arange(n)
            t, d = t + n, d + 1
        pos[b, t:] = np.arange(T - t)  # padding: segment 0
    order = attention.load_balance_order(T, context)
    return jnp.asarray(seg[:, order]), jnp.asarray(pos[:, order])


def test_packed_reference_attention_is_each_document_on_its_own():
    B, T, N, K, H = 2, 128, 4, 2, 32
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k, v = (jax.random.normal(x, (B, T, K, H)) for x in ks[1:3])
    seg, pos = _packed_rows(B, T, 1)
    packed = attention.reference_attention(q, k, v, pos, pos, seg, seg)
    for b in range(B):
        for d in np.unique(np.asarray(seg[b])):
            at = np.flatnonzero(np.asarray(seg[b]) == d)
            alone = attention.reference_attention(
                q[b : b + 1, at], k[b : b + 1, at], v[b : b + 1, at], pos[b : b + 1, at], pos[b : b + 1, at]
            )
            np.testing.assert_allclose(packed[b : b + 1, at], alone, atol=1e-5)


@pytest.mark.parametrize("context,build", [(1, "jax"), (2, "jax"), (2, "tokamax")])
def test_splash_with_segment_ids_matches_packed_reference(context, build):
    """Both Splash builds: JAX's, and tokamax's (selected by maxLogitConst)."""
    B, T, N, K, H = 8, 256, 4, 2, 32
    ks = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k, v = (jax.random.normal(x, (B, T, K, H)) for x in ks[1:3])
    ct = jax.random.normal(ks[3], (B, T, N, H))
    seg, pos = _packed_rows(B, T, context)
    sh = _mesh(context=context)

    def splash(q, k, v):
        with sharding.use(sh):
            spec = SMALLEST_BLOCKS if build == "jax" else SMALLEST_BLOCKS.model_copy(update={"max_logit_const": 30.0})
            return attention.splash_attention(q, k, v, spec=spec, interpret=True, segments_BT=seg)

    want = _value_and_grads(lambda q, k, v: attention.reference_attention(q, k, v, pos, pos, seg, seg), q, k, v, ct=ct)
    _assert_close(_value_and_grads(splash, q, k, v, ct=ct), want, atol=1e-5)


def _experts_vs_reference(axes, **matmul):
    """moe.experts (with moe.Matmul(**matmul)) and the every-expert reference on one routed problem
    over a mesh with `axes` (none: unsharded): (output, gradients) of each. D and F are 128 and 256:
    the Mosaic grouped matmul takes no dimension below 128."""
    B, T, D, F, E, top = 8, 64, 128, 256, 4, 2
    ks = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(ks[0], (B, T, D))
    router = jax.random.normal(ks[1], (D, E))
    gate, up = (0.1 * jax.random.normal(k, (E, D, F)) for k in ks[2:4])
    down = 0.1 * jax.random.normal(ks[4], (E, F, D))
    ct = jax.random.normal(ks[5], (B, T, D))
    sh = _mesh(**axes) if axes else None
    mm = moe.Matmul(interpret=True, **matmul)

    def routed(fn):
        def f(x, gate, up, down):
            weights, experts, _ = moe.route(x, router, top)
            with sharding.use(sh):
                return fn(x, weights, experts, gate, up, down)

        return f

    got = _value_and_grads(routed(lambda *a: moe.experts(*a, mm=mm)), x, gate, up, down, ct=ct)
    return got, _value_and_grads(routed(moe.reference_experts), x, gate, up, down, ct=ct)


# Expert parallelism exchanges rows (expert 2 and 4); context 2 x expert 2 exchanges per context
# shard; tensor 2 splits F (partial sums); none: one device runs every expert.
@pytest.mark.parametrize(
    "impl,axes",
    [
        # the unsharded gmm and a second expert split of ragged_dot: with -m long (CI)
        pytest.param("gmm", {}, marks=pytest.mark.long),
        ("gmm", dict(context=2, expert=2)),
        ("gmm", dict(expert=4, tensor=2)),
        ("ragged_dot", dict(expert=2)),
        pytest.param("ragged_dot", dict(expert=4), marks=pytest.mark.long),
    ],
)
def test_grouped_matmul_matches_reference(impl, axes):
    _assert_close(*_experts_vs_reference(axes, impl=impl), atol=1e-4)


# Measured relative errors (Frobenius) of e4m3 forward / e5m2 gradients against the reference:
# forward 0.061-0.063, gradients 0.073-0.089.
FP8_FORWARD_RTOL, FP8_GRAD_RTOL = 0.1, 0.15


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "impl,axes",
    [
        ("ragged_dot", {}),
        ("gmm", dict(expert=2)),
        ("ragged_dot", dict(context=2, expert=2)),
        pytest.param("gmm", dict(expert=4, tensor=2), marks=pytest.mark.long),  # -m long (CI)
    ],
)
def test_fp8_experts_close_to_reference(impl, axes):
    (out, grads), (out0, grads0) = _experts_vs_reference(axes, impl=impl, fp8=True)
    errors = [_rel(out, out0)] + [_rel(g, g0) for g, g0 in zip(grads, grads0, strict=True)]
    assert 0.01 < errors[0] < FP8_FORWARD_RTOL, errors  # > 0.01: quantised, not the bf16 path
    assert all(0.01 < e < FP8_GRAD_RTOL for e in errors[1:]), errors
