"""What every generate worker does with the output besides generating: read a
planned shard's records back (checked against the plan) and commit its rows."""

from __future__ import annotations

import dataclasses
import os
import time

from store_schema.plan import Plan

from ..corpus import BadRecord, open_corpus
from ..errors import SampleMismatchError
from ..generated_corpus import commit_shard, read_manifest, shard_table
from ..jobs.protocol import ShardDone, failure
from .turns import Conversation, conversation, conversation_digest


class CorpusShards:
    """The plan's shards of one generated corpus, read from the source corpus and
    committed into the output."""

    def __init__(self, corpus_path: str, out_path: str):
        self.out_path = str(out_path)
        self.plan = Plan.from_json(read_manifest(out_path)["plan"])
        self.corpus = open_corpus(corpus_path)

    def records(self, name: str) -> list[tuple[str, int, Conversation]]:
        """(sample id, record index, conversation) of each record of shard `name`."""
        planned = self.plan.shard(name).samples
        out = []
        for sample, record in zip(planned, self.corpus.read([s.record_index for s in planned])):
            where = f"{self.corpus.where(sample.record_index)} ({sample.sample_id!r})"
            try:
                if isinstance(record, BadRecord):
                    raise ValueError(f"{record.reason} {record.detail}".strip())
                conv = conversation(record)
            except Exception as error:
                raise SampleMismatchError(f"{where} is no longer a valid conversation ({error})") from None
            if conversation_digest(conv) != sample.digest:
                raise SampleMismatchError(f"{where} differs from when it was planned")
            out.append((sample.sample_id, sample.record_index, conv))
        return out

    def commit(self, name: str, attempt, rows: list[dict], generated: int, padded: int, extra: dict | None = None):
        """`ShardDone`, or the `ShardFailed` the driver stops on."""
        started = time.perf_counter()
        try:
            record = commit_shard(self.out_path, name, shard_table(rows), attempt=attempt, extra=extra)
        except Exception as error:
            return dataclasses.replace(failure(error), shard=name)
        disk = 0 if record is None else sum(entry["size"] for entry in record["files"].values())
        return ShardDone(
            shard=name,
            written=record is not None,
            samples=len(rows),
            tokens=generated,
            raw_bytes=0,
            disk_bytes=disk,
            padded_tokens=padded,
            write_seconds=round(time.perf_counter() - started, 4),
            pid=os.getpid(),
        )
