"""Which pod shapes the API server admitted lately: one dry run per shape and namespace, not one per job.

A job's pods are validated, and seen by Pod Security admission and by pod webhooks (GKE's TPU one), only
when the Job controller makes them, long after the JobSet was accepted; so the operator asks the API
server to admit one pod per pod template in a dry run before it creates anything (children.py). That
is a request per job, and a burst of jobs from one sweep renders the same pods again and again: they
differ only in names. So a dry run that admits a job's pods is remembered, for `ttl_s`, under its
shape: the namespace, the whole spec, the operator's default image and the slice count, which are
everything the pods are rendered from but the job's name (and its uid, through its control token's digest). A refusal is never remembered (the job is
Invalid, and its next edit is checked afresh).

What this gives up: admission that decides by a job's name (a webhook matching name prefixes) is asked
for the first job of a shape only; a later job of that shape whose name it refuses has its pods refused
when the Job controller makes them, as without any dry run (the pods' diagnosis then says so,
diagnosis.py). A change of admission (a new webhook, a namespace's Pod Security level) reaches jobs of a
shape already admitted after `ttl_s` at most.
"""

from __future__ import annotations

import collections
import hashlib
import json
import time
from collections.abc import Callable

from ..api.models import TPUTrainingJob

TTL_S = 600.0  # as long as a namespace's admission is taken to hold for a shape
SIZE = 256  # shapes remembered: a bound on memory whatever the number of jobs


def shape(job: TPUTrainingJob, default_image: str | None, running: int | None) -> str:
    """What the job's pods are rendered from, but its name: a digest."""
    spec = job.spec.model_dump(mode="json", by_alias=True, exclude_unset=True)
    text = json.dumps([job.metadata.namespace, spec, default_image, running], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class AdmittedShapes:
    """The shapes admitted within the last `ttl_s`, at most `size` of them (the least recently admitted go)."""

    def __init__(self, ttl_s: float = TTL_S, size: int = SIZE, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.size, self.clock = ttl_s, size, clock
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()

    def __contains__(self, key: str) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if self.clock() >= until:
            del self._until[key]
            return False
        return True

    def add(self, key: str) -> None:
        self._until[key] = self.clock() + self.ttl_s
        self._until.move_to_end(key)
        while len(self._until) > self.size:
            self._until.popitem(last=False)
