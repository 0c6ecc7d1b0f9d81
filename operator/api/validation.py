"""Read user files and parse their documents into validated jobs, collecting every problem with its
field path."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from . import rules
from .models import ObjectMeta, TPUCapacity, TPUSpec, TPUTrainingJob, TPUTrainingJobSpec
from .problems import problems


class InvalidJob(ValueError):
    """A job that cannot run as written; `problems` are 'field.path: reason' lines."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def read_text(path: str) -> str:
    """The text of `path` (`-` is stdin); anything unreadable or not UTF-8 text is an InvalidJob
    naming the file, so every command reports it the same way."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except OSError as exc:
        raise InvalidJob([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise InvalidJob([f"{path}: not a text file: byte {exc.start} is not UTF-8; expected job YAML"]) from None


def parse_job(doc: Any) -> TPUTrainingJob:
    if not isinstance(doc, dict):
        raise InvalidJob([f"(root): expected a TPUTrainingJob mapping, got {type(doc).__name__}"])
    try:
        # Strict, as the API server is: true is not 1, "8" is not 8, 1.0 is not 1.
        return TPUTrainingJob.model_validate(doc, strict=True)
    except ValidationError as exc:
        raise InvalidJob(problems(exc) + _unreached_rules(doc, exc)) from None


def _unreached_rules(doc: dict[str, Any], exc: ValidationError) -> list[str]:
    """Cross-field problems among the sections that did validate, when a field elsewhere in the spec
    failed and so kept the spec's own validator (and the job's) from running them."""
    spec = doc.get("spec")
    if not isinstance(spec, dict) or not any(len(e["loc"]) > 1 and e["loc"][0] == "spec" for e in exc.errors()):
        return []  # no spec to read, or every spec field validated and the validators ran
    parts = {name: _section(spec, name) for name in rules.Sections.__dataclass_fields__
             if name not in ("slices", "capacity", "queueing")}
    sections = rules.Sections(**parts, slices=_slices(spec), capacity=_capacity(spec), queueing=_queueing(spec))
    found = [(f"spec.{path}", reason) for path, reason in rules.spec_problems(sections)]
    name = _valid(ObjectMeta, doc.get("metadata"))
    if name is not None and sections.tpu is not None:
        found += [p for p in [rules.hostname_problem(name.name, sections.tpu)] if p]
    return [f"{path}: {reason}" for path, reason in found]


def _section(spec: dict[str, Any], name: str) -> Any:
    field = TPUTrainingJobSpec.model_fields[name]
    raw = spec.get(field.alias or name)
    if raw is None and field.default_factory is not None:
        raw = {}
    section = _valid(field.annotation, raw)
    return section.dims() if name == "model" and section is not None else section


def _slices(spec: dict[str, Any]) -> int | None:
    """spec.tpu.slices when it is valid, whether or not the rest of spec.tpu is."""
    tpu = spec.get("tpu")
    field = TPUSpec.model_fields["slices"]
    raw = tpu.get("slices", field.default) if isinstance(tpu, dict) else None
    try:
        return TypeAdapter(Annotated[(int, *field.metadata)]).validate_python(raw)
    except ValidationError:
        return None


def _capacity(spec: dict[str, Any]) -> TPUCapacity | None:
    """The capacity fields of spec.tpu when they are valid, whether or not the rest of spec.tpu is."""
    tpu = spec.get("tpu")
    if not isinstance(tpu, dict):
        return None
    fields = {f.alias or name for name, f in TPUCapacity.model_fields.items()}
    return _valid(TPUCapacity, {k: v for k, v in tpu.items() if k in fields})


def _queueing(spec: dict[str, Any]) -> rules.Queueing | None:
    """spec.queueName and spec.workloadPriorityClassName, when both are valid."""
    values = {}
    for name in ("queue_name", "workload_priority_class_name"):
        field = TPUTrainingJobSpec.model_fields[name]
        try:
            values[name] = TypeAdapter(Annotated[(field.annotation, *field.metadata)]).validate_python(
                spec.get(field.alias or name))
        except ValidationError:
            return None
    return rules.Queueing(**values)


def _valid(model: type[BaseModel], raw: Any) -> Any:
    try:
        return model.model_validate(raw) if raw is not None else None
    except ValidationError:
        return None


def read_documents(text: str) -> list[Any]:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidJob([f"(yaml): {exc}".replace("\n", " ")]) from None
    if not docs:
        raise InvalidJob(["(yaml): no document found"])
    return docs
