"""Analytic training FLOPs per step, MaxText's accounting (see shared/JAX.md "FLOPs and MFU").

Forward FLOPs per layer with b·s tokens: QKV 2·bs·E·(Hq+2Hkv)·d, output projection 2·bs·E·Hq·d,
causal attention 4·b·s²·Hq·d / 2, SwiGLU 2·bs·E·F·3 (MoE: router 2·bs·E·experts plus top-k ×
SwiGLU); plus the unembedding 2·bs·E·V. Training = 3 × forward (forward + backward);
rematerialisation is not counted. XLA's cost analysis counts a scanned body once, so this is
pinned by a hand count in the tests instead.
"""

from __future__ import annotations

from tpu_operator.api.contract import ModelDims, TrainingSpec


def flops_per_step(model: ModelDims, training: TrainingSpec) -> float:
    """Training FLOPs of one optimizer step over the whole global batch (all devices)."""
    b, s = training.global_batch, training.sequence_length
    tokens = b * s
    E, d = model.model_dim, model.head_dim
    qkv = 2 * tokens * E * (model.heads + 2 * model.kv_heads) * d
    out_proj = 2 * tokens * E * model.heads * d
    attn = 4 * b * s * s * model.heads * d / 2
    ffn = 2 * tokens * E * model.mlp_dim * 3
    if model.is_moe:
        ffn = 2 * tokens * E * model.experts + model.experts_per_token * ffn
    unembed = 2 * tokens * E * model.vocab
    forward = model.layers * (qkv + out_proj + attn + ffn) + unembed
    return 3.0 * forward


def mfu(flops: float, step_time_s: float, peak_per_device: float, devices: int) -> float:
    return flops / step_time_s / (peak_per_device * devices)
