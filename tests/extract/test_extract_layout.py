"""extract/'s shape (issue 34.2): one job framework (`extract.jobs`) that extraction and
generation sit beside, no circle between its files or folders, no private name imported
across modules. Read from the source with `ast`; nothing is imported or run."""

from __future__ import annotations

import ast
from pathlib import Path

from paths import REPO

EXTRACT = REPO / "extract"


def _module(path: Path) -> str:
    parts = list(path.relative_to(EXTRACT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, list[tuple[str, list[str]]]]:
    """module -> [(imported module, names)] for every import in it, function bodies included."""
    found = {}
    for path in sorted(EXTRACT.rglob("*.py")):
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found[module] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                found[module].append((target, [alias.name for alias in node.names]))
            elif isinstance(node, ast.Import):
                found[module].extend((alias.name, []) for alias in node.names)
    return found


def _edges(imports) -> dict[str, set[str]]:
    modules = set(imports)
    edges = {}
    for module, targets in imports.items():
        edges[module] = set()
        for target, names in targets:
            for candidate in [target, *(f"{target}.{name}" for name in names)]:
                if candidate in modules and candidate != module:
                    edges[module].add(candidate)
    return edges


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _folder(module: str) -> str:
    """A sub-package is one node; a file at extract/'s top level is its own."""
    return ".".join(module.split(".")[:2])


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_circle_between_extract_files_or_folders():
    edges = _edges(_imports())
    assert _circles(edges) == []
    folders = {}
    for module, targets in edges.items():
        folders.setdefault(_folder(module), set()).update(_folder(t) for t in targets if _folder(t) != _folder(module))
    assert _circles(folders) == []


def test_extraction_and_generation_import_only_the_framework_corpus_code_and_store_schema():
    edges = _edges(_imports())
    for side, other in (("extract.extraction", "extract.generate"), ("extract.generate", "extract.extraction")):
        crossing = sorted(
            (m, t)
            for m, targets in edges.items()
            if _inside(m, side)
            for t in targets
            if _inside(t, other) or t == "extract.__main__"
        )
        assert crossing == [], crossing
    framework = sorted(
        (m, t)
        for m, targets in edges.items()
        if _inside(m, "extract.jobs")
        for t in targets
        if _inside(t, "extract.extraction") or _inside(t, "extract.generate")
    )
    assert framework == [], framework  # the framework knows neither job


def test_no_private_name_is_imported_across_modules():
    private = sorted(
        (module, target, name)
        for module, targets in _imports().items()
        for target, names in targets
        if target and target.startswith("extract")
        for name in names
        if name.startswith("_")
    )
    assert private == [], private
