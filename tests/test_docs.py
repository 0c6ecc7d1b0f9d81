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
FIX = "run `.venv/bin/python -m tpu_operator.docs` and commit the result"


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
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                assigned.setdefault(node.targets[0].id, set()).add(node.value.value)
        constants = {k: next(iter(v)) for k, v in assigned.items() if len(v) == 1}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                found.append((path.name, [_strings(a, constants) for a in node.args]))
    return found


# --- what the controller passes to set_condition, followed through its code ---------------------------------


class _Code:
    """The operator's modules, parsed once, and what a condition's argument can be: its string values, found by
    following names to their assignments (a tuple's element, a loop over a dict's items, a dict's values), calls
    to the functions that return them, parameters to their callers' arguments, and `x.field` to the class of x
    (a dataclass's constructor calls, or a property's returns). What cannot be followed is returned as source."""

    def __init__(self) -> None:
        self.trees = {p: ast.parse(p.read_text()) for p in sorted((ROOT / "operator").rglob("*.py"))}
        self.parent: dict[ast.AST, ast.AST] = {}
        self.file: dict[ast.AST, Path] = {}
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.calls: list[ast.Call] = []
        self.constants: dict[str, list[ast.AST]] = {}  # module-level NAME = value, by name, in any module
        self.modules: dict[Path, set[str]] = {}  # the names each file imports (modules among them: status_lib)
        for path, tree in self.trees.items():
            self.modules[path] = {
                (a.asname or a.name).split(".")[0]
                for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names
            }
            for node in ast.walk(tree):
                self.file[node] = path
                for child in ast.iter_child_nodes(node):
                    self.parent[child] = node
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.setdefault(node.name, []).append(node)
                elif isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append(node)
                elif isinstance(node, ast.Call):
                    self.calls.append(node)
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        if isinstance(target, ast.Name):
                            self.constants.setdefault(target.id, []).append(node.value)

    def where(self, node: ast.AST) -> str:
        return f"{self.file[node].relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"

    def function_of(self, node: ast.AST) -> ast.FunctionDef | None:
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    @staticmethod
    def _name(func: ast.AST) -> str | None:
        return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None

    def values(self, node: ast.AST, path: tuple[int, ...] = (), seen: frozenset = frozenset()) -> tuple[set, list]:
        """(the strings element `path` of `node` can be, the source of what could not be followed)."""
        if (node, path) in seen or len(seen) > 40:
            return set(), []
        seen = seen | {(node, path)}
        found: set[str] = set()
        lost: list[str] = []

        def add(result: tuple[set, list]) -> None:
            found.update(result[0])
            lost.extend(result[1])

        if isinstance(node, ast.Constant) and node.value is None:
            pass  # no value (a function's "nothing found"): no reason written
        elif isinstance(node, ast.Constant) and not path:
            if isinstance(node.value, str):
                found.add(node.value)
            else:
                lost.append(self.where(node))
        elif isinstance(node, ast.Tuple) and path:
            add(self.values(node.elts[path[0]], path[1:], seen))
        elif isinstance(node, ast.List) and not path:  # the members an `in` guard allows
            for element in node.elts:
                add(self.values(element, (), seen))
        elif isinstance(node, ast.IfExp):
            add(self.values(node.body, path, seen))
            add(self.values(node.orelse, path, seen))
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                add(self.values(value, path, seen))
        elif isinstance(node, ast.Name):
            add(self.name(node, path, seen))
        elif isinstance(node, ast.Subscript) and self.dicts(node.value, seen):  # a dict's value, whichever key
            for d in self.dicts(node.value, seen):
                for value in d.values:
                    add(self.values(value, path, seen))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and self.dicts(node.func.value, seen)
        ):
            for d in self.dicts(node.func.value, seen):
                for value in d.values:
                    add(self.values(value, path, seen))
            for default in node.args[1:]:
                add(self.values(default, path, seen))
        elif (
            isinstance(node, ast.Call)
            and self._name(node.func) in ("min", "max", "next", "sorted", "list")
            and node.args
        ):  # an element of what it is given
            add(self.values(node.args[0], path, seen))
        elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            add(self.values(node.elt, path, seen))
        elif isinstance(node, ast.Call) and self.followed(node) is not None:
            for function in self.followed(node):
                for ret in (n for n in ast.walk(function) if isinstance(n, ast.Return) and n.value is not None):
                    if self.function_of(ret) is function:
                        add(self.values(ret.value, path, seen))
        elif isinstance(node, ast.Attribute) and not path:
            add(self.attribute(node, seen))
        else:
            lost.append(self.where(node))
        return found, lost

    def followed(self, call: ast.Call) -> list[ast.FunctionDef] | None:
        """The functions a call can be: `f(...)`, or `module.f(...)` through an imported module; not a method
        of a value (`d.get(...)` is no function of the operator's)."""
        func = call.func
        if isinstance(func, ast.Attribute) and not (
            isinstance(func.value, ast.Name) and func.value.id in self.modules[self.file[call]]
        ):
            return None
        return self.functions.get(self._name(func))

    def dicts(self, node: ast.AST, seen: frozenset) -> list[ast.Dict]:
        """The dict literals a name stands for (a module constant or the function's own assignments)."""
        if isinstance(node, ast.Dict):
            return [node]
        if not isinstance(node, ast.Name):
            return []
        function = self.function_of(node)
        bound = (
            [
                a.value
                for a in ast.walk(function)
                if isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in a.targets)
            ]
            if function
            else []
        )
        return [d for value in bound or self.constants.get(node.id, []) for d in self.dicts(value, seen)]

    def name(self, node: ast.Name, path: tuple[int, ...], seen: frozenset) -> tuple[set, list]:
        found: set[str] = set()
        lost: list[str] = []
        if not path and (members := self.guard(node)) is not None:  # used under `if NAME in CONSTANT:`
            return self.values(members, (), seen)
        function = self.function_of(node)
        bindings = []  # (value, path within it) for each binding of the name in its function
        if function is not None:
            for n in ast.walk(function):
                if isinstance(n, ast.Assign):
                    bindings += [(n.value, p + path) for t in n.targets for p in _paths(t, node.id)]
                elif isinstance(n, ast.AnnAssign) and n.value is not None:
                    bindings += [(n.value, p + path) for p in _paths(n.target, node.id)]
                elif isinstance(n, ast.NamedExpr):
                    bindings += [(n.value, p + path) for p in _paths(n.target, node.id)]
                elif isinstance(n, ast.For):
                    for p in _paths(n.target, node.id):  # for key, value in D.items(): the dict's keys or values
                        it = n.iter
                        if (
                            isinstance(it, ast.Call)
                            and isinstance(it.func, ast.Attribute)
                            and it.func.attr == "items"
                            and p
                            and self.dicts(it.func.value, seen)
                        ):
                            for d in self.dicts(it.func.value, seen):
                                for value in d.keys if p[0] == 0 else d.values:
                                    bindings.append((value, p[1:] + path))
                        elif isinstance(it, (ast.Tuple, ast.List, ast.Set)):
                            bindings += [(value, p + path) for value in it.elts]
                        else:
                            lost.append(self.where(n.iter))
            params = [a.arg for a in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs)]
            if not bindings and node.id in params:
                return self.parameter(function, node.id, path, seen)
        if not bindings:
            bindings = [(value, path) for value in self.constants.get(node.id, [])]
        if not bindings:
            lost.append(self.where(node))
        for value, p in bindings:
            result = self.values(value, p, seen)
            found.update(result[0])
            lost.extend(result[1])
        return found, lost

    def guard(self, node: ast.Name) -> ast.AST | None:
        """X, when `node` is in the body of an `if NAME in X:` (its values are X's members)."""
        child, parent = node, self.parent.get(node)
        while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            test = parent.test if isinstance(parent, ast.If) else None
            if (
                isinstance(test, ast.Compare)
                and isinstance(test.left, ast.Name)
                and test.left.id == node.id
                and len(test.ops) == 1
                and isinstance(test.ops[0], ast.In)
                and child in parent.body
            ):
                members = test.comparators[0]
                if isinstance(members, ast.Name):
                    members = next(iter(self.constants.get(members.id, [])), None)
                if isinstance(members, (ast.Tuple, ast.List, ast.Set)):
                    return ast.List(elts=members.elts)
            child, parent = parent, self.parent.get(parent)
        return None

    def parameter(self, function: ast.FunctionDef, name: str, path: tuple[int, ...], seen: frozenset):
        """A parameter: what its callers pass."""
        found: set[str] = set()
        lost: list[str] = []
        params = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
        callers = [c for c in self.calls if self._name(c.func) == function.name]
        if not callers:
            lost.append(
                f"{self.file[function].relative_to(ROOT)}:{function.lineno}: parameter {name} of "
                f"{function.name}, which nothing calls"
            )
        for call in callers:
            given = [k.value for k in call.keywords if k.arg == name]
            if not given and name in params and params.index(name) < len(call.args):
                given = [call.args[params.index(name)]]
            for value in given:
                result = self.values(value, path, seen)
                found.update(result[0])
                lost.extend(result[1])
        return found, lost

    def attribute(self, node: ast.Attribute, seen: frozenset) -> tuple[set, list]:
        """x.field: the class x is (its annotation, or what made it), then that class's constructor calls or the
        property's returns."""
        found: set[str] = set()
        lost: list[str] = []
        classes = self.class_of(node.value)
        if not classes:
            return set(), [self.where(node)]
        for cls in classes:
            prop = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == node.attr), None)
            if prop is not None:
                for ret in (n for n in ast.walk(prop) if isinstance(n, ast.Return) and n.value is not None):
                    result = self.values(ret.value, (), seen)
                    found.update(result[0])
                    lost.extend(result[1])
                continue
            annotated = {
                f.target.id: f.annotation
                for f in cls.body
                if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
            }
            fields = list(annotated)
            if node.attr not in fields:
                lost.append(self.where(node))
                continue
            literal = self.literal(annotated[node.attr])
            if literal is not None:  # a field typed Literal[...] holds one of those, whoever constructs it
                found.update(literal)
                continue
            for call in (c for c in self.calls if self._name(c.func) == cls.name):
                given = [k.value for k in call.keywords if k.arg == node.attr]
                if not given and fields.index(node.attr) < len(call.args):
                    given = [call.args[fields.index(node.attr)]]
                for value in given:  # a field left to its default is no reason written: "" or None
                    result = self.values(value, (), seen)
                    found.update(result[0])
                    lost.extend(result[1])
        return found, lost

    def literal(self, annotation: ast.AST) -> list[str] | None:
        """The strings of a Literal[...] annotation, directly or through a module constant (PlanVerdict)."""
        for value in (
            [annotation]
            if isinstance(annotation, ast.Subscript)
            else self.constants.get(annotation.id, [])
            if isinstance(annotation, ast.Name)
            else []
        ):
            if isinstance(value, ast.Subscript) and self._name(value.value) == "Literal":
                elts = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
                return [e.value for e in elts if isinstance(e, ast.Constant)]
        return None

    def class_named(self, annotation: ast.AST | None) -> list[ast.ClassDef]:
        """The class an annotation names (`X`, `mod.X`, `X | None`, "X")."""
        if isinstance(annotation, ast.BinOp):
            return self.class_named(annotation.left) or self.class_named(annotation.right)
        if annotation is None:
            return []
        return self.classes.get(ast.unparse(annotation).strip("'\"").split(".")[-1], [])

    def class_of(self, node: ast.AST) -> list[ast.ClassDef]:
        if not isinstance(node, ast.Name):
            return []
        function = self.function_of(node)
        if function is None:
            return []
        for arg in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs):
            if arg.arg == node.id and arg.annotation is not None:
                return self.class_named(arg.annotation)
        for n in ast.walk(function):  # x, why = f(...) with f -> tuple[X | None, str]
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and len(n.targets) == 1:
                for i, *_rest in (p for p in _paths(n.targets[0], node.id) if len(p) == 1):
                    for f in self.functions.get(self._name(n.value.func), []):
                        if isinstance(f.returns, ast.Subscript) and isinstance(f.returns.slice, ast.Tuple):
                            return self.class_named(f.returns.slice.elts[i])
        for n in ast.walk(function):
            if (
                isinstance(n, (ast.Assign, ast.NamedExpr))
                and isinstance(n.value, ast.Call)
                and any(
                    isinstance(t, ast.Name) and t.id == node.id
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                )
            ):
                func = n.value.func
                if (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and func.value.id in self.classes
                ):  # Cls.constructor(...)
                    return self.classes[func.value.id]
                made = self._name(func)
                if made in self.classes:
                    return self.classes[made]
                for f in self.functions.get(made, []):
                    if f.returns is not None:
                        return self.class_named(f.returns)
        return []


def _paths(target: ast.AST, name: str, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Where `name` is in an assignment's target: () for the whole value, (i, j) for element j of element i."""
    if isinstance(target, ast.Name):
        return [prefix] if target.id == name else []
    if isinstance(target, (ast.Tuple, ast.List)):
        return [p for i, t in enumerate(target.elts) for p in _paths(t, name, prefix + (i,))]
    return []


def _loop_entries(code: _Code, type_: ast.AST, reason: ast.AST) -> list[tuple[ast.AST, tuple, ast.AST, tuple]] | None:
    """Type and reason bound by one `for key, value in D.items()` over dict literals: (key, path in it, value, path
    in it) per entry, so that each type goes with its own entry's reasons only."""
    if not (isinstance(type_, ast.Name) and isinstance(reason, ast.Name)):
        return None
    function = code.function_of(type_)
    for loop in (n for n in ast.walk(function) if isinstance(n, ast.For)) if function else ():
        (tp, *_), (rp, *_) = _paths(loop.target, type_.id) or [None], _paths(loop.target, reason.id) or [None]
        it = loop.iter
        if tp and rp and isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items":
            entries = [(k, v) for d in code.dicts(it.func.value, frozenset()) for k, v in zip(d.keys, d.values)]
            return [(k if tp[0] == 0 else v, tp[1:], k if rp[0] == 0 else v, rp[1:]) for k, v in entries]
    return None


def condition_writes() -> list[tuple[str, set, list]]:
    """(where, the (type, reason) pairs it can write, what could not be followed) of each set_condition call in
    operator/controller/ (but conditions.py, which defines it)."""
    code = _Code()
    writes = []
    for call in code.calls:
        path = code.file[call]
        if code._name(call.func) != "set_condition" or path.parent.name != "controller" or path.name == "conditions.py":
            continue
        args = {
            **dict(zip(("conditions", "type_", "status", "reason"), call.args)),
            **{k.arg: k.value for k in call.keywords},
        }
        entries = _loop_entries(code, args["type_"], args["reason"]) or [(args["type_"], (), args["reason"], ())]
        pairs: set[tuple[str, str]] = set()
        lost: list[str] = []
        for type_node, type_path, reason_node, reason_path in entries:
            (types, lost_types), (reasons, lost_reasons) = (
                code.values(type_node, type_path),
                code.values(reason_node, reason_path),
            )
            pairs |= {(t, r) for t in types for r in reasons}
            lost += lost_types + [f"{t}: {where}" for t in types for where in lost_reasons]
        writes.append((f"{path.name}:{call.lineno}", pairs, lost))
    return writes


# The operator's own fallbacks where it passes another component's reason through, which the table covers by
# that row ("(terminated reason)", "(Kueue's reason)"), and one it never writes; each must still occur in the code.
NOT_IN_TABLE = {
    ("Reconciled", "ApiError"): "ApiError.reason of a transient error: only permanent ones are shown on the job",
}


def test_every_condition_the_controller_writes_is_in_the_table():
    """Each set_condition call's type and reason, followed through the controller's code to the strings they can
    be (tests/test_docs.py `_Code`), is a row of the table; a reason read from another component's object
    (`x.get("reason")`) only where the table has that type's passed-through row."""
    table = {(r.kind, r.reason) for r in docs.condition_table()}
    passed_through = {r.kind for r in docs.condition_table() if r.reason.startswith("(")}
    writes = condition_writes()
    assert len(writes) > 20, "set_condition calls not found: has the controller changed how it sets conditions?"
    written = {pair for _, pairs, _ in writes for pair in pairs}
    assert {("Ready", "Progressing"), ("Reconciled", "Forbidden"), ("Planned", "DoesNotFit")} <= written, written
    missing = sorted(
        {
            (where, *pair)
            for where, pairs, _ in writes
            for pair in pairs
            if pair not in table and pair not in NOT_IN_TABLE
        }
    )
    assert not missing, f"conditions the controller writes but tpu_operator.docs.condition_table() lacks: {missing}"
    lost = [
        (where, what)
        for where, _, unfollowed in writes
        for what in unfollowed
        if not (what.split(":")[0] in passed_through and what.endswith(".get('reason')"))
    ]
    assert not lost, f"condition types or reasons this test cannot follow to their strings: {lost}"
    assert set(NOT_IN_TABLE) <= written and not set(NOT_IN_TABLE) & table, "NOT_IN_TABLE is out of date"


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
    stale = sorted(
        {r.reason for r in rows if not r.reason.startswith("(") and r.reason not in literals}
        | {r.kind for r in docs.condition_table() if r.kind not in literals}
    )
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
