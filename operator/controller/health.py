"""TPU node health: which nodes run a job's pods, which of them GKE says are unhealthy, and why. Pure.

A multi-slice JAX job stops as a whole when one host goes, so a node that GKE has judged unhealthy is
worth acting on while its pods still run: the operator asks the trainer to save the step in flight
(SIGTERM, through a deletion with the pods' grace period) and restarts, cause `hardware`, on the slices
left (api/elastic.py) instead of waiting for the host to die and the step in flight to be lost.

The two signals read, as GKE publishes them:

- The partition-state label `cloud.google.com/gke-tpu-partition-4x4x4-state` on TPU7x (Ironwood) nodes
  of dynamic slicing (GKE docs, "Configure TPUs with GKE dynamic slicing", section "Verify the status of
  the nodes and the partitions": values HEALTHY, DEGRADED "impaired but still usable", UNHEALTHY
  "malfunctioning and can't be used to form a slice", UNSET, INCOMPLETE). Kueue's TPU slice controller
  selects nodes on the same key (`TPUSliceHealthNodeSelectorKey`, healthy value "HEALTHY"), and XPK's
  Kueue flavors (AI-Hypercomputer/xpk, src/xpk/core/kueue_manager.py) and its Pathways manifests require
  `In [HEALTHY, DEGRADED]`. Only UNHEALTHY stops a job: DEGRADED is documented as usable, and UNSET and
  INCOMPLETE describe a partition being formed, not a failing host. The label is matched by pattern
  (`-<shape>-state`) so other partition shapes read the same way.
- The node condition `Ready` (the kubelet's): False or Unknown is the signal GKE's node auto-repair acts
  on (GKE docs, "Auto-repair nodes", Repair criteria: NotReady, or no status at all, over about 10
  minutes).

Judgement (`due`, `holding`):
- The partition-state label acts at once: GKE has judged the host.
- `Ready` False or Unknown acts once it has lasted `spec.failurePolicy.nodeUnhealthyGraceSeconds` (default
  120 s). Ready turns Unknown when the node lifecycle controller has heard nothing from the kubelet for
  `--node-monitor-grace-period` (40 s by default), so a kubelet restart during an upgrade, an API-server
  restart or a network blip shows as a short Unknown; GKE's own repair waits about 10 minutes. 120 s
  rides out those blips and still stops a job whose host is really gone well before the repair does
  (its slice is stopped already: every minute waited is lost). Since when: Ready's `lastTransitionTime`,
  untrusted: a missing, unreadable or future one is replaced by when this operator first saw the node
  unhealthy (`Unhealthy.since`), so it never acts early and never waits for ever; a past one is the API's
  word that the node has been so that long (an operator back from an outage acts at once).
- When a large share of the cluster's TPU nodes is NotReady together, the cause is the control plane or
  the network, not the hosts, and restarting every job would make it worse: the operator holds. The rule
  is the node lifecycle controller's (kube-controller-manager, `ComputeZoneState`): a zone is disrupted when
  every node is NotReady, or more than 2 are and they are at least `--unhealthy-zone-threshold` (0.55) of
  it; there, evictions stop (clusters up to `--large-cluster-size-threshold`, 50 nodes, and fully
  disrupted zones) or slow down. Here the cluster's TPU nodes are the zone (`holding`). While it holds, a
  Ready-based stop waits `HOLD_FACTOR` x the grace (10 minutes by default, when GKE's auto-repair starts
  replacing the nodes: their pods are then lost with them and restarted as hardware failures, restarts.py);
  the partition label still acts at once. Running jobs show condition `NodesHeld` and the operator the
  metric `tpu_operator_node_hold`.

Only nodes carrying GKE's TPU accelerator label `cloud.google.com/gke-tpu-accelerator` are looked at (the
manager's node index is filtered on it), so the operator caches no other nodes: per unhealthy node a small
`Unhealthy`, and for the hold two counts.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..api import names, timestamps
from ..api.failures import Failure
from ..api.status import TPUTrainingJobStatus
from .conditions import set_condition
from .phases import Notice

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
PARTITION_STATE = re.compile(r"^cloud\.google\.com/gke-tpu-partition-(\d+x\d+x\d+)-state$")
UNHEALTHY_STATES = ("UNHEALTHY",)  # DEGRADED: "impaired but still usable" (GKE docs)
HOLD_SHARE = 0.55  # kube-controller-manager --unhealthy-zone-threshold
HOLD_MIN_NOT_READY = 3  # ComputeZoneState: partial disruption needs more than 2 NotReady nodes
_ANY_TIME = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)  # at_once nodes do not read the time
HOLD_FACTOR = 5  # under a hold, a Ready-based stop waits 5 x the grace (600 s by default: GKE's auto-repair)


@dataclasses.dataclass(frozen=True)
class Unhealthy:
    """Why GKE says a TPU node cannot run its slice, and since when (see the module docstring)."""

    reason: str
    at_once: bool = False  # the partition-state label: no grace
    since: datetime.datetime | None = None  # Ready's lastTransitionTime, or when first seen so (None: unknown)


def _ready(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    conds = (node.get("status") or {}).get("conditions") or []
    return next((c for c in conds if isinstance(c, dict) and c.get("type") == "Ready"), None)


def not_ready(node: Mapping[str, Any]) -> bool:
    """Ready is False or Unknown (a node without the condition has not reported yet: not counted)."""
    ready = _ready(node)
    return ready is not None and ready.get("status") in ("False", "Unknown")


def judge(node: Mapping[str, Any], first_seen: datetime.datetime | None = None) -> Unhealthy | None:
    """Why this node cannot run its slice and since when, or None while it can. `first_seen`: when this operator
    first saw it unhealthy, which stands in for a Ready lastTransitionTime that is missing, unreadable or later."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in sorted(labels.items()):
        if PARTITION_STATE.match(str(key)) and value in UNHEALTHY_STATES:
            return Unhealthy(f"label {key}={value}", at_once=True, since=first_seen)
    if not not_ready(node):
        return None
    cond = _ready(node) or {}
    why = str(cond.get("reason") or ("NotReady" if cond.get("status") == "False" else "NodeStatusUnknown"))[:64]
    at = timestamps.parse_or_none(t if isinstance(t := cond.get("lastTransitionTime"), str) else None)
    since = at if at is not None and (first_seen is None or at <= first_seen) else first_seen
    return Unhealthy(f"condition Ready={cond.get('status')} ({why})", since=since)


def unhealthy_reason(node: Mapping[str, Any]) -> str | None:
    """Why GKE says this node cannot run its slice, or None while it can."""
    found = judge(node)
    return found.reason if found is not None else None


def holding(tpu_nodes: int, not_ready_nodes: int) -> bool:
    """So many TPU nodes are NotReady together that the cause is not theirs (the node lifecycle controller's
    zone rule: all of them, or more than 2 and at least 55 %): hold Ready-based stops."""
    if not_ready_nodes <= 0:
        return False
    return not_ready_nodes >= tpu_nodes or (
        not_ready_nodes >= HOLD_MIN_NOT_READY and not_ready_nodes >= HOLD_SHARE * tpu_nodes
    )


def grace_left_s(node: Unhealthy, grace_s: float, held: bool, now: datetime.datetime) -> float:
    """Seconds until an unhealthy node stops the job on it (0: now). The partition label acts at once; Ready
    after the grace (HOLD_FACTOR x the grace under a hold), counted from `since`; without a since (never seen
    before), the whole grace from now."""
    if node.at_once:
        return 0.0
    limit = grace_s * (HOLD_FACTOR if held else 1)
    if node.since is None:
        return limit
    return max(0.0, limit - (now - node.since).total_seconds())


@dataclasses.dataclass(frozen=True)
class HardwareLoss:
    """A node of the job's running pods that GKE says is unhealthy."""

    node: str
    reason: str  # unhealthy_reason's words
    pod: str
    slice_index: int | None
    selector: str | None = None  # the labels that select this pod alone in its JobSet (children.replace_jobset)

    def describe(self) -> str:
        where = f"slice {self.slice_index}'s " if self.slice_index is not None else ""
        return f"node {self.node} of {where}pod {self.pod} is unhealthy ({self.reason})"


def placed(pods: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, int | None]]:
    """node name -> (pod, slice index) of the pods still running or starting on a node."""
    return {node: (pod, index) for node, (pod, index, _) in _placed(pods).items()}


def _placed(pods: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, int | None, str | None]]:
    out: dict[str, tuple[str, int | None, str | None]] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        labels = (pod.get("metadata") or {}).get("labels") or {}
        index, host = labels.get(names.LABEL_JOB_INDEX), labels.get(names.LABEL_COMPLETION_INDEX)
        selector = (
            f"{names.LABEL_JOB_INDEX}={index},{names.LABEL_COMPLETION_INDEX}={host}"
            if isinstance(index, str) and isinstance(host, str) and index.isdigit() and host.isdigit()
            else None
        )
        out.setdefault(node, ((pod.get("metadata") or {}).get("name", "?"), names.slice_index(pod), selector))
    return out


@dataclasses.dataclass(frozen=True)
class Judged:
    """What the job's nodes call for now: the node that stops it (None: none yet), the seconds until the next
    one would (None: no unhealthy node under the job), and whether a Ready-based stop is held."""

    loss: HardwareLoss | None = None
    next_s: float | None = None
    held: bool = False  # a node of the job is unhealthy and the hold delays it


def judged(
    pods: Sequence[Mapping[str, Any]],
    unhealthy: Mapping[str, Unhealthy],
    grace_s: float,
    hold: bool,
    now: datetime.datetime,
) -> Judged:
    """The first (by slice, then node name) of the job's nodes whose grace is over, and when the next one's is."""
    hits, waits = [], []
    for node, (pod, index, selector) in _placed(pods).items():
        found = unhealthy.get(node)
        if found is None:
            continue
        left = grace_left_s(found, grace_s, hold, now)
        if left <= 0:
            hits.append(HardwareLoss(node, found.reason, pod, index, selector))
        else:
            waits.append(left)
    hits.sort(key=lambda h: (h.slice_index is None, h.slice_index or 0, h.node))
    return Judged(
        hits[0] if hits else None,
        min(waits) if waits else None,
        held=hold and not hits and bool(waits),
    )


def lost(pods: Sequence[Mapping[str, Any]], unhealthy: Mapping[str, str]) -> HardwareLoss | None:
    """The first (by slice, then node name) of the job's nodes that is unhealthy, no grace; None when all are fine."""
    return judged(pods, {n: Unhealthy(r, at_once=True) for n, r in unhealthy.items()}, 0, False, _ANY_TIME).loss


def failure(loss: HardwareLoss | None) -> Failure | None:
    """The failure an unhealthy node of a running slice stands for: cause `hardware`, in that node's slice (an
    elastic job goes on without it, api/elastic.py). No pod has failed yet: the replaced JobSet's pods are
    deleted with their grace period (children.replace_jobset), so the trainer's SIGTERM handler
    (workload/loop/preemption.py) saves the step in flight."""
    if loss is None:
        return None
    return Failure(
        cause="hardware",
        code=None,
        pod=loss.pod,
        slice_index=loss.slice_index,
        error=f"{loss.describe()}: the job is stopped with SIGTERM, which saves the step in flight",
    )


def follow(
    status: TPUTrainingJobStatus,
    nodes: Judged | None,
    hold: str | None,
    restarting: bool,
    now: datetime.datetime,
    generation: int | None = None,
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """Condition NodesHeld: True while a node under the job is NotReady and the hold delays its stop; False once
    the job's nodes were looked at and nothing is held, or a restart replaces the job. One Event each way."""
    before = status.condition("NodesHeld")
    was = before is not None and before.status == "True"
    if nodes is not None and nodes.held and not restarting:
        if was:  # said once, with the counts when it began: a disruption's every node event writes no status
            return status, []
        message = f"{hold}; this job's NotReady node stops it only after that" if hold else "held"
        conds = set_condition(status.conditions, "NodesHeld", "True", "ClusterDisrupted", message, now, generation)
        return status.model_copy(update=dict(conditions=conds)), [] if was else [
            Notice("Warning", "NodesHeld", message)
        ]
    if was and (restarting or (nodes is not None and not nodes.held)):
        message = "the hold is over: the TPU nodes are Ready again, or the job's node stopped it"
        conds = set_condition(status.conditions, "NodesHeld", "False", "Released", message, now, generation)
        return status.model_copy(update=dict(conditions=conds)), [Notice("Normal", "NodesReleased", message)]
    return status, []
