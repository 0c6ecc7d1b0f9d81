"""The job's control credential: who may change a running trainer.

The trainer's port is reachable from the node's network (host networking) or any pod, and `POST /profile`
changes what it does. So each job gets a Secret `<job>-control` (owned by the job: deleted with it) holding a
random token, made with the JobSet; the pods mount it (rendering/manifests.py) and the trainer takes a
control request only with that token (workload/process/serving.py). The operator sends it with its own requests
(metrics_reader.post_profile), read back from the Secret once and remembered per job. Reads (`/status`,
`/metrics`) stay open: they change nothing, and are bounded like every request.

The token goes in the header `X-Tpujob-Control-Token`, not `Authorization`: the API server's pod proxy
(`--metrics-access proxy`) authenticates the caller by its own `Authorization` header and removes it
before passing the request on; the trainer takes either.

An operator killed at any point makes nothing twice: the Secret's name is fixed, a 409 adopts it with the
token it already holds (children.ensure_child), and the token is never regenerated for a job.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from ..api import names
from ..api.models import TPUTrainingJob
from ..rendering.manifests import CONTROL_TOKEN_KEY, owner_reference
from .kube import SECRETS, ApiError, Kube

HEADER = "X-Tpujob-Control-Token"


def secret(job: TPUTrainingJob) -> dict[str, Any]:
    """The Secret with a fresh token (made once per job: a 409 keeps the one that exists)."""
    meta: dict[str, Any] = {
        "name": names.control_secret_name(job.metadata.name),
        "namespace": job.metadata.namespace,
        "labels": names.labels(job.metadata.name),
    }
    owner = owner_reference(job)
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "immutable": True,
        "stringData": {CONTROL_TOKEN_KEY: secrets.token_urlsafe(32)},
    }


class Tokens:
    """The control tokens of the jobs the operator sends control requests to, read from their Secrets once."""

    def __init__(self, kube: Kube):
        self.kube = kube
        self._known: dict[tuple[str, str], str] = {}

    async def token(self, namespace: str, job: str) -> str | None:
        """The job's token; None if its Secret cannot be read (the request then goes without, and is refused)."""
        key = (namespace, job)
        if key not in self._known:
            try:
                found = await self.kube.get(SECRETS, namespace, names.control_secret_name(job))
                value = base64.b64decode((found.get("data") or {}).get(CONTROL_TOKEN_KEY) or "").decode()
            except (ApiError, ValueError):
                return None
            if not value:
                return None
            self._known[key] = value
        return self._known[key]

    def forget(self, namespace: str, job: str) -> None:
        """A token the trainer refused (the Secret was made again): read it afresh next time."""
        self._known.pop((namespace, job), None)
