"""Kernel tiles tuned with tune-jax, cached per chip and per kernel shape: Splash block sizes and the
grouped matmul's tiles.

The cache is one JSON file, `<dir>/splash_blocks.json` (a local path or gs://), mapping a key (the chip
and every dimension that changes the kernel's shapes on one device: the sequence and its context
split, the heads of one tensor shard, the grouped matmul's rows, widths and local experts) to tuned
values. Fill it on the target chip:

    python -m tpu_workload.performance.tuning --config config.json --cache-dir gs://bucket/tuning

then name the directory in `kernels.tuningCache`: when the step is built, `resolve_splash` and
`resolve_gmm` swap the tuned values in where the config leaves them at their defaults.

The search runs in stages, each over only the sizes its pass reads: Splash's forward blocks timed on
the forward alone, then the dK/dV blocks, then the dQ blocks (none for tokamax's fused backward, which
`maxLogitConst` selects) on forward + backward with the earlier stages' winners fixed; the grouped
matmul's forward tiles, then the tokens' gradient's, then the weights' gradient's. Three candidates
for each of two block sizes make 9 timings a stage, 27 for Splash, where one search over all six
would be 729.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable

import fsspec
import fsspec.implementations.local
import jax
import jax.numpy as jnp

from tpu_operator.api.contract import GmmSpec, GmmTiles, SplashSpec, TrainerConfig

from ..model import attention, moe

log = logging.getLogger(__name__)

CACHE_FILE = "splash_blocks.json"
BLOCK_FIELDS = tuple(f for f in SplashSpec.model_fields if f.startswith("block_"))
# Splash's stages: the block sizes each pass reads (a compute block follows its block).
SPLASH_STAGES = {
    "forward": ("block_q", "block_kv"),
    "dkv": ("block_q_dkv", "block_kv_dkv"),
    "dq": ("block_q_dq", "block_kv_dq"),
}
SPLASH_CANDIDATES = (128, 256, 512)
GMM_PASSES = tuple(GmmSpec.model_fields)  # forward, lhs_gradient, rhs_gradient
GMM_CANDIDATES = {"m": (256, 512, 1024), "k": (512, 1024, 2048), "n": (512, 1024, 2048)}


@dataclasses.dataclass(frozen=True)
class SplashShape:
    """What Splash computes on one device: the whole sequence, split `context` ways along queries."""

    seq: int
    context: int
    heads: int  # query heads of one tensor shard
    head_dim: int
    fused_backward: bool = False  # tokamax's Splash (maxLogitConst): no separate dQ pass

    @classmethod
    def of(cls, cfg: TrainerConfig) -> SplashShape:
        m = cfg.model
        return cls(
            seq=cfg.training.sequence_length,
            context=cfg.mesh.context,
            heads=m.heads // cfg.mesh.tensor,
            head_dim=m.head_dim,
            fused_backward=cfg.kernels.splash.max_logit_const is not None,
        )

    def key(self, device_kind: str) -> str:
        return (
            f"{device_kind}|splash{'-fused' if self.fused_backward else ''}|seq={self.seq}|"
            f"context={self.context}|heads={self.heads}|head_dim={self.head_dim}"
        )


@dataclasses.dataclass(frozen=True)
class GmmShape:
    """The experts' grouped matmuls on one device: `rows` routed rows (the receive buffer) through
    `experts` local experts, model width `d`, expert MLP width `f` (of one tensor shard)."""

    rows: int
    d: int
    f: int
    experts: int
    fp8: bool = False

    @classmethod
    def of(cls, cfg: TrainerConfig) -> GmmShape:
        m, mesh, t = cfg.model, cfg.mesh, cfg.training
        tokens = t.global_batch // (mesh.data * mesh.fsdp * mesh.expert) * (t.sequence_length // mesh.context)
        local = m.experts // mesh.expert
        return cls(
            rows=moe.receive_rows(tokens, m.experts_per_token, local, mesh.expert),
            d=m.model_dim,
            f=m.mlp_dim // mesh.tensor,
            experts=local,
            fp8=t.precision == "fp8",
        )

    def key(self, device_kind: str) -> str:
        return (
            f"{device_kind}|gmm{'-fp8' if self.fp8 else ''}|rows={self.rows}|d={self.d}|f={self.f}|"
            f"experts={self.experts}"
        )


# --- the cache file ----------------------------------------------------------------------------------


def _cache_file(cache_dir: str):
    """(filesystem, path of the cache file in it) for a local or URL cache directory."""
    fs, root = fsspec.core.url_to_fs(cache_dir)
    return fs, f"{root.rstrip('/')}/{CACHE_FILE}"


def _read(cache_dir: str) -> dict:
    fs, path = _cache_file(cache_dir)
    return json.loads(fs.cat_file(path)) if fs.exists(path) else {}


def _write(cache_dir: str, key: str, value: dict) -> None:
    """Merge one entry into the cache file: a local file is replaced atomically, an object store
    object is written whole (its writes are atomic)."""
    fs, path = _cache_file(cache_dir)
    text = json.dumps(_read(cache_dir) | {key: value}, indent=1, sort_keys=True)
    if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        fs.pipe_file(path, text.encode())
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _device_kind() -> str:
    return jax.devices()[0].device_kind


# --- the search -----------------------------------------------------------------------------------


def _staged_search(stages: dict[str, dict[str, tuple]], time_stage: Callable[[str, dict, dict], dict]) -> dict:
    """Run the stages in order: each searches its own fields (`time_stage(stage, fixed, search)`
    returns tune-jax's winner), with the earlier stages' winners fixed."""
    fixed: dict = {}
    for stage, search in stages.items():
        fixed |= time_stage(stage, dict(fixed), search)
    return fixed


def _tune(fn, search: dict, *args) -> dict:
    import tune_jax  # imported here: only tuning needs it

    tuned = tune_jax.tune(fn, hyperparams={k: tuple(v) for k, v in search.items()})
    tuned(*args)
    return dict(tuned.optimal_hyperparams)


def _complete_splash(blocks: dict) -> SplashSpec:
    """A SplashSpec from searched fields: compute blocks follow their blocks, the rest keep defaults."""
    out = dict(blocks)
    for compute, block in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
        out.setdefault(compute, out.get(block, SplashSpec.model_fields[block].default))
    return SplashSpec(**out)


def splash_search(shape: SplashShape, candidates=SPLASH_CANDIDATES) -> dict[str, dict[str, tuple]]:
    """Every stage that acts for this kernel (no dQ stage for a fused backward) and its candidates."""
    return {
        stage: {f: tuple(candidates) for f in fields}
        for stage, fields in SPLASH_STAGES.items()
        if not (stage == "dq" and shape.fused_backward)
    }


def tune_splash(
    shape: SplashShape,
    *,
    cache_dir: str,
    search: dict | None = None,
    batch: int = 1,
    interpret: bool | None = None,
    retune: bool = False,
    max_logit_const: float | None = None,
) -> dict:
    """Best Splash block sizes for causal attention of `shape` on this chip, from the cache or tuned
    (and cached); the kernel is timed on one device's share (its query shard, its heads). `search`
    maps stages to their fields' candidates (default: `splash_search`); the rest keep defaults."""
    key = shape.key(_device_kind())
    if not retune and (hit := _read(cache_dir).get(key)) is not None:
        return hit
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    q_len = shape.seq // shape.context
    q = jax.random.normal(jax.random.key(0), (batch, shape.heads, q_len, shape.head_dim), jnp.bfloat16)
    kv = jax.random.normal(jax.random.key(1), (batch, shape.heads, shape.seq, shape.head_dim), jnp.bfloat16)

    def kernel(blocks):
        spec = _complete_splash(blocks).model_copy(update={"max_logit_const": max_logit_const})
        # One device's kernel: the mask of the whole sequence, queries of shard 0 of `context`.
        built = attention.make_splash_kernel(shape.seq, shape.context, shape.heads, spec, interpret)
        return jax.vmap(attention.one_shard(built, spec, shape.context))

    def time_stage(stage: str, fixed: dict, search: dict) -> dict:
        if stage == "forward":
            return _tune(lambda q, k, v, **b: kernel(fixed | b)(q, k, v), search, q, kv, kv)

        def fwd_bwd(q, k, v, **b):
            loss = lambda q, k, v: kernel(fixed | b)(q, k, v).astype(jnp.float32).sum()  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        return _tune(fwd_bwd, search, q, kv, kv)

    found = _staged_search(search or splash_search(shape), time_stage)
    blocks = _complete_splash(found).model_dump(include=set(BLOCK_FIELDS))
    log.info("tuning: %s -> %s", key, blocks)
    _write(cache_dir, key, blocks)
    return blocks


def tune_gmm(
    shape: GmmShape, *, cache_dir: str, search: dict | None = None, interpret: bool | None = None, retune: bool = False
) -> dict:
    """Best grouped-matmul tiles per pass for the experts' SwiGLU of `shape` on this chip, from the
    cache or tuned (and cached); rows routed evenly over the local experts. `search` maps passes to
    their tiles' candidates (default: every pass over GMM_CANDIDATES); the rest keep defaults."""
    key = shape.key(_device_kind())
    if not retune and (hit := _read(cache_dir).get(key)) is not None:
        return hit
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (shape.rows, shape.d), jnp.bfloat16)
    w_in = jax.random.normal(ks[1], (shape.experts, shape.d, shape.f), jnp.bfloat16)
    w_out = jax.random.normal(ks[2], (shape.experts, shape.f, shape.d), jnp.bfloat16)
    sizes = jnp.full((shape.experts,), shape.rows // shape.experts, jnp.int32)
    router_w = jnp.ones((shape.rows,), jnp.float32)  # each row's router weight: the experts' SwiGLU scales by it

    def swiglu(tiles: dict):
        spec = GmmSpec(**{p: GmmTiles(**t) for p, t in tiles.items()})
        mm = moe.Matmul(impl="gmm", tiles=spec, interpret=interpret, fp8=shape.fp8)
        return lambda x, a, b, c: moe._swiglu(x, router_w, sizes, a, b, c, mm)

    def time_stage(stage: str, fixed: dict, search: dict) -> dict:
        def run(x, a, b, c, **tiles):
            f = swiglu(fixed | {stage: GmmTiles(**tiles).model_dump()})
            if stage == "forward":
                return f(x, a, b, c)
            return jax.grad(lambda *w: f(*w).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))(x, a, b, c)

        return {stage: _tune(run, search, x, w_in, w_in, w_out)}

    found = _staged_search(search or {p: dict(GMM_CANDIDATES) for p in GMM_PASSES}, time_stage)
    tiles = GmmSpec(**{p: GmmTiles(**t) for p, t in found.items()}).model_dump()
    log.info("tuning: %s -> %s", key, tiles)
    _write(cache_dir, key, tiles)
    return tiles


# --- what a step uses -------------------------------------------------------------------------------


def resolve_splash(
    spec: SplashSpec, shape: SplashShape, cache_dir: str | None, device_kind: str | None = None
) -> SplashSpec:
    """`spec` with tuned block sizes from the cache when it leaves all of them at their defaults
    and the cache has this chip (`device_kind`, default this process's) and shape; otherwise `spec`
    unchanged. A step compiled ahead of time for a TPU (plan.py) names the mesh's chip: this
    process's devices are CPUs there."""
    if not cache_dir or any(getattr(spec, f) != SplashSpec.model_fields[f].default for f in BLOCK_FIELDS):
        return spec
    key = shape.key(device_kind or _device_kind())
    hit = _read(cache_dir).get(key)
    log.info("splash blocks: %s in %s", f"tuned {hit}" if hit else f"defaults (no entry {key!r})", cache_dir)
    return spec.model_copy(update={f: hit[f] for f in BLOCK_FIELDS if f in hit}) if hit else spec


def resolve_gmm(spec: GmmSpec, shape: GmmShape, cache_dir: str | None, device_kind: str | None = None) -> GmmSpec:
    """`spec` with tuned tiles from the cache when the job leaves them at their defaults (as
    resolve_splash)."""
    if not cache_dir or spec != GmmSpec():
        return spec
    key = shape.key(device_kind or _device_kind())
    hit = _read(cache_dir).get(key)
    log.info("gmm tiles: %s in %s", f"tuned {hit}" if hit else f"defaults (no entry {key!r})", cache_dir)
    return GmmSpec(**{p: GmmTiles(**t) for p, t in hit.items()}) if hit else spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tpu_workload.performance.tuning",
        description="Tune a trainer config's kernels (Splash blocks, grouped-matmul "
        "tiles) for its per-device shapes on this chip.",
    )
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
    kind, out = _device_kind(), {}
    if cfg.kernels.attention == "splash":
        shape = SplashShape.of(cfg)
        out[shape.key(kind)] = tune_splash(
            shape, cache_dir=cache_dir, retune=args.retune, max_logit_const=cfg.kernels.splash.max_logit_const
        )
    if cfg.model.is_moe and cfg.kernels.moe_matmul == "gmm":
        shape = GmmShape.of(cfg)
        out[shape.key(kind)] = tune_gmm(shape, cache_dir=cache_dir, retune=args.retune)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
