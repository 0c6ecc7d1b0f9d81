"""Every kopf handler of the operator, each a line or two that hands over to the manager.

- An index of GKE's TPU nodes (label `cloud.google.com/gke-tpu-accelerator`) that are unhealthy, with why and
  since when (health.py), and one that counts the TPU nodes and the NotReady ones (the hold: health.holding);
  a node event that says unhealthy, or that starts or ends the hold, has every Running job look at where
  its pods are.
- Indices of TPUTrainingJobs, of the JobSets labelled `training.tpu-operator.dev/job`, of the
  pre-flight batch Jobs (preflight.py), and of the Kueue Workloads a JobSet owns: the manager's
  caches, filled from kopf's watches (kopf runs the other handlers only once all are filled from
  their initial listing). The Workload selector names
  no version: kopf watches the one the cluster prefers (v1beta2 from Kueue v0.16, v1beta1 before;
  the fields read are the same). Where Kueue is not installed, kopf finds no such resource, logs
  that once, and runs everything else without waiting for it; it starts watching if Kueue's CRDs
  appear later.
- Events of any of them (created, changed, deleted, or listed at start-up): the job's key goes into
  the manager's work queue; the JobSet's whose job label was edited away too (drift.py).
- Events of the ConfigMaps labelled `training.tpu-operator.dev/job` (no index): the job's key goes into the
  queue only when the one its JobSet mounts was edited or deleted (manager.config_map_seen).
- Start-up and clean-up: the manager's workers and ticker.

kopf writes nothing on the objects: no finalizers (children go by owner references and garbage
collection; the periodic work is the manager's, not per-object timers), no progress or diff-base
annotations (only event and index handlers, which keep no state on the object).
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import Any, TypedDict, cast

import kopf

from ..api import names
from ..api.models import GROUP, PLURAL, VERSION
from ..rendering.preflight import LABEL_ROLE, ROLE
from . import health, kueue, preflight, trimmed
from .kube import BATCH_JOBS, JOBSETS, Obj
from .manager import Key, Manager

JOB = (GROUP, VERSION, PLURAL)
JOBSET = (JOBSETS.group, JOBSETS.version, JOBSETS.plural)
OURS = {names.LABEL_JOB: kopf.PRESENT}


class _GroupAndPlural(TypedDict):
    group: str
    plural: str


WORKLOAD: _GroupAndPlural = {"group": kueue.GROUP, "plural": kueue.PLURAL}  # any served version: the preferred one
PREFLIGHT = (BATCH_JOBS.group, BATCH_JOBS.version, BATCH_JOBS.plural)
# A label's value or kopf.PRESENT (whose type, kopf's MetaFilterToken, kopf does not export).
OUR_PREFLIGHTS: dict[str, Any] = {names.LABEL_JOB: kopf.PRESENT, LABEL_ROLE: ROLE}
NODE = ("", "v1", "nodes")
CONFIGMAP = ("", "v1", "configmaps")
TPU_NODES = {health.ACCELERATOR_LABEL: kopf.PRESENT}  # GKE's TPU nodes only: no other node is cached
# The same filters as label selectors of the watches themselves (kopf >= 1.45: settings.watching.label_selectors).
# A handler's `labels=` is kopf's own filter, applied after the event arrived: without these, every JobSet, batch
# Job and Node of the cluster is listed, sent and decoded on the operator's one event loop only to be dropped.
SERVER_SIDE = {
    JOBSET: names.LABEL_JOB,
    PREFLIGHT: f"{names.LABEL_JOB},{LABEL_ROLE}={ROLE}",
    NODE: health.ACCELERATOR_LABEL,
    CONFIGMAP: names.LABEL_JOB,
}


def select_server_side(settings: kopf.OperatorSettings) -> None:
    """Have the API server send only what the handlers of SERVER_SIDE's resources keep."""
    for resource, selector in SERVER_SIDE.items():
        settings.watching.label_selectors[resource] = selector


class NoEssence(kopf.DiffBaseStorage):
    """kopf's diff base serves change handlers (on.create, on.update...): on every event of every watched
    object kopf builds it by copying the whole object, twice, a JobSet's pod templates included (a profile
    of a burst of 500 jobs put a third of kopf's own time per event there), only to diff it for handlers
    this operator does not have: event and index handlers never read it. So its essence is empty and
    nothing is ever stored on an object."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return cast(kopf.BodyEssence, {})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def _owned_by_a_jobset(body: kopf.Body, **_: Any) -> bool:
    return kueue.jobset_owner(body) is not None


def _plain(body: kopf.Body) -> dict[str, Any]:
    """kopf's live body view as a plain dict snapshot."""
    return copy.deepcopy(dict(body))


def register(
    registry: kopf.OperatorRegistry, manager: Manager, login: Callable[[], Awaitable[kopf.ConnectionInfo]]
) -> None:
    """Register the handlers on `registry`; `login` returns the kopf.ConnectionInfo to use."""

    @kopf.on.login(id="login", registry=registry)
    async def _login(**_: Any) -> kopf.ConnectionInfo:
        return await login()

    @kopf.index(*JOB, id="jobs", registry=registry)
    async def jobs(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): trimmed.job(body)}

    @kopf.index(*JOBSET, id="jobsets", labels=OURS, registry=registry)
    async def jobsets(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): trimmed.jobset(body)}  # its pod templates are never read

    @kopf.index(**WORKLOAD, id="workloads", when=_owned_by_a_jobset, registry=registry)
    async def workloads(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, kueue.jobset_owner(body)): kueue.trim(_plain(body))}

    @kopf.index(*PREFLIGHT, id="preflights", labels=OUR_PREFLIGHTS, registry=registry)
    async def preflights(body: kopf.Body, **_: Any) -> dict[Any, Any]:
        key = preflight.job_key(body)
        return {key: preflight.trim(_plain(body))} if key else {}

    @kopf.index(*NODE, id="nodes", labels=TPU_NODES, registry=registry)
    async def nodes(name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        found = manager.node_health(name, body)  # only the unhealthy ones are kept: a sentence and a time each
        return {name: found} if found else {}

    @kopf.index(*NODE, id="node_counts", labels=TPU_NODES, registry=registry)
    async def node_counts(body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {"tpu": None, **({"not_ready": None} if health.not_ready(body) else {})}  # counts, not nodes

    @kopf.on.event(*NODE, id="node", labels=TPU_NODES, registry=registry)
    async def node_event(body: kopf.Body, type: str | None, **_: Any) -> None:  # noqa: A002 - kopf's name
        manager.node_seen(body, deleted=type == "DELETED")

    @kopf.on.event(*JOB, id="job", registry=registry)
    async def job_event(namespace: str | None, name: str, **_: Any) -> None:
        assert namespace is not None  # TPUTrainingJobs are namespaced
        manager.add((namespace, name), "job")

    # No `labels=`: the watch's selector (SERVER_SIDE) sends only ours, and a JobSet whose job label is edited
    # away leaves it as a DELETED event without the label, which must still reach its job (drift.py).
    @kopf.on.event(*JOBSET, id="jobset", registry=registry)
    async def jobset_event(body: kopf.Body, type: str | None, **_: Any) -> None:  # noqa: A002 - kopf's name
        manager.jobset_seen(body, deleted=type == "DELETED")

    @kopf.on.event(*CONFIGMAP, id="configmap", registry=registry)  # no index: nothing of them is kept
    async def config_map_event(body: kopf.Body, type: str | None, **_: Any) -> None:  # noqa: A002 - kopf's name
        manager.config_map_seen(body, deleted=type == "DELETED")

    @kopf.on.event(*PREFLIGHT, id="preflight", labels=OUR_PREFLIGHTS, registry=registry)
    async def preflight_event(body: kopf.Body, **_: Any) -> None:
        manager.preflight_seen(body)

    @kopf.on.event(**WORKLOAD, id="workload", when=_owned_by_a_jobset, registry=registry)
    async def workload_event(body: kopf.Body, **_: Any) -> None:
        manager.workload_seen(body)

    # kopf passes its indices to every handler as keyword arguments named for them, which its ActivityFn
    # protocol cannot name (it knows settings, retry, ...): the handler is typed right, kopf's protocol is not.
    @kopf.on.startup(id="manager", registry=registry)  # type: ignore[arg-type]
    async def start(
        jobs: kopf.Index[Key, Obj],
        jobsets: kopf.Index[Key, Obj],
        workloads: kopf.Index[Key, Obj],
        preflights: kopf.Index[Key, Obj],
        nodes: kopf.Index[str, health.Unhealthy],
        node_counts: kopf.Index[str, None],
        **_: Any,
    ) -> None:
        manager.start(jobs, jobsets, workloads, preflights, nodes, node_counts)

    @kopf.on.cleanup(id="manager", registry=registry)
    async def stop(**_: Any) -> None:
        await manager.stop()
