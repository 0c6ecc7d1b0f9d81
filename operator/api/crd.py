"""Generate the TPUTrainingJob CRD from the pydantic models (`tpujob crd`): the spec of `models.py`, the status
of `status.py`.

pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 schema. The
conversion inlines $refs, turns `X | None` into `nullable`, int-or-"auto" into
x-kubernetes-int-or-string, enumerated map keys into explicit properties, and drops what the
API server rejects (additionalProperties: false next to properties, titles, object defaults).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel

from . import models
from .status import TPUTrainingJobStatus

CRD_FILE = "tputrainingjob.yaml"
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Topology", "type": "string", "jsonPath": ".spec.tpu.topology"},
    {"name": "Slices", "type": "string", "jsonPath": ".status.slices.shown"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "MFU", "type": "number", "jsonPath": ".status.mfu"},
    {"name": "Step Time", "type": "number", "jsonPath": ".status.stepTimeSeconds"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.tokensPerSecond", "priority": 1},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts.total", "priority": 1},
    {"name": "Preemptions", "type": "integer", "jsonPath": ".status.restarts.preemption", "priority": 1},
    {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},  # why Queued or Pending
]


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = _structural(defs[node["$ref"].split("/")[-1]], defs)
        return {**target, **({"description": node["description"]} if "description" in node else {})}
    out: dict[str, Any] = {}
    variants = node.get("anyOf")
    if variants:
        non_null = [v for v in variants if v.get("type") != "null"]
        if len(non_null) < len(variants):
            out["nullable"] = True
        if len(non_null) == 1:
            out.update(_structural(non_null[0], defs))
        else:
            types = {v.get("type") for v in non_null}
            if types != {"integer", "string"}:
                raise ValueError(f"cannot express union {variants} in a structural schema")
            # int or a keyword ("auto"): minimum applies to integers only, pattern to strings only.
            out["x-kubernetes-int-or-string"] = True
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            for v in non_null:
                out.update({k: v[k] for k in ("minimum", "maximum") if k in v})
                if "enum" in v or "const" in v:
                    out["pattern"] = "^(" + "|".join(v.get("enum", [v.get("const")])) + ")$"
    for key, value in node.items():
        if key in {
            "anyOf",
            "$ref",
            "title",
            "$defs",
            "additionalProperties",
            "propertyNames",
            "properties",
            "patternProperties",
            "items",
            "exclusiveMinimum",
            "exclusiveMaximum",
            "const",
        }:
            continue
        if key == "default" and (isinstance(value, (dict, list)) or value is None):
            continue
        out[key] = value
    if "const" in node:
        out["enum"] = [node["const"]]
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node:
            out[key.replace("exclusiveM", "m")] = node[key]
            out[key] = True
    if "properties" in node:
        out["properties"] = {k: _structural(v, defs) for k, v in node["properties"].items()}
    if "items" in node:
        out["items"] = _structural(node["items"], defs)
    if isinstance(node.get("additionalProperties"), dict):
        value_schema = _structural(node["additionalProperties"], defs)
        keys = node.get("propertyNames", {}).get("enum")
        if keys:  # enumerated keys: list them, so the API server prunes any other key
            out["properties"] = {k: value_schema for k in keys}
        else:
            out["additionalProperties"] = value_schema
    if node.get("patternProperties"):
        # A structural schema has no patternProperties (the API server refuses the CRD): the values'
        # schema becomes additionalProperties and the keys' pattern a CEL rule on the map.
        ((pattern, value), *more) = node["patternProperties"].items()
        if more:
            raise ValueError(f"cannot express several key patterns {list(node['patternProperties'])} structurally")
        out["additionalProperties"] = _structural(value, defs)
        out["x-kubernetes-validations"] = [
            {"rule": f"self.all(k, k.matches(r'{pattern}'))", "message": f"every key must match {pattern}"}
        ]
        if "maxLength" in node.get("propertyNames", {}):
            out["x-kubernetes-validations"].append(
                {
                    "rule": f"self.all(k, size(k) <= {node['propertyNames']['maxLength']})",
                    "message": f"every key is at most {node['propertyNames']['maxLength']} characters",
                }
            )
    return out


def _schema(model: type[BaseModel], **kw: Any) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, **kw)
    return _structural(raw, raw.get("$defs", {}))


def immutability_rules(spec_schema: dict[str, Any]) -> list[dict[str, Any]]:
    """CEL rules on the whole object, one per spec field outside `models.MUTABLE_SPEC_FIELDS`: once the job
    has a JobSet (`status.jobSetName`, written when the operator created it), an update that changes the
    field is refused by the API server, `kubectl apply` included. Before that (an Invalid job, one whose
    pre-flight said it does not fit) the spec may still be fixed. CEL sees only the job itself, so a change
    that lands between the JobSet's creation and that status write is caught after the fact by the
    operator (SpecChange=False, controller/reconcile.py)."""
    aliases = {models.TPUTrainingJobSpec.model_fields[f].alias or f for f in models.MUTABLE_SPEC_FIELDS}
    rules = []
    for field in spec_schema["properties"]:
        if field in aliases:
            continue
        new, old = f"self.spec.{field}", f"oldSelf.spec.{field}"
        rules.append(
            {
                "rule": f"!has(oldSelf.status) || !has(oldSelf.status.jobSetName) || "
                f"(has({new}) == has({old}) && (!has({new}) || {new} == {old}))",
                "fieldPath": f".spec.{field}",
                "reason": "FieldValueForbidden",
                "message": f"spec.{field} cannot change once the job has its JobSet (only "
                f"{', '.join('spec.' + a for a in sorted(aliases))} can): delete the job and create it again",
            }
        )
    return rules


# Fields newer than the previous chart's operator that have a default: the API server would write it into every
# job it stores, and the previous operator (still running during `helm upgrade`, or again after `helm rollback`)
# refuses a field it does not know, so the job would turn Invalid under it (tests/cluster/test_upgrade.py). The
# CRD leaves them unset; the models fill them in when the job is read.
NO_SERVER_DEFAULT = (
    ("training", "objective"),
    ("training", "data", "textField"),
    ("training", "eval", "data", "textField"),
)


def _drop_default(schema: dict[str, Any], path: tuple[str, ...]) -> None:
    for name in path:
        schema = schema["properties"][name]
    schema.pop("default", None)


def definition() -> dict[str, Any]:
    spec_schema = _schema(models.TPUTrainingJobSpec)
    for field in models.OPERATOR_DEFAULTED_FIELDS:  # the API server would fill them in: unset must stay unset
        spec_schema["properties"][models.TPUTrainingJobSpec.model_fields[field].alias or field].pop("default", None)
    for path in NO_SERVER_DEFAULT:
        _drop_default(spec_schema, path)
    status_schema = _schema(TPUTrainingJobStatus, mode="serialization")
    status_schema["properties"]["conditions"].update(
        {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{models.PLURAL}.{models.GROUP}"},
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": models.SHORT_NAMES,
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A JAX training run on Cloud TPU slices, run as a JobSet.",
                            "required": ["spec"],
                            "x-kubernetes-validations": immutability_rules(spec_schema),
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


class _NoAliases(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no types: SafeDumper is Any
    """Repeated sub-schemas are written out in full: kubectl and humans read the CRD, not anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml() -> str:
    header = "# Generated by `tpujob crd` from operator/api/models.py. Do not edit by hand.\n"
    body: str = yaml.dump(definition(), Dumper=_NoAliases, sort_keys=False, width=120)
    return header + body


def committed() -> str:
    """The CRD file shipped in the package (crds/ in the repository)."""
    return resources.files("tpu_operator.crds").joinpath(CRD_FILE).read_text()
