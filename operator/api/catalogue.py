"""The TPU generations we can place, and the slice shapes each one offers.

Numbers come from the GKE and Cloud TPU documentation: accelerator labels, machine types, chips per host and
the valid topologies from https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus, each generation's
figures from its Cloud TPU page (https://cloud.google.com/tpu/docs/tpu7x, .../v6e, .../v5p). Everything here is
derived from a generation and a topology string; users never type chips, hosts or devices.

Peaks per chip (FLOP/s, HBM, ICI and DCN bandwidth) are the Cloud TPU documentation's table of the three
generations, https://cloud.google.com/tpu/docs/tpu7x ("System architecture": peak BF16 and FP8 compute,
HBM bandwidth, bidirectional ICI bandwidth, DCN bandwidth per chip; v5p also at
https://cloud.google.com/tpu/docs/v5p). They bound a step's time from below (api/roofline.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TERA = 1e12
GB = 1e9


@dataclass(frozen=True)
class Generation:
    name: str  # our spelling, e.g. "v7x"
    gke_accelerator: str  # value of cloud.google.com/gke-tpu-accelerator
    machine_type: str  # 4-chip host machine type
    chips_per_host: int
    devices_per_chip: int  # JAX devices per chip (v7x: 2 chiplets)
    peak_bf16_flops: float  # per chip
    peak_fp8_flops: float  # per chip (v5p has no native fp8: same as bf16)
    hbm_bandwidth: float  # bytes/s per chip
    ici_bandwidth: float  # bytes/s per chip, both directions together (what the documentation quotes)
    dcn_bandwidth: float  # bytes/s per chip (the documentation's Gb/s over 8)
    hbm_gib: int  # per chip
    host_ram_gb: int  # per 4-chip host VM (Cloud TPU docs: v5p 448, v6e 720, TPU7x 960 GB)
    vmem_kib: int | None  # per TensorCore; bounds --xla_tpu_scoped_vmem_limit_kib
    sparse_core: bool  # SparseCore collective offload available
    dims: int  # 3 for the twisted-torus generations, 2 for v6e
    fixed_topologies: tuple[str, ...]  # sub-cube shapes that are valid as listed
    max_chips: int  # a full pod

    def peak_flops(self, precision: str) -> float:
        return self.peak_fp8_flops if precision == "fp8" else self.peak_bf16_flops

    def topology_error(self, topology: str) -> str | None:
        """Why `topology` is not a slice of this generation, or None when it is."""
        try:
            shape = parse_topology(topology)
        except ValueError as e:
            return str(e)
        if len(shape) != self.dims:
            return f"{topology} is not a {self.name} topology: it needs {self.dims} dimensions; valid examples: {self.examples}"
        if topology in self.fixed_topologies:
            return None
        if self.dims == 3:
            if any(d % 4 for d in shape) or list(shape) != sorted(shape):
                return (
                    f"{topology} is not a {self.name} topology: beyond {', '.join(self.fixed_topologies)} every "
                    f"dimension is a multiple of 4 and A <= B <= C; valid examples: {self.examples}"
                )
        elif topology not in self.fixed_topologies:
            return f"{topology} is not a {self.name} topology; valid: {', '.join(self.fixed_topologies)}"
        if math.prod(shape) > self.max_chips:
            return f"{topology} has {math.prod(shape)} chips, more than a full {self.name} pod ({self.max_chips})"
        return None

    @property
    def examples(self) -> str:
        return ", ".join(EXAMPLES[self.name])


def parse_topology(topology: str) -> tuple[int, ...]:
    parts = topology.split("x")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{topology!r} is not a topology of the form AxB or AxBxC with positive integers")
    return tuple(int(p) for p in parts)


GENERATIONS: dict[str, Generation] = {
    "v7x": Generation(
        name="v7x",
        gke_accelerator="tpu7x",
        machine_type="tpu7x-standard-4t",
        chips_per_host=4,
        devices_per_chip=2,
        peak_bf16_flops=2307 * TERA,
        peak_fp8_flops=4614 * TERA,
        hbm_bandwidth=7380 * GB,
        ici_bandwidth=1200 * GB,
        dcn_bandwidth=100 * GB / 8,
        hbm_gib=192,
        host_ram_gb=960,
        vmem_kib=65536,
        sparse_core=True,
        dims=3,
        fixed_topologies=("1x1x1", "2x2x1", "2x2x2", "2x2x4", "2x4x4"),
        max_chips=9216,
    ),
    "v6e": Generation(
        name="v6e",
        gke_accelerator="tpu-v6e-slice",
        machine_type="ct6e-standard-4t",
        chips_per_host=4,
        devices_per_chip=1,
        peak_bf16_flops=918 * TERA,
        peak_fp8_flops=918 * TERA,
        hbm_bandwidth=1638 * GB,
        ici_bandwidth=800 * GB,
        dcn_bandwidth=100 * GB / 8,
        hbm_gib=32,
        host_ram_gb=720,
        vmem_kib=131072,
        sparse_core=False,
        dims=2,
        fixed_topologies=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        max_chips=256,
    ),
    "v5p": Generation(
        name="v5p",
        gke_accelerator="tpu-v5p-slice",
        machine_type="ct5p-hightpu-4t",
        chips_per_host=4,
        devices_per_chip=1,
        peak_bf16_flops=459 * TERA,
        peak_fp8_flops=459 * TERA,
        hbm_bandwidth=2765 * GB,
        ici_bandwidth=1200 * GB,
        dcn_bandwidth=50 * GB / 8,
        hbm_gib=95,
        host_ram_gb=448,
        vmem_kib=None,
        sparse_core=False,
        dims=3,
        fixed_topologies=("2x2x1", "2x2x2", "2x2x4", "2x4x4"),
        max_chips=8960,
    ),
}

EXAMPLES = {"v7x": ("2x2x1", "4x4x4", "4x4x8"), "v6e": ("2x2", "4x4", "16x16"), "v5p": ("2x2x1", "4x4x4", "8x8x16")}

# GKE and Cloud TPU spellings users paste from other tools.
ALIASES = {
    "v7x": "v7x",
    "tpu7x": "v7x",
    "ironwood": "v7x",
    "tpu-v7x": "v7x",
    "v7": "v7x",
    "v6e": "v6e",
    "tpu-v6e-slice": "v6e",
    "trillium": "v6e",
    "tpu6e": "v6e",
    "v5p": "v5p",
    "tpu-v5p-slice": "v5p",
}


def generation(name: str) -> Generation:
    key = ALIASES.get(name.strip().lower())
    if key is None:
        raise ValueError(f"{name!r} is not a supported TPU generation; use one of v7x (tpu7x), v6e, v5p")
    return GENERATIONS[key]


@dataclass(frozen=True)
class Slice:
    """One slice of `topology` on `gen`, with everything derived from it."""

    gen: Generation
    topology: str

    @property
    def chips(self) -> int:
        return math.prod(parse_topology(self.topology))

    @property
    def chips_per_host(self) -> int:
        # A 1-chip v7x machine (tpu7x-standard-1t) is the only host with fewer than 4 chips.
        return min(self.gen.chips_per_host, self.chips)

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def devices(self) -> int:
        return self.chips * self.gen.devices_per_chip

    @property
    def machine_type(self) -> str:
        if self.chips == 1 and self.gen.name == "v7x":
            return "tpu7x-standard-1t"
        return self.gen.machine_type
