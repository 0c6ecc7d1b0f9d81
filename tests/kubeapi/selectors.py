"""Label and field selectors, parsed as the API server does for `?labelSelector=` / `?fieldSelector=`.

Label selector grammar: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`,
joined by commas (commas inside parentheses belong to the set).
"""

import re
from collections.abc import Callable
from typing import Any

from .errors import bad_request

Predicate = Callable[[dict[str, Any]], bool]

_SET_RE = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_RE = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")
_EXISTS_RE = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside a `(...)` value set."""
    terms, depth, current = [], 0, ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term for term in terms if term.strip()]


def _label_term(term: str) -> Callable[[dict[str, str]], bool]:
    if match := _SET_RE.match(term):
        key, op, raw_values = match.groups()
        values = {value.strip() for value in raw_values.split(",") if value.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQ_RE.match(term):
        key, op, value = match.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := _EXISTS_RE.match(term):
        negated, key = match.groups()
        if negated:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise bad_request(f"unable to parse requirement: {term!r}")


def label_selector(selector: str | None) -> Predicate:
    terms = [_label_term(term) for term in _split_terms(selector or "")]

    def matches(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(term(labels) for term in terms)

    return matches


def _field_value(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    # Field selectors compare strings; an absent field compares as "" (as for metadata.namespace
    # of a cluster-scoped object).
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def field_selector(selector: str | None) -> Predicate:
    checks: list[tuple[str, bool, str]] = []
    for term in _split_terms(selector or ""):
        match = _EQ_RE.match(term)
        if not match:
            raise bad_request(f"invalid field selector: {term!r}")
        path, op, value = match.groups()
        checks.append((path, op != "!=", value))

    def matches(obj: dict[str, Any]) -> bool:
        return all((_field_value(obj, path) == value) == equal for path, equal, value in checks)

    return matches


def selector(params: dict[str, str]) -> Predicate:
    """One predicate for both selectors of a list or watch request."""
    labels = label_selector(params.get("labelSelector"))
    fields = field_selector(params.get("fieldSelector"))
    return lambda obj: labels(obj) and fields(obj)
