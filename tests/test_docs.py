"""docs/ and README: the generated reference parts match the code, the hand-written condition and Event
tables match what the controller writes, the troubleshooting page names every problem, and every link
resolves. Regenerate with `.venv/bin/python -m tpu_operator.docs`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tpu_operator import docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTROLLER = sorted((ROOT / "operator" / "controller").glob("*.py"))
FIX = f"run `.venv/bin/python -m tpu_operator.docs` and commit the result"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_generated_parts_match_the_code(page):
    text = page.read_text()
    assert docs.regenerate(text) == text, f"docs/{page.name} drifted from the code: {FIX}"


def test_every_generator_has_a_place_in_the_docs():
    used = {m.group("name") for page in PAGES for m in docs.BLOCK.finditer(page.read_text())}
    assert used == set(docs.BLOCKS), f"blocks without a page: {set(docs.BLOCKS) - used}"


# --- the condition and Event tables against the controller's code ------------------------------------


def _strings(node: ast.AST, constants: dict[str, str]) -> list[str] | None:
    """The string values an argument can take, when the code spells them out; None when it does not."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        both = (_strings(node.body, constants), _strings(node.orelse, constants))
        return None if None in both else both[0] + both[1]
    if isinstance(node, ast.Name) and node.id in constants:
        return [constants[node.id]]
    return None


def _calls(name: str) -> list[tuple[str, list[list[str] | None]]]:
    """(file, the values of each positional argument) of every call of `name` in the controller."""
    found = []
    for path in CONTROLLER:
        tree = ast.parse(path.read_text())
        assigned: dict[str, set] = {}
        for node in ast.walk(tree):  # names bound to one string constant in the module (COMPILING, reason)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                assigned.setdefault(node.targets[0].id, set()).add(node.value.value)
        constants = {k: next(iter(v)) for k, v in assigned.items() if len(v) == 1}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                found.append((path.name, [_strings(a, constants) for a in node.args]))
    return found


def test_every_condition_the_controller_writes_is_in_the_table():
    table = {(r.kind, r.reason) for r in docs.condition_table()}
    calls = _calls("set_condition")
    assert len(calls) > 10, "set_condition calls not found: has the controller changed how it sets conditions?"
    missing = [(f, t, r) for f, args in calls if args[1] for t in args[1] for r in args[3] or () if (t, r) not in table]
    assert not missing, f"conditions the controller writes but tpu_operator.docs.condition_table() lacks: {missing}"


def test_every_event_the_controller_posts_is_in_the_table():
    table = {r.reason for r in docs.event_table()}
    calls = _calls("Notice")
    assert len(calls) > 10, "Notice(...) calls not found: has the controller changed how it posts Events?"
    missing = [(f, r) for f, args in calls for r in args[1] or () if r not in table]
    assert not missing, f"Events the controller posts but tpu_operator.docs.event_table() lacks: {missing}"


def test_the_tables_list_nothing_the_code_does_not_have():
    source = "".join(p.read_text() for p in (ROOT / "operator").rglob("*.py") if p.name != "docs.py")
    literals = set(re.findall(r"""["']([A-Za-z]+)["']""", source))
    rows = [*docs.condition_table(), *docs.event_table()]
    stale = sorted({r.reason for r in rows if not r.reason.startswith("(") and r.reason not in literals}
                   | {r.kind for r in docs.condition_table() if r.kind not in literals})
    assert not stale, f"condition types, reasons or Events that appear nowhere in operator/: {stale}"


def test_troubleshooting_names_every_problem():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    problems = {r.reason for r in docs.condition_table() if r.status != "True" and r.kind != "Running"}
    problems |= {r.reason for r in docs.event_table() if "Warning" in r.kind}
    unnamed = sorted(r for r in problems if not r.startswith("(") and f"`{r}`" not in text)
    assert not unnamed, f"docs/troubleshooting.md does not say what to do about: {unnamed}"


# --- links --------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (a repeated heading gets -1, -2...)."""
    anchors: set[str] = set()
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"^#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = next(i for i in range(len(anchors) + 1) if (f"{slug}-{i}" if i else slug) not in anchors)
            anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_internal_link_resolves(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_readme_gives_the_test_command_ci_runs():
    """.ci/run runs README's test command; README must still give that exact command."""
    ci = re.search(r"readme_tests\(\) \{ (.*?); \}", (ROOT / ".ci" / "run").read_text()).group(1)
    assert f"```sh\n{ci}\n```" in (ROOT / "README.md").read_text()
