"""The production Pallas kernels compiled by the TPU compiler for TPU7x (libtpu, no TPU): Splash
forward + backward and the MoE experts (Megablox gmm) forward + backward, through Mosaic with
`interpret=False`, at small shapes with our default block sizes. Interpret mode (the other kernel
tests) never meets Mosaic's VMEM or layout limits; this does.

In this process: libtpu reads LIBTPU_INIT_ARGS once, at the first topology, so the module sets the
v7x flags the pods get before making it (nothing else here makes one: the plans run in children).
Skipped, with the reason, where libtpu is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import trainer_config
from tpu_operator.api.catalogue import generation
from tpu_operator.api.contract import SplashSpec
from tpu_operator.api.models import RuntimeSpec
from tpu_operator.rendering.libtpu import libtpu_init_args
from tpu_workload import attention, moe, plan, sharding

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (bash scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def sharder() -> sharding.Sharder:
    """FSDP over the 8 devices of a TPU7x 2x2x1 slice, made by libtpu with the pods' v7x flags."""
    os.environ.setdefault("LIBTPU_INIT_ARGS", " ".join(libtpu_init_args(generation("v7x"), RuntimeSpec())))
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags
    devices = plan.topology_devices("v7x", "2x2x1", 1)
    assert [d.device_kind for d in devices] == ["TPU7x"] * 8
    return sharding.Sharder(sharding.make_mesh(dict(data=1, fsdp=8, context=1, expert=1, tensor=1), 1, devices))


def test_splash_forward_and_backward_compile_for_tpu7x_with_default_blocks(sharder):
    B, T, N, K, H = 8, 1024, 8, 2, 128  # GQA, 1024 tokens: two of the default 512-token blocks
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16, sharding=sharder.named(("batch", None, None, None)))

    def loss(q, k, v):
        with sharding.use(sharder):
            return attention.splash_attention(q, k, v, spec=SplashSpec(), interpret=False).astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv)
    assert "tpu_custom_call" in lowered.as_text()  # the Mosaic kernels, not an XLA fallback
    assert 0 < lowered.compile().memory_analysis().temp_size_in_bytes < 1 << 30


def test_moe_experts_megablox_forward_and_backward_compile_for_tpu7x(sharder):
    B, T, D, F, E, k = 8, 256, 256, 512, 4, 2
    mesh = sharder.mesh
    x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16, sharding=sharder.named(("batch", None, None)))
    w = jax.ShapeDtypeStruct((E, D, F), jnp.float32, sharding=NamedSharding(mesh, P()))
    w_down = jax.ShapeDtypeStruct((E, F, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    router = jax.ShapeDtypeStruct((D, E), jnp.float32, sharding=NamedSharding(mesh, P()))

    def loss(x, router, gate, up, down):
        with sharding.use(sharder):
            weights, experts, aux = moe.route(x, router, k)
            y = moe.experts(x, weights, experts, gate, up, down, impl="gmm", interpret=False)
            return y.astype(jnp.float32).sum() + aux

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, router, w, w, w_down)
    assert "tpu_custom_call" in lowered.as_text()
    assert lowered.compile().memory_analysis().temp_size_in_bytes > 0


def test_a_generation_libtpu_cannot_target_is_said_so_not_raised(sharder):
    cfg = trainer_config().model_copy(update={"generation": "v2x"})
    result = plan.plan(cfg, capacity_gib=96, headroom=0.1)
    assert result.verdict == "Unsupported" and result.fits is None and result.exit_code == 3
    assert "cannot make a v2x 2x2x1" in result.message and "Invalid TPU external name" in result.message
