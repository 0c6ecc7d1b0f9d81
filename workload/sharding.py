"""Mesh construction and logical-axis sharding.

Model code names logical axes only ("embed", "mlp", "batch", ...). `RULES` maps them to the
mesh axes of `MESH_AXES`; a `Sharder` (mesh + rules) turns logical names into PartitionSpecs.
The sharder that is active while a step is traced is set with `use(sharder)`; model code calls
`constrain(x, axes)` and `current()` and never builds a PartitionSpec itself: kernels under
`shard_map` ask the sharder for their specs (`spec`), the mesh axes of a logical axis
(`mesh_axes`, for collectives) and its degree (`degree`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from typing import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tpu_operator.api.contract import MESH_AXES

log = logging.getLogger(__name__)

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

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes (of size > 1) that the logical axis `logical` is sharded over."""
        axes = self.rules.get(logical) if logical is not None else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return tuple(a for a in axes if self.mesh.shape[a] > 1)

    def degree(self, logical: str) -> int:
        """How many ways the logical axis `logical` is split."""
        return int(np.prod([self.mesh.shape[a] for a in self.mesh_axes(logical)]))

    def spec(self, logical: Logical, shape: Sequence[int] | None = None) -> P:
        """PartitionSpec for `logical`; with `shape`, mesh axes that do not divide a dim are dropped."""
        used: set[str] = set()
        out = []
        for i, name in enumerate(logical):
            axes = tuple(a for a in self.mesh_axes(name) if a not in used)
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


def make_mesh(shape: dict[str, int], slices: int = 1, devices: Sequence | None = None) -> jax.sharding.Mesh:
    """The 5-axis device mesh over `devices` (default: all global devices); the same device order on
    every process.

    TPU: `tpu_grid` (with several slices, `data` spans slices over DCN, the other axes one
    slice's ICI); `devices` may be a TPU topology's, to compile for a slice ahead of time (plan.py).
    Elsewhere (the CPU, where the local runner emulates a slice as a group of processes)
    `jax.make_mesh` lays the devices out in process order, so `data` varies slowest.
    """
    dims = tuple(shape[a] for a in MESH_AXES)
    devices = list(devices) if devices is not None else jax.devices()
    auto = (AxisType.Auto,) * len(MESH_AXES)
    if devices[0].platform == "tpu":
        return jax.sharding.Mesh(tpu_grid(dims, slices, devices), MESH_AXES, axis_types=auto)  # checks too
    check_mesh(dims, slices, len(devices))
    return jax.make_mesh(dims, MESH_AXES, axis_types=auto, devices=devices)


def check_mesh(dims: Sequence[int], slices: int, n_devices: int) -> None:
    """Raise ValueError unless `dims` (in MESH_AXES order) fits `n_devices` split into `slices`."""
    named = dict(zip(MESH_AXES, dims))
    if int(np.prod(dims)) != n_devices:
        raise ValueError(f"mesh {named} needs {int(np.prod(dims))} devices, but there are {n_devices}")
    if slices < 1 or dims[0] % slices:
        raise ValueError(f"mesh data={dims[0]} must be a multiple of slices={slices}: only `data` "
                         "spans slices (DCN); every other axis stays inside one slice")


def tpu_grid(dims: Sequence[int], slices: int, devices: Sequence) -> np.ndarray:
    """TPU devices as an array of shape `dims` whose `data` axis runs over slices (`slice_index`).

    Each slice holds `data // slices` consecutive data indices and all of fsdp, context, expert
    and tensor; mesh_utils places each slice's share on its ICI torus. A degree that is not a
    product of whole torus axes (e.g. 2 on a 4-long axis) is placed by splitting a physical axis,
    with a warning, rather than failing.
    """
    from jax.experimental import mesh_utils

    check_mesh(dims, slices, len(devices))
    sizes = collections.Counter(getattr(d, "slice_index", None) for d in devices)
    if len(sizes) != slices or (slices > 1 and None in sizes):
        raise ValueError(f"the config says {slices} slice(s) but the devices report slice_index "
                         f"{sorted(sizes, key=str)}: are MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID set on every host?")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"slices must be equal; devices per slice_index: {dict(sorted(sizes.items()))}")
    ici = (dims[0] // slices,) + tuple(dims[1:])
    dcn = (slices,) + (1,) * (len(dims) - 1)

    def build(split: bool) -> np.ndarray:
        if slices == 1:
            return mesh_utils.create_device_mesh(dims, devices, allow_split_physical_axes=split)
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, allow_split_physical_axes=split)

    try:
        return build(False)
    except NotImplementedError as e:  # mesh_utils' signal that no whole-axis assignment exists
        log.warning("mesh %s does not map onto whole torus axes of a slice; splitting physical axes (%s)",
                    dict(zip(MESH_AXES, ici)), str(e).split(".")[0])
        return build(True)


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
