"""The job plan: which corpus records become which samples in which shard.

Fixed by a planning pass before any model work, written into the store, so that a
rerun, `verify`, and any number of workers see the same expected content."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PlannedSample:
    sample_id: str  # safe name (see `is_safe_id`), unique in the store
    record_index: int  # position of the record in the corpus, as the corpus reader numbers them
    num_tokens: int  # after truncation to max_length
    num_loss_tokens: int
    digest: str  # sha256 hex of the int32 input_ids bytes + uint8 loss_mask bytes


@dataclass(frozen=True)
class PlannedShard:
    name: str  # "shard-000000"
    samples: tuple[PlannedSample, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


@dataclass(frozen=True)
class QuarantinedRecord:
    record_index: int
    sample_id: str | None
    reason: str  # one short machine-readable reason, e.g. "no_assistant_turn"
    detail: str = ""


@dataclass(frozen=True)
class Plan:
    shards: tuple[PlannedShard, ...]
    quarantined: tuple[QuarantinedRecord, ...] = ()
    settings: dict = field(default_factory=dict)  # max_length, shard_tokens, corpus path/hash, ...

    @property
    def num_samples(self) -> int:
        return sum(len(s.samples) for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    def shard(self, name: str) -> PlannedShard:
        for shard in self.shards:
            if shard.name == name:
                return shard
        raise KeyError(f"shard {name!r} is not in the plan")

    def to_json(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:06d}"


def sample_digest(input_ids_bytes: bytes, loss_mask_bytes: bytes) -> str:
    return hashlib.sha256(input_ids_bytes + loss_mask_bytes).hexdigest()


_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def is_safe_id(sample_id: str) -> bool:
    """Sample ids are names, never paths: 1-128 chars of [A-Za-z0-9._-], not starting with '.'."""
    return (
        isinstance(sample_id, str)
        and 0 < len(sample_id) <= 128
        and not sample_id.startswith(".")
        and set(sample_id) <= _SAFE
    )
