"""Kubernetes-shaped conditions on the typed status. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from ..api.models import Condition, ConditionStatus


def set_condition(conditions: Sequence[Condition], type_: str, status: ConditionStatus, reason: str, message: str,
                  now: str, generation: int | None = None) -> tuple[Condition, ...]:
    """`conditions` with `type_` set; its lastTransitionTime moves only if `status` changes."""
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else None
    new = Condition(type=type_, status=status, reason=reason, message=message,
                    last_transition_time=since or now, observed_generation=generation)
    if old is None:
        return (*conditions, new)
    return tuple(new if c is old else c for c in conditions)
