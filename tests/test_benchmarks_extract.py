"""extract_bench's `--smoke` (tests/test_benchmarks.py says why), in a module of its own:
~70 s on 2 idle cores, so that `make test`'s other pytest worker can run beside it."""

from __future__ import annotations

import pytest
from benchmark_smoke import SMOKE_KEYS, smoke


@pytest.mark.slow  # a child process
def test_extract_bench_smoke():
    figures = smoke("extract_bench.py")
    missing = SMOKE_KEYS["extract_bench.py"] - set(figures)
    assert not missing, f"extract_bench --smoke lacks {sorted(missing)}"
    assert figures["smoke"] is True
    assert figures["tokens"] > 0 and 1.0 <= figures["padded_token_ratio"] < 2.0
