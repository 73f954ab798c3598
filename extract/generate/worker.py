"""The generate worker: a long-lived Ray actor holding the target (`extract.jobs.target.load_target`,
whole model with its head), regenerating groups of shards for the `extract.jobs.dispatch.Dispatcher`.

A shard's records go turn by turn: round k generates turn k of every record that has
one, its prompt built from the record's earlier turns as the target wrote them
(`turns.Conversation.prompt`). Within a round, prompts are batched by length
(`extract.jobs.batching.batches_by_length` over prompt + room to reply) and generated with
`model.generate` (KV cache, left padding, stop at the end-of-turn token; greedy at
temperature 0, else sampled from a seed fixed by shard, round and batch), so a shard's
batches, and its bytes, are the same in every run. A reply that reaches its limit
(``--max-new-tokens``, or ``--max-length`` counting the prompt) is kept and the record
flagged ``truncated``; a later turn whose prompt alone fills ``--max-length`` ends the
record there (flagged too). The shard is committed as one Parquet file
(`shards.CorpusShards.commit`), claiming the driver's attempt first.

Replies are the framework's (`extract.jobs.protocol`: `GroupDone` of `ShardDone` /
`ShardFailed`), with ``tokens`` = tokens generated, so the driver's queue, retries and
progress are the same as extraction's."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import AutoTokenizer

from ..jobs.batching import batches_by_length
from ..jobs.protocol import GROUPS_IN_FLIGHT, BatchFaults, GroupDone, failure, quiet_worker_process, worker_info
from ..jobs.target import load_target
from .config import GenerationSettings
from .shards import CorpusShards
from .turns import end_of_turn_ids, render_prompt, reply_message, reply_text


@dataclass(frozen=True)
class GenerationSpec:
    """What every generate actor is built from (Ray sends it to each)."""

    model: str
    corpus: str
    out: str
    settings: GenerationSettings  # as the plan recorded them
    device: str = "cpu"
    batch_tokens: int = 65536
    torch_threads: int | None = None
    task: ClassVar[str] = "generate_group"
    groups_in_flight: ClassVar[int] = GROUPS_IN_FLIGHT

    @staticmethod
    def actor_class() -> type:
        return GenerationWorker


class GenerationWorker:
    """Plain class; `extract.jobs.pool.ActorPool` wraps it with ``ray.remote``. Also usable in-process."""

    def __init__(self, spec: GenerationSpec, faults: BatchFaults | None = None):
        quiet_worker_process(spec.torch_threads)
        started = time.perf_counter()
        self.settings = spec.settings
        self.shards = CorpusShards(spec.corpus, spec.out)
        self.tokenizer = AutoTokenizer.from_pretrained(str(spec.model))
        self.target = load_target(spec.model, device=spec.device)
        self.model: Any = self.target.model  # a *ForCausalLM: transformers types generate() on its mixin only
        self.end_of_turn = end_of_turn_ids(self.tokenizer, self.model.generation_config)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.end_of_turn[0])
        self.batch_tokens = int(spec.batch_tokens)
        self.faults = faults or BatchFaults()
        self._compute = threading.Lock()
        self.startup_seconds = time.perf_counter() - started

    def info(self):
        return worker_info(self.target, self.startup_seconds)

    def generate_group(self, names: list[str], attempts: dict) -> GroupDone:
        """Generate and commit the shards in `attempts` (shard -> the driver's `Attempt`)."""
        started = time.perf_counter()
        replies = []
        for name in names:
            if name not in attempts:
                continue  # generate batches one shard at a time: nothing to recompute as a filler
            try:
                with self._compute:
                    rows, generated, padded = self._generate_shard(name)
                replies.append(self.shards.commit(name, attempts[name], rows, generated, padded))
            except Exception as error:
                replies.append(dataclasses.replace(failure(error), shard=name))
        return GroupDone(replies, 0, 0.0, round(time.perf_counter() - started, 4))

    # -- one shard ------------------------------------------------------------------------
    def _generate_shard(self, name: str) -> tuple[list[dict], int, int]:
        """The shard's rows, tokens generated and tokens computed (padded batches)."""
        records = [(sample_id, conv) for sample_id, _, conv in self.shards.records(name)]
        replies: list[list[dict]] = [[] for _ in records]
        truncated = [False] * len(records)
        done = [False] * len(records)
        generated = [0] * len(records)
        padded = 0
        rounds = max(len(conv.turns) for _, conv in records)
        for turn in range(rounds):
            prompts = {}  # record position -> (prompt text, prompt ids)
            for i, (_, conv) in enumerate(records):
                if done[i] or turn >= len(conv.turns):
                    continue
                text, ids = render_prompt(self.tokenizer, conv.prompt(turn, replies[i]), self.settings.thinking)
                if len(ids) >= self.settings.max_length:
                    done[i] = truncated[i] = True  # no room for this turn: the record ends before it
                    continue
                prompts[i] = (text, ids)
            outputs, computed = self._generate(name, turn, {i: ids for i, (_, ids) in prompts.items()})
            padded += computed
            for i, (tokens, hit_limit) in outputs.items():
                text = reply_text(self.tokenizer, tokens)
                replies[i].append(reply_message(prompts[i][0], text))
                generated[i] += len(tokens) + (0 if hit_limit else 1)  # the end-of-turn token counts
                truncated[i] = truncated[i] or hit_limit
        rows = [
            dict(id=sample_id, messages=conv.result(replies[i]), truncated=truncated[i], generated_tokens=generated[i])
            for i, (sample_id, conv) in enumerate(records)
        ]
        return rows, sum(generated), padded

    def _generate(self, shard: str, turn: int, prompts: dict[int, list[int]]) -> tuple[dict, int]:
        """{record position: (reply tokens without the end-of-turn token, hit its limit)}
        and the tokens computed, batching the prompts by length."""
        positions = sorted(prompts)
        limits = [min(self.settings.max_new_tokens, self.settings.max_length - len(prompts[p])) for p in positions]
        sizes = [len(prompts[p]) + limit for p, limit in zip(positions, limits)]
        outputs, computed = {}, 0
        for number, batch in enumerate(batches_by_length(sizes, self.batch_tokens)):
            rows = [prompts[positions[b]] for b in batch]
            results = self._generate_batch(rows, [limits[b] for b in batch], seed_key=f"{shard}/{turn}/{number}")
            computed += len(batch) * max(sizes[b] for b in batch)
            outputs.update({positions[b]: result for b, result in zip(batch, results)})
            self.faults.batch_done()
        return outputs, computed

    def _generate_batch(self, rows: list[list[int]], limits: list[int], seed_key: str) -> list[tuple[list[int], bool]]:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: every row's reply starts at column `width`
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention[i, width - len(row) :] = 1
        sampled = self.settings.temperature > 0
        if sampled:
            digest = hashlib.sha256(f"{self.settings.seed}/{seed_key}".encode()).hexdigest()
            torch.manual_seed(int(digest[:15], 16))
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.target.device),
                attention_mask=attention.to(self.target.device),
                max_new_tokens=max(limits),
                do_sample=sampled,
                temperature=self.settings.temperature if sampled else None,
                top_k=None,
                top_p=None,
                eos_token_id=self.end_of_turn,
                pad_token_id=self.pad_id,
            )
        results = []
        for i, limit in enumerate(limits):
            tokens = out[i, width:].tolist()[:limit]
            stop = next((k for k, t in enumerate(tokens) if t in self.end_of_turn), None)
            results.append((tokens, True) if stop is None else (tokens[:stop], False))
        return results
