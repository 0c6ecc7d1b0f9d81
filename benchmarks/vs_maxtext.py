"""Per-device HBM of each example's train step beside MaxText's own step for the same job.

    git clone https://github.com/AI-Hypercomputer/maxtext ~/.cache/maxtext   # once; tested at e591f30cb
    python benchmarks/vs_maxtext.py --maxtext ~/.cache/maxtext [--venv DIR] [--python python3.12]
        [--maxtext-only] [--largest N] [--dump DIR] [--json] [examples/*.yaml ...]

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan import ROOT, plan_one  # noqa: E402  (benchmarks/plan.py: our side)

from tpu_operator.api.contract import TrainerConfig  # noqa: E402
from tpu_operator.api.plan import Plan  # noqa: E402
from tpu_operator.api.presets import PRESETS  # noqa: E402
from tpu_operator.api.validation import parse_job, read_documents, read_text  # noqa: E402
from tpu_operator.rendering.preflight import plan_env  # noqa: E402
from tpu_workload.plan import GIB, largest_allocations  # noqa: E402

EXAMPLES = ("llama3-8b-fsdp", "multislice", "long-context", "moe")
PINS = "jax==0.10.2\njaxlib==0.10.2\nlibtpu==0.0.52\n"
REQUIREMENTS = "src/dependencies/requirements/generated_requirements/tpu-requirements.txt"
TRAIN_COMPILE = "maxtext.trainers.pre_train.train_compile"
# Our presets that MaxText has a model config for (same dimensions: configs/models/*.yml).
MODELS = ("llama3-8b", "llama3-70b", "mixtral-8x7b")
# MaxText's names (its compile_topology) for our generations: "<name>-<devices in a slice>".
GENERATIONS = {"v7x": "tpu7x"}
# Our custom-remat names -> the checkpoint names MaxText's layers give the same tensors.
REMAT_NAMES = {"decoder_layer_input": ["decoder_layer_input"],
               "qkv_proj": ["query_proj", "key_proj", "value_proj", "qkv_proj"],
               "attention_out": ["attention_out"], "out_proj": ["out_proj"],
               "mlp_in": ["mlpwi", "mlpwi_0", "mlpwi_1", "moe_mlpwi_0", "moe_mlpwi_1"],
               "mlp_out": ["mlpwo", "moe_mlpwo"]}
# MaxText has no keep-everything policy; minimal_with_context (matmul outputs and attention kept) is nearest.
REMAT_POLICIES = {"full": "full", "minimal": "minimal", "none": "minimal_with_context"}


@dataclasses.dataclass
class Compiled:
    """One MaxText compile: its printed `memory_analysis()` (bytes per device), or why it failed."""

    stats: dict[str, int]
    wall_s: float
    largest: list[str]
    error: str | None = None

    def gib(self) -> dict[str, float]:
        """Per device: state (arguments), temporaries (temps + outputs not aliased to arguments), their
        total, and host (pinned_host) bytes, as tpu_workload.plan.Memory counts HBM."""
        def size(added: tuple[str, ...], less: str = "") -> float:
            b = sum(self.stats.get(f"{k}_size_in_bytes", 0) for k in added) - self.stats.get(f"{less}_size_in_bytes", 0)
            return round(b / GIB, 2)

        return {"total_gib": size(("argument", "temp", "output"), "alias"), "state_gib": size(("argument",)),
                "temporaries_gib": size(("temp", "output"), "alias"),
                "host_gib": size(("host_argument", "host_temp", "host_output"), "host_alias")}

    def summary(self) -> dict[str, object]:
        return {"error": self.error, "wall_s": self.wall_s} if self.error else \
            {**self.gib(), "wall_s": self.wall_s, "bytes": self.stats, "largest": self.largest}


def maxtext_args(cfg: TrainerConfig) -> tuple[list[str], list[str]]:
    """MaxText's `key=value` overrides for the job, and notes on what it expresses only approximately.
    Raises ValueError where it cannot express the job at all."""
    m, t, k = cfg.model, cfg.training, cfg.kernels
    dims = m.model_dump()
    model = next((p for p in MODELS if all(dims[f] == PRESETS[p].get(f, 0) for f in
                                           {*PRESETS[p], "experts", "experts_per_token"})), None)
    if model is None or cfg.generation not in GENERATIONS:
        raise ValueError(f"no MaxText model config / topology for {cfg.generation} and {dims}")
    devices = cfg.hosts_per_slice * cfg.devices_per_host * cfg.slices
    notes: list[str] = []
    args = [f"model_name={model}", f"compile_topology={GENERATIONS[cfg.generation]}-{devices // cfg.slices}",
            f"compile_topology_num_slices={cfg.slices}", f"per_device_batch_size={t.global_batch / devices}",
            f"max_target_length={t.sequence_length}", f"steps={t.steps}",
            # Only `data` spans slices (DCN) in our mesh; every other axis stays inside one slice.
            f"dcn_data_parallelism={cfg.slices}", f"ici_data_parallelism={cfg.mesh.data // cfg.slices}",
            f"ici_fsdp_parallelism={cfg.mesh.fsdp}", f"ici_context_parallelism={cfg.mesh.context}",
            f"ici_expert_parallelism={cfg.mesh.expert}", f"ici_tensor_parallelism={cfg.mesh.tensor}",
            "dataset_type=synthetic", "enable_checkpointing=false"]
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
        args += ["attention=flash"] + [f"sa_{name}={getattr(s, name)}" for name in (
            "block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
            "block_q_dq", "block_kv_dq")]
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
        raise SystemExit(f"no MaxText checkout at {path}: fetch one with\n"
                         "  git clone https://github.com/AI-Hypercomputer/maxtext ~/.cache/maxtext\n"
                         "and pass --maxtext ~/.cache/maxtext (tested at commit e591f30cb)")
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
    subprocess.run([str(py), "-m", "uv", "pip", "install", "--python", str(py), "--resolution=lowest",
                    "-r", str(maxtext / REQUIREMENTS), "--override", str(pins)], check=True)
    ready.write_text(PINS)
    return py


def compile_maxtext(py: Path, maxtext: Path, args: list[str], flags: dict[str, str], dump: Path | None,
                    largest: int) -> Compiled:
    """MaxText's `train_compile` in a child, with XLA's memory report dumped for the largest allocations
    (into `dump` when given, kept there; else a scratch directory)."""
    with tempfile.TemporaryDirectory(prefix="vs-maxtext-") as tmp:
        dump_dir = str(dump or f"{tmp}/dump")
        # Only `flags` reach the compiler: none of this shell's own LIBTPU_INIT_ARGS / XLA_FLAGS.
        env = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")}
        env |= {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONPATH": str(maxtext / "src"), **flags}
        env["XLA_FLAGS"] = (flags.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}"
                            " --xla_dump_hlo_module_re=.*train_step.*").strip()
        cmd = [str(py), "-m", TRAIN_COMPILE, str(maxtext / "src/maxtext/configs/base.yml"), *args,
               f"base_output_directory={tmp}/out", "run_name=vs_maxtext"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
        wall = round(time.perf_counter() - start, 1)
        found = re.search(r"Memory analysis: CompiledMemoryStats\((.*)\)", proc.stdout)
        if proc.returncode or not found:
            tail = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()][-3:]
            return Compiled({}, wall, largest_allocations(dump_dir, largest),
                            f"exit {proc.returncode}: " + " | ".join(tail))
        stats = {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", found.group(1))}
        return Compiled(stats, wall, largest_allocations(dump_dir, largest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="*", type=Path,
                        help=f"job YAMLs (default: examples/{{{','.join(EXAMPLES)}}}.yaml)")
    parser.add_argument("--maxtext", type=Path, help="a MaxText checkout (git clone of its public repository)")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "vs_maxtext" / "venv",
                        help="MaxText's venv, made there if missing (default: %(default)s)")
    parser.add_argument("--python", default="python3.12", help="Python (>= 3.12) for a new venv (default: %(default)s)")
    parser.add_argument("--maxtext-only", action="store_true", help="skip our plan (MaxText's side only)")
    parser.add_argument("--largest", type=int, default=0, help="also print MaxText's N largest HBM allocations")
    parser.add_argument("--dump", type=Path, help="keep XLA's dumps of MaxText's steps under DIR/<example>-<mode>")
    parser.add_argument("--json", action="store_true", help="one JSON line per example")
    args = parser.parse_args(argv)
    maxtext = checkout(args.maxtext.expanduser() if args.maxtext else None)
    py = ensure_venv(args.venv.expanduser(), maxtext, args.python)
    paths = args.examples or [ROOT / "examples" / f"{name}.yaml" for name in EXAMPLES]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; MaxText at {maxtext}", flush=True)
    if not args.json:
        print(f"{'example':20} {'ours':>21} {'MaxText default':>21} {'MaxText tiling 4':>21} {'ours/best':>9} "
              f"{'MaxText host':>12}", flush=True)
    for path in paths:
        job = parse_job(read_documents(read_text(str(path)))[0])
        try:
            mt_args, notes = maxtext_args(Plan(job).trainer_config())
        except ValueError as exc:
            print(f"{path.name}: MaxText cannot express this job: {exc}", flush=True)
            continue
        ours = None if args.maxtext_only else plan_one(path, None)[0]
        dump = lambda mode: args.dump and args.dump / f"{path.stem}-{mode}"  # noqa: E731
        n = max(args.largest, 6)
        default = compile_maxtext(py, maxtext, mt_args, plan_env(job), dump("default"), n)
        tiled = compile_maxtext(py, maxtext, [*mt_args, "num_vocab_tiling=4"], {}, dump("tiling4"), n)
        best = min((c.gib()["total_gib"] for c in (default, tiled) if not c.error), default=None)
        ratio = round(ours.hbm_per_device_gib / best, 2) if ours and ours.hbm_per_device_gib and best else None
        if args.json:
            print(json.dumps({"example": path.name, "maxtext_args": mt_args, "notes": notes,
                              "ours": ours and ours.model_dump(by_alias=True, exclude_defaults=True),
                              "maxtext_default": default.summary(), "maxtext_vocab_tiling_4": tiled.summary(),
                              "ratio": ratio}), flush=True)
            continue
        cell = lambda total, state, temps: f"{total:6.2f} ({state:.2f} + {temps:5.2f})"  # noqa: E731
        mine = cell(ours.hbm_per_device_gib, ours.state_gib, ours.temporaries_gib) \
            if ours and ours.hbm_per_device_gib is not None else (ours.verdict if ours else "-")
        theirs = ["failed" if c.error else cell(*list(c.gib().values())[:3]) for c in (default, tiled)]
        hosts = "/".join(f"{c.gib()['host_gib']:.2f}" for c in (default, tiled) if not c.error)
        print(f"{path.name:20} {mine:>21} {theirs[0]:>21} {theirs[1]:>21} {ratio or '-':>9} {hosts:>12}"
              f"  ({default.wall_s:.0f}s + {tiled.wall_s:.0f}s)", flush=True)
        for name, c in (("default", default), ("vocab tiling 4", tiled)):
            if c.error:
                print(f"    MaxText {name} failed: {c.error[:800]}", flush=True)
            for line in c.largest[:args.largest]:
                print(f"    MaxText {name}: {line}", flush=True)
        for note in notes:
            print(f"    note: {note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
