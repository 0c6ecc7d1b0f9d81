"""`GET /openapi/v2`: the Swagger 2.0 document of the kinds this server has a schema for, as JSON or protobuf.

What the clients do with it (seen with `helm --debug` 3.10.1 and `kubectl -v=6` 1.32):
- both fetch it through client-go's `OpenAPISchema()`, which sends `Accept: PROTOBUF` and decodes the
  body as gnostic's `openapi.v2.Document` whatever comes back: JSON is not a fallback for them (a 404,
  403 or 406 makes client-go try `/swagger-2.0.0.pb-v1`, protobuf too). kube-apiserver answers by the
  Accept header, so this does: protobuf, JSON (also for no Accept or `*/*`), else 406.
- helm validates every manifest against it, and the Namespace of `--create-namespace` even with
  `--disable-openapi-validation`; kubectl validates on its side (`--validate=strict`, after asking
  `/openapi/v3`, which is 404 here). Both look a kind up by the `x-kubernetes-group-version-kind` of a
  definition and skip the validation of a kind that has none.

What it holds: one definition per served CRD version, named as kube-apiserver names it (`<reversed
group>.<version>.<Kind>`), converted from its openAPIV3Schema as kube-apiserver converts it for v2
(apiextensions-apiserver's ToStructuralOpenAPIV2): allOf/anyOf/oneOf/not dropped; a nullable schema
loses its type, properties and items, and its name leaves its parent's `required`; one with
`x-kubernetes-preserve-unknown-fields` loses its properties and items (at the root: only `type:
object` is left); an array left without items loses its type; `apiVersion` and `kind` are added.
Not served: built-in kinds (there are no Go types here to derive them from, so clients skip their
validation), the ObjectMeta definition (`metadata` is an untyped object), the List kinds, and
`paths` (empty: clients then see no server-side field validation and validate on their side, which
is true of this server).
"""

import json
import re
import struct
from collections.abc import Iterable
from typing import Any

from .errors import ApiError
from .resources import ResourceType

PROTOBUF = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
PROTOBUF_RETURNED = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"  # kube-openapi's spelling
JSON = "application/json"

# Schema keyword -> (field number in gnostic's OpenAPIv2.proto `message Schema`, encoding).
_SCHEMA_FIELDS: dict[str, tuple[int, str]] = {
    "$ref": (1, "string"), "format": (2, "string"), "title": (3, "string"), "description": (4, "string"),
    "default": (5, "any"), "multipleOf": (6, "double"), "maximum": (7, "double"), "exclusiveMaximum": (8, "bool"),
    "minimum": (9, "double"), "exclusiveMinimum": (10, "bool"), "maxLength": (11, "int"), "minLength": (12, "int"),
    "pattern": (13, "string"), "maxItems": (14, "int"), "minItems": (15, "int"), "uniqueItems": (16, "bool"),
    "maxProperties": (17, "int"), "minProperties": (18, "int"), "required": (19, "strings"), "enum": (20, "anys"),
    "additionalProperties": (21, "additional"), "type": (22, "type"), "items": (23, "items"),
    "properties": (25, "properties"), "example": (30, "any"),
}
_VENDOR_EXTENSIONS = 31
_DROPPED_FOR_V2 = ("allOf", "anyOf", "oneOf", "not")
_TYPE_META = {
    "apiVersion": {"type": "string", "description": "The versioned schema of this representation of an object."},
    "kind": {"type": "string", "description": "The REST resource this object represents."},
}


# --- the document ------------------------------------------------------------------------------------


def definition_name(group: str, version: str, kind: str) -> str:
    """`example.com`, `v1`, `Widget` -> `com.example.v1.Widget`, as kube-openapi's ToRESTFriendlyName."""
    return ".".join([*reversed(group.split(".")), version, kind])


def to_v2(schema: dict[str, Any]) -> dict[str, Any]:
    """One structural OpenAPI v3 schema as kube-apiserver publishes it in OpenAPI v2."""
    out = {key: value for key, value in schema.items()
           if (key in _SCHEMA_FIELDS or key.startswith("x-")) and key not in _DROPPED_FOR_V2}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: to_v2(sub) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = to_v2(out[key])
    if schema.get("nullable"):
        for key in ("type", "items", "properties"):
            out.pop(key, None)
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("items", None)
        out.pop("properties", None)
    if out.get("type") == "array" and "items" not in out:
        out.pop("type")
    nullable = {name for name, sub in (schema.get("properties") or {}).items() if sub.get("nullable")}
    extra = schema.get("additionalProperties")
    required = [] if isinstance(extra, dict) and extra.get("nullable") else \
        [name for name in out.get("required") or [] if name not in nullable]
    if required:
        out["required"] = required
    else:
        out.pop("required", None)
    return out


def kind_definition(rt: ResourceType) -> dict[str, Any]:
    schema = rt.schema.openapi
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        out: dict[str, Any] = {"type": "object"}  # kubectl would call every field unknown otherwise
    else:
        out = to_v2(schema)
        out["properties"] = {**_TYPE_META, **(out.get("properties") or {}), "metadata": {"type": "object"}}
    out["x-kubernetes-group-version-kind"] = [{"group": rt.group, "version": rt.version, "kind": rt.kind}]
    return out


def document(types: Iterable[ResourceType], version: str) -> dict[str, Any]:
    """The Swagger 2.0 document of every served CRD version among `types`."""
    definitions = {definition_name(rt.group, rt.version, rt.kind): kind_definition(rt)
                   for rt in types if rt.from_crd and rt.schema is not None}
    return {"swagger": "2.0", "info": {"title": "Kubernetes", "version": version}, "paths": {},
            "definitions": dict(sorted(definitions.items()))}


# --- content negotiation -------------------------------------------------------------------------------


def negotiate(accept: str) -> str:
    """PROTOBUF or JSON for an Accept header, by quality then order, as kube-openapi's handler picks."""
    clauses = []
    for i, clause in enumerate(part.strip() for part in (accept or "*/*").split(",")):
        media, *params = [p.strip() for p in clause.split(";")]
        q = next((float(p[2:]) for p in params if re.fullmatch(r"q=[0-9.]+", p)), 1.0)
        if media and q > 0:
            clauses.append((-q, i, media))
    for _, _, media in sorted(clauses):
        if media in (PROTOBUF, PROTOBUF_RETURNED):
            return PROTOBUF
        if media in (JSON, "application/*", "*/*"):
            return JSON
    raise ApiError(406, f"only {JSON} and {PROTOBUF} are served here, not {accept!r}", "NotAcceptable")


# --- protobuf (gnostic's openapi.v2.Document) ----------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 two's complement for negatives
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _len(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _string(number: int, text: str) -> bytes:
    return _len(number, text.encode())


def _any(number: int, value: Any) -> bytes:
    """gnostic's `Any` keeps a value as YAML text (field 2); JSON is YAML."""
    return _len(number, _string(2, json.dumps(value)))


def _named_any(name: str, value: Any) -> bytes:
    return _string(1, name) + _any(2, value)


def schema_message(schema: dict[str, Any]) -> bytes:
    out = bytearray()
    for key, value in schema.items():
        if key.startswith("x-"):
            out += _len(_VENDOR_EXTENSIONS, _named_any(key, value))
            continue
        number, kind = _SCHEMA_FIELDS[key]
        if kind == "string":
            out += _string(number, value)
        elif kind == "double":
            out += _varint(number << 3 | 1) + struct.pack("<d", float(value))
        elif kind == "bool":
            out += _varint(number << 3) + _varint(int(bool(value)))
        elif kind == "int":
            out += _varint(number << 3) + _varint(int(value))
        elif kind == "any":
            out += _any(number, value)
        elif kind == "strings":
            out += b"".join(_string(number, item) for item in value)
        elif kind == "anys":
            out += b"".join(_any(number, item) for item in value)
        elif kind == "type":  # TypeItem { repeated string value = 1 }
            out += _len(number, b"".join(_string(1, t) for t in ([value] if isinstance(value, str) else value)))
        elif kind == "items":  # ItemsItem { repeated Schema schema = 1 }
            schemas = [value] if isinstance(value, dict) else value
            out += _len(number, b"".join(_len(1, schema_message(s)) for s in schemas))
        elif kind == "additional":  # AdditionalPropertiesItem { oneof { Schema schema = 1; bool boolean = 2 } }
            inner = _len(1, schema_message(value)) if isinstance(value, dict) else _varint(2 << 3) + _varint(int(value))
            out += _len(number, inner)
        elif kind == "properties":  # Properties { repeated NamedSchema additional_properties = 1 }
            out += _len(number, b"".join(_len(1, _string(1, name) + _len(2, schema_message(sub)))
                                         for name, sub in value.items()))
    return bytes(out)


def document_message(doc: dict[str, Any]) -> bytes:
    """The protobuf form: Document { swagger = 1; info = 2 {title = 1; version = 2}; paths = 8; definitions = 9 }."""
    info = _string(1, doc["info"]["title"]) + _string(2, doc["info"]["version"])
    definitions = b"".join(_len(1, _string(1, name) + _len(2, schema_message(schema)))
                           for name, schema in doc["definitions"].items())
    return _string(1, doc["swagger"]) + _len(2, info) + _len(8, b"") + _len(9, definitions)
