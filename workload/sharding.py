"""Mesh construction and logical-axis sharding.

Model code names logical axes only ("embed", "mlp", "batch", ...). `RULES` maps them to the
mesh axes of `MESH_AXES`; a `Sharder` (mesh + rules) turns logical names into PartitionSpecs.
The sharder that is active while a step is traced is set with `use(sharder)`; model code calls
`constrain(x, axes)` and `current()` and never builds a PartitionSpec itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")

# One strategy: FSDP over `fsdp` (weights' embed dim), batch over data x fsdp x expert,
# sequence over context, experts over expert, heads / MLP / vocab over tensor.
RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": BATCH_AXES,
    "length": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # parameters
    "layers": None,
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "exp": "expert",
    "norm": None,
    "router": None,
}

Logical = Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class Sharder:
    """A mesh and the rules that map logical axis names onto it."""

    mesh: jax.sharding.Mesh
    rules: dict = dataclasses.field(default_factory=lambda: dict(RULES))

    def axis_size(self, name: str) -> int:
        return self.mesh.shape[name]

    def spec(self, logical: Logical, shape: Sequence[int] | None = None) -> P:
        """PartitionSpec for `logical`; with `shape`, mesh axes that do not divide a dim are dropped."""
        used: set[str] = set()
        out = []
        for i, name in enumerate(logical):
            axes = self.rules.get(name) if name is not None else None
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            axes = tuple(a for a in axes if a not in used and self.mesh.shape[a] > 1)
            if shape is not None:
                size = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
                if shape[i] % size:
                    log.warning("logical axis %s (size %d) not divisible by mesh axes %s; replicated",
                                name, shape[i], axes)
                    axes = ()
            used.update(axes)
            out.append(axes[0] if len(axes) == 1 else (axes or None))
        return P(*out)

    def named(self, logical: Logical, shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))


_CURRENT: list[Sharder] = []


@contextlib.contextmanager
def use(sharder: Sharder | None) -> Iterator[None]:
    """Make `sharder` the one model code sees while a function is traced."""
    _CURRENT.append(sharder)
    try:
        yield
    finally:
        _CURRENT.pop()


def current() -> Sharder | None:
    return _CURRENT[-1] if _CURRENT else None


def constrain(x: jax.Array, logical: Logical) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op with no active sharder."""
    sh = current()
    if sh is None:
        return x
    return jax.lax.with_sharding_constraint(x, sh.named(logical, x.shape))


def make_mesh(shape: dict[str, int], slices: int = 1) -> jax.sharding.Mesh:
    """The 5-axis device mesh; deterministic device order on every process.

    Multi-slice TPU: `data` spans slices (DCN), the other axes one slice (ICI).
    """
    dims = tuple(shape[a] for a in MESH_AXES)
    devices = jax.devices()
    if int(np.prod(dims)) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, dims))} needs {int(np.prod(dims))} devices, "
                         f"but there are {len(devices)}")
    auto = (AxisType.Auto,) * len(MESH_AXES)
    if slices > 1 and hasattr(devices[0], "slice_index"):
        from jax.experimental import mesh_utils

        ici = (1,) + dims[1:]
        dcn = (dims[0],) + (1,) * (len(dims) - 1)
        arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
        return jax.sharding.Mesh(arr, MESH_AXES, axis_types=auto)
    return jax.make_mesh(dims, MESH_AXES, axis_types=auto, devices=devices)


def check_shardings(tree, planned) -> None:
    """Raise if any array in `tree` is not sharded as `planned` (a matching tree of NamedShardings)."""
    bad = []
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat_planned = jax.tree.leaves(planned, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, arr), want in zip(flat, flat_planned, strict=True):
        if not arr.sharding.is_equivalent_to(want, arr.ndim):
            bad.append(f"{jax.tree_util.keystr(path)}: {arr.sharding.spec} != planned {want.spec}")
    if bad:
        raise RuntimeError("parameters are not sharded as planned:\n  " + "\n  ".join(bad))
