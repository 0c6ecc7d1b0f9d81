"""The RBAC rules the operator needs: `tpujob operator --print-rbac`, the chart, and the tests that
check every request the operator makes against them all read this table."""

from __future__ import annotations

from typing import Any

# What the operator does on each resource; tests/operator checks every request it makes against these.
RBAC_RULES: tuple[dict[str, Any], ...] = (
    # kopf watches the jobs; a status write that conflicts re-reads the job once.
    {"apiGroups": ["training.tpu-operator.dev"], "resources": ["tputrainingjobs"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["training.tpu-operator.dev"], "resources": ["tputrainingjobs/status"], "verbs": ["patch"]},
    # get: adoption after a 409 and the resync; patch: spec.suspend; delete: a restart replaces a failed or
    # hung JobSet (api/failures.py).
    {
        "apiGroups": ["jobset.x-k8s.io"],
        "resources": ["jobsets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # delete: a ConfigMap of ours whose contents are not its name's is replaced (children.py); immutable,
    # it cannot be updated. list, watch: the ConfigMaps labelled as a job's (no cache), to see a hand edit or
    # deletion; patch: their labels put back (drift.py).
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # The pre-flight compile (a kopf index of our batch Jobs); get: adoption after a 409.
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create"]},
    # list: pod 0 of a JobSet, for its metrics; a JobSet's pods when some are not ready, to say why (one
    # label-selected list per JobSet event or resync: no watch, so no cluster-wide pod cache); a failed
    # JobSet's pods, for their exit codes and messages; the pre-flight's pod, for its result (its
    # termination message) or why it did not start. deletecollection: a failed or hung attempt's pods,
    # at once (children.replace_jobset). create: only ever with dryRun=All, one pod per pod template before a
    # job's first object is made, so what the API would refuse later makes the job Invalid (children.dry_run);
    # RBAC cannot tell a dry run from a create.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "create", "deletecollection"]},
    # --metrics-access proxy only: get, the trainer's /status; create, a POST of a profile request (profiles.py).
    {"apiGroups": [""], "resources": ["pods/proxy"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Kueue: list and watch the Workloads of queued JobSets (a kopf index); patch spec.active to carry a
    # queued job's spec.suspend (Kueue undoes a suspended JobSet whose Workload is admitted). Unused where
    # Kueue is not installed.
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list", "watch", "patch"]},
    # kopf: notices CRDs and namespaces coming and going, also with --namespace names (it lists and watches
    # namespaces to learn that the named ones exist). Without them a real API server answers 403 and kopf
    # retries its namespace watch as long as it runs (a 403 every few seconds, seen in the audit log).
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # TPU node health (health.py): a kopf index of the nodes labelled cloud.google.com/gke-tpu-accelerator, to
    # see GKE's partition-state label and the Ready condition of the nodes a running job's pods are on.
    # Cluster-scoped, so granted by the ClusterRole even with rbac.namespaced.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
    # Leader election (leader.py, --leader-elect): the one Lease, in the operator's own namespace only (the chart
    # grants it with a Role there, never cluster-wide). get: a standby's polls; create: the first replica;
    # update: acquire, renew, release (an update carries the read's resourceVersion: of two, one wins).
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
    # The control key (control.py): one Secret, in the operator's own namespace only (the chart grants it with a
    # Role there, never cluster-wide; `get` limited to its name). get: at start-up; create: the first start.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    # kopf peering, only without --standalone (kopf's KopfPeering CRDs installed).
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["kopfpeerings", "clusterkopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    },
)


def rbac_yaml() -> str:
    import yaml

    text: str = yaml.safe_dump({"rules": [dict(r) for r in RBAC_RULES]}, sort_keys=False)
    return text
