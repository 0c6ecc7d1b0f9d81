"""Elastic slices in the trainer: a checkpoint of a two-slice run restores onto one slice bit for bit, and
training on one slice ($TPUJOB_SLICES=1: the same global batch in twice the microbatches) then on two again
stays on the loss curve of an uninterrupted two-slice run (docs/elastic.md)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import trainer_config

from tpu_workload.loop import checkpoint, train
from tpu_workload.model import sharding

TWO_SLICES = dict(data=2, fsdp=4, context=1, expert=1, tensor=1)


def _two_slice_config(**kw):
    # Each slice one host of 4 devices; the batch is split over data x fsdp = 8 shards.
    return trainer_config("tiny", mesh=TWO_SLICES, batch=16, **kw).model_copy(
        update={"slices": 2, "devices_per_host": 4}
    )


def test_a_two_slice_checkpoint_restores_onto_one_slice_bit_for_bit(tmp_path):
    cfg = _two_slice_config(steps=2)
    two = train.build(cfg, sharding.make_mesh(cfg.mesh.shape, 2))
    state = two.init()
    batch = train.data_lib.Batches(train.data_lib.make_source(cfg.training, cfg.model.vocab), two.batch_sharding, 1)
    state, _ = two.step(state, batch(0))  # moments that are not zeros
    saved = jax.device_get(state)
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
    ckpt.save(1, state)
    ckpt.finish()
    ckpt.close()

    one_cfg = cfg.at_slices(1)
    assert (one_cfg.mesh.data, one_cfg.mesh.fsdp, one_cfg.training.microbatches) == (1, 4, 2)
    one_mesh = sharding.make_mesh(one_cfg.mesh.shape, 1, devices=jax.devices()[:4])
    one = train.build(one_cfg, one_mesh)
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
    restored, _ = ckpt.restore(one.abstract_state)
    ckpt.close()
    sharding.check_shardings(restored["params"], one.param_shardings)  # laid out for the smaller mesh
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        assert leaf.sharding.mesh.devices.size == 4, jax.tree_util.keystr(path)
    flat_saved = jax.tree_util.tree_leaves(saved)
    flat_restored = jax.tree_util.tree_leaves(jax.device_get(restored))
    assert len(flat_saved) == len(flat_restored)
    for a, b in zip(flat_saved, flat_restored):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # bit for bit: nothing is recomputed or cast


def _losses(lines):
    return {r["step"]: r["loss"] for r in lines if not r.get("summary")}


@pytest.mark.e2e
@pytest.mark.long  # the trainer's side of test_local_elastic's run (about 2 minutes)
def test_shrink_to_one_slice_and_grow_back_keeps_the_loss_curve(trainers, tmp_path):
    whole = _two_slice_config(steps=9)
    expected = _losses(trainers.run(whole, processes=2, devices=4))

    ckpt = str(tmp_path / "ckpt")
    # The schedule is constant after one warm-up step, so runs of 3, 6 and 9 steps continue each other.
    first = _losses(trainers.run(_two_slice_config(steps=3, checkpoint=ckpt, interval=3), processes=2, devices=4))
    assert first == {s: expected[s] for s in (1, 2, 3)}
    # One slice left: the same config file, told by the operator's $TPUJOB_SLICES that one slice runs.
    shrunk = _losses(
        trainers.run(_two_slice_config(steps=6, checkpoint=ckpt, interval=3), processes=1, devices=4, TPUJOB_SLICES=1)
    )
    assert sorted(shrunk) == [4, 5, 6]
    grown = _losses(
        trainers.run(_two_slice_config(steps=9, checkpoint=ckpt, interval=3), processes=2, devices=4, TPUJOB_SLICES=2)
    )
    assert sorted(grown) == [7, 8, 9]
    got = {**first, **shrunk, **grown}
    # Twice the microbatches of half the rows: the same mean loss and gradient, summed in another order.
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=2e-3)
    print("losses", {s: (round(expected[s], 5), round(got[s], 5)) for s in sorted(got)})
