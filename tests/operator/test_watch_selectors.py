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


def test_a_jobset_or_config_map_that_leaves_its_watch_still_reaches_its_job():
    """A JobSet or ConfigMap whose job label is edited away leaves the label-selected watch as a DELETED event
    without the label: their event handlers filter nothing more than the watch does, so it still reaches the
    manager (controller/drift.py); ConfigMaps are watched by the same label, and never indexed."""
    assert handlers.SERVER_SIDE[handlers.CONFIGMAP] == handlers.SERVER_SIDE[handlers.JOBSET]
    registry = kopf.OperatorRegistry()
    handlers.register(registry, None, None)  # type: ignore[arg-type]  # registering calls neither
    events = {h.id: h for h in registry._watching.get_all_handlers()}
    assert events["jobset"].labels is None and events["configmap"].labels is None
    assert not [h for h in registry._indexing.get_all_handlers() if h.id == "configmap"]
