"""safetensors files read by byte range and written whole, with numpy and fsspec only (no torch).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (`{name: {dtype, shape,
data_offsets: [begin, end]}}`, offsets relative to the end of the header) and the tensors' bytes in C
order. So the bytes of any rectangular slice of a tensor are known without reading the rest: `read`
computes the contiguous runs of a slice (the trailing axes it takes whole, times its range of the last
axis it cuts), optionally joins runs whose gap is under `gap` bytes into one read, and fetches them with
fsspec (`cat_ranges`: concurrent for gs://, positioned reads for a local path). The trainer reads blocks
of whole rows (hf_weights.load_sharded): one run per tensor.

Every file is the user's: the header is capped at MAX_HEADER_BYTES and each entry is checked (a known
dtype, a shape of at most MAX_RANK non-negative sizes, offsets inside the file that span exactly the
shape's bytes) before any offset is used. A sharded checkpoint's index (`model.safetensors.index.json`)
may name only plain `.safetensors` file names beside it, never a path elsewhere.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import fsspec
import ml_dtypes
import numpy as np

MAX_HEADER_BYTES = 16 << 20  # Llama 3 70B's largest shard header is ~100 KiB
MAX_INDEX_BYTES = 16 << 20
MAX_RANK = 8
DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
NAMES = {v: k for k, v in DTYPES.items()}
SHARD_BYTES = 5 << 30  # export: the Hub's default shard size (transformers' max_shard_size "5GB")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class BadFile(ValueError):
    """A checkpoint file that is not what it claims; the message names the file or tensor and why."""


@dataclass(frozen=True)
class Tensor:
    name: str
    path: str  # the file's URL or path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of element 0 in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Reads:
    """Bytes and requests made (tests count them: a process reads only what its devices hold)."""

    bytes: int = 0
    requests: int = 0
    ranges: list = field(default_factory=list)  # (path, start, end) of every range fetched


def _fs(path: str):
    return fsspec.core.url_to_fs(path)[0]


def _join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name


def read_small(path: str, limit: int) -> bytes:
    """A whole small file (config.json, an index), refused past `limit` bytes."""
    fs = _fs(path)
    size = fs.size(path)
    if size > limit:
        raise BadFile(f"{path}: {size} bytes, more than the {limit} allowed")
    return fs.cat_file(path)


def header(path: str) -> dict[str, Tensor]:
    """The tensors of one safetensors file, checked against the file's size."""
    fs = _fs(path)
    size = fs.size(path)
    if size < 8:
        raise BadFile(f"{path}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", fs.cat_file(path, 0, 8))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise BadFile(f"{path}: header of {n} bytes (at most {MAX_HEADER_BYTES}, and within the file's {size})")
    try:
        entries = json.loads(fs.cat_file(path, 8, 8 + n))
    except ValueError as exc:
        raise BadFile(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(entries, dict):
        raise BadFile(f"{path}: header is not a JSON object")
    data = 8 + n
    out = {}
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, e, data, size)
    return out


def _entry(path: str, name: str, e, data: int, size: int) -> Tensor:
    if not isinstance(e, dict) or e.get("dtype") not in DTYPES:
        dtype = e.get("dtype") if isinstance(e, dict) else e
        raise BadFile(f"{name} in {path}: dtype {dtype!r}; only {sorted(DTYPES)} are read")
    shape, offsets = e.get("shape"), e.get("data_offsets")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise BadFile(f"{name} in {path}: shape {shape!r} is not a list of at most {MAX_RANK} sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise BadFile(f"{name} in {path}: data_offsets {offsets!r} is not [begin, end]")
    dtype = DTYPES[e["dtype"]]
    begin, end = offsets
    if not (0 <= begin <= end and data + end <= size) or end - begin != math.prod(shape) * dtype.itemsize:
        raise BadFile(f"{name} in {path}: data_offsets {offsets} do not hold a {e['dtype']} {shape} inside the file")
    return Tensor(name, path, dtype, tuple(shape), data + begin)


def catalogue(directory: str) -> dict[str, Tensor]:
    """Every tensor of a model directory: the files its index names, or its one model.safetensors."""
    fs = _fs(directory)
    index_path = _join(directory, INDEX)
    if fs.exists(index_path):
        try:
            weight_map = json.loads(read_small(index_path, MAX_INDEX_BYTES)).get("weight_map")
        except (ValueError, AttributeError) as exc:
            raise BadFile(f"{index_path}: not an index with a weight_map ({exc})") from exc
        if not isinstance(weight_map, dict):
            raise BadFile(f"{index_path}: weight_map is not an object")
        files = sorted(set(weight_map.values()))
        for f in files:
            if not isinstance(f, str) or "/" in f or "\\" in f or f.startswith(".") or not f.endswith(".safetensors"):
                raise BadFile(f"{index_path}: {f!r} is not a .safetensors file name beside the index")
    elif fs.exists(_join(directory, SINGLE)):
        files = [SINGLE]
    else:
        raise BadFile(f"{directory}: neither {INDEX} nor {SINGLE}")
    out: dict[str, Tensor] = {}
    for f in files:
        for name, t in header(_join(directory, f)).items():
            if name in out:
                raise BadFile(f"{name}: in both {out[name].path} and {t.path}")
            out[name] = t
    return out


def runs(shape: tuple[int, ...], index: tuple[slice, ...], itemsize: int) -> tuple[np.ndarray, int]:
    """(byte offsets of the contiguous runs of `index` in a C-order array of `shape`, bytes per run).
    Steps other than 1 are not slices a sharding makes."""
    bounds = [s.indices(n) for s, n in zip(index, shape)]
    if any(step != 1 for _, _, step in bounds):
        raise ValueError(f"strided slice {index}")
    k = len(shape)  # axes k.. are taken whole
    while k > 0 and bounds[k - 1][:2] == (0, shape[k - 1]):
        k -= 1
    strides = [math.prod(shape[i + 1 :]) * itemsize for i in range(len(shape))]
    if k == 0:
        return np.zeros(1, np.int64), math.prod(shape) * itemsize
    run = (bounds[k - 1][1] - bounds[k - 1][0]) * strides[k - 1]
    offsets = np.array([bounds[k - 1][0] * strides[k - 1]], np.int64)
    for i in range(k - 2, -1, -1):  # the outer axes' offsets, outermost last
        lo, hi, _ = bounds[i]
        offsets = (np.arange(lo, hi, dtype=np.int64)[:, None] * strides[i] + offsets[None, :]).reshape(-1)
    return offsets, run


def read(t: Tensor, index: tuple[slice, ...], reads: Reads | None = None, gap: int = 0) -> np.ndarray:
    """The slice `index` of tensor `t` (its own dtype), reading only the runs it covers (runs less than
    `gap` bytes apart joined into one request: more bytes, fewer requests)."""
    if len(index) != len(t.shape):
        raise ValueError(f"{t.name}: index {index} for shape {t.shape}")
    out_shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, t.shape))
    if math.prod(out_shape) == 0:
        return np.zeros(out_shape, t.dtype)
    offsets, run = runs(t.shape, index, t.dtype.itemsize)
    starts, ends = _joined(offsets, run, gap)
    fs = _fs(t.path)
    chunks = fs.cat_ranges([t.path] * len(starts), [t.start + s for s in starts], [t.start + e for e in ends])
    if reads is not None:
        reads.bytes += sum(len(c) for c in chunks)
        reads.requests += len(chunks)
        reads.ranges += [(t.path, t.start + s, t.start + e) for s, e in zip(starts, ends)]
    for s, e, chunk in zip(starts, ends, chunks):
        if len(chunk) != e - s:
            raise BadFile(f"{t.name} in {t.path}: short read ({len(chunk)} of {e - s} bytes)")
    buf, c = bytearray(len(offsets) * run), 0
    for i, o in enumerate(offsets.tolist()):  # ascending, as the ranges are
        while o >= ends[c]:
            c += 1
        buf[i * run : (i + 1) * run] = chunks[c][o - starts[c] : o - starts[c] + run]
    return np.frombuffer(bytes(buf), t.dtype).reshape(out_shape)


def _joined(offsets: np.ndarray, run: int, gap: int) -> tuple[list[int], list[int]]:
    """Ranges covering every run, neighbours under `gap` bytes apart joined."""
    starts, ends = [int(offsets[0])], [int(offsets[0]) + run]
    for o in offsets[1:]:
        o = int(o)
        if o - ends[-1] <= gap:
            ends[-1] = o + run
        else:
            starts.append(o)
            ends.append(o + run)
    return starts, ends


def write(directory: str, tensors: Iterable[tuple[str, np.ndarray]], shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write (name, array) pairs as safetensors shards of at most `shard_bytes` (one tensor may exceed it,
    alone in its shard) plus the index transformers reads, one shard in memory at a time. The file names
    are the Hub's `model-0000i-of-0000n.safetensors`, renamed once n is known."""
    fs = _fs(directory)
    fs.makedirs(directory, exist_ok=True)
    shards: list[list[str]] = []
    weight_map: dict[str, int] = {}
    pending: list[tuple[str, np.ndarray]] = []
    total = 0

    def flush() -> None:
        if pending:
            _write_file(fs, _join(directory, f"part-{len(shards):05d}.tmp"), pending)
            shards.append([n for n, _ in pending])
            pending.clear()

    for name, a in tensors:
        if a.dtype not in NAMES:
            raise ValueError(f"{name}: dtype {a.dtype} cannot be written")
        if pending and sum(p.nbytes for _, p in pending) + a.nbytes > shard_bytes:
            flush()
        pending.append((name, a))
        weight_map[name] = len(shards)
        total += a.nbytes
    flush()
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, final in enumerate(names):
        fs.mv(_join(directory, f"part-{i:05d}.tmp"), _join(directory, final))
    index = {"metadata": {"total_size": total}, "weight_map": {n: names[i] for n, i in sorted(weight_map.items())}}
    with fs.open(_join(directory, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return names


def _write_file(fs, path: str, tensors: list[tuple[str, np.ndarray]]) -> None:
    entries, offset = {}, 0
    for name, a in tensors:
        entries[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    # transformers loads only files whose metadata says "pt"; the header is padded to 8 bytes as the
    # safetensors library pads it.
    head = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with fs.open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a).tobytes())
