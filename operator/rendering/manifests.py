"""Rendering: a pure function from a validated job to the manifests that run it.

The templates hold the shape of each object; this module computes the values (env, selectors,
resources...) and passes them through a filter that emits JSON, which is YAML, so a hostile
user string can never add a key or a document.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

import jinja2
import yaml

from ..api import names
from ..api.derived import Plan
from ..api.models import CONFIG_FILE, CONFIG_MOUNT_DIR, MUTABLE_SPEC_FIELDS, TPUTrainingJob
from . import libtpu, placement

TEMPLATES = ("configmap.yaml.j2", "jobset.yaml.j2")
# libyaml's parser is ~20x faster than PyYAML's pure-Python one; rendering sits on the reconcile path.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
TPU_RESOURCE = "google.com/tpu"
DEFAULT_COMMAND = ["python", "-m", "tpu_workload", "--config", f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE}"]
# The SHA-256 (hex) of the job's control token (controller/control.py), where the operator gives it: the trainer
# takes control requests (POST /profile) only with the token whose digest this is (workload/process/serving.py).
CONTROL_DIGEST_ENV = "TPUJOB_CONTROL_TOKEN_SHA256"
JOB_INDEX_FIELD = f"metadata.annotations['{names.LABEL_JOB_INDEX}']"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# JobSet's exclusive placement: one replicated Job (a slice) per value of this node label (a GKE node pool).
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"


def yaml_value(value: Any) -> str:
    """JSON with every non-ASCII character escaped the YAML way (\\u / \\U), so PyYAML reads it back
    exactly; plain JSON escapes astral characters as surrogate pairs, which YAML rejects."""
    text = json.dumps(value, ensure_ascii=False)
    return "".join(
        c if ord(c) < 0x7F else (f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}") for c in text
    )


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: resources.files("tpu_operator.templates").joinpath(name).read_text()),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["v"] = yaml_value
    return env


def owner_reference(job: TPUTrainingJob) -> dict[str, Any] | None:
    if not job.metadata.uid:
        return None
    return {
        "apiVersion": job.apiVersion,
        "kind": job.kind,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _env(plan: Plan, control_digest: str | None) -> list[dict[str, Any]]:
    job, spec = plan.job, plan.job.spec
    name = job.metadata.name
    coordinator = names.coordinator_host(name)

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": "TPUJOB_NAME", "value": name},
        {"name": "TPUJOB_CONFIG", "value": f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE}"},
        {"name": "TPUJOB_COORDINATOR_ADDRESS", "value": f"{coordinator}:{names.JAX_COORDINATOR_PORT}"},
        {"name": "TPUJOB_NUM_PROCESSES", "value": str(plan.total_hosts)},
        {"name": "TPUJOB_HOSTS_PER_SLICE", "value": str(plan.slice.hosts)},
        # The trainer derives its process id as slice * hostsPerSlice + host.
        {"name": "TPUJOB_SLICE_ID", **field(JOB_INDEX_FIELD)},
        {"name": "TPUJOB_HOST_ID", **field(COMPLETION_INDEX)},
        {"name": "TPUJOB_METRICS_PORT", "value": str(spec.runtime.metrics_port)},
    ]
    if control_digest is not None:  # none (`tpujob render`): the trainer refuses every control request
        env.append({"name": CONTROL_DIGEST_ENV, "value": control_digest})
    if spec.tpu.elastic is not None:
        # The slices that run now: the trainer applies it to the ConfigMap's whole-job config
        # (TrainerConfig.at_slices: mesh data degree and microbatches), so the ConfigMap never changes.
        env.append({"name": "TPUJOB_SLICES", "value": str(plan.slices)})
    if plan.slices > 1:
        # Set by hand: GKE's webhook does not set these for multi-slice JobSets reliably.
        env += [
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": coordinator},
            {"name": "MEGASCALE_NUM_SLICES", "value": str(plan.slices)},
            {"name": "MEGASCALE_SLICE_ID", **field(JOB_INDEX_FIELD)},
            {"name": "MEGASCALE_PORT", "value": str(names.MEGASCALE_PORT)},
        ]
    init_args = libtpu.libtpu_init_args(plan.gen, spec.runtime)
    if init_args:
        env.append({"name": "LIBTPU_INIT_ARGS", "value": " ".join(init_args)})
    if spec.runtime.xla_flags:
        env.append({"name": "XLA_FLAGS", "value": " ".join(spec.runtime.xla_flags)})
    env += [e.container() for e in spec.runtime.env]  # valueFrom as a reference: the pods resolve it
    return env


def _resources(plan: Plan) -> dict[str, Any]:
    spec = plan.job.spec
    chips = plan.slice.chips_per_host
    return {
        "requests": {**spec.resources.requests, TPU_RESOURCE: chips},
        "limits": {**spec.resources.limits, TPU_RESOURCE: chips},
    }


def trainer_config_json(plan: Plan) -> str:
    """What the ConfigMap holds: the whole job's trainer config (the same whatever slices an elastic job
    runs on: the trainer applies TPUJOB_SLICES to it)."""
    return plan.trainer_config().model_dump_json(by_alias=True, indent=2)


def _volumes(plan: Plan, config_map: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ckpt = plan.job.spec.checkpoint
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if ckpt.persistent_volume_claim:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": ckpt.persistent_volume_claim}})
        mounts.append({"name": "checkpoints", "mountPath": ckpt.directory})
    return volumes, mounts


def applied_spec(job: TPUTrainingJob) -> dict[str, Any]:
    """The spec as the user wrote it (normalised), without the fields that may change on a running job:
    kept on the JobSet, so the controller can name the fields a later edit changed."""
    return job.spec.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude=set(MUTABLE_SPEC_FIELDS))


def applied_spec_text(job: TPUTrainingJob) -> str:
    """`applied_spec` as the JobSet's annotation holds it (canonical JSON: its digest names the spec, drift.py)."""
    return json.dumps(applied_spec(job), sort_keys=True, separators=(",", ":"))


def jobset_metadata(job: TPUTrainingJob) -> tuple[dict[str, str], dict[str, str]]:
    """The JobSet's labels and annotations, as rendered (the pre-flight's admission gate aside: it is added and
    lifted by the operator, controller/preflight.py). Also what a hand edit of them is compared with
    (controller/drift.py), without rendering the rest."""
    labels = {**names.labels(job.metadata.name), **placement.jobset_labels(job.spec)}
    annotations = {
        EXCLUSIVE_TOPOLOGY: placement.NODE_POOL,  # each slice (Job) gets a node pool of its own
        names.APPLIED_SPEC: applied_spec_text(job),
        **placement.jobset_annotations(job.spec),
    }
    return labels, annotations


def context(
    job: TPUTrainingJob,
    default_image: str | None = None,
    running: int | None = None,
    control_digest: str | None = None,
) -> dict[str, Any]:
    """Everything the templates read. `default_image` (the operator's setting) replaces the
    built-in image only where the job does not name one. `running`: the slices an elastic job runs on
    (unset: all); the JobSet's replicas and the pods' process count and MEGASCALE_* follow it, the
    ConfigMap does not. `control_digest`: the SHA-256 of the job's control token (controller/control.py), in
    the pods' env; the ConfigMap does not depend on it either."""
    plan = Plan(job, running)
    spec, name = job.spec, job.metadata.name
    image = default_image if default_image and "image" not in spec.model_fields_set else spec.image
    config_json = trainer_config_json(plan)
    config_map = names.config_map_name(name, config_json)
    volumes, mounts = _volumes(plan, config_map)
    jobset_labels, jobset_annotations = jobset_metadata(job)
    return {
        "job": job,
        "plan": plan,
        "owner": owner_reference(job),
        "names": {"jobset": names.jobset_name(name), "config_map": config_map, "replicated_job": names.REPLICATED_JOB},
        "labels": {**names.labels(name)},
        "jobset_labels": jobset_labels,
        "annotations": jobset_annotations,
        # A queued JobSet starts suspended: Kueue unsuspends it when it admits the job (its webhook would
        # suspend it too; rendering it closes the race where the webhook is not installed yet).
        "suspend": spec.suspend or spec.queue_name is not None,
        "ports": {"jax": names.JAX_COORDINATOR_PORT, "megascale": names.MEGASCALE_PORT},
        "config_file": CONFIG_FILE,
        "config_json": config_json,
        "image": image,
        "command": list(spec.command) if spec.command else DEFAULT_COMMAND,
        "node_selector": {
            **spec.node_selector,  # ours last: a user selector cannot move the job off its TPU or capacity
            **placement.node_selector(spec.tpu),
            "cloud.google.com/gke-tpu-accelerator": plan.gen.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": spec.tpu.topology,
        },
        "tolerations": [
            {"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
            *placement.tolerations(spec.tpu),
            *(t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations),
        ],
        "env": _env(plan, control_digest),
        "resources": _resources(plan),
        "volumes": volumes,
        "volume_mounts": mounts,
        "grace_period_s": plan.termination_grace_period_seconds,
    }


def render(
    job: TPUTrainingJob,
    default_image: str | None = None,
    running: int | None = None,
    control_digest: str | None = None,
) -> list[dict[str, Any]]:
    """The manifests of `job`, in creation order (the ConfigMap before the pods that mount it); `running`
    and `control_digest` as in `context`."""
    ctx = context(job, default_image, running, control_digest)
    return [_render(t, ctx) for t in TEMPLATES]


def _render(template: str, ctx: dict[str, Any]) -> dict[str, Any]:
    return yaml.load(_environment().get_template(template).render(ctx), Loader=_Loader)


def to_yaml_stream(manifests: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=False, default_flow_style=False, width=1 << 16)
