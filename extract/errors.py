"""Every error extract/ raises on purpose, in one place, and what the job says about a
full disk (the driver and the workers both meet it; the rule itself is
`store_schema.runtime.host.is_disk_full`).

`ExtractError` and its kinds stop a job with a message meant for the user (exit 1);
`QuarantineError` and `RequestFailed` are about one record, which is quarantined
with their ``reason``; `SampleMismatchError` is a worker's finding that the corpus
changed since planning (the job stops: `extract.jobs.protocol` classifies it)."""

from __future__ import annotations

from pathlib import Path

from store_schema.runtime import host
from store_schema.runtime.units import human_bytes


class ExtractError(RuntimeError):
    """The job cannot go on; the message says why and what to do."""


class PlanWorkerError(ExtractError):
    """A planning process could not start or died; the pass stops instead of waiting."""


class EndpointsDown(ExtractError):
    """No endpoint answers any more: the job stops; a rerun resumes."""

    failure_kind = "endpoints_down"


class PlanError(ValueError):
    """Raised in strict mode at the first bad record (in record order), named where a
    person finds it (`extract.corpus.Corpus.where`: ``a.jsonl line 4``), else by its
    0-based record index."""

    def __init__(self, record_index: int, reason: str, detail: str = "", where: str = ""):
        super().__init__(f"{where or f'record {record_index}'}: {reason}" + (f" ({detail})" if detail else ""))
        self.record_index, self.reason, self.detail = record_index, reason, detail


class QuarantineError(ValueError):
    """A corpus record that cannot become a sample; ``reason`` is the quarantine reason.
    (Not `store_schema.commit.records.RecordError`: a store's commit record unreadable.)"""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class RequestFailed(Exception):
    """A request that failed every try: its record is quarantined with `reason`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class SampleMismatchError(RuntimeError):
    """A record no longer tokenizes to what the plan fixed (corpus or tokenizer changed)."""


class GeneratedCorpusError(ValueError):
    """A generated corpus that cannot be read: bad manifest, or shards missing."""


def disk_full_message(store_path: object, where: str) -> str:  # a path, or a backend that prints as one
    return (
        f"disk full {where} in {store_path}: free space (or move the store) and rerun the same command; "
        "committed shards are intact and will not be recomputed, half-written ones were never visible"
    )


def refuse_unless_it_fits(path: Path, needed: int, what: str, override: str) -> None:
    """Refuse a job whose output needs more than the free space of `path`'s
    filesystem (`store_schema.runtime.host.free_bytes`), naming both figures; better
    now than when the disk fills hours in."""
    free = host.free_bytes(path)  # through the module: tests fake the free space there
    if needed > free:
        raise ExtractError(
            f"{path}: {what} need about {human_bytes(needed)}, its filesystem has {human_bytes(free)} free -- "
            f"free space or choose another location, or pass {override} to start anyway"
        )


def actor_error_cause(error: BaseException) -> str:
    """One readable line: Ray's actor-death messages run to a paragraph."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines()) or type(error).__name__
    for marker in ("The actor is dead because", "The actor died because"):
        if marker in text:
            text = text[text.index(marker) :]
    for cut in (" Some common causes", " The actor never ran"):
        text = text.split(cut)[0]
    return text[:300]
