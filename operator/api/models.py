"""The TPUTrainingJob API: one set of pydantic models is the CRD schema, the validator and the
template context.

Field names are snake_case in Python and camelCase on the wire (YAML, the CRD, the ConfigMap).
Unknown fields are errors. The sections the trainer reads too (training, kernels, checkpoint, the
resolved model and mesh) are in `contract.py`; cross-field rules are in `rules.py` and run from the
`model_validator`s here, so `tpujob validate`, the operator and the CRD-less local runner all
refuse the same inputs with the same messages.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import catalogue, limits as L, rules
from .contract import (DNS1123_SUBDOMAIN, SLICE_AXES, Base, CheckpointSpec, KernelsSpec, Mesh, ModelDims,
                       StepResources, TrainingSpec, _desc)
from .failures import DEFAULT_RESTART_ON_EXIT_CODES, NEVER_RESTARTED, LastRestart, RestartCounts
from .goodput import Badput, Ledger
from .presets import PRESETS
from .problems import shown
from .timestamps import Timestamp

GROUP = "training.tpu-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TPUTrainingJob"
PLURAL = "tputrainingjobs"
SINGULAR = "tputrainingjob"
SHORT_NAMES = ["tpujob", "tpujobs"]

CONFIG_MOUNT_DIR = "/etc/tpujob"
CONFIG_FILE = "config.json"
# Paths every trainer pod mounts a volume of the operator's at (rendering.manifests: the config and /dev/shm;
# templates/jobset.yaml.j2: /tmp, writable under the read-only root filesystem).
RESERVED_MOUNTS = (CONFIG_MOUNT_DIR, "/dev/shm", "/tmp")
# Env names the renderer, GKE's TPU webhook or JAX's start-up own: a user env var of the same name would
# silently change who a pod is (TPU_WORKER_ID=0 on every pod: 16 workers 0, issue 27) or where it
# connects. TPUJOB_*: the trainer's own switches; MEGASCALE_*: multislice identity; TPU_WORKER_*:
# GKE's webhook (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES); the TPU_* below: the slice's shape, which GKE
# sets from the node; JAX_*: jax.distributed's process identity and coordinator, which the trainer
# passes itself. Other TPU_ and JAX_ settings (TPU_STDERR_LOG_LEVEL, JAX_COMPILATION_CACHE_DIR...) stay
# the user's.
RESERVED_ENV_PREFIXES = ("TPUJOB_", "MEGASCALE_", "TPU_WORKER_")
RESERVED_ENV = ("LIBTPU_INIT_ARGS", "XLA_FLAGS", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY", "TPU_TOPOLOGY_WRAP",
                "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS",
                "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "TPU_SKIP_MDS_QUERY",
                "TPU_RUNTIME_METRICS_PORTS", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_PROCESS_ID",
                "JAX_PROCESS_COUNT", "JAX_NUM_PROCESSES", "JAX_LOCAL_DEVICE_IDS")
# The trainer's fault-injection switches (tpu_workload.loop.faults, docs/failures.md): a test job may set them and
# they act on that job alone; the renderer never does.
TEST_ENV_PREFIX = "TPUJOB_TEST_"
# Flags whose value a spec field owns and checks (runtime.scopedVmemLimitKiB: at most the core's VMEM); a raw
# flag would bypass that check.
OWNED_FLAGS = {"--xla_tpu_scoped_vmem_limit_kib": "runtime.scopedVmemLimitKiB"}

GENERATION_SPELLINGS = tuple(sorted(catalogue.ALIASES))
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a namespace's name
# The pod fields an env var may read (Kubernetes' downward API for env).
FIELD_PATH = (r"^(metadata\.(name|namespace|uid)|metadata\.(labels|annotations)\['[-A-Za-z0-9_./]+'\]|"
              r"spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_KEY_MAX = 253 + 1 + 63  # a DNS-subdomain prefix, '/', a name
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# A container's resource name: the standard ones, or a domain-prefixed extended resource (google.com/tpu).
RESOURCE_NAME = (r"^(cpu|memory|ephemeral-storage|hugepages-[-A-Za-z0-9_.]+|"
                 r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
# An image reference as container runtimes parse one (github.com/distribution/reference, reference.go):
# [domain[:port]/]path[:tag][@digest]; the kubelet refuses anything else (InvalidImageName) only once a pod
# exists. Character classes are spelled out: \w means Unicode letters in some regex engines.
_DOMAIN = r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*(:[0-9]+)?"
_PATH_PART = r"[a-z0-9]+(([_.]|__|-+)[a-z0-9]+)*"
IMAGE = (rf"^({_DOMAIN}/)?{_PATH_PART}(/{_PATH_PART})*(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
         r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
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
        "queued provisioning, requested through Kueue: needs queueName).", default="onDemand")
    reservation_name: str | None = _desc("capacity reservation: the reservation to consume.", default=None,
                                         max_length=63, pattern=GCE_NAME)
    reservation_project: str | None = _desc(
        "capacity reservation: the project that owns a shared reservation (default: the cluster's own).",
        default=None, max_length=30, pattern=GCE_PROJECT)
    max_run_duration: str | None = _desc(
        "capacity flexStart: how long the job needs its nodes, e.g. 24h or 1h30m (at most 7 days); passed to "
        "the ProvisioningRequest as maxRunDurationSeconds.", default=None, max_length=32,
        pattern=DURATION)

    @field_validator("max_run_duration")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is None:
            return v
        seconds = duration_seconds(v)
        if not seconds:
            raise ValueError(f"{v!r} is not a positive duration such as 24h, 1h30m or 5400s")
        if seconds > MAX_RUN_DURATION_S:
            raise ValueError(f"{v!r} is {seconds} s; flex-start provisions nodes for at most 7 days "
                             f"({MAX_RUN_DURATION_S} s)")
        return v

    @property
    def max_run_duration_seconds(self) -> int | None:
        return duration_seconds(self.max_run_duration) if self.max_run_duration else None


class ElasticSpec(Base):
    """A multi-slice job that keeps training on fewer slices when it loses some (docs/elastic.md)."""

    min_slices: int = _desc(
        "The fewest slices the job trains on: when a slice is lost and at least this many remain, the job is "
        "re-created on the slices left (the global batch kept, its microbatches raised) instead of waiting for "
        "all of them.", ge=1, le=L.MAX_SLICES)
    grow_back: bool = _desc(
        "After a shrink, go back to spec.tpu.slices at the next checkpoint once the larger job can be placed "
        "(the smaller one keeps running until then).", default=False)


class TPUSpec(TPUCapacity):
    generation: Literal[GENERATION_SPELLINGS] = _desc(  # type: ignore[valid-type]
        "TPU generation: v7x (Ironwood; GKE spelling tpu7x), v6e or v5p.", default="v7x")
    topology: str = _desc("Slice topology AxBxC (AxB on v6e), e.g. 4x4x4 = 64 v7x chips.",
                          max_length=32, pattern=r"^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$")
    slices: int = _desc("Number of identical slices (multi-slice over DCN).", default=1, ge=1, le=L.MAX_SLICES)
    elastic: ElasticSpec | None = _desc("Train on fewer slices when some are lost (at least elastic.minSlices), "
                                        "and optionally grow back. Unset: a lost slice restarts the whole job.",
                                        default=None)

    @field_validator("generation", mode="before")
    @classmethod
    def _canonical_generation(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v not in catalogue.ALIASES:  # exactly as listed: the CRD's enum refuses V7X and ' v7x'
                raise ValueError(f"{shown(repr(v))} is not a supported TPU generation; use one of "
                                 f"{', '.join(GENERATION_SPELLINGS)}")
            return catalogue.generation(v).name  # raises "'v9' is not a supported TPU generation; use ..."
        return v

    @model_validator(mode="after")
    def _topology_fits_generation(self) -> "TPUSpec":
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
        "Named model shape; explicit fields next to it override the preset.", default=None)
    layers: int | None = _desc("Decoder layers.", default=None, ge=1, le=L.MAX_LAYERS)
    model_dim: int | None = _desc("Embedding (model) dimension.", default=None, ge=1, le=L.MAX_MODEL_DIM)
    heads: int | None = _desc("Query heads.", default=None, ge=1, le=L.MAX_HEADS)
    kv_heads: int | None = _desc("Key/value heads (grouped-query attention).", default=None, ge=1, le=L.MAX_HEADS)
    head_dim: int | None = _desc("Dimension of one attention head.", default=None, ge=1, le=L.MAX_HEAD_DIM)
    mlp_dim: int | None = _desc("SwiGLU hidden dimension (per expert for MoE).", default=None, ge=1, le=L.MAX_MLP_DIM)
    vocab: int | None = _desc("Vocabulary size.", default=None, ge=2, le=L.MAX_VOCAB)
    experts: int | None = _desc("MoE experts per layer; 0 or unset for a dense model.", default=None, ge=0,
                                le=L.MAX_EXPERTS)
    experts_per_token: int | None = _desc("Experts each token is routed to (top-k).", default=None, ge=1,
                                          le=L.MAX_EXPERTS_PER_TOKEN)
    rope_theta: float | None = _desc("RoPE base frequency; the preset's (Llama 3: 500000), else 10000.",
                                     default=None, gt=0, le=L.MAX_ROPE_THETA)
    rope_scaling: Literal["none", "llama3"] | None = _desc(
        "RoPE frequency scaling for long contexts: llama3 is Llama 3.1's (factor 8, for contexts past 8192 "
        "tokens); none by default.", default=None)

    @model_validator(mode="after")
    def _complete(self) -> "ModelSpec":
        dims = self.resolved()
        missing = [to_camel(k) for k in ("layers", "model_dim", "heads", "kv_heads", "head_dim", "mlp_dim", "vocab")
                   if dims.get(k) is None]
        if missing:
            raise ValueError(f"needs a preset or these dimensions: {', '.join(missing)}")
        if dims["heads"] % dims["kv_heads"]:
            raise ValueError(f"kvHeads: {dims['kv_heads']} does not divide heads ({dims['heads']})")
        experts, k = dims.get("experts") or 0, dims.get("experts_per_token")
        if experts and not k:
            raise ValueError("expertsPerToken: required when experts is set")
        if k and not experts:
            raise ValueError("expertsPerToken: set without experts")
        if experts and k > experts:
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

Degree = Union[Annotated[int, Field(ge=1, le=L.MAX_DEGREE)], Literal["auto"]]


class ParallelismSpec(Base):
    fsdp: Degree = _desc("Fully-sharded data parallelism over the slice's devices.", default="auto")
    context: Degree = _desc("Context (sequence) parallelism.", default=1)
    expert: Degree = _desc("Expert parallelism (MoE models).", default=1)
    tensor: Degree = _desc("Tensor parallelism over heads and MLP.", default=1)

    @model_validator(mode="after")
    def _one_auto(self) -> "ParallelismSpec":
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

    field_path: str = _desc("metadata.name, metadata.namespace, metadata.uid, metadata.labels['KEY'], "
                            "metadata.annotations['KEY'], spec.nodeName, spec.serviceAccountName, status.hostIP, "
                            "status.podIP (and the plural IPs).", max_length=LABEL_KEY_MAX + 24, pattern=FIELD_PATH)


class EnvVarSource(Base):
    """Where a variable's value comes from, exactly one of these; the value never passes through the job."""

    secret_key_ref: KeySelector | None = _desc("A key of a Secret in the job's namespace.", default=None)
    config_map_key_ref: KeySelector | None = _desc("A key of a ConfigMap in the job's namespace.", default=None)
    field_ref: FieldSelector | None = _desc("A field of the pod.", default=None)

    @model_validator(mode="after")
    def _one(self) -> "EnvVarSource":
        given = [to_camel(f) for f in type(self).model_fields if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of secretKeyRef, configMapKeyRef, fieldRef; got "
                             f"{', '.join(given) or 'none'}")
        return self


class EnvVar(Base):
    name: str = _desc("Variable name.", min_length=1, max_length=256, pattern=ENV_NAME.pattern)
    value: str = _desc("Value, passed verbatim: it is part of the job, its JobSet's annotation and its pods; "
                       "for a secret, use valueFrom.", default="", max_length=L.MAX_ENV_VALUE)
    value_from: EnvVarSource | None = _desc(
        "The value by reference, as a container's env has it: the pods read it from the Secret, ConfigMap or "
        "pod field; the job, its annotation, its ConfigMap and the pre-flight never hold it.", default=None)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if (v.startswith(RESERVED_ENV_PREFIXES) and not v.startswith(TEST_ENV_PREFIX)) or v in RESERVED_ENV:
            raise ValueError(f"{v} is set by the operator; use runtime.libtpuInitArgs / xlaFlags for flags")
        return v

    @model_validator(mode="after")
    def _value_or_reference(self) -> "EnvVar":
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
    def _one(self) -> "EnvFromSource":
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("exactly one of secretRef, configMapRef")
        if self.prefix and (self.prefix.startswith(RESERVED_ENV_PREFIXES) or self.prefix.startswith("TPU_")):
            raise ValueError(f"prefix: {self.prefix} names variables the operator or GKE set")
        return self


class SparseCoreOffloadSpec(Base):
    all_gather: bool | None = _desc("Offload all-gather to SparseCore (default: on where available).",
                                    default=None)
    reduce_scatter: bool | None = _desc("Offload reduce-scatter to SparseCore (default: on where available).",
                                        default=None)
    all_reduce: bool | None = _desc("Offload all-reduce to SparseCore (default: on where available).",
                                    default=None)


# A value is printable ASCII without spaces: flags are joined by spaces into one variable, and printed.
Flag = Annotated[str, Field(pattern=r"^--[A-Za-z0-9_.-]+(=[!-~]*)?$", max_length=L.MAX_FLAG)]


class RuntimeSpec(Base):
    sparse_core_offload: SparseCoreOffloadSpec = _desc(
        "SparseCore collective offload per collective; v7x only.", default_factory=SparseCoreOffloadSpec)
    scoped_vmem_limit_kib: int | None = Field(
        default=None, ge=1, le=131072, alias="scopedVmemLimitKiB",
        description="--xla_tpu_scoped_vmem_limit_kib; at most the generation's VMEM per core "
                    "(65536 on v7x). Default 61440 on v7x (published recipes).")
    libtpu_init_args: list[Flag] = _desc("Extra LIBTPU_INIT_ARGS flags, each --name[=value].",
                                         default_factory=list, max_length=L.MAX_FLAGS)
    xla_flags: list[Flag] = _desc("Extra XLA_FLAGS flags, each --name[=value].", default_factory=list,
                                  max_length=L.MAX_FLAGS)
    env: list[EnvVar] = _desc("Extra environment variables for the trainer; secrets by valueFrom.secretKeyRef.",
                              default_factory=list, max_length=L.MAX_ENV)
    env_from: list[EnvFromSource] = _desc(
        "Every key of these Secrets and ConfigMaps as the trainer's variables (a container's envFrom). The env "
        "the operator, GKE and runtime.env set wins over a key of the same name.", default_factory=list,
        max_length=16)
    metrics_port: int = _desc("Port the coordinator serves /metrics and /status on.", default=9431,
                              ge=1024, le=65535)
    host_network: bool | None = _desc(
        "Run the trainer pods on their nodes' network. Default: on for a multislice job (GKE's and XPK's "
        "multislice manifests use it for the DCN traffic between slices), off for one slice (pod networking: "
        "the pods keep Workload Identity and do not listen on the node's address). docs/operations.md, "
        "Security.", default=None)

    @field_validator("libtpu_init_args", "xla_flags")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        for flag in v:
            field = OWNED_FLAGS.get(flag.split("=", 1)[0])
            if field:
                raise ValueError(f"{flag.split('=', 1)[0]} is set from spec.{field}, which is checked against the "
                                 f"chip; set that field instead")
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


class FailurePolicySpec(Base):
    """How the operator restarts a job (docs/failures.md; api/failures.py has the rule)."""

    max_restarts: int = _desc("Restarts after failures and hangs before the job fails, counted by the operator "
                              "across JobSet re-creations (preemptions are counted but not charged).",
                              default=3, ge=0, le=1000)
    restart_on_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = _desc(
        "Trainer exit codes that restart the job; any other fails it at once. Default: the retryable "
        "classes 42 (infrastructure), 137 (killed), 143 (SIGTERM). Empty: every code but 3 restarts; "
        "3 (a user error) never does.",
        default_factory=lambda: list(DEFAULT_RESTART_ON_EXIT_CODES), max_length=L.MAX_EXIT_CODES)
    hang_timeout_seconds: int | None = _desc(
        "A running job is Hung, and restarted, when no step completed for this long. Default: the larger of "
        "600 and 20 x the median step time.", default=None, ge=1, le=L.MAX_TIMEOUT_S)
    startup_timeout_seconds: int = _desc(
        "Start-up allowance: pods running -> first step done (restore and compilation included) before the "
        "job is Hung.", default=1800, ge=1, le=L.MAX_TIMEOUT_S)
    backoff_seconds: float = _desc("Delay before the first restart; doubled for each restart after it.",
                                   default=10.0, ge=0, le=86400)
    max_backoff_seconds: float = _desc("Longest delay between restarts.", default=600.0, ge=0, le=86400)

    @field_validator("restart_on_exit_codes")
    @classmethod
    def _never_user_errors(cls, v: list[int]) -> list[int]:
        listed = sorted(set(v) & set(NEVER_RESTARTED))
        if listed:
            raise ValueError(f"exit code {listed[0]} is a user or configuration error and is never retried; "
                             "remove it")
        return v


class Toleration(Base):
    """A pod toleration, checked as the API server checks one (ValidateTolerations)."""

    key: str | None = _desc("Taint key (a label key); empty with operator Exists tolerates every taint.",
                            default=None, max_length=LABEL_KEY_MAX, pattern=LABEL_KEY)
    operator: Literal["Exists", "Equal"] | None = _desc("Exists or Equal.", default=None)
    value: str | None = _desc("Taint value (a label value); only with operator Equal.", default=None, max_length=63,
                              pattern=LABEL_VALUE)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = _desc("Taint effect.", default=None)
    toleration_seconds: int | None = _desc("How long a NoExecute taint is tolerated; only with effect NoExecute.",
                                           default=None, ge=0, le=L.MAX_TIMEOUT_S)

    @model_validator(mode="after")
    def _as_the_api_server(self) -> "Toleration":
        if not self.key and self.operator != "Exists":
            raise ValueError("operator: must be Exists when key is empty (a toleration of every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError("value: must be empty when operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"tolerationSeconds: only with effect NoExecute, not {self.effect}")
        return self


Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?([eE][0-9]+|[numkMGTPE]|[KMGTPE]i)?$",
                                max_length=L.MAX_QUANTITY)]
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
        "Extra resource requests (google.com/tpu is set by the operator).", default_factory=dict,
        max_length=L.MAX_RESOURCES)
    limits: dict[ResourceName, Quantity] = _desc("Extra resource limits.", default_factory=dict,
                                                 max_length=L.MAX_RESOURCES)

    @model_validator(mode="after")
    def _as_the_api_server(self) -> "ResourcesSpec":
        """google.com/tpu is ours; and the API server's ValidateResourceRequirements: a request at most its
        limit; an extended resource (domain-prefixed, outside kubernetes.io) a whole number, with a limit,
        its request equal to it (extended resources are not overcommitted)."""
        problems = []
        for part in ("requests", "limits"):
            if "google.com/tpu" in getattr(self, part):
                problems.append((part, "google.com/tpu is derived from the topology; remove it"))
        for name in sorted(set(self.requests) | set(self.limits)):
            request, limit = (quantity(q) if q is not None else None for q in (self.requests.get(name),
                                                                               self.limits.get(name)))
            extended = "/" in name and not name.split("/")[0].endswith("kubernetes.io") and name != "google.com/tpu"
            if extended and any(q is not None and q != int(q) for q in (request, limit)):
                problems.append((f"limits.{name}", "an extended resource is a whole number"))
            elif extended and limit is None:
                problems.append((f"limits.{name}", "required with its request: extended resources are not "
                                                   "overcommitted"))
            elif extended and request is not None and request != limit:
                problems.append((f"requests.{name}", f"must equal limits.{name} (extended resources are not "
                                                     "overcommitted)"))
            elif request is not None and limit is not None and request > limit:
                problems.append((f"requests.{name}", f"{self.requests[name]} is more than limits.{name} "
                                                     f"({self.limits[name]})"))
        if problems:
            raise ValueError(rules.joined(problems))
        return self


_SUFFIX = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
           "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
           "P": Fraction(10**15), "E": Fraction(10**18),
           **{f"{p}i": Fraction(2 ** (10 * (i + 1))) for i, p in enumerate("KMGTPE")}}


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
        "JobSet at once.", default="compile")
    hbm_headroom: float = _desc("Fraction of each device's HBM the compiled step must leave free.", default=0.10,
                                ge=0, lt=1)


# ---------------------------------------------------------------------------------------------
# The whole spec


class TPUTrainingJobSpec(Base):
    tpu: TPUSpec = _desc("Which TPU slices to run on.")
    model: ModelSpec = _desc("The decoder model to train.")
    training: TrainingSpec = _desc("Steps, batch, sequence, schedule, precision, data.")
    parallelism: ParallelismSpec = _desc("Mesh degrees within one slice.", default_factory=ParallelismSpec)
    kernels: KernelsSpec = _desc("Attention and MoE kernels.", default_factory=KernelsSpec)
    runtime: RuntimeSpec = _desc("TPU runtime flags and environment.", default_factory=RuntimeSpec)
    checkpoint: CheckpointSpec = _desc("Checkpointing and resume.", default_factory=CheckpointSpec)
    plan: PlanSpec = _desc("The compile check (pre-flight) before the JobSet is created.", default_factory=PlanSpec)
    failure_policy: FailurePolicySpec = _desc("Restarts.", default_factory=FailurePolicySpec)
    image: str | None = _desc(
        "Trainer image: [registry[:port]/]path[:tag][@digest]. Unset: the operator's --default-image (the chart's "
        "operator.defaultImage); a job the operator cannot give an image is Invalid.", default=None, min_length=1,
        max_length=L.MAX_IMAGE, pattern=IMAGE)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = _desc("Image pull policy.",
                                                                          default="IfNotPresent")
    command: list[Arg] | None = _desc("Overrides the bundled trainer's command.", default=None, min_length=1,
                                      max_length=L.MAX_ARGS)
    args: list[Arg] = _desc("Extra arguments appended to the command.", default_factory=list,
                            max_length=L.MAX_ARGS)
    resources: ResourcesSpec = _desc("Extra pod resources.", default_factory=ResourcesSpec)
    service_account_name: str | None = _desc("Service account of the pods (e.g. for GCS access).",
                                             default=None, max_length=253,
                                             pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    priority_class_name: str | None = _desc(
        "Kubernetes PriorityClass of the pods (pod priority and preemption). Under Kueue it is also the "
        "Workload's priority, unless workloadPriorityClassName is set.", default=None, max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    queue_name: str | None = _desc(
        "Kueue LocalQueue (in the job's namespace) to submit the job to: the JobSet is created suspended with "
        "the label kueue.x-k8s.io/queue-name and runs when Kueue admits it.", default=None, max_length=63,
        pattern=KUEUE_NAME)
    workload_priority_class_name: str | None = _desc(
        "Kueue WorkloadPriorityClass: the job's priority in its queue and for Kueue's preemption "
        "(label kueue.x-k8s.io/priority-class), independent of the pods' priorityClassName. Needs queueName.",
        default=None, max_length=63, pattern=KUEUE_NAME)
    node_selector: dict[LabelKey, Annotated[str, Field(pattern=LABEL_VALUE, max_length=63)]] = _desc(
        "Extra node selectors (GKE TPU selectors are set by the operator).", default_factory=dict,
        max_length=L.MAX_SELECTORS)
    tolerations: list[Toleration] = _desc("Extra tolerations (the TPU taint is tolerated already).",
                                          default_factory=list, max_length=L.MAX_TOLERATIONS)
    suspend: bool = _desc("Suspend the job (its pods are deleted; resume continues from the checkpoint). With "
                          "queueName, the operator deactivates the job's Kueue Workload.", default=False)
    termination_grace_period_seconds: int | None = _desc(
        "Seconds a pod has after SIGTERM to finish its step and write a checkpoint before it is killed. "
        "Default: derived from the checkpoint size per host (docs/jobs.md: What a rendered JobSet carries).",
        default=None, ge=1, le=86400)

    @field_validator("priority_class_name")
    @classmethod
    def _not_the_clusters(cls, v: str | None) -> str | None:
        # Kubernetes' own classes rank above every workload: a training job with one would preempt other
        # tenants' pods and the cluster's components for its TPUs.
        if v is not None and v.startswith("system-"):
            raise ValueError(f"{v} is reserved for the cluster's own components; use a PriorityClass of your "
                             "cluster's workloads")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> "TPUTrainingJobSpec":
        problems = rules.spec_problems(self.sections()) + self._pod_problems()
        if problems:
            raise ValueError(rules.joined(problems))
        return self

    def _pod_problems(self) -> list[rules.Problem]:
        """What the API server would refuse in the objects rendered from this spec: a checkpoint volume mounted
        where the renderer mounts its own (mount paths are unique per container), and a spec too large for
        the JobSet's annotation that carries it (256 KiB of annotations per object; the ConfigMap's 1 MiB
        follows, its config being a part of the spec)."""
        problems = []
        directory = self.checkpoint.directory
        if self.checkpoint.persistent_volume_claim and directory:
            path = "/" + "/".join(p for p in directory.split("/") if p)
            parts = path.split("/")
            shown_directory = shown(repr(directory))
            if ".." in parts or "." in parts:
                problems.append(("checkpoint.directory", f"{shown_directory}: a volume's mount path has no . or .. "
                                                         "parts"))
            elif path == "/" or any(path == m or m.startswith(path + "/") for m in RESERVED_MOUNTS):
                problems.append(("checkpoint.directory", f"{shown_directory} would hide a volume the operator "
                                                         f"mounts ({', '.join(RESERVED_MOUNTS)}); choose another path"))
        size = len(self.model_dump_json(by_alias=True, exclude_unset=True))
        if size > L.MAX_SPEC_BYTES:
            problems.append(("", f"{size} bytes as JSON, more than {L.MAX_SPEC_BYTES}: the JobSet carries the "
                                       f"spec in an annotation and Kubernetes allows {L.MAX_ANNOTATIONS_BYTES} bytes "
                                       f"of annotations per object"))
        return problems

    def sections(self) -> rules.Sections:
        return rules.Sections(tpu=self.tpu, model=self.model_dims, training=self.training,
                              parallelism=self.parallelism, kernels=self.kernels, runtime=self.runtime,
                              capacity=self.tpu, queueing=self.queueing)

    @property
    def host_network(self) -> bool:
        """spec.runtime.hostNetwork, else on exactly for a multislice job (its configured slices, so an elastic
        job that shrinks to one slice keeps the network it started with)."""
        explicit = self.runtime.host_network
        return explicit if explicit is not None else self.tpu.slices > 1

    @property
    def queueing(self) -> rules.Queueing:
        return rules.Queueing(queue_name=self.queue_name,
                              workload_priority_class_name=self.workload_priority_class_name)

    @property
    def model_dims(self) -> ModelDims:
        return self.model.dims()

    @property
    def mesh(self) -> Mesh:
        return rules.resolve_mesh(self.parallelism, self.tpu.slice.devices, self.tpu.slices)


# ---------------------------------------------------------------------------------------------
# metadata and the whole object


class ObjectMeta(BaseModel):
    """The parts of metadata the renderer reads; everything else passes through untouched."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(max_length=63)
    namespace: str = Field(default="default", max_length=63, pattern=DNS1123_LABEL)
    uid: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns1035(cls, v: str) -> str:
        if not DNS1035.fullmatch(v):  # fullmatch: `$` alone lets a trailing newline through
            raise ValueError(f"{v!r} must be a DNS-1035 label (lower-case letters, digits and '-', starting with "
                             "a letter): it names the JobSet, its Service and every pod hostname")
        return v


class TPUTrainingJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    apiVersion: Literal[API_VERSION]  # type: ignore[valid-type]
    kind: Literal[KIND]  # type: ignore[valid-type]
    metadata: ObjectMeta
    spec: TPUTrainingJobSpec
    status: dict[str, Any] | None = None  # written by the operator; ignored as input

    @model_validator(mode="after")
    def _hostnames_fit(self) -> "TPUTrainingJob":
        problem = rules.hostname_problem(self.metadata.name, self.spec.tpu)
        if problem:
            raise ValueError(rules.joined([problem]))
        return self


# Spec fields a job may change once its JobSet exists (every other one is immutable from then on: the API
# server refuses the change through the CRD's CEL rules, crd.py; the operator reports one that got past as
# SpecChange=False).
MUTABLE_SPEC_FIELDS = frozenset({"suspend"})
# Spec fields whose default the operator applies, not the API server: the CRD publishes no default for them,
# so a job that leaves one unset stays so (spec.image: the operator's --default-image; no image is published
# under a name this project could default to, so a job neither names is Invalid, validation.image_problem).
OPERATOR_DEFAULTED_FIELDS = frozenset({"image"})


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(Base):
    """A Kubernetes-shaped condition; `lastTransitionTime` moves only when `status` changes."""

    type: str = _desc("Ready, Planned, SpecChange, Admitted, Scheduled, ContainersReady, Running, Succeeded, Failed, "
                      "Metrics, Hung.")
    status: ConditionStatus = _desc("True, False or Unknown.")
    reason: str = _desc("CamelCase reason.", default="")
    message: str = _desc("Human-readable detail.", default="")
    last_transition_time: Timestamp | None = _desc("When `status` last changed.", default=None)
    observed_generation: int | None = _desc("metadata.generation the condition describes.", default=None)


class PlanStatus(Base):
    """What the pre-flight compile found (spec.plan)."""

    hbm_per_device_gib: float | None = Field(default=None, alias="hbmPerDeviceGiB",
                                             description="HBM the compiled train step needs per device.")
    hbm_capacity_gib: float | None = Field(default=None, alias="hbmCapacityGiB", description="HBM of one device.")
    host_per_device_gib: float | None = Field(default=None, alias="hostPerDeviceGiB",
                                              description="Host memory per device of activations remat offloads.")
    fits: bool | None = _desc("Fits with the headroom asked for; unset when it could not be checked.", default=None)
    compile_seconds: float | None = _desc("Time in the TPU compiler.", default=None)
    libtpu_version: str | None = _desc("The libtpu that compiled it.", default=None)
    slices: int | None = _desc("The slice count the figures are for: an elastic job is compiled at every count from "
                               "spec.tpu.slices down to elastic.minSlices, and the worst is shown (the first that "
                               "does not fit or could not be checked, else the most HBM per device).", default=None)
    hbm_by_slices: dict[str, float] | None = Field(
        default=None, alias="hbmPerDeviceGiBBySlices",
        description="An elastic job: HBM per device at each slice count compiled (slice count -> GiB).")
    resources: StepResources | None = _desc("What one step costs per device (matmul FLOPs, collective bytes by kind, "
                                            "HBM traffic) and the least time that allows.", default=None)
    checked_at: Timestamp | None = _desc("When the pre-flight finished.", default=None)


class ProfileStatus(Base):
    """A profile asked for with the annotation training.tpu-operator.dev/profile (api/profiling.py), as the
    trainer answered it."""

    request: str = _desc("The annotation's value this describes, e.g. steps:100-105.")
    steps: str | None = _desc("The steps the trainer traces (those asked for, less any already run).", default=None)
    state: Literal["pending", "capturing", "done", "failed"] = _desc(
        "pending (sent; its first step not reached), capturing, done (the trace is at path), or failed (message).")
    path: str | None = _desc("The trace file (.xplane.pb) under the job's TensorBoard directory, once written.",
                             default=None)
    message: str | None = _desc("Why it failed, or what the trainer changed (steps already run).", default=None)


class SliceStatus(Base):
    """How many slices the job asks for and how many its JobSet runs (fewer after an elastic shrink)."""

    desired: int = _desc("spec.tpu.slices.", ge=1)
    running: int = _desc("Slices of the current JobSet: spec.tpu.slices, or fewer after an elastic shrink "
                         "(docs/elastic.md).", ge=0)
    shown: str = _desc("running/desired, for kubectl's Slices column (a printer column shows one field).",
                       default="")
    replaces: str | None = _desc("The uid of the smaller JobSet a grow-back replaces: it is being stopped as a "
                                 "preemption stops it, and the JobSet on every slice follows (docs/elastic.md).",
                                 default=None)

    @model_validator(mode="after")
    def _shown(self) -> "SliceStatus":
        object.__setattr__(self, "shown", f"{self.running}/{self.desired}")  # frozen; always derived
        return self


Phase = Literal["Pending", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "Invalid"]
TERMINAL_PHASES = ("Succeeded", "Failed")


class TPUTrainingJobStatus(Base):
    """What the operator writes into `.status`: built by the controller's pure functions, written once
    per reconcile as a merge patch of the fields that changed. Fields it does not know (written by
    another version) are ignored when read."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, alias_generator=to_camel)
    phase: Phase | None = _desc("Lifecycle phase.", default=None)
    conditions: tuple[Condition, ...] = _desc("Kubernetes-shaped conditions (Ready, Admitted, Scheduled, Metrics...).",
                                              default=())
    observed_generation: int | None = _desc("metadata.generation the status describes.", default=None)
    job_set_name: str | None = _desc("The JobSet running this job.", default=None)
    slices: SliceStatus | None = _desc("Slices asked for and running (an elastic job may run on fewer).",
                                       default=None)
    restarts: RestartCounts | None = _desc("Whole-job restarts by cause; they survive JobSet re-creations. A "
                                           "Kueue eviction counts under preemption.", default=None)
    last_restart: LastRestart | None = _desc("The latest restart: its cause and the trainer's last error line.",
                                             default=None)
    next_restart_time: Timestamp | None = _desc("When the pending restart creates the JobSet again (after its backoff).",
                                          default=None)
    last_eviction_time: Timestamp | None = _desc("When Kueue last evicted the job (its Workload's Evicted condition); "
                                           "each eviction counts once under restarts.preemption.", default=None)
    workload_name: str | None = _desc("The Kueue Workload of the JobSet (jobs with a queueName).", default=None)
    plan: PlanStatus | None = _desc("The pre-flight compile's findings (spec.plan.preflight compile).", default=None)
    step: int | None = _desc("Latest completed training step.", default=None)
    step_time_seconds: float | None = _desc("Latest step time in seconds.", default=None)
    loss: float | None = _desc("Training loss of the latest read step (cross entropy plus the weighted aux and "
                               "z-losses).", default=None)
    eval_loss: float | None = _desc("Cross entropy on the held-out data at the latest evaluation "
                                    "(spec.training.eval).", default=None)
    tokens_per_second: float | None = _desc("Training throughput, tokens per second, all slices.", default=None)
    mfu: float | None = _desc("Model FLOPs utilisation, 0..1.", default=None)
    last_checkpoint_step: int | None = _desc("Step of the latest complete checkpoint.", default=None)
    metrics_time: Timestamp | None = _desc("When the metrics above were read.", default=None)
    start_time: Timestamp | None = _desc("When the job first ran.", default=None)
    completion_time: Timestamp | None = _desc("When the job succeeded or failed.", default=None)
    message: str | None = _desc("Human-readable summary of the phase.", default=None)
    goodput: float | None = _desc("Seconds on steps that survive / seconds since the job was created, as of "
                                  "the latest change (0..1).", default=None)
    badput: Badput | None = _desc("The rest of the wall time, in seconds, by cause.", default=None)
    accounting: Ledger | None = _desc("The goodput ledger the figures above are computed from.", default=None)
    profile: ProfileStatus | None = _desc("The latest profile asked for with the annotation "
                                          "training.tpu-operator.dev/profile, and where its trace is.", default=None)

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def to_wire(self) -> dict[str, Any]:
        """The status as the API stores it (camelCase, unset fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
