"""The import rules of the packages, checked over the import graph (imports inside functions count too).

- `spec` (the pipeline language) imports no other package of the project: both planes read it.
- `run` (one pipeline run on disk) imports `spec` only: both planes read and write it.
- `workflows` (the control plane) and `stages` (the data plane) do not import each other. What both need lives in
  `spec` or `run`; what the local runner needs of a stage it gets through the run directory or a subprocess, as a
  pod does.
- No module imports itself back through others (no import cycle).

Each package's `__init__.py` states its rule.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("spec", "run", "workflows", "stages")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` is, or is inside (a name imported from it), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module → the project modules it imports, at any depth of its code."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                if (known := _known(target, modules)) and known != module:
                    graph[module].add(known)
                    if isinstance(node, ast.ImportFrom):
                        break  # `from a.b import c`: c is a module of a.b, or a name in it
        graph.setdefault(module, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    return module.split(".")[0]


def test_spec_imports_no_other_package_of_the_project() -> None:
    graph = import_graph()
    outside = sorted(
        (m, t) for m, targets in graph.items() if _package(m) == "spec" for t in targets if _package(t) != "spec"
    )
    assert not outside, f"spec imports the planes: {outside}"


def test_run_imports_no_other_package_of_the_project_but_spec() -> None:
    graph = import_graph()
    outside = sorted(
        (m, t)
        for m, targets in graph.items()
        if _package(m) == "run"
        for t in targets
        if _package(t) not in ("run", "spec")
    )
    assert not outside, f"run imports the planes: {outside}"


def test_the_planes_do_not_import_each_other() -> None:
    graph = import_graph()
    crossing = sorted(
        (m, t) for m, targets in graph.items() for t in targets if {_package(m), _package(t)} == {"workflows", "stages"}
    )
    assert not crossing, f"imports between the planes: {crossing}"


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_the_graph_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The checker itself: an import inside a function body is an edge like one at the top of the module."""
    graph = import_graph()
    assert "stages.contract" in graph["stages.__main__"]
    source = (REPO / "spec" / "loading.py").read_text(encoding="utf-8")
    assert "    from spec import variants" in source and "spec.variants" in graph["spec.loading"]


def test_the_checker_finds_a_cycle_and_a_crossing() -> None:
    """The checker itself: a two-module loop is a cycle, a chain is not; a crossing import is seen as one."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert {_package("workflows.local"), _package("stages.contract")} == {"workflows", "stages"}
