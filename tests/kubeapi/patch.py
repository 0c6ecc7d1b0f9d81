"""The three PATCH flavours clients send: JSON merge, JSON (RFC 6902), and strategic merge.

Strategic merge is approximated: a merge patch whose lists of named dicts (containers,
env, volumes, ports, conditions...) merge by `name` instead of being replaced, and whose
`$`-directives (`$setElementOrder/...`, `$retainKeys`) are dropped. That covers what
`kubectl apply` sends for built-in kinds; custom resources get merge patches from kubectl anyway.
"""

import copy
from typing import Any

from .errors import ApiError, bad_request

MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif strategic and _named_list(value) and _named_list(result.get(key)):
            result[key] = _merge_named_lists(result[key], value)
        else:
            result[key] = merge_patch(result.get(key), value, strategic)
    return result


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and "name" in v for v in value)


def _merge_named_lists(original: list[dict], patch: list[dict]) -> list[dict]:
    merged = {item["name"]: item for item in original}
    order = [item["name"] for item in original]
    for item in patch:
        name = item["name"]
        if item.get("$patch") == "delete":
            merged.pop(name, None)
            continue
        if name not in merged:
            order.append(name)
        merged[name] = merge_patch(merged.get(name), item, strategic=True)
    return [merged[name] for name in order if name in merged]


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"invalid JSON pointer: {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent, last = _resolve(doc, parts[:-1]), parts[-1]
    if isinstance(parent, list):
        parent.insert(len(parent) if last == "-" else int(last), value)
    else:
        parent[last] = value
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    parent, last = _resolve(doc, parts[:-1]), parts[-1]
    if isinstance(parent, list):
        return parent.pop(int(last))
    return parent.pop(last)


def json_patch(target: Any, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise bad_request("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        try:
            parts = _pointer(op["path"])
            match op["op"]:
                case "add":
                    doc = _add(doc, parts, copy.deepcopy(op["value"]))
                case "remove":
                    _remove(doc, parts)
                case "replace":
                    _resolve(doc, parts)  # must exist
                    if parts:
                        _remove(doc, parts)
                    doc = _add(doc, parts, copy.deepcopy(op["value"]))
                case "move":
                    value = _remove(doc, _pointer(op["from"]))
                    doc = _add(doc, parts, value)
                case "copy":
                    doc = _add(doc, parts, copy.deepcopy(_resolve(doc, _pointer(op["from"]))))
                case "test":
                    if _resolve(doc, parts) != op["value"]:
                        raise ApiError(422, f"the test operation failed at {op['path']}", "Invalid")
                case other:
                    raise bad_request(f"unknown JSON patch operation: {other!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, f"the JSON patch cannot be applied: {op!r}: {exc!r}", "Invalid") from exc
    return doc


def apply_patch(content_type: str, target: dict[str, Any], patch: Any) -> dict[str, Any]:
    kind = content_type.split(";")[0].strip()
    if kind == MERGE:
        return merge_patch(target, patch)
    if kind == STRATEGIC:
        return merge_patch(target, patch, strategic=True)
    if kind == JSON:
        return json_patch(target, patch)
    raise ApiError(415, f"the body of the request was in an unknown format: {kind or '(none)'}; "
                        f"accepted: {JSON}, {MERGE}, {STRATEGIC}", "UnsupportedMediaType")
