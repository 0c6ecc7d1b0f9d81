"""Kernel tiles tuned with tune-jax (interpret mode on the CPU), cached per chip and per-device shape:
Splash block sizes and the grouped matmul's tiles."""

from __future__ import annotations

import json
import uuid

import fsspec
import fsspec.implementations.memory
import jax
import pytest
import tune_jax
from conftest import trainer_config
from fsspec.registry import _registry

from tpu_operator.api.contract import GmmSpec, GmmTiles, KernelsSpec, SplashSpec
from tpu_workload.loop import train
from tpu_workload.performance import tuning

FSDP8 = dict(data=1, fsdp=8, context=1, expert=1, tensor=1)
KIND = jax.devices()[0].device_kind


def splash_config(cache: str, seq: int = 128, mesh=FSDP8, **splash):
    """The tiny preset with Splash attention, `splash` block sizes (default: all defaults), a cache."""
    cfg = trainer_config("tiny", mesh=mesh, attention="splash", seq=seq)
    return cfg.model_copy(
        update={"kernels": KernelsSpec(attention="splash", splash=SplashSpec(**splash), tuning_cache=cache)}
    )


@pytest.fixture(autouse=True)
def _one_sample(monkeypatch):
    monkeypatch.setattr(tune_jax.CONFIG, "profiling_samples", 1)


def test_the_search_runs_only_the_sizes_each_pass_reads(tmp_path, monkeypatch):
    """Splash: forward blocks on the forward, then dK/dV, then dQ; no dQ stage for tokamax's fused
    backward (maxLogitConst). 9 timings a stage, 27 in all, where one search over all six sizes was 729."""
    seen = []

    def record(fn, search, *args):
        seen.append(sorted(search))
        return {f: values[0] for f, values in search.items()}

    monkeypatch.setattr(tuning, "_tune", record)
    shape = tuning.SplashShape(seq=256, context=1, heads=1, head_dim=128)
    tuning.tune_splash(shape, cache_dir=str(tmp_path))
    assert seen == [["block_kv", "block_q"], ["block_kv_dkv", "block_q_dkv"], ["block_kv_dq", "block_q_dq"]]
    search = tuning.splash_search(shape)
    assert (
        sum(len(s["block_q" if stage == "forward" else f"block_q_{stage}"]) ** 2 for stage, s in search.items()) == 27
    )
    seen.clear()
    fused = tuning.SplashShape(seq=256, context=1, heads=1, head_dim=128, fused_backward=True)
    tuning.tune_splash(fused, cache_dir=str(tmp_path), max_logit_const=30.0)
    assert seen == [["block_kv", "block_q"], ["block_kv_dkv", "block_q_dkv"]]


def test_tune_writes_cache_then_reads_it(tmp_path, monkeypatch):
    shape = tuning.SplashShape(seq=256, context=1, heads=1, head_dim=128)
    blocks = tuning.tune_splash(shape, cache_dir=str(tmp_path), search={"forward": {"block_kv": (128, 256)}})
    assert blocks["block_kv"] in (128, 256) and blocks["block_kv_compute"] == blocks["block_kv"]
    assert set(blocks) == set(tuning.BLOCK_FIELDS)
    assert json.loads((tmp_path / tuning.CACHE_FILE).read_text()) == {shape.key(KIND): blocks}

    def no_tuning(*args, **kwargs):
        raise AssertionError("cached shape was tuned again")

    monkeypatch.setattr(tune_jax, "tune", no_tuning)
    assert tuning.tune_splash(shape, cache_dir=str(tmp_path)) == blocks


def test_a_context_shard_is_timed_on_its_own_queries(tmp_path):
    """Context 2: the kernel runs as shard 0 runs it (half the queries, the whole sequence's keys)."""
    shape = tuning.SplashShape(seq=512, context=2, heads=2, head_dim=128)
    blocks = tuning.tune_splash(shape, cache_dir=str(tmp_path), search={"forward": {"block_q": (128, 256)}})
    assert blocks["block_q"] in (128, 256)


def test_the_cache_key_names_every_degree_that_changes_the_kernels_shapes():
    base = dict(data=1, fsdp=2, context=1, expert=1, tensor=1)
    keys = {
        tuning.SplashShape.of(splash_config("/c", seq=256, mesh=dict(base, **change))).key(KIND)
        for change in ({}, dict(fsdp=1, context=2), dict(fsdp=1, tensor=2))
    }
    assert len(keys) == 3, keys  # fsdp changes nothing a device's kernel sees; context and tensor do
    moe = trainer_config("tiny-moe", mesh=dict(base, fsdp=1, expert=2))
    assert tuning.GmmShape.of(moe) == tuning.GmmShape(rows=2 * 512 * 2, d=64, f=128, experts=2)


def test_the_step_uses_tuned_blocks_only_where_the_config_leaves_the_defaults(tmp_path):
    tuned = {f: 128 for f in tuning.BLOCK_FIELDS}
    cfg = splash_config(str(tmp_path))
    (tmp_path / tuning.CACHE_FILE).write_text(json.dumps({tuning.SplashShape.of(cfg).key(KIND): tuned}))
    assert train.model_config(cfg, interpret=True).kernels.splash == SplashSpec(**tuned)
    mine = splash_config(str(tmp_path), block_q=256)
    assert train.model_config(mine, interpret=True).kernels.splash == SplashSpec(block_q=256)  # the user's
    longer = splash_config(str(tmp_path), seq=256)
    assert train.model_config(longer, interpret=True).kernels.splash == SplashSpec()  # no entry: defaults


def test_a_step_compiled_for_a_tpu_looks_up_that_chips_blocks_not_this_processs(tmp_path):
    """Ahead of time (tpu_workload.performance.plan) this process's devices are CPUs: the mesh's chip names the entry."""
    tuned = {f: 256 for f in tuning.BLOCK_FIELDS}
    cfg = splash_config(str(tmp_path))
    (tmp_path / tuning.CACHE_FILE).write_text(json.dumps({tuning.SplashShape.of(cfg).key("TPU7x"): tuned}))
    assert train.model_config(cfg, interpret=False, device_kind="TPU7x").kernels.splash == SplashSpec(**tuned)
    assert train.model_config(cfg, interpret=True).kernels.splash == SplashSpec()  # this CPU: no entry


def test_gmm_tiles_tuned_per_pass_and_used_where_the_job_leaves_the_defaults(tmp_path):
    shape = tuning.GmmShape(rows=256, d=128, f=256, experts=2)
    tiles = tuning.tune_gmm(shape, cache_dir=str(tmp_path), search={"forward": {"n": (128, 256)}})
    assert tiles["forward"]["n"] in (128, 256) and tiles["lhs_gradient"] == GmmTiles().model_dump()
    cfg = trainer_config("tiny-moe", moe="gmm")
    cfg = cfg.model_copy(update={"kernels": cfg.kernels.model_copy(update={"tuning_cache": str(tmp_path)})})
    tuning._write(str(tmp_path), tuning.GmmShape.of(cfg).key(KIND), tiles)
    assert train.model_config(cfg, interpret=True).kernels.gmm == GmmSpec(
        **{p: GmmTiles(**t) for p, t in tiles.items()}
    )
    mine = cfg.model_copy(update={"kernels": cfg.kernels.model_copy(update={"gmm": GmmSpec(forward=GmmTiles(m=256))})})
    assert train.model_config(mine, interpret=True).kernels.gmm.forward.m == 256  # the user's


class MemoryGCS(fsspec.implementations.memory.MemoryFileSystem):
    """fsspec's in-memory filesystem under the gs:// protocol: stands in for GCS (the spec takes gs:// or an
    absolute path), with the same read/merge/write path as any object store."""

    protocol = ("gs",)

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol("memory://" + str(path).removeprefix("gs://"))


def test_cli_tunes_the_configs_shape_into_a_url_cache(tmp_path, monkeypatch, capsys):
    """A gs:// cache (fsspec's memory filesystem standing in for GCS): read, merged, written whole."""
    monkeypatch.setitem(_registry, "gs", MemoryGCS)  # fsspec looks here first
    monkeypatch.setattr(tuning, "splash_search", lambda shape: {"forward": {"block_q": (128,), "block_kv": (128,)}})
    cache = f"gs://tuning-{uuid.uuid4().hex}"
    tuning._write(cache, "other-chip|splash|seq=1", {"block_q": 512})
    cfg = splash_config(cache)
    path = tmp_path / "config.json"
    path.write_text(cfg.model_dump_json(by_alias=True))
    assert tuning.main(["--config", str(path)]) == 0
    ((key, blocks),) = json.loads(capsys.readouterr().out).items()
    assert blocks["block_q"] == blocks["block_kv"] == 128
    assert set(tuning._read(cache)) == {"other-chip|splash|seq=1", key}  # merged
    assert train.model_config(cfg, interpret=True).kernels.splash.block_kv_compute == 128
