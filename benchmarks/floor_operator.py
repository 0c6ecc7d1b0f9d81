"""The floor for benchmarks/operator_load.py: a bare kopf operator that does only the least a
TPUTrainingJob needs, with kopf's defaults: on creation, render the job's JobSet exactly as
`tpujob operator` does, POST it, and write one status. No ConfigMap, no Event, no validation
beyond parsing, no following of the JobSet.

    KUBECONFIG=... python -m kopf run --standalone --namespace default benchmarks/floor_operator.py
"""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes_asyncio import client, config

from tpu_operator.api.validation import parse_job
from tpu_operator.rendering.manifests import render


@kopf.on.startup()
async def connect(memo: kopf.Memo, **_: Any) -> None:
    cfg = client.Configuration()
    await config.load_kube_config(client_configuration=cfg)
    memo.api = client.CustomObjectsApi(client.ApiClient(cfg))


@kopf.on.create("training.tpu-operator.dev", "v1alpha1", "tputrainingjobs")
async def create(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    job = parse_job({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    _, jobset = render(job)
    await memo.api.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", jobset)
    await memo.api.patch_namespaced_custom_object_status(
        "training.tpu-operator.dev",
        "v1alpha1",
        namespace,
        "tputrainingjobs",
        name,
        {"status": {"phase": "Pending", "jobSetName": name}},
        _content_type="application/merge-patch+json",
    )
