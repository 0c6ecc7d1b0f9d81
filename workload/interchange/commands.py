"""`tpujob convert` and `tpujob export` (run as `python -m tpu_workload.interchange.commands`): a Hugging Face
model to an Orbax directory a job starts from, and a trained checkpoint back to a Hugging Face model directory. Both run in one process on this host's default
device and hold the whole model in host memory as f32 (4 bytes a parameter): they are the offline,
once-per-model steps; a job reads a Hugging Face directory shard by shard itself (pretrained.py).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from tpu_operator.api.contract import ModelDims

from . import hf_config, hf_weights, pretrained, tensorfiles
from .pretrained import HF, MODEL, PARAMS, join

# What a model directory carries besides weights, copied as they are (each at most MAX_SIDE_FILE_BYTES); the chat
# template is in tokenizer_config.json or, as recent transformers versions save it, in chat_template.jinja.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
MAX_SIDE_FILE_BYTES = 64 << 20  # Llama 3's tokenizer.json is 9 MiB
CHUNK_BYTES = 16 << 20  # convert's storage chunks: a restore reads whole chunks
DTYPES = {"bfloat16": tensorfiles.DTYPES["BF16"], "float32": tensorfiles.DTYPES["F32"], "float16": np.dtype(np.float16)}


def _abstract(dims: ModelDims) -> dict:
    """Our parameters' shapes (f32) on this host's first device."""
    import jax
    from flax import nnx

    from ..model import decoder

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = nnx.state(nnx.eval_shape(lambda: decoder.Decoder(decoder.ModelConfig(dims), nnx.Rngs(0))))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), shapes.to_pure_dict())


def _copy_side_files(src: str, dst: str) -> list[str]:
    import fsspec

    fs = fsspec.core.url_to_fs(src)[0]
    out_fs = fsspec.core.url_to_fs(dst)[0]
    out_fs.makedirs(dst, exist_ok=True)
    copied = []
    for name in (*SIDE_FILES, "config.json"):
        if fs.exists(join(src, name)):
            data = tensorfiles.read_small(join(src, name), MAX_SIDE_FILE_BYTES)
            with out_fs.open(join(dst, name), "wb") as f:
                f.write(data)
            copied.append(name)
    return copied


def convert(src: str, dst: str) -> ModelDims:
    """SRC (a Hugging Face directory) to DST: DST/params (Orbax), DST/model.json, DST/hf (the source's
    config.json and tokenizer files). A job starts from it with `model.init: {format: orbax, path: DST}`."""
    import fsspec
    import jax
    import orbax.checkpoint as ocp

    model = pretrained.hf_model(src)
    abstract = _abstract(model.dims)
    params = hf_weights.load_sharded(model, tensorfiles.catalogue(src), jax.tree.map(lambda a: a.sharding, abstract))
    fs = fsspec.core.url_to_fs(dst)[0]
    fs.makedirs(dst, exist_ok=True)
    # Saved from one device, each array would be one storage chunk that every restoring process reads whole;
    # chunks of at most CHUNK_BYTES let a run's restore read little more than its shards.
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(join(dst, PARAMS), params, save_args=save_args)
    with fs.open(join(dst, MODEL), "w") as f:
        f.write(model.dims.model_dump_json(indent=2))
    _copy_side_files(src, join(dst, HF))
    return model.dims


def _params_of(ckpt: str, dims: ModelDims) -> dict:
    """The parameters of a convert directory (CKPT/params) or of a job's latest checkpoint (only its
    `params`: the optimizer state is not read)."""
    import fsspec
    import orbax.checkpoint as ocp

    abstract = _abstract(dims)
    fs = fsspec.core.url_to_fs(ckpt)[0]
    if fs.exists(join(ckpt, PARAMS)):
        return pretrained.restore_params(join(ckpt, PARAMS), abstract)
    steps = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(ckpt, detail=False)]
    steps = sorted(int(s) for s in steps if s.isdigit())
    if not steps:
        raise tensorfiles.BadFile(f"{ckpt}: neither a convert directory ({PARAMS}/) nor a job's checkpoints")
    item = {"params": abstract}
    with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(
            join(join(ckpt, str(steps[-1])), "state"),
            args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
            ),
        )
    return restored["params"]


def export(
    ckpt: str, dst: str, *, dims: ModelDims | None = None, tokenizer_from: str | None = None, dtype: str = "bfloat16"
) -> list[str]:
    """CKPT (a convert directory, or a job's checkpoint directory with `dims` given) to DST, a Hugging Face
    model directory: safetensors shards, their index, config.json (Llama or Mixtral) and the tokenizer
    files of `tokenizer_from` (else those convert kept). Returns the files written."""
    import fsspec

    fs = fsspec.core.url_to_fs(ckpt)[0]
    kept = join(ckpt, HF)
    if dims is None:
        if not fs.exists(join(ckpt, MODEL)):
            raise tensorfiles.BadFile(f"{ckpt}: no {MODEL} (not a convert directory): give the job's file (--job)")
        dims = pretrained.saved_dims(ckpt)
    source = tokenizer_from or (kept if fs.exists(kept) else None)
    extra = pretrained.hf_model(source).extra if source and fs.exists(join(source, "config.json")) else {}
    params = _params_of(ckpt, dims)
    written = tensorfiles.write(dst, hf_weights.hf_tensors(params, dims, DTYPES[dtype]))
    side = _copy_side_files(source, dst) if source else []
    out_fs = fsspec.core.url_to_fs(dst)[0]
    with out_fs.open(join(dst, "config.json"), "w") as f:
        json.dump(hf_config.to_config(dims, extra, dtype), f, indent=2)
    return [*written, tensorfiles.INDEX, "config.json", *[s for s in side if s != "config.json"]]


def main(argv: list[str] | None = None) -> int:
    """The CLI's child process: 0 done, 2 a checkpoint or shape the user must fix (the reason on stderr)."""
    parser = argparse.ArgumentParser(prog="tpujob", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert")
    p.add_argument("path")
    p.add_argument("--to", required=True)
    p = sub.add_parser("export")
    p.add_argument("path")
    p.add_argument("--to", required=True)
    p.add_argument("--dims", help="the job's ModelDims as JSON")
    p.add_argument("--tokenizer-from")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            dims = convert(args.path, args.to)
            model = pretrained.model_spec(dims) | {"init": {"format": "orbax", "path": args.to}}
            print(f"wrote {args.to}; start a job from it with this spec.model:")
            print(json.dumps({"model": model}, indent=2))
        else:
            dims = ModelDims.model_validate_json(args.dims) if args.dims else None
            files = export(args.path, args.to, dims=dims, tokenizer_from=args.tokenizer_from, dtype=args.dtype)
            print(f"wrote {args.to}: {', '.join(files)}")
    except (hf_config.Unsupported, tensorfiles.BadFile, pretrained.Mismatch, FileNotFoundError) as exc:
        print(f"error: {exc}"[:2000], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
