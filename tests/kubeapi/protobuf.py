"""Decoding of the protobuf bodies kubectl's built-in generators send.

`kubectl create namespace|configmap|secret|serviceaccount NAME` post protobuf, not JSON
(`kubectl apply/create -f` post JSON). Only those kinds are decoded, from the field numbers of
k8s.io/api/core/v1/generated.proto and apimachinery's meta/v1/generated.proto; other kinds get 415.
"""

import base64
from typing import Any

from .errors import ApiError

MAGIC = b"k8s\x00"

# Field number -> (JSON name, how to decode). "str", "int", "bool", "bytes" are scalars;
# "strs" is repeated string; ("map", "str"|"bytes") is map<string, ...>; a dict is a nested message.
_META = {1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"),
         11: ("labels", ("map", "str")), 12: ("annotations", ("map", "str")), 14: ("finalizers", "strs")}
_SCHEMAS: dict[str, dict[int, Any]] = {
    "Namespace": {1: ("metadata", _META), 2: ("spec", {1: ("finalizers", "strs")})},
    "ConfigMap": {1: ("metadata", _META), 2: ("data", ("map", "str")), 3: ("binaryData", ("map", "bytes")),
                  4: ("immutable", "bool")},
    "Secret": {1: ("metadata", _META), 2: ("data", ("map", "bytes")), 3: ("type", "str"),
               4: ("stringData", ("map", "str")), 5: ("immutable", "bool")},
    "ServiceAccount": {1: ("metadata", _META), 4: ("automountServiceAccountToken", "bool")},
}
_UNKNOWN = {1: ("typeMeta", {1: ("apiVersion", "str"), 2: ("kind", "str")}), 2: ("raw", "bytes")}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of a message; values are ints or raw bytes."""
    pos, fields = 0, []
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = int.from_bytes(data[pos:pos + size], "little"), pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.append((number, value))
    return fields


def _decode(data: bytes, schema: dict[int, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for number, value in _fields(data):
        if number not in schema:
            continue  # a field these tests never need (e.g. managedFields)
        name, kind = schema[number]
        if isinstance(kind, dict):
            out[name] = _decode(value, kind)
        elif isinstance(kind, tuple):  # map entries are messages {1: key, 2: value}
            entry = dict(_fields(value))
            raw = entry.get(2, b"")
            out.setdefault(name, {})[entry[1].decode()] = (
                base64.b64encode(raw).decode() if kind[1] == "bytes" else raw.decode())
        elif kind == "strs":
            out.setdefault(name, []).append(value.decode())
        elif kind == "str":
            if value:  # the JSON form omits empty strings
                out[name] = value.decode()
        elif kind == "bytes":
            out[name] = value
        elif kind == "bool":
            out[name] = bool(value)
        else:
            out[name] = value
    return out


def decode(body: bytes) -> dict[str, Any]:
    envelope = _decode(body[len(MAGIC):], _UNKNOWN)
    type_meta = envelope.get("typeMeta") or {}
    kind = type_meta.get("kind", "")
    if kind not in _SCHEMAS:
        raise ApiError(415, f"protobuf bodies of kind {kind or '(unknown)'} are not supported by this test server; "
                            "send JSON (e.g. kubectl apply/create -f FILE)", "UnsupportedMediaType")
    obj = _decode(envelope.get("raw", b""), _SCHEMAS[kind])
    return {"apiVersion": type_meta.get("apiVersion", "v1"), "kind": kind, **obj}
