"""The operator's modules import one another one way: no import cycle, whether the import is at module level
or inside a function, and no `if TYPE_CHECKING:` import (the usual way to hide a cycle)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "operator"
PACKAGE = "tpu_operator"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every tpu_operator module `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_in_the_operator():
    graph = _graph()
    assert len(graph) > 50 and graph["tpu_operator.api.failures"] >= {"tpu_operator.api.spec"}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_type_checking_imports():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "TYPE_CHECKING" in p.read_text()]
    assert not offenders


def _listed(package: str) -> list[str]:
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()), clean=False) or ""
    # `module  what it does`, one per line (the formatter may take the lines' indent away)
    return re.findall(r"^[ ]*(\w+)[ ]{2,}\S", doc, re.M)


def test_each_package_docstring_lists_every_module():
    for package in ("api", "rendering", "controller", "local"):
        modules = {p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
        assert sorted(_listed(package)) == sorted(modules), package


def test_api_modules_import_only_those_listed_above_them():
    graph, order = _graph(), _listed("api")
    for i, name in enumerate(order):
        later = {f"{PACKAGE}.api.{m}" for m in order[i:]}
        assert not graph[f"{PACKAGE}.api.{name}"] & later, name
