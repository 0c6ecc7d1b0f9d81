"""The job's control credential: who may change a running trainer.

The trainer's port is reachable from the node's network (host networking) or any pod, and `POST /profile`
changes what it does. So the trainer takes a control request only with the job's token
(workload/process/serving.py). Reads (`/status`, `/metrics`) stay open: they change nothing, and are bounded
like every request.

One key per operator installation, nothing per job:
- the key: `KEY_BYTES` random bytes in the Secret `tpu-operator-control-key` (field `key`) in the operator's
  own namespace (`key_namespace`: --control-key-namespace, else $POD_NAMESPACE, which the chart sets, else the
  service account's namespace file, else "default"). `load_key` reads it once at start-up: GET; on 404 it
  makes it; on 409 (another replica made it first) it reads it again. Unreadable or malformed is
  `KeyUnavailable`, a start-up error. The key is never logged, and no message here carries it.
- a job's token: base64url(HMAC-SHA256(key, `DOMAIN` and the job's namespace, name and uid, each
  length-prefixed)): distinct per job and per incarnation of a name (its uid), the same for every replica and
  every restart of the operator with that key; derived when a control request is sent, with no API request.
- the pods get only the token's SHA-256 (hex, `digest`), in the env var `TPUJOB_CONTROL_TOKEN_SHA256` of the
  JobSet's pod template (rendering/manifests.py): what a pod spec shows cannot be sent as the token, and the
  ConfigMap (named by its content's hash) does not depend on the key. A new key (the Secret deleted) makes every
  running job's token another: their profile requests are refused until their JobSets are made again.

The token goes in the header `X-Tpujob-Control-Token`, not `Authorization`: the API server's pod proxy
(`--metrics-access proxy`) authenticates the caller by its own `Authorization` header and removes it
before passing the request on; the trainer takes either.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from .kube import SECRETS, ApiError, Kube

HEADER = "X-Tpujob-Control-Token"
KEY_SECRET = "tpu-operator-control-key"
KEY_FIELD = "key"
KEY_BYTES = 32
DOMAIN = b"tpu-operator.dev/control-token/v1"  # a key used for anything else never yields a token
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KeyUnavailable(Exception):
    """The control key's Secret cannot be read, made or used: the operator does not start. The message names
    the Secret and the API's answer, never the key."""


def key_namespace(flag: str = "", environ: Any = os.environ, account_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """Where the key's Secret lives: the flag, else $POD_NAMESPACE, else the service account's namespace (in a
    pod), else "default"."""
    if flag:
        return flag
    if environ.get("POD_NAMESPACE"):
        return str(environ["POD_NAMESPACE"])
    try:
        found = account_file.read_text()[:253].strip()
    except OSError:
        found = ""
    return found or "default"


def key_secret(namespace: str, key: bytes, name: str = KEY_SECRET) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "tpu-operator"}},
        "type": "Opaque",
        "immutable": True,  # a changed key would refuse every running job's requests: made once, never updated
        "data": {KEY_FIELD: base64.b64encode(key).decode()},
    }


def _key_of(secret: dict[str, Any], where: str) -> bytes:
    value = (secret.get("data") or {}).get(KEY_FIELD)
    try:
        key = base64.b64decode(value or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise KeyUnavailable(f"Secret {where}: field {KEY_FIELD!r} is not base64") from None
    if len(key) != KEY_BYTES:
        raise KeyUnavailable(f"Secret {where}: field {KEY_FIELD!r} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


async def load_key(kube: Kube, namespace: str, name: str = KEY_SECRET) -> bytes:
    """The installation's control key: read, or made on first start (a 409: another replica made it first, and
    it is read again). KeyUnavailable if it cannot be read or made, or is not `KEY_BYTES` bytes."""
    where = f"{namespace}/{name}"
    try:
        try:
            return _key_of(await kube.get(SECRETS, namespace, name), where)
        except ApiError as exc:
            if exc.status != 404:
                raise
        try:
            made = await kube.create(SECRETS, namespace, key_secret(namespace, secrets.token_bytes(KEY_BYTES), name))
        except ApiError as exc:
            if exc.status != 409:
                raise
            made = await kube.get(SECRETS, namespace, name)
        return _key_of(made, where)
    except ApiError as exc:
        # The API's words only for a read: a refused create's might quote what was sent.
        said = f": {exc.message[:200]}" if exc.verb == "GET" else ""
        raise KeyUnavailable(
            f"cannot read or make the control key, Secret {where} (HTTP {exc.status} on {exc.verb or 'a request'}"
            f"{said}); the operator needs get and create on Secrets in its own namespace (the chart's control-key "
            "Role)"
        ) from None


def derive(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The job's token (unpadded base64url of an HMAC-SHA256 of its namespace, name and uid)."""
    message = DOMAIN + b"".join(len(f).to_bytes(2, "big") + f for f in (s.encode() for s in (namespace, name, uid)))
    return base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest()).rstrip(b"=").decode()


def digest(token: str) -> str:
    """What the pods hold of a token: its SHA-256 in hex (the trainer compares the presented token's)."""
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    """The jobs' tokens and their digests, derived from the key; without a key (a reader made without one) there
    are none: requests go without, and are refused."""

    def __init__(self, key: bytes | None = None):
        if key is not None and len(key) != KEY_BYTES:
            raise ValueError(f"a control key is {KEY_BYTES} bytes")
        self._key = key

    def __repr__(self) -> str:  # never the key
        return f"Tokens(key={'set' if self._key else 'none'})"

    def token(self, namespace: str, name: str, uid: str) -> str | None:
        return None if self._key is None else derive(self._key, namespace, name, uid)

    def digest(self, namespace: str, name: str, uid: str) -> str | None:
        token = self.token(namespace, name, uid)
        return None if token is None else digest(token)
