"""Splash block sizes tuned with tune-jax (interpret mode on the CPU), cached per chip and shape."""

from __future__ import annotations

import json
import uuid

import jax
import pytest
import tune_jax

from conftest import trainer_config
from tpu_operator.api.contract import KernelsSpec, SplashSpec
from tpu_workload import train, tuning

FSDP8 = dict(data=1, fsdp=8, context=1, expert=1, tensor=1)


def splash_config(cache: str, seq: int = 128, **splash):
    """The tiny preset with Splash attention, `splash` block sizes (default: all defaults), a cache."""
    cfg = trainer_config("tiny", mesh=FSDP8, attention="splash", seq=seq)
    return cfg.model_copy(update={"kernels": KernelsSpec(attention="splash", splash=SplashSpec(**splash),
                                                         tuning_cache=cache)})


@pytest.fixture(autouse=True)
def _absl_parsed():
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags


def test_tune_writes_cache_then_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tune_jax.CONFIG, "profiling_samples", 1)
    blocks = tuning.tune_splash_blocks(256, 1, 128, cache_dir=str(tmp_path), search={"block_kv": [128, 256]})
    assert blocks["block_kv"] in (128, 256) and blocks["block_kv_compute"] == blocks["block_kv"]
    assert set(blocks) == set(tuning.BLOCK_FIELDS)
    key = tuning.cache_key(256, 1, 128, jax.devices()[0].device_kind)
    assert json.loads((tmp_path / tuning.CACHE_FILE).read_text()) == {key: blocks}

    def no_tuning(*args, **kwargs):
        raise AssertionError("cached shape was tuned again")

    monkeypatch.setattr(tune_jax, "tune", no_tuning)
    assert tuning.tune_splash_blocks(256, 1, 128, cache_dir=str(tmp_path), search={"block_kv": [128]}) == blocks


def test_the_step_uses_tuned_blocks_only_where_the_config_leaves_the_defaults(tmp_path):
    tuned = {f: 128 for f in tuning.BLOCK_FIELDS}
    key = tuning.cache_key(128, 4, 16, jax.devices()[0].device_kind)  # the tiny preset at sequence 128
    (tmp_path / tuning.CACHE_FILE).write_text(json.dumps({key: tuned}))
    cfg = splash_config(str(tmp_path))
    assert (cfg.model.heads, cfg.model.head_dim, cfg.training.sequence_length) == (4, 16, 128)
    assert train.model_config(cfg, interpret=True).kernels.splash == SplashSpec(**tuned)
    mine = splash_config(str(tmp_path), block_q=256)
    assert train.model_config(mine, interpret=True).kernels.splash == SplashSpec(block_q=256)  # the user's
    longer = splash_config(str(tmp_path), seq=256)
    assert train.model_config(longer, interpret=True).kernels.splash == SplashSpec()  # no entry: defaults


def test_a_step_compiled_for_a_tpu_looks_up_that_chips_blocks_not_this_processs(tmp_path):
    """Ahead of time (tpu_workload.plan) this process's devices are CPUs: the mesh's chip names the entry."""
    tuned = {f: 256 for f in tuning.BLOCK_FIELDS}
    (tmp_path / tuning.CACHE_FILE).write_text(json.dumps({tuning.cache_key(128, 4, 16, "TPU7x"): tuned}))
    cfg = splash_config(str(tmp_path))
    assert train.model_config(cfg, interpret=False, device_kind="TPU7x").kernels.splash == SplashSpec(**tuned)
    assert train.model_config(cfg, interpret=True).kernels.splash == SplashSpec()  # this CPU: no entry


def test_cli_tunes_the_configs_shape_into_a_url_cache(tmp_path, monkeypatch, capsys):
    """An fsspec memory:// directory stands in for gs:// (same read/merge/write path)."""
    monkeypatch.setattr(tune_jax.CONFIG, "profiling_samples", 1)
    monkeypatch.setattr(tuning, "DEFAULT_SEARCH", {"block_q": (128,), "block_kv": (128,)})
    cache = f"memory://tuning-{uuid.uuid4().hex}"
    tuning._write(cache, "other-chip|seq=1|heads=1|head_dim=1", {"block_q": 512})
    cfg = splash_config(cache)
    path = tmp_path / "config.json"
    path.write_text(cfg.model_dump_json(by_alias=True))
    assert tuning.main(["--config", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["blocks"]["block_q"] == out["blocks"]["block_kv"] == 128
    assert set(tuning._read(cache)) == {"other-chip|seq=1|heads=1|head_dim=1", out["key"]}  # merged
    assert train.model_config(cfg, interpret=True).kernels.splash.block_kv_compute == 128
