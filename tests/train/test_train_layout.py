"""The layout rules of `train/` (DESIGN.md "Code layout"), read from its source with
`ast`: no function over 60 lines, no import circle between its files nor between its
folders and top-level files (imports inside functions included), `train/config.py`
only composing the sections their owners define, no private name imported from
another module, and every import inside a function says why it is there."""

from __future__ import annotations

import ast
from collections import defaultdict

from paths import REPO

TRAIN = REPO / "train"
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(TRAIN.rglob("*.py")):
        parts = list(path.relative_to(TRAIN.parent).with_suffix("").parts)
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


def is_section(module: str) -> bool:
    """A run-config section beside its owner: `train/<folder>/config.py`, or a drafter
    family's, `train/families/<family>/config.py`."""
    parts = module.split(".")
    return parts[-1] == "config" and (len(parts) == 3 or (len(parts) == 4 and parts[1] == "families"))


def unit(module: str) -> str:
    """A folder of train/ (`train.fitting`), a drafter family's folder
    (`train.families.dflash`, its section included: the family reads its own section),
    or a top-level file (`train.config`) on its own, as is each file beside the
    families (the interface `train.families.family` below them, the registry
    `train.families.kinds` above). Any other section
    (`train.fitting.config`) is its own too: `train/config.py` gathers the sections from
    below, and folders that read the composed config (`train.fitting`) sit above it;
    `test_a_section_is_a_leaf` keeps a section from leading back up."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "families":
        return ".".join(parts[:3])
    if is_section(module):
        return module
    return ".".join(parts[:2]) if len(parts) > 1 else module


def edges_between(found: dict, node_of) -> dict[str, set[str]]:
    """node -> the nodes it imports, `node_of` naming each module's node (imports inside
    functions included; `train/__main__.py`, the entry point above everything, left out)."""
    edges = defaultdict(set)
    for name, (path, tree) in found.items():
        if name == "train.__main__":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(name, node, path.name == "__init__.py"):
                    if target in found and node_of(target) != node_of(name) and target != "train":
                        edges[node_of(name)].add(node_of(target))
    return edges


def circles_in(edges: dict[str, set[str]]) -> list[list[str]]:
    seen, stack, circles = set(), [], []

    def visit(node):
        if node in stack:
            circles.append(stack[stack.index(node) :] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(edges[node]):
            visit(nxt)
        stack.pop()

    for start in sorted(edges):
        visit(start)
    return circles


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{path.relative_to(TRAIN.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path, tree in modules().values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_no_circle_between_the_folders_and_files_of_train():
    """`train/__main__.py` is the entry point above everything and is left out."""
    found = modules()
    folders = {name for name in found if (TRAIN.parent / name.replace(".", "/")).is_dir()}
    edges = edges_between(found, unit)
    assert "train.fitting" in folders and edges
    circles = circles_in(edges)
    assert not circles, circles


def test_no_circle_between_the_files_of_train():
    edges = edges_between(modules(), lambda module: module)
    assert edges
    circles = circles_in(edges)
    assert not circles, circles


def test_a_section_is_a_leaf():
    """A section imports, of train/, only other sections, the files below every folder
    (`config_error`, `dtypes`) and files of its own folder: never the composed config,
    nor another folder's code."""
    found = modules()
    sections = [name for name in found if is_section(name)]
    assert {
        "train.data.config",
        "train.families.dflash.config",
        "train.acceptance.config",
        "train.fitting.config",
    } <= set(sections)
    below = {"train.config_error", "train.dtypes"}
    above = []
    for name in sections:
        path, tree = found[name]
        own = (unit(name), name.rpartition(".")[0])
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(name, node, False):
                    if (
                        target in found
                        and target != "train"
                        and not (is_section(target) or target in below or unit(target) in own)
                    ):
                        above.append(f"{name} imports {target}")
    assert not above, above


def test_the_run_config_only_composes_the_sections():
    """`train/config.py` defines no class but `RunConfig`; each of its sections is a
    class imported from its owner's `config.py` (`train.families.dflash.config.LossConfig`)."""
    tree = modules()["train.config"][1]
    classes = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    assert classes == ["RunConfig"], classes
    owner = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    run_config = next(node for node in tree.body if isinstance(node, ast.ClassDef))
    fields = {
        node.target.id: ast.unparse(node.annotation) for node in run_config.body if isinstance(node, ast.AnnAssign)
    }
    sections = {field: kind for field, kind in fields.items() if kind != "str"}
    named = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["SECTIONS"]
    )
    assert set(sections) == set(named), (fields, named)
    misplaced = {field: owner.get(kind) for field, kind in sections.items() if not is_section(owner.get(kind) or "")}
    assert not misplaced, misplaced


def test_no_private_name_is_imported_from_another_module():
    private = [
        f"{path.relative_to(TRAIN.parent)}:{node.lineno} {alias.name}"
        for path, tree in modules().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, private


def test_every_import_inside_a_function_says_why():
    """Imports belong at the top of a module; one inside a function (for `--help`
    speed, or an optional dependency) carries a comment on its line or above it in
    that function."""
    unexplained = []
    for path, tree in modules().values():
        lines = path.read_text().splitlines()
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    above = lines[function.lineno - 1 : node.end_lineno]
                    if not any("#" in line for line in above):
                        unexplained.append(f"{path.relative_to(TRAIN.parent)}:{node.lineno}")
    assert not unexplained, unexplained


def test_a_drafter_family_is_reached_only_through_the_registry():
    """Issue 63: outside `train/families/`, no module imports a family's folder (the
    trainer, loader, evaluation, decoding, export and dry run call the interface,
    `train.families.family`, found by the registry, `train.families.kinds`); the one
    run config reads the sections the families compose (`train.families.config`)."""
    composing: set[str] = set()
    interface = ("train.families.family", "train.families.kinds", "train.families.config")
    direct = [
        f"{name} imports {target}"
        for name, (path, tree) in modules().items()
        if not name.startswith("train.families") and name not in composing
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in imported(name, node, path.name == "__init__.py")
        if target.startswith("train.families.") and unit(target) not in interface
    ]
    assert not direct, direct
    families = {unit(name) for name in modules() if name.startswith("train.families.")}
    assert {
        "train.families.dflash",
        "train.families.eagle3",
        "train.families.family",
        "train.families.kinds",
    } <= families
