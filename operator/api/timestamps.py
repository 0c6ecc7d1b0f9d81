"""Time at the API boundary: RFC 3339 text outside, aware UTC datetimes inside.

Kubernetes writes times as RFC 3339 (`metav1.Time`: whole seconds, `Z`; `metav1.MicroTime` and other
controllers' fields may carry fractional seconds or an offset). `parse` reads any of them; `format`
writes `metav1.Time`'s form. They are the only two conversions: the status models' time fields are
`Timestamp`s (parsed when a status is read, formatted when it is written), and the controller reads a
`Clock` once per reconcile and computes with datetimes from there on. Tests pass a fake clock.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

UTC = datetime.UTC
Clock = Callable[[], datetime.datetime]  # the current time, aware, in UTC


def parse(text: str) -> datetime.datetime:
    """An RFC 3339 timestamp (`Z` or an offset, fractional seconds or not) as an aware UTC datetime.
    Raises ValueError on anything else."""
    at = datetime.datetime.fromisoformat(text.strip().replace("z", "Z").replace("Z", "+00:00"))
    if at.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return at.astimezone(UTC)


def parse_or_none(text: str | None) -> datetime.datetime | None:
    """`parse`, with None for an absent or unreadable timestamp (another controller's field)."""
    try:
        return parse(text) if text else None
    except ValueError:
        return None


def format(at: datetime.datetime) -> str:  # noqa: A001 - the counterpart of parse, in this module's namespace
    """`metav1.Time`'s form: UTC, whole seconds, `Z`."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now() -> datetime.datetime:
    """The real clock, to the second (what the API keeps of a `metav1.Time`)."""
    return datetime.datetime.now(UTC).replace(microsecond=0)


def _read(value: Any) -> Any:
    """A status time as read: text that is not a time (another version's field) reads as unset, as
    fields the model does not know are ignored."""
    if isinstance(value, str):
        return parse_or_none(value)
    if isinstance(value, datetime.datetime) and value.tzinfo is None:
        raise ValueError("a datetime without a time zone")
    return value


# A status time field (unset: None): a datetime in the model, RFC 3339 text on the wire.
Timestamp = Annotated[
    datetime.datetime | None,
    BeforeValidator(_read),
    PlainSerializer(format, return_type=str, when_used="json-unless-none"),
]
