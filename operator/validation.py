"""Parse user documents into validated jobs, collecting every problem with its field path."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from .errors import problems
from .models import TPUTrainingJob


class InvalidJob(ValueError):
    """A job that cannot run as written; `problems` are 'field.path: reason' lines."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def parse_job(doc: Any) -> TPUTrainingJob:
    if not isinstance(doc, dict):
        raise InvalidJob([f"(root): expected a TPUTrainingJob mapping, got {type(doc).__name__}"])
    try:
        return TPUTrainingJob.model_validate(doc)
    except ValidationError as exc:
        raise InvalidJob(problems(exc)) from None


def read_documents(text: str) -> list[Any]:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidJob([f"(yaml): {exc}".replace("\n", " ")]) from None
    if not docs:
        raise InvalidJob(["(yaml): no document found"])
    return docs
