"""`meta.k8s.io/v1 Table` rendering: what `kubectl get` asks for and prints.

kubectl sends `Accept: application/json;as=Table;v=v1;g=meta.k8s.io, ...` and prints the
columns the server chooses: for custom resources, Name plus the CRD's additionalPrinterColumns
(or Name, Age when it declares none), with `date` columns rendered as ages, as the real server does.
"""

import datetime
import re
from typing import Any

from .resources import ResourceType

_NAME = {"name": "Name", "type": "string", "format": "name", "priority": 0,
         "description": "Name must be unique within a namespace."}
_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp", "priority": 0,
        "description": "CreationTimestamp is a timestamp representing the server time when this object was created."}
_FILTER = re.compile(r"^\[\?\(@\.([\w.]+)\s*==\s*[\"']([^\"']*)[\"']\)\]$")
_TOKEN = re.compile(r"\.([\w-]+)|(\[\?\([^\]]*\)\])|\[(\d+|\*)\]")


def wants_table(accept: str) -> bool:
    return "as=Table" in accept.replace(" ", "")


def jsonpath(obj: Any, path: str) -> list[Any]:
    """The subset of kubectl JSONPath that printer columns use: fields, [n], [*], [?(@.a=="b")]."""
    values = [obj]
    for field, flt, index in _TOKEN.findall(path.strip().strip("{}")):
        nxt: list[Any] = []
        for value in values:
            if field:
                if isinstance(value, dict) and field in value:
                    nxt.append(value[field])
            elif flt:
                key, wanted = _FILTER.match(flt).groups()
                for item in value if isinstance(value, list) else []:
                    found = jsonpath(item, "." + key)
                    if found and str(found[0]) == wanted:
                        nxt.append(item)
            elif isinstance(value, list):
                if index == "*":
                    nxt.extend(value)
                elif int(index) < len(value):
                    nxt.append(value[int(index)])
        values = nxt
    return values


def age(timestamp: str) -> str:
    try:
        then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except (TypeError, ValueError):
        return "<invalid>"
    seconds = max(int((datetime.datetime.now(datetime.UTC) - then).total_seconds()), 0)
    # kubectl's short human durations: "90s", "5m", "3h", "2d".
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 120 * 60:
        return f"{seconds // 60}m"
    if seconds < 48 * 3600:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def columns(rt: ResourceType) -> list[dict[str, Any]]:
    declared = [dict(col, priority=col.get("priority", 0)) for col in rt.printer_columns]
    return [_NAME, *(declared or [_AGE])]


def _cell(obj: Any, column: dict[str, Any]) -> Any:
    if column is _NAME:
        return obj["metadata"]["name"]
    found = jsonpath(obj, column["jsonPath"])
    if not found:
        return None
    value = found[0] if len(found) == 1 else ",".join(map(str, found))
    if column.get("type") == "date":
        return age(value)
    if column.get("type") == "integer" and isinstance(value, (int, str)) and str(value).lstrip("-").isdigit():
        return int(value)
    return value


def _row_object(obj: dict[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}


def table(rt: ResourceType, objs: list[dict[str, Any]], resource_version: str, include: str | None) -> dict[str, Any]:
    cols = columns(rt)
    definitions = [{key: col.get(key, "") for key in ("name", "type", "format", "description", "priority")}
                   for col in cols]
    rows = []
    for obj in objs:
        row: dict[str, Any] = {"cells": [_cell(obj, col) for col in cols]}
        row_object = _row_object(obj, include or "Metadata")
        if row_object is not None:
            row["object"] = row_object
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": definitions, "rows": rows}
