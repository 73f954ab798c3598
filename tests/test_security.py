"""Security properties of the data path: no pickle, no remote code by default,
loopback-only services, sample ids that can never become paths."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from store_schema import is_safe_id

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("store_schema", "extract", "train")


def _sources():
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))


def test_no_pickle_or_torch_load_on_the_data_path():
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "cloudpickle", "dill", "joblib") for n in names):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports a pickle module")
            if isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name):
                if node.value.id in ("torch", "pickle"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} calls {node.value.id}.load")
    assert not offenders, offenders
    assert list(_sources()), "the scan must see the packages"


def test_trust_remote_code_is_never_switched_on_in_code():
    offenders = []
    for path in _sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"trust_remote_code\s*=\s*True", line):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}")
    assert not offenders, offenders
    from extract.target import load_target

    assert inspect.signature(load_target).parameters["trust_remote_code"].default is False


@pytest.mark.parametrize("sample_id", ["../../x", "/etc/passwd", "a/b", "..", ".hidden", "", "x" * 129, "a\x00b", "a b", "ü"])
def test_unsafe_ids_are_refused(sample_id):
    assert not is_safe_id(sample_id)


@pytest.mark.parametrize("sample_id", ["sample-00001", "rec-000000012", "A.b_c-9"])
def test_safe_ids_are_accepted(sample_id):
    assert is_safe_id(sample_id)
