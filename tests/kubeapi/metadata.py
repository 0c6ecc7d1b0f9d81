"""The API server's own checks of object metadata: names, label syntax, annotation size.

These catch real operator bugs (a rendered name over 63 characters, a label value with a
slash, a last-applied annotation too big to store) that a lenient fake would let through.
"""

import json
import re
from typing import Any

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
MAX_ANNOTATIONS_BYTES = 256 * 1024
# Kinds whose names must be DNS labels (63 characters, no dots), not DNS subdomains.
_LABEL_NAMED = {"Namespace", "Service"}


def _cause(field: str, message: str, reason: str = "FieldValueInvalid") -> dict[str, str]:
    return {"reason": reason, "message": message, "field": field}


def _key_problems(field: str, key: str) -> list[dict[str, str]]:
    prefix, _, name = key.rpartition("/")
    problems = []
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        problems.append(_cause(field, f"Invalid value: {key!r}: prefix part must be a DNS-1123 subdomain"))
    if len(name) > 63 or not _QUALIFIED_NAME.match(name):
        problems.append(_cause(field, f"Invalid value: {key!r}: name part must consist of alphanumeric characters, "
                                      "'-', '_' or '.', start and end with one, and be at most 63 characters"))
    return problems


def problems(kind: str, metadata: dict[str, Any]) -> list[dict[str, str]]:
    """422 causes for the metadata of an object being written; empty when it is fine."""
    found = []
    name = metadata.get("name") or ""
    if kind in _LABEL_NAMED:
        if len(name) > 63 or not _LABEL.match(name):
            found.append(_cause("metadata.name", f"Invalid value: {name!r}: a lowercase RFC 1123 label must consist "
                                                 "of lower case alphanumeric characters or '-', and be at most 63 characters"))
    elif len(name) > 253 or not _SUBDOMAIN.match(name):
        found.append(_cause("metadata.name", f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist "
                                             "of lower case alphanumeric characters, '-' or '.'"))
    for key, value in (metadata.get("labels") or {}).items():
        field = "metadata.labels"
        found += _key_problems(field, key)
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            found.append(_cause(field, f"Invalid value: {value!r}: a valid label must be an empty string or "
                                       "consist of alphanumeric characters, '-', '_' or '.', at most 63 characters"))
    annotations = metadata.get("annotations") or {}
    for key in annotations:
        found += _key_problems("metadata.annotations", key)
    size = sum(len(k) + len(v if isinstance(v, str) else json.dumps(v)) for k, v in annotations.items())
    if size > MAX_ANNOTATIONS_BYTES:
        found.append(_cause("metadata.annotations", f"Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes",
                            "FieldValueTooLong"))
    return found
