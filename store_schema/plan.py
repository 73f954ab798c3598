"""The job plan: which corpus records become which samples in which shard.

Fixed by a planning pass before any model work, written into the store, so that a
rerun, `verify`, and any number of workers see the same expected content."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace

DEFAULT_MAX_LENGTH = 3072
DEFAULT_SHARD_TOKENS = 32768
DEFAULT_MIN_LOSS_TOKENS = 1  # a sample without a reply token trains no drafter; each family's filter does the rest
DEFAULT_SEED = 0
# Which tokens of an assistant turn the loss scores (`--loss-mask`), and how a plan
# records each (its `mask_convention`). "turn": the turn as the target emits it when
# served (reasoning, content, tool calls, the end-of-turn token); "content": the
# message's content only, the rule every plan made before scopes existed used.
LOSS_MASK_CONVENTIONS = {"turn": "assistant_turn", "content": "assistant_content"}
DEFAULT_LOSS_MASK = "turn"


@dataclass(frozen=True)
class PlanSettings:
    """The choices that decide a plan's content besides the corpus and the tokenizer.

    The planner's input, and recorded in the plan's settings under the same keys
    (`to_json` / `from_json`), so a resumed job compares what it would plan
    with what the store was planned with, and a store's settings read back as this.

    The store serves every drafter family, so it quarantines only samples none can
    train on (`min_loss_tokens`); a family's sample filter decides the rest at
    `fit`. Plans made for one DFlash block (`block_size`, every plan before
    families) keep it: their `min_loss_tokens` is 2 x `block_size`."""

    max_length: int = DEFAULT_MAX_LENGTH  # longer records are truncated (or quarantined: drop_long)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # token budget of one shard
    min_loss_tokens: int = DEFAULT_MIN_LOSS_TOKENS  # fewer loss tokens: quarantined
    seed: int = DEFAULT_SEED  # the shuffle that deals samples into shards
    drop_long: bool = False
    limit: int | None = None  # plan only the first `limit` records
    loss_mask: str = DEFAULT_LOSS_MASK  # a key of LOSS_MASK_CONVENTIONS
    block_size: int | None = None  # planned for one DFlash block: min_loss_tokens is 2 x this

    def __post_init__(self):
        sizes = ("max_length", "shard_tokens", "min_loss_tokens")
        for name in sizes if self.block_size is None else ("block_size", *sizes):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"plan settings: {name} must be a positive integer, got {value!r}")
            if name == "block_size":
                object.__setattr__(self, "min_loss_tokens", 2 * value)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"plan settings: seed must be an integer, got {self.seed!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)):
            raise ValueError(f"plan settings: limit must be an integer or None, got {self.limit!r}")
        if self.loss_mask not in LOSS_MASK_CONVENTIONS:
            raise ValueError(
                f"plan settings: loss_mask must be one of {tuple(LOSS_MASK_CONVENTIONS)}, got {self.loss_mask!r}"
            )
        object.__setattr__(self, "drop_long", bool(self.drop_long))

    def to_json(self) -> dict:
        """These settings as the plan records them: the loss-mask scope as the
        `mask_convention` plans have always recorded (so a content-scope plan keeps the
        digest it had before scopes existed), `block_size` only where planned for one."""
        record = asdict(self)
        record["mask_convention"] = LOSS_MASK_CONVENTIONS[record.pop("loss_mask")]
        if self.block_size is None:
            del record["block_size"]
        return record

    def overridden(self, given: "PlanSettings", names: Collection[str]) -> "PlanSettings":
        """These settings (a stored plan's) with those `names`d taken from `given` (what a
        resumed job's command line set; `block_size` and `min_loss_tokens` go together)."""
        names = set(names)
        if names & {"block_size", "min_loss_tokens"}:
            names |= {"block_size", "min_loss_tokens"}
        return replace(self, **{name: getattr(given, name) for name in names})

    @classmethod
    def from_json(cls, record: Mapping) -> "PlanSettings":
        """The settings a recorded plan was made with (a plan's `settings`)."""
        scopes = {convention: scope for scope, convention in LOSS_MASK_CONVENTIONS.items()}
        convention = record.get("mask_convention", LOSS_MASK_CONVENTIONS["content"])
        if convention not in scopes:
            raise ValueError(f"plan settings: unknown mask_convention {convention!r}")
        names = [name for name in cls.__dataclass_fields__ if name not in ("loss_mask", "block_size")]
        return cls(
            **{name: record[name] for name in names}, block_size=record.get("block_size"), loss_mask=scopes[convention]
        )


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
    # As recorded (on disk and in `digest`): `PlanSettings.to_json()` plus what the
    # corpus and the tokenizer were (paths, hashes, format) and the planner's conventions.
    settings: dict = field(default_factory=dict)

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
        """`asdict(self)`, built field by field: a full job's plan holds ~900,000
        samples, and asdict's generic recursion was most of the cost of `digest`."""
        return {
            "shards": tuple({"name": s.name, "samples": tuple(dict(vars(x)) for x in s.samples)} for s in self.shards),
            "quarantined": tuple(dict(vars(q)) for q in self.quarantined),
            "settings": copy.deepcopy(self.settings),
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "Plan":
        """The plan `to_json` gave (e.g. kept in a JSON manifest)."""
        shards = tuple(PlannedShard(s["name"], tuple(PlannedSample(**x) for x in s["samples"])) for s in data["shards"])
        quarantined = tuple(QuarantinedRecord(**q) for q in data.get("quarantined", ()))
        return cls(shards, quarantined, dict(data.get("settings", {})))

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
