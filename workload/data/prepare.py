"""`tpujob data prepare`: text files tokenized once into ArrayRecord files, for corpora too large to
tokenize at every start.

The records are those `format: arrayrecord` reads (records.py): one per document, in the order the
text formats read them (each input's files sorted, inputs in the order given), each the tokens that
on-the-fly tokenization gives the document (text.py, tokenizer.py: its encoding, then the EOS), in the
dtype `model.vocab` picks. So a job reading them packs the same rows, batch for batch, as a job
reading the text with the same tokenizer and settings (tests/workload/test_text_data.py).

Output goes to `--out` (a local directory, created; it must hold no ArrayRecord files yet) as
data-00000.array_record, data-00001... of at most `records_per_file` documents each. Progress goes to
stderr: a line rewritten in place on a terminal, else a plain line every PLAIN_EVERY_S seconds.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from . import records, text
from .tokenizer import Tokenizer

PLAIN_EVERY_S = 10.0
TTY_EVERY_S = 0.2


class ProgressBar:
    """Documents and tokens written so far, on `stream`."""

    def __init__(self, total: int, stream: TextIO = sys.stderr):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self.docs = self.tokens = 0

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        share = self.docs / self.total if self.total else 1.0
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        width = 30
        bar = "#" * int(share * width) + "." * (width - int(share * width))
        return (
            f"[{bar}] {100 * share:5.1f}% {self.docs}/{self.total} documents, "
            f"{self.tokens} tokens, {rate:,.0f} tokens/s, {elapsed:.0f}s"
        )

    def update(self, docs: int, tokens: int) -> None:
        self.docs, self.tokens = self.docs + docs, self.tokens + tokens
        now = time.perf_counter()
        if now - self.last >= (TTY_EVERY_S if self.tty else PLAIN_EVERY_S):
            self.last = now
            self.stream.write(("\r" + self.line()) if self.tty else self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self.line() + "\n")
        self.stream.flush()


def prepare(
    inputs: Sequence[str],
    fmt: str,
    tokenizer: str,
    out: str,
    vocab: int,
    *,
    eos_id: int | None = None,
    text_field: str = "text",
    records_per_file: int = 1 << 20,
    stream: TextIO = sys.stderr,
) -> tuple[int, int]:
    """Write the documents of `inputs` as ArrayRecord files under `out`; (documents, tokens) written."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if "://" in out:
        raise ValueError(f"--out: {out} is a URL; write to a local directory, then copy it (gcloud storage cp -r)")
    encoder = Tokenizer(tokenizer, eos_id)
    encoder.check_fits(vocab)
    dtype = records.token_dtype(vocab)
    sources = [text.documents(path, fmt, text_field) for path in inputs]
    os.makedirs(out, exist_ok=True)
    if glob.glob(os.path.join(glob.escape(out), "*.array_record*")):
        raise ValueError(f"--out: {out} already holds ArrayRecord files; name an empty directory")
    progress = ProgressBar(sum(len(s) for s in sources), stream)
    writer, written, shard = None, 0, 0
    try:
        for docs in sources:
            for tokens in text.encoded(docs, encoder, every_s=float("inf")):
                if writer is None or (written and written % records_per_file == 0):
                    if writer is not None:
                        writer.close()
                    writer = ArrayRecordWriter(os.path.join(out, f"data-{shard:05d}.array_record"), "group_size:1")
                    shard += 1
                writer.write(records.encode(tokens, dtype))
                written += 1
                progress.update(1, len(tokens))
    finally:
        if writer is not None:
            writer.close()
    progress.close()
    return progress.docs, progress.tokens


def main(argv: Sequence[str] | None = None) -> int:
    """`tpujob data prepare` (operator/cli.py parses and passes its flags on; exit 2 for bad settings or
    inputs, the error naming which)."""
    import argparse

    from ..process.exits import UserError

    p = argparse.ArgumentParser(prog="tpujob data prepare")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--format", required=True, choices=("jsonl", "parquet", "text"))
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", required=True, type=int)
    p.add_argument("--eos-id", type=int)
    p.add_argument("--text-field", default="text")
    p.add_argument("--records-per-file", type=int, default=1 << 20)
    args = p.parse_args(argv)
    try:
        docs, tokens = prepare(
            args.inputs,
            args.format,
            args.tokenizer,
            args.out,
            args.vocab,
            eos_id=args.eos_id,
            text_field=args.text_field,
            records_per_file=args.records_per_file,
        )
    except (ValueError, OSError, UserError) as exc:  # bad settings or inputs: the error names which
        print(f"error: {str(exc)[:1000]}", file=sys.stderr)
        return 2
    print(f"wrote {docs} documents, {tokens} tokens to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
