"""What an ML engineer sets and reads: evaluation, the per-step metrics, the loss's weights, Adam's
settings, and the refusal of a resume onto changed data (in-process runs on 8 virtual devices)."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import trainer_config

from tpu_operator.api.contract import TrainingSpec
from tpu_workload.loop import train
from tpu_workload.process import exits

FSDP8 = dict(data=1, fsdp=8, context=1, expert=1, tensor=1)


def _records(cfg, capsys, peak=5e10):
    train.run(cfg, peak_flops_per_device=peak)
    return [r for r in map(json.loads, capsys.readouterr().out.splitlines()) if not r.get("summary")]


def test_evaluation_reports_held_out_loss_and_never_changes_training(capsys):
    plain = _records(trainer_config("tiny", mesh=FSDP8, steps=5), capsys)
    evaluated = _records(
        trainer_config("tiny", mesh=FSDP8, steps=5, log_every=2, eval=dict(interval=2, batches=2)), capsys
    )
    # Reported at every second step and the last; logEvery 2 would skip step 5, an evaluation does not.
    assert [r["step"] for r in evaluated] == [2, 4, 5]
    assert all(r["eval_loss"] is not None for r in evaluated)
    for r in evaluated:
        assert r["loss"] == plain[r["step"] - 1]["loss"]  # bit for bit: evaluation reads, never writes
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
    # The held-out loss of synthetic data falls as training does (held-out sequences, same rule).
    assert evaluated[-1]["eval_loss"] < evaluated[0]["eval_loss"]


def test_every_step_reports_its_parts_rate_and_throughput(capsys):
    cfg = trainer_config(
        "tiny-moe",
        mesh=dict(data=1, fsdp=4, context=1, expert=2, tensor=1),
        steps=3,
        lr=1e-2,
        z_loss_weight=1e-3,
        moe_aux_loss_weight=0.05,
    )
    cfg = cfg.model_copy(update={"peak_bf16_flops_per_device": cfg.peak_flops_per_device / 2})
    records = _records(cfg, capsys)
    for r in records:
        assert r["loss"] == pytest.approx(r["ce"] + 0.05 * r["aux"] + 1e-3 * r["z_loss"], rel=1e-5)
        assert r["aux"] > 0 and r["z_loss"] > 0 and r["grad_norm"] > 0
        assert r["tflops_per_device"] == pytest.approx(r["mfu"] * 5e10 / 1e12, rel=1e-6)
        assert r["mfu_bf16"] == pytest.approx(2 * r["mfu"], rel=1e-6)  # a bf16 peak half the fp8 one
        assert r["global_tokens_per_s"] == pytest.approx(8 * 128 / r["step_time_s"], rel=1e-6)
    # The rate each step's update used: warm-up from 0 over one step, then the constant peak.
    assert [r["learning_rate"] for r in records] == pytest.approx([0.0, 1e-2, 1e-2])


def test_without_a_different_bf16_peak_no_second_mfu(capsys):
    (record,) = _records(trainer_config("tiny", mesh=FSDP8, steps=1), capsys)
    assert record["mfu_bf16"] is None and record["z_loss"] == 0.0 and record["aux"] == 0.0


def test_adam_settings_reach_the_update():
    spec = TrainingSpec(
        steps=10,
        global_batch=1,
        sequence_length=2,
        grad_clip=0,
        weight_decay=0,
        learning_rate=dict(peak=0.1, schedule="constant"),
        adam=dict(beta1=0.5, beta2=0.75, epsilon=0.25),
    )
    tx = train.optimizer(spec)
    params = {"w": jnp.array([1.0])}
    state = tx.init(params)
    for g in (2.0, -1.0):
        updates, state = tx.update({"w": jnp.array([g])}, state, params)
    # Adam by hand: m = 0.5 m + 0.5 g, v = 0.75 v + 0.25 g^2, bias-corrected, lr m / (sqrt(v) + eps).
    m, v = 0.0, 0.0
    for _t, g in enumerate((2.0, -1.0), 1):
        m, v = 0.5 * m + 0.5 * g, 0.75 * v + 0.25 * g * g
    want = -0.1 * (m / (1 - 0.5**2)) / (math.sqrt(v / (1 - 0.75**2)) + 0.25)
    np.testing.assert_allclose(np.asarray(updates["w"]), [want], rtol=1e-6)
    assert isinstance(tx, optax.GradientTransformation)


def test_a_resume_onto_changed_data_is_refused_naming_the_field(tmp_path, capsys):
    first = trainer_config("tiny", mesh=FSDP8, steps=2, checkpoint=str(tmp_path), interval=1)
    _records(first, capsys)
    changed = trainer_config("tiny", mesh=FSDP8, steps=4, batch=16, checkpoint=str(tmp_path), interval=1)
    with pytest.raises(exits.UserError, match=r"spec\.training\.globalBatch: 8 at the checkpoint, 16 now.*allowChange"):
        _records(changed, capsys)
    allowed = trainer_config(
        "tiny", mesh=FSDP8, steps=4, batch=16, checkpoint=str(tmp_path), interval=1, data=dict(allow_change=True)
    )
    assert [r["step"] for r in _records(allowed, capsys)] == [3, 4]
    # The checkpoints from here on record the new order: a plain resume of it is accepted.
    more = trainer_config("tiny", mesh=FSDP8, steps=5, batch=16, checkpoint=str(tmp_path), interval=1)
    assert [r["step"] for r in _records(more, capsys)] == [5]


def test_files_added_under_the_data_path_are_a_change(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.arange(20000, dtype=np.uint16) % 256)
    files = dict(source="files", path=str(data), format="npy")
    cfg = trainer_config("tiny", mesh=FSDP8, steps=2, checkpoint=str(tmp_path / "ckpt"), interval=1, data=files)
    _records(cfg, capsys)
    np.save(data / "b.npy", np.arange(20000, dtype=np.uint16) % 256)
    more = trainer_config("tiny", mesh=FSDP8, steps=3, checkpoint=str(tmp_path / "ckpt"), interval=1, data=files)
    with pytest.raises(exits.UserError, match=r"spec\.training\.data\.files: 1 added \(.*b\.npy\)"):
        _records(more, capsys)


def test_a_trace_reads_by_layer_and_block():
    """The step's ops carry the model's named scopes, which a profile (docs/profiling.md) shows."""
    import re

    from tpu_workload.data import batches as data_lib
    from tpu_workload.model import sharding

    for preset, block in (("tiny", "mlp"), ("tiny-moe", "moe")):
        cfg = trainer_config(preset, steps=1, mesh=FSDP8)
        trainer = train.build(cfg, sharding.make_mesh(cfg.mesh.shape, 1))
        batch = data_lib.Batches(data_lib.make_source(cfg.training, cfg.model.vocab), trainer.batch_sharding, 1)(0)
        text = trainer.step.lower(trainer.abstract_state, batch).as_text(debug_info=True)
        # e.g. "jit(train_step)/jvp(embed)/shard_map", ".../checkpoint/layer/attention/dot_general"
        names = set(re.findall(r"[(/](embed|layer/attention|layer/" + block + r"|lm_head_loss)[)/]", text))
        assert names == {"embed", "layer/attention", f"layer/{block}", "lm_head_loss"}, preset


def test_a_packed_row_trains_as_its_documents_would_alone():
    """Two documents and padding in one row: the loss is the token-weighted mean of each document's
    own loss (attention never crosses a document, positions restart, padding and a document's last
    token count for nothing)."""
    from flax import nnx

    from tpu_operator.api.contract import KernelsSpec, ModelDims
    from tpu_workload.model import decoder as model_lib

    dims = ModelDims(layers=2, model_dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=128, vocab=256)
    model = model_lib.Decoder(model_lib.ModelConfig(dims=dims, kernels=KernelsSpec(attention="xla")), nnx.Rngs(0))
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 256, 40), rng.integers(1, 256, 25)
    row = np.concatenate([a, b, np.zeros(16, int)])  # 81 tokens: 80 inputs and their 80 targets
    seg = np.concatenate([np.full(40, 1), np.full(25, 2), np.zeros(15, int)])
    pos = np.concatenate([np.arange(40), np.arange(25), np.zeros(15, int)])
    mask = np.concatenate([np.ones(39), [0], np.ones(24), [0], np.zeros(15)])
    as_row = lambda x, dtype=jnp.int32: jnp.asarray(x, dtype)[None]  # noqa: E731
    packed, parts = model_lib.loss_fn(
        model, as_row(row[:80]), as_row(row[1:]), as_row(pos), as_row(seg), as_row(mask, jnp.float32)
    )

    def alone(doc):
        n = len(doc) - 1
        return float(model_lib.loss_fn(model, as_row(doc[:-1]), as_row(doc[1:]), as_row(np.arange(n)))[0]), n

    (la, na), (lb, nb) = alone(a), alone(b)
    np.testing.assert_allclose(float(parts["ce"]), (la * na + lb * nb) / (na + nb), rtol=2e-3)
