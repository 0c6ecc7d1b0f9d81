"""One name per concept: no two of the product's top-level classes or functions share a name.

The exceptions are protocols, where the same name in several modules is the point: each controller module
that follows something has `follow` (and `decide`, `trim` where it has them) for the status steps to call,
and each command-line module has `main`. Overloads of one function count once."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = {"follow", "decide", "trim", "main"}


def test_no_two_product_classes_or_functions_share_a_name():
    where: dict[str, set[str]] = defaultdict(set)
    for package in ("operator", "workload"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    where[node.name].add(str(path.relative_to(ROOT)))
    assert len(where) > 500
    shared = {name: sorted(paths) for name, paths in where.items() if len(paths) > 1 and not name.startswith("_")}
    assert set(shared) <= PROTOCOLS, {name: paths for name, paths in shared.items() if name not in PROTOCOLS}
