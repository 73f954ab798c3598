"""The planning pass: corpus -> Plan (which record becomes which sample in which shard).

It runs before any GPU work and fixes the whole job: every record is tokenized
once here (in parallel), bad ones are quarantined with one reason each, and the
good ones are dealt into shards. The result depends only on the corpus and the
settings, never on the worker count, so a rerun, `verify`, and any number of
extraction workers expect the same store.

Workers later call `load_samples` to re-tokenize their shard's records from the
plan; it checks each sample against the digest fixed here, so a corpus or
tokenizer that changed since planning is caught before it reaches the store.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from transformers import AutoTokenizer

from store_schema.dtypes import BFLOAT16_STORE, FP8_E4M3_STORE, STORE_DTYPES
from store_schema.layout import raw_bytes_per_token
from store_schema.plan import (
    Plan,
    PlannedSample,
    PlannedShard,
    PlanSettings,
    QuarantinedRecord,
    sample_digest,
    shard_name,
)
from store_schema.runtime.progress import Progress

from ..corpus import BadRecord, Corpus, open_corpus, sample_id_for
from ..errors import PlanError, PlanWorkerError, QuarantineError, SampleMismatchError
from ..tokenization import chat_template_hash, has_generation_tags, tokenize_record, tokenizer_hash, tokenizer_missing

PLANNER_VERSION = 1
_CHUNK = 256  # records per parallel task: small enough to balance, big enough to amortise
# Where the inputs were when planned: recorded, but not part of what a plan is. Two
# plans of the same corpus bytes, tokenizer and settings are the same plan wherever
# the files lie (a copied or moved tree resumes).
LOCATION_FIELDS = ("corpus_path", "tokenizer_path")


# --------------------------------------------------------------------------- per-record work


class _Ok(NamedTuple):
    record_index: int
    sample_id: str
    num_tokens: int
    num_loss_tokens: int
    digest: str


class _Bad(NamedTuple):
    record_index: int
    sample_id: str | None
    reason: str
    detail: str


def _digest(tokenized) -> str:
    return sample_digest(tokenized.input_ids.tobytes(), tokenized.loss_mask.tobytes())


class _RecordRules(NamedTuple):
    """What every planning process applies to a record: the settings and the
    tokenizer's chat path (fixed once, in the parent)."""

    settings: PlanSettings
    generation_tags: bool | None


def _plan_record(index: int, record, tokenizer, rules: _RecordRules) -> _Ok | _Bad:
    if isinstance(record, BadRecord):
        return _Bad(index, None, record.reason, record.detail)
    try:
        sample_id = sample_id_for(record, index)
    except QuarantineError as error:
        return _Bad(index, None, error.reason, error.detail)
    try:
        tokenized = tokenize_record(
            record,
            tokenizer,
            max_length=rules.settings.max_length,
            drop_long=rules.settings.drop_long,
            use_generation_tags=rules.generation_tags,
            loss_mask=rules.settings.loss_mask,
        )
    except QuarantineError as error:
        return _Bad(index, sample_id, error.reason, error.detail)
    if tokenized.num_loss_tokens < rules.settings.min_loss_tokens:
        return _Bad(
            index,
            sample_id,
            "too_few_loss_tokens",
            f"{tokenized.num_loss_tokens} loss tokens < {rules.settings.min_loss_tokens} "
            f"({'2 x --block-size' if rules.settings.block_size else '--min-loss-tokens'})",
        )
    return _Ok(index, sample_id, tokenized.num_tokens, tokenized.num_loss_tokens, _digest(tokenized))


_worker: dict = {}


def _init_worker(corpus_path: str, tokenizer_path: str, rules: _RecordRules) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle, once
    step = f"opening the corpus {corpus_path}"
    try:
        corpus = open_corpus(corpus_path)
        step = f"loading the tokenizer {tokenizer_path}"
        _worker.update(corpus=corpus, tokenizer=AutoTokenizer.from_pretrained(tokenizer_path), rules=rules)
    except Exception as error:
        _worker["error"] = f"{step}: {type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _plan_chunk(bounds: tuple[int, int]) -> list:
    if "error" in _worker:
        raise PlanWorkerError(f"a planning process failed to start: {_worker['error']}")
    start, stop = bounds
    corpus, tokenizer, rules = _worker["corpus"], _worker["tokenizer"], _worker["rules"]
    return [_plan_record(i, record, tokenizer, rules) for i, record in corpus.iter_records(start, stop)]


def _parallel_results(chunks, workers: int, initargs: tuple):
    """Each chunk's results, in record order, from `workers` spawned processes. A
    process that cannot start, or dies, stops the pass with a `PlanWorkerError`
    (multiprocessing.Pool would respawn it forever and wait)."""
    context = multiprocessing.get_context("spawn")  # no fork after tokenizers/torch threads started
    executor = ProcessPoolExecutor(
        min(workers, len(chunks)), mp_context=context, initializer=_init_worker, initargs=initargs
    )
    try:
        yield from executor.map(_plan_chunk, chunks)
    except BrokenProcessPool as error:
        raise PlanWorkerError(
            f"a planning process died or could not start ({error}); rerun with --plan-workers 1 "
            "to see the error in this process"
        ) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- shards


def assign_shards(samples: list[PlannedSample], shard_tokens: int, seed: int) -> tuple[PlannedShard, ...]:
    """Seeded shuffle, then fill shards greedily up to ``shard_tokens``.

    The shuffle makes every shard a random subset of the corpus, which the
    trainer relies on (it shuffles whole shards plus a buffer of a few). A
    sample longer than the budget gets a shard of its own. Within a shard,
    samples go longest first (ties by record index) so runs of similar length
    batch together on the GPU."""
    order = sorted(samples, key=lambda s: s.record_index)
    random.Random(seed).shuffle(order)
    groups: list[list[PlannedSample]] = []
    current: list[PlannedSample] = []
    tokens = 0
    for sample in order:
        if current and tokens + sample.num_tokens > shard_tokens:
            groups.append(current)
            current, tokens = [], 0
        current.append(sample)
        tokens += sample.num_tokens
    if current:
        groups.append(current)
    return tuple(
        PlannedShard(shard_name(i), tuple(sorted(group, key=lambda s: (-s.num_tokens, s.record_index))))
        for i, group in enumerate(groups)
    )


# --------------------------------------------------------------------------- the pass


def build_plan(
    corpus_path: str | Path,
    tokenizer_path: str | Path,
    settings: PlanSettings = PlanSettings(),
    *,
    tokenizer=None,
    strict: bool = False,
    workers: int = 1,
    progress: Callable[[int], Progress] | None = None,
    chunk_records: int = _CHUNK,
) -> Plan:
    """Tokenize every record (``workers`` processes), quarantine bad ones,
    deal good ones into shards. Same corpus + tokenizer + settings -> identical Plan,
    whatever the execution options (``workers``, ``chunk_records``, ``progress``: a
    function of the record count giving the `store_schema.runtime.progress.Progress` to update).

    ``tokenizer_path`` is what workers load (a model or tokenizer directory);
    pass an already loaded ``tokenizer`` of the same path to skip one load.
    ``strict`` raises `PlanError` at the first bad record instead of quarantining."""
    if tokenizer is None:
        missing = tokenizer_missing(tokenizer_path)
        if missing:  # transformers would build one that knows no chat template
            raise ValueError(missing)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    corpus = open_corpus(corpus_path)
    limit = settings.limit
    stop = len(corpus) if limit is None else min(len(corpus), max(0, limit))
    rules = _RecordRules(settings, _generation_tags(tokenizer))
    chunks = [(start, min(start + chunk_records, stop)) for start in range(0, stop, chunk_records)]
    sorted_out = _Sorting(corpus, strict)
    bar = progress(stop) if progress else Progress("planning", stop, "record")
    if workers <= 1 or len(chunks) <= 1:
        for index, record in corpus.iter_records(0, stop):
            sorted_out.take(_plan_record(index, record, tokenizer, rules))
            bar.update(1)
    else:
        for results in _parallel_results(chunks, workers, (str(corpus_path), str(tokenizer_path), rules)):
            for result in results:
                sorted_out.take(result)
            bar.update(len(results))
    bar.close()

    recorded = plan_inputs(corpus, corpus_path, tokenizer, tokenizer_path, settings)
    shards = assign_shards(sorted_out.good, settings.shard_tokens, settings.seed)
    return Plan(shards, tuple(sorted_out.quarantined), recorded)


class _Sorting:
    """The planning pass's results in record order: good samples, quarantined records
    (a repeated id is the later record's fault), or `PlanError` at the first bad one
    when strict."""

    def __init__(self, corpus: Corpus, strict: bool):
        self.corpus, self.strict = corpus, strict
        self.good: list[PlannedSample] = []
        self.quarantined: list[QuarantinedRecord] = []
        self.seen: dict[str, int] = {}

    def take(self, result: _Ok | _Bad) -> None:
        if isinstance(result, _Ok) and result.sample_id in self.seen:
            result = _Bad(
                result.record_index,
                result.sample_id,
                "duplicate_id",
                f"id already used by {self.corpus.where(self.seen[result.sample_id])}",
            )
        if isinstance(result, _Bad):
            if self.strict:
                raise PlanError(
                    result.record_index, result.reason, result.detail, self.corpus.where(result.record_index)
                )
            self.quarantined.append(
                QuarantinedRecord(result.record_index, result.sample_id, result.reason, result.detail)
            )
            return
        self.seen[result.sample_id] = result.record_index
        self.good.append(PlannedSample(**result._asdict()))


def plan_inputs(corpus: Corpus, corpus_path, tokenizer, tokenizer_path, settings: PlanSettings) -> dict:
    """A plan's recorded settings: `settings` plus what the corpus and the tokenizer
    were (hashes, format, where) and the planner's conventions. Same record (the
    `LOCATION_FIELDS` aside) -> same plan, so a store's plan can be reused by
    computing this, without tokenizing anything (`plan_differences`)."""
    return dict(
        settings.to_json(),
        planner_version=PLANNER_VERSION,
        corpus_path=str(Path(corpus_path).resolve()),
        corpus_format=corpus.format,
        corpus_hash=corpus.content_hash(),
        corpus_records=len(corpus),
        tokenizer_path=str(Path(tokenizer_path).resolve()),
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=chat_template_hash(tokenizer) if tokenizer.chat_template else None,
        generation_tags=_generation_tags(tokenizer),
        truncation="keep_first_max_length_tokens",
    )


def plan_differences(recorded: dict, wanted: dict) -> list[str]:
    """What differs between two plans' recorded settings (`plan_inputs`), locations
    aside, as ``key: old -> new``; empty: the same plan."""
    keys = sorted((set(recorded) | set(wanted)) - set(LOCATION_FIELDS))
    return [f"{k}: {recorded.get(k)!r} -> {wanted.get(k)!r}" for k in keys if recorded.get(k) != wanted.get(k)]


def _generation_tags(tokenizer) -> bool | None:
    try:
        return has_generation_tags(tokenizer)
    except ValueError:  # no chat template: only pre-tokenized records can be planned
        return None


# --------------------------------------------------------------------------- reading back


_open_corpora: dict[tuple, Corpus] = {}


def _cached_corpus(path: str | Path) -> Corpus:
    """Opening a JSONL corpus scans it for line offsets; a long-lived worker
    re-reads many shards, so keep the opened corpus while its files are unchanged."""
    path = Path(path).resolve()
    entries = sorted(path.rglob("*")) if path.is_dir() else [path]
    key = (str(path), tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in entries if p.is_file()))
    corpus = _open_corpora.get(key)
    if corpus is None:
        if len(_open_corpora) >= 4:
            _open_corpora.clear()
        corpus = _open_corpora[key] = open_corpus(path)
    return corpus


def load_samples(
    corpus: str | Path | Corpus, tokenizer, planned_samples, settings: dict
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Re-tokenize planned samples: ``[(sample_id, input_ids int32, loss_mask uint8)]``
    in the order given. This is what an extraction worker calls for its shard
    (``plan.shard(name).samples``, ``plan.settings``).

    Each sample is checked against the plan (id, length, digest); any
    difference raises `SampleMismatchError` naming the sample, because writing
    it would silently break the store's contract with the plan."""
    corpus = corpus if isinstance(corpus, Corpus) else _cached_corpus(corpus)
    planned_samples = list(planned_samples)
    records = corpus.read([s.record_index for s in planned_samples])
    out = []
    for planned, record in zip(planned_samples, records):
        where = f"sample {planned.sample_id!r} ({corpus.where(planned.record_index)})"
        if isinstance(record, BadRecord):
            raise SampleMismatchError(f"{where} no longer parses: {record.reason} {record.detail}")
        try:
            sample_id = sample_id_for(record, planned.record_index)
            tokenized = tokenize_record(
                record,
                tokenizer,
                max_length=settings["max_length"],
                drop_long=False,  # the plan only holds records that fit or were truncated
                use_generation_tags=settings.get("generation_tags"),
                loss_mask=PlanSettings.from_json(settings).loss_mask,
            )
        except QuarantineError as error:
            raise SampleMismatchError(f"{where} is now rejected: {error}") from None
        if sample_id != planned.sample_id:
            raise SampleMismatchError(f"{where} now has id {sample_id!r}; the corpus changed since planning")
        if tokenized.num_tokens != planned.num_tokens or _digest(tokenized) != planned.digest:
            raise SampleMismatchError(
                f"{where} tokenizes differently than when planned ({tokenized.num_tokens} vs "
                f"{planned.num_tokens} tokens); the corpus or tokenizer changed since planning"
            )
        out.append((planned.sample_id, tokenized.input_ids, tokenized.loss_mask))
    return out


def check_tokenizer(tokenizer, settings: dict) -> None:
    """Fail fast (once per worker) if this tokenizer is not the one the plan used."""
    expected = settings.get("tokenizer_hash")
    if expected and tokenizer_hash(tokenizer) != expected:
        raise SampleMismatchError("the tokenizer differs from the one the plan was made with (tokenizer_hash)")


# --------------------------------------------------------------------------- summaries


class StoreEstimate(NamedTuple):
    raw_bytes: int
    by_dtype: dict[str, int]  # store dtype name -> the store's bytes in that dtype

    @property
    def compressed_bytes(self) -> int:
        """A bf16 store (the default)."""
        return self.by_dtype[BFLOAT16_STORE.name]

    @property
    def fp8_bytes(self) -> int:
        return self.by_dtype[FP8_E4M3_STORE.name]

    def store_bytes(self) -> dict[str, int]:
        """{"raw": ..., dtype: ...}: what the job and cache estimates take."""
        return {"raw": self.raw_bytes, **self.by_dtype}


def estimate_store_bytes(
    plan: Plan, num_context_layers: int, hidden_size: int, compression_ratio: float | None = None
) -> StoreEstimate:
    """Size before a job starts: per token, bf16 (2 B) x hidden x layers, plus
    int32 input_ids and uint8 loss_mask, times each store dtype's ratio to that raw
    size (`store_schema.dtypes.StoreDtype.size_ratio`, as store_bench measures them;
    ``compression_ratio`` overrides bf16's). Applied to the whole, since
    tokens are a rounding error next to the hidden states."""
    raw = plan.num_tokens * raw_bytes_per_token(hidden_size, num_context_layers)
    by_dtype = {
        name: dtype.expected_bytes(raw, compression_ratio if dtype is BFLOAT16_STORE else None)
        for name, dtype in STORE_DTYPES.items()
    }
    return StoreEstimate(raw, by_dtype)


@dataclass(frozen=True)
class PlanSummary:
    samples: int
    shards: int
    tokens: int
    loss_tokens: int
    quarantined: int
    quarantined_by_reason: dict

    def to_json(self) -> dict:
        return dict(self.__dict__)


def summarize(plan: Plan) -> PlanSummary:
    reasons = Counter(q.reason for q in plan.quarantined)
    return PlanSummary(
        samples=plan.num_samples,
        shards=len(plan.shards),
        tokens=plan.num_tokens,
        loss_tokens=sum(s.num_loss_tokens for shard in plan.shards for s in shard.samples),
        quarantined=len(plan.quarantined),
        quarantined_by_reason=dict(sorted(reasons.items())),
    )
