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

The load is sharded (`load_sharded`): each parameter is read as stored, its rows split over the
devices (`jax.make_array_from_callback`: each process reads one contiguous byte range per tensor per row
block its devices hold, converted to f32), then one jitted transpose lays it out as ours on the target
sharding. No host ever holds more of the model than its devices do, and each byte is read once.
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


def read_shape(rule: Rule, dims: ModelDims) -> tuple[int, ...]:
    """The array a rule reads: its stacked axes, then the tensor as stored ([L, N*H, D] for wq)."""
    return our_shape(rule, dims)[: rule.stacked] + stored_shape(rule, dims)


def read_block(
    rule: Rule,
    model: HfModel,
    tensors: dict[str, tensorfiles.Tensor],
    index: tuple[slice, ...],
    reads: tensorfiles.Reads | None = None,
) -> np.ndarray:
    """The block `index` of the rule's read array (f32): for each layer (and expert) it covers, the byte runs
    of that tensor's slice (one run for a block of whole rows)."""
    shape = read_shape(rule, model.dims)
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    k = rule.stacked
    layers = range(*index[0].indices(shape[0])) if k >= 1 else [0]
    experts = range(*index[1].indices(shape[1])) if k == 2 else [0]
    out = []
    for i in layers:
        row = [
            tensorfiles.read(tensors[_source(rule, model, i, e)], index[k:], reads).astype(np.float32) for e in experts
        ]
        out.append(np.stack(row) if k == 2 else row[0])
    return np.stack(out) if k >= 1 else out[0]


def read_sharding(rule: Rule, dims: ModelDims, target):
    """How a rule's read array is split: its stored rows (the outer stored axis, contiguous on disk) over the
    target's devices, in the target's device order (the relayout's jit needs one device assignment); as
    many row blocks as divide the rows, each copy of a block read once per process. A target on one
    device reads there."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if not isinstance(target, NamedSharding):
        return target
    devices = np.asarray(target.mesh.devices).reshape(-1)
    rows = stored_shape(rule, dims)[0]
    blocks = math.gcd(len(devices), rows)
    mesh = Mesh(devices.reshape(blocks, -1), ("rows", "copies"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return NamedSharding(mesh, P(*(None,) * rule.stacked, "rows"))


def load_sharded(model: HfModel, tensors: dict[str, tensorfiles.Tensor], shardings: dict, reads=None) -> dict:
    """Our parameters (f32 jax.Arrays on `shardings`, a params-shaped dict of shardings).

    Each parameter is first read as stored, its rows split over the devices (`read_sharding`): every
    process reads one contiguous byte range per tensor for each row block its devices hold, each byte of
    the checkpoint read once by one process (and once more per copy where the rows do not split over
    every device). One jitted transpose then lays it out as ours on its target sharding (the collective
    moves the blocks between devices). Reading the target's shards directly would instead cut the rows
    wherever the embed dimension is split, which is the inner, contiguous axis of most stored tensors: a
    request per row per shard (thousands per tensor from gs://)."""
    import jax
    import jax.numpy as jnp

    check_tensors(model, tensors)
    params: dict = {}
    for rule in rules(model.dims):
        target = _at(shardings, rule.path)
        cache: dict = {}

        def block(index, rule=rule, cache=cache):
            key = tuple(s.indices(n)[:2] for s, n in zip(index, read_shape(rule, model.dims)))
            if key not in cache:  # devices holding the same block (its copies) share one read
                cache[key] = read_block(rule, model, tensors, index, reads)
            return cache[key]

        stored = jax.make_array_from_callback(
            read_shape(rule, model.dims), read_sharding(rule, model.dims, target), block
        )
        k, view = rule.stacked, tuple(sizes(model.dims)[c] for c in rule.view)
        axes = (*range(k), *(k + rule.view.index(c) for c in rule.ours))
        relayout = jax.jit(
            lambda a, k=k, view=view, axes=axes: jnp.transpose(a.reshape(a.shape[:k] + view), axes),
            out_shardings=target,
            donate_argnums=0,
        )
        _put(params, rule.path, relayout(stored))
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
