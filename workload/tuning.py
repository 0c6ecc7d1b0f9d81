"""Splash block sizes tuned with tune-jax, cached per chip and attention shape.

The cache is one JSON file, `<dir>/splash_blocks.json` (a local path or gs://), mapping
"device_kind|seq=..|heads=..|head_dim=.." to the tuned block sizes. Fill it on the target chip:

    python -m tpu_workload.tuning --config config.json --cache-dir gs://bucket/tuning

(forward + backward of the kernel timed by tune-jax's profiler), then name the directory in
`kernels.tuningCache`: `resolve_splash` swaps the tuned blocks in when the step is built, if the
config leaves every block size at its default. Keys use the global sequence; with context
parallelism the kernel fits query blocks to the per-shard length (attention._fit_block).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

import fsspec
import fsspec.implementations.local
import jax
import jax.numpy as jnp

from tpu_operator.api.contract import SplashSpec, TrainerConfig

from . import attention

log = logging.getLogger(__name__)

CACHE_FILE = "splash_blocks.json"
BLOCK_FIELDS = tuple(f for f in SplashSpec.model_fields if f.startswith("block_"))
# A compute block equals its block unless the search names it.
DEFAULT_SEARCH = {f: (128, 256, 512) for f in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv",
                                              "block_q_dq", "block_kv_dq")}


def cache_key(seq: int, heads: int, head_dim: int, device_kind: str | None = None) -> str:
    """The cache entry of an attention shape on `device_kind` (default: this process's chip)."""
    device_kind = device_kind or jax.devices()[0].device_kind
    return f"{device_kind}|seq={seq}|heads={heads}|head_dim={head_dim}"


def _cache_file(cache_dir: str):
    """(filesystem, path of the cache file in it) for a local or URL cache directory."""
    fs, root = fsspec.core.url_to_fs(cache_dir)
    return fs, f"{root.rstrip('/')}/{CACHE_FILE}"


def _read(cache_dir: str) -> dict:
    fs, path = _cache_file(cache_dir)
    return json.loads(fs.cat_file(path)) if fs.exists(path) else {}


def _write(cache_dir: str, key: str, blocks: dict) -> None:
    """Merge one entry into the cache file: a local file is replaced atomically, an object store
    object is written whole (its writes are atomic)."""
    fs, path = _cache_file(cache_dir)
    text = json.dumps(_read(cache_dir) | {key: blocks}, indent=1, sort_keys=True)
    if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        fs.pipe_file(path, text.encode())
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _complete(blocks: dict) -> dict:
    """All block fields: compute blocks follow their blocks, the rest keep SplashSpec's defaults."""
    out = {f: SplashSpec.model_fields[f].default for f in BLOCK_FIELDS} | dict(blocks)
    for compute, block in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
        if compute not in blocks:
            out[compute] = out[block]
    return out


def tune_splash_blocks(seq: int, heads: int, head_dim: int, *, cache_dir: str, search: dict | None = None,
                       batch: int = 1, dtype=jnp.bfloat16, interpret: bool | None = None,
                       retune: bool = False) -> dict:
    """Best Splash block sizes for causal attention of this shape on this chip, from the cache or
    tuned (and cached). `search` maps block fields to candidate values (default DEFAULT_SEARCH)."""
    key = cache_key(seq, heads, head_dim)
    if not retune and (hit := _read(cache_dir).get(key)) is not None:
        return hit
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    search = {f: tuple(v) for f, v in (search or DEFAULT_SEARCH).items()}

    def fwd_bwd(q_BNTH, k_BNSH, v_BNSH, **blocks):
        kernel = jax.vmap(attention.make_splash_kernel(seq, 1, SplashSpec(**_complete(blocks)), interpret))
        loss = lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q_BNTH, k_BNSH, v_BNSH)

    import tune_jax  # imported here: only tuning needs it

    q, k, v = jax.random.normal(jax.random.key(0), (3, batch, heads, seq, head_dim), dtype)
    tuned = tune_jax.tune(fwd_bwd, hyperparams=search)
    tuned(q, k, v)
    blocks = _complete(tuned.optimal_hyperparams)
    log.info("tuning: %s -> %s", key, blocks)
    _write(cache_dir, key, blocks)
    return blocks


def resolve_splash(spec: SplashSpec, seq: int, heads: int, head_dim: int, cache_dir: str | None,
                   device_kind: str | None = None) -> SplashSpec:
    """`spec` with tuned block sizes from the cache when it leaves all of them at their defaults
    and the cache has this chip (`device_kind`, default this process's) and shape; otherwise `spec`
    unchanged. A step compiled ahead of time for a TPU (plan.py) names the mesh's chip: this
    process's devices are CPUs there."""
    if not cache_dir or any(getattr(spec, f) != SplashSpec.model_fields[f].default for f in BLOCK_FIELDS):
        return spec
    key = cache_key(seq, heads, head_dim, device_kind)
    hit = _read(cache_dir).get(key)
    log.info("splash blocks: %s in %s", f"tuned {hit}" if hit else f"defaults (no entry {key!r})", cache_dir)
    return spec.model_copy(update={f: hit[f] for f in BLOCK_FIELDS}) if hit else spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_workload.tuning",
                                     description="Tune Splash block sizes for a trainer config's attention shape.")
    parser.add_argument("--config", required=True, help="TrainerConfig JSON file (the one the pods mount)")
    parser.add_argument("--cache-dir", help="cache directory (default: the config's kernels.tuningCache)")
    parser.add_argument("--retune", action="store_true", help="tune again even if the cache has this shape")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with open(args.config) as f:
        cfg = TrainerConfig.model_validate_json(f.read())
    cache_dir = args.cache_dir or cfg.kernels.tuning_cache
    if not cache_dir:
        parser.error("no --cache-dir and the config has no kernels.tuningCache")
    import absl.flags

    absl.flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags
    m = cfg.model
    blocks = tune_splash_blocks(cfg.training.sequence_length, m.heads, m.head_dim, cache_dir=cache_dir,
                                retune=args.retune)
    print(json.dumps({"key": cache_key(cfg.training.sequence_length, m.heads, m.head_dim), "blocks": blocks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
