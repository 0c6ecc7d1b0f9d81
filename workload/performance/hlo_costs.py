"""What one compiled train step costs per device, read from XLA's optimized HLO: matmul FLOPs, the
Pallas kernels' FLOPs and calls, bytes by collective kind over ICI and DCN, and HBM traffic.

    python -m tpu_workload.performance.hlo_costs FILE|DUMP_DIR [--top N] [--json]

FILE is an optimized module as XLA dumps it (`--xla_dump_to=DIR`: `*jit_train_step*.after_optimizations.txt`)
or `compiled.as_text()` (which libtpu 0.0.52 refuses for TPU steps with async collectives, a RET_CHECK;
the dump is the reliable source). XLA's own `cost_analysis()` counts a while loop's body once and no
Pallas kernel, so the walk does what it does not:

- Every while loop is weighted by its trip count: `known_trip_count` in its backend_config where the
  compiler wrote one, else derived from the loop itself (the condition compares an induction variable
  with a constant, the init tuple starts it at a constant, the body adds a constant). Nested loops
  multiply. A loop whose count cannot be derived is counted once and named in `unknown_loops`.
- Called computations are walked: fusions, calls, async computations (SparseCore offload), custom calls
  with called computations. A conditional counts its costliest branch (most FLOPs, then bytes): an upper
  bound on that op; the reducers of collectives, reduce, sort, scatter are not walked.
- Matmul FLOPs: every `convolution` (the TPU compiler rewrites dots as convolutions) and `dot`,
  2 x multiply-adds, counting only window positions that meet real (unpadded) input, as XLA's
  HloCostAnalysis does; split into fp8 (both operands 8-bit floats) and the rest.
- Kernels (`tpu_custom_call`, Mosaic): the Splash attention kernels from their q and k operands
  ([batch..., heads, sequence, head_dim], as `operand_layout_constraints` gives them), counted as causal
  attention: half of the dense 2·B·Hq·Sq·Skv·d per matmul, 2 matmuls forward, 3 for dQ, 4 for dK/dV, 5 for
  a fused backward; the grouped matmuls (Megablox / tokamax `gmm`, `tgmm`) as 2·M·K·N with M the rows as
  the kernel is given them (padding included). Other kernels are counted as calls with no FLOPs.
- Collectives, counted once per async start/done pair, each with `bytes` = the size of its full
  (unsharded-side) buffer on one device: an all-gather's result, a reduce-scatter's operand, an
  all-reduce's, all-to-all's and collective-permute's operand, a ragged all-to-all's output buffer (an upper
  bound: what is sent depends on the routing). `wire_bytes` is what one device sends over the links in the
  usual ring/bucket algorithms: (n-1)/n of `bytes` for all-gather, reduce-scatter and all-to-all, 2(n-1)/n
  for all-reduce, all of it for a permute (n: the replica group's size). The collective-permutes of
  XLA's windowed einsum loops (a matmul fused with the all-gather or reduce-scatter of its operand) are
  counted as the all-gather or reduce-scatter they implement.
- DCN: a multislice step is compiled per slice; what crosses slices is sent through the megascale
  runtime as host transfers (`send` with `_xla_megascale_transfer_type`), counted as DCN bytes of that
  kind; every collective with replica groups is inside one slice (ICI).
- HBM traffic (an estimate, not a compiler figure: the compiler writes none it can be read from) is the
  bytes each top-level op reads and writes in HBM (memory space 0): every fusion's operands and result
  once, a slice read by a fusion as the slice, an in-place dynamic-update-slice as its update.
  Operands and results placed in VMEM or SMEM by the compiler are not HBM traffic. A fusion that reads an
  operand more than once (a matmul tiled over HBM) is counted once: a lower bound on the traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterator

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
GIB = 1 << 30

_BYTES = {
    "pred": 1,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e3m4": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
}
_FP8 = {k for k in _BYTES if k.startswith("f8")}

# Opcodes that neither read nor write memory of their own (bookkeeping, aliases, control).
_NO_TRAFFIC = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "async-start",
    "async-update",
    "async-done",
    "opt-barrier",
    "add-dependency",
    "domain",
    "send",
    "recv",
    "send-done",
    "recv-done",
}
_COLLECTIVES = {
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "ragged-all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "all-gather",
}
_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}
# Matmuls per Splash call: forward QKᵀ and PV; dQ recomputes S and forms dP and dQ; dK/dV adds dV and dK.
_SPLASH_MATMULS = (("dkv", 4), ("dq", 3), ("bwd", 5), ("fwd", 2))


# --- shapes -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a shape: element type, dimensions, and the memory space its layout names (0: HBM)."""

    dtype: str
    dims: tuple[int, ...]
    space: int = 0

    @property
    def bytes(self) -> float:
        return _BYTES.get(self.dtype, 4) * math.prod(self.dims)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


Shape = Array | tuple  # a tuple shape is a tuple of Shapes

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")


def _skip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text)


def parse_shape(text: str) -> Shape:
    """`bf16[8,128]{1,0:T(8,128)(2,1)S(1)}` -> Array; `(f32[], (s32[2]))` -> a nested tuple of them."""
    text = _skip_comments(text).strip()
    if text.startswith("("):
        parts, depth, start = [], 0, 1
        for i, ch in enumerate(text):
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
                if text[start:i].strip():
                    parts.append(parse_shape(text[start:i]))
                start = i + 1
                if depth == 0:
                    break
        return tuple(parts)
    m = _ARRAY.match(text)
    if not m:
        return ()
    dims = tuple(int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    space = re.search(r"S\((\d+)\)", m.group(3) or "")
    return Array(m.group(1), dims, int(space.group(1)) if space else 0)


def arrays(shape: Shape) -> Iterator[Array]:
    if isinstance(shape, Array):
        yield shape
    else:
        for s in shape:
            yield from arrays(s)


def hbm_bytes(shape: Shape) -> float:
    return sum(a.bytes for a in arrays(shape) if a.space == 0)


# --- the module ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: Shape
    operands: list[str]
    attrs: str  # everything after the operands, string literals blanked
    raw: str  # the whole instruction text

    def attr(self, key: str) -> str | None:
        m = re.search(rf"(?:^|[ ,]){re.escape(key)}=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None

    def called(self, key: str) -> list[str]:
        m = re.search(rf"(?:^|[ ,]){re.escape(key)}=\{{([^}}]*)\}}", self.attrs)
        return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()] if m else []

    def string(self, key: str) -> str | None:
        m = re.search(rf'{re.escape(key)}="((?:[^"\\]|\\.)*)"', self.raw)
        return m.group(1) if m else None

    @property
    def op_name(self) -> str:
        return self.string("op_name") or ""


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    root: str | None
    params: dict[int, str]  # parameter number -> instruction name


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str


_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _balance(text: str) -> int:
    stripped = _STRING.sub('""', text)
    return sum(stripped.count(c) for c in "([{") - sum(stripped.count(c) for c in ")]}")


def _instruction(text: str) -> tuple[bool, Instruction] | None:
    head = _INSTRUCTION.match(text)
    if not head:
        return None
    rest = text[head.end() :]
    # The shape: a balanced parenthesised tuple, or one token.
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):  # noqa: B007 (i is read after the loop)
            depth += ch in "([{"
            depth -= ch in ")]}"
            if depth == 0:
                break
        shape_text, rest = rest[: i + 1], rest[i + 1 :].lstrip()
    else:
        shape_text, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    opcode, depth, i = m.group(1), 0, m.end() - 1
    blank = _STRING.sub(lambda s: '"' + " " * (len(s.group(0)) - 2) + '"', rest)
    for j in range(i, len(blank)):
        depth += blank[j] in "([{"
        depth -= blank[j] in ")]}"
        if depth == 0:
            break
    operands = re.findall(r"%([\w.\-]+)", _skip_comments(rest[i + 1 : j]))
    return bool(head.group(1)), Instruction(
        head.group(2), opcode, parse_shape(shape_text), operands, blank[j + 1 :], text
    )


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text (`HloModule ...` then `%name (...) -> ... { ... }` blocks)."""
    computations: dict[str, Computation] = {}
    entry, current, pending, depth = None, None, "", 0
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = Computation(m.group(2), {}, None, {})
                if m.group(1):
                    entry = current.name
            continue
        if not pending and line.startswith("}"):
            computations[current.name] = current
            current = None
            continue
        pending = f"{pending}\n{line}" if pending else line
        depth += _balance(line)
        if depth > 0:
            continue
        parsed, pending, depth = _instruction(pending), "", 0
        if parsed is None:
            continue
        is_root, inst = parsed
        current.instructions[inst.name] = inst
        if is_root:
            current.root = inst.name
        if inst.opcode == "parameter":
            current.params[int(re.search(r"parameter\((\d+)\)", inst.raw).group(1))] = inst.name
    if entry is None:
        raise ValueError("no ENTRY computation: not an HLO module's text")
    return Module(computations, entry)


# --- loops -----------------------------------------------------------------------------------------

_PASS_THROUGH = {"copy", "bitcast", "convert", "reshape", "copy-start", "copy-done"}


def _trace(comp: Computation, name: str) -> Instruction | None:
    inst = comp.instructions.get(name)
    while inst is not None and inst.opcode in _PASS_THROUGH and inst.operands:
        inst = comp.instructions.get(inst.operands[0])
    return inst


def _constant(module: Module, comp: Computation, name: str) -> int | None:
    inst = _trace(comp, name)
    if inst is None:
        return None
    if inst.opcode == "constant":
        m = re.search(r"constant\((-?\d+)\)", inst.raw)
        return int(m.group(1)) if m else None
    if inst.opcode == "fusion":  # a constant wrapped in a fusion of its own
        fused = module.computations.get(inst.attr("calls") or "")
        if fused and fused.root and not fused.params:
            return _constant(module, fused, fused.root)
    return None


def _tuple_index(comp: Computation, name: str) -> int | None:
    """i where `name` is get-tuple-element(parameter, index=i) of `comp`'s (single, tuple) parameter."""
    inst = _trace(comp, name)
    if inst is None or inst.opcode != "get-tuple-element":
        return None
    source = comp.instructions.get(inst.operands[0])
    if source is None or source.opcode != "parameter":
        return None
    return int(inst.attr("index") or -1)


def _unfuse(module: Module, comp: Computation, inst: Instruction) -> tuple[Computation, Instruction, dict[str, str]]:
    """A fusion's root inside its computation, with the fused parameters mapped to the fusion's operands."""
    fused = module.computations.get(inst.attr("calls") or "")
    if inst.opcode != "fusion" or fused is None or fused.root is None:
        return comp, inst, {}
    return (
        fused,
        fused.instructions[fused.root],
        {fused.params[i]: op for i, op in enumerate(inst.operands) if i in fused.params},
    )


def _compare(module: Module, cond: Computation) -> tuple[int, int, str] | None:
    """(induction variable's tuple index, bound, direction) of `cond`, the variable on the left."""
    root = cond.instructions.get(cond.root or "")
    if root is None:
        return None
    where, cmp, mapping = _unfuse(module, cond, root)
    if cmp.opcode != "compare" or len(cmp.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", cmp.attrs)
    flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}

    def side(name: str) -> tuple[int | None, int | None]:
        inner = _trace(where, name)
        outer = mapping.get(inner.name) if inner is not None and inner.opcode == "parameter" and mapping else None
        if outer is not None:
            return _tuple_index(cond, outer), _constant(module, cond, outer)
        return _tuple_index(where, name) if not mapping else None, _constant(module, where, name)

    (li, lc), (ri, rc) = side(cmp.operands[0]), side(cmp.operands[1])
    if direction is None:
        return None
    if li is not None and rc is not None:
        return li, rc, direction.group(1)
    if ri is not None and lc is not None:
        return ri, lc, flip[direction.group(1)]
    return None


def _step(module: Module, body: Computation, index: int) -> int | None:
    """The constant the body adds to tuple element `index` per iteration."""
    root = body.instructions.get(body.root or "")
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    inst = _trace(body, root.operands[index])
    where, update, mapping = _unfuse(module, body, inst) if inst is not None else (body, None, {})
    if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None

    def is_var(name: str) -> bool:
        inner = _trace(where, name)
        if inner is not None and inner.opcode == "parameter" and mapping:
            return _tuple_index(body, mapping[inner.name]) == index
        return not mapping and _tuple_index(where, name) == index

    def const(name: str) -> int | None:
        inner = _trace(where, name)
        if inner is not None and inner.opcode == "parameter" and mapping:
            return _constant(module, body, mapping[inner.name])
        return _constant(module, where, name)

    a, b = update.operands
    if is_var(a) and const(b) is not None:
        return const(b) if update.opcode == "add" else -const(b)
    if update.opcode == "add" and is_var(b) and const(a) is not None:
        return const(a)
    return None


def trip_count(module: Module, comp: Computation, loop: Instruction) -> int | None:
    """How many times `loop` (a while in `comp`) runs its body, or None where it cannot be told."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.raw)
    if known:
        return int(known.group(1))
    cond = module.computations.get(loop.attr("condition") or "")
    body = module.computations.get(loop.attr("body") or "")
    found = _compare(module, cond) if cond else None
    if body is None or found is None:
        return None
    index, bound, direction = found
    init = _trace(comp, loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start, step = _constant(module, comp, init.operands[index]), _step(module, body, index)
    if start is None or not step:
        return None
    span = {
        "LT": bound - start,
        "LE": bound - start + step,
        "GT": bound - start,
        "GE": bound - start + step,
        "NE": bound - start,
    }.get(direction)
    if span is None or (span > 0) != (step > 0):
        return 0 if span is not None else None
    return max(0, -(-span // step))


# --- replica groups --------------------------------------------------------------------------------


def replica_groups(inst: Instruction) -> list[list[int]] | None:
    """The device groups of a collective (explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]`, or
    `mesh['a'=2,'b'=2] {'b'}`), or None when the op names none (one group of every device)."""
    text = inst.attrs
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", text)
    if m:
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        return groups or None
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        return [list(g) for g in _iota(m.group(2), m.group(3), shape[-1])]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", text)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        chosen = re.findall(r"'([^']+)'", m.group(4))
        ids = _iota_array(m.group(2) or ",".join(map(str, sizes)), m.group(3), math.prod(sizes))
        order = [i for i, n in enumerate(names) if n not in chosen] + [names.index(c) for c in chosen]
        size = math.prod(sizes[names.index(c)] for c in chosen)
        flat = _transpose(ids, sizes, order)
        return [flat[i : i + size] for i in range(0, len(flat), size)]
    return None


def _iota_array(dims_text: str, perm_text: str | None, total: int) -> list[int]:
    dims = [int(x) for x in dims_text.split(",")]
    ids = list(range(math.prod(dims)))
    if perm_text:
        ids = _transpose(ids, dims, [int(x) for x in perm_text.split(",")])
    return ids[:total]


def _iota(dims_text: str, perm_text: str | None, size: int) -> list[list[int]]:
    ids = _iota_array(dims_text, perm_text, math.prod(int(x) for x in dims_text.split(",")))
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _transpose(flat: list[int], dims: list[int], perm: list[int]) -> list[int]:
    """`flat` as a row-major array of `dims`, transposed by `perm`, flattened again."""
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    new_dims = [dims[p] for p in perm]
    out = []
    for idx in range(math.prod(dims)):
        rest, old = idx, 0
        for k in range(len(new_dims) - 1, -1, -1):
            coord, rest = rest % new_dims[k], rest // new_dims[k]
            old += coord * strides[perm[k]]
        out.append(flat[old])
    return out


# --- costs -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Site:
    """One op of the module with its per-step totals: how many times it runs, and what it costs."""

    what: str  # e.g. "all-gather bf16[4096,14336]" or "convolution bf16[...] x bf16[...]"
    op_name: str
    count: float = 0.0
    value: float = 0.0  # FLOPs or bytes per step


@dataclasses.dataclass
class Costs:
    """Per device, per step (every loop at its trip count)."""

    matmul_flops: float = 0.0  # XLA's dots and convolutions
    fp8_matmul_flops: float = 0.0  # the part of matmul_flops with both operands 8-bit floats
    kernel_flops: dict[str, float] = dataclasses.field(default_factory=dict)  # Splash, grouped matmul
    fp8_kernel_flops: float = 0.0
    kernel_calls: dict[str, float] = dataclasses.field(default_factory=dict)  # every Mosaic kernel by name
    ici_bytes: dict[str, float] = dataclasses.field(default_factory=dict)  # kind -> bytes (see module doc)
    dcn_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    ici_wire_bytes: float = 0.0
    dcn_wire_bytes: float = 0.0
    hbm_bytes: float = 0.0
    unknown_loops: list[str] = dataclasses.field(default_factory=list)
    sites: dict[tuple[str, str, str], Site] = dataclasses.field(default_factory=dict)  # (category, what, op_name)

    @property
    def flops(self) -> float:
        """Matmul FLOPs: XLA's and the kernels'."""
        return self.matmul_flops + sum(self.kernel_flops.values())

    @property
    def fp8_flops(self) -> float:
        return self.fp8_matmul_flops + self.fp8_kernel_flops

    @property
    def collective_bytes(self) -> dict[str, float]:
        """ICI + DCN bytes by kind."""
        return {
            k: self.ici_bytes.get(k, 0.0) + self.dcn_bytes.get(k, 0.0)
            for k in KINDS
            if k in self.ici_bytes or k in self.dcn_bytes
        }

    def add(self, other: Costs, times: float) -> None:
        self.matmul_flops += other.matmul_flops * times
        self.fp8_matmul_flops += other.fp8_matmul_flops * times
        self.fp8_kernel_flops += other.fp8_kernel_flops * times
        self.ici_wire_bytes += other.ici_wire_bytes * times
        self.dcn_wire_bytes += other.dcn_wire_bytes * times
        self.hbm_bytes += other.hbm_bytes * times
        for mine, theirs in (
            (self.kernel_flops, other.kernel_flops),
            (self.kernel_calls, other.kernel_calls),
            (self.ici_bytes, other.ici_bytes),
            (self.dcn_bytes, other.dcn_bytes),
        ):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v * times
        self.unknown_loops += [u for u in other.unknown_loops if u not in self.unknown_loops]
        for key, site in other.sites.items():
            mine_site = self.sites.setdefault(key, Site(site.what, site.op_name))
            mine_site.count += site.count * times
            mine_site.value += site.value * times

    def note(self, category: str, what: str, op_name: str, value: float) -> None:
        site = self.sites.setdefault((category, what, op_name), Site(what, op_name))
        site.count += 1
        site.value += value

    def top(self, category: str, n: int = 10) -> list[Site]:
        """The `n` costliest sites of a category: "flops", "kernel", "ici", "dcn" or "hbm"."""
        return sorted((s for (c, _, _), s in self.sites.items() if c == category), key=lambda s: -s.value)[:n]

    def summary(self) -> dict:
        """Per device per step, in plain units (TFLOP, GiB), for JSON."""
        gib = lambda d: {k: round(v / GIB, 4) for k, v in d.items()}  # noqa: E731
        return {
            "matmul_tflop": round(self.flops / 1e12, 4),
            "xla_matmul_tflop": round(self.matmul_flops / 1e12, 4),
            "kernel_tflop": {k: round(v / 1e12, 4) for k, v in self.kernel_flops.items()},
            "fp8_tflop": round(self.fp8_flops / 1e12, 4),
            "kernel_calls": {k: int(v) for k, v in self.kernel_calls.items()},
            "ici_gib": gib(self.ici_bytes),
            "dcn_gib": gib(self.dcn_bytes),
            "collective_gib": gib(self.collective_bytes),
            "ici_wire_gib": round(self.ici_wire_bytes / GIB, 4),
            "dcn_wire_gib": round(self.dcn_wire_bytes / GIB, 4),
            "hbm_traffic_gib": round(self.hbm_bytes / GIB, 3),
            "unknown_loops": self.unknown_loops,
        }


def _short(op_name: str) -> str:
    """The op's path without the jit(...) wrapper and stack noise, for sites."""
    return re.sub(r"^jit\([^)]*\)/", "", op_name)[-160:]


def _conv_flops(comp: Computation, inst: Instruction) -> float:
    """2 x the multiply-adds of a convolution that meet real input (padding and dilation holes skipped)."""
    lhs, rhs = (comp.instructions.get(o) for o in inst.operands[:2])
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs)
    if lhs is None or rhs is None or labels is None or not isinstance(inst.shape, Array):
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    ls, rs, os_ = lhs.shape, rhs.shape, inst.shape
    if not (isinstance(ls, Array) and isinstance(rs, Array)):
        return 0.0
    window = re.search(r"window=\{([^}]*)\}", inst.attrs)
    fields = dict(re.findall(r"(\w+)=([\w_\-]+)", window.group(1))) if window else {}

    def per_dim(key: str) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else []

    spatial = sorted(c for c in lhs_l if c.isdigit())
    sizes, strides = per_dim("size"), per_dim("stride")
    pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else []
    lhs_dil, rhs_dil = per_dim("lhs_dilate"), per_dim("rhs_dilate")
    macs = os_.dims[out_l.index("b")] * os_.dims[out_l.index("f")] * rs.dims[rhs_l.index("i")]
    for k, d in enumerate(spatial):
        n_in, n_out = ls.dims[lhs_l.index(d)], os_.dims[out_l.index(d)]
        K = sizes[k] if k < len(sizes) else rs.dims[rhs_l.index(d)]
        s = strides[k] if k < len(strides) else 1
        lo = pads[k][0] if k < len(pads) else 0
        ld = lhs_dil[k] if k < len(lhs_dil) else 1
        rd = rhs_dil[k] if k < len(rhs_dil) else 1
        macs *= _valid_taps(n_in, n_out, K, s, lo, ld, rd)
    return 2.0 * macs


def _valid_taps(n_in: int, n_out: int, window: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """Sum over output positions of the kernel taps that land on a real input element."""
    span = (n_in - 1) * lhs_dil + 1
    total = 0
    for k in range(window):
        offset = k * rhs_dil - pad_lo  # input position of output 0
        if lhs_dil == 1:
            first = max(0, -(offset // stride))  # smallest o with o*stride + offset >= 0
            last = min(n_out - 1, (span - 1 - offset) // stride)
            total += max(0, last - first + 1)
        else:
            total += sum(
                1 for o in range(n_out) if 0 <= o * stride + offset < span and (o * stride + offset) % lhs_dil == 0
            )
    return total


def _dot_flops(comp: Computation, inst: Instruction) -> float:
    lhs = comp.instructions.get(inst.operands[0]) if inst.operands else None
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    if lhs is None or not isinstance(lhs.shape, Array) or not isinstance(inst.shape, Array):
        return 0.0
    contracted = math.prod(lhs.shape.dims[int(i)] for i in m.group(1).split(",") if i) if m else 1
    return 2.0 * math.prod(inst.shape.dims) * contracted


def _is_fp8(comp: Computation, inst: Instruction, operands: list[Array] | None = None) -> bool:
    ops = operands or [
        s
        for o in inst.operands[:2]
        for s in [comp.instructions.get(o)]
        if s is not None
        for s in [s.shape]
        if isinstance(s, Array)
    ]
    return len(ops) >= 2 and all(a.dtype in _FP8 for a in ops[:2])


def _layout_constraints(inst: Instruction) -> list[Array]:
    m = re.search(r"operand_layout_constraints=\{(.*?)\}(?:, [a-z_]+=|$)", inst.attrs)
    return [parse_shape(t.group(0)) for t in _ARRAY.finditer(m.group(1))] if m else []


def kernel_name(inst: Instruction) -> str:
    """The Mosaic kernel's name: the op path's component before `pallas_call`, else the instruction's."""
    parts = inst.op_name.split("/")
    if "pallas_call" in parts and parts.index("pallas_call") > 0:
        return parts[parts.index("pallas_call") - 1]
    return re.sub(r"\.\d+$", "", inst.name)


def kernel_flops(inst: Instruction, operands: list[Array]) -> tuple[str, float]:
    """(family, FLOPs) of one Mosaic kernel call from its operand shapes: ("splash", ...),
    ("grouped_matmul", ...), or ("other", 0)."""
    name = kernel_name(inst)
    floats = [a for a in operands if a.dtype.startswith(("f", "bf"))]
    if "splash" in name or "flash" in name:
        big = [a for a in floats if len(a.dims) >= 3]
        if len(big) < 2:
            return "splash", 0.0
        q, k = big[0], big[1]
        matmuls = next((n for key, n in _SPLASH_MATMULS if key in name), 2)
        *batch, heads, sq, d = q.dims
        skv = k.dims[-2]
        return "splash", matmuls * 2.0 * math.prod(batch) * heads * sq * skv * d / 2  # causal: half the blocks
    if "gmm" in name or "ragged_dot" in name or "megablox" in name:
        mats = [a for a in floats if len(a.dims) >= 2]
        out = next(iter(arrays(inst.shape)), None)
        if len(mats) < 2 or out is None:
            return "grouped_matmul", 0.0
        lhs, rhs = mats[-2], mats[-1]
        if len(out.dims) == 2:  # gmm: out [M, N] = lhs [M, K] x rhs [G, K, N] (or [G, N, K])
            M = out.dims[0]
            return "grouped_matmul", 2.0 * math.prod(out.dims) * math.prod(lhs.dims) / M
        # tgmm: out [G, K, N] from lhs [M, K] and rhs [M, N] (either may come transposed): M is shared
        M = next((x for x in lhs.dims if x in rhs.dims), lhs.dims[0])
        return "grouped_matmul", 2.0 * math.prod(lhs.dims) * math.prod(rhs.dims) / M
    return "other", 0.0


def _collective(comp: Computation, inst: Instruction, costs: Costs, kind: str, windowed: str | None) -> None:
    ops = [comp.instructions[o].shape for o in inst.operands if o in comp.instructions]
    if kind == "ragged-all-to-all":
        size = hbm_or_all(ops[1]) if len(ops) > 1 else 0.0
    else:
        size = sum(hbm_or_all(s) for s in ops)
    groups = replica_groups(inst)
    n = len(groups[0]) if groups else 0
    if inst.opcode.startswith("collective-permute"):
        pairs = re.findall(
            r"\{(\d+),(\d+)\}",
            (re.search(r"source_target_pairs=\{(.*?)\}\}", inst.attrs) or re.search("()", "")).group(1) + "}",
        )
        wire = size if any(a != b for a, b in pairs) else 0.0
    else:
        if kind == "all-gather":
            size *= max(n, 1) if groups else 1
        factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n if n else 1.0
        wire = size * factor
    if windowed:  # a windowed einsum's permutes implement the all-gather / reduce-scatter of a matmul operand
        kind = windowed
    costs.ici_bytes[kind] = costs.ici_bytes.get(kind, 0.0) + size
    costs.ici_wire_bytes += wire
    shape = next(iter(arrays(inst.shape)), None) if not inst.opcode.endswith("start") else None
    what = f"{kind} {shape or ', '.join(str(a) for s in ops for a in arrays(s))}" + (
        " (windowed einsum)" if windowed else ""
    )
    costs.note("ici", what, _short(inst.op_name), size)


def hbm_or_all(shape: Shape) -> float:
    return sum(a.bytes for a in arrays(shape))


def _megascale(inst: Instruction, costs: Costs) -> None:
    kind = _MEGASCALE_KINDS.get(inst.string("_xla_megascale_transfer_type") or "", "collective-permute")
    data = inst.shape[0] if isinstance(inst.shape, tuple) and inst.shape else inst.shape
    size = hbm_or_all(data)
    target = inst.string("_xla_megascale_target") or ""
    first = re.match(r"\{([^}]*)\}", target)
    k = len(first.group(1).split(",")) if first else 2
    factor = 2 * (k - 1) / k if kind == "all-reduce" else (k - 1) / k if kind != "collective-permute" else 1.0
    costs.dcn_bytes[kind] = costs.dcn_bytes.get(kind, 0.0) + size
    costs.dcn_wire_bytes += size * factor
    costs.note("dcn", f"{kind} {', '.join(str(a) for a in arrays(data))}", _short(inst.op_name), size)


_LAYOUT_ONLY = {"bitcast", "copy", "reshape", "transpose"}


def _layout_only(module: Module, inst: Instruction) -> bool:
    """An op that only moves or relabels its one operand: a bitcast, copy, reshape, transpose, or a fusion
    of nothing else (the TPU compiler nests such fusions in others)."""
    if inst.opcode in _LAYOUT_ONLY:
        return True
    fused = module.computations.get(inst.attr("calls") or "") if inst.opcode == "fusion" else None
    return (
        fused is not None
        and len(fused.params) == 1
        and len(inst.operands) == 1
        and all(i.opcode in _LAYOUT_ONLY or i.opcode == "parameter" for i in fused.instructions.values())
    )


def _fusion_traffic(module: Module, comp: Computation, inst: Instruction) -> float:
    """HBM bytes a fusion reads and writes: each operand once (the slices, where the fusion only slices it),
    its result once (the update, where it updates an operand in place)."""
    fused = module.computations.get(inst.attr("calls") or "")
    if fused is None:
        return sum(hbm_bytes(comp.instructions[o].shape) for o in inst.operands if o in comp.instructions) + hbm_bytes(
            inst.shape
        )
    users: dict[str, list[Instruction]] = defaultdict(list)
    for i in fused.instructions.values():
        for o in i.operands:
            users[o].append(i)

    def uses(name: str) -> list[tuple[Instruction, int]]:
        """The ops that read `name` for more than its layout, with the operand index they read it at."""
        found = []
        for user in users.get(name, []):
            if _layout_only(module, user):
                found += uses(user.name)
            else:
                found += [(user, k) for k, o in enumerate(user.operands) if o == name]
        return found

    def through(name: str) -> Instruction | None:
        inst_ = fused.instructions.get(name)
        while inst_ is not None and _layout_only(module, inst_) and inst_.operands:
            inst_ = fused.instructions.get(inst_.operands[0])
        return inst_

    root = fused.instructions.get(fused.root or "")
    roots = (
        [through(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [through(fused.root)]
    )
    written = 0.0
    for r in roots:
        if r is not None and r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
            update = fused.instructions.get(r.operands[1])
            written += hbm_bytes(update.shape) if update is not None else 0.0
        elif r is not None:
            written += hbm_bytes(r.shape)
    if not any(a.space == 0 for a in arrays(inst.shape)):
        written = 0.0
    read = 0.0
    for number, pname in fused.params.items():
        if number >= len(inst.operands) or inst.operands[number] not in comp.instructions:
            continue
        outer = comp.instructions[inst.operands[number]].shape
        if hbm_bytes(outer) == 0:
            continue  # not in HBM (VMEM, SMEM, a sync flag)
        reads = uses(pname)
        sliced = [u for u, k in reads if u.opcode in ("dynamic-slice", "slice", "gather") and k == 0]
        in_place = [u for u, k in reads if u.opcode == "dynamic-update-slice" and k == 0]
        if reads and len(sliced) + len(in_place) == len(reads):
            read += sum(hbm_bytes(u.shape) for u in sliced)  # the slices; an in-place buffer is not read
        else:
            read += hbm_bytes(outer)
    return read + written


class Walker:
    """Walks a module from its entry, each computation's cost computed once and scaled where it is used."""

    def __init__(self, module: Module):
        self.module = module
        self.memo: dict[tuple[str, bool, str | None], Costs] = {}

    def costs(self) -> Costs:
        return self.computation(self.module.entry, fused=False)

    def computation(self, name: str, fused: bool, windowed: str | None = None) -> Costs:
        key = (name, fused, windowed)
        if key not in self.memo:
            self.memo[key] = Costs()  # a placeholder against recursion
            self.memo[key] = self._walk(self.module.computations[name], fused, windowed)
        return self.memo[key]

    def _walk(self, comp: Computation, fused: bool, windowed: str | None) -> Costs:
        costs = Costs()
        for inst in comp.instructions.values():
            op = inst.opcode
            if op == "while":
                trips = trip_count(self.module, comp, inst)
                body = inst.attr("body") or ""
                if trips is None:
                    costs.unknown_loops.append(f"{inst.name} ({_short(inst.op_name)})")
                m = re.search(r"windowed_dot_general_body_(ag|rs)", body)
                inner = {"ag": "all-gather", "rs": "reduce-scatter"}[m.group(1)] if m else windowed
                costs.add(self.computation(body, False, inner), trips if trips is not None else 1)
                continue
            if op == "conditional":
                branches = inst.called("branch_computations") or [
                    b for b in (inst.attr("true_computation"), inst.attr("false_computation")) if b
                ]
                walked = [self.computation(b, False, windowed) for b in branches]
                if walked:
                    costs.add(max(walked, key=lambda c: (c.flops, c.hbm_bytes)), 1)
                continue
            if op in ("call", "async-start") and inst.attr("calls"):
                costs.add(self.computation(inst.attr("calls"), fused, windowed), 1)
                continue
            if op == "fusion" and inst.attr("calls"):
                costs.add(self.computation(inst.attr("calls"), True, windowed), 1)
            if op == "custom-call" and inst.called("called_computations"):
                for called in inst.called("called_computations"):
                    costs.add(self.computation(called, True, windowed), 1)
            self._op(comp, inst, costs, fused, windowed)
        return costs

    def _op(self, comp: Computation, inst: Instruction, costs: Costs, fused: bool, windowed: str | None) -> None:
        op = inst.opcode
        if op in ("convolution", "dot"):
            flops = _conv_flops(comp, inst) if op == "convolution" else _dot_flops(comp, inst)
            costs.matmul_flops += flops
            if _is_fp8(comp, inst):
                costs.fp8_matmul_flops += flops
            operands = " x ".join(str(comp.instructions[o].shape) for o in inst.operands[:2] if o in comp.instructions)
            costs.note("flops", f"{op} {operands} -> {inst.shape}", _short(inst.op_name), flops)
        elif op == "custom-call" and inst.string("custom_call_target") == "tpu_custom_call":
            operands = _layout_constraints(inst) or [
                a for o in inst.operands if o in comp.instructions for a in arrays(comp.instructions[o].shape)
            ]
            family, flops = kernel_flops(inst, operands)
            name = kernel_name(inst)
            costs.kernel_calls[name] = costs.kernel_calls.get(name, 0.0) + 1
            if family != "other":
                costs.kernel_flops[family] = costs.kernel_flops.get(family, 0.0) + flops
                if _is_fp8(comp, inst, [a for a in operands if len(a.dims) >= 2][-2:]):
                    costs.fp8_kernel_flops += flops
            costs.note(
                "kernel",
                f"{name} {', '.join(str(a) for a in operands if len(a.dims) >= 2)}",
                _short(inst.op_name),
                flops,
            )
        elif op in _COLLECTIVES:
            _collective(comp, inst, costs, _COLLECTIVES[op], windowed if op.startswith("collective-permute") else None)
        elif op == "send" and inst.string("_xla_megascale_transfer_type"):
            _megascale(inst, costs)
        if fused or op in _NO_TRAFFIC or op.endswith("-done") and op != "copy-done":
            return
        if op == "fusion":
            traffic = _fusion_traffic(self.module, comp, inst)
        elif op.endswith("-start"):
            traffic = sum(hbm_bytes(comp.instructions[o].shape) for o in inst.operands if o in comp.instructions)
        elif op == "copy-done":
            traffic = hbm_bytes(inst.shape)
        elif op == "dynamic-slice":
            traffic = 2 * hbm_bytes(inst.shape)
        elif op == "dynamic-update-slice" and len(inst.operands) > 1 and inst.operands[1] in comp.instructions:
            traffic = 2 * hbm_bytes(comp.instructions[inst.operands[1]].shape)
        else:
            traffic = sum(
                hbm_bytes(comp.instructions[o].shape) for o in inst.operands if o in comp.instructions
            ) + hbm_bytes(inst.shape)
        costs.hbm_bytes += traffic
        if traffic:
            costs.note(
                "hbm", f"{op} {inst.shape if isinstance(inst.shape, Array) else 'tuple'}", _short(inst.op_name), traffic
            )


def module_costs(text: str) -> Costs:
    """The per-device, per-step costs of an optimized HLO module's text."""
    return Walker(parse_module(text)).costs()


def step_module(dump_dir: str, pattern: str = "*train_step*") -> str | None:
    """The optimized module of the step in an XLA dump directory (the largest, should several match)."""
    files = [f for f in glob.glob(os.path.join(dump_dir, f"{pattern}.after_optimizations.txt"))]
    return max(files, key=os.path.getsize) if files else None


def dump_costs(dump_dir: str, pattern: str = "*train_step*") -> Costs | None:
    path = step_module(dump_dir, pattern)
    if path is None:
        return None
    with open(path) as f:
        return module_costs(f.read())


# --- the CLI ---------------------------------------------------------------------------------------


def table(costs: Costs, top: int = 8) -> list[str]:
    """The costs as `python -m tpu_workload.performance.hlo_costs` prints them."""
    out = [
        f"matmul FLOPs per device per step: {costs.flops / 1e12:,.2f} TFLOP "
        f"(XLA dots/convolutions {costs.matmul_flops / 1e12:,.2f}"
        + "".join(f", {k} kernels {v / 1e12:,.2f}" for k, v in sorted(costs.kernel_flops.items()))
        + (f"; fp8 {costs.fp8_flops / 1e12:,.2f}" if costs.fp8_flops else "")
        + ")",
        f"kernel calls per step: {int(sum(costs.kernel_calls.values()))}"
        + "".join(f", {k} {int(v)}" for k, v in sorted(costs.kernel_calls.items())),
        "collective bytes per device per step (GiB):",
        f"  {'kind':20} {'ICI':>10} {'DCN':>10}",
    ]
    for kind in KINDS:
        if kind in costs.ici_bytes or kind in costs.dcn_bytes:
            out.append(
                f"  {kind:20} {costs.ici_bytes.get(kind, 0) / GIB:10.3f} {costs.dcn_bytes.get(kind, 0) / GIB:10.3f}"
            )
    out.append(
        f"  {'total':20} {sum(costs.ici_bytes.values()) / GIB:10.3f} {sum(costs.dcn_bytes.values()) / GIB:10.3f}"
        f"   (sent per device: ICI {costs.ici_wire_bytes / GIB:.3f}, DCN {costs.dcn_wire_bytes / GIB:.3f})"
    )
    out.append(f"HBM traffic per device per step (estimate): {costs.hbm_bytes / GIB:,.2f} GiB")
    if costs.unknown_loops:
        out.append(f"loops of unknown trip count, counted once: {', '.join(costs.unknown_loops)}")
    for category, title, unit, scale in (
        ("ici", "largest collectives", "GiB", GIB),
        ("dcn", "DCN transfers", "GiB", GIB),
        ("flops", "largest matmuls", "TFLOP", 1e12),
        ("kernel", "kernels", "TFLOP", 1e12),
    ):
        sites = costs.top(category, top)
        if sites and top:
            out.append(f"{title} (per step: times run, total {unit}):")
            out += [f"  {s.count:8.0f} x {s.what[:90]:90} {s.value / scale:10.3f}  {s.op_name[-70:]}" for s in sites]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tpu_workload.performance.hlo_costs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("module", help="an optimized HLO module's text, or an XLA dump directory (its train step)")
    parser.add_argument("--top", type=int, default=8, help="list the N costliest ops of each kind (default 8)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    path = step_module(args.module) if os.path.isdir(args.module) else args.module
    if path is None:
        parser.error(f"no *train_step*.after_optimizations.txt in {args.module}")
    with open(path) as f:
        costs = module_costs(f.read())
    print(json.dumps(costs.summary()) if args.json else "\n".join([path, *table(costs, args.top)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
