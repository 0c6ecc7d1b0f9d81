"""The TPUTrainingJob API object: its group, version and kind, the whole spec (the sections of `spec.py`
checked together by the cross-field rules of `rules.py`), its metadata, and the object itself. One set
of pydantic models is the CRD schema (`crd.py`, with `status.py`'s status), the validator and the
template context, so `tpujob validate`, the operator and the CRD-less local runner all refuse the same
inputs with the same messages.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import limits as L
from . import rules
from .contract import Base, CheckpointSpec, KernelsSpec, Mesh, ModelDims, TrainingSpec, _desc
from .problems import Problem, joined, shown
from .spec import (
    IMAGE,
    KUEUE_NAME,
    LABEL_VALUE,
    Arg,
    FailurePolicySpec,
    LabelKey,
    ModelSpec,
    ParallelismSpec,
    PlanSpec,
    ResourcesSpec,
    RuntimeSpec,
    Toleration,
    TPUSpec,
)

GROUP = "training.tpu-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TPUTrainingJob"
PLURAL = "tputrainingjobs"
SINGULAR = "tputrainingjob"
SHORT_NAMES = ["tpujob", "tpujobs"]

CONFIG_MOUNT_DIR = "/etc/tpujob"
CONFIG_FILE = "config.json"
# Paths every trainer pod mounts a volume of the operator's at (rendering.manifests: the config and /dev/shm;
# templates/jobset.yaml.j2: /tmp, writable under the read-only root filesystem).
RESERVED_MOUNTS = (CONFIG_MOUNT_DIR, "/dev/shm", "/tmp")
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a namespace's name


# ---------------------------------------------------------------------------------------------
# The whole spec


class TPUTrainingJobSpec(Base):
    tpu: TPUSpec = _desc("Which TPU slices to run on.")
    model: ModelSpec = _desc("The decoder model to train.")
    training: TrainingSpec = _desc("Steps, batch, sequence, schedule, precision, data.")
    parallelism: ParallelismSpec = _desc("Mesh degrees within one slice.", default_factory=ParallelismSpec)
    kernels: KernelsSpec = _desc("Attention and MoE kernels.", default_factory=KernelsSpec)
    runtime: RuntimeSpec = _desc("TPU runtime flags and environment.", default_factory=RuntimeSpec)
    checkpoint: CheckpointSpec = _desc("Checkpointing and resume.", default_factory=CheckpointSpec)
    plan: PlanSpec = _desc("The compile check (pre-flight) before the JobSet is created.", default_factory=PlanSpec)
    failure_policy: FailurePolicySpec = _desc("Restarts.", default_factory=FailurePolicySpec)
    image: str | None = _desc(
        "Trainer image: [registry[:port]/]path[:tag][@digest]. Unset: the operator's --default-image (the chart's "
        "operator.defaultImage); a job the operator cannot give an image is Invalid.",
        default=None,
        min_length=1,
        max_length=L.MAX_IMAGE,
        pattern=IMAGE,
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = _desc("Image pull policy.", default="IfNotPresent")
    command: list[Arg] | None = _desc(
        "Overrides the bundled trainer's command.", default=None, min_length=1, max_length=L.MAX_ARGS
    )
    args: list[Arg] = _desc("Extra arguments appended to the command.", default_factory=list, max_length=L.MAX_ARGS)
    resources: ResourcesSpec = _desc("Extra pod resources.", default_factory=ResourcesSpec)
    service_account_name: str | None = _desc(
        "Service account of the pods (e.g. for GCS access).",
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )
    priority_class_name: str | None = _desc(
        "Kubernetes PriorityClass of the pods (pod priority and preemption). Under Kueue it is also the "
        "Workload's priority, unless workloadPriorityClassName is set.",
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )
    queue_name: str | None = _desc(
        "Kueue LocalQueue (in the job's namespace) to submit the job to: the JobSet is created suspended with "
        "the label kueue.x-k8s.io/queue-name and runs when Kueue admits it.",
        default=None,
        max_length=63,
        pattern=KUEUE_NAME,
    )
    workload_priority_class_name: str | None = _desc(
        "Kueue WorkloadPriorityClass: the job's priority in its queue and for Kueue's preemption "
        "(label kueue.x-k8s.io/priority-class), independent of the pods' priorityClassName. Needs queueName.",
        default=None,
        max_length=63,
        pattern=KUEUE_NAME,
    )
    node_selector: dict[LabelKey, Annotated[str, Field(pattern=LABEL_VALUE, max_length=63)]] = _desc(
        "Extra node selectors (GKE TPU selectors are set by the operator).",
        default_factory=dict,
        max_length=L.MAX_SELECTORS,
    )
    tolerations: list[Toleration] = _desc(
        "Extra tolerations (the TPU taint is tolerated already).", default_factory=list, max_length=L.MAX_TOLERATIONS
    )
    suspend: bool = _desc(
        "Suspend the job (its pods are deleted; resume continues from the checkpoint). With "
        "queueName, the operator deactivates the job's Kueue Workload.",
        default=False,
    )
    termination_grace_period_seconds: int | None = _desc(
        "Seconds a pod has after SIGTERM to finish its step and write a checkpoint before it is killed. "
        "Default: derived from the checkpoint size per host (docs/jobs.md: What a rendered JobSet carries).",
        default=None,
        ge=1,
        le=86400,
    )

    @field_validator("priority_class_name")
    @classmethod
    def _not_the_clusters(cls, v: str | None) -> str | None:
        # Kubernetes' own classes rank above every workload: a training job with one would preempt other
        # tenants' pods and the cluster's components for its TPUs.
        if v is not None and v.startswith("system-"):
            raise ValueError(
                f"{v} is reserved for the cluster's own components; use a PriorityClass of your cluster's workloads"
            )
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> TPUTrainingJobSpec:
        problems = rules.spec_problems(self.sections()) + self._pod_problems()
        if problems:
            raise ValueError(joined(problems))
        return self

    def _pod_problems(self) -> list[Problem]:
        """What the API server would refuse in the objects rendered from this spec: a checkpoint volume mounted
        where the renderer mounts its own (mount paths are unique per container), and a spec too large for
        the JobSet's annotation that carries it (256 KiB of annotations per object; the ConfigMap's 1 MiB
        follows, its config being a part of the spec)."""
        problems = []
        directory = self.checkpoint.directory
        if self.checkpoint.persistent_volume_claim and directory:
            path = "/" + "/".join(p for p in directory.split("/") if p)
            parts = path.split("/")
            shown_directory = shown(repr(directory))
            if ".." in parts or "." in parts:
                problems.append(
                    ("checkpoint.directory", f"{shown_directory}: a volume's mount path has no . or .. parts")
                )
            elif path == "/" or any(path == m or m.startswith(path + "/") for m in RESERVED_MOUNTS):
                problems.append(
                    (
                        "checkpoint.directory",
                        f"{shown_directory} would hide a volume the operator "
                        f"mounts ({', '.join(RESERVED_MOUNTS)}); choose another path",
                    )
                )
        size = len(self.model_dump_json(by_alias=True, exclude_unset=True))
        if size > L.MAX_SPEC_BYTES:
            problems.append(
                (
                    "",
                    f"{size} bytes as JSON, more than {L.MAX_SPEC_BYTES}: the JobSet carries the "
                    f"spec in an annotation and Kubernetes allows {L.MAX_ANNOTATIONS_BYTES} bytes "
                    f"of annotations per object",
                )
            )
        return problems

    def sections(self) -> rules.Sections:
        return rules.Sections(
            tpu=self.tpu,
            model=self.model_dims,
            training=self.training,
            parallelism=self.parallelism,
            kernels=self.kernels,
            runtime=self.runtime,
            capacity=self.tpu,
            queueing=self.queueing,
            checkpoint=self.checkpoint,
            failure_policy=self.failure_policy,
        )

    @property
    def host_network(self) -> bool:
        """spec.runtime.hostNetwork, else on exactly for a multislice job (its configured slices, so an elastic
        job that shrinks to one slice keeps the network it started with)."""
        explicit = self.runtime.host_network
        return explicit if explicit is not None else self.tpu.slices > 1

    @property
    def queueing(self) -> rules.Queueing:
        return rules.Queueing(
            queue_name=self.queue_name, workload_priority_class_name=self.workload_priority_class_name
        )

    @property
    def model_dims(self) -> ModelDims:
        return self.model.dims()

    @property
    def mesh(self) -> Mesh:
        return rules.resolve_mesh(self.parallelism, self.tpu.slice.devices, self.tpu.slices)


# ---------------------------------------------------------------------------------------------
# metadata and the whole object


class ObjectMeta(BaseModel):
    """The parts of metadata the renderer reads; everything else passes through untouched."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(max_length=63)
    namespace: str = Field(default="default", max_length=63, pattern=DNS1123_LABEL)
    uid: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns1035(cls, v: str) -> str:
        if not DNS1035.fullmatch(v):  # fullmatch: `$` alone lets a trailing newline through
            raise ValueError(
                f"{v!r} must be a DNS-1035 label (lower-case letters, digits and '-', starting with "
                "a letter): it names the JobSet, its Service and every pod hostname"
            )
        return v


class TPUTrainingJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    apiVersion: Literal[API_VERSION]  # type: ignore[valid-type]
    kind: Literal[KIND]  # type: ignore[valid-type]
    metadata: ObjectMeta
    spec: TPUTrainingJobSpec
    status: dict[str, Any] | None = None  # written by the operator; ignored as input

    @model_validator(mode="after")
    def _hostnames_fit(self) -> TPUTrainingJob:
        problem = rules.hostname_problem(self.metadata.name, self.spec.tpu)
        if problem:
            raise ValueError(joined([problem]))
        return self


# Spec fields a job may change once its JobSet exists (every other one is immutable from then on: the API
# server refuses the change through the CRD's CEL rules, crd.py; the operator reports one that got past as
# SpecChange=False).
MUTABLE_SPEC_FIELDS = frozenset({"suspend"})
# Spec fields whose default the operator applies, not the API server: the CRD publishes no default for them,
# so a job that leaves one unset stays so (spec.image: the operator's --default-image; no image is published
# under a name this project could default to, so a job neither names is Invalid, validation.image_problem).
OPERATOR_DEFAULTED_FIELDS = frozenset({"image"})
