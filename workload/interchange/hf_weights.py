"""Hugging Face tensors to our parameters and back: one rule per parameter, a sharded load, an export.

Dimension letters as in decoder.py: V vocab, D model dim, N query heads, K kv heads, H head dim, F MLP
dim, E experts. Hugging Face keeps each layer's (and each expert's) weights as separate tensors,
`nn.Linear` weights as [out, in]; ours are stacked over layers (and experts) with their own axis order.
A rule says how one of ours is made: the tensor name (`{i}` the layer, `{e}` the expert), its stored
axes (`"NH,D"`: stored [N*H, D], which in C order is the same bytes as [N, H, D], so any slice of the
unmerged view is a set of byte runs), and our trailing axes, a permutation of the view's. The
query/key rows of a Hugging Face checkpoint are already in the split-halves RoPE order our `rope` uses
(transformers' conversion permuted Meta's interleaved layout), so no permutation of heads is needed;
GQA groups match too (query head n uses kv head n // (N / K), as `attention.reference_attention`'s
[K, G] split does).

The load is sharded (`load`): each parameter is a `jax.make_array_from_callback` over its target
sharding, whose callback reads, for each of this process's distinct shards, only the byte runs of that
shard in each layer's tensor (tensorfiles.read), converts them to f32 and transposes them: no host ever
holds more of the model than its devices do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tpu_operator.api.contract import ModelDims

from . import tensorfiles
from .hf_config import HfModel


@dataclass(frozen=True)
class Rule:
    path: tuple[str, ...]  # keys of our parameter in the params dict
    name: str  # the Hugging Face tensor; {i}: layer, {e}: expert
    stored: str  # its axes as stored, comma between stored dimensions ("NH,D": [N*H, D])
    ours: str  # our trailing axes (after layers and experts), a permutation of the stored letters

    @property
    def view(self) -> str:
        return self.stored.replace(",", "")

    @property
    def stacked(self) -> int:
        """Leading stacked axes of ours: 0, 1 (layers) or 2 (layers, experts)."""
        return ("{i}" in self.name) + ("{e}" in self.name)


LAYER = "model.layers.{i}."
COMMON = (
    Rule(("embed",), "model.embed_tokens.weight", "V,D", "VD"),
    Rule(("final_norm", "scale"), "model.norm.weight", "D", "D"),
    Rule(("unembed",), "lm_head.weight", "V,D", "DV"),
    Rule(("layers", "attn_norm", "scale"), LAYER + "input_layernorm.weight", "D", "D"),
    Rule(("layers", "mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", "D", "D"),
    Rule(("layers", "attn", "wq"), LAYER + "self_attn.q_proj.weight", "NH,D", "DNH"),
    Rule(("layers", "attn", "wk"), LAYER + "self_attn.k_proj.weight", "KH,D", "DKH"),
    Rule(("layers", "attn", "wv"), LAYER + "self_attn.v_proj.weight", "KH,D", "DKH"),
    Rule(("layers", "attn", "wo"), LAYER + "self_attn.o_proj.weight", "D,NH", "NHD"),
)
DENSE = (
    Rule(("layers", "mlp", "gate"), LAYER + "mlp.gate_proj.weight", "F,D", "DF"),
    Rule(("layers", "mlp", "up"), LAYER + "mlp.up_proj.weight", "F,D", "DF"),
    Rule(("layers", "mlp", "down"), LAYER + "mlp.down_proj.weight", "D,F", "FD"),
)
# Mixtral as the Hub stores it (transformers 5 fuses the experts in memory and writes this layout back).
EXPERT = LAYER + "block_sparse_moe.experts.{e}."
MOE = (
    Rule(("layers", "mlp", "router"), LAYER + "block_sparse_moe.gate.weight", "E,D", "DE"),
    Rule(("layers", "mlp", "gate"), EXPERT + "w1.weight", "F,D", "DF"),
    Rule(("layers", "mlp", "up"), EXPERT + "w3.weight", "F,D", "DF"),
    Rule(("layers", "mlp", "down"), EXPERT + "w2.weight", "D,F", "FD"),
)


def rules(dims: ModelDims) -> tuple[Rule, ...]:
    return COMMON + (MOE if dims.is_moe else DENSE)


def sizes(dims: ModelDims) -> dict[str, int]:
    d = dims
    return dict(V=d.vocab, D=d.model_dim, N=d.heads, K=d.kv_heads, H=d.head_dim, F=d.mlp_dim, E=d.experts, L=d.layers)


def stored_shape(rule: Rule, dims: ModelDims) -> tuple[int, ...]:
    s = sizes(dims)
    return tuple(math.prod(s[c] for c in group) for group in rule.stored.split(","))


def our_shape(rule: Rule, dims: ModelDims) -> tuple[int, ...]:
    s = sizes(dims)
    return (
        (dims.layers,) * ("{i}" in rule.name) + (dims.experts,) * ("{e}" in rule.name) + tuple(s[c] for c in rule.ours)
    )


def _name(rule: Rule, i: int = 0, e: int = 0) -> str:
    return rule.name.replace("{i}", str(i)).replace("{e}", str(e))


def check_tensors(model: HfModel, tensors: dict[str, tensorfiles.Tensor]) -> None:
    """Every tensor a rule reads exists with the shape the config says (the file is the user's: a clear
    error naming the tensor, before any device memory is spent)."""
    for rule in rules(model.dims):
        want = stored_shape(rule, model.dims)
        for i in range(model.dims.layers if "{i}" in rule.name else 1):
            for e in range(model.dims.experts if "{e}" in rule.name else 1):
                name = _source(rule, model, i, e)
                t = tensors.get(name)
                if t is None:
                    raise tensorfiles.BadFile(f"{name}: missing from the checkpoint ({model.model_type} needs it)")
                if t.shape != want:
                    raise tensorfiles.BadFile(f"{name}: shape {list(t.shape)}, config.json says {list(want)}")


def _source(rule: Rule, model: HfModel, i: int = 0, e: int = 0) -> str:
    """The tensor a rule reads; a tied checkpoint's unembedding is its embedding (transposed by the rule)."""
    if rule.path == ("unembed",) and model.tied:
        return "model.embed_tokens.weight"
    return _name(rule, i, e)


def read_slice(
    rule: Rule,
    model: HfModel,
    tensors: dict[str, tensorfiles.Tensor],
    index: tuple[slice, ...],
    reads: tensorfiles.Reads | None = None,
    gap: int = tensorfiles.GAP_BYTES,
) -> np.ndarray:
    """Our parameter's slice `index` (f32), read from only the byte runs of the tensors it covers."""
    dims = model.dims
    shape = our_shape(rule, dims)
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    k = rule.stacked
    trailing = dict(zip(rule.ours, index[k:]))
    view_index = tuple(trailing[c] for c in rule.view)
    view_shape = tuple(sizes(dims)[c] for c in rule.view)
    order = [rule.view.index(c) for c in rule.ours]
    layers = range(*index[0].indices(shape[0])) if k >= 1 else [0]
    experts = range(*index[1].indices(shape[1])) if k == 2 else [0]
    out = []
    for i in layers:
        row = []
        for e in experts:
            t = tensors[_source(rule, model, i, e)]
            view = tensorfiles.Tensor(t.name, t.path, t.dtype, view_shape, t.start)
            row.append(np.transpose(tensorfiles.read(view, view_index, reads, gap).astype(np.float32), order))
        out.append(np.stack(row) if k == 2 else row[0])
    return np.stack(out) if k >= 1 else out[0]


def load_sharded(model: HfModel, tensors: dict[str, tensorfiles.Tensor], shardings: dict, reads=None, gap=None) -> dict:
    """Our parameters (f32 jax.Arrays on `shardings`, a params-shaped dict of NamedShardings), each shard
    read by the process that holds it, once however many of its devices hold a copy."""
    import jax

    check_tensors(model, tensors)
    gap = tensorfiles.GAP_BYTES if gap is None else gap
    params: dict = {}
    for rule in rules(model.dims):
        shape = our_shape(rule, model.dims)
        sharding = _at(shardings, rule.path)
        cache: dict = {}

        def shard(index, rule=rule, cache=cache):
            key = tuple(s.indices(n)[:2] for s, n in zip(index, our_shape(rule, model.dims)))
            if key not in cache:
                cache[key] = read_slice(rule, model, tensors, index, reads, gap)
            return cache[key]

        _put(params, rule.path, jax.make_array_from_callback(shape, sharding, shard))
    return params


def hf_tensors(params: dict, dims: ModelDims, dtype: np.dtype):
    """(name, array) of every Hugging Face tensor of `params` (our layout; host arrays), the unstacked ones
    first, then layer by layer (so a shard holds whole layers), cast to `dtype`."""
    by_rule = {rule: np.asarray(_at(params, rule.path)) for rule in rules(dims)}

    def one(rule: Rule, ours: np.ndarray, i: int = 0, e: int = 0):
        order = [rule.ours.index(c) for c in rule.view]
        a = np.transpose(ours, order).reshape(stored_shape(rule, dims))
        return _name(rule, i, e), np.ascontiguousarray(a.astype(dtype))

    for rule, ours in by_rule.items():
        if rule.stacked == 0:
            yield one(rule, ours)
    for i in range(dims.layers):
        for rule, ours in by_rule.items():
            for e in range(dims.experts if rule.stacked == 2 else 1 if rule.stacked == 1 else 0):
                yield one(rule, ours[i, e] if rule.stacked == 2 else ours[i], i, e)


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
