"""The job's JSON report: printed last by `run`, and kept in the store, one file per
run (``reports/extract-<UTC start>-<run>.json``), so a rerun that had nothing to do
(``"status": "nothing_to_do"``) never hides what the run that extracted measured."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from store_schema.runtime.units import human_bytes
from store_schema.stores import StoreBackend

from ..corpus import open_corpus
from ..jobs.dispatch import DispatchCounts
from .config import JobConfig
from .planning import summarize

REPORT_PREFIX = "extract"


@dataclass
class Outcome:
    """What the run did, gathered for the report."""

    run: str  # this run's id (staging names, fence, report file)
    started_at: float = field(default_factory=time.time)  # wall clock, for the report's name
    plan_seconds: float = 0.0
    startup_seconds: float = 0.0
    extract_seconds: float = 0.0
    workers: list = field(default_factory=list)  # WorkerInfo of each started actor
    workers_started: int = 0  # replacements of lost actors included
    kernels: dict = field(default_factory=dict)
    kernel_warning: str | None = None
    counts: DispatchCounts = field(default_factory=DispatchCounts)
    shards_committed: int = 0  # planned shards committed in the store when the run ended


def report_name(outcome: Outcome) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(outcome.started_at))
    return f"{REPORT_PREFIX}-{stamp}-{outcome.run}"


def build_report(
    config: JobConfig, store_path: StoreBackend, planned, layer_ids, outcome: Outcome, *, wall: float, leftovers: int
) -> dict:
    plan = planned.plan
    summary = summarize(plan)
    counts = outcome.counts
    seconds = outcome.extract_seconds
    return {
        "status": "complete" if planned.pending else "nothing_to_do",
        "run": outcome.run,
        "report": f"reports/{report_name(outcome)}.json",
        "store": store_path.address,
        "plan_digest": plan.digest(),
        "plan_reused": planned.reused,
        "samples": plan.num_samples,
        "tokens": plan.num_tokens,
        "shards": len(plan.shards),
        "shards_committed": outcome.shards_committed,
        "samples_written": counts.samples_written,
        "tokens_written": counts.tokens_written,
        "shards_written": counts.shards_written,
        "shards_skipped": planned.skipped,
        "shards_committed_elsewhere": counts.shards_committed_elsewhere,
        "shards_retried": counts.shards_retried,
        "shards_committed_before_worker_death": counts.shards_committed_before_worker_death,
        "worker_deaths": counts.worker_deaths,
        "workers_timed_out": counts.workers_timed_out,
        "attempts_revoked": counts.attempts_revoked,
        "quarantined": summary.quarantined,
        "quarantined_by_reason": summary.quarantined_by_reason,
        "quarantined_first": first_quarantined(plan, config.corpus),
        "layer_ids": list(layer_ids),
        "target_topk": int(config.target_topk or 0),
        "workers": len(outcome.workers),
        "workers_started": outcome.workers_started,
        "batch_shards": config.batch_shards,
        "batch_tokens": config.batch_tokens,
        "device": config.execution.device,
        "devices": sorted({w.device for w in outcome.workers}),
        "hosts": sorted({w.host for w in outcome.workers}),
        "nodes": sorted({w.node for w in outcome.workers}),  # Ray node ids of the first workers
        "shards_by_node": dict(sorted(counts.shards_by_node.items())),
        "kernels": outcome.kernels,
        "kernel_warning": outcome.kernel_warning,
        "padded_tokens": counts.padded_tokens,
        "filler_tokens": counts.filler_tokens,
        # computed / real tokens of what this run extracted (1.0: no padding); null if it extracted nothing
        "padded_token_ratio": round(counts.padded_tokens / counts.tokens_written, 4) if counts.tokens_written else None,
        "bytes_written": counts.bytes_written,
        "raw_bytes_written": counts.raw_bytes_written,
        "tokens_per_s": round(counts.tokens_written / seconds, 2) if seconds else 0.0,
        "bytes_per_s": round(counts.bytes_written / seconds, 2) if seconds else 0.0,
        "wall_seconds": round(wall, 3),
        "plan_seconds": round(outcome.plan_seconds, 3),
        "startup_seconds": round(outcome.startup_seconds, 3),
        "extract_seconds": round(seconds, 3),
        "leftovers_cleaned": leftovers,
        **upload_figures(counts),
    }


def upload_figures(counts: DispatchCounts) -> dict:
    """A store on object storage: what the workers uploaded, the rate while uploading
    (bytes over the seconds spent in uploads, summed over workers: one uploader's
    throughput; null when nothing was uploaded, as into a directory), and how long
    they waited for room in their local spools (summed over shards)."""
    seconds = counts.upload_seconds
    return {
        "upload_bytes": counts.upload_bytes,
        "upload_seconds": round(seconds, 3),
        "upload_mb_per_s": round(counts.upload_bytes / seconds / 1e6, 2) if seconds else None,
        "spool_wait_seconds": round(counts.spool_wait_seconds, 3),
    }


def summary_line(report: dict) -> str:
    """The one line `run` prints on stderr before the JSON."""
    if report["status"] == "nothing_to_do":
        return (
            f"nothing to do: all {report['shards']} shard(s) of {report['store']} are committed "
            f"(this run's report: {report['report']})"
        )
    ratio = report["padded_token_ratio"]
    return (
        f"extracted {report['shards_written']} shard(s) ({report['samples_written']} samples, "
        f"{report['tokens_written']} tokens), {report['shards_skipped']} already committed, "
        f"{quarantine_text(report['quarantined'], report['quarantined_by_reason'])}"
        + (
            f" (first: {report['quarantined_first']}; all: python -m store_schema info {report['store']} --quarantined)"
            if report.get("quarantined_first")
            else ""
        )
        + "; "
        f"{report['tokens_per_s']:.0f} tokens/s, "
        f"{human_bytes(int(report['bytes_per_s']))}/s on {report['workers']} worker(s)"
        + (f", padded/real tokens {ratio:.3f}" if ratio else "")
    )


def first_quarantined(plan, corpus) -> str | None:
    """The first quarantined records of each reason, by file and line (None: none)."""
    if not plan.quarantined:
        return None
    return quarantine_examples(plan.quarantined, open_corpus(corpus).where)


def quarantine_examples(quarantined, where, per_reason: int = 2) -> str:
    """The first `per_reason` quarantined records of each reason: where (file:line) and why."""
    shown: dict[str, list[str]] = {}
    for record in quarantined:
        rows = shown.setdefault(record.reason, [])
        if len(rows) < per_reason:
            rows.append(f"{where(record.record_index)}: {record.reason}: {record.detail}")
    return "; ".join(row for rows in shown.values() for row in rows) or "none"


def quarantine_text(count: int, by_reason: dict) -> str:
    """``6 record(s) quarantined (no_assistant_turn 2, unsafe_id 4)``: the count with its reasons."""
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(by_reason.items()))
    return f"{count} record(s) quarantined" + (f" ({reasons})" if reasons else "")
