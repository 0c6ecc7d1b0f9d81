"""LIBTPU_INIT_ARGS and XLA_FLAGS for a job, from its generation and runtime settings.

SparseCore collective offload (v7x; libtpu turns it on by default for the three main collectives): per
collective `--xla_tpu_enable_sparse_core_collective_offload_<op>=true`, with
`--xla_tpu_enable_async_collective_fusion_fuse_<op>=false` (offload and continuation fusion of the same
collective are mutually exclusive) and `--xla_tpu_enable_<op>_offload_tracing=true`, and the base set
`SPARSE_CORE_BASE` once; v5p and v6e use continuation fusion instead. `--xla_tpu_scoped_vmem_limit_kib` is at
most a TensorCore's VMEM (64 MiB, 65536 KiB, on v7x); the published v7x recipes
(https://github.com/AI-Hypercomputer/tpu-recipes, e.g. Llama 3.1-70B, 8k, bf16 on 4x4x4) use 61440.
libtpu 0.0.52 accepts every flag written here (an unknown one aborts it: `Unknown command line flag`).
"""

from __future__ import annotations

from ..api.catalogue import Generation
from ..api.spec import RuntimeSpec

COLLECTIVES = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce"}
# Needed once whenever any collective is offloaded to SparseCore.
SPARSE_CORE_BASE = (
    "--xla_tpu_use_tc_device_shape_on_sc=true",
    "--xla_sc_enable_instruction_fusion=false",
    "--xla_sc_disjoint_spmem=false",
    "--xla_sc_disable_megacore_partitioning=true",
)
DEFAULT_SCOPED_VMEM_KIB = {"v7x": 61440}  # published v7x recipes; 65536 is the hardware bound


def offloaded(gen: Generation, runtime: RuntimeSpec) -> list[str]:
    """Collectives offloaded to SparseCore: on by default where the chip has SparseCores."""
    spec = runtime.sparse_core_offload
    return [c for c in COLLECTIVES if (getattr(spec, c) if getattr(spec, c) is not None else gen.sparse_core)]


def scoped_vmem_kib(gen: Generation, runtime: RuntimeSpec) -> int | None:
    return runtime.scoped_vmem_limit_kib or DEFAULT_SCOPED_VMEM_KIB.get(gen.name)


def libtpu_init_args(gen: Generation, runtime: RuntimeSpec) -> list[str]:
    flags: list[str] = []
    ops = offloaded(gen, runtime)
    for op in ops:
        flags += [
            f"--xla_tpu_enable_sparse_core_collective_offload_{op}=true",
            # Offload and continuation fusion of the same collective are mutually exclusive.
            f"--xla_tpu_enable_async_collective_fusion_fuse_{op}=false",
            f"--xla_tpu_enable_{op}_offload_tracing=true",
        ]
    if ops:
        flags += SPARSE_CORE_BASE
    vmem = scoped_vmem_kib(gen, runtime)
    if vmem:
        flags.append(f"--xla_tpu_scoped_vmem_limit_kib={vmem}")
    # User flags win: drop our setting of any flag the user sets, keep the order otherwise.
    user = {f.split("=", 1)[0] for f in runtime.libtpu_init_args}
    return [f for f in flags if f.split("=", 1)[0] not in user] + list(runtime.libtpu_init_args)


def field_of(runtime: RuntimeSpec, flag: str) -> str:
    """The spec field a rendered LIBTPU_INIT_ARGS flag comes from (to name it when libtpu refuses it)."""
    name = flag.split("=", 1)[0]
    for i, user in enumerate(runtime.libtpu_init_args):
        if user.split("=", 1)[0] == name:
            return f"spec.runtime.libtpuInitArgs[{i}]"
    if name == "--xla_tpu_scoped_vmem_limit_kib":
        return "spec.runtime.scopedVmemLimitKiB"
    for op in COLLECTIVES:
        if name.endswith(op) or f"_{op}_" in name:
            return f"spec.runtime.sparseCoreOffload.{op.split('_')[0]}{''.join(w.title() for w in op.split('_')[1:])}"
    return "spec.runtime.sparseCoreOffload"  # the SparseCore base flags
