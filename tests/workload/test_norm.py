"""RMSNorm's hand-written backward (model.rms_norm) against autodiff of the same formula."""

import jax
import jax.numpy as jnp
import numpy as np

from tpu_workload.model import decoder as model


def _autodiff_norm(x_BTD, scale_D):
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + model.NORM_EPS)
    return (x * scale_D).astype(model.COMPUTE)


def test_norm_and_its_gradients_match_autodiff():
    keys = jax.random.split(jax.random.key(0), 3)
    x = (3 * jax.random.normal(keys[0], (2, 7, 64))).astype(jnp.bfloat16)
    scale = 1 + 0.1 * jax.random.normal(keys[1], (64,))
    probe = jax.random.normal(keys[2], (2, 7, 64))

    def loss(norm):
        return lambda x, s: jnp.sum(norm(x, s).astype(jnp.float32) * probe)

    np.testing.assert_array_equal(model.rms_norm(x, scale), _autodiff_norm(x, scale))
    dx, dscale = jax.grad(loss(model.rms_norm), (0, 1))(x, scale)
    dx_ref, dscale_ref = jax.grad(loss(_autodiff_norm), (0, 1))(x, scale)
    assert dx.dtype == x.dtype and dscale.dtype == scale.dtype
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(dscale, dscale_ref, rtol=1e-5, atol=1e-5)
