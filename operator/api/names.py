"""Names and labels of everything a job owns. Deterministic: the operator finds and adopts by name.

Part of the API rather than of rendering: validation refuses a job whose pod hostnames would be too
long, and the controller finds a job's children by these names and labels.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

REPLICATED_JOB = "slice"  # short on purpose: it is part of every pod hostname
LABEL_JOB = "training.tpu-operator.dev/job"
# On the JobSet: the spec it was rendered from (rendering.manifests.applied_spec), as JSON.
APPLIED_SPEC = "training.tpu-operator.dev/applied-spec"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# On a job, set by its user: `steps:A-B` asks the running trainer for a profiler trace of steps A..B
# (api/profiling.py); the job's status.profile says where the trace is.
PROFILE_ANNOTATION = "training.tpu-operator.dev/profile"
# On a Kueue Workload the operator deactivated (spec.active=false) for the job's spec.suspend: it
# reactivates only Workloads it deactivated itself, never one an administrator stopped.
DEACTIVATED_FOR_SUSPEND = "training.tpu-operator.dev/deactivated-for-suspend"
MANAGED_BY = "tpu-operator"
# Labels JobSet and the Job controller put on every pod: its JobSet; the index of its replicated Job, i.e. its
# slice (an annotation too); its index within that Job (its host). Pod 0 of slice 0 runs process 0.
LABEL_JOBSET = "jobset.sigs.k8s.io/jobset-name"
LABEL_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
LABEL_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JAX_COORDINATOR_PORT = 8476
MEGASCALE_PORT = 8080


def jobset_name(job: str) -> str:
    return job


# The probe's replicated Job (controller/growback.py PROBE_JOB): its pod names count in JobSet's name rule.
GROWBACK_REPLICATED_JOB = "g"


def growback_name(job: str) -> str:
    """The probe JobSet that asks the cluster whether an elastic job's missing slices can be placed
    (controller/growback.py). Its pods get no DNS hostnames, so the suffix costs no hostname length."""
    return f"{job}-grow"


def slice_index(pod: Mapping[str, Any]) -> int | None:
    """The slice a pod belongs to (JobSet's job index), or None where it carries none."""
    meta = pod.get("metadata") or {}
    index = (meta.get("labels") or {}).get(LABEL_JOB_INDEX) or (meta.get("annotations") or {}).get(LABEL_JOB_INDEX)
    text = str(index)
    return int(text) if text.isdigit() else None


def config_map_name(job: str, config_json: str) -> str:
    """`<job>-config-<sha10>`: the name carries a hash of the config it holds, so pods that mount it by name
    mount that config and no other. The ConfigMap is immutable: an edit of the job (allowed until its JobSet
    exists) renders a new config under a new name, never a change of the old one that a pod started before
    it or a pre-flight compiled; and one found under the name with other contents was not made by this
    rendering (controller/children.py replaces it)."""
    return f"{job}-config-{hashlib.sha256(config_json.encode()).hexdigest()[:10]}"


def hostname(job: str, slice_index: int, host_index: int) -> str:
    """The pod hostname JobSet derives: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>."""
    return f"{jobset_name(job)}-{REPLICATED_JOB}-{slice_index}-{host_index}"


def longest_hostname(job: str, slices: int, hosts: int) -> str:
    return hostname(job, slices - 1, hosts - 1)


def coordinator_host(job: str) -> str:
    """Pod 0 of slice 0, through the JobSet's headless Service (subdomain = JobSet name)."""
    return f"{hostname(job, 0, 0)}.{jobset_name(job)}"


def labels(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGED_BY}
