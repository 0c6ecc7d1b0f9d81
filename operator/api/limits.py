"""The bounds of every number, string and list a job may carry: the CRD publishes them (the API server
refuses the absurd before the operator reads it), and the models enforce the same ones offline.

Each is chosen from what a real job needs, with room: the largest published configurations (Llama 3.1
405B, DeepSeek-V3, Gemma's 262k vocabulary, million-token contexts, a full v7x pod) fit well inside
them. What they buy is bounded work: no rule, render or plan may cost more than these numbers allow
(docs/api.md, Bounds, says each and why). pydantic only: the trainer imports it through contract.py.
"""

from __future__ import annotations

# Kubernetes stores integers as int64; every bound below is far inside it.
INT64_MAX = 2**63 - 1

# spec.model
MAX_LAYERS = 1024  # Llama 3.1 405B has 126; PaLM 118
MAX_MODEL_DIM = 131072  # 405B: 16384
MAX_HEADS = 1024  # 405B: 128 query heads
MAX_HEAD_DIM = 1024  # 128-256 in practice
MAX_MLP_DIM = 1048576  # 405B: 53248
MAX_VOCAB = 4194304  # Gemma 3: 262144
MAX_EXPERTS = 1024  # DeepSeek-V3: 256 routed
MAX_EXPERTS_PER_TOKEN = 64  # DeepSeek-V3: 8
MAX_ROPE_THETA = 1e10  # Llama 3: 5e5; long-context variants go to 1e8
MAX_NORM_EPS = 1e-2  # Llama 3 and Mixtral: 1e-5; past this the norm no longer normalises

# spec.training
MAX_STEPS = 100_000_000  # 1e8 optimizer steps: years of training at one step a second
MAX_GLOBAL_BATCH = 1048576  # sequences per step; Llama 3 405B: 2048 x 8192 tokens
MAX_MICROBATCHES = 4096  # gradient accumulation beyond this is slower than fewer slices
MAX_SEQUENCE_LENGTH = 2097152  # 2M tokens: past every published context length
MAX_SEED = 2**32 - 1  # JAX's PRNG seeds are 32-bit in the trainer's data order
MAX_LEARNING_RATE = 1.0  # Adam with a learning rate above 1 diverges at the first step
MAX_LOSS_WEIGHT = 100.0  # z-loss, MoE aux loss: 1e-4..1e-2 in practice
MAX_GRAD_CLIP = 1e6
MAX_DATA_WORKERS = 256
MAX_PREFETCH = 64
MAX_EVAL_BATCHES = 10000
MAX_FIELD_NAME = 128  # data.textField: a JSON key or parquet column name

# spec.parallelism: one degree never exceeds one slice's devices (a full v7x pod: 9,216 chips x 2)
MAX_DEGREE = 32768

# spec.kernels
MAX_BLOCK = 131072  # Splash blocks and grouped-matmul tiles, in tokens or columns
MAX_LOGIT_CONST = 1e6

# spec.checkpoint
MAX_CHECKPOINTS_KEPT = 1000

# spec.tpu
MAX_SLICES = 256  # the largest published multislice runs use tens of slices

# Durations (seconds): a job's timeouts stay below a week (flex-start's own limit).
MAX_TIMEOUT_S = 7 * 24 * 3600

# Strings and lists
MAX_PATH = 1024  # a gs:// URI or a mounted path
MAX_ENV = 256  # runtime.env entries
MAX_ENV_VALUE = 32768  # one value (the whole spec is capped by MAX_SPEC_BYTES anyway)
MAX_FLAGS = 256  # libtpuInitArgs, xlaFlags
MAX_FLAG = 1024
MAX_ARGS = 256  # command, args
MAX_ARG = 4096
MAX_TOLERATIONS = 64
MAX_SELECTORS = 64  # nodeSelector entries
MAX_RESOURCES = 32  # resources.requests / limits entries
MAX_QUANTITY = 64
MAX_IMAGE = 512
MAX_EXIT_CODES = 64

# The whole spec as JSON: the JobSet carries it as an annotation (names.APPLIED_SPEC), and Kubernetes
# allows 256 KiB of annotations per object; the ConfigMap (its trainer config, at most the spec's
# sections) must stay under 1 MiB. 192 KiB leaves room for the other annotations.
MAX_ANNOTATIONS_BYTES = 256 * 1024
MAX_CONFIG_MAP_BYTES = 1024 * 1024
MAX_SPEC_BYTES = 192 * 1024
