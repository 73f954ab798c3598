"""Records -> the generate job's plan: which records, in which shards, which quarantined.

A `store_schema.plan.Plan` like extraction's, read differently: a sample is a record
to regenerate (``num_tokens``: its first prompt's tokens, ``num_loss_tokens``: the
turns the target speaks, ``digest``: the record's messages, checked by the worker that
re-reads it). Shards hold consecutive records, so the generated corpus keeps the
corpus's order. Nothing here depends on the worker count: a rerun plans the same."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from store_schema.fingerprint import target_identity
from store_schema.plan import Plan, PlannedSample, PlannedShard, QuarantinedRecord, shard_name
from store_schema.runtime.progress import Progress

from ..corpus import BadRecord, open_corpus, sample_id_for
from ..errors import QuarantineError
from ..tokenization import chat_template_hash, tokenizer_hash
from .config import GenerationSettings
from .replies import SAMPLING
from .server import server_identity
from .turns import conversation, conversation_digest, render_prompt

# May differ between runs on one output: where the target lies (its hashes may not),
# and the name a server gives it.
RERUN_TOLERATES = ("target_model", "served_models")


def generation_identity(model: str, tokenizer, corpus, settings: GenerationSettings, served=None) -> dict:
    """What made a generated corpus: the target (`target_identity`), its tokenizer and
    chat template, the source corpus's bytes, and the generation settings; with
    `--engine openai` (`served`: `server.ServedModel`s), the server build and the
    sampling settings sent. Recorded as the manifest's ``generation`` block (read by
    `store_schema.provenance`)."""
    identity = dict(
        target_identity(model, full=False),  # which checkpoint; a store's fingerprint keeps the full digest
        tokenizer_sha256=tokenizer_hash(tokenizer),
        chat_template_sha256=chat_template_hash(tokenizer),
        source_corpus_sha256=corpus.content_hash(),
        source_corpus_records=len(corpus),
        **settings.to_json(),
    )
    if served is not None:
        identity.update(server_identity(served), sampling=dict(SAMPLING))
    return identity


def plan_generation(
    corpus_path: str | Path,
    tokenizer,
    settings: GenerationSettings,
    identity: dict,
    progress: Callable[[int], Progress] | None = None,
) -> Plan:
    corpus = open_corpus(corpus_path)
    stop = len(corpus) if settings.limit is None else min(len(corpus), settings.limit)
    good: list[PlannedSample] = []
    quarantined: list[QuarantinedRecord] = []
    seen: dict[str, int] = {}
    bar = progress(stop) if progress else Progress("planning", stop, "record")
    for index, record in corpus.iter_records(0, stop):
        bar.update(1)
        if isinstance(record, BadRecord):
            quarantined.append(QuarantinedRecord(index, None, record.reason, record.detail))
            continue
        sample_id = None
        try:
            sample_id = sample_id_for(record, index)
            conv = conversation(record)
            _, ids = render_prompt(tokenizer, conv.prompt(0, []), settings.thinking)
            if len(ids) >= settings.max_length:
                raise QuarantineError(
                    "prompt_too_long",
                    f"{len(ids)} prompt tokens >= --max-length {settings.max_length}: no room for a reply",
                )
            if sample_id in seen:
                raise QuarantineError("duplicate_id", f"id already used by record {seen[sample_id]}")
        except QuarantineError as error:
            quarantined.append(QuarantinedRecord(index, sample_id, error.reason, error.detail))
            continue
        seen[sample_id] = index
        good.append(PlannedSample(sample_id, index, len(ids), len(conv.turns), conversation_digest(conv)))
    bar.close()
    size = settings.shard_records
    shards = tuple(
        PlannedShard(shard_name(i), tuple(good[at : at + size])) for i, at in enumerate(range(0, len(good), size))
    )
    return Plan(shards, tuple(quarantined), dict(identity))


def plan_counts(plan: Plan) -> dict:
    """What `--dry-run` prints and the report carries."""
    return dict(
        records=plan.num_samples,
        turns=sum(s.num_loss_tokens for shard in plan.shards for s in shard.samples),
        prompt_tokens=plan.num_tokens,
        shards=len(plan.shards),
        quarantined=len(plan.quarantined),
        quarantined_by_reason=dict(sorted(Counter(q.reason for q in plan.quarantined).items())),
    )
