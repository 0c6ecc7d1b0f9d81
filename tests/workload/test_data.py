"""Token sources: deterministic by (seed, step, row), files read as one stream, env contract."""

from __future__ import annotations

import numpy as np

from tpu_workload.data import batches as data
from tpu_workload.process import runtime


def test_synthetic_rows_do_not_depend_on_how_the_batch_is_split():
    src = data.SyntheticTokens(vocab=256, seq_len=16, batch=8, seed=3)
    whole = src.rows(5, range(0, 8))
    np.testing.assert_array_equal(np.concatenate([src.rows(5, range(0, 3)), src.rows(5, range(3, 8))]), whole)
    assert not np.array_equal(src.rows(6, range(0, 8)), whole)
    assert whole.min() >= 0 and whole.max() < 256


def test_files_stream_across_files(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(0, 50, dtype=np.uint16))
    np.save(tmp_path / "b.npy", np.arange(50, 100, dtype=np.uint16))
    src = data.FileTokens(str(tmp_path), "npy", vocab=1000, seq_len=16, batch=4)
    rows = src.rows(1, range(0, 4))  # global sequences 4..7 -> windows 4, 5, 0, 1 (6 windows)
    assert src.windows == 6
    np.testing.assert_array_equal(rows[0], np.arange(64, 81))
    np.testing.assert_array_equal(rows[2], np.arange(0, 17))
    (tmp_path / "c.bin").write_bytes(np.arange(40, dtype=np.uint16).tobytes())
    binsrc = data.FileTokens(str(tmp_path), "bin", vocab=1000, seq_len=8, batch=2)
    np.testing.assert_array_equal(binsrc.rows(0, range(1, 2))[0], np.arange(8, 17))


def test_env_contract():
    env = runtime.read_env(
        {
            "TPUJOB_COORDINATOR_ADDRESS": "h:1",
            "TPUJOB_NUM_PROCESSES": "8",
            "TPUJOB_SLICE_ID": "1",
            "TPUJOB_HOST_ID": "2",
            "TPUJOB_HOSTS_PER_SLICE": "4",
            "TPUJOB_METRICS_PORT": "0",
            "TPUJOB_LINGER_SECONDS": "5",
        }
    )
    assert (env.process_id, env.num_processes, env.metrics_port, env.linger_s) == (6, 8, 0, 5.0)
    assert runtime.read_env({"TPUJOB_PROCESS_ID": "3"}).process_id == 3
