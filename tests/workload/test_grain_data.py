"""The `files` source as a Grain pipeline: deterministic by step, shuffled per pass, resumable,
read from local files or by byte range from an fsspec URL (the gs:// path)."""

from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pytest
from conftest import trainer_config

from tpu_workload.data import batches as data
from tpu_workload.model import sharding


def _write(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(0, 300, dtype=np.uint16))
    np.save(tmp_path / "b.npy", np.arange(300, 700, dtype=np.uint16))
    return str(tmp_path)


def _batches(src, steps):
    return [src.rows(s, range(0, src.batch)) for s in steps]


def test_unshuffled_windows_are_the_stream_cut_every_seq_tokens(tmp_path):
    src = data.FileTokens(_write(tmp_path), "npy", vocab=1000, seq_len=16, batch=8)
    assert src.windows == 43  # (700 - 1) // 16
    rows = src.rows(3, range(4, 6))  # global sequences 28, 29
    np.testing.assert_array_equal(rows, [np.arange(28 * 16, 28 * 16 + 17), np.arange(29 * 16, 29 * 16 + 17)])
    np.testing.assert_array_equal(src.rows(5, range(3, 4))[0], np.arange(0, 17))  # g = 43 wraps to window 0


def test_shuffle_visits_every_window_once_per_pass_in_a_new_order(tmp_path):
    path = _write(tmp_path)
    src = data.FileTokens(path, "npy", vocab=1000, seq_len=16, batch=1, shuffle=True, seed=7)
    starts = [int(src.rows(s, range(0, 1))[0, 0]) // 16 for s in range(2 * src.windows)]
    first, second = starts[: src.windows], starts[src.windows :]
    assert sorted(first) == sorted(second) == list(range(src.windows))
    assert first != list(range(src.windows)) and first != second
    other_seed = data.FileTokens(path, "npy", vocab=1000, seq_len=16, batch=1, shuffle=True, seed=8)
    other_first = [int(other_seed.rows(s, range(0, 1))[0, 0]) // 16 for s in range(src.windows)]
    assert other_first != first and other_first != second  # seeds are not passes shifted by one


def test_a_reader_built_at_step_k_reads_what_an_uninterrupted_reader_reads(tmp_path):
    path = _write(tmp_path)
    make = lambda: data.FileTokens(path, "npy", vocab=1000, seq_len=16, batch=8, shuffle=True, seed=1)  # noqa: E731
    uninterrupted = _batches(make(), range(10))
    resumed = _batches(make(), range(6, 10))  # a fresh process after resuming at step 6
    for a, b in zip(uninterrupted[6:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    split = make()  # how the batch is split over processes does not change it
    np.testing.assert_array_equal(
        np.concatenate([split.rows(7, range(0, 3)), split.rows(7, range(3, 8))]), uninterrupted[7]
    )


@pytest.mark.parametrize("fmt", ["npy", "bin"])
def test_url_files_are_read_by_byte_range_like_local_ones(tmp_path, fmt):
    """fsspec's in-memory filesystem stands in for gs:// (same code path: glob, header, ranged reads)."""
    fs = fsspec.filesystem("memory")
    root = f"memory://tokens-{uuid.uuid4().hex}"
    chunks = [np.arange(0, 300, dtype=np.uint16), np.arange(300, 700, dtype=np.uint16)]
    for i, chunk in enumerate(chunks):
        local = tmp_path / f"{i}.{fmt}"
        np.save(local, chunk) if fmt == "npy" else local.write_bytes(chunk.tobytes())
        fs.pipe(f"{root}/{i}.{fmt}", local.read_bytes())
    fs.pipe(f"{root}/notes.txt", b"ignored: another extension")
    ranged = []
    cat_file = fs.cat_file
    fs.cat_file = lambda path, start=None, end=None, **kw: (
        ranged.append(end - start) or cat_file(path, start, end, **kw)
    )
    try:
        remote = data.FileTokens(root, fmt, vocab=1000, seq_len=16, batch=8, shuffle=True, seed=3)
        local = data.FileTokens(str(tmp_path), fmt, vocab=1000, seq_len=16, batch=8, shuffle=True, seed=3)
        for step in (0, 5):
            np.testing.assert_array_equal(remote.rows(step, range(0, 8)), local.rows(step, range(0, 8)))
    finally:
        del fs.cat_file
    assert ranged and max(ranged) <= 17 * 2  # one window of uint16 tokens at a time, never a whole file


def test_no_files_and_too_few_tokens_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no bin files match .*\*\.bin"):
        data.FileTokens(str(tmp_path), "bin", vocab=1000, seq_len=16, batch=8)
    np.save(tmp_path / "short.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ValueError, match="fewer than one sequence of 17"):
        data.FileTokens(str(tmp_path), "npy", vocab=1000, seq_len=16, batch=8)


def test_trainer_batches_come_from_the_grain_source(tmp_path):
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 256, 8 * 129 * 3, dtype=np.uint16))
    cfg = trainer_config(
        "tiny",
        mesh=dict(data=1, fsdp=4, context=2, expert=1, tensor=1),
        data=dict(source="files", path=str(tmp_path), format="npy"),
    )
    mesh = sharding.make_mesh(cfg.mesh.shape)
    batch_sharding = sharding.Sharder(mesh).named(("batch", "length"), (8, 128))
    src = data.make_source(cfg.training, cfg.model.vocab)
    seq = src.rows(4, range(0, 8))
    for workers in (0, 3):  # on the training thread, and read ahead by worker threads
        batch = data.Batches(src, batch_sharding, context=2, workers=workers, prefetch=2)(4)
        assert batch.segments is None and batch.mask is None  # unpacked: the step is unchanged
        order = np.asarray(batch.positions)[0]
        np.testing.assert_array_equal(np.asarray(batch.inputs), seq[:, :-1][:, order])
        np.testing.assert_array_equal(np.asarray(batch.targets), seq[:, 1:][:, order])
