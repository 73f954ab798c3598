"""train_bench's `--smoke` (tests/test_benchmarks.py says why), in a module of its own:
~120 s on 2 idle cores, so that `make test`'s other pytest worker can run beside it."""

from __future__ import annotations

import pytest
from benchmark_smoke import SMOKE_KEYS, smoke


@pytest.mark.slow  # a child process
def test_train_bench_smoke():
    figures = smoke("train_bench.py")
    missing = SMOKE_KEYS["train_bench.py"] - set(figures)
    assert not missing, f"train_bench --smoke lacks {sorted(missing)}"
    assert figures["smoke"] is True
