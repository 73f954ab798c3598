"""The `--engine openai` worker: a Ray actor that regenerates shards by asking
OpenAI-compatible servers (`client.EndpointPool`) instead of holding the target.

Same contract as `worker.GenerationWorker` (``info``, ``generate_group`` ->
`GroupDone`), so the driver's queue, fences, retries and progress are extraction's
own. Inside, one event loop runs every shard the actor holds: each record goes
through its turns on its own (turn k+1 is asked as soon as turn k is back), so the
servers always have ``concurrency`` requests per endpoint and no shard waits for a
batch's longest reply. The prompt of each turn, its limits (``--max-new-tokens``,
``--max-length``), truncation and the rows are the hf engine's rules
(`turns`, `replies`); every finished reply is journaled (`replies.Journal`) so that
a redone shard, in this run or the next, asks only for the replies it lacks.

A record whose request fails every try is quarantined (reason, detail) in the
shard's commit record; every endpoint down fails the shard as ``endpoints_down``."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from store_schema.runtime.target_config import read_target_config

from ..errors import EndpointsDown, RequestFailed
from ..jobs.protocol import (
    GROUPS_IN_FLIGHT,
    BatchFaults,
    GroupDone,
    ShardDone,
    WorkerInfo,
    failure,
    quiet_worker_process,
)
from .client import EndpointPool
from .config import GenerationSettings
from .replies import Journal, make_reply, remove_journal, request_body
from .server import ServedModel
from .shards import CorpusShards
from .turns import end_of_turn_ids, render_prompt, reply_message

MISMATCH_EXAMPLES = 3  # per shard, in its commit record


@dataclass(frozen=True)
class OpenAIGenerationSpec:
    """What every `--engine openai` actor is built from (Ray sends it to each)."""

    model: str
    corpus: str
    out: str
    settings: GenerationSettings  # as the plan recorded them
    served: tuple  # `server.ServedModel` of each checked endpoint, as dicts
    concurrency: int  # requests in flight per endpoint, for this actor
    request_timeout: float
    request_retries: int
    groups_in_flight: int = GROUPS_IN_FLIGHT  # shards held at once: enough to keep every endpoint busy
    task: ClassVar[str] = "generate_group"

    @staticmethod
    def actor_class() -> type:
        return OpenAIGenerationWorker


class OpenAIGenerationWorker:
    """Plain class; `extract.jobs.pool.ActorPool` wraps it with ``ray.remote``."""

    def __init__(self, spec: OpenAIGenerationSpec, faults: BatchFaults | None = None):
        # in the actor only: the driver imports this module to build the spec without transformers
        from transformers import AutoTokenizer, GenerationConfig

        quiet_worker_process(1)
        started = time.perf_counter()
        self.model_path = str(spec.model)
        self.settings = spec.settings
        self.shards = CorpusShards(spec.corpus, spec.out)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        try:
            generation_config = GenerationConfig.from_pretrained(self.model_path)
        except OSError:
            generation_config = None  # no generation_config.json: the tokenizer's eos
        self.end_of_turn = end_of_turn_ids(self.tokenizer, generation_config)
        self.served = [ServedModel(**s) for s in spec.served]
        self.dims = read_target_config(self.model_path)
        self.faults = faults or BatchFaults()  # a "batch" is one reply here
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="openai-client").start()
        self.pool = EndpointPool(self.served, spec.concurrency, spec.request_timeout, spec.request_retries, log=_log)
        asyncio.run_coroutine_threadsafe(self.pool.__aenter__(), self._loop).result()
        self.startup_seconds = time.perf_counter() - started

    def info(self) -> WorkerInfo:
        first = self.served[0]
        return WorkerInfo(
            num_layers=self.dims.num_hidden_layers,
            hidden_size=self.dims.hidden_size,
            vocab_size=self.dims.vocab_size,
            architecture=str(self.dims.model_type),
            kernels={"engine": "openai", "server": f"{first.server} {first.version}"},
            device=f"{first.server} {first.version}",
            torch_threads=1,
            pid=os.getpid(),
            host=socket.gethostname(),
            startup_seconds=round(self.startup_seconds, 3),
        )

    def generate_group(self, names: list[str], attempts: dict) -> GroupDone:
        started = time.perf_counter()
        replies = []
        for name in names:
            if name not in attempts:
                continue
            try:
                rows, extra = asyncio.run_coroutine_threadsafe(self._shard(name, attempts[name]), self._loop).result()
                done = self.shards.commit(name, attempts[name], rows, extra["generated_tokens"], 0, extra["record"])
                if isinstance(done, ShardDone):
                    remove_journal(self.shards.out_path, name)
                replies.append(done)
            except Exception as error:
                replies.append(dataclasses.replace(failure(error), shard=name))
        return GroupDone(replies, 0, 0.0, round(time.perf_counter() - started, 4))

    # -- one shard ------------------------------------------------------------------------
    async def _shard(self, name: str, attempt) -> tuple[list[dict], dict]:
        records = self.shards.records(name)
        journal = Journal(self.shards.out_path, name, attempt.token)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._record(journal, *record)) for record in records]
        except BaseExceptionGroup as errors:
            raise _first(errors) from None
        finally:
            journal.close()
        rows, quarantined, checks = [], [], dict(replies=0, checked=0, mismatched=0, prompt_mismatched=0)
        examples: list[str] = []
        for task in tasks:
            row, failed, stats = task.result()
            if failed is not None:
                quarantined.append(failed)
                continue
            rows.append(row)
            for key in checks:
                checks[key] += stats[key]
            examples.extend(stats["examples"][: MISMATCH_EXAMPLES - len(examples)])
        # Only what the replies decide goes in the commit record: a redone shard's is the same.
        record = dict(quarantined=quarantined, token_checks=dict(checks, examples=examples))
        return rows, dict(generated_tokens=sum(r["generated_tokens"] for r in rows), record=record)

    async def _record(self, journal: Journal, sample_id: str, record_index: int, conv):
        settings = self.settings
        replies: list[dict] = []
        generated, truncated = 0, False
        stats: dict[str, Any] = dict(replies=0, checked=0, mismatched=0, prompt_mismatched=0, examples=[])
        for turn in range(len(conv.turns)):
            messages = conv.prompt(turn, replies)
            prompt_text, prompt_ids = render_prompt(self.tokenizer, messages, settings.thinking)
            if len(prompt_ids) >= settings.max_length:
                truncated = True  # no room for this turn: the record ends before it
                break
            reply = journal.get(sample_id, turn, prompt_text)
            if reply is None:
                limit = min(settings.max_new_tokens, settings.max_length - len(prompt_ids))
                body = request_body(messages, settings, limit, self.end_of_turn, f"{sample_id}/{turn}")
                try:
                    completion = await self.pool.chat(body)
                except RequestFailed as failed:
                    return (
                        None,
                        dict(
                            record_index=record_index,
                            id=sample_id,
                            reason=failed.reason,
                            detail=f"turn {turn}: {failed.detail}",
                        ),
                        stats,
                    )
                reply = make_reply(completion, self.tokenizer, messages, prompt_text, prompt_ids, self.end_of_turn)
                journal.add(sample_id, turn, prompt_text, reply)
                self.faults.batch_done()
            stats["replies"] += 1
            stats["checked"] += reply.checked
            stats["mismatched"] += reply.mismatch
            stats["prompt_mismatched"] += reply.prompt_mismatch
            if reply.mismatch or reply.prompt_mismatch:
                stats["examples"].append(f"{sample_id} turn {turn}")
            replies.append(reply_message(prompt_text, reply.text))
            generated += reply.tokens
            truncated = truncated or reply.hit_limit
        row = dict(id=sample_id, messages=conv.result(replies), truncated=truncated, generated_tokens=generated)
        return row, None, stats


def _first(errors: BaseExceptionGroup) -> BaseException:
    """The error a failed shard reports: every endpoint down, if that is among them."""
    flat = list(_leaves(errors))
    return next((e for e in flat if isinstance(e, EndpointsDown)), flat[0])


def _leaves(error: BaseException):
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
