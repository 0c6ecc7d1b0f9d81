"""Model presets: named decoder shapes from CI-tiny to Llama-3-70B and Mixtral-like MoE.

A preset fills every dimension; fields a user writes next to `preset` override it.
"""

from __future__ import annotations

from typing import Any

# Dimension names match ModelSpec's fields (snake_case; camelCase in YAML).
# RoPE bases as published: Llama 3 500,000 (its model cards), Mixtral 1,000,000 (its config.json).
PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for CI on 2 CPU cores with 8 virtual JAX devices (tests/workload/conftest.py: jax_num_cpu_devices).
    "tiny": dict(layers=2, model_dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256),
    "tiny-moe": dict(
        layers=2, model_dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256, experts=4, experts_per_token=2
    ),
    "small": dict(layers=4, model_dim=256, heads=8, kv_heads=4, head_dim=32, mlp_dim=1024, vocab=4096),
    "llama3-1b": dict(
        layers=16, model_dim=2048, heads=32, kv_heads=8, head_dim=64, mlp_dim=8192, vocab=128256, rope_theta=500000.0
    ),
    "llama3-8b": dict(
        layers=32, model_dim=4096, heads=32, kv_heads=8, head_dim=128, mlp_dim=14336, vocab=128256, rope_theta=500000.0
    ),
    "llama3-70b": dict(
        layers=80, model_dim=8192, heads=64, kv_heads=8, head_dim=128, mlp_dim=28672, vocab=128256, rope_theta=500000.0
    ),
    "mixtral-8x7b": dict(
        layers=32,
        model_dim=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        mlp_dim=14336,
        vocab=32000,
        experts=8,
        experts_per_token=2,
        rope_theta=1000000.0,
    ),
}
