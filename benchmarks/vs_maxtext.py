"""Each example's train step beside MaxText's own step for the same job: per-device HBM, matmul FLOPs,
collective bytes by kind (ICI and DCN), HBM traffic and the step-time bound; and both trainers' steps timed
on this CPU.

    git clone https://github.com/AI-Hypercomputer/maxtext ~/.cache/maxtext   # once; tested at e591f30cb
    python benchmarks/vs_maxtext.py --maxtext ~/.cache/maxtext [--venv DIR] [--python python3.12]
        [--maxtext-only] [--largest N] [--dump DIR] [--json] [--ours-from PLAN.jsonl]
        [--maxtext-from EARLIER.jsonl] [examples/*.yaml ...]
    python benchmarks/vs_maxtext.py --maxtext ~/.cache/maxtext --cpu [--rounds N] [--steps N] [--json]

By hand only, never in CI (each MaxText compile takes minutes). Ours is `benchmarks/plan.py`'s plan (the
step `tpujob plan` compiles); MaxText's is its own `train_compile` for the same model, per-device batch,
sequence, remat, Splash blocks, fp8, MoE kernel, mesh degrees and slice count, compiled twice: "default"
with the LIBTPU_INIT_ARGS our renderer gives the job, and with `num_vocab_tiling=4` (MaxText's chunked
loss, the counterpart of ours) and no extra flags. What the job does not fix stays at MaxText's default
(e.g. JAX's Pallas Splash, not tokamax's). The ratio is ours over MaxText's smaller. Figures are
`memory_analysis()` per device: state (arguments) + temporaries (temps + outputs not aliased), and host
(pinned_host: offloaded activations) where there is any. MaxText runs in its own venv (Python >= 3.12), made
on first use from its own requirements at their lowest (tested) versions, as its setup.sh installs them,
with jax/jaxlib 0.10.2 and libtpu 0.0.52 pinned: the compiler our plan uses.

The costs of both compiled steps are read by the same walk of their optimized HLO (tpu_workload.performance.hlo_costs,
docs/plan.md: every loop at its trip count, the Splash and grouped-matmul kernels from their shapes, each
collective's full buffer by kind) and bounded at the same peaks (tpu_operator.api.roofline), so the
ratios compare like with like. Ratios are ours over MaxText's, per MaxText compile. MaxText's compiles do
not change with our trainer: `--maxtext-from` reads them from an earlier `--json` run, and `--ours-from`
takes ours from `benchmarks/plan.py --json`, so a comparison after a change to the trainer costs one
compile per example.

`--cpu` times both trainers on this machine instead: the `tiny` and `small` presets' decoders (MaxText's
llama2 decoder block with the same dimensions), 8 virtual CPU devices, FSDP 8, the same global batch,
sequence and remat (full), dot-product attention, synthetic data; the two run alternately, `--rounds`
times each, and each run's median step (MaxText's logged step seconds; ours, benchmarks/train.py's) is
taken, then the median over the rounds: tokens/s and ours ÷ MaxText's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan import ROOT, plan_one  # noqa: E402  (benchmarks/plan.py: our side)

from tpu_operator.api.contract import PlanResult, StepResources, TrainerConfig  # noqa: E402
from tpu_operator.api.derived import Plan  # noqa: E402
from tpu_operator.api.presets import PRESETS  # noqa: E402
from tpu_operator.api.validation import parse_job, read_documents, read_text  # noqa: E402
from tpu_operator.rendering.preflight import plan_env  # noqa: E402
from tpu_workload.performance.hlo_costs import KINDS  # noqa: E402
from tpu_workload.performance.plan import GIB, largest_allocations, step_resources  # noqa: E402

EXAMPLES = ("llama3-8b-fsdp", "multislice", "long-context", "moe")
PINS = "jax==0.10.2\njaxlib==0.10.2\nlibtpu==0.0.52\n"
REQUIREMENTS = "src/dependencies/requirements/generated_requirements/tpu-requirements.txt"
TRAIN_COMPILE = "maxtext.trainers.pre_train.train_compile"
# Our presets that MaxText has a model config for (same dimensions: configs/models/*.yml).
MODELS = ("llama3-8b", "llama3-70b", "mixtral-8x7b")
# MaxText's names (its compile_topology) for our generations: "<name>-<devices in a slice>".
GENERATIONS = {"v7x": "tpu7x"}
# Our custom-remat names -> the checkpoint names MaxText's layers give the same tensors.
REMAT_NAMES = {
    "decoder_layer_input": ["decoder_layer_input"],
    "qkv_proj": ["query_proj", "key_proj", "value_proj", "qkv_proj"],
    "attention_out": ["attention_out"],
    "out_proj": ["out_proj"],
    "mlp_in": ["mlpwi", "mlpwi_0", "mlpwi_1", "moe_mlpwi_0", "moe_mlpwi_1"],
    "mlp_out": ["mlpwo", "moe_mlpwo"],
}
# MaxText has no keep-everything policy; minimal_with_context (matmul outputs and attention kept) is nearest.
REMAT_POLICIES = {"full": "full", "minimal": "minimal", "none": "minimal_with_context"}


@dataclasses.dataclass
class Compiled:
    """One MaxText compile: its printed `memory_analysis()` (bytes per device) and what its step costs each
    device (read from its dumped module as ours is), or why it failed."""

    stats: dict[str, int]
    wall_s: float
    largest: list[str]
    error: str | None = None
    resources: StepResources | None = None

    def gib(self) -> dict[str, float]:
        """Per device: state (arguments), temporaries (temps + outputs not aliased to arguments), their
        total, and host (pinned_host) bytes, as tpu_workload.performance.plan.Memory counts HBM."""

        def size(added: tuple[str, ...], less: str = "") -> float:
            b = sum(self.stats.get(f"{k}_size_in_bytes", 0) for k in added) - self.stats.get(f"{less}_size_in_bytes", 0)
            return round(b / GIB, 2)

        return {
            "total_gib": size(("argument", "temp", "output"), "alias"),
            "state_gib": size(("argument",)),
            "temporaries_gib": size(("temp", "output"), "alias"),
            "host_gib": size(("host_argument", "host_temp", "host_output"), "host_alias"),
        }

    @classmethod
    def from_summary(cls, doc: dict) -> Compiled:
        """A compile as an earlier run's --json printed it (`summary`)."""
        resources = doc.get("resources")
        return cls(
            doc.get("bytes", {}),
            doc["wall_s"],
            doc.get("largest", []),
            doc.get("error"),
            StepResources.model_validate(resources) if resources else None,
        )

    def summary(self) -> dict[str, object]:
        return (
            {"error": self.error, "wall_s": self.wall_s}
            if self.error
            else {
                **self.gib(),
                "wall_s": self.wall_s,
                "bytes": self.stats,
                "largest": self.largest,
                "resources": self.resources and self.resources.model_dump(by_alias=True),
            }
        )


def maxtext_args(cfg: TrainerConfig) -> tuple[list[str], list[str]]:
    """MaxText's `key=value` overrides for the job, and notes on what it expresses only approximately.
    Raises ValueError where it cannot express the job at all."""
    m, t, k = cfg.model, cfg.training, cfg.kernels
    dims = m.model_dump()
    model = next(
        (
            p
            for p in MODELS
            if all(dims[f] == PRESETS[p].get(f, 0) for f in {*PRESETS[p], "experts", "experts_per_token"})
        ),
        None,
    )
    if model is None or cfg.generation not in GENERATIONS:
        raise ValueError(f"no MaxText model config / topology for {cfg.generation} and {dims}")
    devices = cfg.hosts_per_slice * cfg.devices_per_host * cfg.slices
    notes: list[str] = []
    args = [
        f"model_name={model}",
        f"compile_topology={GENERATIONS[cfg.generation]}-{devices // cfg.slices}",
        f"compile_topology_num_slices={cfg.slices}",
        f"per_device_batch_size={t.global_batch / devices}",
        f"max_target_length={t.sequence_length}",
        f"steps={t.steps}",
        # Only `data` spans slices (DCN) in our mesh; every other axis stays inside one slice.
        f"dcn_data_parallelism={cfg.slices}",
        f"ici_data_parallelism={cfg.mesh.data // cfg.slices}",
        f"ici_fsdp_parallelism={cfg.mesh.fsdp}",
        f"ici_context_parallelism={cfg.mesh.context}",
        f"ici_expert_parallelism={cfg.mesh.expert}",
        f"ici_tensor_parallelism={cfg.mesh.tensor}",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
    ]
    if t.remat.policy == "custom":
        args.append("remat_policy=custom")
        args += [f"{name}={where}" for ours, where in t.remat.tensors.items() for name in REMAT_NAMES[ours]]
    else:
        args.append(f"remat_policy={REMAT_POLICIES[t.remat.policy]}")
        if t.remat.policy == "none":
            notes.append("remat none -> MaxText minimal_with_context (it has no keep-everything policy)")
    if t.precision == "fp8":
        args += ["quantization=fp8_full", "use_qwix_quantization=true"]
    if k.attention == "splash":
        s = k.splash
        args += ["attention=flash"] + [
            f"sa_{name}={getattr(s, name)}"
            for name in (
                "block_q",
                "block_kv",
                "block_kv_compute",
                "block_q_dkv",
                "block_kv_dkv",
                "block_kv_dkv_compute",
                "block_q_dq",
                "block_kv_dq",
            )
        ]
        if s.max_logit_const is not None:
            # Acts only in tokamax's Splash; MaxText's default is JAX's Pallas Splash, which has no such constant.
            args.append(f"use_max_logit_estimate={int(s.max_logit_const)}")
    else:
        args.append("attention=dot_product")
    if m.experts:
        # No token dropping, as ours; gmm is Megablox, ragged_dot its XLA reference.
        args += ["sparse_matmul=true", "capacity_factor=-1", f"megablox={str(k.moe_matmul == 'gmm').lower()}"]
    return args, notes


def checkout(path: Path | None) -> Path:
    if path is None or not (path / "src" / Path(*TRAIN_COMPILE.split("."))).with_suffix(".py").exists():
        raise SystemExit(
            f"no MaxText checkout at {path}: fetch one with\n"
            "  git clone https://github.com/AI-Hypercomputer/maxtext ~/.cache/maxtext\n"
            "and pass --maxtext ~/.cache/maxtext (tested at commit e591f30cb)"
        )
    return path


def ensure_venv(venv: Path, maxtext: Path, python: str) -> Path:
    """MaxText's venv: its generated TPU requirements at their lowest versions (what its setup.sh installs:
    the versions its seed-env tested together), jax/jaxlib/libtpu pinned to ours. MaxText itself is not
    installed: the child runs it from the checkout (PYTHONPATH), so another checkout needs no new venv.
    Its GitHub-only extras (JetStream, mlperf-logging) are left out: train_compile does not import them."""
    py, ready = venv / "bin" / "python", venv / ".vs_maxtext-ready"
    if ready.exists() and ready.read_text() == PINS:
        return py
    print(f"making MaxText's venv in {venv} with {python} (a few minutes)", file=sys.stderr, flush=True)
    if not py.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pins = venv / "pins.txt"
    pins.write_text(PINS)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "uv"], check=True)
    subprocess.run(
        [
            str(py),
            "-m",
            "uv",
            "pip",
            "install",
            "--python",
            str(py),
            "--resolution=lowest",
            "-r",
            str(maxtext / REQUIREMENTS),
            "--override",
            str(pins),
        ],
        check=True,
    )
    ready.write_text(PINS)
    return py


def compile_maxtext(
    py: Path,
    maxtext: Path,
    args: list[str],
    flags: dict[str, str],
    dump: Path | None,
    largest: int,
    costs: Callable[[str], StepResources | None] = lambda _: None,
) -> Compiled:
    """MaxText's `train_compile` in a child, with XLA's memory report and optimized module dumped (into
    `dump` when given, kept there; else a scratch directory): the largest allocations, and `costs` of the
    dump directory (what the step costs each device)."""
    with tempfile.TemporaryDirectory(prefix="vs-maxtext-") as tmp:
        dump_dir = str(dump or f"{tmp}/dump")
        # Only `flags` reach the compiler: none of this shell's own LIBTPU_INIT_ARGS / XLA_FLAGS.
        env = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")}
        env |= {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONPATH": str(maxtext / "src"), **flags}
        env["XLA_FLAGS"] = (
            flags.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*train_step.*"
        ).strip()
        cmd = [
            str(py),
            "-m",
            TRAIN_COMPILE,
            str(maxtext / "src/maxtext/configs/base.yml"),
            *args,
            f"base_output_directory={tmp}/out",
            "run_name=vs_maxtext",
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
        wall = round(time.perf_counter() - start, 1)
        found = re.search(r"Memory analysis: CompiledMemoryStats\((.*)\)", proc.stdout)
        if proc.returncode or not found:
            tail = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()][-3:]
            return Compiled(
                {}, wall, largest_allocations(dump_dir, largest), f"exit {proc.returncode}: " + " | ".join(tail)
            )
        stats = {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", found.group(1))}
        return Compiled(stats, wall, largest_allocations(dump_dir, largest), resources=costs(dump_dir))


# --- the compiled steps' costs side by side -----------------------------------------------------------


def costs_reader(job) -> Callable[[str], StepResources | None]:
    """What a dumped step of `job` costs each device, bounded at its generation's peaks: the same figures,
    from the same walk, as our plan's."""
    plan = Plan(job)
    cfg = plan.trainer_config()

    def read(dump_dir: str) -> StepResources | None:
        found = step_resources(cfg, dump_dir, plan.total_devices)
        return found and plan.bounded(PlanResult(verdict="Fits", message="", resources=found)).resources

    return read


def resource_rows(ours: StepResources | None, theirs: list[StepResources | None]) -> list[tuple[str, list]]:
    """(label, [ours, MaxText's each]) rows of per-device per-step figures."""
    every = [ours, *theirs]

    def row(label: str, value: Callable[[StepResources], float | str | None]) -> tuple[str, list]:
        return label, [value(r) if r is not None else None for r in every]

    rows = [
        row("matmul TFLOP", lambda r: r.matmul_tflop),
        row("  of which fp8", lambda r: r.fp8_tflop),
        row("kernel calls", lambda r: r.kernel_calls),
    ]
    for net, field in (("ICI", "ici_gib"), ("DCN", "dcn_gib")):
        for kind in KINDS:
            if any(r is not None and kind in getattr(r, field) for r in every):
                rows.append(row(f"{net} {kind} GiB", lambda r, f=field, k=kind: getattr(r, f).get(k, 0.0)))
    rows += [
        row("collectives, all kinds GiB", lambda r: sum(r.ici_gib.values()) + sum(r.dcn_gib.values())),
        row("HBM traffic GiB", lambda r: r.hbm_traffic_gib),
        row("step-time bound s", lambda r: r.step_time_bound_s),
        row("  binding", lambda r: r.binding),
        row("MFU ceiling", lambda r: r.mfu_ceiling),
    ]
    return rows


def print_rows(rows: list[tuple[str, list]], names: list[str]) -> None:
    def fmt(v) -> str:
        return "-" if v is None else v if isinstance(v, str) else f"{v:,.4g}"

    def ratio(a, b) -> str:
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
        return f"{a / b:.2f}" if ok else ("=" if a == b and isinstance(a, str) else "-")

    head = "".join(f" {n:>16} {'ours/' + n.split()[-1]:>12}" for n in names[1:])
    print(f"    {'per device per step':28} {names[0]:>12}{head}", flush=True)
    for label, (mine, *theirs) in rows:
        print(
            f"    {label:28} {fmt(mine):>12}" + "".join(f" {fmt(t):>16} {ratio(mine, t):>12}" for t in theirs),
            flush=True,
        )


def _by_example(path: Path | None, key: str) -> dict[str, dict]:
    """JSON lines of an earlier run (benchmarks/plan.py --json, or this script's --json) by example."""
    if path is None:
        return {}
    found = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            found[doc["example"]] = doc.get(key, doc) if key else doc
    return found


def compare(args, py: Path, maxtext: Path, paths: list[Path]) -> None:
    """Per example: HBM, then the resources of ours and MaxText's two compiles side by side."""
    earlier_ours = {
        k: {f: v for f, v in d.items() if f not in ("example", "wall_s")}
        for k, d in _by_example(args.ours_from, "").items()
    }
    earlier_maxtext = _by_example(args.maxtext_from, "")
    if not args.json:
        print(
            f"{'example':20} {'ours':>21} {'MaxText default':>21} {'MaxText tiling 4':>21} {'ours/best':>9} "
            f"{'MaxText host':>12}",
            flush=True,
        )
    for path in paths:
        job = parse_job(read_documents(read_text(str(path)))[0])
        try:
            mt_args, notes = maxtext_args(Plan(job).trainer_config())
        except ValueError as exc:
            print(f"{path.name}: MaxText cannot express this job: {exc}", flush=True)
            continue
        if args.maxtext_only:
            ours = None
        elif path.name in earlier_ours:
            ours = Plan(job).bounded(PlanResult.model_validate(earlier_ours[path.name]))
        else:
            ours = plan_one(path, None, args.dump and args.dump / "ours")[0]
        dump = lambda mode: args.dump and args.dump / f"{path.stem}-{mode}"  # noqa: E731, B023 (called in this turn)
        n, costs = max(args.largest, 6), costs_reader(job)
        if path.name in earlier_maxtext:
            default, tiled = (
                Compiled.from_summary(earlier_maxtext[path.name][key])
                for key in ("maxtext_default", "maxtext_vocab_tiling_4")
            )
        else:
            default = compile_maxtext(py, maxtext, mt_args, plan_env(job), dump("default"), n, costs)
            tiled = compile_maxtext(py, maxtext, [*mt_args, "num_vocab_tiling=4"], {}, dump("tiling4"), n, costs)
        best = min((c.gib()["total_gib"] for c in (default, tiled) if not c.error), default=None)
        ratio = round(ours.hbm_per_device_gib / best, 2) if ours and ours.hbm_per_device_gib and best else None
        if args.json:
            print(
                json.dumps(
                    {
                        "example": path.name,
                        "maxtext_args": mt_args,
                        "notes": notes,
                        "ours": ours and ours.model_dump(by_alias=True, exclude_defaults=True),
                        "maxtext_default": default.summary(),
                        "maxtext_vocab_tiling_4": tiled.summary(),
                        "ratio": ratio,
                    }
                ),
                flush=True,
            )
            continue
        cell = lambda total, state, temps: f"{total:6.2f} ({state:.2f} + {temps:5.2f})"  # noqa: E731
        mine = (
            cell(ours.hbm_per_device_gib, ours.state_gib, ours.temporaries_gib)
            if ours and ours.hbm_per_device_gib is not None
            else (ours.verdict if ours else "-")
        )
        theirs = ["failed" if c.error else cell(*list(c.gib().values())[:3]) for c in (default, tiled)]
        hosts = "/".join(f"{c.gib()['host_gib']:.2f}" for c in (default, tiled) if not c.error)
        print(
            f"{path.name:20} {mine:>21} {theirs[0]:>21} {theirs[1]:>21} {ratio or '-':>9} {hosts:>12}"
            f"  ({default.wall_s:.0f}s + {tiled.wall_s:.0f}s)",
            flush=True,
        )
        print_rows(
            resource_rows(ours and ours.resources, [default.resources, tiled.resources]),
            ["ours", "MaxText default", "MaxText tiling4"],
        )
        for name, c in (("default", default), ("vocab tiling 4", tiled)):
            if c.error:
                print(f"    MaxText {name} failed: {c.error[:800]}", flush=True)
            for line in c.largest[: args.largest]:
                print(f"    MaxText {name}: {line}", flush=True)
        for note in notes:
            print(f"    note: {note}", flush=True)


# --- both trainers' steps on this CPU -----------------------------------------------------------------

# The decoders timed (our presets; MaxText's llama2 block with the same dimensions), global batch, sequence.
CPU_CASES = {"tiny": dict(batch=8, seq=128), "small": dict(batch=8, seq=256)}
CPU_DEVICES = 8
MAXTEXT_TRAIN = "maxtext.trainers.pre_train.train"


def time_ours(preset: str, batch: int, seq: int, steps: int) -> float:
    """Our trainer's median step (s): benchmarks/train.py, FSDP over 8 CPU devices, remat full."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "train.py"),
        "--case",
        "dense",
        "--preset",
        preset,
        "--steps",
        str(steps),
        "--devices",
        str(CPU_DEVICES),
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--remat",
        "full",
        "--attention",
        "xla",
    ]
    proc = subprocess.run(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"our trainer failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])["step_time_s"]


def time_maxtext(py: Path, maxtext: Path, preset: str, batch: int, seq: int, steps: int) -> float:
    """MaxText's median step (s) over its logged steps after the first three (compiles), same shapes."""
    m = PRESETS[preset]
    with tempfile.TemporaryDirectory(prefix="vs-maxtext-cpu-") as tmp:
        args = [
            f"base_emb_dim={m['model_dim']}",
            f"base_num_query_heads={m['heads']}",
            f"base_num_kv_heads={m['kv_heads']}",
            f"head_dim={m['head_dim']}",
            f"base_mlp_dim={m['mlp_dim']}",
            f"base_num_decoder_layers={m['layers']}",
            f"vocab_size={m['vocab']}",
            "decoder_block=llama2",
            f"per_device_batch_size={batch / CPU_DEVICES}",
            f"max_target_length={seq}",
            f"steps={steps}",
            "remat_policy=full",
            "attention=dot_product",
            f"ici_fsdp_parallelism={CPU_DEVICES}",
            "hardware=cpu",
            "skip_jax_distributed_system=true",
            "dataset_type=synthetic",
            "enable_checkpointing=false",
            "enable_tensorboard=false",
            f"base_output_directory={tmp}/out",
            "run_name=vs_maxtext_cpu",
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")}
        env |= {
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(maxtext / "src"),
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={CPU_DEVICES}",
        }
        proc = subprocess.run(
            [str(py), "-m", MAXTEXT_TRAIN, str(maxtext / "src/maxtext/configs/base.yml"), *args],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp,
        )
    found = [
        (int(step), float(sec))
        for step, sec in re.findall(r"completed step: (\d+), seconds: ([\d.]+)", proc.stdout + proc.stderr)
    ]
    timed = [sec for step, sec in found if step >= 3]
    if not timed:
        tail = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()][-3:]
        raise SystemExit(f"MaxText's CPU run failed (exit {proc.returncode}): " + " | ".join(tail))
    return statistics.median(timed)


def cpu_timing(args, py: Path, maxtext: Path) -> None:
    for preset, case in CPU_CASES.items():
        ours, theirs = [], []
        for _ in range(args.rounds):  # alternately, so the machine's load falls on both alike
            ours.append(time_ours(preset, case["batch"], case["seq"], args.steps))
            theirs.append(time_maxtext(py, maxtext, preset, case["batch"], case["seq"], args.steps))
        tokens = case["batch"] * case["seq"]
        mine, other = statistics.median(ours), statistics.median(theirs)
        result = {
            "preset": preset,
            **case,
            "devices": CPU_DEVICES,
            "fsdp": CPU_DEVICES,
            "remat": "full",
            "ours_step_s": ours,
            "maxtext_step_s": theirs,
            "ours_tokens_per_s": round(tokens / mine, 1),
            "maxtext_tokens_per_s": round(tokens / other, 1),
            "ratio": round(other / mine, 3),
        }
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(
                f"{preset:6} batch {case['batch']} x {case['seq']}, fsdp {CPU_DEVICES}, remat full: ours "
                f"{result['ours_tokens_per_s']:,.0f} tokens/s (median step {1e3 * mine:.1f} ms), MaxText "
                f"{result['maxtext_tokens_per_s']:,.0f} tokens/s ({1e3 * other:.1f} ms): ours {result['ratio']:.2f}x"
                f"  [steps ms: ours {', '.join(f'{1e3 * t:.1f}' for t in ours)}; "
                f"MaxText {', '.join(f'{1e3 * t:.1f}' for t in theirs)}]",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "examples", nargs="*", type=Path, help=f"job YAMLs (default: examples/{{{','.join(EXAMPLES)}}}.yaml)"
    )
    parser.add_argument("--maxtext", type=Path, help="a MaxText checkout (git clone of its public repository)")
    parser.add_argument(
        "--venv",
        type=Path,
        default=Path.home() / ".cache" / "vs_maxtext" / "venv",
        help="MaxText's venv, made there if missing (default: %(default)s)",
    )
    parser.add_argument("--python", default="python3.12", help="Python (>= 3.12) for a new venv (default: %(default)s)")
    parser.add_argument("--maxtext-only", action="store_true", help="skip our plan (MaxText's side only)")
    parser.add_argument("--largest", type=int, default=0, help="also print MaxText's N largest HBM allocations")
    parser.add_argument(
        "--dump",
        type=Path,
        help="keep XLA's dumps of MaxText's steps under DIR/<example>-<mode>, ours under DIR/ours/<example>",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per example (or CPU case)")
    parser.add_argument(
        "--ours-from", type=Path, help="our plans from `benchmarks/plan.py --json` output (not compiled again)"
    )
    parser.add_argument(
        "--maxtext-from",
        type=Path,
        help="MaxText's compiles from an earlier `--json` run of this script (the same jobs: not compiled again)",
    )
    parser.add_argument("--cpu", action="store_true", help="time both trainers' steps on this CPU instead")
    parser.add_argument("--rounds", type=int, default=3, help="--cpu: runs of each trainer, alternating (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="--cpu: steps per run (default 30)")
    args = parser.parse_args(argv)
    maxtext = checkout(args.maxtext.expanduser() if args.maxtext else None)
    py = ensure_venv(args.venv.expanduser(), maxtext, args.python)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; MaxText at {maxtext}", flush=True)
    if args.cpu:
        cpu_timing(args, py, maxtext)
    else:
        compare(args, py, maxtext, args.examples or [ROOT / "examples" / f"{name}.yaml" for name in EXAMPLES])
    return 0


if __name__ == "__main__":
    sys.exit(main())
