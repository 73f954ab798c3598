"""A process's start (store_schema/runtime/startup.py): its long-lived imports run without
the cycle collector, the collector comes back after, and what is alive at exit is frozen
once, so that the exit's collections skip it."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
from paths import REPO

from store_schema.runtime.startup import collector_paused, preload


def test_the_collector_is_off_inside_and_restored_after_even_on_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled(), "a nested block turned the collector back on"
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled(), "a block turned on a collector its caller had off"
    finally:
        gc.enable()


def test_preload_imports_without_the_collector_and_turns_it_back_on(tmp_path, monkeypatch):
    (tmp_path / "startup_probe.py").write_text("import gc\ncollector_on = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    preload("startup_probe")
    assert sys.modules["startup_probe"].collector_on is False
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0, "preload froze objects before the exit"


def test_a_process_that_preloads_is_frozen_once_at_its_exit():
    # The check is registered before preload, so it runs after preload's freeze (exit handlers run last first).
    program = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, 'handlers', atexit._ncallbacks()))\n"
        "from store_schema.runtime.startup import preload\n"
        "preload('json')\npreload('csv')\n"
        "print('before exit', gc.get_freeze_count())\n"
    )
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # two exit handlers: the check and one freeze, however many preloads
    assert done.stdout.split() == ["before", "exit", "0", "frozen", "True", "handlers", "2"]


def test_info_reads_a_directory_store_without_importing_torch(tmp_path):
    """Issue 47.4: `store_schema info` is metadata only (`store_schema.metadata`); torch's
    import was most of its time on a store of any size."""
    import builders

    builders.random_store(tmp_path / "store", num_shards=2)
    probe = (
        "import json, sys; from store_schema.__main__ import main; code = main(['info', sys.argv[1], '--json']);"
        " print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "store")], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == {"code": 0, "torch": False}
    assert json.loads(lines[0])["shards"] == 2
