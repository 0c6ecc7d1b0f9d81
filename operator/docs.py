"""The reference parts of `docs/`, generated from the code: `python -m tpu_operator.docs` rewrites them,
`python -m tpu_operator.docs --check` lists the files that drifted (tests/test_docs.py runs the same check
in the default test run). Run from the repository root.

A doc file is hand-written prose with generated blocks in it:

    <!-- generated: NAME (python -m tpu_operator.docs) -->
    ...
    <!-- end generated: NAME -->

`BLOCKS` maps each NAME to the function that renders it. Each reads the code that is the source:
- `api-spec`, `api-status`, `columns`: the CRD built from the pydantic models (`api/crd.py`'s own walk);
- `phases`: the `Phase` literal and the numbered rule in `controller/phases.py`'s docstring;
- `condition-types`, `conditions`: the controller's table (`controller/conditions.py` `TYPES`) and the
  reasons it passes through; `events`: `event_table()` below (tests/test_docs.py holds the tables to
  the literals the controller passes);
- `trainer-settings` (README): every field under `spec.training`, from the CRD;
- `metrics-operator`: the operator's Prometheus registry (`controller/stats.py`), walked after one sample
  of each series; `metrics-trainer`: `api/trainer_metrics.py`'s `PROMETHEUS`;
- `rbac`: `controller/rbac.py`'s `RBAC_RULES`; `operator-flags`: `tpujob operator`'s argument parser;
  `pins`: `scripts/cluster-versions.env`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_args

ROOT = Path(__file__).resolve().parents[1]  # the repository (docs/ and scripts/ are not in the wheel)
DOCS = ROOT / "docs"
COMMAND = "python -m tpu_operator.docs"
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[a-z-]+) \(python -m tpu_operator\.docs\) -->\n)(?P<body>.*?)"
    r"(<!-- end generated: (?P=name) -->)",
    re.S,
)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- the API (docs/api.md) ----------------------------------------------------------------------------


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = node.get("type", "object")
    if kind == "array":
        return "[]" + _type(node.get("items", {}))
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return "map[string]" + _type(node["additionalProperties"])
    return kind


def _limits(node: dict[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for key, word in (
        ("minimum", ">="),
        ("maximum", "<="),
        ("minLength", "length >="),
        ("maxLength", "length <="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
        ("maxProperties", "keys <="),
    ):
        if key in node:
            strict = node.get("exclusive" + key[0].upper() + key[1:]) is True
            parts.append(f"{word.replace('=', '') if strict else word} {node[key]}")
    if "pattern" in node and len(node["pattern"]) <= 48:
        parts.append(f"pattern `{node['pattern']}`")
    return "; ".join(parts)


def _fields(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, child in node.get("properties", {}).items():
        yield f"{path}.{name}", child
        target = child.get("items", child) if child.get("type") == "array" else child
        suffix = "[]" if child.get("type") == "array" else ""
        yield from _fields(target, f"{path}.{name}{suffix}")


def _row(path: str, node: dict[str, Any]) -> tuple[str, ...]:
    default = "" if "default" not in node else '`""`' if node["default"] == "" else f"`{node['default']}`"
    return (f"`{path}`", _type(node), default, _limits(node), node.get("description", ""))


def _field_tables(schema: dict[str, Any], root: str) -> str:
    """A table of the top-level fields, then one per field that has fields of its own, in the CRD's order."""
    header = ("field", "type", "default", "limits", "description")
    out = [_table(header, [_row(f"{root}.{name}", child) for name, child in schema["properties"].items()])]
    for name, child in schema["properties"].items():
        rows = [
            _row(p, n)
            for p, n in _fields(
                child.get("items", child), f"{root}.{name}" + ("[]" if child.get("type") == "array" else "")
            )
        ]
        if rows:
            out.append(f"### `{root}.{name}`\n\n{child.get('description', '')}\n\n" + _table(header, rows))
    return "\n".join(out)


def api_spec() -> str:
    from .api import crd, models

    schema = crd.definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    required = ", ".join(f"`spec.{f}`" for f in schema["properties"]["spec"].get("required", []))
    fields = models.TPUTrainingJobSpec.model_fields
    by_operator = ", ".join(
        f"`spec.{fields[f].alias or f}` (the operator's `--default-image`; a job with neither is Invalid)"
        if f == "image"
        else f"`spec.{fields[f].alias or f}`"
        for f in sorted(models.OPERATOR_DEFAULTED_FIELDS)
    )
    return (
        f"Required: {required}. Defaulted by the operator, not by the API server, so the CRD shows no "
        f"default: {by_operator}.\n\n" + _field_tables(schema["properties"]["spec"], "spec")
    )


def trainer_settings() -> str:
    """Every field under spec.training (README's trainer section): the CRD's own walk, fewer columns."""
    from .api import crd

    schema = crd.definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    training = schema["properties"]["spec"]["properties"]["training"]
    # A map's keys and a nested DataSpec repeat what their parent row and `training.data` say.
    repeated = ("`training.remat.tensors.", "`training.eval.data.")
    rows = [
        (path, default, description)
        for path, _, default, _, description in (_row(p, n) for p, n in _fields(training, "training"))
        if not path.startswith(repeated)
    ]
    return _table(("setting", "default", "what it does"), rows)


def api_status() -> str:
    from .api import crd

    schema = crd.definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return _field_tables(schema["properties"]["status"], "status")


def columns() -> str:
    from .api import crd

    rows = [
        (c["name"], f"`{c['jsonPath']}`", "`-o wide`" if c.get("priority") else "always") for c in crd.PRINTER_COLUMNS
    ]
    return _table(("column", "from", "shown"), rows)


# --- phases, conditions, Events (docs/status.md) ------------------------------------------------------


def phases() -> str:
    from .api.status import Phase
    from .controller import phases as rule

    listed = ", ".join(f"`{p}`" for p in get_args(Phase))
    doc = rule.__doc__ or ""
    numbered = doc[doc.index("\n1. ") : doc.index("\n\n", doc.index("\n1. ") + 1)].strip("\n")
    return (
        f"Phases: {listed}.\n\nThe rule, first match wins (from `operator/controller/phases.py`, "
        f"`phase_of`):\n\n{numbered}\n"
    )


@dataclasses.dataclass(frozen=True)
class ReasonRow:
    """One (condition type, status, reason) the operator writes, or one Event it posts."""

    kind: str  # the condition type, or the Event's type (Normal | Warning)
    status: str  # True | False | Unknown; "" for an Event
    reason: str
    meaning: str


def condition_table() -> list[ReasonRow]:
    """Every condition type, status and reason the controller writes: `controller/conditions.py`'s
    `TYPES` (each reason's meaning starts with the status it goes with), then the reasons passed through
    from elsewhere, listed from the constants the controller reads them against (the plan's verdicts,
    Kueue's, the kubelet's)."""
    from .api.contract import JOB_MUST_CHANGE, PlanVerdict
    from .controller import diagnosis
    from .controller.conditions import TYPES

    rows = []
    for t in TYPES:
        for r in t.reasons:
            status, _, meaning = r.meaning.partition(": ")
            rows.append(ReasonRow(t.name, status, r.name, meaning + "."))
    could_not_check = [v for v in get_args(PlanVerdict) if v != "Fits" and v not in JOB_MUST_CHANGE]
    rows += [
        *[
            ReasonRow(
                "Planned", "False", v, "the plan's verdict: the job must change (HBM, VMEM, or a flag libtpu refuses)."
            )
            for v in JOB_MUST_CHANGE
        ],
        *[
            ReasonRow(
                "Planned",
                "Unknown",
                v,
                "the plan could not check the job (its verdict); the JobSet is created without the check.",
            )
            for v in could_not_check
        ],
        ReasonRow(
            "Admitted",
            "False",
            "(Kueue's reason)",
            "the Workload's own QuotaReserved reason while it waits "
            "for quota, or its Evicted reason after an eviction (`Preempted`, `PodsReadyTimeout`...).",
        ),
        ReasonRow("Admitted", "False", "Evicted", "Kueue evicted the Workload without a reason of its own."),
        *[
            ReasonRow(
                "ContainersReady",
                "False",
                r,
                "the kubelet's waiting reason: the image cannot be pulled (the message names it).",
            )
            for r in diagnosis.IMAGE_REASONS
        ],
        *[
            ReasonRow(
                "ContainersReady",
                "False",
                r,
                "the kubelet's waiting reason: the container cannot start or keeps failing.",
            )
            for r in diagnosis.START_REASONS
        ],
        ReasonRow(
            "ContainersReady",
            "False",
            "(terminated reason)",
            "a container exited non-zero: its terminated reason (`Error`, `OOMKilled`...) and exit code.",
        ),
        ReasonRow("ContainersReady", "False", "Error", "a container exited non-zero and the kubelet gave no reason."),
    ]
    return rows


def condition_types() -> str:
    """Each condition type, what True means and the status a healthy job shows (its polarity)."""
    from .controller.conditions import TYPES

    return _table(("type", "a healthy job shows", "True means"), [(f"`{t.name}`", t.normal, t.meaning) for t in TYPES])


def event_table() -> list[ReasonRow]:
    """Every Event the controller posts (type, reason). The one source of docs/status.md's Event table; as
    for `condition_table`, point it at the controller's own table once there is one."""
    from .api.contract import PlanVerdict
    from .controller import diagnosis

    could_not_check = ", ".join(
        f"`{v}`" for v in get_args(PlanVerdict) if v not in ("Fits", "DoesNotFit", "VmemOverflow", "RejectedFlags")
    )
    return [
        ReasonRow("Normal", "", "Created", "the ConfigMap and the JobSet were created."),
        ReasonRow(
            "Warning",
            "",
            "Invalid",
            "the spec does not validate, or the API server refuses what it renders (phase Invalid).",
        ),
        ReasonRow("Warning", "", "NameConflict", "a child's name is taken by an object this job does not own."),
        ReasonRow("Warning", "", "SpecChangeRefused", "a spec change after the JobSet exists was refused."),
        ReasonRow(
            "Warning",
            "",
            "ChildEdited",
            "a hand edit of the labels or annotations the operator renders on the JobSet or ConfigMap, or the "
            "ConfigMap's deletion, was put back or is reported (`ChildrenAsMade`), once per edit.",
        ),
        ReasonRow("Normal", "", "Planned", "the pre-flight says the step fits."),
        ReasonRow("Warning", "", "DoesNotFit", "the pre-flight says it does not fit: no JobSet for this spec."),
        ReasonRow(
            "Warning",
            "",
            "(pre-flight reason)",
            "the pre-flight could not check the job: its Planned reason "
            f"({could_not_check}, `DeadlineExceeded`, `PreflightFailed`, `PreflightNotStarted`).",
        ),
        ReasonRow(
            "Warning",
            "",
            "(pod problem)",
            "the pods' most telling problem changed: the Scheduled or "
            "ContainersReady reason (`Unschedulable`, "
            + ", ".join(f"`{r}`" for r in diagnosis.IMAGE_REASONS[:3])
            + ", `CrashLoopBackOff`, `Error`...).",
        ),
        ReasonRow("Normal", "", "Admitted", "Kueue admitted the job."),
        ReasonRow(
            "Normal / Warning",
            "",
            "Queued",
            "the job waits in its Kueue queue (Warning when Kueue says the queue or the job is misconfigured).",
        ),
        ReasonRow(
            "Warning", "", "Evicted", "Kueue evicted the job; it is queued again (counted under restarts.preemption)."
        ),
        ReasonRow("Warning", "", "Restarted", "a failed, preempted or hung attempt is restarted after its backoff."),
        ReasonRow(
            "Warning / Normal",
            "",
            "Resized",
            "an elastic job's next JobSet runs on another slice count: fewer "
            "after a lost slice (Warning), all of them again (Normal).",
        ),
        ReasonRow("Warning", "", "Hung", "no progress for the hang timeout."),
        ReasonRow(
            "Warning",
            "",
            "Diverged",
            "the trainer exited 43: a non-finite loss or gradient norm (step, metric and value in status.divergence); "
            "restarted from the last checkpoint with onDivergence Rewind, else the job fails.",
        ),
        ReasonRow(
            "Warning",
            "",
            "NodesHeld",
            "a node under the job is NotReady while most TPU nodes are: its stop waits (docs/failures.md).",
        ),
        ReasonRow("Normal", "", "NodesReleased", "the hold on the job's nodes is over."),
        ReasonRow(
            "Normal", "", "Suspended", "the JobSet is suspended (a job made suspended has only its `Created` Event)."
        ),
        ReasonRow("Normal", "", "Resumed", "the JobSet is resumed."),
        ReasonRow("Normal", "", "Succeeded", "the job succeeded."),
        ReasonRow("Warning", "", "Failed", "the job failed."),
        ReasonRow("Normal", "", "Profiled", "the trace asked for with the profile annotation is written (its path)."),
        ReasonRow(
            "Warning",
            "",
            "ProfileRefused",
            "the profile annotation's value is not valid, or the trainer refused "
            "the request (steps already run, another trace being captured).",
        ),
    ]


def conditions() -> str:
    rows = [
        (f"`{r.kind}`", r.status, f"`{r.reason}`" if not r.reason.startswith("(") else r.reason, r.meaning)
        for r in condition_table()
    ]
    return _table(("type", "status", "reason", "meaning"), rows)


def events() -> str:
    rows = [(r.kind, f"`{r.reason}`" if not r.reason.startswith("(") else r.reason, r.meaning) for r in event_table()]
    return _table(("type", "reason", "when"), rows)


# --- metrics (docs/metrics.md) ------------------------------------------------------------------------


def _label_values() -> dict[str, str]:
    from .api.failures import Cause
    from .api.goodput import BUCKETS
    from .controller.manager import TRIGGERS

    return {
        "handler": ", ".join(TRIGGERS),
        "bucket": ", ".join(BUCKETS),
        "cause": ", ".join(get_args(Cause)),
        "result": "the reconcile's outcome (`created`, `adopted`, `followed`, `waiting`, `invalid`, `gone`... "
        "as `controller/reconcile.py` returns them); `held` (refused for good, not tried yet) and `echo` "
        "(the watch delivered the operator's own status write: not reconciled) from the manager; `error` (an "
        "exception) and `api_error` (an API error) are retried and counted in "
        "`tpu_operator_reconcile_errors_total` too",
        "namespace": "the job's namespace",
        "job": "the job's name",
        "state": "total (every TPU node), not_ready (Ready False or Unknown)",
    }


def metrics_operator() -> str:
    """The operator's registry after one reconcile and one job's figures, so every series has its labels."""
    from .api.status import TPUTrainingJobStatus
    from .controller.stats import Leadership, Stats

    stats = Stats()
    Leadership(stats.registry)  # registered by a replica run with --leader-elect (controller/main.py)
    stats.observe("job", "done", 0.0)
    stats.job(("ns", "job"), TPUTrainingJobStatus.model_validate({"goodput": 0.5, "badput": {}, "restarts": {}}))
    stats.node_hold(False, 0, 0)
    values, rows = _label_values(), []
    for family in stats.registry.collect():
        # The operator turns off prometheus_client's *_created series (controller/main.py).
        series = sorted({s.name for s in family.samples if not s.name.endswith("_created")})
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        rows.append(
            (
                " ".join(f"`{s}`" for s in series),
                family.type,
                family.documentation,
                "; ".join(f"`{k}`: {values.get(k, '')}" for k in labels),
            )
        )
    return _table(("series", "type", "meaning", "labels"), rows)


def metrics_trainer() -> str:
    from .api.trainer_metrics import PROMETHEUS

    rows = [(f"`{name}`", "gauge", help_, f"`{key}`") for name, key, help_ in PROMETHEUS]
    return _table(("series", "type", "meaning", "/status key"), rows)


# --- operations (docs/operations.md) ------------------------------------------------------------------


def rbac() -> str:
    from .controller.rbac import RBAC_RULES

    rows = [
        (
            ", ".join(f"`{g}`" if g else '`""` (core)' for g in r["apiGroups"]),
            ", ".join(f"`{x}`" for x in r["resources"]),
            ", ".join(r["verbs"]),
        )
        for r in RBAC_RULES
    ]
    return _table(("API group", "resources", "verbs"), rows)


def operator_flags() -> str:
    from .cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    rows = [
        (", ".join(f"`{o}`" for o in a.option_strings), a.help or "")
        for a in sub.choices["operator"]._actions
        if a.option_strings and a.dest != "help"
    ]
    return _table(("flag", "what it does"), rows)


def pins() -> str:
    text = (ROOT / "scripts" / "cluster-versions.env").read_text()
    rows = [tuple(line.split("=", 1)) for line in text.splitlines() if re.match(r"^[A-Z_]+=", line)]
    return _table(("component", "pinned version"), [(f"`{k}`", f"`{v}`") for k, v in rows])


BLOCKS: dict[str, Callable[[], str]] = {
    "api-spec": api_spec,
    "api-status": api_status,
    "columns": columns,
    "phases": phases,
    "condition-types": condition_types,
    "conditions": conditions,
    "events": events,
    "metrics-operator": metrics_operator,
    "metrics-trainer": metrics_trainer,
    "trainer-settings": trainer_settings,
    "rbac": rbac,
    "operator-flags": operator_flags,
    "pins": pins,
}


def regenerate(text: str) -> str:
    """`text` with every generated block rendered again from the code."""

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise KeyError(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        return m.group(1) + BLOCKS[name]() + m.group(4)

    return BLOCK.sub(fill, text)


def drifted(docs: Path = DOCS) -> list[Path]:
    """The doc files (and README) whose generated blocks differ from what the code renders now."""
    files = [*sorted(docs.glob("*.md")), *([ROOT / "README.md"] if docs == DOCS else [])]
    return [p for p in files if regenerate(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="regenerate the reference parts of docs/")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file drifted")
    args = parser.parse_args(argv)
    stale = drifted()
    for path in stale:
        if args.check:
            print(f"{path.relative_to(ROOT)}: drifted from the code; run `{COMMAND}`", file=sys.stderr)
        else:
            path.write_text(regenerate(path.read_text()))
            print(f"wrote {path.relative_to(ROOT)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
