"""The packages import one way: megalith < preprocessing < training < evaluation, registry
< deploy < pipelines (evaluation and registry never import each other), and no module
imports itself back through others. Read from the source with ``ast``: module-level and
function-local imports alike, so a cycle cannot hide in a function body."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
LAYER = {
    "megalith": 0,
    "preprocessing": 1,
    "training": 2,
    "evaluation": 3,
    "registry": 3,
    "deploy": 4,
    "pipelines": 5,
}


class Import(NamedTuple):
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        path = self.importer.replace(".", "/")
        return f"{self.importer} ({path}.py:{self.line}) imports {self.imported}"


def our_modules() -> dict[str, Path]:
    modules = {}
    for package in LAYER:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of one of our modules, resolved to the module it loads (``from a.b import
    c`` is ``a.b.c`` when that is a module, else ``a.b``)."""

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    found = []
    for importer, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                imported = resolve(target)
                if imported and imported != importer:
                    found.append(Import(importer, imported, node.lineno))
    return found


def package(module: str) -> str:
    return module.split(".")[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


MODULES = our_modules()
IMPORTS = imports(MODULES)


def test_every_import_points_down_the_layers() -> None:
    wrong = [
        str(edge)
        for edge in IMPORTS
        if package(edge.importer) != package(edge.imported)
        and LAYER[package(edge.imported)] >= LAYER[package(edge.importer)]
    ]
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def test_the_bottom_package_imports_no_stage() -> None:
    wrong = [
        str(edge)
        for edge in IMPORTS
        if package(edge.importer) == "megalith" and package(edge.imported) != "megalith"
    ]
    assert not wrong, "megalith/ must import no stage package:\n" + "\n".join(wrong)


def test_no_module_imports_itself_back() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], Import] = {}
    for edge in IMPORTS:
        edges[edge.importer].add(edge.imported)
        where.setdefault((edge.importer, edge.imported), edge)
    for module in MODULES:
        edges[module]  # every module is a node
    found = []
    for component in cycles(edges):
        members = set(component)
        inside = [str(where[(a, b)]) for a in component for b in sorted(edges[a]) if b in members]
        found.append(" <-> ".join(component) + ":\n  " + "\n  ".join(inside))
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_graph_covers_every_stage() -> None:
    """The checks above read real code: every layer has modules and imports."""
    assert {package(name) for name in MODULES} == set(LAYER)
    assert {package(edge.importer) for edge in IMPORTS} == set(LAYER)
