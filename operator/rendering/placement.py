"""Where a job's pods may run and who decides when they start: the GKE node selectors and
tolerations of each capacity mode, and the Kueue labels and annotation of a queued job.

Every key here is GKE's or Kueue's, not ours, and each cites where it is documented. Kueue: the
JobSet integration of v0.15 and later (the queue is a label only since v0.15); the constants are in
kubernetes-sigs/kueue `pkg/controller/constants/constants.go`. docs/queues.md
lists the same keys with the same sources.
"""

from __future__ import annotations

from typing import Any

from ..api.models import TPUTrainingJobSpec
from ..api.spec import TPUCapacity

# --- Kueue ------------------------------------------------------------------------------------------
# The LocalQueue that admits the JobSet (`QueueLabel`); Kueue reads labels only (the annotation form
# was removed in v0.15, CHANGELOG-0.15). Docs: kueue.sigs.k8s.io/docs/tasks/run/jobsets/ "Queue selection".
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# A WorkloadPriorityClass (`WorkloadPriorityClassLabel`); without it Kueue takes the Workload's priority
# from the pods' priorityClassName. Docs: kueue.sigs.k8s.io/docs/concepts/workload_priority_class/.
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# Passed by Kueue's ProvisioningRequest admission check to the ProvisioningRequest as the parameter
# maxRunDurationSeconds (every annotation with the prefix `provreq.kueue.x-k8s.io/`, ProvReqAnnotationPrefix).
# Docs: kueue.sigs.k8s.io/docs/admission-check-controllers/provisioning/ ("Job annotations");
# GKE: cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest (the Kueue example job).
PROVREQ_MAX_RUN_DURATION = "provreq.kueue.x-k8s.io/maxRunDurationSeconds"

# --- GKE ----------------------------------------------------------------------------------------------
# The node label naming a node's node pool (cloud.google.com/kubernetes-engine/docs/how-to/node-pools), the
# topology JobSet's exclusive placement gives each slice one of (jobset.sigs.k8s.io/docs/concepts, "Exclusive
# Job to topology placement"; the annotation: rendering/manifests.py EXCLUSIVE_TOPOLOGY).
NODE_POOL = "cloud.google.com/gke-nodepool"
# Spot VMs: "use the cloud.google.com/gke-spot=true label in a nodeSelector or node affinity"
# (cloud.google.com/kubernetes-engine/docs/how-to/autopilot-spot-pods; Standard: .../concepts/spot-vms).
# Autopilot taints Spot nodes itself; on Standard the documented taint is added at node-pool creation
# (--node-taints=cloud.google.com/gke-spot="true":NoSchedule). Tolerating it is harmless where it is absent.
SPOT = "cloud.google.com/gke-spot"
# Specific reservations, consumed through node selectors
# (cloud.google.com/kubernetes-engine/docs/how-to/consuming-reservations; the same labels stand for
# priorities.reservations.specific in .../concepts/about-custom-compute-classes). The project label is
# for a shared reservation owned by another project.
RESERVATION_NAME = "cloud.google.com/reservation-name"
RESERVATION_AFFINITY = "cloud.google.com/reservation-affinity"
RESERVATION_PROJECT = "cloud.google.com/reservation-project"
# Flex-start with queued provisioning (node pools made with --flex-start --enable-queued-provisioning,
# cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest): GKE taints those nodes
# cloud.google.com/gke-queued=true:NoSchedule; Google's TPU v7x example tolerates it as "Mandatory for
# Queued Provisioning" (GoogleCloudPlatform/cluster-toolkit, examples/gke-consumption-options/
# dws-flex-start-queued-provisioning/gke-tpu-7x/tpu-7x-test-job.yaml). The node *label* of the same name is
# not rendered as a selector: GKE does not document it on pools made with plain gcloud flags (cluster-toolkit
# adds it by hand), and Kueue's ProvisioningRequest admission check already places the pods on the nodes it
# provisioned. Add it through spec.nodeSelector where your pools carry it.
QUEUED = "cloud.google.com/gke-queued"


def _toleration(key: str) -> dict[str, str]:
    return {"key": key, "operator": "Equal", "value": "true", "effect": "NoSchedule"}


def node_selector(tpu: TPUCapacity) -> dict[str, str]:
    """The node selectors of the capacity mode (added to the TPU accelerator and topology ones)."""
    if tpu.capacity == "spot":
        return {SPOT: "true"}
    if tpu.capacity == "reservation":
        selector = {RESERVATION_NAME: tpu.reservation_name or "", RESERVATION_AFFINITY: "specific"}
        return {**selector, RESERVATION_PROJECT: tpu.reservation_project} if tpu.reservation_project else selector
    return {}


def tolerations(tpu: TPUCapacity) -> list[dict[str, str]]:
    """The tolerations of the capacity mode (added to the google.com/tpu one)."""
    if tpu.capacity == "spot":
        return [_toleration(SPOT)]
    if tpu.capacity == "flexStart":
        return [_toleration(QUEUED)]
    return []


def jobset_labels(spec: TPUTrainingJobSpec) -> dict[str, str]:
    """The Kueue labels of the JobSet (none without a queue). On the JobSet only: Kueue reads them there."""
    labels = {KUEUE_QUEUE_LABEL: spec.queue_name} if spec.queue_name else {}
    if spec.workload_priority_class_name:
        labels[KUEUE_PRIORITY_LABEL] = spec.workload_priority_class_name
    return labels


def jobset_annotations(spec: TPUTrainingJobSpec) -> dict[str, Any]:
    seconds = spec.tpu.max_run_duration_seconds
    return {PROVREQ_MAX_RUN_DURATION: str(seconds)} if seconds else {}
