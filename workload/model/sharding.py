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
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_operator.api.contract import MESH_AXES

log = logging.getLogger(__name__)

BATCH_AXES = ("data", "fsdp", "expert")

# One strategy, MaxText's: batch over data x fsdp x expert, sequence over context, experts over
# expert, heads / MLP / vocab over tensor. Weights' embed dim (and so their Adam moments) is split
# over fsdp x context x expert: every slice axis that does not split the weight's use, so no
# parameter byte is replicated inside a slice (an axis a weight already uses, e.g. `expert` for the
# experts' `exp` dim, is skipped for its embed dim). The weights are all-gathered where used (FSDP).
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
    "embed": ("fsdp", "context", "expert"),
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
        return self.size(self.mesh_axes(logical))

    def size(self, axes) -> int:
        """Devices along mesh axes `axes` (a PartitionSpec entry: None, a name or names)."""
        return int(np.prod([self.mesh.shape[a] for a in spec_axes(axes)]))

    def spec(self, logical: Logical, shape: Sequence[int] | None = None) -> P:
        """PartitionSpec for `logical`; with `shape`, mesh axes that do not divide a dim are dropped."""
        used: set[str] = set()
        out = []
        for i, name in enumerate(logical):
            axes = tuple(a for a in self.mesh_axes(name) if a not in used)
            if shape is not None:
                size = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
                if shape[i] % size:
                    log.warning(
                        "logical axis %s (size %d) not divisible by mesh axes %s; replicated", name, shape[i], axes
                    )
                    axes = ()
            used.update(axes)
            out.append(axes[0] if len(axes) == 1 else (axes or None))
        return P(*out)

    def named(self, logical: Logical, shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


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
        raise ValueError(
            f"mesh data={dims[0]} must be a multiple of slices={slices}: only `data` "
            "spans slices (DCN); every other axis stays inside one slice"
        )


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
        raise ValueError(
            f"the config says {slices} slice(s) but the devices report slice_index "
            f"{sorted(sizes, key=str)}: are MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID set on every host?"
        )
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
        log.warning(
            "mesh %s does not map onto whole torus axes of a slice; splitting physical axes (%s)",
            dict(zip(MESH_AXES, ici)),
            str(e).split(".")[0],
        )
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


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """How much of a state tree one device holds, against an even split over the slice's devices."""

    per_device: int  # bytes held by the first addressable device
    total: int  # bytes of the whole (unsharded) tree
    split: int  # devices of one slice: fsdp x context x expert x tensor (data replicates across slices)

    @property
    def ratio(self) -> float:
        """per_device over total / split: 1.0 when every byte is split over the whole slice."""
        return self.per_device * self.split / max(self.total, 1)

    def __str__(self) -> str:
        return (
            f"{self.per_device / 2**20:.2f} MiB per device of {self.total / 2**20:.2f} MiB "
            f"({self.ratio:.2f}x an even split over {self.split} devices)"
        )


def _shard_bytes(a) -> int:
    shards = getattr(a, "addressable_shards", None)
    if shards:  # a real array: what its first device actually holds
        return shards[0].data.nbytes
    return int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize


def state_bytes(tree, mesh: jax.sharding.Mesh) -> StateBytes:
    """Per-device and total bytes of `tree` (arrays, or ShapeDtypeStructs with shardings)."""
    leaves = jax.tree.leaves(tree)
    split = int(np.prod([mesh.shape[a] for a in MESH_AXES if a != "data"]))
    return StateBytes(
        per_device=sum(_shard_bytes(a) for a in leaves),
        total=sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in leaves),
        split=split,
    )


# Above this many times an even split, the start-up check names the parameters that are not split.
STATE_SPLIT_WARN = 1.1


def check_state_bytes(tree, planned: StateBytes, mesh: jax.sharding.Mesh) -> StateBytes:
    """The start-up check of the state's memory: raise if one device holds other than the bytes the
    shardings planned; log the ratio to an even split, and warn, naming the parameters split the
    least, when it passes STATE_SPLIT_WARN (a dimension the mesh does not divide is replicated)."""
    got = state_bytes(tree, mesh)
    if got.per_device != planned.per_device:
        raise RuntimeError(
            f"the state is not sharded as planned: {got.per_device} bytes on one device, planned {planned.per_device}"
        )
    if got.ratio > STATE_SPLIT_WARN:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        excess = lambda a: _shard_bytes(a) - a.nbytes / got.split  # noqa: E731
        worst = sorted(flat, key=lambda pa: -excess(pa[1]))[:3]
        log.warning(
            "state: %s; least split: %s",
            got,
            ", ".join(f"{jax.tree_util.keystr(p)} {a.sharding.spec}" for p, a in worst),
        )
    else:
        log.info("state: %s", got)
    return got
