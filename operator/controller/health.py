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
  minutes). The operator acts at once: a TPU host that stopped reporting has stopped its slice already.

Only nodes carrying GKE's TPU accelerator label `cloud.google.com/gke-tpu-accelerator` are looked at (the
manager's node index is filtered on it), so the operator caches no other nodes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..api import names
from ..api.failures import Failure

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
PARTITION_STATE = re.compile(r"^cloud\.google\.com/gke-tpu-partition-(\d+x\d+x\d+)-state$")
UNHEALTHY_STATES = ("UNHEALTHY",)  # DEGRADED: "impaired but still usable" (GKE docs)


def unhealthy_reason(node: Mapping[str, Any]) -> str | None:
    """Why GKE says this node cannot run its slice, or None while it can."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in sorted(labels.items()):
        if PARTITION_STATE.match(key) and value in UNHEALTHY_STATES:
            return f"label {key}={value}"
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") in ("False", "Unknown"):
            why = cond.get("reason") or ("NotReady" if cond.get("status") == "False" else "NodeStatusUnknown")
            return f"condition Ready={cond.get('status')} ({why})"
    return None


@dataclasses.dataclass(frozen=True)
class HardwareLoss:
    """A node of the job's running pods that GKE says is unhealthy."""

    node: str
    reason: str  # unhealthy_reason's words
    pod: str
    slice_index: int | None

    def describe(self) -> str:
        where = f"slice {self.slice_index}'s " if self.slice_index is not None else ""
        return f"node {self.node} of {where}pod {self.pod} is unhealthy ({self.reason})"


def placed(pods: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, int | None]]:
    """node name -> (pod, slice index) of the pods still running or starting on a node."""
    out: dict[str, tuple[str, int | None]] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        out.setdefault(node, ((pod.get("metadata") or {}).get("name", "?"), names.slice_index(pod)))
    return out


def lost(pods: Sequence[Mapping[str, Any]], unhealthy: Mapping[str, str]) -> HardwareLoss | None:
    """The first (by slice, then node name) of the job's nodes that is unhealthy; None when all are fine."""
    hits = [
        HardwareLoss(node, unhealthy[node], pod, index)
        for node, (pod, index) in placed(pods).items()
        if node in unhealthy
    ]
    hits.sort(key=lambda h: (h.slice_index is None, h.slice_index or 0, h.node))
    return hits[0] if hits else None


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
