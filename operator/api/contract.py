"""The contract between the operator and the trainer: the `TrainerConfig` the renderer writes into
the job's ConfigMap and the trainer reads, and the spec sections it is made of.

This module imports pydantic and nothing else of ours or anyone's, so the trainer (`tpu_workload`)
installs and imports it without the operator's dependencies (kopf, kubernetes, jinja2). The job API
(`models.py`) builds on these sections; a field added here is a field of the CRD too.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from . import limits as L

# The device mesh, outermost first: `data` spans slices (DCN), the others one slice's devices (ICI).
MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")
SLICE_AXES = MESH_AXES[1:]
# A PVC name is a DNS-1123 subdomain.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Where the trainer reads or writes: a gs:// URI or an absolute path in the pod, with no control
# characters (they end up in log lines and file names). A relative path or another scheme (s3://) would
# only fail once the pods run.
LOCATION = r"^(gs://[a-z0-9][-_.a-z0-9]*[a-z0-9](/[^\x00-\x1f\x7f]*)?|/[^\x00-\x1f\x7f]*)$"
# Formats of text that `DataSpec.tokenizer` tokenizes (the others hold tokens).
TEXT_FORMATS = ("jsonl", "parquet", "text")


class Base(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, alias_generator=to_camel, validate_default=True
    )


class Recorded(Base):
    """A part of a job's `.status`, read back from the API server: another version of the operator (an upgrade's
    roll, a rollback) may have written fields this one does not know, and they are ignored, never an error
    (the previous release forbade them, so a new status field stopped it: tests/cluster/test_upgrade.py)."""

    model_config = ConfigDict(extra="ignore")


def _desc(text: str, **kw: Any) -> Any:
    return Field(description=text, **kw)


# ---------------------------------------------------------------------------------------------
# The model shape


class ModelDims(Base):
    """A fully resolved model shape: what the trainer builds and MFU is computed from."""

    layers: int = _desc("Decoder layers.", ge=1, le=L.MAX_LAYERS)
    model_dim: int = _desc("Embedding (model) dimension.", ge=1, le=L.MAX_MODEL_DIM)
    heads: int = _desc("Query heads.", ge=1, le=L.MAX_HEADS)
    kv_heads: int = _desc("Key/value heads.", ge=1, le=L.MAX_HEADS)
    head_dim: int = _desc("Dimension of one attention head.", ge=1, le=L.MAX_HEAD_DIM)
    mlp_dim: int = _desc("SwiGLU hidden dimension (per expert for MoE).", ge=1, le=L.MAX_MLP_DIM)
    vocab: int = _desc("Vocabulary size.", ge=2, le=L.MAX_VOCAB)
    experts: int = _desc("MoE experts per layer; 0 for dense.", default=0, ge=0, le=L.MAX_EXPERTS)
    experts_per_token: int = _desc("Top-k experts per token; 0 for dense.", default=0, ge=0, le=L.MAX_EXPERTS_PER_TOKEN)
    rope_theta: float = _desc(
        "RoPE base frequency (Llama 3: 500000; Mixtral: 1000000).", default=10000.0, gt=0, le=L.MAX_ROPE_THETA
    )
    rope_scaling: Literal["none", "llama3"] = _desc(
        "RoPE frequency scaling for contexts past the pre-training length: llama3 is Llama 3.1's (factor 8 "
        "below the frequencies of an 8192-token context, smoothed between wavelengths 2048 and 8192).",
        default="none",
    )
    norm_eps: float = _desc(
        "RMSNorm epsilon (Llama 3 and Mixtral: 1e-5; a Hugging Face checkpoint's rms_norm_eps).",
        default=1e-6,
        gt=0,
        le=L.MAX_NORM_EPS,
    )

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


class ModelInit(Base):
    """Parameters a new run starts from instead of a random initialisation (a resume still restores the
    run's own latest checkpoint; the optimizer state always starts fresh)."""

    format: Literal["huggingface", "orbax"] = _desc(
        "huggingface: a Hugging Face model directory (config.json and safetensors shards) of a Llama 3 or "
        "Mixtral model, whose config must agree with spec.model; orbax: a directory `tpujob convert` wrote."
    )
    path: str = _desc(
        "The directory: a gs:// URI or an absolute path visible to every pod. Each process reads only the "
        "bytes of the parameters its devices hold.",
        max_length=L.MAX_PATH,
        pattern=LOCATION,
    )


# ---------------------------------------------------------------------------------------------
# spec.training


class LearningRateSpec(Base):
    peak: float = _desc("Peak learning rate.", default=3e-4, gt=0, le=L.MAX_LEARNING_RATE)
    warmup_steps: int = _desc("Linear warm-up steps from 0 to peak.", default=0, ge=0, le=L.MAX_STEPS)
    schedule: Literal["constant", "cosine", "linear"] = _desc("Decay after warm-up.", default="cosine")
    min_ratio: float = _desc("Final learning rate as a fraction of peak.", default=0.1, ge=0, le=1)


# Activations the trainer names inside a decoder layer; `custom` remat decides each one.
REMAT_TENSORS = ("decoder_layer_input", "qkv_proj", "attention_out", "out_proj", "mlp_in", "mlp_out")


class RematSpec(Base):
    policy: Literal["full", "minimal", "none", "custom"] = _desc(
        "full: recompute the whole layer in the backward pass; minimal: keep matmul outputs; "
        "none: keep everything; custom: decide each named activation in `tensors`.",
        default="full",
    )
    tensors: dict[Literal[REMAT_TENSORS], Literal["device", "remat", "offload"]] = _desc(  # type: ignore[valid-type]
        "For policy custom: keep on device, recompute (remat) or offload to host memory, per named activation.",
        default_factory=dict,
    )

    @model_validator(mode="after")
    def _tensors_only_for_custom(self) -> RematSpec:
        if self.tensors and self.policy != "custom":
            raise ValueError(f"tensors: only used with policy custom, not {self.policy}")
        return self


class AdamSpec(Base):
    beta1: float = _desc("Adam's first-moment decay.", default=0.9, ge=0, lt=1)
    beta2: float = _desc("Adam's second-moment decay.", default=0.95, ge=0, lt=1)
    epsilon: float = _desc("Added to the second moment's root in the update's denominator.", default=1e-8, gt=0, le=1)


class DataSpec(Base):
    source: Literal["synthetic", "files"] = _desc(
        "synthetic tokens, or the files under `path` (tokens, or text a `tokenizer` tokenizes).", default="synthetic"
    )
    path: str | None = _desc(
        "Directory or glob of the data files visible to every pod: a mounted path, or "
        "gs://bucket/prefix (flat files are read by byte range with the pod's Google "
        "credentials; ArrayRecord and text files are copied to local disk at start-up).",
        default=None,
        max_length=L.MAX_PATH,
        pattern=LOCATION,
    )
    format: Literal["npy", "bin", "arrayrecord", "jsonl", "parquet", "text"] = _desc(
        "File format of `path`: npy or flat .bin (one stream of tokens, uint16 when model.vocab <= 65536 "
        "else uint32, documents separated by `eosId`), or arrayrecord (one document per record, stored as "
        "the raw little-endian bytes of its tokens in that same dtype; needs `packing`). Text, tokenized "
        "on the fly with `tokenizer` (needs `packing`): jsonl (*.jsonl, one document per line, its "
        "`textField` string), parquet (*.parquet, one document per row, the string column `textField`) "
        "or text (*.txt, one document per line). Blank lines are no documents.",
        default="npy",
    )
    tokenizer: str | None = _desc(
        "The tokenizer of the text formats (jsonl, parquet, text): a Hugging Face tokenizer.json or a "
        "SentencePiece .model file, chosen by its name (a directory: its tokenizer.json, else its "
        "tokenizer.model), a mounted path or gs:// URI. Each document becomes its tokens followed by "
        "the end-of-sequence token (`eosId`, else the tokenizer's own); its vocabulary must fit "
        "model.vocab. `tpujob data prepare` writes the same tokens to arrayrecord files once.",
        default=None,
        max_length=L.MAX_PATH,
        pattern=LOCATION,
    )
    text_field: str = _desc(
        "The JSON field (jsonl) or column (parquet) that holds each document's text; text when unset.",
        default="text",
        min_length=1,
        max_length=L.MAX_FIELD_NAME,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
    )
    shuffle: bool = _desc(
        "Shuffle the sequences of `files`, a new permutation each pass over the data "
        "(seeded by training.seed; the order stays a pure function of the step, so "
        "resume is exact).",
        default=True,
    )
    allow_change: bool = _desc(
        "Resume even where what decides the data order (seed, global batch, sequence length, source, "
        "files, shuffle) differs from the checkpoint's: the run then reads other data than the "
        "interrupted run would have. Without it such a resume is refused, naming the field.",
        default=False,
    )
    workers: int = _desc(
        "Threads that read the rows of `files` ahead of the training loop (each process "
        "reads only the rows its devices hold); 0 reads them on the training thread when "
        "the step needs them.",
        default=8,
        ge=0,
        le=L.MAX_DATA_WORKERS,
    )
    prefetch: int = _desc(
        "Steps whose rows the `workers` read ahead of the step being trained.", default=2, ge=1, le=L.MAX_PREFETCH
    )
    packing: bool = _desc(
        "Pack whole documents into each sequence (truncated to sequenceLength + 1 "
        "tokens, never split across sequences, the rest padded) instead of cutting one "
        "stream into windows; the batch then carries document ids and a loss mask. The "
        "packing plan is built once at start-up, which reads every document's length "
        "(all of the data once for npy/bin).",
        default=False,
    )
    eos_id: int | None = _desc(
        "The token that ends each document in npy/bin files (it stays in the "
        "document); required with `packing` of npy/bin files. With a `tokenizer`: the token "
        "appended to each document, which must be the tokenizer's own end-of-sequence token "
        "where it declares one.",
        default=None,
        ge=0,
        le=L.MAX_VOCAB,
    )

    @model_validator(mode="after")
    def _path_for_files(self) -> DataSpec:
        if self.source == "files" and not self.path:
            raise ValueError("path: required when source is files")
        if self.source == "synthetic" and self.path:
            raise ValueError("path: only used when source is files")
        if self.source == "files" and self.format == "arrayrecord" and not self.packing:
            raise ValueError("packing: required with format arrayrecord (one document per record)")
        text = self.format in TEXT_FORMATS
        if self.source == "files" and text and not self.packing:
            raise ValueError(f"packing: required with format {self.format} (documents of text)")
        if self.source == "files" and text and not self.tokenizer:
            raise ValueError(f"tokenizer: required with format {self.format} (text is tokenized on the fly)")
        if self.tokenizer and not (self.source == "files" and text):
            raise ValueError("tokenizer: only used with the text formats (jsonl, parquet, text) of files")
        if self.source == "files" and self.packing and self.format in ("npy", "bin") and self.eos_id is None:
            raise ValueError(f"eosId: required when packing {self.format} files (the token between documents)")
        return self


class EvalSpec(Base):
    interval: int = _desc("Evaluate every N steps (and after the last step).", default=100, ge=1, le=L.MAX_STEPS)
    batches: int = _desc(
        "Batches of `globalBatch` held-out sequences per evaluation, each run a microbatch "
        "at a time; the same batches every time, so evaluations compare.",
        default=4,
        ge=1,
        le=L.MAX_EVAL_BATCHES,
    )
    data: DataSpec | None = _desc(
        "The held-out data, set as `training.data` is. Unset with synthetic training data: synthetic "
        "sequences training never reads. Required when training reads files.",
        default=None,
    )


class TrainingSpec(Base):
    steps: int = _desc("Optimizer steps to train.", ge=1, le=L.MAX_STEPS)
    global_batch: int = _desc("Sequences per step across all slices.", ge=1, le=L.MAX_GLOBAL_BATCH)
    microbatches: int = _desc(
        "Gradient accumulation: each step runs the global batch as this many equal microbatches, one "
        "after another, and sums their gradients before the one optimizer update. The loss and "
        "gradients are the whole batch's; activations are one microbatch's.",
        default=1,
        ge=1,
        le=L.MAX_MICROBATCHES,
    )
    sequence_length: int = _desc("Tokens per sequence.", ge=2, le=L.MAX_SEQUENCE_LENGTH)
    learning_rate: LearningRateSpec = _desc("Learning-rate schedule.", default_factory=LearningRateSpec)
    weight_decay: float = _desc("AdamW weight decay (not applied to norm scales).", default=0.1, ge=0, le=1)
    adam: AdamSpec = _desc("Adam's moment decays and epsilon.", default_factory=AdamSpec)
    z_loss_weight: float = _desc(
        "Weight of the z-loss, the mean squared log of the softmax normaliser (PaLM uses 1e-4): it keeps "
        "the logits from drifting. 0 leaves it out.",
        default=0.0,
        ge=0,
        le=L.MAX_LOSS_WEIGHT,
    )
    moe_aux_loss_weight: float = _desc(
        "Weight of the MoE load-balancing loss (Switch Transformer).", default=0.01, ge=0, le=L.MAX_LOSS_WEIGHT
    )
    grad_clip: float = _desc("Global gradient-norm clip; 0 disables.", default=1.0, ge=0, le=L.MAX_GRAD_CLIP)
    precision: Literal["bf16", "fp8"] = _desc("Matmul precision: bf16, or fp8 through qwix.", default="bf16")
    remat: RematSpec = _desc("Rematerialisation policy.", default_factory=RematSpec)
    objective: Literal["pretrain", "sft"] = _desc(
        "pretrain (when unset): the loss on every next token of each document. sft (supervised fine-tuning): "
        '`data` is chat jsonl (each line `{"messages": [{"role", "content"}, ...]}`), rendered with the '
        "chat template beside the Hugging Face `tokenizer` (tokenizer_config.json's chat_template or "
        "chat_template.jinja, in jinja2's sandbox), the loss on the assistant's tokens only.",
        default="pretrain",
    )
    data: DataSpec = _desc("Training data.", default_factory=DataSpec)
    seed: int = _desc("Seed for initialisation and synthetic data.", default=0, ge=0, le=L.MAX_SEED)
    log_every: int = _desc("Report metrics every N steps.", default=1, ge=1, le=L.MAX_STEPS)
    eval: EvalSpec | None = _desc(
        "Evaluation on held-out data: loss and perplexity, reported like the training metrics. Unset: no evaluation.",
        default=None,
    )

    @model_validator(mode="after")
    def _eval_data_for_files(self) -> TrainingSpec:
        if self.objective == "sft":
            for name, data in (("data", self.data), ("eval.data", self.eval.data if self.eval else None)):
                if data is not None and not (data.source == "files" and data.format == "jsonl"):
                    raise ValueError(
                        f"{name}: objective: sft reads chat jsonl files (source: files, format: jsonl, a tokenizer)"
                    )
                if data is not None and data.text_field != "text":
                    raise ValueError(f"{name}.textField: not used by objective sft, which reads `messages`")
                if data is not None and (data.tokenizer or "").endswith(".model"):
                    raise ValueError(
                        f"{name}.tokenizer: objective sft needs a Hugging Face tokenizer.json beside its chat "
                        "template, not a SentencePiece model"
                    )
        if self.eval is not None and self.eval.data is None and self.data.source == "files":
            raise ValueError(
                "eval.data: required when data.source is files (held-out files the training data does not include)"
            )
        return self

    @property
    def microbatch(self) -> int:
        """Sequences in one microbatch (the batch whose activations one device holds at a time)."""
        return self.global_batch // self.microbatches


def splits_at(global_batch: int, microbatches: int, slices: int, running: int, shards_per_slice: int) -> bool:
    """Whether `microbatches_at` has an answer, in O(1): the batch splits over running x shards_per_slice
    shards, and the least count it needs is no more than the rows of one shard (that count of
    microbatches, one row each, always divides them)."""
    shards = running * shards_per_slice
    return global_batch % shards == 0 and -(-microbatches * slices // running) <= global_batch // shards


def microbatches_at(
    global_batch: int, microbatches: int, slices: int, running: int, shards_per_slice: int
) -> int | None:
    """Microbatches of a step on `running` of `slices` slices, the global batch kept: the fewest that are
    at least microbatches x slices / running (so a device's rows per microbatch are no more than on every
    slice, and the compiled step fits as the full one does) and split the batch evenly over
    running x `shards_per_slice` (the batch axes data x fsdp x expert). None when none does (the batch is
    not a multiple of running x shards_per_slice). Gradient accumulation averages the microbatches, so the
    loss and the update are the whole batch's whatever the count (train.py `accumulated`).

    The answer is the smallest divisor of one shard's rows that is at least that least count, found among
    the divisor pairs (d, rows / d) with d <= sqrt(rows): at most sqrt(limits.MAX_GLOBAL_BATCH) = 1024
    steps. Counting up from the least count instead took up to `rows` steps, which a hostile job sets
    to 10**15 (issue 27)."""
    if not splits_at(global_batch, microbatches, slices, running, shards_per_slice):
        return None
    rows = global_batch // (running * shards_per_slice)
    least = -(-microbatches * slices // running)
    best = rows
    for d in range(1, math.isqrt(rows) + 1):
        if rows % d == 0:
            best = min([best] + [c for c in (d, rows // d) if c >= least])
    return best


# ---------------------------------------------------------------------------------------------
# The mesh


class Mesh(Base):
    """Resolved device mesh: `data` spans slices, the rest one slice's devices."""

    data: int = _desc("Data parallelism across slices.", ge=1)
    fsdp: int = _desc("FSDP degree.", ge=1)
    context: int = _desc("Context-parallel degree.", ge=1)
    expert: int = _desc("Expert-parallel degree.", ge=1)
    tensor: int = _desc("Tensor-parallel degree.", ge=1)

    @property
    def shape(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def __str__(self) -> str:
        return " x ".join(f"{k}={v}" for k, v in self.shape.items())


# ---------------------------------------------------------------------------------------------
# spec.kernels


class SplashSpec(Base):
    """Splash attention's block sizes (tokens). Each is fitted down to a multiple of 128 that divides
    the sequence (query blocks: the sequence of one context shard) when it does not divide it."""

    block_q: int = _desc("Query block of the forward pass.", default=512, ge=128, le=L.MAX_BLOCK, multiple_of=128)
    block_kv: int = _desc("Key/value block of the forward pass.", default=512, ge=128, le=L.MAX_BLOCK, multiple_of=128)
    block_kv_compute: int = _desc(
        "Key/value compute block of the forward pass.", default=512, ge=128, le=L.MAX_BLOCK, multiple_of=128
    )
    block_q_dkv: int = _desc(
        "Query block of the dK/dV backward pass.", default=512, ge=128, le=L.MAX_BLOCK, multiple_of=128
    )
    block_kv_dkv: int = _desc(
        "Key/value block of the dK/dV backward pass.", default=512, ge=128, le=L.MAX_BLOCK, multiple_of=128
    )
    block_kv_dkv_compute: int = _desc(
        "Key/value compute block of the dK/dV pass.", default=512, ge=128, le=L.MAX_BLOCK, multiple_of=128
    )
    block_q_dq: int = _desc(
        "Query block of the dQ backward pass (unused with maxLogitConst, whose backward computes dQ with dK/dV).",
        default=512,
        ge=128,
        le=L.MAX_BLOCK,
        multiple_of=128,
    )
    block_kv_dq: int = _desc(
        "Key/value block of the dQ backward pass (unused with maxLogitConst).",
        default=512,
        ge=128,
        le=L.MAX_BLOCK,
        multiple_of=128,
    )
    max_logit_const: float | None = _desc(
        "Fixed softmax max: skips the running max (a few % faster). Only tokamax's Splash has it, and its "
        "backward writes dQ once per key/value block in f32 (sequence / blockKvDkv copies of dQ per device: "
        "`tpujob plan` shows the cost); unset, JAX's Splash runs, whose dQ pass accumulates on chip.",
        default=None,
        gt=0,
        le=L.MAX_LOGIT_CONST,
    )

    @model_validator(mode="after")
    def _compute_fits(self) -> SplashSpec:
        for compute, block in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
            if getattr(self, block) % getattr(self, compute):
                raise ValueError(
                    f"{to_camel(compute)}: {getattr(self, compute)} does not divide "
                    f"{to_camel(block)} ({getattr(self, block)})"
                )
        return self


class GmmTiles(Base):
    """Tiles of one grouped matmul [m, k] x [groups, k, n]; each is fitted down to a multiple of 128
    that divides its dimension when it does not divide it."""

    m: int = _desc("Rows (routed tokens) per tile.", default=512, ge=128, le=L.MAX_BLOCK, multiple_of=128)
    k: int = _desc("Contracted dimension per tile.", default=1024, ge=128, le=L.MAX_BLOCK, multiple_of=128)
    n: int = _desc("Output columns per tile.", default=1024, ge=128, le=L.MAX_BLOCK, multiple_of=128)


class GmmSpec(Base):
    """The grouped matmul's tiles, per pass; MaxText's defaults (512 x 1024 x 1024)."""

    forward: GmmTiles = _desc("Tiles of the forward pass.", default_factory=GmmTiles)
    lhs_gradient: GmmTiles = _desc("Tiles of the tokens' gradient (dY x W^T).", default_factory=GmmTiles)
    rhs_gradient: GmmTiles = _desc("Tiles of the experts' weight gradient (X^T x dY).", default_factory=GmmTiles)


class KernelsSpec(Base):
    attention: Literal["splash", "xla"] = _desc(
        "splash: the Pallas Splash kernel (interpret mode off-TPU); xla: the reference path.", default="splash"
    )
    splash: SplashSpec = _desc("Splash block sizes.", default_factory=SplashSpec)
    moe_matmul: Literal["gmm", "ragged_dot"] = _desc(
        "gmm: tokamax's Mosaic grouped matmul (Megablox; interpret mode off-TPU); ragged_dot: XLA's, the reference.",
        default="gmm",
    )
    gmm: GmmSpec = _desc("Grouped-matmul tiles.", default_factory=GmmSpec)
    tuning_cache: str | None = _desc(
        "Directory (mounted path or gs://) of Splash block sizes and grouped-matmul tiles tuned per chip "
        "and shape by `python -m tpu_workload.performance.tuning`; each is used when the job leaves it at its defaults.",
        default=None,
        min_length=1,
        max_length=L.MAX_PATH,
        pattern=LOCATION,
    )


# ---------------------------------------------------------------------------------------------
# spec.checkpoint


class CheckpointSpec(Base):
    directory: str | None = _desc(
        "gs:// URI or absolute path visible to every pod; unset disables checkpoints.",
        default=None,
        max_length=L.MAX_PATH,
        pattern=LOCATION,
    )
    interval: int = _desc("Save every N steps (and at the last step).", default=100, ge=1, le=L.MAX_STEPS)
    keep: int = _desc("Checkpoints to keep.", default=3, ge=1, le=L.MAX_CHECKPOINTS_KEPT)
    resume: bool = _desc("Resume from the latest complete checkpoint on start and restart.", default=True)
    persistent_volume_claim: str | None = _desc(
        "PVC to mount at `directory` (for a path directory).", default=None, pattern=DNS1123_SUBDOMAIN, max_length=253
    )

    @model_validator(mode="after")
    def _pvc_needs_path(self) -> CheckpointSpec:
        if self.persistent_volume_claim:
            if not self.directory:
                raise ValueError("directory: required when persistentVolumeClaim is set")
            if self.directory.startswith("gs://"):
                raise ValueError("persistentVolumeClaim: cannot be mounted at a gs:// directory")
        return self


class DivergenceSpec(Base):
    """What the trainer does about a non-finite loss or gradient norm: spec.failurePolicy's onDivergence and
    skipBatches, which the operator copies here (the rest of the failure policy is the operator's)."""

    on_divergence: Literal["Fail", "Rewind"] = _desc(
        "Fail, or Rewind: a restart from the latest checkpoint skips skipBatches batches after it.", default="Fail"
    )
    skip_batches: int = _desc(
        "Batches of data skipped after the checkpoint a rewind restores.", default=0, ge=0, le=L.MAX_STEPS
    )


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
    peak_bf16_flops_per_device: float | None = _desc(
        "Peak bf16 FLOP/s of one JAX device, where the job's precision has another peak (fp8).", default=None, gt=0
    )
    model: ModelDims = _desc("Resolved model shape.")
    init: ModelInit | None = _desc("Parameters to start from (spec.model.init); unset: random.", default=None)
    training: TrainingSpec = _desc("Training settings.")
    mesh: Mesh = _desc("Resolved mesh.")
    kernels: KernelsSpec = _desc("Kernels.")
    checkpoint: CheckpointSpec = _desc("Checkpointing.")
    divergence: DivergenceSpec = _desc(
        "A non-finite loss or gradient norm (spec.failurePolicy.onDivergence, skipBatches).",
        default_factory=lambda: DivergenceSpec(),
    )
    metrics_port: int = _desc("Metrics port of the coordinator.")
    # Not from the job's spec: `tpujob run --local --profile` sets it; on a cluster the annotation asks the
    # running trainer instead (api/profiling.py).
    profile_steps: str | None = _desc(
        "Steps to trace with the JAX profiler, FIRST-LAST (1-based, as reported).",
        default=None,
        pattern=r"^[0-9]+(-[0-9]+)?$",
    )

    def at_slices(self, running: int) -> TrainerConfig:
        """This config run on `running` of its slices (an elastic job that lost some, docs/elastic.md): the
        mesh's `data` degree is the slices that run, the global batch is kept, and the microbatches grow
        (`microbatches_at`) so that no device holds more rows at a time than on every slice. Pure; the
        operator renders the count into the pods ($TPUJOB_SLICES) and the trainer applies it to the one
        ConfigMap, which never changes."""
        if running == self.slices:
            return self
        t, m = self.training, self.mesh
        per_slice = m.data // self.slices
        micro = microbatches_at(t.global_batch, t.microbatches, self.slices, running, per_slice * m.fsdp * m.expert)
        if micro is None:
            raise ValueError(f"slices: the global batch {t.global_batch} cannot be split over {running} slice(s)")
        return self.model_copy(
            update={
                "slices": running,
                "mesh": m.model_copy(update={"data": per_slice * running}),
                "training": t.model_copy(update={"microbatches": micro}),
            }
        )


# ---------------------------------------------------------------------------------------------
# What the plan says: `python -m tpu_workload.performance.plan` prints it, and the operator's pre-flight reads it
# back from the pod's termination message (Kubernetes keeps at most 4096 bytes of it)

# Fits: compiled, and fits HBM with the headroom asked for. DoesNotFit, VmemOverflow, RejectedFlags: the
# job must change. The rest: it could not be checked here (no libtpu, a generation this libtpu cannot
# target, any other compile failure).
PlanVerdict = Literal["Fits", "DoesNotFit", "VmemOverflow", "RejectedFlags", "NoLibtpu", "Unsupported", "CompileError"]
JOB_MUST_CHANGE = ("DoesNotFit", "VmemOverflow", "RejectedFlags")
TERMINATION_MESSAGE_BYTES = 4096


class RejectedFlag(Base):
    flag: str = _desc("The flag as LIBTPU_INIT_ARGS carried it.")
    message: str = _desc("libtpu's words, e.g. ERROR: Unknown command line flag 'x'.")


# The resources a step is bound by, in the order `binding` is chosen on a tie.
RESOURCES = ("compute", "hbm", "ici", "dcn")


class StepResources(Base):
    """What one train step costs each device, read from the compiled step's optimized HLO with every loop
    at its trip count (tpu_workload.performance.hlo_costs), and the least time each resource allows at the
    generation's peaks (tpu_operator.api.roofline). See docs/plan.md for what is counted and what not."""

    matmul_tflop: float = Field(
        alias="matmulTFLOP",
        ge=0,
        description=(
            "Matmul TFLOP per device per step: XLA's dots and convolutions, and the Splash and grouped-matmul kernels "
            "from their shapes (rematerialisation included)."
        ),
    )
    fp8_tflop: float = Field(default=0.0, alias="fp8TFLOP", ge=0, description="Of those, with fp8 operands.")
    model_tflop: float | None = Field(
        default=None,
        alias="modelTFLOP",
        ge=0,
        description=("Model TFLOP per device per step, analytic (3 x forward, no rematerialisation): what MFU counts."),
    )
    kernel_calls: int = _desc("Mosaic kernel calls per step (Splash, grouped matmul).", default=0, ge=0)
    ici_gib: dict[str, float] = Field(
        default_factory=dict,
        alias="iciGiB",
        description=(
            "Collective GiB per device per step inside a slice, by kind (all-gather, reduce-scatter, all-reduce, "
            "all-to-all, ragged-all-to-all, collective-permute): each collective's full buffer (an all-gather's "
            "result, a reduce-scatter's operand)."
        ),
    )
    dcn_gib: dict[str, float] = Field(
        default_factory=dict, alias="dcnGiB", description="Collective GiB per device per step between slices, by kind."
    )
    ici_sent_gib: float = Field(
        default=0.0, alias="iciSentGiB", ge=0, description="GiB one device sends over ICI per step (ring algorithms)."
    )
    dcn_sent_gib: float = Field(
        default=0.0, alias="dcnSentGiB", ge=0, description="GiB one device sends over DCN per step."
    )
    hbm_traffic_gib: float | None = Field(
        default=None,
        alias="hbmTrafficGiB",
        ge=0,
        description=(
            "HBM GiB read and written per device per step, estimated from the module (each fused op's operands and "
            "result once)."
        ),
    )
    unknown_loops: int = _desc("Loops whose trip count could not be told, counted once.", default=0, ge=0)
    bound_seconds: dict[str, float] = Field(
        default_factory=dict,
        alias="boundSeconds",
        description=("The least step time each resource allows at the generation's peaks: compute, hbm, ici, dcn."),
    )
    step_time_bound_s: float | None = Field(
        default=None,
        alias="stepTimeBoundSeconds",
        ge=0,
        description=("Lower bound on the step time: the largest of boundSeconds (perfect overlap of the rest)."),
    )
    binding: str | None = _desc("The resource with the largest bound.", default=None)
    mfu_ceiling: float | None = _desc(
        "modelTFLOP over stepTimeBoundSeconds at the peak MFU is computed against: the most MFU this step can reach.",
        default=None,
        ge=0,
    )


class PlanResult(Base):
    """The train step compiled for the job's slice by the TPU compiler: per-device HBM, or why not."""

    verdict: PlanVerdict = _desc("Fits, or what stopped it.")
    message: str = _desc("One or two sentences: the numbers, and what to change.")
    hbm_per_device_gib: float | None = Field(
        default=None, alias="hbmPerDeviceGiB", description="Per-device total: state + temporaries."
    )
    state_gib: float | None = Field(
        default=None, alias="stateGiB", description="Step arguments: parameters, optimizer state, the batch."
    )
    temporaries_gib: float | None = Field(
        default=None, alias="temporariesGiB", description="Activations and temporaries (and outputs not donated)."
    )
    hbm_capacity_gib: float | None = Field(default=None, alias="hbmCapacityGiB", description="HBM of one device.")
    host_per_device_gib: float | None = Field(
        default=None, alias="hostPerDeviceGiB", description="Host memory per device: activations offloaded by remat."
    )
    host_capacity_gib: float | None = Field(
        default=None, alias="hostCapacityGiB", description="The host VM's memory per device."
    )
    headroom: float = _desc("Fraction of HBM (and host memory) to keep free.", default=0.0, ge=0, lt=1)
    compile_seconds: float | None = _desc("Time in the TPU compiler.", default=None)
    libtpu_version: str | None = _desc("The libtpu that compiled.", default=None)
    device_kind: str | None = _desc("The compiled-for device kind, e.g. TPU7x.", default=None)
    devices: int | None = _desc("Devices of all slices.", default=None)
    change: list[str] = _desc("Fields to change (paths under spec).", default_factory=list)
    largest: list[str] = _desc("The largest allocations XLA reports, largest first.", default_factory=list)
    rejected_flags: list[RejectedFlag] = _desc("LIBTPU_INIT_ARGS flags libtpu refused.", default_factory=list)
    slices: int | None = _desc(
        "The slice count this result is for (an elastic job's plan at every count: the worst of them).", default=None
    )
    hbm_by_slices: dict[str, float] = Field(
        default_factory=dict,
        alias="hbmPerDeviceGiBBySlices",
        description="An elastic job: HBM per device at each slice count compiled.",
    )
    resources: StepResources | None = _desc(
        "Matmul FLOPs, collective bytes and HBM traffic of one step per device, and the step-time bound they set.",
        default=None,
    )

    @property
    def fits(self) -> bool | None:
        """True or False when the compiler answered; None when it could not be asked."""
        if self.verdict == "Fits":
            return True
        return False if self.verdict in JOB_MUST_CHANGE else None

    @property
    def exit_code(self) -> int:
        """0 fits, 2 the job must change, 3 it could not be checked (`tpujob plan` exits with it too)."""
        return 0 if self.verdict == "Fits" else 2 if self.verdict in JOB_MUST_CHANGE else 3

    def to_termination_message(self) -> str:
        """Compact JSON under TERMINATION_MESSAGE_BYTES: allocations, then message text, cut to fit."""
        result = self
        for _ in range(len(self.largest) + 1):
            text = result.model_dump_json(by_alias=True, exclude_defaults=True)
            if len(text.encode()) <= TERMINATION_MESSAGE_BYTES:
                return text
            result = result.model_copy(update={"largest": result.largest[:-1]})
        room = TERMINATION_MESSAGE_BYTES - (len(text.encode()) - len(result.message.encode())) - 8
        return result.model_copy(update={"message": result.message[: max(room // 4, 0)] + "..."}).model_dump_json(
            by_alias=True, exclude_defaults=True
        )
