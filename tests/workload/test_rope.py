"""RoPE's frequencies: the presets' published bases, and Llama 3.1's long-context scaling."""

import math

import jax.numpy as jnp
import numpy as np

from tpu_operator.api.spec import ModelSpec
from tpu_workload.model import decoder as model


def test_presets_carry_their_published_rope_base():
    assert ModelSpec(preset="llama3-8b").dims().rope_theta == 500_000
    assert ModelSpec(preset="llama3-70b").dims().rope_theta == 500_000
    assert ModelSpec(preset="mixtral-8x7b").dims().rope_theta == 1_000_000
    assert ModelSpec(preset="tiny").dims().rope_theta == 10_000
    assert ModelSpec(preset="llama3-8b", ropeTheta=10_000).dims().rope_theta == 10_000  # a field overrides


def test_llama3_scaling_keeps_short_wavelengths_and_divides_long_ones_by_8():
    plain = np.asarray(model.rope_frequencies(128, 500_000.0))
    scaled = np.asarray(model.rope_frequencies(128, 500_000.0, "llama3"))
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 8192 / 4, wavelength > 8192
    assert short.any() and long.any() and (~short & ~long).any()  # all three bands occur at head_dim 128
    np.testing.assert_allclose(scaled[short], plain[short], rtol=1e-6)
    np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-6)
    between = ~short & ~long  # blended: strictly between freq / 8 and freq, still decreasing
    assert np.all((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8))
    assert np.all(np.diff(scaled) < 0)


def test_rope_rotates_by_position_and_keeps_norms():
    freq = model.rope_frequencies(16, 10_000.0)
    x = jnp.ones((1, 3, 2, 16), jnp.float32)
    y = np.asarray(model.rope(x, jnp.arange(3)[None], freq))
    np.testing.assert_allclose(y[0, 0], np.asarray(x[0, 0]))  # position 0: unrotated
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(np.asarray(x), axis=-1), rtol=1e-6)
