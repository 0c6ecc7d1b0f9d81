"""`python -m tpu_workload.performance.plan --config FILE`: the train step the pods will run, compiled by the TPU
compiler for the job's real slice on any machine with libtpu (no TPU), and whether it fits.

libtpu from PyPI compiles ahead of time for a slice it does not have: `topology_devices` makes the
devices of `slices` slices of the job's generation and topology, the trainer's own mesh (`tpu_grid`)
goes over them, and `train.build(cfg, mesh, interpret=False)` gives the exact step (kernels through
Mosaic, fp8, remat, loss chunks), which is lowered with abstract arguments and compiled.
`memory_analysis()` then gives per-device bytes: state (the step's arguments: parameters, optimizer
state, the batch) and temporaries (activations and scratch, plus outputs not donated back).

What the process prints on stdout is one JSON object, a `PlanResult` (contract.py); with
`--termination-log PATH` it also writes it there, cut to the 4 KiB Kubernetes keeps (the operator's
pre-flight pod reads it back from the pod's status). Human logs go to stderr. Exit status: 0 it
fits; 2 the job must change (HBM, VMEM or a flag libtpu refuses); 3 it could not be checked here
(no libtpu, a generation this libtpu cannot target, any other compile failure).

Order matters: libtpu reads LIBTPU_INIT_ARGS once per process, at the first topology, and ends the
process on a bad flag; so the flags are checked first in a child (libtpu_flags.py), JAX_PLATFORMS
is cpu (nothing initialises libtpu earlier), and ALLOW_MULTIPLE_LIBTPU_LOAD lets several plans run
at once. XLA's `cost_analysis()` is not used: for a scanned model with Pallas calls its
`optimal_seconds` is negative and its `flops` count one layer. What the step costs per device (matmul
FLOPs, collective bytes, HBM traffic: `PlanResult.resources`) is read instead from the optimized module
XLA dumps beside its memory report, every loop at its trip count (hlo_costs.py); the bounds those set on
the step's time need the generation's peaks, which the operator fills in (tpu_operator.api.roofline).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import tempfile
import time

from tpu_operator.api.contract import PlanResult, RejectedFlag, StepResources, TrainerConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
# Our generation names as libtpu names them (`v7x` itself is not one), and the chips of one host.
LIBTPU_NAMES = {"v7x": "tpu7x", "v6e": "v6e", "v5p": "v5p"}
CHIPS_PER_HOST = (2, 2, 1)
LARGEST = 6  # allocations listed when it does not fit


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def topology_devices(generation: str, topology: str, slices: int) -> list:
    """The devices of `slices` slices of `generation` `topology`, made by libtpu (no TPU needed)."""
    from jax.experimental import topologies

    dims = [int(d) for d in topology.split("x")]
    padded = dims + [1] * (3 - len(dims))
    bounds = tuple(min(b, d) for b, d in zip(CHIPS_PER_HOST, padded))  # 1x1x1 is a 1-chip host
    topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name=f"{LIBTPU_NAMES.get(generation, generation)}:{topology}",
        chip_config_name="default",
        chips_per_host_bounds=bounds,
        num_slices=slices,
        wrap=tuple(d >= 4 for d in padded),
    )
    return list(topo.devices)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of a compiled step (`compiled.memory_analysis()`): HBM, and the host memory
    of activations a remat policy offloads to `pinned_host`."""

    argument: int
    output: int
    alias: int
    temp: int
    host_argument: int = 0
    host_output: int = 0
    host_alias: int = 0
    host_temp: int = 0

    @classmethod
    def of(cls, stats) -> Memory:
        return cls(*(getattr(stats, f"{f.name}_size_in_bytes") for f in dataclasses.fields(cls)))

    @property
    def host(self) -> int:
        return self.host_argument + self.host_temp + self.host_output - self.host_alias

    @property
    def state(self) -> int:
        return self.argument

    @property
    def temporaries(self) -> int:
        return self.temp + self.output - self.alias

    @property
    def total(self) -> int:
        return self.state + self.temporaries


def build_step(cfg: TrainerConfig, devices: list):
    """The trainer's step over `devices`, lowered with abstract arguments; and the trainer."""
    from ..data import batches as data
    from ..loop import train
    from ..model import sharding

    mesh = sharding.make_mesh(cfg.mesh.shape, cfg.slices, devices)
    trainer = train.build(cfg, mesh, interpret=False)
    return trainer.step.lower(
        trainer.abstract_state, data.abstract_batch(cfg.training, trainer.batch_sharding)
    ), trainer


# --- what went wrong ------------------------------------------------------------------------------


def oom_kind(exc: BaseException) -> str | None:
    """'hbm' or 'vmem' for the TPU compiler's out-of-memory errors (RESOURCE_EXHAUSTED), else None.
    Seen with libtpu 0.0.52:
      E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for HLO temporaries
        (162.91G) exceeds available HBM (94.74G).
      XLA:TPU compile permanent error. Ran out of memory in memory space vmem. Used 91.44M of 63.94M vmem.
      E1001: CompileTimeScopedVmemOom: Ran out of memory in memory space vmem while allocating on stack
        for %splash_mha_dkv_no_residuals.1 ... Scoped allocation with size 35.78M and limit 32.00M ...
    """
    text = str(exc)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    if "memory space vmem" in text or "ScopedVmemOom" in text:
        return "vmem"
    if "HbmOom" in text or "memory on HBM" in text:
        return "hbm"
    return None


def _first_line(exc: BaseException | str) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "(no message)")[:600]


def hbm_advice(cfg: TrainerConfig, state: int, limit: float) -> list[str]:
    """Fields (under spec) that lower per-device HBM, the most direct first: where the state alone
    takes half the limit or more, more devices to shard it over; otherwise fewer activations."""
    m, t = cfg.mesh, cfg.training
    shard_state = ["tpu.topology"] + (["parallelism.fsdp"] if m.fsdp * m.tensor * m.expert * m.context > m.fsdp else [])
    # Accumulation first: it keeps the batch (and so the training) the job asked for.
    fewer_activations = ["training.microbatches", "training.globalBatch"]
    if t.remat.policy != "full":
        fewer_activations.append("training.remat.policy")
    fewer_activations.append("tpu.slices")  # the batch spreads over more devices
    if t.sequence_length >= 32768:
        fewer_activations.append("parallelism.context")
    if state >= limit / 2:
        return shard_state + fewer_activations
    return fewer_activations + shard_state


def vmem_summary(text: str) -> str:
    """The kernel and the numbers of a VMEM overflow, without the HLO instruction the compiler quotes."""
    kernel = re.search(r"for %([\w.-]+) =|HLO :: ([\w.-]+)", text)
    numbers = re.search(
        r"Scoped allocation with size [\d.]+\w+ and limit [\d.]+\w+ exceeded [^.]*\.\d*\w*|"
        r"Used [\d.]+\w+ of [\d.]+\w+ vmem\. Exceeded vmem capacity by [\d.]+\w+",
        text,
    )
    name = next((g for g in kernel.groups() if g), "") if kernel else ""
    return (f"{name}: " if name else "") + (numbers.group(0) if numbers else _first_line(text))


def vmem_advice(text: str) -> list[str]:
    """Smaller kernel blocks, or more scoped VMEM (up to the chip's: the operator checks that bound)."""
    kernel = "kernels.splash" if "splash" in text else "kernels.moeMatmul"
    return [kernel, "runtime.scopedVmemLimitKiB"]


def largest_allocations(dump_dir: str | None, n: int = LARGEST) -> list[str]:
    """The n largest HBM allocations of XLA's memory-usage report of the step ('size: shapes')."""
    files = sorted(glob.glob(os.path.join(dump_dir or "", "*train_step*memory-usage-report.txt")), key=os.path.getsize)
    if not files:
        return []
    with open(files[-1]) as f:
        first = f.read().split("\n\n", 1)[0]  # the default memory space (HBM)
    rows = re.findall(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+\s*\w+);\s*\d+;\s*\d+;\s*(.*)$", first, re.M)
    return [f"{size.replace('GiB', ' GiB').replace('MiB', ' MiB')}: {shapes[:160]}" for size, shapes in rows[:n]]


# --- the plan ---------------------------------------------------------------------------------------


def _gib(n: float) -> float:
    return round(n / GIB, 3)


def _figure(n: float) -> float:
    return float(f"{n:.6g}")


def step_resources(cfg: TrainerConfig, dump_dir: str | None, devices: int) -> StepResources | None:
    """What the compiled step costs each device, from its optimized module in XLA's dump (hlo_costs.py), with
    the model FLOPs MFU counts; None where there is no dump or the walk fails (logged: the plan goes on)."""
    from . import flops, hlo_costs

    try:
        costs = hlo_costs.dump_costs(dump_dir) if dump_dir else None
    except Exception:  # noqa: BLE001 -- a module the walk does not understand must not fail the plan
        log.exception("reading the step's costs from its HLO failed")
        return None
    if costs is None:
        return None
    gib = lambda d: {k: _figure(v / GIB) for k, v in d.items()}  # noqa: E731
    return StepResources(
        matmul_tflop=_figure(costs.flops / 1e12),
        fp8_tflop=_figure(costs.fp8_flops / 1e12),
        model_tflop=_figure(flops.flops_per_step(cfg.model, cfg.training) / devices / 1e12),
        kernel_calls=int(sum(costs.kernel_calls.values())),
        ici_gib=gib(costs.ici_bytes),
        dcn_gib=gib(costs.dcn_bytes),
        ici_sent_gib=_figure(costs.ici_wire_bytes / GIB),
        dcn_sent_gib=_figure(costs.dcn_wire_bytes / GIB),
        hbm_traffic_gib=_figure(costs.hbm_bytes / GIB),
        unknown_loops=len(costs.unknown_loops),
    )


def plan(
    cfg: TrainerConfig,
    *,
    capacity_gib: float | None,
    headroom: float,
    dump_dir: str | None = None,
    host_capacity_gib: float | None = None,
) -> PlanResult:
    """Compile `cfg`'s step for its slice and judge it against `capacity_gib` of HBM per device (and
    `host_capacity_gib` of host memory, for offloaded activations) less `headroom`. In this process:
    LIBTPU_INIT_ARGS must be set, and accepted (`libtpu_flags`), before."""
    from ..model import sharding

    base = dict(
        hbm_capacity_gib=capacity_gib,
        host_capacity_gib=host_capacity_gib,
        headroom=headroom,
        libtpu_version=libtpu_version(),
    )
    where = f"{cfg.generation} {cfg.topology} x {cfg.slices} slice(s)"
    try:
        devices = topology_devices(cfg.generation, cfg.topology, cfg.slices)
    except Exception as exc:  # noqa: BLE001 -- libtpu's INVALID_ARGUMENT for a name it does not know
        return PlanResult(
            verdict="Unsupported",
            message=f"libtpu {base['libtpu_version']} cannot make a {where}: {_first_line(exc)}",
            **base,
        )
    base |= dict(device_kind=devices[0].device_kind, devices=len(devices))
    try:
        lowered, trainer = build_step(cfg, devices)
    except Exception as exc:  # noqa: BLE001 -- a bug or a shape the trainer refuses: not the user's to fix
        log.exception("building the step failed")
        return PlanResult(verdict="CompileError", message=f"building the step failed: {_first_line(exc)}", **base)
    state = sharding.state_bytes(trainer.abstract_state, trainer.sharder.mesh).per_device
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as exc:  # noqa: BLE001 -- classified below; anything else is reported, not raised
        seconds = round(time.perf_counter() - start, 1)
        kind, first = oom_kind(exc), _first_line(exc)
        if kind == "vmem":
            return PlanResult(
                verdict="VmemOverflow",
                compile_seconds=seconds,
                change=vmem_advice(str(exc)),
                **base,
                message=f"a Mosaic kernel does not fit VMEM on {devices[0].device_kind}: {vmem_summary(str(exc))}",
            )
        if kind == "hbm":
            limit = (capacity_gib or 0) * (1 - headroom) * GIB
            return PlanResult(
                verdict="DoesNotFit",
                compile_seconds=seconds,
                state_gib=_gib(state),
                **base,
                change=hbm_advice(cfg, state, limit),
                largest=largest_allocations(dump_dir),
                message=f"does not fit HBM on a {where}: {first} Parameters and optimizer state alone "
                f"are {_gib(state)} GiB per device",
            )
        log.error("compile failed: %s", exc)
        return PlanResult(
            verdict="CompileError", compile_seconds=seconds, **base, message=f"the TPU compiler failed: {first}"
        )
    seconds = round(time.perf_counter() - start, 1)
    memory = Memory.of(compiled.memory_analysis())
    numbers = dict(
        hbm_per_device_gib=_gib(memory.total),
        state_gib=_gib(memory.state),
        temporaries_gib=_gib(memory.temporaries),
        host_per_device_gib=_gib(memory.host),
        compile_seconds=seconds,
        largest=largest_allocations(dump_dir),
        resources=step_resources(cfg, dump_dir, len(devices)),
    )
    said = (
        f"{_gib(memory.total)} GiB per device ({_gib(memory.state)} state + {_gib(memory.temporaries)} "
        f"temporaries) on a {where}"
    ) + (f", {_gib(memory.host)} GiB offloaded to host" if memory.host else "")
    if host_capacity_gib is not None and memory.host / GIB > host_capacity_gib * (1 - headroom):
        return PlanResult(
            verdict="DoesNotFit",
            change=["training.remat.tensors", "training.globalBatch"],
            **numbers,
            **base,
            message=f"does not fit host memory: {said}, more than {host_capacity_gib:g} GiB "
            f"of host memory per device less {headroom:.0%} headroom",
        )
    if capacity_gib is None:
        return PlanResult(
            verdict="Fits", message=f"compiles: {said}; no HBM capacity given to check against", **numbers, **base
        )
    usable = capacity_gib * (1 - headroom)
    if memory.total / GIB <= usable:
        return PlanResult(
            verdict="Fits",
            **numbers,
            **base,
            message=f"fits: {said}, of {capacity_gib:g} GiB ({usable:.1f} GiB with {headroom:.0%} headroom)",
        )
    return PlanResult(
        verdict="DoesNotFit",
        change=hbm_advice(cfg, memory.state, usable * GIB),
        **numbers,
        **base,
        message=f"does not fit: {said}, more than {usable:.1f} GiB ({capacity_gib:g} GiB less {headroom:.0%} headroom)",
    )


def check(
    cfg: TrainerConfig,
    *,
    capacity_gib: float | None,
    headroom: float,
    host_capacity_gib: float | None = None,
    keep_dump: str | None = None,
) -> PlanResult:
    """The whole check, as the CLI runs it: libtpu present, the flags of $LIBTPU_INIT_ARGS accepted (in
    a child), then `plan` in this process with XLA's memory report and optimized module dumped to a
    scratch directory (to `keep_dump`, kept, when given)."""
    base = dict(hbm_capacity_gib=capacity_gib, headroom=headroom)
    if importlib.util.find_spec("libtpu") is None:
        return PlanResult(
            verdict="NoLibtpu",
            **base,
            message="libtpu is not installed here, so the TPU compiler "
            "cannot be run: pip install 'tpu-operator[plan]' (or the TPU workload image)",
        )
    from . import libtpu_flags

    flags = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    bad: list[RejectedFlag] = libtpu_flags.rejected(flags, cfg.generation)
    if bad:
        return PlanResult(
            verdict="RejectedFlags",
            rejected_flags=bad,
            libtpu_version=libtpu_version(),
            **base,
            change=["runtime.libtpuInitArgs"],
            message=f"libtpu {libtpu_version()} refuses {len(bad)} LIBTPU_INIT_ARGS flag(s): "
            + "; ".join(f"{b.flag}: {b.message}" for b in bad),
        )
    with tempfile.TemporaryDirectory(prefix="tpujob-plan-") as scratch:
        dump = keep_dump or scratch
        # The TPU compiler reads XLA_FLAGS too: its memory report names the largest allocations, and its
        # optimized module says what the step costs (hlo_costs.py).
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*train_step.*"
        ).strip()
        return plan(
            cfg, capacity_gib=capacity_gib, headroom=headroom, dump_dir=dump, host_capacity_gib=host_capacity_gib
        )


def worst(results: list[tuple[int, PlanResult]]) -> PlanResult:
    """One result for plans at several slice counts (an elastic job): the first that does not fit or could not
    be checked, else the one that needs the most HBM per device; with the slice count it is for, every
    count's HBM per device, and the compile time of all of them."""
    by = {str(k): r.hbm_per_device_gib for k, r in results if r.hbm_per_device_gib is not None}
    bad = [(k, r) for k, r in results if r.verdict != "Fits"]
    k, r = bad[0] if bad else max(results, key=lambda kr: kr[1].hbm_per_device_gib or 0.0)
    total = sum(x.compile_seconds or 0.0 for _, x in results)
    return r.model_copy(
        update=dict(
            slices=k,
            hbm_by_slices=by,
            compile_seconds=round(total, 1) if total else None,
            message=f"on {k} slice(s): {r.message}" if len(results) > 1 else r.message,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tpu_workload.performance.plan", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", required=True, help="TrainerConfig JSON file (the one the pods mount)")
    parser.add_argument(
        "--hbm-capacity-gib",
        type=float,
        help="HBM of one device (v7x: 96); unset: only the compiler's own limit is checked",
    )
    parser.add_argument(
        "--host-capacity-gib",
        type=float,
        help="host memory per device (v7x: 111.8); unset: offloaded bytes are reported, not checked",
    )
    parser.add_argument(
        "--headroom", type=float, default=0.10, help="fraction of HBM (and host memory) to keep free (default 0.10)"
    )
    parser.add_argument("--termination-log", help="also write the result here (e.g. /dev/termination-log)")
    parser.add_argument(
        "--keep-dump", metavar="DIR", help="keep XLA's dump of the step (its optimized module, memory report) in DIR"
    )
    parser.add_argument(
        "--slice-counts",
        help="an elastic job: compile at each of these slice counts (e.g. 2,1; the "
        "config applied with TrainerConfig.at_slices) and report the worst",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before JAX is imported: nothing may initialise libtpu before the flags are checked, and several
    # plans may run on one machine.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with open(args.config) as f:
        cfg = TrainerConfig.model_validate_json(f.read())
    try:
        import absl.flags

        absl.flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags on first use
    except ImportError:
        pass
    counts = [int(c) for c in args.slice_counts.split(",")] if args.slice_counts else [cfg.slices]
    results = [
        (
            k,
            check(
                cfg if k == cfg.slices else cfg.at_slices(k),
                capacity_gib=args.hbm_capacity_gib,
                headroom=args.headroom,
                host_capacity_gib=args.host_capacity_gib,
                keep_dump=args.keep_dump and os.path.join(args.keep_dump, f"slices-{k}"),
            ),
        )
        for k in counts
    ]
    result = worst(results) if args.slice_counts else results[0][1]
    print(result.model_dump_json(by_alias=True, exclude_defaults=True), flush=True)
    if args.termination_log:
        with open(args.termination_log, "w") as f:
            f.write(result.to_termination_message())
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
