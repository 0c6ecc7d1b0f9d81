"""Packing (packing.py): whole documents per row, never split; positions, segments and mask exact;
rows a pure function of (seed, step); ArrayRecord documents; the synthetic packed source."""

from __future__ import annotations

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from conftest import trainer_config

from tpu_workload.data import batches as data
from tpu_workload.data import packing, records
from tpu_workload.model import attention, sharding

EOS = 99
# Four documents, the last one without its EOS, the second across the two files.
STREAM = [1, 2, EOS, 3, 4, 5, 6, EOS, 7, EOS, 8, 9]


def _files(tmp_path):
    np.save(tmp_path / "a.npy", np.array(STREAM[:5], np.uint16))
    np.save(tmp_path / "b.npy", np.array(STREAM[5:], np.uint16))
    return str(tmp_path)


def _batch(src, step, context=1, **kw):
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, context=context, expert=1, tensor=2 // context))
    named = sharding.Sharder(mesh).named(("batch", "length"), (src.batch, src.seq_len))
    batches = data.Batches(src, named, context=context, **kw)
    try:
        return {k: None if v is None else np.asarray(v) for k, v in batches(step)._asdict().items()}
    finally:
        batches.close()


def test_a_hand_built_batch_is_exact(tmp_path):
    # Capacity 5: [1 2 E] and [7 E] share row 0 (first fit), [3 4 5 6 E] fills row 1, [8 9] row 2.
    src = data.PackedFiles(_files(tmp_path), "npy", vocab=100, seq_len=4, batch=4, eos=EOS)
    for workers in (0, 2):
        b = _batch(src, 0, workers=workers)  # global sequences 0..3: rows 0, 1, 2 and row 0 again
        np.testing.assert_array_equal(b["inputs"], [[1, 2, EOS, 7], [3, 4, 5, 6], [8, 9, 0, 0], [1, 2, EOS, 7]])
        np.testing.assert_array_equal(b["targets"], [[2, EOS, 7, EOS], [4, 5, 6, EOS], [9, 0, 0, 0], [2, EOS, 7, EOS]])
        np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 0], [0, 1, 2, 0]])
        np.testing.assert_array_equal(b["segments"], [[1, 1, 1, 2], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 2]])
        # 0 where the target is another document's (row 0, token 3 -> 7) or padding.
        np.testing.assert_array_equal(b["mask"], [[1, 1, 0, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 1]])
        assert (b["inputs"].dtype, b["segments"].dtype, b["mask"].dtype) == (np.int32, np.int32, np.float32)


def test_context_parallel_batches_permute_every_part_alike(tmp_path):
    src = data.SyntheticDocuments(vocab=256, seq_len=16, batch=4, seed=2)
    plain, balanced = _batch(src, 3), _batch(src, 3, context=2)
    order = attention.load_balance_order(16, 2)
    for key in plain:
        np.testing.assert_array_equal(balanced[key], plain[key][:, order], err_msg=key)


def test_documents_are_whole_and_rows_repeat_for_the_same_seed_and_step(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 99, rng.integers(1, 40)), EOS) for _ in range(200)]
    np.save(tmp_path / "tokens.npy", np.concatenate(docs).astype(np.uint16))
    make = lambda: data.PackedFiles(  # noqa: E731
        str(tmp_path),
        "npy",
        vocab=100,
        seq_len=24,
        batch=8,
        eos=EOS,
        shuffle=True,
        seed=4,
    )
    src, again = make(), make()
    cut = {tuple(d[:25]) for d in docs}  # each document cut to sequenceLength + 1
    seen = set()
    for step in range(len(src.source) // 8 + 2):  # past a whole pass
        rows = src.rows(step, range(0, 8))
        other = again.rows(step, range(0, 8))
        np.testing.assert_array_equal(rows.tokens, other.tokens)
        np.testing.assert_array_equal(rows.segments, other.segments)
        for tokens, segments in zip(*rows):
            for s in range(1, segments.max() + 1):
                doc = tuple(tokens[segments == s])
                assert doc in cut  # whole, in one piece
                seen.add(doc)
            ordered = np.where(segments > 0, segments, segments.max() + 1)  # documents 1, 2, .., then padding
            assert (np.diff(ordered) >= 0).all()
    assert seen == cut  # a pass covers every document


def test_array_record_documents_round_trip(tmp_path):
    docs = [[5, 6, 7], list(range(1, 30)), [70000, 70001]]  # a uint32 vocabulary
    writer = ArrayRecordWriter(str(tmp_path / "docs-00000.array_record"), "group_size:1")
    for doc in docs:
        writer.write(records.encode(doc, np.uint32))
    writer.close()
    stored = records.Documents(str(tmp_path), np.uint32)
    np.testing.assert_array_equal(stored.lengths(), [3, 29, 2])
    np.testing.assert_array_equal(stored.read(1, 29), docs[1])
    src = data.PackedFiles(str(tmp_path), "arrayrecord", vocab=80000, seq_len=7, batch=2)
    rows = src.rows(0, range(0, 2))
    # Capacity 8: [5 6 7] opens row 0, the long document is cut to 8 and fills row 1, [70000 70001]
    # joins row 0.
    np.testing.assert_array_equal(rows.tokens, [[5, 6, 7, 70000, 70001, 0, 0, 0], list(range(1, 9))])
    np.testing.assert_array_equal(rows.segments, [[1, 1, 1, 2, 2, 0, 0, 0], [1] * 8])


def test_first_fit_fills_the_oldest_open_row_with_room():
    order, offsets = packing.first_fit(np.array([3, 5, 2, 4, 8, 1]), capacity=8)
    rows = [order[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert rows == [[0, 1], [2, 3, 5], [4]]


def test_synthetic_packing_is_deterministic_and_varied():
    src = data.SyntheticDocuments(vocab=256, seq_len=64, batch=8, seed=1)
    rows = src.rows(7, range(0, 8))
    np.testing.assert_array_equal(rows.tokens, data.SyntheticDocuments(256, 64, 8, 1).rows(7, range(0, 8)).tokens)
    split = [src.rows(7, range(0, 3)).segments, src.rows(7, range(3, 8)).segments]
    np.testing.assert_array_equal(np.concatenate(split), rows.segments)
    lengths = [int((row == s).sum()) for row in rows.segments for s in range(1, row.max() + 1)]
    assert len(set(lengths)) > 5 and min(lengths) >= 2
    assert (rows.segments.max(axis=1) >= 2).all()  # several documents a row


def test_packing_needs_its_settings():
    from tpu_operator.api.contract import DataSpec

    with pytest.raises(ValueError, match="eosId: required when packing bin files"):
        DataSpec(source="files", path="/d", format="bin", packing=True)
    with pytest.raises(ValueError, match="packing: required with format arrayrecord"):
        DataSpec(source="files", path="/d", format="arrayrecord")
    cfg = trainer_config("tiny", data=dict(packing=True))
    assert isinstance(data.make_source(cfg.training, cfg.model.vocab), data.SyntheticDocuments)


def test_a_packed_job_trains_with_accumulation(capsys):
    """The step takes the packed Batch whole (segments and mask too), through the microbatch split."""
    from tpu_workload.loop import train

    cfg = trainer_config(
        "tiny",
        steps=2,
        batch=8,
        seq=32,
        microbatches=2,
        data=dict(packing=True),
        mesh=dict(data=1, fsdp=4, context=2, expert=1, tensor=1),
    )
    summary = train.run(cfg, peak_flops_per_device=5e10)
    assert summary.step == 2 and np.isfinite(summary.loss)


def test_array_record_files_behind_a_url_are_read_from_a_local_copy(tmp_path):
    """fsspec's in-memory filesystem stands in for gs:// (the ArrayRecord reader opens local paths only)."""
    import uuid

    import fsspec

    local = tmp_path / "docs.array_record"
    writer = ArrayRecordWriter(str(local), "group_size:1")
    for doc in ([1, 2, 3], [4, 5]):
        writer.write(records.encode(doc, np.uint16))
    writer.close()
    root = f"memory://docs-{uuid.uuid4().hex}"
    fsspec.filesystem("memory").pipe(f"{root}/docs.array_record", local.read_bytes())
    stored = records.Documents(root, np.uint16)
    np.testing.assert_array_equal(stored.lengths(), [3, 2])
    np.testing.assert_array_equal(stored.read(1, 2), [4, 5])
