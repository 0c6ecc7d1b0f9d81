"""Structural OpenAPI v3 schemas of CRDs, offline: pruning and validation as the API server does them, for
fast checks of rendered manifests against the real JobSet CRD (tests/jobset_crd.py finds it) in the default test run.
The cluster suite checks the same manifests against a real kube-apiserver and JobSet's own webhooks
(tests/cluster/test_render_admitted.py); this stays because it needs no cluster and no Go.

A CRD's `openAPIV3Schema` is OpenAPI 3.0 with Kubernetes extensions. jsonschema's Draft 4
matches OpenAPI 3.0's keyword semantics (boolean `exclusiveMinimum`), so the schema is
translated into Draft 4 once per CRD version:
- `nullable: true` adds "null" to `type`;
- `x-kubernetes-int-or-string` becomes "integer or string" (structural schemas give it no type);
- `format` is left unchecked (no format checker), so int32/int64/date-time are lenient;
- `x-kubernetes-validations` (CEL) and the list/map-type markers are not enforced.
Unknown fields are pruned before validation unless under `x-kubernetes-preserve-unknown-fields`.
"""

import copy
from typing import Any

import jsonschema

# apiVersion/kind/metadata are the server's business; the CRD schema never prunes them.
_ROOT_KEEP = {"apiVersion", "kind", "metadata"}


def to_jsonschema(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: to_jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_jsonschema(sub) for sub in value]
        elif key in ("nullable", "format", "description", "example", "externalDocs") or key.startswith("x-kubernetes-"):
            continue
        else:
            out[key] = copy.deepcopy(value)
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        int_or_string = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
        # Structural schemas often repeat the anyOf themselves; never overwrite one.
        out = {"allOf": [int_or_string, out]} if "anyOf" in out else {**out, **int_or_string}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def prune(value: Any, schema: dict[str, Any], root: bool = False) -> Any:
    """Drop fields the schema does not declare, returning a pruned copy."""
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return copy.deepcopy(value)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        out = {}
        for key, sub in value.items():
            if root and key in _ROOT_KEEP:
                out[key] = copy.deepcopy(sub)
            elif key in properties:
                out[key] = prune(sub, properties[key])
            elif isinstance(extra, dict):
                out[key] = prune(sub, extra)
            elif extra is True or keep_unknown:
                out[key] = copy.deepcopy(sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"]) for item in value]
    return copy.deepcopy(value)


def _field_path(error: jsonschema.ValidationError) -> str:
    path = ""
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    if error.validator == "required":
        missing = [name for name in error.validator_value if name not in (error.instance or {})]
        if missing:
            path = f"{path}.{missing[0]}" if path else missing[0]
    return path or "<root>"


def _cause(error: jsonschema.ValidationError) -> dict[str, str]:
    field = _field_path(error)
    if error.validator == "required":
        return {"reason": "FieldValueRequired", "message": "Required value", "field": field}
    if error.validator == "enum":
        return {
            "reason": "FieldValueNotSupported",
            "message": f"Unsupported value: {error.instance!r}: supported values: {error.validator_value!r}",
            "field": field,
        }
    if error.validator == "type":
        return {
            "reason": "FieldValueTypeInvalid",
            "message": f"Invalid value: {error.instance!r}: {field} in body must be of type {error.validator_value}",
            "field": field,
        }
    return {"reason": "FieldValueInvalid", "message": f"Invalid value: {error.message}", "field": field}


class SchemaError(ValueError):
    """What the API server would answer with 422 Invalid: `causes` lists each failing field."""

    def __init__(self, message: str, causes: list[dict[str, str]]):
        super().__init__(message)
        self.causes = causes


class CrdSchema:
    """The validator of one served CRD version."""

    def __init__(self, openapi: dict[str, Any] | None):
        self.openapi = openapi or {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        translated = to_jsonschema(self.openapi)
        # metadata is validated by the server's own rules, not the CRD's schema.
        translated.get("properties", {}).pop("metadata", None)
        self.validator = jsonschema.Draft4Validator(translated)

    def admit(self, obj: dict[str, Any], kind: str, group: str) -> dict[str, Any]:
        """Prune then validate; raises SchemaError naming every failing field."""
        pruned = prune(obj, self.openapi, root=True)
        errors = sorted(self.validator.iter_errors(pruned), key=lambda e: list(map(str, e.absolute_path)))
        if errors:
            name = (obj.get("metadata") or {}).get("name", "")
            causes = [_cause(error) for error in errors]
            summary = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
            raise SchemaError(f'{kind}.{group} "{name}" is invalid: {summary}', causes)
        return pruned
