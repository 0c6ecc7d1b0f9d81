"""The parameters a new run starts from (`spec.model.init`): a Hugging Face directory, read shard by shard,
or an Orbax directory `tpujob convert` wrote (DIR/params, DIR/model.json), restored onto the run's
shardings. Either way the checkpoint's shape must be the job's: every field that differs is named.
"""

from __future__ import annotations

import json

from tpu_operator.api.contract import ModelDims, ModelInit

from . import hf_config, hf_weights, tensorfiles

PARAMS = "params"  # convert's Orbax item: the parameters alone
MODEL = "model.json"  # convert's record of the shape (ModelDims) the parameters have
HF = "hf"  # convert's copy of the source's config.json and tokenizer files, for a later export
MAX_MODEL_JSON_BYTES = 64 << 10


class Mismatch(ValueError):
    """The checkpoint's shape is not the job's."""


def join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name


def hf_model(directory: str) -> hf_config.HfModel:
    return hf_config.parse_config(tensorfiles.read_small(join(directory, "config.json"), hf_config.MAX_CONFIG_BYTES))


def saved_dims(directory: str) -> ModelDims:
    """The shape convert recorded beside its parameters."""
    text = tensorfiles.read_small(join(directory, MODEL), MAX_MODEL_JSON_BYTES)
    try:
        return ModelDims.model_validate_json(text)
    except ValueError as exc:
        raise tensorfiles.BadFile(f"{join(directory, MODEL)}: not a model shape ({exc})") from exc


def agree(job: ModelDims, checkpoint: ModelDims, where: str) -> None:
    problems = hf_config.disagreements(job, checkpoint)
    if problems:
        raise Mismatch(f"{where} has another shape than the job: " + "; ".join(problems))


def parameters(init: ModelInit, dims: ModelDims, abstract_params: dict, reads: tensorfiles.Reads | None = None) -> dict:
    """The parameters of `init` on the shardings of `abstract_params` (ShapeDtypeStructs with shardings)."""
    import jax

    if init.format == "huggingface":
        model = hf_model(init.path)
        agree(dims, model.dims, init.path)
        shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
        return hf_weights.load_sharded(model, tensorfiles.catalogue(init.path), shardings, reads)
    agree(dims, saved_dims(init.path), init.path)
    return restore_params(join(init.path, PARAMS), abstract_params)


def restore_params(path: str, abstract_params: dict) -> dict:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract_params)


def model_spec(dims: ModelDims) -> dict:
    """The job's `spec.model` fields (camelCase) of a shape: what convert prints for the job file."""
    return json.loads(dims.model_dump_json(by_alias=True))
