"""One reader of the product's import graph, for every structure rule (tests/test_structure.py,
and the package rules of train/ and extract/): modules parsed with `ast` (nothing imported
or run), the modules each import statement names (imports inside functions included),
edges between any grouping of modules, and the circles among them."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from paths import REPO

PACKAGES = ("store_schema", "extract", "train")


def modules(package: str) -> dict[str, tuple[Path, ast.Module]]:
    """Dotted module name -> (path, parsed source) for every file of `package`."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = (path, ast.parse(path.read_text(), filename=str(path)))
    return found


def imported(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    """The modules (or `module.name`s) an import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def imports_of(found: dict) -> dict[str, set[str]]:
    """Module -> the modules of `found` it imports (itself and the package's root left out)."""
    roots = {name.split(".")[0] for name in found}
    result = {}
    for name, (path, tree) in found.items():
        result[name] = {
            target
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for target in imported(name, node, path.name == "__init__.py")
            if target in found and target != name and target not in roots
        }
    return result


def edges_between(found: dict, node_of: Callable[[str], str], leave_out=()) -> dict[str, set[str]]:
    """Node -> the nodes it imports, `node_of` naming each module's node; modules in
    `leave_out` (an entry point above everything) are not read."""
    edges = defaultdict(set)
    for name, targets in imports_of(found).items():
        if name in leave_out:
            continue
        for target in targets:
            if node_of(target) != node_of(name):
                edges[node_of(name)].add(node_of(target))
    return edges


def folder(module: str) -> str:
    """A package's sub-folder is one node (`store_schema.commit`); a top-level file its own."""
    return ".".join(module.split(".")[:2])


def is_section(module: str) -> bool:
    """A run-config section of train/ beside its owner: `train/<folder>/config.py`, or a
    drafter family's, `train/families/<family>/config.py`."""
    parts = module.split(".")
    return parts[-1] == "config" and (len(parts) == 3 or (len(parts) == 4 and parts[1] == "families"))


def train_unit(module: str) -> str:
    """train/'s node: a folder (`train.fitting`), a drafter family's folder
    (`train.families.dflash`, its section included: the family reads its own section),
    or a top-level file (`train.config`) on its own, as is each file beside the
    families (the interface `train.families.family` below them, the registry
    `train.families.kinds` above). Any other section (`train.fitting.config`) is its own
    too: `train/config.py` gathers the sections from below, and folders that read the
    composed config (`train.fitting`) sit above it (tests/train/test_train_layout.py
    keeps a section from leading back up)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "families":
        return ".".join(parts[:3])
    if is_section(module):
        return module
    return folder(module)


NODE_OF = {"store_schema": folder, "extract": folder, "train": train_unit}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
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
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found
