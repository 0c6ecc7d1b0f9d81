"""A Hugging Face `config.json` read as our model's shape, and written back from it.

Only what our decoder expresses is accepted (Llama 3 / 3.1 and Mixtral): RMSNorm, SwiGLU with
SiLU, no biases, rotary embeddings over whole heads in the split-halves convention with Llama 3.1's
scaling or none, full causal attention (no sliding window), no dropout. Anything else is refused with the
config key and what we would need instead, never approximated. The file is the user's: it is read with a
size cap, every value is type-checked here and the dimensions are bounded by ModelDims' own limits.

Two spellings of the rotary settings exist in the wild: `rope_theta` plus `rope_scaling` (the Hub's
Llama 3.1 config.json, transformers 4) and one `rope_parameters` dict (transformers 5 writes it); both
are read, and `to_config` writes both, so every transformers version reads the export alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tpu_operator.api.contract import ModelDims

MAX_CONFIG_BYTES = 1 << 20  # a real config.json is a few KiB
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
# Llama 3.1's rope_scaling, the one scaling rope_frequencies(..., "llama3") computes.
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class Unsupported(ValueError):
    """A checkpoint our model does not express, or a config.json that is not one: the message names the key."""


@dataclass(frozen=True)
class HfModel:
    """What a config.json says: our dimensions, plus what a round trip carries over unchanged."""

    dims: ModelDims
    model_type: str  # "llama" or "mixtral"
    tied: bool  # tie_word_embeddings: the unembedding is the embedding's transpose
    extra: dict[str, Any]  # token ids, context length, dtype: written back on export


def parse_config(text: bytes | str) -> HfModel:
    """Parse a config.json (at most MAX_CONFIG_BYTES) into our shape, or raise Unsupported naming the key."""
    if len(text) > MAX_CONFIG_BYTES:
        raise Unsupported(f"config.json: {len(text)} bytes, more than the {MAX_CONFIG_BYTES} a model config needs")
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise Unsupported(f"config.json: not JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise Unsupported("config.json: not a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise Unsupported(f"model_type: {model_type!r}; only {sorted(ARCHITECTURES)} (Llama 3, Mixtral) are supported")
    _refuse_what_differs(cfg, model_type)
    heads = _int(cfg, "num_attention_heads")
    model_dim = _int(cfg, "hidden_size")
    head_dim = cfg.get("head_dim")
    head_dim = model_dim // heads if head_dim is None else _int(cfg, "head_dim")
    theta, scaling = _rope(cfg)
    fields: dict[str, Any] = dict(
        layers=_int(cfg, "num_hidden_layers"),
        model_dim=model_dim,
        heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads,
        head_dim=head_dim,
        mlp_dim=_int(cfg, "intermediate_size"),
        vocab=_int(cfg, "vocab_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=_number(cfg, "rms_norm_eps"),
    )
    if model_type == "mixtral":
        fields |= dict(experts=_int(cfg, "num_local_experts"), experts_per_token=_int(cfg, "num_experts_per_tok"))
    try:
        dims = ModelDims(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise Unsupported(f"config.json: {first['loc'][0]}: {first['msg']}") from exc
    if dims.heads % dims.kv_heads:
        raise Unsupported(f"num_key_value_heads: {dims.kv_heads} does not divide num_attention_heads ({dims.heads})")
    if dims.experts_per_token > dims.experts:
        raise Unsupported(f"num_experts_per_tok: {dims.experts_per_token} is more than num_local_experts")
    extra = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "max_position_embeddings") if k in cfg}
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    if dtype in ("bfloat16", "float16", "float32"):
        extra["torch_dtype"] = dtype
    return HfModel(dims=dims, model_type=model_type, tied=bool(cfg.get("tie_word_embeddings", False)), extra=extra)


def _refuse_what_differs(cfg: dict, model_type: str) -> None:
    """Every setting our decoder cannot express, by its config key."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act: {cfg['hidden_act']!r}; our MLP is SwiGLU with silu")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise Unsupported(f"{key}: true; our projections have no bias")
    for key in ("attention_dropout", "router_jitter_noise"):
        if cfg.get(key):
            raise Unsupported(f"{key}: {cfg[key]!r}; our model has none (0)")
    if cfg.get("sliding_window") is not None:
        raise Unsupported(f"sliding_window: {cfg['sliding_window']!r}; our attention is full causal (null)")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise Unsupported("partial_rotary_factor: our RoPE rotates whole heads (1.0)")
    if model_type == "mixtral" and cfg.get("num_local_experts") in (None, 0):
        raise Unsupported("num_local_experts: a Mixtral config needs experts")


def _rope(cfg: dict) -> tuple[float, str]:
    """(theta, "none" | "llama3") from either spelling."""
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise Unsupported("rope_parameters: not an object")
    params = params or {}
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise Unsupported("rope_scaling: not an object or null")
    merged = {**(scaling or {}), **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not math.isfinite(theta) or theta <= 0:
        raise Unsupported(f"rope_theta: {theta!r} is not a positive number")
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return float(theta), "none"
    if kind != "llama3":
        raise Unsupported(f"rope_scaling.rope_type: {kind!r}; only llama3 (Llama 3.1) or none is supported")
    for key, want in LLAMA3_SCALING.items():
        if merged.get(key) != want:
            raise Unsupported(
                f"rope_scaling.{key}: {merged.get(key)!r}; our llama3 scaling is Llama 3.1's ({key} {want:g})"
            )
    return float(theta), "llama3"


def _int(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise Unsupported(f"{key}: {value!r} is not a positive integer")
    return value


def _number(cfg: dict, key: str) -> float:
    value = cfg.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise Unsupported(f"{key}: {value!r} is not a positive number")
    return float(value)


def disagreements(spec: ModelDims, checkpoint: ModelDims) -> list[str]:
    """Each field where the job's shape and the checkpoint's differ, as `spec.model.FIELD: spec's,
    checkpoint's`: the trainer refuses to start from a checkpoint of another shape."""
    out = []
    for name in ModelDims.model_fields:
        ours, theirs = getattr(spec, name), getattr(checkpoint, name)
        if ours != theirs:
            camel = name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])
            out.append(f"spec.model.{camel}: {ours!r} in the job, {theirs!r} in the checkpoint")
    return out


def to_config(dims: ModelDims, extra: dict[str, Any] | None = None, dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json of our shape: Llama for a dense model, Mixtral for MoE; `extra` (token ids, context
    length) as the source checkpoint had them."""
    model_type = "mixtral" if dims.is_moe else "llama"
    extra = {k: v for k, v in (extra or {}).items() if k != "torch_dtype"}
    scaling = {"rope_type": "llama3", **LLAMA3_SCALING} if dims.rope_scaling == "llama3" else None
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": dims.model_dim,
        "intermediate_size": dims.mlp_dim,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "rms_norm_eps": dims.norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta} | (scaling or {}),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 131072 if dims.rope_scaling == "llama3" else 8192,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if model_type == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg |= {
            "num_local_experts": dims.experts,
            "num_experts_per_tok": dims.experts_per_token,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    return cfg | extra
