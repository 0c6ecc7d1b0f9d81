"""Read user files and parse their documents into validated jobs, collecting every problem with its
field path."""

from __future__ import annotations

import sys
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from . import rules
from .models import ObjectMeta, TPUTrainingJob, TPUTrainingJobSpec
from .problems import problems, shown
from .spec import ModelSpec, TPUCapacity, TPUSpec


class InvalidJob(ValueError):
    """A job that cannot run as written; `problems` are 'field.path: reason' lines."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


# What one input file may hold. A job's spec is at most limits.MAX_SPEC_BYTES as JSON; a file of a few jobs
# in YAML fits well within this, and reading stops here whatever the file is (a device, a huge log).
MAX_FILE_BYTES = 4 * 1024 * 1024
# What YAML may expand to: values counted as often as aliases repeat them (a 710-byte alias bomb is
# 10**8 of them), and nesting (PyYAML composes recursively; a job nests about 6 levels deep).
MAX_VALUES = 100_000
MAX_DEPTH = 64
# Python refuses to turn more digits than this into an int (sys.int_info.str_digits_check_threshold);
# any integer past 19 digits is beyond int64 and refused by its field's bound anyway.
MAX_INT_DIGITS = 4000


def read_text(path: str) -> str:
    """The text of `path` (`-` is stdin); anything unreadable, larger than MAX_FILE_BYTES or not UTF-8 text
    is an InvalidJob naming the file, so every command reports it the same way."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise InvalidJob([f"{shown(path)}: more than {MAX_FILE_BYTES} bytes; a job file is a few kilobytes"])
        return data.decode("utf-8")
    except OSError as exc:
        raise InvalidJob([f"{shown(path)}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise InvalidJob(
            [f"{shown(path)}: not a text file: byte {exc.start} is not UTF-8; expected job YAML"]
        ) from None


def parse_job(doc: Any, *, needs_image: bool = False, default_image: str | None = None) -> TPUTrainingJob:
    """The job `doc` describes, or InvalidJob listing every problem. `needs_image`: the job is about to become
    pods (the operator, `tpujob render`), so it must name an image or `default_image` must give it one."""
    if not isinstance(doc, dict):
        raise InvalidJob([f"(root): expected a TPUTrainingJob mapping, got {type(doc).__name__}"])
    try:
        # Strict, as the API server is: true is not 1, "8" is not 8, 1.0 is not 1.
        job = TPUTrainingJob.model_validate(doc, strict=True)
    except ValidationError as exc:
        raise InvalidJob(problems(exc) + _unreached_rules(doc, exc)) from None
    problem = image_problem(job, default_image) if needs_image else None
    if problem:
        raise InvalidJob([problem])
    return job


def image_problem(job: TPUTrainingJob, default_image: str | None) -> str | None:
    """Why the job's pods would have no image: it names none and there is no default to give it."""
    if job.spec.image or default_image:
        return None
    return (
        "spec.image: not set, and the operator has no --default-image (the chart's operator.defaultImage): "
        "name the trainer image you built and pushed (docs/operations.md, Images)"
    )


def _unreached_rules(doc: dict[str, Any], exc: ValidationError) -> list[str]:
    """Cross-field problems among the sections that did validate, when a field elsewhere in the spec
    failed and so kept the spec's own validator (and the job's) from running them."""
    spec = doc.get("spec")
    if not isinstance(spec, dict) or not any(len(e["loc"]) > 1 and e["loc"][0] == "spec" for e in exc.errors()):
        return []  # no spec to read, or every spec field validated and the validators ran
    parts = {
        name: _section(spec, name)
        for name in rules.Sections.__dataclass_fields__
        if name not in ("slices", "capacity", "queueing")
    }
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
    model = field.annotation  # each section's field is typed by its model class (rules.Sections)
    assert isinstance(model, type) and issubclass(model, BaseModel), (name, model)
    section = _valid(model, raw)
    return section.dims() if isinstance(section, ModelSpec) else section


def _slices(spec: dict[str, Any]) -> int | None:
    """spec.tpu.slices when it is valid, whether or not the rest of spec.tpu is."""
    tpu = spec.get("tpu")
    field = TPUSpec.model_fields["slices"]
    raw = tpu.get("slices", field.default) if isinstance(tpu, dict) else None
    try:
        slices: int = _adapter(int, field.metadata).validate_python(raw)
        return slices
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
    values: dict[str, str | None] = {}
    for name in ("queue_name", "workload_priority_class_name"):
        field = TPUTrainingJobSpec.model_fields[name]
        try:
            values[name] = _adapter(field.annotation, field.metadata).validate_python(spec.get(field.alias or name))
        except ValidationError:
            return None
    return rules.Queueing(**values)


def _adapter(annotation: Any, metadata: list[Any]) -> TypeAdapter[Any]:
    """A validator for a field's type with its constraints (a type built at run time, which only pydantic reads)."""
    form: Any = Annotated[(annotation, *metadata)]
    return TypeAdapter(form)


_Model = TypeVar("_Model", bound=BaseModel)


def _valid(model: type[_Model], raw: Any) -> _Model | None:
    try:
        return model.model_validate(raw) if raw is not None else None
    except ValidationError:
        return None


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types: SafeLoader is Any
    """PyYAML's safe loader (pure Python: libyaml's composer recurses in C, where no RecursionError stops it)
    that refuses what Kubernetes' YAML refuses or what would make one file cost unbounded work: a key
    given twice (kubectl: "mapping key already defined"), an integer Python cannot read."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue  # a collection as a key: no job has one, and the models refuse it by type
        key = (key_node.tag, key_node.value)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {shown(key_node.value)} is given twice", key_node.start_mark
            )
        seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node, deep=deep)
    return mapping


def _int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    if sum(c.isdigit() for c in node.value) > MAX_INT_DIGITS:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(node.value)} digits; Kubernetes integers are 64-bit", node.start_mark
        )
    value: int = loader.construct_yaml_int(node)
    return value


_StrictLoader.add_constructor("tag:yaml.org,2002:map", _mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _int)


def _bounded(doc: Any) -> str | None:
    """Why `doc` is too big to validate (MAX_VALUES values once aliases are expanded, MAX_DEPTH levels), or
    None. Iterative and stops at the first bound crossed: an alias bomb costs MAX_VALUES steps here, not
    its expansion."""
    stack, count = [(doc, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            return f"more than {MAX_VALUES} values once aliases are expanded; a job has a few hundred"
        if depth > MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} levels deep; a job nests a few"
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()] + [(k, depth + 1) for k in node]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
    return None


def read_documents(text: str) -> list[Any]:
    """The YAML documents of `text`, each bounded (`_bounded`), or one InvalidJob saying where and why not."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidJob([f"(yaml): {shown(str(exc).replace(chr(10), ' '), 400)}"]) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise InvalidJob([f"(yaml): nested more than {MAX_DEPTH} levels deep; a job nests a few"]) from None
    if not docs:
        raise InvalidJob(["(yaml): no document found"])
    for i, doc in enumerate(docs):
        problem = _bounded(doc)
        if problem:
            raise InvalidJob([f"(yaml): document {i + 1}: {problem}" if len(docs) > 1 else f"(yaml): {problem}"])
    return docs
