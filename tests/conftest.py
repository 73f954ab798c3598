"""Shared fixtures: real tiny components, built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import builders  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    builders.build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _model_dir(tmp_path_factory, tokenizer_dir, kind: str) -> Path:
    import shutil

    path = tmp_path_factory.mktemp(kind)
    builders.build_model(path, kind=kind, vocab_size=512)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """Tiny dense Qwen3 (6 layers, hidden 64) with the tokenizer beside it."""
    return _model_dir(tmp_path_factory, tokenizer_dir, "qwen3")


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """Tiny hybrid linear-attention Qwen3.5 (8 layers, hidden 64) with the tokenizer."""
    return _model_dir(tmp_path_factory, tokenizer_dir, "qwen3_5")


@pytest.fixture(scope="session")
def qwen3_5_vl_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """Tiny multimodal Qwen3.5 release layout (nested text_config)."""
    return _model_dir(tmp_path_factory, tokenizer_dir, "qwen3_5_vl")


# `make test-fast` runs `-m "not slow"`: no Ray cluster, no child process, no pretrained target.
# What is slow follows from what a test uses, so no list has to be kept by hand.
_SLOW_FIXTURES = {"ray_cluster"}
_SLOW_CALLS = ("subprocess", "sys.executable", "ctrl_c_when", "verify_cli", "Popen")


def _starts_a_process(function) -> bool:
    import inspect

    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return any(call in source for call in _SLOW_CALLS)


def pytest_collection_modifyitems(items):
    for item in items:
        function = getattr(item, "function", None)
        if (_SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("faults")
                or (function is not None and _starts_a_process(function))):
            item.add_marker(pytest.mark.slow)
