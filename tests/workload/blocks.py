"""The smallest Splash block sizes, 128 tokens on every pass: what the CPU tests' short sequences take
(the defaults, 512, are fitted down anyway; these say it once for the tests that compare kernels)."""

from __future__ import annotations

from tpu_operator.api.contract import SplashSpec

SMALLEST_BLOCKS = SplashSpec(**{name: 128 for name in SplashSpec.model_fields if name.startswith("block_")})
