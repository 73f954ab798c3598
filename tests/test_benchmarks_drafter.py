"""drafter_bench's `--smoke` (tests/test_benchmarks.py says why), in a module of its own:
~100 s on 2 idle cores, so that `make test`'s other pytest worker can run beside it."""

from __future__ import annotations

import pytest
from benchmark_smoke import SMOKE_KEYS, smoke


@pytest.mark.slow  # a child process
def test_drafter_bench_smoke():
    figures = smoke("drafter_bench.py")
    missing = SMOKE_KEYS["drafter_bench.py"] - set(figures)
    assert not missing, f"drafter_bench --smoke lacks {sorted(missing)}"
    assert figures["smoke"] is True
    text = figures["store_text"]  # how memorisable the store's replies are, printed before the ranking
    assert figures["store"] == "demo" and 0 < text["distinct_reply_tokens"] <= text["reply_tokens"]
    variants = figures["variants"]  # DFlash / DFlash 2, each decoded losslessly
    assert set(variants) == {"dflash_decay", "dflash2_warm", "eagle3"}  # drafter_bench.SMOKE_VARIANTS
    assert all(v["lossless"] and v["decode_tau"] >= 1.0 for v in variants.values())
    assert all(v["decode_tau_t1"] >= 1.0 for v in variants.values())  # ranked at T 0 and at T 1
    assert set(figures["rank_t0"]) == set(figures["rank_t1"]) == set(variants)
    assert variants["dflash2_warm"]["parameters"] > variants["dflash_decay"]["parameters"]
    assert variants["dflash2_warm"]["heldout_selector_acc"] is not None  # the selector trained and was measured
