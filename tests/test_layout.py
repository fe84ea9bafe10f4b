"""The layout holds: every package is installed, and no module of distdoctor imports itself back."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATALOGS = {"rules": "distdoctor.rules", "probes": "distdoctor.probes"}


def _module_files() -> dict[str, Path]:
    """Every module of the product by its installed name."""
    found: dict[str, Path] = {}
    for top, package in [("distdoctor", "distdoctor"), *CATALOGS.items()]:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT / top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(re.findall(r'"(distdoctor[\w.]*)"', (ROOT / "pyproject.toml").read_text().split("packages = [", 1)[1].split("]", 1)[0]))
    packages = {name for name, path in _module_files().items() if path.name == "__init__.py"}
    assert packages == listed


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules it imports (at the top or inside functions), among `files`."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module and not files[name].name == "__init__.py":
                    targets.add(name)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's modules (strongly connected components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("import a\n")
    graph = import_graph({name: tmp_path / f"{name}.py" for name in "abc"})
    assert import_cycles(graph) == [["a", "b"]]


def test_no_module_is_imported_in_a_circle():
    graph = import_graph(_module_files())
    assert "distdoctor.probe.script.hooks" in graph["distdoctor.probe.script.horovod_hooks"]  # the graph is read
    assert import_cycles(graph) == []


def test_the_rule_catalog_lists_exactly_the_rules():
    # Selection reads distdoctor/data/rules.json so that a run whose files no rule can read never
    # imports the rules; it must say what the rule classes say (`python -m distdoctor.lint.catalog`).
    from distdoctor.lint.catalog import catalog, from_rules

    assert catalog() == from_rules(), "distdoctor/data/rules.json is stale: run python -m distdoctor.lint.catalog"
