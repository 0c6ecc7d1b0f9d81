"""JobSet's and Kueue's own CRDs and webhook configurations, from the pinned module versions (copied by
scripts/build-cluster.sh from the Go module cache), made to work with controllers that run as local
processes, the way envtest installs them:

- every `clientConfig.service` (admission webhooks, CRD conversion) becomes `url: https://127.0.0.1:PORT/PATH`
  plus `caBundle`, PORT being that controller's own webhook port;
- the kustomize patches the projects ship are applied: JobSet's JSON patches (its pod webhooks get an
  objectSelector, so a pod create is never blocked by JobSet unless it belongs to a JobSet) and the CRD
  patches that turn on conversion webhooks (Kueue's ClusterQueue, LocalQueue, Cohort, Workload...);
- names get the project's prefix, as their kustomize `namePrefix` does (`jobset-`, `kueue-`);
- Kueue registers only what its configuration enables (here the JobSet integration and its own APIs):
  webhooks for other frameworks (pods, Deployments, batch Jobs, Ray...) would fail every such create
  with failurePolicy Fail, so they are left out.

Pure functions over YAML documents; `tests/cluster/test_manifests.py` checks them on the real files.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
KUEUE_GROUPS = {"kueue.x-k8s.io", "jobset.x-k8s.io"}


def documents(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _patch_entries(kustomization: Path) -> list[Doc]:
    return (yaml.safe_load(kustomization.read_text()) or {}).get("patches") or []


def url_config(port: int, path: str, ca_bundle: bytes) -> Doc:
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": base64.b64encode(ca_bundle).decode()}


def crds(component: Path, port: int, ca_bundle: bytes) -> list[Doc]:
    """The component's CRDs (crd/kustomization.yaml's resources) with the conversion webhooks its
    patches turn on, served at 127.0.0.1:`port`."""
    kustomization = component / "crd" / "kustomization.yaml"
    resources = (yaml.safe_load(kustomization.read_text()) or {}).get("resources") or []
    out = {d["metadata"]["name"]: d for r in resources for d in documents(component / "crd" / r)}
    for entry in _patch_entries(kustomization):
        patch = documents(component / "crd" / entry["path"])[0]
        conversion = (patch.get("spec") or {}).get("conversion")
        if not conversion:
            continue  # cert-manager's CA injection: we set caBundle ourselves
        service = conversion["webhook"]["clientConfig"]["service"]
        crd = out[patch["metadata"]["name"]]
        crd["spec"]["conversion"] = {
            **conversion,
            "webhook": {**conversion["webhook"], "clientConfig": url_config(port, service.get("path", "/"), ca_bundle)},
        }
    return list(out.values())


def _json_pointer_set(doc: Any, pointer: str, value: Any, op: str) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    if isinstance(doc, list):
        index = len(doc) if last == "-" else int(last)
        if op == "add":
            doc.insert(index, value)
        else:
            doc[index] = value
    else:
        doc[last] = value


def _apply_kustomize_patches(configs: list[Doc], kustomization: Path, kept: Callable[[Doc], bool]) -> None:
    """JSON6902 patches (`path` + `target`) are applied; an inline strategic-merge patch may only touch
    webhooks that are left out (`kept` false), else this fails rather than install something else."""
    for entry in _patch_entries(kustomization):
        if "target" in entry and "path" in entry:
            ops = yaml.safe_load((kustomization.parent / entry["path"]).read_text())
            for config in configs:
                if config["kind"] == entry["target"]["kind"] and config["metadata"]["name"] == entry["target"]["name"]:
                    for op in ops:
                        if op["op"] not in ("replace", "add"):
                            raise ValueError(f"unsupported JSON patch op {op} in {entry['path']}")
                        _json_pointer_set(config, op["path"], copy.deepcopy(op["value"]), op["op"])
        elif "patch" in entry:
            patch = yaml.safe_load(entry["patch"])
            touched = [w for w in patch.get("webhooks") or [] if kept(w)]
            if touched:
                raise ValueError(
                    f"{kustomization}: an inline patch changes webhooks we register: {[w['name'] for w in touched]}"
                )
        else:
            raise ValueError(f"{kustomization}: unsupported patch entry {entry}")


def webhook_configs(
    component: Path, prefix: str, port: int, ca_bundle: bytes, kept: Callable[[Doc], bool] = lambda webhook: True
) -> list[Doc]:
    """The component's Mutating/ValidatingWebhookConfigurations, patched as its kustomization says,
    renamed `prefix` + name, each webhook calling 127.0.0.1:`port`; webhooks for which `kept` is false
    are left out."""
    kustomization = component / "webhook" / "kustomization.yaml"
    configs = documents(component / "webhook" / "manifests.yaml")
    _apply_kustomize_patches(configs, kustomization, kept)
    for config in configs:
        config["metadata"]["name"] = prefix + config["metadata"]["name"]
        webhooks = []
        for webhook in config.get("webhooks") or []:
            if not kept(webhook):
                continue
            service = webhook["clientConfig"]["service"]
            webhook["clientConfig"] = url_config(port, service.get("path", "/"), ca_bundle)
            webhooks.append(webhook)
        config["webhooks"] = webhooks
    return configs


def kueue_kept(webhook: Doc) -> bool:
    """Kueue's webhooks for its own APIs and for JobSets: the integrations its configuration enables."""
    groups = {group for rule in webhook.get("rules") or [] for group in rule.get("apiGroups") or []}
    return bool(groups) and groups <= KUEUE_GROUPS


def names(docs: Iterable[Doc]) -> list[str]:
    return [d["metadata"]["name"] for d in docs]
