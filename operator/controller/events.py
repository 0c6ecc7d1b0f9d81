"""Kubernetes Events about a job, posted in the background with the controller's client.

Best effort, as Events are: a post that fails is logged and dropped, and never holds up a
reconcile. `drain` waits for the posts in flight (at shutdown)."""

from __future__ import annotations

import asyncio
import datetime
import logging

from ..api import timestamps
from .kube import EVENTS, ApiError, Kube, Obj
from .phases import Notice

log = logging.getLogger("tpu_operator")
COMPONENT = "tpu-operator"


def event_body(obj: Obj, notice: Notice, now: datetime.datetime) -> Obj:
    meta = obj["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace", "default")},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": meta["name"],
            "namespace": meta.get("namespace", "default"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": notice.type,
        "reason": notice.reason,
        "message": notice.message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": timestamps.format(now),
        "lastTimestamp": timestamps.format(now),
        "count": 1,
    }


class EventPoster:
    """`emit(obj, notice)` for the reconcile logic."""

    def __init__(self, kube: Kube, clock: timestamps.Clock = timestamps.utc_now):
        self.kube, self.clock = kube, clock
        self.posting: set[asyncio.Task[None]] = set()

    def __call__(self, obj: Obj, notice: Notice) -> None:
        task = asyncio.create_task(self._post(event_body(obj, notice, self.clock())))
        self.posting.add(task)
        task.add_done_callback(self.posting.discard)

    async def _post(self, body: Obj) -> None:
        try:
            await self.kube.create(EVENTS, body["metadata"]["namespace"], body)
        except ApiError as exc:
            log.warning("could not post Event %s about %s: %s", body["reason"], body["involvedObject"]["name"], exc)

    async def drain(self) -> None:
        await asyncio.gather(*self.posting, return_exceptions=True)
