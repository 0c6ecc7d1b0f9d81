"""In-process runs on 8 virtual devices: resume onto another mesh, fp8, remat policies, sharding."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import trainer_config

from tpu_workload.loop import checkpoint, train
from tpu_workload.model import sharding


def _run(cfg, capsys):
    train.run(cfg, peak_flops_per_device=5e10)
    out = capsys.readouterr().out
    return {r["step"]: r["loss"] for r in map(json.loads, out.splitlines()) if not r.get("summary")}


def test_resume_onto_a_different_mesh(tmp_path, capsys):
    a = dict(data=1, fsdp=8, context=1, expert=1, tensor=1)
    b = dict(data=1, fsdp=2, context=2, expert=1, tensor=2)
    expected = _run(trainer_config("tiny", mesh=a, steps=6), capsys)
    first = _run(trainer_config("tiny", mesh=a, steps=3, checkpoint=str(tmp_path)), capsys)
    assert first == {s: expected[s] for s in (1, 2, 3)}
    # The schedule is constant, so a 6-step run continues the 3-step run exactly; another mesh
    # changes only the reduction order.
    resumed = _run(trainer_config("tiny", mesh=b, steps=6, checkpoint=str(tmp_path)), capsys)
    assert sorted(resumed) == [4, 5, 6]
    np.testing.assert_allclose([resumed[s] for s in (4, 5, 6)], [expected[s] for s in (4, 5, 6)], rtol=2e-3)


@pytest.mark.slow
def test_fp8_loss_falls(capsys):
    losses = _run(
        trainer_config("tiny", mesh=dict(data=1, fsdp=4, context=1, expert=1, tensor=2), steps=8, precision="fp8"),
        capsys,
    )
    assert min(losses[6], losses[7], losses[8]) < losses[1] - 0.5


@pytest.mark.slow
@pytest.mark.parametrize(
    "remat",
    [
        dict(policy="minimal"),
        dict(policy="none"),
        dict(policy="custom", tensors=dict(qkv_proj="device", mlp_in="offload", out_proj="remat")),
    ],
)
def test_remat_policies_match_full(remat):
    mesh = sharding.make_mesh(dict(data=1, fsdp=8, context=1, expert=1, tensor=1))

    def one_step(remat_spec):
        cfg = trainer_config("tiny", mesh=dict(data=1, fsdp=8, context=1, expert=1, tensor=1), remat="full")
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"remat": remat_spec})})
        t = train.build(cfg, mesh)
        from tpu_workload.data import batches as data

        batch = data.Batches(data.make_source(cfg.training, cfg.model.vocab), t.batch_sharding, 1)(0)
        _, metrics = t.step(t.init(), batch)
        return float(metrics["loss"]), float(metrics["grad_norm"])

    from tpu_operator.api.contract import RematSpec

    full = one_step(RematSpec(policy="full"))
    np.testing.assert_allclose(one_step(RematSpec(**remat)), full, rtol=1e-5)


def test_parameters_sharded_as_planned_and_mismatch_is_reported():
    cfg = trainer_config("tiny-moe", mesh=dict(data=1, fsdp=2, context=1, expert=2, tensor=2))
    mesh = sharding.make_mesh(cfg.mesh.shape)
    t = train.build(cfg, mesh)
    state = t.init()
    sharding.check_shardings(state["params"], t.param_shardings)
    gate = state["params"]["layers"]["mlp"]["gate"]
    assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
    wrong = dict(state["params"], embed=jax.device_put(state["params"]["embed"], sharding.Sharder(mesh).named(())))
    with pytest.raises(RuntimeError, match="embed"):
        sharding.check_shardings(wrong, t.param_shardings)
    assert checkpoint.abstract_like(state, t.state_shardings)["step"].shape == ()


@pytest.mark.parametrize(
    "preset,axes",
    # Every axis is in the default run (fsdp; context and expert together; tensor); the other sizes of the
    # same axes run with -m long (CI).
    [
        ("tiny", dict(fsdp=8)),
        pytest.param("tiny", dict(fsdp=4, context=2), marks=pytest.mark.long),
        pytest.param("tiny", dict(fsdp=2, context=4), marks=pytest.mark.long),
        pytest.param("tiny-moe", dict(fsdp=4, expert=2), marks=pytest.mark.long),
        pytest.param("tiny-moe", dict(fsdp=2, expert=4), marks=pytest.mark.long),
        ("tiny-moe", dict(fsdp=2, context=2, expert=2)),
        ("tiny", dict(fsdp=4, tensor=2)),
    ],
)
def test_state_is_split_over_every_slice_axis(preset, axes, caplog):
    """Parameters and Adam moments are split over fsdp, context, expert and tensor alike: one device holds
    an eighth of the state on any of these meshes (the norm scales, 64 floats a layer, are not split),
    and the start-up check logs it."""
    mesh = dict(dict(data=1, fsdp=1, context=1, expert=1, tensor=1), **axes)
    cfg = trainer_config(preset, mesh=mesh)
    t = train.build(cfg, sharding.make_mesh(cfg.mesh.shape))
    planned = sharding.state_bytes(t.abstract_state, t.sharder.mesh)
    with caplog.at_level("INFO", logger="tpu_workload.model.sharding"):
        got = sharding.check_state_bytes(t.init(), planned, t.sharder.mesh)
    assert got == planned and got.split == 8
    assert 1.0 <= got.ratio < 1.03, got
    assert f"({got.ratio:.2f}x an even split over 8 devices)" in caplog.text


def test_a_state_not_split_as_planned_is_refused():
    cfg = trainer_config("tiny", mesh=dict(data=1, fsdp=8, context=1, expert=1, tensor=1))
    t = train.build(cfg, sharding.make_mesh(cfg.mesh.shape))
    state = t.init()
    whole = jax.device_put(state["params"]["embed"], sharding.Sharder(t.sharder.mesh).named(()))
    with pytest.raises(RuntimeError, match="not sharded as planned"):
        sharding.check_state_bytes(
            dict(state, params=dict(state["params"], embed=whole)),
            sharding.state_bytes(t.abstract_state, t.sharder.mesh),
            t.sharder.mesh,
        )


@pytest.mark.parametrize(
    "preset,axes",
    # MoE's variant (its load-balancing loss is per microbatch) runs with -m long (CI).
    [("tiny", dict(fsdp=8)), pytest.param("tiny-moe", dict(fsdp=4, expert=2), marks=pytest.mark.long)],
)
def test_accumulated_step_equals_the_whole_batch_step(preset, axes):
    """microbatches: 4 gives the loss and gradients of the unaccumulated step on the same batch. The
    gradients are read from Adam's moments after one step (mu = 0.1 g, nu = 0.05 g^2: no clipping at
    this norm); the parameters themselves would not show them (the first step's learning rate is 0)."""
    from tpu_workload.data import batches as data

    mesh_shape = dict(dict(data=1, fsdp=1, context=1, expert=1, tensor=1), **axes)
    mesh = sharding.make_mesh(mesh_shape)
    results = []
    for micro in (1, 4):
        cfg = trainer_config(preset, mesh=mesh_shape, batch=32, microbatches=micro)
        t = train.build(cfg, mesh)
        batch = data.Batches(data.make_source(cfg.training, cfg.model.vocab), t.batch_sharding, 1)(0)
        state, metrics = t.step(t.init(), batch)
        results.append((metrics, jax.device_get(state["opt"])))
    (whole, opt_whole), (accumulated, opt_accumulated) = results
    assert 0 < float(whole["grad_norm"]) < cfg.training.grad_clip
    # MoE's load-balancing loss is a product of batch statistics: each microbatch's, averaged (as in
    # MaxText), is close to the whole batch's but not equal; the cross entropy is.
    exact = ("loss", "ce", "aux", "grad_norm") if preset == "tiny" else ("ce",)
    for key in exact:
        np.testing.assert_allclose(float(accumulated[key]), float(whole[key]), rtol=1e-4, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(float(accumulated["aux"]), float(whole["aux"]), rtol=1e-2)

    # bf16 rounding (2^-8 relative): the gradients flow through bf16 activations of other shapes; and
    # MoE's per-microbatch load-balancing loss.
    tolerance = 1e-2 if preset == "tiny" else 3e-2

    def close(path, a, b):
        if ".mu" in jax.tree_util.keystr(path):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.linalg.norm(a - b) <= tolerance * np.linalg.norm(b), jax.tree_util.keystr(path)

    jax.tree_util.tree_map_with_path(close, opt_accumulated, opt_whole)
