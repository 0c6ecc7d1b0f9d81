"""The label selectors the operator's watches send to the API server (handlers.SERVER_SIDE) say what the handlers'
own `labels=` filters keep, no less (a handler would miss its objects) and no more (the API server would send what
the operator drops, decoded on its one event loop: docs/operator.md, One loop for every tenant)."""

from __future__ import annotations

import kopf

from tpu_operator.controller import handlers
from tpu_operator.controller.main import OperatorOptions, _settings


def _as_filter(selector: str) -> dict:
    terms = (term.split("=", 1) for term in selector.split(","))
    return {t[0]: (t[1] if len(t) == 2 else kopf.PRESENT) for t in terms}


def test_each_watch_selector_is_its_handlers_label_filter():
    assert _as_filter(handlers.SERVER_SIDE[handlers.JOBSET]) == handlers.OURS
    assert _as_filter(handlers.SERVER_SIDE[handlers.PREFLIGHT]) == handlers.OUR_PREFLIGHTS
    assert _as_filter(handlers.SERVER_SIDE[handlers.NODE]) == handlers.TPU_NODES


def test_the_operators_settings_carry_them():
    selectors = dict(_settings(OperatorOptions()).watching.label_selectors.items())
    assert sorted(selectors.values()) == sorted(handlers.SERVER_SIDE.values())
    assert {(s.group, s.version, s.any_name) for s in selectors} == set(handlers.SERVER_SIDE)
