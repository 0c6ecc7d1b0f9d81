"""flops_per_step pinned against a hand count (MaxText accounting)."""

from __future__ import annotations

from tpu_operator.api.contract import ModelDims, TrainingSpec
from tpu_operator.api.presets import PRESETS
from tpu_workload.performance.flops import flops_per_step, mfu


def test_dense_hand_count():
    # tiny: L=2, E=64, Hq=4, Hkv=2, d=16, F=128, V=256; batch 8 x 128 tokens = 1024 tokens.
    qkv = 2 * 1024 * 64 * (4 + 2 * 2) * 16  # 16,777,216
    out = 2 * 1024 * 64 * 4 * 16  # 8,388,608
    attn = 4 * 8 * 128 * 128 * 4 * 16 // 2  # 16,777,216 (causal: halved)
    ffn = 2 * 1024 * 64 * 128 * 3  # 50,331,648
    unembed = 2 * 1024 * 64 * 256  # 33,554,432
    assert 3 * (2 * (qkv + out + attn + ffn) + unembed) == 654_311_424
    got = flops_per_step(ModelDims(**PRESETS["tiny"]), TrainingSpec(steps=1, global_batch=8, sequence_length=128))
    assert got == 654_311_424


def test_moe_hand_count():
    # tiny-moe: 4 experts, top-2: router 2*1024*64*4 + 2 x SwiGLU.
    per_layer = 16_777_216 + 8_388_608 + 16_777_216 + (2 * 1024 * 64 * 4 + 2 * 50_331_648)
    assert 3 * (2 * per_layer + 33_554_432) == 959_447_040
    got = flops_per_step(ModelDims(**PRESETS["tiny-moe"]), TrainingSpec(steps=1, global_batch=8, sequence_length=128))
    assert got == 959_447_040


def test_mfu():
    assert mfu(1e12, 0.5, 1e12, 4) == 0.5
