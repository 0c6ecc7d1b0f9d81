"""The sections of a job's spec: one pydantic model per part of `.spec` (tpu, model, parallelism, runtime,
failurePolicy, tolerations, resources, plan) and the formats their fields must have.

Field names are snake_case in Python and camelCase on the wire (YAML, the CRD, the ConfigMap).
Unknown fields are errors. Each model checks its own fields; the rules that read more than one
section are in `rules.py`, which reads these models, and the whole spec that runs them is in
`models.py`. The sections the trainer reads too (training, kernels, checkpoint, the resolved model
and mesh) are in `contract.py`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import catalogue
from . import limits as L
from .contract import DNS1123_SUBDOMAIN, SLICE_AXES, Base, ModelDims, ModelInit, _desc
from .lifecycle import DEFAULT_RESTART_ON_EXIT_CODES, NEVER_RESTARTED
from .presets import PRESETS
from .problems import joined, shown

# Env names the renderer, GKE's TPU webhook or JAX's start-up own: a user env var of the same name would
# silently change who a pod is (TPU_WORKER_ID=0 on every pod: 16 workers 0, issue 27) or where it
# connects. TPUJOB_*: the trainer's own switches; MEGASCALE_*: multislice identity; TPU_WORKER_*:
# GKE's webhook (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES); the TPU_* below: the slice's shape, which GKE
# sets from the node; JAX_*: jax.distributed's process identity and coordinator, which the trainer
# passes itself. Other TPU_ and JAX_ settings (TPU_STDERR_LOG_LEVEL, JAX_COMPILATION_CACHE_DIR...) stay
# the user's.
RESERVED_ENV_PREFIXES = ("TPUJOB_", "MEGASCALE_", "TPU_WORKER_")
RESERVED_ENV = (
    "LIBTPU_INIT_ARGS",
    "XLA_FLAGS",
    "TPU_ACCELERATOR_TYPE",
    "TPU_TOPOLOGY",
    "TPU_TOPOLOGY_WRAP",
    "TPU_HOST_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_PROCESS_ADDRESSES",
    "TPU_PROCESS_PORT",
    "TPU_SKIP_MDS_QUERY",
    "TPU_RUNTIME_METRICS_PORTS",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_PORT",
    "JAX_PROCESS_ID",
    "JAX_PROCESS_COUNT",
    "JAX_NUM_PROCESSES",
    "JAX_LOCAL_DEVICE_IDS",
)
# The trainer's fault-injection switches (tpu_workload.loop.faults, docs/failures.md): a test job may set them and
# they act on that job alone; the renderer never does.
TEST_ENV_PREFIX = "TPUJOB_TEST_"
# Flags whose value a spec field owns and checks (runtime.scopedVmemLimitKiB: at most the core's VMEM); a raw
# flag would bypass that check.
OWNED_FLAGS = {"--xla_tpu_scoped_vmem_limit_kib": "runtime.scopedVmemLimitKiB"}

GENERATION_SPELLINGS = tuple(sorted(catalogue.ALIASES))
# The pod fields an env var may read (Kubernetes' downward API for env).
FIELD_PATH = (
    r"^(metadata\.(name|namespace|uid)|metadata\.(labels|annotations)\['[-A-Za-z0-9_./]+'\]|"
    r"spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$"
)
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_KEY_MAX = 253 + 1 + 63  # a DNS-subdomain prefix, '/', a name
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# A container's resource name: the standard ones, or a domain-prefixed extended resource (google.com/tpu).
RESOURCE_NAME = (
    r"^(cpu|memory|ephemeral-storage|hugepages-[-A-Za-z0-9_.]+|"
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$"
)
# An image reference as container runtimes parse one (github.com/distribution/reference, reference.go):
# [domain[:port]/]path[:tag][@digest]; the kubelet refuses anything else (InvalidImageName) only once a pod
# exists. Character classes are spelled out: \w means Unicode letters in some regex engines.
_DOMAIN = r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*(:[0-9]+)?"
_PATH_PART = r"[a-z0-9]+(([_.]|__|-+)[a-z0-9]+)*"
IMAGE = (
    rf"^({_DOMAIN}/)?{_PATH_PART}(/{_PATH_PART})*(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
# Kueue object names (LocalQueue, WorkloadPriorityClass) that go into JobSet label values: DNS-1123
# subdomains of at most 63 characters (a label value's limit).
KUEUE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# Compute Engine resource names (reservations) and project ids, as GKE's node labels carry them.
GCE_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
GCE_PROJECT = r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$"
# A duration as Kubernetes writes one, in hours, minutes and seconds: 24h, 1h30m, 5400s.
DURATION = r"^(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?$"


# ---------------------------------------------------------------------------------------------
# spec.tpu

# GKE flex-start: "dynamically provision ... for up to seven days"
# (https://cloud.google.com/kubernetes-engine/docs/concepts/dws; Cloud TPU: "a duration of up to
# 7 days", https://cloud.google.com/tpu/docs/request-using-flex-start).
MAX_RUN_DURATION_S = 7 * 24 * 3600

Capacity = Literal["onDemand", "spot", "reservation", "flexStart"]


def duration_seconds(text: str) -> int | None:
    """Seconds of a duration such as 24h, 1h30m or 5400s; None if it is not one."""
    m = re.fullmatch(DURATION, text)
    if not text or m is None:
        return None
    hours, minutes, seconds = (int(m.group(i) or 0) for i in (2, 4, 6))
    return hours * 3600 + minutes * 60 + seconds


class TPUCapacity(Base):
    """Where the slices come from (a part of spec.tpu of its own: the capacity rules read only these
    fields, so they run even when the topology is wrong)."""

    capacity: Capacity = _desc(
        "How GKE provides the slices: onDemand; spot (Spot VMs, may be reclaimed); reservation (a specific "
        "Compute Engine reservation: reservationName); flexStart (Dynamic Workload Scheduler flex-start with "
        "queued provisioning, requested through Kueue: needs queueName).",
        default="onDemand",
    )
    reservation_name: str | None = _desc(
        "capacity reservation: the reservation to consume.", default=None, max_length=63, pattern=GCE_NAME
    )
    reservation_project: str | None = _desc(
        "capacity reservation: the project that owns a shared reservation (default: the cluster's own).",
        default=None,
        max_length=30,
        pattern=GCE_PROJECT,
    )
    max_run_duration: str | None = _desc(
        "capacity flexStart: how long the job needs its nodes, e.g. 24h or 1h30m (at most 7 days); passed to "
        "the ProvisioningRequest as maxRunDurationSeconds.",
        default=None,
        max_length=32,
        pattern=DURATION,
    )

    @field_validator("max_run_duration")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is None:
            return v
        seconds = duration_seconds(v)
        if not seconds:
            raise ValueError(f"{v!r} is not a positive duration such as 24h, 1h30m or 5400s")
        if seconds > MAX_RUN_DURATION_S:
            raise ValueError(
                f"{v!r} is {seconds} s; flex-start provisions nodes for at most 7 days ({MAX_RUN_DURATION_S} s)"
            )
        return v

    @property
    def max_run_duration_seconds(self) -> int | None:
        return duration_seconds(self.max_run_duration) if self.max_run_duration else None


class ElasticSpec(Base):
    """A multi-slice job that keeps training on fewer slices when it loses some (docs/elastic.md)."""

    min_slices: int = _desc(
        "The fewest slices the job trains on: when a slice is lost and at least this many remain, the job is "
        "re-created on the slices left (the global batch kept, its microbatches raised) instead of waiting for "
        "all of them.",
        ge=1,
        le=L.MAX_SLICES,
    )
    grow_back: bool = _desc(
        "After a shrink, go back to spec.tpu.slices at the next checkpoint once the larger job can be placed "
        "(the smaller one keeps running until then).",
        default=False,
    )


class TPUSpec(TPUCapacity):
    generation: Literal[GENERATION_SPELLINGS] = _desc(  # type: ignore[valid-type]
        "TPU generation: v7x (Ironwood; GKE spelling tpu7x), v6e or v5p.", default="v7x"
    )
    topology: str = _desc(
        "Slice topology AxBxC (AxB on v6e), e.g. 4x4x4 = 64 v7x chips.",
        max_length=32,
        pattern=r"^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$",
    )
    slices: int = _desc("Number of identical slices (multi-slice over DCN).", default=1, ge=1, le=L.MAX_SLICES)
    elastic: ElasticSpec | None = _desc(
        "Train on fewer slices when some are lost (at least elastic.minSlices), "
        "and optionally grow back. Unset: a lost slice restarts the whole job.",
        default=None,
    )

    @field_validator("generation", mode="before")
    @classmethod
    def _canonical_generation(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v not in catalogue.ALIASES:  # exactly as listed: the CRD's enum refuses V7X and ' v7x'
                raise ValueError(
                    f"{shown(repr(v))} is not a supported TPU generation; use one of {', '.join(GENERATION_SPELLINGS)}"
                )
            return catalogue.generation(v).name  # raises "'v9' is not a supported TPU generation; use ..."
        return v

    @model_validator(mode="after")
    def _topology_fits_generation(self) -> TPUSpec:
        err = catalogue.generation(self.generation).topology_error(self.topology)
        if err:
            raise ValueError(f"topology: {err}")
        if self.elastic is not None and self.elastic.min_slices > self.slices:
            raise ValueError(f"elastic.minSlices: {self.elastic.min_slices} is more than slices ({self.slices})")
        return self

    @property
    def slice_counts(self) -> range:
        """Every slice count the job may run on: minSlices..slices for an elastic job, else slices alone."""
        return range(self.elastic.min_slices if self.elastic else self.slices, self.slices + 1)

    @property
    def slice(self) -> catalogue.Slice:
        return catalogue.Slice(catalogue.generation(self.generation), self.topology)


# ---------------------------------------------------------------------------------------------
# spec.model


class ModelSpec(Base):
    preset: Literal[tuple(PRESETS)] | None = _desc(  # type: ignore[valid-type]
        "Named model shape; explicit fields next to it override the preset.", default=None
    )
    layers: int | None = _desc("Decoder layers.", default=None, ge=1, le=L.MAX_LAYERS)
    model_dim: int | None = _desc("Embedding (model) dimension.", default=None, ge=1, le=L.MAX_MODEL_DIM)
    heads: int | None = _desc("Query heads.", default=None, ge=1, le=L.MAX_HEADS)
    kv_heads: int | None = _desc("Key/value heads (grouped-query attention).", default=None, ge=1, le=L.MAX_HEADS)
    head_dim: int | None = _desc("Dimension of one attention head.", default=None, ge=1, le=L.MAX_HEAD_DIM)
    mlp_dim: int | None = _desc("SwiGLU hidden dimension (per expert for MoE).", default=None, ge=1, le=L.MAX_MLP_DIM)
    vocab: int | None = _desc("Vocabulary size.", default=None, ge=2, le=L.MAX_VOCAB)
    experts: int | None = _desc(
        "MoE experts per layer; 0 or unset for a dense model.", default=None, ge=0, le=L.MAX_EXPERTS
    )
    experts_per_token: int | None = _desc(
        "Experts each token is routed to (top-k).", default=None, ge=1, le=L.MAX_EXPERTS_PER_TOKEN
    )
    rope_theta: float | None = _desc(
        "RoPE base frequency; the preset's (Llama 3: 500000), else 10000.", default=None, gt=0, le=L.MAX_ROPE_THETA
    )
    rope_scaling: Literal["none", "llama3"] | None = _desc(
        "RoPE frequency scaling for long contexts: llama3 is Llama 3.1's (factor 8, for contexts past 8192 "
        "tokens); none by default.",
        default=None,
    )
    norm_eps: float | None = _desc(
        "RMSNorm epsilon; 1e-6 by default (Llama 3 and Mixtral checkpoints: 1e-5).",
        default=None,
        gt=0,
        le=L.MAX_NORM_EPS,
    )
    init: ModelInit | None = _desc(
        "Start a new run from these parameters (a Hugging Face checkpoint, or one `tpujob convert` wrote) "
        "instead of a random initialisation; the shape above must agree with the checkpoint's. A resume "
        "restores the run's own latest checkpoint instead.",
        default=None,
    )

    @model_validator(mode="after")
    def _complete(self) -> ModelSpec:
        dims = self.resolved()
        missing = [
            to_camel(k)
            for k in ("layers", "model_dim", "heads", "kv_heads", "head_dim", "mlp_dim", "vocab")
            if dims.get(k) is None
        ]
        if missing:
            raise ValueError(f"needs a preset or these dimensions: {', '.join(missing)}")
        if dims["heads"] % dims["kv_heads"]:
            raise ValueError(f"kvHeads: {dims['kv_heads']} does not divide heads ({dims['heads']})")
        experts, k = dims.get("experts") or 0, dims.get("experts_per_token")
        if experts and not k:
            raise ValueError("expertsPerToken: required when experts is set")
        if k and not experts:
            raise ValueError("expertsPerToken: set without experts")
        if experts and k is not None and k > experts:
            raise ValueError(f"expertsPerToken: {k} is more than experts ({experts})")
        return self

    def dims(self) -> ModelDims:
        """The fully resolved shape (the model validator has checked that it is complete)."""
        return ModelDims(**{k: v for k, v in self.resolved().items() if v is not None})

    def resolved(self) -> dict[str, Any]:
        dims: dict[str, Any] = dict(PRESETS[self.preset]) if self.preset else {}
        for name in ModelDims.model_fields:
            value = getattr(self, name)
            if value is not None:
                dims[name] = value
        return dims


# ---------------------------------------------------------------------------------------------
# spec.parallelism

Degree = Annotated[int, Field(ge=1, le=L.MAX_DEGREE)] | Literal["auto"]


class ParallelismSpec(Base):
    fsdp: Degree = _desc("Fully-sharded data parallelism over the slice's devices.", default="auto")
    context: Degree = _desc("Context (sequence) parallelism.", default=1)
    expert: Degree = _desc("Expert parallelism (MoE models).", default=1)
    tensor: Degree = _desc("Tensor parallelism over heads and MLP.", default=1)

    @model_validator(mode="after")
    def _one_auto(self) -> ParallelismSpec:
        autos = [a for a in SLICE_AXES if getattr(self, a) == "auto"]
        if len(autos) > 1:
            raise ValueError(f"only one axis may be auto, got {', '.join(autos)}")
        return self


# ---------------------------------------------------------------------------------------------
# spec.runtime


class KeySelector(Base):
    """One key of a Secret or ConfigMap in the job's namespace (a container's secretKeyRef / configMapKeyRef)."""

    name: str = _desc("The Secret's or ConfigMap's name.", min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)
    key: str = _desc("The key.", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = _desc("Start without it when it is missing.", default=None)


class NameRef(Base):
    """A whole Secret or ConfigMap in the job's namespace (a container's envFrom secretRef / configMapRef)."""

    name: str = _desc("Its name.", min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)
    optional: bool | None = _desc("Start without it when it is missing.", default=None)


class FieldSelector(Base):
    """A field of the pod (the downward API's env fields)."""

    field_path: str = _desc(
        "metadata.name, metadata.namespace, metadata.uid, metadata.labels['KEY'], "
        "metadata.annotations['KEY'], spec.nodeName, spec.serviceAccountName, status.hostIP, "
        "status.podIP (and the plural IPs).",
        max_length=LABEL_KEY_MAX + 24,
        pattern=FIELD_PATH,
    )


class EnvVarSource(Base):
    """Where a variable's value comes from, exactly one of these; the value never passes through the job."""

    secret_key_ref: KeySelector | None = _desc("A key of a Secret in the job's namespace.", default=None)
    config_map_key_ref: KeySelector | None = _desc("A key of a ConfigMap in the job's namespace.", default=None)
    field_ref: FieldSelector | None = _desc("A field of the pod.", default=None)

    @model_validator(mode="after")
    def _one(self) -> EnvVarSource:
        given = [to_camel(f) for f in type(self).model_fields if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of secretKeyRef, configMapKeyRef, fieldRef; got {', '.join(given) or 'none'}"
            )
        return self


class EnvVar(Base):
    name: str = _desc("Variable name.", min_length=1, max_length=256, pattern=ENV_NAME.pattern)
    value: str = _desc(
        "Value, passed verbatim: it is part of the job, its JobSet's annotation and its pods; "
        "for a secret, use valueFrom.",
        default="",
        max_length=L.MAX_ENV_VALUE,
    )
    value_from: EnvVarSource | None = _desc(
        "The value by reference, as a container's env has it: the pods read it from the Secret, ConfigMap or "
        "pod field; the job, its annotation, its ConfigMap and the pre-flight never hold it.",
        default=None,
    )

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if (v.startswith(RESERVED_ENV_PREFIXES) and not v.startswith(TEST_ENV_PREFIX)) or v in RESERVED_ENV:
            raise ValueError(f"{v} is set by the operator; use runtime.libtpuInitArgs / xlaFlags for flags")
        return v

    @model_validator(mode="after")
    def _value_or_reference(self) -> EnvVar:
        if self.value and self.value_from is not None:  # the API server refuses both
            raise ValueError("valueFrom: not with a non-empty value")
        return self

    def container(self) -> dict[str, Any]:
        """The entry of a container's env."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude={"value"} if self.value_from else set())


class EnvFromSource(Base):
    """Every key of a Secret or ConfigMap as variables (a container's envFrom), exactly one of the two."""

    prefix: str | None = _desc("Prepended to every key.", default=None, max_length=253, pattern=ENV_NAME.pattern)
    secret_ref: NameRef | None = _desc("A Secret in the job's namespace.", default=None)
    config_map_ref: NameRef | None = _desc("A ConfigMap in the job's namespace.", default=None)

    @model_validator(mode="after")
    def _one(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("exactly one of secretRef, configMapRef")
        if self.prefix and (self.prefix.startswith(RESERVED_ENV_PREFIXES) or self.prefix.startswith("TPU_")):
            raise ValueError(f"prefix: {self.prefix} names variables the operator or GKE set")
        return self


class SparseCoreOffloadSpec(Base):
    all_gather: bool | None = _desc("Offload all-gather to SparseCore (default: on where available).", default=None)
    reduce_scatter: bool | None = _desc(
        "Offload reduce-scatter to SparseCore (default: on where available).", default=None
    )
    all_reduce: bool | None = _desc("Offload all-reduce to SparseCore (default: on where available).", default=None)


# A value is printable ASCII without spaces: flags are joined by spaces into one variable, and printed.
Flag = Annotated[str, Field(pattern=r"^--[A-Za-z0-9_.-]+(=[!-~]*)?$", max_length=L.MAX_FLAG)]


class RuntimeSpec(Base):
    sparse_core_offload: SparseCoreOffloadSpec = _desc(
        "SparseCore collective offload per collective; v7x only.", default_factory=SparseCoreOffloadSpec
    )
    scoped_vmem_limit_kib: int | None = Field(
        default=None,
        ge=1,
        le=131072,
        alias="scopedVmemLimitKiB",
        description="--xla_tpu_scoped_vmem_limit_kib; at most the generation's VMEM per core "
        "(65536 on v7x). Default 61440 on v7x (published recipes).",
    )
    libtpu_init_args: list[Flag] = _desc(
        "Extra LIBTPU_INIT_ARGS flags, each --name[=value].", default_factory=list, max_length=L.MAX_FLAGS
    )
    xla_flags: list[Flag] = _desc(
        "Extra XLA_FLAGS flags, each --name[=value].", default_factory=list, max_length=L.MAX_FLAGS
    )
    env: list[EnvVar] = _desc(
        "Extra environment variables for the trainer; secrets by valueFrom.secretKeyRef.",
        default_factory=list,
        max_length=L.MAX_ENV,
    )
    env_from: list[EnvFromSource] = _desc(
        "Every key of these Secrets and ConfigMaps as the trainer's variables (a container's envFrom). The env "
        "the operator, GKE and runtime.env set wins over a key of the same name.",
        default_factory=list,
        max_length=16,
    )
    metrics_port: int = _desc("Port the coordinator serves /metrics and /status on.", default=9431, ge=1024, le=65535)
    host_network: bool | None = _desc(
        "Run the trainer pods on their nodes' network. Default: on for a multislice job (GKE's and XPK's "
        "multislice manifests use it for the DCN traffic between slices), off for one slice (pod networking: "
        "the pods keep Workload Identity and do not listen on the node's address). docs/operations.md, "
        "Security.",
        default=None,
    )

    @field_validator("libtpu_init_args", "xla_flags")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        for flag in v:
            field = OWNED_FLAGS.get(flag.split("=", 1)[0])
            if field:
                raise ValueError(
                    f"{flag.split('=', 1)[0]} is set from spec.{field}, which is checked against the "
                    f"chip; set that field instead"
                )
        return v

    def container_env_from(self) -> list[dict[str, Any]]:
        return [e.model_dump(by_alias=True, exclude_none=True) for e in self.env_from]

    @property
    def by_reference(self) -> bool:
        """Whether any variable comes from a Secret, ConfigMap or pod field."""
        return bool(self.env_from) or any(e.value_from is not None for e in self.env)

    @field_validator("env")
    @classmethod
    def _unique_env(cls, v: list[EnvVar]) -> list[EnvVar]:
        seen: set[str] = set()
        for e in v:
            if e.name in seen:  # Kubernetes keeps the last one silently; say which
                raise ValueError(f"{e.name} is set twice; a container's env names are unique")
            seen.add(e.name)
        return v


# ---------------------------------------------------------------------------------------------
# spec.checkpoint, spec.failurePolicy, pod knobs


class RestartBudgetsSpec(Base):
    """Each restart cause's own limit. maxRestarts is the total of the job's own faults (failure, hang,
    diverged); hardware and preemption are the infrastructure's and are limited only here."""

    failure: int | None = _desc(
        "Restarts after a failed pod; default: only maxRestarts applies.", default=None, ge=0, le=1000
    )
    hang: int | None = _desc("Restarts after a hang; default: only maxRestarts applies.", default=None, ge=0, le=1000)
    diverged: int | None = _desc(
        "Rewinds after a non-finite loss or gradient norm (onDivergence Rewind).", default=2, ge=0, le=1000
    )
    hardware: int | None = _desc(
        "Restarts after a node of a running slice turned unhealthy or was lost; not in maxRestarts.",
        default=10,
        ge=0,
        le=1000,
    )
    preemption: int | None = _desc(
        "Restarts after SIGTERM (preemption, maintenance, eviction); default: uncharged.", default=None, ge=0, le=1000
    )


class FailurePolicySpec(Base):
    """How the operator restarts a job (docs/failures.md; api/failures.py has the rule)."""

    max_restarts: int = _desc(
        "Restarts after failures and hangs before the job fails, counted by the operator "
        "across JobSet re-creations (preemptions are counted but not charged).",
        default=3,
        ge=0,
        le=1000,
    )
    restart_on_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = _desc(
        "Trainer exit codes that restart the job; any other fails it at once. Default: the retryable "
        "classes 42 (infrastructure), 137 (killed), 143 (SIGTERM). Empty: every code but 3 restarts; "
        "3 (a user error) never does.",
        default_factory=lambda: list(DEFAULT_RESTART_ON_EXIT_CODES),
        max_length=L.MAX_EXIT_CODES,
    )
    hang_timeout_seconds: int | None = _desc(
        "A running job is Hung, and restarted, when no step completed for this long. Default: the larger of "
        "600 and 20 x the median step time.",
        default=None,
        ge=1,
        le=L.MAX_TIMEOUT_S,
    )
    startup_timeout_seconds: int = _desc(
        "Start-up allowance: pods running -> first step done (restore and compilation included) before the "
        "job is Hung.",
        default=1800,
        ge=1,
        le=L.MAX_TIMEOUT_S,
    )
    backoff_seconds: float = _desc(
        "Delay before the first restart; doubled for each restart after it.", default=10.0, ge=0, le=86400
    )
    max_backoff_seconds: float = _desc("Longest delay between restarts.", default=600.0, ge=0, le=86400)
    restart_budgets: RestartBudgetsSpec = _desc(
        "Each cause's own restart limit, beside maxRestarts' total.", default_factory=lambda: RestartBudgetsSpec()
    )
    restart_window_seconds: int | None = _desc(
        "Restarts decided longer ago than this stop counting against every budget (as Kubernetes' pod "
        "back-off resets after a while running). Default: they count for the job's whole life.",
        default=None,
        ge=60,
        le=L.MAX_TIMEOUT_S,
    )
    on_divergence: Literal["Fail", "Rewind"] = _desc(
        "A non-finite loss or gradient norm (exit code 43): Fail the job, or Rewind: restart from the "
        "latest checkpoint (never written from non-finite state) with the next skipBatches batches skipped, "
        "within restartBudgets.diverged.",
        default="Fail",
    )
    skip_batches: int = _desc(
        "With onDivergence Rewind: batches of data skipped after the checkpoint a rewind restores.",
        default=0,
        ge=0,
        le=L.MAX_STEPS,
    )
    node_unhealthy_grace_seconds: int = _desc(
        "How long a node under a running pod must report Ready False or Unknown before the job is stopped "
        "and restarted (cause hardware); GKE's TPU partition-state UNHEALTHY label acts at once. The default "
        "rides out a kubelet restart or an API-server blip (Ready turns Unknown after the 40 s node-monitor "
        "grace period) and still acts long before GKE's auto-repair (about 10 minutes). While most TPU nodes "
        "are NotReady together, 5 x this (docs/failures.md).",
        default=120,
        ge=0,
        le=L.MAX_TIMEOUT_S,
    )

    @field_validator("restart_on_exit_codes")
    @classmethod
    def _never_user_errors(cls, v: list[int]) -> list[int]:
        listed = sorted(set(v) & set(NEVER_RESTARTED))
        if listed:
            raise ValueError(f"exit code {listed[0]} is a user or configuration error and is never retried; remove it")
        return v


class Toleration(Base):
    """A pod toleration, checked as the API server checks one (ValidateTolerations)."""

    key: str | None = _desc(
        "Taint key (a label key); empty with operator Exists tolerates every taint.",
        default=None,
        max_length=LABEL_KEY_MAX,
        pattern=LABEL_KEY,
    )
    operator: Literal["Exists", "Equal"] | None = _desc("Exists or Equal.", default=None)
    value: str | None = _desc(
        "Taint value (a label value); only with operator Equal.", default=None, max_length=63, pattern=LABEL_VALUE
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = _desc("Taint effect.", default=None)
    toleration_seconds: int | None = _desc(
        "How long a NoExecute taint is tolerated; only with effect NoExecute.", default=None, ge=0, le=L.MAX_TIMEOUT_S
    )

    @model_validator(mode="after")
    def _as_the_api_server(self) -> Toleration:
        if not self.key and self.operator != "Exists":
            raise ValueError("operator: must be Exists when key is empty (a toleration of every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError("value: must be empty when operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"tolerationSeconds: only with effect NoExecute, not {self.effect}")
        return self


Quantity = Annotated[
    str, Field(pattern=r"^[0-9]+(\.[0-9]+)?([eE][0-9]+|[numkMGTPE]|[KMGTPE]i)?$", max_length=L.MAX_QUANTITY)
]
ResourceName = Annotated[str, Field(pattern=RESOURCE_NAME, max_length=LABEL_KEY_MAX)]


def _prefix_fits(key: str) -> str:
    """A label key's prefix is a DNS subdomain: at most 253 characters (the pattern bounds each part only)."""
    prefix, slash, _ = key.rpartition("/")
    if slash and len(prefix) > 253:
        raise ValueError(f"the prefix of a label key is at most 253 characters, got {len(prefix)}")
    return key


LabelKey = Annotated[str, Field(pattern=LABEL_KEY, max_length=LABEL_KEY_MAX), AfterValidator(_prefix_fits)]
Arg = Annotated[str, Field(max_length=L.MAX_ARG)]


class ResourcesSpec(Base):
    requests: dict[ResourceName, Quantity] = _desc(
        "Extra resource requests (google.com/tpu is set by the operator).",
        default_factory=dict,
        max_length=L.MAX_RESOURCES,
    )
    limits: dict[ResourceName, Quantity] = _desc(
        "Extra resource limits.", default_factory=dict, max_length=L.MAX_RESOURCES
    )

    @model_validator(mode="after")
    def _as_the_api_server(self) -> ResourcesSpec:
        """google.com/tpu is ours; and the API server's ValidateResourceRequirements: a request at most its
        limit; an extended resource (domain-prefixed, outside kubernetes.io) a whole number, with a limit,
        its request equal to it (extended resources are not overcommitted)."""
        problems = []
        for part in ("requests", "limits"):
            if "google.com/tpu" in getattr(self, part):
                problems.append((part, "google.com/tpu is derived from the topology; remove it"))
        for name in sorted(set(self.requests) | set(self.limits)):
            request, limit = (
                quantity(q) if q is not None else None for q in (self.requests.get(name), self.limits.get(name))
            )
            extended = "/" in name and not name.split("/")[0].endswith("kubernetes.io") and name != "google.com/tpu"
            if extended and any(q is not None and q != int(q) for q in (request, limit)):
                problems.append((f"limits.{name}", "an extended resource is a whole number"))
            elif extended and limit is None:
                problems.append(
                    (f"limits.{name}", "required with its request: extended resources are not overcommitted")
                )
            elif extended and request is not None and request != limit:
                problems.append(
                    (f"requests.{name}", f"must equal limits.{name} (extended resources are not overcommitted)")
                )
            elif request is not None and limit is not None and request > limit:
                problems.append(
                    (f"requests.{name}", f"{self.requests[name]} is more than limits.{name} ({self.limits[name]})")
                )
        if problems:
            raise ValueError(joined(problems))
        return self


_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    **{f"{p}i": Fraction(2 ** (10 * (i + 1))) for i, p in enumerate("KMGTPE")},
}


def quantity(text: str) -> Fraction:
    """The exact value of a quantity that matched `Quantity`'s pattern (digits, a fraction, a suffix)."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(?:[eE]([0-9]+)|([a-zA-Z]*))", text)
    assert m is not None, text  # the pattern let it through
    number = Fraction(m.group(1))
    return number * 10 ** int(m.group(2)) if m.group(2) else number * _SUFFIX[m.group(3)]


# ---------------------------------------------------------------------------------------------
# spec.plan: the compile check before the slice is asked for


class PlanSpec(Base):
    preflight: Literal["compile", "skip"] = _desc(
        "compile: before creating the JobSet, compile the train step for the job's slice on a CPU node "
        "(`python -m tpu_workload.performance.plan` in a batch Job) and refuse a job that does not fit; skip: create the "
        "JobSet at once.",
        default="compile",
    )
    hbm_headroom: float = _desc(
        "Fraction of each device's HBM the compiled step must leave free.", default=0.10, ge=0, lt=1
    )
