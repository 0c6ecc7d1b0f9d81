"""The trainer's layout shows its architecture: role subpackages whose docstrings list every module, no
import cycle among its modules (imports at module or function level alike), and an operator that
never imports the trainer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "workload"


def _modules() -> dict[str, Path]:
    found = {}
    for path in WORKLOAD.rglob("*.py"):
        parts = list(path.relative_to(WORKLOAD).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(["tpu_workload", *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tpu_workload modules `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names}
    return {m for m in out if m in modules and m != name}


def test_no_import_cycle_among_the_trainers_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(name) :] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_every_package_docstring_lists_every_module_in_it():
    for init in WORKLOAD.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""
        listed = set(re.findall(r"^[ ]*(\w+)[ ]{2,}\S", doc, re.M))  # `module  what it does` (the formatter may dedent)
        here = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        here |= {p.parent.name for p in init.parent.glob("*/__init__.py")}
        assert here <= listed, f"{init.relative_to(ROOT)} does not list {sorted(here - listed)}"


def test_the_operator_never_imports_the_trainer():
    for path in (ROOT / "operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            assert not any(n.split(".")[0] == "tpu_workload" for n in names), f"{path.relative_to(ROOT)} imports it"
