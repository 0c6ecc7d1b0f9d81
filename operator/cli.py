"""`tpujob`: render, validate and print the CRD; run the operator; run a job locally."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from .api import crd
from .api.derived import Plan
from .api.models import TPUTrainingJob
from .api.problems import shown
from .api.validation import InvalidJob, parse_job, read_documents, read_text
from .rendering.manifests import render, to_yaml_stream
from .rendering.summary import summary

EXIT_INVALID = 2
EXIT_NOT_CHECKED = 3  # validate --server: the server was not asked (unreachable, no credentials)


def load_jobs(path: str, needs_image: bool = False, default_image: str | None = None) -> list[TPUTrainingJob]:
    """Every job in the file, or InvalidJob listing every problem of every document (parse_job's
    `needs_image` and `default_image` as there)."""
    docs = read_documents(read_text(path))
    jobs, errors = [], []
    for i, doc in enumerate(docs):
        try:
            jobs.append(parse_job(doc, needs_image=needs_image, default_image=default_image))
        except InvalidJob as exc:
            prefix = f"document {i + 1}: " if len(docs) > 1 else ""
            errors += [prefix + p for p in exc.problems]
    if errors:
        raise InvalidJob(errors)
    return jobs


def cmd_render(args: argparse.Namespace) -> int:
    jobs = load_jobs(args.file, needs_image=True, default_image=args.default_image)
    manifests = [m for job in jobs for m in render(job, args.default_image)]
    sys.stdout.write(to_yaml_stream(manifests))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    needs_image = args.default_image is not None or args.server  # the server is sent the rendered pods
    jobs = load_jobs(args.file, needs_image=needs_image, default_image=args.default_image)
    for job in jobs:
        print("\n".join(shown(line, 1000) for line in summary(Plan(job))))  # flag values are the user's
        if job.spec.image is None and args.default_image is None:
            print("image: not set: the operator's --default-image (a job is Invalid where the operator has none)")
        if args.project or args.zone:
            from .api.capacity import check_capacity

            print(check_capacity(job, args.project, args.zone))
    if args.server:
        import asyncio

        return asyncio.run(server_check(jobs, args.default_image, args.namespace))
    return 0


async def server_check(jobs: list[TPUTrainingJob], default_image: str | None, namespace: str | None) -> int:
    """The operator's own dry run (children.dry_run: `?dryRun=All`) of each job's ConfigMap, JobSet and one pod
    per pod template, against the kubeconfig's cluster (as the operator does before it creates anything):
    EXIT_INVALID with the API's refusal naming the object, 0 when all are admitted, EXIT_NOT_CHECKED when
    the server cannot be reached or will not answer (no credentials, RBAC, JobSet not installed)."""
    from .controller.children import Inadmissible, dry_run, pods_of
    from .controller.kube import CONFIGMAPS, JOBSETS, PODS, ApiError, AsyncKube, api_client, configuration

    try:
        credentials = await configuration()
    except Exception as exc:  # noqa: BLE001 -- any loader failure means the same thing
        print(
            f"error: not checked by a server: no kubeconfig ({type(exc).__name__}: {shown(str(exc), 500)})",
            file=sys.stderr,
        )
        return EXIT_NOT_CHECKED
    api = api_client(credentials)
    worst = 0
    try:
        kube = AsyncKube(api)
        for job in jobs:
            if namespace:
                job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": namespace})})
            config_map, jobset = render(job, default_image)
            where = f"{job.metadata.namespace}/{job.metadata.name}"
            try:
                await dry_run(
                    kube,
                    job.metadata.namespace,
                    (CONFIGMAPS, config_map),
                    (JOBSETS, jobset),
                    *((PODS, p) for p in pods_of(jobset)),
                    strict=True,
                )
            except Inadmissible as exc:
                print(f"error: {where}: {shown(str(exc), 1000)}", file=sys.stderr)
                worst = EXIT_INVALID
            except ApiError as exc:
                print(
                    f"error: {where}: not checked by the server {credentials.host}: {shown(str(exc), 500)}",
                    file=sys.stderr,
                )
                return EXIT_NOT_CHECKED
            else:
                print(f"server: {credentials.host} admits {where} in a dry run (its ConfigMap, JobSet and pods)")
    finally:
        await api.close()
    return worst


def cmd_plan(args: argparse.Namespace) -> int:
    from .local.compiler import run_plan
    from .rendering.plan_report import lines

    worst = 0
    for job in load_jobs(args.file):
        # An elastic job may run on any count from minSlices up: each shape must fit before a TPU is spent.
        counts = list(reversed(job.spec.tpu.slice_counts))
        for running in counts:
            result = run_plan(job, running=running)
            if args.json:
                print(result.model_dump_json(by_alias=True))
            else:
                if len(counts) > 1:
                    print(f"on {running} of {job.spec.tpu.slices} slices (elastic):")
                print("\n".join(lines(result, job)))
            worst = max(worst, result.exit_code)
    return worst


def cmd_crd(args: argparse.Namespace) -> int:
    sys.stdout.write(crd.to_yaml())
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def print_plan(job: TPUTrainingJob, *, skip: bool = False) -> None:
    """Before a local run: the plan of the job's real slice, where libtpu can compile it here."""
    from .local.compiler import available, run_plan
    from .rendering.plan_report import lines

    if job.spec.command or job.spec.plan.preflight == "skip":
        return  # its own command is not our trainer's step; or planning is off for this job
    if skip:
        print("plan: not checked for the real slice (--no-plan; `tpujob plan -f FILE` checks it)")
        return
    if not available():
        print("plan: not checked for the real slice (libtpu is not installed: pip install 'tpu-operator[plan]')")
        return
    print(f"plan of the real slice ({job.spec.tpu.topology} x {job.spec.tpu.slices}), before the local run:")
    print("\n".join("  " + line for line in lines(run_plan(job), job)), flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    from .local.run import TooLargeForLocal, check_fits, run_local, scale_down

    if not args.local:
        print(
            "error: only --local runs are supported by `tpujob run`; on a cluster, `kubectl apply -f` the job "
            "with the operator installed",
            file=sys.stderr,
        )
        return EXIT_INVALID
    docs = read_documents(read_text(args.file))
    if len(docs) != 1:
        raise InvalidJob([f"(file): run --local takes exactly one job, got {len(docs)} documents"])
    doc = docs[0]
    original = parse_job(doc)  # the job as written must be valid before it is shrunk
    if original.spec.runtime.by_reference:
        raise InvalidJob(
            [
                "spec.runtime: a local run has no Secrets, ConfigMaps or pod fields to read valueFrom or "
                "envFrom from; give the values for the local run as runtime.env values"
            ]
        )
    if args.scale_down:
        doc, changes = scale_down(doc)
        print("scaled down for this machine: " + "; ".join(changes))
    if args.steps is not None:  # a short try of a long job
        doc = {**doc, "spec": {**doc["spec"], "training": {**doc["spec"]["training"], "steps": args.steps}}}
    job = parse_job(doc)
    try:
        check_fits(job)
    except TooLargeForLocal as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if args.profile is not None:
        from .api.profiling import parse_steps

        try:
            args.profile = str(parse_steps(args.profile, job.spec.training.steps))
        except ValueError as exc:
            print(f"error: --profile: {exc}", file=sys.stderr)
            return EXIT_INVALID
    print_plan(original, skip=args.no_plan)  # the job as written, for its real slice
    run_dir = Path(args.run_dir or f"runs/{job.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    # SIGTERM (e.g. from a test or a container runtime) stops the processes like Ctrl-C does; and so does
    # SIGINT even where the run was started with it ignored (a background job of a shell script, or a
    # parent that ignores it: Python then installs no KeyboardInterrupt for it).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        ran = run_local(job, run_dir, profile=args.profile)
    except TooLargeForLocal as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if ran.metrics:
        from .local.report import write_report

        try:
            print(f"report: {write_report(run_dir)}")
        except ImportError:
            print("report: matplotlib is not installed; `pip install matplotlib` for the PNG")
    return {"Succeeded": 0, "Interrupted": 130}.get(ran.phase, 1)


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .local.report import write_report

    run_dir = Path(args.run_dir)
    try:
        print(write_report(run_dir, Path(args.output) if args.output else None))
    except (OSError, ValueError) as exc:
        print(f"error: cannot report on {run_dir}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """The trainer's code (workload/data/prepare.py), run in a child process as `convert` and `export` are:
    the operator never imports the trainer."""
    import subprocess

    child = [sys.executable, "-m", "tpu_workload.data.prepare", *args.inputs, "--format", args.format]
    child += ["--tokenizer", args.tokenizer, "--out", args.out, "--vocab", str(args.vocab)]
    child += ["--text-field", args.text_field, "--records-per-file", str(args.records_per_file)]
    child += ["--eos-id", str(args.eos_id)] if args.eos_id is not None else []
    return subprocess.call(child)


def add_data_parser(sub: Any) -> None:
    """`tpujob data prepare`: text tokenized once into the ArrayRecord files `format: arrayrecord` reads."""
    data = sub.add_parser("data", help="prepare training data").add_subparsers(dest="data_command", required=True)
    p = data.add_parser(
        "prepare",
        help="tokenize text files (jsonl, parquet, text) once into ArrayRecord files: the tokens that "
        "on-the-fly tokenization with the same settings gives, for `format: arrayrecord`",
    )
    p.add_argument("inputs", nargs="+", metavar="IN", help="a file, directory or glob of the format (in order)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, a SentencePiece .model, or a directory")
    p.add_argument("--format", required=True, choices=("jsonl", "parquet", "text"), help="the inputs' format")
    p.add_argument("--out", required=True, help="a local directory for the ArrayRecord files (new or empty)")
    p.add_argument("--vocab", required=True, type=int, help="model.vocab of the jobs that will read the files")
    p.add_argument("--eos-id", type=int, help="training.data.eosId (default: the tokenizer's own)")
    p.add_argument("--text-field", default="text", help="training.data.textField (default: text)")
    p.add_argument("--records-per-file", type=int, default=1 << 20, help="documents per ArrayRecord file")
    p.set_defaults(func=cmd_data_prepare)


def cmd_operator(args: argparse.Namespace) -> int:
    from .controller import slim_client

    slim_client.install()  # before anything imports kubernetes_asyncio (slim_client.py)
    from .controller.main import run_operator  # kopf is imported only to run the operator

    return run_operator(operator_options(args))


def operator_options(args: argparse.Namespace):  # noqa: ANN201 -- OperatorOptions, imported lazily
    """`tpujob operator`'s flags as the operator's options."""
    from .controller.leader import LeaseTiming
    from .controller.main import OperatorOptions
    from .controller.preflight import Timing as PreflightTiming
    from .controller.reconcile import OperatorConfig

    def given(**flags: Any) -> dict[str, Any]:  # flags left out keep OperatorConfig's defaults
        return {name: value for name, value in flags.items() if value is not None}

    deadline = args.preflight_deadline
    controller = OperatorConfig(
        **given(
            default_image=args.default_image,
            metrics_access=args.metrics_access,
            metrics_interval_s=args.metrics_interval,
            resync_interval_s=args.resync_interval,
        ),
        preflight=PreflightTiming(
            **given(start_s=args.preflight_start_timeout, deadline_s=int(deadline) if deadline is not None else None)
        ),
    )
    try:
        timing = LeaseTiming(
            **given(
                lease_duration_s=args.leader_elect_lease_duration,
                renew_deadline_s=args.leader_elect_renew_deadline,
                retry_period_s=args.leader_elect_retry_period,
            )
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return OperatorOptions(
        leader_elect=args.leader_elect,
        leader_timing=timing,
        lease_name=args.leader_elect_resource_name,
        lease_namespace=args.leader_elect_resource_namespace or "",
        control_key_namespace=args.control_key_namespace or "",
        namespaces=() if args.all_namespaces else tuple(args.namespace),
        standalone=args.standalone,
        health_host=args.health_host,
        health_port=args.health_port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        controller=controller,
        verbose=args.verbose,
        print_rbac=args.print_rbac,
    )


def positive_seconds(text: str) -> float:
    """An interval on the command line: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def started_from(job: TPUTrainingJob) -> str | None:
    """The Hugging Face directory whose tokenizer files and token ids an export of the job's checkpoints
    carries by default: the one it started from (`model.init`; a convert directory keeps the source's in
    hf/), so a fine-tuned model goes out with the tokenizer and chat template it was trained with."""
    init = job.spec.model.init
    if init is None:
        return None
    return init.path if init.format == "huggingface" else init.path.rstrip("/") + "/hf"


def add_checkpoint_parsers(sub: Any) -> None:
    """`convert` and `export`: Hugging Face checkpoints in and out. They are the trainer's code
    (workload/interchange/commands.py), run in a child process as `tpujob plan`'s compile is: the operator
    never imports the trainer or JAX. `export --job` resolves the job's model shape here and passes it on."""

    def run(args: argparse.Namespace) -> int:
        import json
        import subprocess

        child = [sys.executable, "-m", "tpu_workload.interchange.commands", args.command, args.path, "--to", args.to]
        if args.command == "export":
            job = load_jobs(args.job)[0] if args.job else None
            tokenizer_from = args.tokenizer_from or (started_from(job) if job else None)
            child += ["--dtype", args.dtype] + (["--tokenizer-from", tokenizer_from] if tokenizer_from else [])
            if job:
                child += ["--dims", json.dumps(job.spec.model_dims.model_dump())]
        return subprocess.call(child)

    p = sub.add_parser("convert", help="a Hugging Face Llama 3 / Mixtral directory to an Orbax one a job starts from")
    p.add_argument("path", metavar="SOURCE", help="Hugging Face model directory (config.json, safetensors), or gs://")
    p.add_argument("--to", required=True, help="output directory (model.init: {format: orbax, path: DIR})")
    p.set_defaults(func=run)
    p = sub.add_parser("export", help="a checkpoint as a Hugging Face model directory (safetensors, config.json)")
    p.add_argument("path", metavar="CHECKPOINT", help="a `tpujob convert` directory, or a job's checkpoint.directory")
    p.add_argument("--to", required=True, help="output directory")
    p.add_argument("--job", "-f", help="the job's YAML: its model shape (needed for a job's checkpoint directory)")
    p.add_argument(
        "--tokenizer-from",
        help="Hugging Face directory whose tokenizer files and token ids to carry over (default with --job: the "
        "checkpoint the job started from, its model.init)",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16", help="tensor dtype")
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpujob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="print the manifests of a job as a YAML stream")
    p.add_argument("-f", "--file", required=True, help="job YAML, or - for stdin")
    p.add_argument("--default-image", help="trainer image for jobs that name none, as the operator's flag")
    p.set_defaults(func=cmd_render)
    p = sub.add_parser("validate", help="check a job and print its derived plan")
    p.add_argument("-f", "--file", required=True, help="job YAML, or - for stdin")
    p.add_argument("--project", help="Google Cloud project for the capacity look-up (optional, online)")
    p.add_argument("--zone", help="zone for the capacity look-up, e.g. us-central1-c")
    p.add_argument(
        "--default-image", help="the operator's --default-image: a job that names no image must get one from it"
    )
    p.add_argument(
        "--server",
        action="store_true",
        help="then a server-side dry run of its ConfigMap, JobSet and pods against the kubeconfig's "
        "cluster: exit 2 refused, 3 not checked (unreachable)",
    )
    p.add_argument("--namespace", "-n", help="with --server: the namespace to check in (default: the job's)")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser(
        "plan",
        help="compile a job's train step for its TPU slice (libtpu, no TPU) and check "
        "that it fits: exit 0 fits, 2 it does not, 3 not checked",
    )
    p.add_argument("-f", "--file", required=True, help="job YAML, or - for stdin")
    p.add_argument("--json", action="store_true", help="one JSON object (the plan's result) per job")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("crd", help="print the TPUTrainingJob CRD generated from the models")
    p.set_defaults(func=cmd_crd)
    p = sub.add_parser("run", help="run a job's pods as local processes (--local)")
    p.add_argument("-f", "--file", required=True, help="job YAML, or - for stdin")
    p.add_argument("--local", action="store_true", help="run on this machine: one process per TPU host")
    p.add_argument("--run-dir", help="logs, checkpoints, metrics and status (default runs/<name>-<time>)")
    p.add_argument(
        "--profile",
        metavar="FIRST-LAST",
        help="trace these steps (from 1) with the JAX profiler into the run's TensorBoard directory",
    )
    p.add_argument(
        "--scale-down",
        action="store_true",
        help="shrink a job too large for this machine to a tiny model on a 2-host slice",
    )
    p.add_argument("--steps", type=int, metavar="N", help="train N steps instead of the job's training.steps")
    p.add_argument(
        "--no-plan",
        action="store_true",
        help="skip the plan of the real slice before the run (a libtpu compile: minutes for a large model)",
    )
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("report", help="write a PNG of loss, step time and MFU of a local run")
    p.add_argument("run_dir", help="the run directory of `tpujob run --local`")
    p.add_argument("-o", "--output", help="PNG path (default RUN_DIR/report.png)")
    p.set_defaults(func=cmd_report)
    add_data_parser(sub)
    p = sub.add_parser(
        "operator", help="run the operator: TPUTrainingJobs -> JobSets, status from JobSets and trainers"
    )
    p.add_argument("--namespace", "-n", action="append", default=[], help="namespace to serve (repeatable)")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace (the default)")
    p.add_argument("--standalone", action="store_true", help="single replica: no kopf peering")
    p.add_argument("--health-port", type=int, default=0, help="serve kopf's liveness probe at :PORT/healthz")
    p.add_argument("--health-host", default="0.0.0.0", help="address of the liveness endpoint")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics at :PORT/metrics")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics endpoint")
    p.add_argument("--default-image", help="trainer image for jobs that name none")
    p.add_argument(
        "--metrics-access",
        choices=("proxy", "direct"),
        help="reach the trainer's /status through the API server's pod proxy (the default), or directly by pod IP",
    )
    p.add_argument("--metrics-interval", type=positive_seconds, help="seconds between trainer metric reads")
    p.add_argument(
        "--resync-interval",
        type=positive_seconds,
        help="seconds between two re-reads of an unfinished job's JobSet, to catch up on a lost event",
    )
    p.add_argument(
        "--preflight-start-timeout",
        type=positive_seconds,
        help="seconds a pre-flight pod may take to start before the job goes on without the check",
    )
    p.add_argument(
        "--preflight-deadline",
        type=positive_seconds,
        help="the pre-flight Job's activeDeadlineSeconds (a full-size compile takes minutes)",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="act only while holding the leader Lease (coordination.k8s.io/v1), so replicas can stand by; "
        "off: this process acts at once, alone (the chart turns it on)",
    )
    p.add_argument("--leader-elect-resource-name", default="tpu-operator-leader", help="name of the leader Lease")
    p.add_argument(
        "--leader-elect-resource-namespace",
        help="namespace of the leader Lease (default: $POD_NAMESPACE, else default)",
    )
    p.add_argument(
        "--control-key-namespace",
        help="namespace of the Secret tpu-operator-control-key, the key the jobs' control tokens are derived from "
        "(made on first start; default: $POD_NAMESPACE, else the service account's namespace, else default)",
    )
    p.add_argument(
        "--leader-elect-lease-duration",
        type=positive_seconds,
        help="seconds a standby waits, after it last saw the Lease renewed, before taking it (default 15)",
    )
    p.add_argument(
        "--leader-elect-renew-deadline",
        type=positive_seconds,
        help="seconds the leader may go without a successful renewal before it exits (default 10)",
    )
    p.add_argument(
        "--leader-elect-retry-period",
        type=positive_seconds,
        help="seconds between two renewals, and between a standby's reads of the Lease (default 2)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="debug logs")
    p.add_argument("--print-rbac", action="store_true", help="print the RBAC rules the operator needs, and exit")
    p.set_defaults(func=cmd_operator)
    add_checkpoint_parsers(sub)
    return parser


# Problems printed for one input: the first ones say what to fix; a file with thousands (a list of 10,000
# bad env entries) would otherwise print thousands of lines.
MAX_PROBLEMS_SHOWN = 50


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidJob as exc:
        # Every line is capped and its control characters escaped (problems.shown), whatever built it.
        for problem in exc.problems[:MAX_PROBLEMS_SHOWN]:
            print(f"error: {shown(problem, 1000)}", file=sys.stderr)
        if len(exc.problems) > MAX_PROBLEMS_SHOWN:
            print(f"error: ... and {len(exc.problems) - MAX_PROBLEMS_SHOWN} more problems", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
