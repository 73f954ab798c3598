"""The layout rules of `train/` alone (DESIGN.md "Code layout"), read from its source
with the product's one import-graph reader (tests/import_graph.py): `train/config.py`
only composing the sections their owners define, a section a leaf, and a drafter family
reached only through the registry. The rules every package keeps (functions, circles,
private names, imports inside functions) are tests/test_structure.py's."""

from __future__ import annotations

import ast

import import_graph
from import_graph import imported, is_section, train_unit


def modules() -> dict:
    return import_graph.modules("train")


def test_a_section_is_a_leaf():
    """A section imports, of train/, only other sections, the files below every folder
    (`config_error`, `dtypes`) and files of its own folder: never the composed config,
    nor another folder's code."""
    found = modules()
    sections = [name for name in found if is_section(name)]
    assert {
        "train.data.config",
        "train.families.dflash.config",
        "train.evaluation.config",
        "train.fitting.config",
    } <= set(sections)
    below = {"train.config_error", "train.dtypes"}
    above = []
    for name in sections:
        path, tree = found[name]
        own = (train_unit(name), name.rpartition(".")[0])
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(name, node, False):
                    if (
                        target in found
                        and target != "train"
                        and not (is_section(target) or target in below or train_unit(target) in own)
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
        if target.startswith("train.families.") and train_unit(target) not in interface
    ]
    assert not direct, direct
    families = {train_unit(name) for name in modules() if name.startswith("train.families.")}
    assert {
        "train.families.dflash",
        "train.families.eagle3",
        "train.families.family",
        "train.families.kinds",
    } <= families
