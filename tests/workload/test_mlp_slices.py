"""The dense MLP over slices of its hidden dimension equals the whole MLP, forward and backward.

Where the layer is recomputed, the MLP runs over slices of F (model.MLP, chunked.sum_over_slices): slice
j is the j-th part of each tensor shard of F, its output is summed over slices in f32, and the
backward pass recomputes one slice at a time. Only the order of f32 sums changes, and where products
are rounded to bf16 (per slice, then summed in f32), so the loss agrees to 1e-4 (bf16 activations),
and every gradient is as close to the same model computed in f32 as the whole MLP's is (both about 1%
off it: bf16), on FSDP and on tensor parallelism (F itself split).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import loss_and_grads

from tpu_operator.api.contract import KernelsSpec, ModelDims, RematSpec
from tpu_workload.model import decoder as model_lib
from tpu_workload.model import sharding

DIMS = ModelDims(layers=2, model_dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=512, vocab=256)


@pytest.mark.parametrize("mesh", [dict(fsdp=8), pytest.param(dict(fsdp=4, tensor=2), marks=pytest.mark.long)])
def test_sliced_mlp_equals_the_whole_mlp(mesh):
    base = model_lib.ModelConfig(dims=DIMS, kernels=KernelsSpec(attention="xla"), remat=RematSpec(policy="full"))
    sh = sharding.Sharder(sharding.make_mesh(dict(data=1, fsdp=1, context=1, expert=1, tensor=1) | mesh))
    value_and_grad = loss_and_grads(base, sh, 128)

    loss1, grads1 = value_and_grad(mlp_chunks=1)
    loss4, grads4 = value_and_grad(mlp_chunks=4)
    _, exact = value_and_grad(mlp_chunks=1, compute="f32")  # the same model in f32: the reference
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-4)
    for (path, g1), g4, g in zip(
        jax.tree_util.tree_flatten_with_path(grads1)[0], jax.tree.leaves(grads4), jax.tree.leaves(exact)
    ):
        g1, g4, g = np.asarray(g1), np.asarray(g4), np.asarray(g)
        assert g4.shape == g1.shape
        whole, sliced = (np.linalg.norm(a - g) / np.linalg.norm(g) for a in (g1, g4))
        assert whole < 0.02 and sliced <= 1.25 * whole, (jax.tree_util.keystr(path), whole, sliced)
