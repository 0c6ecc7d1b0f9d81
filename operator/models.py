"""The TPUTrainingJob API: one set of pydantic models is the CRD schema, the validator and the
template context.

Field names are snake_case in Python and camelCase on the wire (YAML, the CRD, the ConfigMap).
Unknown fields are errors. Cross-field rules that need the TPU catalogue live in the
`model_validator`s here, so `tpujob validate`, the operator and the CRD-less local runner all
refuse the same inputs with the same messages.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import catalogue
from .presets import PRESETS

GROUP = "training.tpu-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TPUTrainingJob"
PLURAL = "tputrainingjobs"
SINGULAR = "tputrainingjob"
SHORT_NAMES = ["tpujob", "tpujobs"]

DEFAULT_IMAGE = "ghcr.io/tpu-operator/workload:0.1.0"
CONFIG_MOUNT_DIR = "/etc/tpujob"
CONFIG_FILE = "config.json"
# Env names the renderer owns; a user env var of the same name would silently break start-up.
RESERVED_ENV_PREFIXES = ("TPUJOB_", "MEGASCALE_")
RESERVED_ENV = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")

GENERATION_SPELLINGS = tuple(sorted(catalogue.ALIASES))
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"


class Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, alias_generator=to_camel,
                              validate_default=True)


def _desc(text: str, **kw: Any) -> Any:
    return Field(description=text, **kw)


# ---------------------------------------------------------------------------------------------
# spec.tpu


class TPUSpec(Base):
    generation: Literal[GENERATION_SPELLINGS] = _desc(  # type: ignore[valid-type]
        "TPU generation: v7x (Ironwood; GKE spelling tpu7x), v6e or v5p.", default="v7x")
    topology: str = _desc("Slice topology AxBxC (AxB on v6e), e.g. 4x4x4 = 64 v7x chips.",
                          pattern=r"^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$")
    slices: int = _desc("Number of identical slices (multi-slice over DCN).", default=1, ge=1, le=256)

    @field_validator("generation", mode="before")
    @classmethod
    def _canonical_generation(cls, v: Any) -> Any:
        if isinstance(v, str):
            return catalogue.generation(v).name  # raises "'v9' is not a supported TPU generation; use ..."
        return v

    @model_validator(mode="after")
    def _topology_fits_generation(self) -> "TPUSpec":
        err = catalogue.generation(self.generation).topology_error(self.topology)
        if err:
            raise ValueError(f"topology: {err}")
        return self

    @property
    def slice(self) -> catalogue.Slice:
        return catalogue.Slice(catalogue.generation(self.generation), self.topology)


# ---------------------------------------------------------------------------------------------
# spec.model


class ModelSpec(Base):
    preset: Literal[tuple(PRESETS)] | None = _desc(  # type: ignore[valid-type]
        "Named model shape; explicit fields next to it override the preset.", default=None)
    layers: int | None = _desc("Decoder layers.", default=None, ge=1)
    model_dim: int | None = _desc("Embedding (model) dimension.", default=None, ge=1)
    heads: int | None = _desc("Query heads.", default=None, ge=1)
    kv_heads: int | None = _desc("Key/value heads (grouped-query attention).", default=None, ge=1)
    head_dim: int | None = _desc("Dimension of one attention head.", default=None, ge=1)
    mlp_dim: int | None = _desc("SwiGLU hidden dimension (per expert for MoE).", default=None, ge=1)
    vocab: int | None = _desc("Vocabulary size.", default=None, ge=2)
    experts: int | None = _desc("MoE experts per layer; 0 or unset for a dense model.", default=None, ge=0)
    experts_per_token: int | None = _desc("Experts each token is routed to (top-k).", default=None, ge=1)

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

    def resolved(self) -> dict[str, int | None]:
        dims: dict[str, int | None] = dict(PRESETS[self.preset]) if self.preset else {}
        for name in ModelDims.model_fields:
            value = getattr(self, name)
            if value is not None:
                dims[name] = value
        return dims


class ModelDims(Base):
    """A fully resolved model shape: what the trainer builds and MFU is computed from."""

    layers: int = _desc("Decoder layers.", ge=1)
    model_dim: int = _desc("Embedding (model) dimension.", ge=1)
    heads: int = _desc("Query heads.", ge=1)
    kv_heads: int = _desc("Key/value heads.", ge=1)
    head_dim: int = _desc("Dimension of one attention head.", ge=1)
    mlp_dim: int = _desc("SwiGLU hidden dimension (per expert for MoE).", ge=1)
    vocab: int = _desc("Vocabulary size.", ge=2)
    experts: int = _desc("MoE experts per layer; 0 for dense.", default=0, ge=0)
    experts_per_token: int = _desc("Top-k experts per token; 0 for dense.", default=0, ge=0)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


# ---------------------------------------------------------------------------------------------
# spec.training


class LearningRateSpec(Base):
    peak: float = _desc("Peak learning rate.", default=3e-4, gt=0)
    warmup_steps: int = _desc("Linear warm-up steps from 0 to peak.", default=0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = _desc("Decay after warm-up.", default="cosine")
    min_ratio: float = _desc("Final learning rate as a fraction of peak.", default=0.1, ge=0, le=1)


# Activations the trainer names inside a decoder layer; `custom` remat decides each one.
REMAT_TENSORS = ("decoder_layer_input", "qkv_proj", "attention_out", "out_proj", "mlp_in", "mlp_out")


class RematSpec(Base):
    policy: Literal["full", "minimal", "none", "custom"] = _desc(
        "full: recompute the whole layer in the backward pass; minimal: keep matmul outputs; "
        "none: keep everything; custom: decide each named activation in `tensors`.", default="full")
    tensors: dict[Literal[REMAT_TENSORS], Literal["device", "remat", "offload"]] = _desc(  # type: ignore[valid-type]
        "For policy custom: keep on device, recompute (remat) or offload to host memory, per named activation.",
        default_factory=dict)

    @model_validator(mode="after")
    def _tensors_only_for_custom(self) -> "RematSpec":
        if self.tensors and self.policy != "custom":
            raise ValueError(f"tensors: only used with policy custom, not {self.policy}")
        return self


class DataSpec(Base):
    source: Literal["synthetic", "files"] = _desc("synthetic tokens, or tokenized files under `path`.",
                                                  default="synthetic")
    path: str | None = _desc("Directory or glob of tokenized files (.npy or flat uint16/uint32 .bin) "
                             "visible to every pod: a mounted path, or gs://bucket/prefix (read by byte "
                             "range with the pod's Google credentials).", default=None)
    format: Literal["npy", "bin"] = _desc("File format of `path`.", default="npy")
    shuffle: bool = _desc("Shuffle the sequences of `files`, a new permutation each pass over the data "
                          "(seeded by training.seed; the order stays a pure function of the step, so "
                          "resume is exact).", default=True)

    @model_validator(mode="after")
    def _path_for_files(self) -> "DataSpec":
        if self.source == "files" and not self.path:
            raise ValueError("path: required when source is files")
        if self.source == "synthetic" and self.path:
            raise ValueError("path: only used when source is files")
        return self


class TrainingSpec(Base):
    steps: int = _desc("Optimizer steps to train.", ge=1)
    global_batch: int = _desc("Sequences per step across all slices.", ge=1)
    sequence_length: int = _desc("Tokens per sequence.", ge=2)
    learning_rate: LearningRateSpec = _desc("Learning-rate schedule.", default_factory=LearningRateSpec)
    weight_decay: float = _desc("AdamW weight decay.", default=0.1, ge=0)
    grad_clip: float = _desc("Global gradient-norm clip; 0 disables.", default=1.0, ge=0)
    precision: Literal["bf16", "fp8"] = _desc("Matmul precision: bf16, or fp8 through qwix.", default="bf16")
    remat: RematSpec = _desc("Rematerialisation policy.", default_factory=RematSpec)
    data: DataSpec = _desc("Training data.", default_factory=DataSpec)
    seed: int = _desc("Seed for initialisation and synthetic data.", default=0, ge=0)
    log_every: int = _desc("Report metrics every N steps.", default=1, ge=1)


# ---------------------------------------------------------------------------------------------
# spec.parallelism

Degree = Union[Annotated[int, Field(ge=1)], Literal["auto"]]
MESH_AXES = ("fsdp", "context", "expert", "tensor")


class ParallelismSpec(Base):
    fsdp: Degree = _desc("Fully-sharded data parallelism over the slice's devices.", default="auto")
    context: Degree = _desc("Context (sequence) parallelism.", default=1)
    expert: Degree = _desc("Expert parallelism (MoE models).", default=1)
    tensor: Degree = _desc("Tensor parallelism over heads and MLP.", default=1)

    @model_validator(mode="after")
    def _one_auto(self) -> "ParallelismSpec":
        autos = [a for a in MESH_AXES if getattr(self, a) == "auto"]
        if len(autos) > 1:
            raise ValueError(f"only one axis may be auto, got {', '.join(autos)}")
        return self


class Mesh(Base):
    """Resolved device mesh: `data` spans slices, the rest one slice's devices."""

    data: int = _desc("Data parallelism across slices.", ge=1)
    fsdp: int = _desc("FSDP degree.", ge=1)
    context: int = _desc("Context-parallel degree.", ge=1)
    expert: int = _desc("Expert-parallel degree.", ge=1)
    tensor: int = _desc("Tensor-parallel degree.", ge=1)

    @property
    def shape(self) -> dict[str, int]:
        return {"data": self.data, **{a: getattr(self, a) for a in MESH_AXES}}

    def __str__(self) -> str:
        return " x ".join(f"{k}={v}" for k, v in self.shape.items())


# ---------------------------------------------------------------------------------------------
# spec.kernels


class SplashSpec(Base):
    block_q: int = _desc("Query block of the forward pass.", default=512, ge=128, multiple_of=128)
    block_kv: int = _desc("Key/value block of the forward pass.", default=512, ge=128, multiple_of=128)
    block_kv_compute: int = _desc("Key/value compute block of the forward pass.", default=512, ge=128,
                                  multiple_of=128)
    block_q_dkv: int = _desc("Query block of the dK/dV backward pass.", default=512, ge=128, multiple_of=128)
    block_kv_dkv: int = _desc("Key/value block of the dK/dV backward pass.", default=512, ge=128, multiple_of=128)
    block_kv_dkv_compute: int = _desc("Key/value compute block of the dK/dV pass.", default=512, ge=128,
                                      multiple_of=128)
    block_q_dq: int = _desc("Query block of the dQ backward pass.", default=512, ge=128, multiple_of=128)
    block_kv_dq: int = _desc("Key/value block of the dQ backward pass.", default=512, ge=128, multiple_of=128)
    max_logit_const: float | None = _desc("Fixed softmax max (skips the running max; tokamax only).",
                                          default=None, gt=0)

    @model_validator(mode="after")
    def _compute_fits(self) -> "SplashSpec":
        for compute, block in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
            if getattr(self, block) % getattr(self, compute):
                raise ValueError(f"{to_camel(compute)}: {getattr(self, compute)} does not divide "
                                 f"{to_camel(block)} ({getattr(self, block)})")
        return self


class KernelsSpec(Base):
    attention: Literal["splash", "xla"] = _desc(
        "splash: the Pallas Splash kernel (interpret mode off-TPU); xla: the reference path.", default="splash")
    splash: SplashSpec = _desc("Splash block sizes.", default_factory=SplashSpec)
    moe_matmul: Literal["gmm", "ragged_dot"] = _desc(
        "gmm: Megablox grouped matmul (interpret mode off-TPU); ragged_dot: the reference.", default="gmm")
    tuning_cache: str | None = _desc(
        "Directory (mounted path or gs://) of Splash block sizes tuned per chip and shape by "
        "`python -m tpu_workload.tuning`; used when every splash block size is left at its default.",
        default=None, min_length=1)


# ---------------------------------------------------------------------------------------------
# spec.runtime


class EnvVar(Base):
    name: str = _desc("Variable name.", min_length=1, max_length=256, pattern=ENV_NAME.pattern)
    value: str = _desc("Value, passed verbatim.", default="")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v.startswith(RESERVED_ENV_PREFIXES) or v in RESERVED_ENV:
            raise ValueError(f"{v} is set by the operator; use runtime.libtpuInitArgs / xlaFlags for flags")
        return v


class SparseCoreOffloadSpec(Base):
    all_gather: bool | None = _desc("Offload all-gather to SparseCore (default: on where available).",
                                    default=None)
    reduce_scatter: bool | None = _desc("Offload reduce-scatter to SparseCore (default: on where available).",
                                        default=None)
    all_reduce: bool | None = _desc("Offload all-reduce to SparseCore (default: on where available).",
                                    default=None)


Flag = Annotated[str, Field(pattern=r"^--[A-Za-z0-9_.-]+(=\S*)?$", max_length=1024)]


class RuntimeSpec(Base):
    sparse_core_offload: SparseCoreOffloadSpec = _desc(
        "SparseCore collective offload per collective; v7x only.", default_factory=SparseCoreOffloadSpec)
    scoped_vmem_limit_kib: int | None = Field(
        default=None, ge=1, alias="scopedVmemLimitKiB",
        description="--xla_tpu_scoped_vmem_limit_kib; at most the generation's VMEM per core "
                    "(65536 on v7x). Default 61440 on v7x (published recipes).")
    libtpu_init_args: list[Flag] = _desc("Extra LIBTPU_INIT_ARGS flags, each --name[=value].",
                                         default_factory=list)
    xla_flags: list[Flag] = _desc("Extra XLA_FLAGS flags, each --name[=value].", default_factory=list)
    env: list[EnvVar] = _desc("Extra environment variables for the trainer.", default_factory=list)
    metrics_port: int = _desc("Port the coordinator serves /metrics and /status on.", default=9431,
                              ge=1024, le=65535)


# ---------------------------------------------------------------------------------------------
# spec.checkpoint, spec.failurePolicy, pod knobs


class CheckpointSpec(Base):
    directory: str | None = _desc("gs:// URI or absolute path visible to every pod; unset disables checkpoints.",
                                  default=None, pattern=r"^(gs://[a-z0-9][-_.a-z0-9]*[a-z0-9](/.*)?|/.*)$")
    interval: int = _desc("Save every N steps (and at the last step).", default=100, ge=1)
    keep: int = _desc("Checkpoints to keep.", default=3, ge=1)
    resume: bool = _desc("Resume from the latest complete checkpoint on start and restart.", default=True)
    persistent_volume_claim: str | None = _desc(
        "PVC to mount at `directory` (for a path directory).", default=None, pattern=DNS1035.pattern.replace(
            "[a-z]", "[a-z0-9]", 1), max_length=253)

    @model_validator(mode="after")
    def _pvc_needs_path(self) -> "CheckpointSpec":
        if self.persistent_volume_claim:
            if not self.directory:
                raise ValueError("directory: required when persistentVolumeClaim is set")
            if self.directory.startswith("gs://"):
                raise ValueError("persistentVolumeClaim: cannot be mounted at a gs:// directory")
        return self


class FailurePolicySpec(Base):
    max_restarts: int = _desc("Whole-slice restarts before the job fails.", default=3, ge=0, le=1000)
    restart_on_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = _desc(
        "Trainer exit codes that restart the job; any other non-zero code fails it at once. "
        "Empty: every failure restarts.", default_factory=list, max_length=64)


class Toleration(Base):
    key: str | None = _desc("Taint key.", default=None)
    operator: Literal["Exists", "Equal"] | None = _desc("Exists or Equal.", default=None)
    value: str | None = _desc("Taint value.", default=None)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = _desc("Taint effect.", default=None)
    toleration_seconds: int | None = _desc("For NoExecute.", default=None)


Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?([eE][0-9]+|[numkMGTPE]|[KMGTPE]i)?$")]


class ResourcesSpec(Base):
    requests: dict[str, Quantity] = _desc("Extra resource requests (google.com/tpu is set by the operator).",
                                          default_factory=dict)
    limits: dict[str, Quantity] = _desc("Extra resource limits.", default_factory=dict)

    @model_validator(mode="after")
    def _no_tpu(self) -> "ResourcesSpec":
        for part in ("requests", "limits"):
            if "google.com/tpu" in getattr(self, part):
                raise ValueError(f"{part}: google.com/tpu is derived from the topology; remove it")
        return self


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
    failure_policy: FailurePolicySpec = _desc("Restarts.", default_factory=FailurePolicySpec)
    image: str = _desc("Trainer image.", default=DEFAULT_IMAGE, min_length=1, max_length=512,
                       pattern=r"^[^\s]+$")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = _desc("Image pull policy.",
                                                                          default="IfNotPresent")
    command: list[str] | None = _desc("Overrides the bundled trainer's command.", default=None, min_length=1)
    args: list[str] = _desc("Extra arguments appended to the command.", default_factory=list)
    resources: ResourcesSpec = _desc("Extra pod resources.", default_factory=ResourcesSpec)
    service_account_name: str | None = _desc("Service account of the pods (e.g. for GCS access).",
                                             default=None, max_length=253,
                                             pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    priority_class_name: str | None = _desc("Priority class of the pods.", default=None, max_length=253,
                                            pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    node_selector: dict[Annotated[str, Field(pattern=LABEL_KEY, max_length=316)], Annotated[str, Field(max_length=63)]] = _desc(
        "Extra node selectors (GKE TPU selectors are set by the operator).", default_factory=dict)
    tolerations: list[Toleration] = _desc("Extra tolerations (the TPU taint is tolerated already).",
                                          default_factory=list)
    suspend: bool = _desc("Suspend the job (its pods are deleted; resume continues from the checkpoint).",
                          default=False)

    @model_validator(mode="after")
    def _cross_field(self) -> "TPUTrainingJobSpec":
        gen, sl = catalogue.generation(self.tpu.generation), self.tpu.slice
        dims = self.model_dims
        mesh = resolve_mesh(self.parallelism, sl.devices, self.tpu.slices)  # raises with the field named
        if dims.is_moe:
            if dims.experts % mesh.expert:
                raise ValueError(f"parallelism.expert: {mesh.expert} does not divide model.experts ({dims.experts})")
        elif mesh.expert > 1:
            raise ValueError(f"parallelism.expert: {mesh.expert} needs an MoE model (model.experts > 0)")
        if dims.heads % mesh.tensor:
            raise ValueError(f"parallelism.tensor: {mesh.tensor} does not divide model.heads ({dims.heads})")
        batch_shards = mesh.data * mesh.fsdp * mesh.expert
        if self.training.global_batch % batch_shards:
            raise ValueError(f"training.globalBatch: {self.training.global_batch} is not a multiple of "
                             f"data x fsdp x expert = {batch_shards}, the axes the batch is sharded over")
        # Load-balanced causal context parallelism splits each shard's sequence in two halves.
        if mesh.context > 1 and self.training.sequence_length % (2 * mesh.context):
            raise ValueError(f"training.sequenceLength: {self.training.sequence_length} is not a multiple of "
                             f"2 x context = {2 * mesh.context}")
        if self.kernels.attention == "splash":
            per_shard = self.training.sequence_length // mesh.context
            if per_shard % 128:
                raise ValueError(f"kernels.attention: splash needs sequenceLength / context to be a multiple of "
                                 f"128, got {per_shard}; use attention xla for short sequences")
        offload = self.runtime.sparse_core_offload
        if not gen.sparse_core and any(getattr(offload, f) for f in SparseCoreOffloadSpec.model_fields):
            raise ValueError(f"runtime.sparseCoreOffload: {gen.name} has no SparseCore; remove the offload settings")
        vmem = self.runtime.scoped_vmem_limit_kib
        if vmem is not None and (gen.vmem_kib is None or vmem > gen.vmem_kib):
            limit = f"at most {gen.vmem_kib}" if gen.vmem_kib else "not settable"
            raise ValueError(f"runtime.scopedVmemLimitKiB: {vmem} exceeds the VMEM of a {gen.name} core ({limit})")
        if self.training.precision == "fp8" and gen.name == "v5p":
            raise ValueError("training.precision: v5p has no native fp8; use bf16")
        return self

    @property
    def model_dims(self) -> ModelDims:
        return ModelDims(**{k: v for k, v in self.model.resolved().items() if v is not None})

    @property
    def mesh(self) -> Mesh:
        return resolve_mesh(self.parallelism, self.tpu.slice.devices, self.tpu.slices)


def resolve_mesh(par: ParallelismSpec, devices: int, slices: int) -> Mesh:
    """Fill an `auto` degree so the four degrees multiply to one slice's devices."""
    fixed = {a: getattr(par, a) for a in MESH_AXES if getattr(par, a) != "auto"}
    product = 1
    for v in fixed.values():
        product *= v
    auto = next((a for a in MESH_AXES if getattr(par, a) == "auto"), None)
    if auto is None:
        if product != devices:
            raise ValueError(f"parallelism: fsdp x context x expert x tensor = {product}, but one slice has "
                             f"{devices} devices; make them equal or set one axis to auto")
        return Mesh(data=slices, **fixed)
    if devices % product:
        raise ValueError(f"parallelism: the fixed degrees multiply to {product}, which does not divide the "
                         f"{devices} devices of one slice")
    return Mesh(data=slices, **fixed, **{auto: devices // product})


# ---------------------------------------------------------------------------------------------
# metadata and the whole object


class ObjectMeta(BaseModel):
    """The parts of metadata the renderer reads; everything else passes through untouched."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(max_length=63)
    namespace: str = "default"
    uid: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns1035(cls, v: str) -> str:
        if not DNS1035.match(v):
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
        from .naming import longest_hostname  # import here: naming imports this module's constants

        host = longest_hostname(self.metadata.name, self.spec.tpu.slices, self.spec.tpu.slice.hosts)
        if len(host) > 63:
            room = 63 - (len(host) - len(self.metadata.name))
            raise ValueError(f"metadata.name: {self.metadata.name!r} is too long for this slice: pod hostname "
                             f"{host!r} would have {len(host)} characters (limit 63); use at most {room}")
        return self


# ---------------------------------------------------------------------------------------------
# What the pods read: the ConfigMap file


class TrainerConfig(Base):
    """Everything the trainer needs, resolved. Written as JSON into the job's ConfigMap."""

    name: str = _desc("Job name.")
    namespace: str = _desc("Job namespace.", default="default")
    generation: str = _desc("TPU generation (canonical spelling).")
    topology: str = _desc("Slice topology.")
    slices: int = _desc("Slices.", ge=1)
    hosts_per_slice: int = _desc("Hosts (processes) per slice.", ge=1)
    devices_per_host: int = _desc("JAX devices per host on the TPU.", ge=1)
    peak_flops_per_device: float = _desc("Peak FLOP/s of one JAX device at the job's precision.", gt=0)
    model: ModelDims = _desc("Resolved model shape.")
    training: TrainingSpec = _desc("Training settings.")
    mesh: Mesh = _desc("Resolved mesh.")
    kernels: KernelsSpec = _desc("Kernels.")
    checkpoint: CheckpointSpec = _desc("Checkpointing.")
    metrics_port: int = _desc("Metrics port of the coordinator.")


class Condition(BaseModel):
    """A Kubernetes-shaped condition."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    lastTransitionTime: str | None = None
    observedGeneration: int | None = None


Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "Invalid"]


class TPUTrainingJobStatus(Base):
    phase: Phase | None = _desc("Lifecycle phase.", default=None)
    conditions: list[Condition] = _desc("Kubernetes-shaped conditions (Ready, Metrics, SpecChange...).",
                                        default_factory=list)
    observed_generation: int | None = _desc("metadata.generation the status describes.", default=None)
    job_set_name: str | None = _desc("The JobSet running this job.", default=None)
    restarts: int | None = _desc("Whole-slice restarts so far.", default=None)
    step: int | None = _desc("Latest completed training step.", default=None)
    step_time_seconds: float | None = _desc("Latest step time in seconds.", default=None)
    tokens_per_second: float | None = _desc("Training throughput, tokens per second, all slices.", default=None)
    mfu: float | None = _desc("Model FLOPs utilisation, 0..1.", default=None)
    last_checkpoint_step: int | None = _desc("Step of the latest complete checkpoint.", default=None)
    metrics_time: str | None = _desc("When the metrics above were read.", default=None)
    start_time: str | None = _desc("When the job first ran.", default=None)
    completion_time: str | None = _desc("When the job succeeded or failed.", default=None)
    message: str | None = _desc("Human-readable summary of the phase.", default=None)
