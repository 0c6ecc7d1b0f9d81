"""What decides the data order, recorded with every checkpoint and checked on resume.

A batch is a pure function of (seed, step) and the data settings, so a resume reads exactly what
the interrupted run would have read only if those settings are the same. Changed between runs
(`globalBatch` raised, files added), the resumed run silently reads other data: some sequences
twice, some never. So every checkpoint records the fingerprint below, and a resume whose
fingerprint differs is refused with the fields that changed, unless `data.allowChange` says the
change is meant. Microbatches, workers and prefetch change how a batch is read, not which rows it
holds: they are not part of it.

Keys are paths under spec.training, so the refusal names the field to look at.
"""

from __future__ import annotations

from tpu_operator.api.contract import TrainingSpec

from . import files as files_lib

# DataSpec fields that change how the data is read, not what a step reads.
NOT_ORDER = ("allowChange", "workers", "prefetch")


def of(
    training: TrainingSpec, files: list[tuple[str, int]] | None = None, tokenizer: tuple[str, int] | None = None
) -> dict:
    """The fingerprint of `training`'s data order; `files`: (name, bytes) of every file read, in order;
    `tokenizer`: (name, bytes) of the tokenizer file of text data (another tokenizer, other tokens)."""
    data = training.data.model_dump(by_alias=True, mode="json")
    fp = {
        "seed": training.seed,
        "globalBatch": training.global_batch,
        "sequenceLength": training.sequence_length,
        **{f"data.{k}": v for k, v in data.items() if k not in NOT_ORDER},
    }
    if files is not None:
        fp["data.files"] = [[name, size] for name, size in files]
    if tokenizer is not None:
        fp["data.tokenizerFile"] = list(tokenizer)
    return fp


def listed_files(path: str, fmt: str) -> list[tuple[str, int]]:
    """(path, bytes) of the files the source reads (files.py), in the order it reads them."""
    return list(files_lib.matching(path, fmt)[2].items())


def tokenizer_file(path: str) -> tuple[str, int]:
    """(path, bytes) of the tokenizer file `path` names (tokenizer.resolve)."""
    import fsspec

    from .tokenizer import resolve

    name = resolve(path)
    fs, root = fsspec.core.url_to_fs(name)
    return name, int(fs.size(root))


def changes(saved: dict, now: dict) -> list[str]:
    """One line per field that differs, e.g. "globalBatch: 16 at the checkpoint, 32 now"."""
    lines = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if a == b:
            continue
        if key == "data.files" and isinstance(a, list) and isinstance(b, list):
            lines.append(f"data.files: {_files_change(a, b)}")
        else:
            lines.append(f"{key}: {a!r} at the checkpoint, {b!r} now")
    return lines


def _files_change(a: list, b: list) -> str:
    old, new = {n: s for n, s in a}, {n: s for n, s in b}
    parts = []
    if added := [n for n in new if n not in old]:
        parts.append(f"{len(added)} added ({added[0]}{', ...' if len(added) > 1 else ''})")
    if removed := [n for n in old if n not in new]:
        parts.append(f"{len(removed)} removed ({removed[0]}{', ...' if len(removed) > 1 else ''})")
    if resized := [n for n in new if n in old and old[n] != new[n]]:
        parts.append(f"{len(resized)} changed size ({resized[0]}{', ...' if len(resized) > 1 else ''})")
    return ", ".join(parts) or "the same files in another order"
