"""Cross-field rules of a job: checks that read more than one section of the spec.

Each rule runs whenever the values it reads are known, so a job with several independent
problems gets all of them listed, not only those of the first section that failed. The spec's
own validator runs them on a whole valid spec (`TPUTrainingJobSpec`); `validation.parse_job`
runs them on the sections that validated when another did not (`Sections` with None for a
section that failed). A mesh degree is known when it is a fixed number, or, for the `auto` one,
when the slice is known too.

Rules return (path under `spec`, reason) pairs; the path names the field to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import catalogue
from .contract import SLICE_AXES, CheckpointSpec, KernelsSpec, Mesh, ModelDims, TrainingSpec, splits_at
from .names import GROWBACK_REPLICATED_JOB, growback_name, longest_hostname
from .problems import Problem
from .spec import FailurePolicySpec, ParallelismSpec, RuntimeSpec, TPUCapacity, TPUSpec


@dataclass(frozen=True)
class Queueing:
    """The Kueue fields of a spec: spec.queueName and spec.workloadPriorityClassName."""

    queue_name: str | None = None
    workload_priority_class_name: str | None = None


@dataclass(frozen=True)
class Sections:
    """The parts of a spec the rules read; None where that part did not validate."""

    tpu: TPUSpec | None = None
    slices: int | None = None  # known on its own when the topology is not valid
    model: ModelDims | None = None
    training: TrainingSpec | None = None
    parallelism: ParallelismSpec | None = None
    kernels: KernelsSpec | None = None
    runtime: RuntimeSpec | None = None
    capacity: TPUCapacity | None = None  # spec.tpu's capacity fields, known on their own like slices
    queueing: Queueing | None = None
    checkpoint: CheckpointSpec | None = None
    failure_policy: FailurePolicySpec | None = None


def resolve_mesh(par: ParallelismSpec, devices: int, slices: int) -> Mesh:
    """Fill an `auto` degree so the four degrees multiply to one slice's devices."""
    fixed = {a: getattr(par, a) for a in SLICE_AXES if getattr(par, a) != "auto"}
    product = 1
    for v in fixed.values():
        product *= v
    auto = next((a for a in SLICE_AXES if getattr(par, a) == "auto"), None)
    if auto is None:
        if product != devices:
            raise ValueError(
                f"parallelism: fsdp x context x expert x tensor = {product}, but one slice has "
                f"{devices} devices; make them equal or set one axis to auto"
            )
        return Mesh(data=slices, **fixed)
    if devices % product:
        raise ValueError(
            f"parallelism: the fixed degrees multiply to {product}, which does not divide the "
            f"{devices} devices of one slice"
        )
    return Mesh(data=slices, **fixed, **{auto: devices // product})


def _degrees(s: Sections) -> tuple[dict[str, int | None], list[Problem]]:
    """Every mesh degree that is known (None where it is not), and the mesh's own problem."""
    if s.parallelism is None:
        return dict.fromkeys(("data", *SLICE_AXES)), []
    if s.tpu is not None:
        try:
            return dict(resolve_mesh(s.parallelism, s.tpu.slice.devices, s.tpu.slices).shape), []
        except ValueError as exc:
            problem = [_split(str(exc))]
    else:
        problem = []
    known = {a: getattr(s.parallelism, a) for a in SLICE_AXES}
    return {
        "data": s.tpu.slices if s.tpu else s.slices,
        **{a: (None if v == "auto" else v) for a, v in known.items()},
    }, problem


def _split(message: str) -> Problem:
    path, _, reason = message.partition(": ")
    return path, reason


def spec_problems(s: Sections) -> list[Problem]:
    """Every cross-field problem whose inputs are known."""
    mesh, problems = _degrees(s)
    gen = catalogue.generation(s.tpu.generation) if s.tpu else None
    dims, t = s.model, s.training
    if dims is not None and mesh["expert"] is not None:
        if dims.is_moe and dims.experts % mesh["expert"]:
            problems.append(("parallelism.expert", f"{mesh['expert']} does not divide model.experts ({dims.experts})"))
        elif not dims.is_moe and mesh["expert"] > 1:
            problems.append(("parallelism.expert", f"{mesh['expert']} needs an MoE model (model.experts > 0)"))
    if dims is not None and mesh["tensor"] is not None and dims.heads % mesh["tensor"]:
        problems.append(("parallelism.tensor", f"{mesh['tensor']} does not divide model.heads ({dims.heads})"))
    data, fsdp, expert = mesh["data"], mesh["fsdp"], mesh["expert"]
    if t is not None and data is not None and fsdp is not None and expert is not None:
        shards = data * fsdp * expert
        if t.global_batch % shards:
            problems.append(
                (
                    "training.globalBatch",
                    f"{t.global_batch} is not a multiple of data x fsdp x expert "
                    f"= {shards}, the axes the batch is sharded over",
                )
            )
        elif t.global_batch % (shards * t.microbatches):
            problems.append(
                (
                    "training.microbatches",
                    f"{t.microbatches} microbatches of {t.global_batch} sequences "
                    f"do not each split evenly over data x fsdp x expert = {shards}; "
                    f"globalBatch must be a multiple of {shards * t.microbatches}",
                )
            )
    if dims is not None and t is not None and t.data.eos_id is not None and t.data.eos_id >= dims.vocab:
        problems.append(("training.data.eosId", f"{t.data.eos_id} is not a token of model.vocab ({dims.vocab})"))
    if (
        t is not None
        and s.tpu is not None
        and s.tpu.elastic is not None
        and data is not None
        and fsdp is not None
        and expert is not None
    ):
        problems += _elastic_problems(s.tpu, t, fsdp * expert)
    context = mesh["context"]
    # Load-balanced causal context parallelism splits each shard's sequence in two halves.
    if t is not None and context is not None and context > 1 and t.sequence_length % (2 * context):
        problems.append(
            ("training.sequenceLength", f"{t.sequence_length} is not a multiple of 2 x context = {2 * context}")
        )
    if t is not None and context is not None and s.kernels is not None and s.kernels.attention == "splash":
        per_shard = t.sequence_length // context
        if per_shard % 128:
            problems.append(
                (
                    "kernels.attention",
                    f"splash needs sequenceLength / context to be a multiple of 128, "
                    f"got {per_shard}; use attention xla for short sequences",
                )
            )
    if dims is not None and dims.is_moe and s.kernels is not None and s.kernels.moe_matmul == "gmm":
        problems += _gmm_problems(dims, t, mesh)
    if gen is not None and s.runtime is not None:
        problems += _runtime_problems(gen, s.runtime)
    if gen is not None and t is not None and t.precision == "fp8" and gen.name == "v5p":
        problems.append(("training.precision", "v5p has no native fp8; use bf16"))
    if s.capacity is not None:
        problems += _capacity_problems(s.capacity, s.queueing)
    # A rewind restarts from the latest checkpoint and finds what to skip in a marker beside it
    # (docs/divergence.md): with no directory there is neither, and the restart would train from step 0
    # on the very batches that diverged.
    if (
        s.failure_policy is not None
        and s.failure_policy.on_divergence == "Rewind"
        and s.checkpoint is not None
        and not s.checkpoint.directory
    ):
        problems.append(
            (
                "failurePolicy.onDivergence",
                "Rewind restarts from the latest checkpoint, and spec.checkpoint.directory is not set; set it, "
                "or use Fail",
            )
        )
    if s.queueing is not None and s.queueing.workload_priority_class_name and not s.queueing.queue_name:
        problems.append(
            (
                "workloadPriorityClassName",
                "only Kueue reads it; set queueName too, or use priorityClassName for the pods' priority",
            )
        )
    return problems


def _elastic_problems(tpu: TPUSpec, t: TrainingSpec, shards_per_slice: int) -> list[Problem]:
    """Every slice count an elastic job may shrink to must split the global batch (contract.microbatches_at),
    each checked in O(1) (contract.splits_at): at most limits.MAX_SLICES checks per job."""
    if t.global_batch % (tpu.slices * shards_per_slice * t.microbatches):
        return []  # the whole job's own batch problem is reported above
    bad = [
        k
        for k in tpu.slice_counts[:-1]
        if not splits_at(t.global_batch, t.microbatches, tpu.slices, k, shards_per_slice)
    ]
    if not bad:
        return []
    return [
        (
            "tpu.elastic.minSlices",
            f"on {bad[0]} slice(s) the global batch {t.global_batch} does not split over "
            f"{bad[0]} x fsdp x expert = {bad[0] * shards_per_slice} shards; raise minSlices "
            f"above {bad[-1]} or make globalBatch a multiple of it",
        )
    ]


GMM_MIN = 128  # the Mosaic grouped matmul takes no dimension below 128 (tokamax)


def _gmm_problems(dims: ModelDims, t: TrainingSpec | None, mesh: dict[str, int | None]) -> list[Problem]:
    """The Mosaic grouped matmul's shapes: model dim, expert MLP dim of one tensor shard, and the routed
    rows of one device, each at least GMM_MIN."""
    widths = {"model.modelDim": dims.model_dim}
    if mesh["tensor"] is not None:
        widths["model.mlpDim"] = dims.mlp_dim // mesh["tensor"]
    short = [f"{path} ({value})" for path, value in widths.items() if value < GMM_MIN]
    data, fsdp, expert, context = mesh["data"], mesh["fsdp"], mesh["expert"], mesh["context"]
    if t is not None and data is not None and fsdp is not None and expert is not None and context is not None:
        tokens = t.microbatch // (data * fsdp * expert) * (t.sequence_length // context)
        if tokens * dims.experts_per_token < GMM_MIN:
            short.append(f"routed rows per device ({tokens * dims.experts_per_token})")
    if not short:
        return []
    return [
        (
            "kernels.moeMatmul",
            f"gmm (the Mosaic grouped matmul) needs at least {GMM_MIN} in every dimension; "
            f"{', '.join(short)} is less; use ragged_dot",
        )
    ]


def _capacity_problems(tpu: TPUCapacity, queueing: Queueing | None) -> list[Problem]:
    """The fields each capacity mode needs, and those it does not use."""
    problems = []
    if tpu.capacity == "reservation" and not tpu.reservation_name:
        problems.append(("tpu.reservationName", "required with capacity reservation: the reservation to consume"))
    for field, value in (("reservationName", tpu.reservation_name), ("reservationProject", tpu.reservation_project)):
        if value is not None and tpu.capacity != "reservation":
            problems.append((f"tpu.{field}", f"only used with capacity reservation, not {tpu.capacity}"))
    if tpu.max_run_duration is not None and tpu.capacity != "flexStart":
        problems.append(("tpu.maxRunDuration", f"only used with capacity flexStart, not {tpu.capacity}"))
    # Our choice, not a GKE rejection: flex-start with queued provisioning is requested through a
    # ProvisioningRequest, which the operator leaves to Kueue's ProvisioningRequest admission check.
    if queueing is not None and tpu.capacity == "flexStart" and not queueing.queue_name:
        problems.append(
            (
                "queueName",
                "required with tpu.capacity flexStart: flex-start capacity is requested "
                "through Kueue (a LocalQueue whose ClusterQueue has a ProvisioningRequest "
                "admission check)",
            )
        )
    return problems


def _runtime_problems(gen: catalogue.Generation, runtime: RuntimeSpec) -> list[Problem]:
    problems = []
    offload = runtime.sparse_core_offload
    if not gen.sparse_core and any(getattr(offload, f) for f in type(offload).model_fields):
        problems.append(("runtime.sparseCoreOffload", f"{gen.name} has no SparseCore; remove the offload settings"))
    vmem = runtime.scoped_vmem_limit_kib
    if vmem is not None and (gen.vmem_kib is None or vmem > gen.vmem_kib):
        limit = f"at most {gen.vmem_kib}" if gen.vmem_kib else "not settable"
        problems.append(("runtime.scopedVmemLimitKiB", f"{vmem} exceeds the VMEM of a {gen.name} core ({limit})"))
    return problems


# JobSet's webhook checks the longest pod name of each replicated Job, `<jobset>-<replicatedJob>-<jobIndex>-
# <podIndex>` plus the 5-character random suffix of a generated name and its '-', as a DNS-1035 label of at
# most 63 characters (kubernetes-sigs/jobset, pkg/webhooks/jobset_webhook.go: `longestPodName :=
# placement.GenPodName(...) + "-abcde"`).
POD_NAME_SUFFIX = len("-abcde")


def hostname_problem(name: str, tpu: TPUSpec) -> Problem | None:
    """The pod names JobSet derives from the job's name, with their generated suffix, must fit 63 characters:
    the job's own, and for an elastic job that grows back, its probe's (`<job>-grow-g-<i>-<host>` for the
    up to slices - minSlices slices it asks for; controller/growback.py)."""
    host = longest_hostname(name, tpu.slices, tpu.slice.hosts)
    if tpu.elastic is not None and tpu.elastic.grow_back and tpu.slices > tpu.elastic.min_slices:
        probe = (
            f"{growback_name(name)}-{GROWBACK_REPLICATED_JOB}-{tpu.slices - tpu.elastic.min_slices - 1}-"
            f"{tpu.slice.hosts - 1}"
        )
        host = max(host, probe, key=len)
    if len(host) + POD_NAME_SUFFIX <= 63:
        return None
    room = 63 - POD_NAME_SUFFIX - (len(host) - len(name))
    return "metadata.name", (
        f"{name!r} is too long for this slice: pod hostname {host!r} has {len(host)} "
        f"characters, and JobSet's webhook wants it and a {POD_NAME_SUFFIX}-character "
        f"generated suffix within 63; use at most {room}"
    )
