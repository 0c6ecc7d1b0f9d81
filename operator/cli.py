"""`tpujob`: render, validate and print the CRD; run the operator; run a job locally."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import crd
from .models import TPUTrainingJob
from .plan import Plan
from .render import render, to_yaml_stream
from .validation import InvalidJob, parse_job, read_documents

EXIT_INVALID = 2


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise InvalidJob([f"(file): cannot read {path}: {exc.strerror}"]) from None


def load_jobs(path: str) -> list[TPUTrainingJob]:
    """Every job in the file, or InvalidJob listing every problem of every document."""
    docs = read_documents(_read(path))
    jobs, errors = [], []
    for i, doc in enumerate(docs):
        try:
            jobs.append(parse_job(doc))
        except InvalidJob as exc:
            prefix = f"document {i + 1}: " if len(docs) > 1 else ""
            errors += [prefix + p for p in exc.problems]
    if errors:
        raise InvalidJob(errors)
    return jobs


def cmd_render(args: argparse.Namespace) -> int:
    manifests = [m for job in load_jobs(args.file) for m in render(job)]
    sys.stdout.write(to_yaml_stream(manifests))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    for job in load_jobs(args.file):
        print("\n".join(Plan(job).summary()))
        if args.project or args.zone:
            from .capacity import check_capacity

            print(check_capacity(job, args.project, args.zone))
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    sys.stdout.write(crd.to_yaml())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpujob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="print the manifests of a job as a YAML stream")
    p.add_argument("-f", "--file", required=True, help="job YAML, or - for stdin")
    p.set_defaults(func=cmd_render)
    p = sub.add_parser("validate", help="check a job and print its derived plan")
    p.add_argument("-f", "--file", required=True, help="job YAML, or - for stdin")
    p.add_argument("--project", help="Google Cloud project for the capacity look-up (optional, online)")
    p.add_argument("--zone", help="zone for the capacity look-up, e.g. us-central1-c")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("crd", help="print the TPUTrainingJob CRD generated from the models")
    p.set_defaults(func=cmd_crd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidJob as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
