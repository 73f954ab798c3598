"""The sample order of a run: which shards each lane reads in which epoch, how they
are grouped, how a group's samples are permuted, and where a lane stands. Pure
arithmetic on (seed, epoch, group, lane): no store read, no thread, so it is
testable on its own and a checkpointed position *is* the RNG state
(`train.data.loader` explains the order; `ShardLoader` prefetches along it)."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from train.data.heldout import is_heldout

LANE_DEAL = "fixed"  # checkpoints record how shards were dealt to lanes (before: anew every epoch)
# the deal's seed words after the seed: three words ending nonzero, a key no epoch order ([seed, epoch]) or
# group permutation ([seed, epoch, group, 1, ...]) uses (numpy's SeedSequence ignores trailing zero words)
LANE_DEAL_STREAM = (0xDEA1, 1)


@dataclass(frozen=True)
class LoaderPosition:
    epoch: int = 0
    group: int = 0  # index of the shard group in this epoch's order
    sample: int = 0  # samples of that group already delivered

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LoaderPosition":
        return cls(int(data["epoch"]), int(data["group"]), int(data["sample"]))

    def describe(self) -> str:
        return f"epoch {self.epoch}, shard group {self.group}, sample {self.sample} of that group"


class SampleOrder:
    """The order lane `lane` of `lanes` reads `shards` (sorted) in, seeded by `seed`,
    shuffled through groups of `buffer_shards` shards."""

    def __init__(self, shards: list[str], seed: int, buffer_shards: int, lane: int = 0, lanes: int = 1):
        self.shards = sorted(shards)
        self.seed, self.buffer_shards, self.lane, self.lanes = seed, buffer_shards, lane, lanes

    @property
    def shards_sha256(self) -> str:
        """Identifies the shard list a position refers to (a resume must see the same)."""
        return hashlib.sha256("\n".join(self.shards).encode()).hexdigest()

    def epoch_order(self, epoch: int) -> list[str]:
        rng = np.random.default_rng([self.seed, epoch])
        return [self.shards[i] for i in rng.permutation(len(self.shards))]

    @functools.cached_property
    def shard_lanes(self) -> dict[str, int]:
        """The lane of each shard, dealt once for the run (a seeded permutation of the
        shards, position i to lane i mod lanes): a lane reads the same shards every
        epoch, so a node's shard cache (`train.data.cache`) holds its own lanes' shards."""
        rng = np.random.default_rng([self.seed, *LANE_DEAL_STREAM])
        return {self.shards[i]: position % self.lanes for position, i in enumerate(rng.permutation(len(self.shards)))}

    def lane_shards(self, epoch: int, lane: int | None = None) -> list[str]:
        """The shards `lane` (default: this order's) reads in `epoch`, in the epoch's order."""
        lane = self.lane if lane is None else lane
        return [name for name in self.epoch_order(epoch) if self.shard_lanes[name] == lane]

    def num_groups(self, epoch: int) -> int:
        return math.ceil(len(self.lane_shards(epoch)) / self.buffer_shards)

    def groups(self, epoch: int) -> list[list[str]]:
        order = self.lane_shards(epoch)
        size = self.buffer_shards
        return [order[i : i + size] for i in range(0, len(order), size)]

    def group_permutation(self, epoch: int, group: int, count: int) -> np.ndarray:
        lane = [] if self.lanes == 1 else [self.lane, self.lanes]
        return np.random.default_rng([self.seed, epoch, group, 1, *lane]).permutation(count)

    def next_position(self, position: LoaderPosition, group_size: int) -> LoaderPosition:
        """The position after delivering one more sample of a group of `group_size`."""
        if position.sample + 1 < group_size:
            return LoaderPosition(position.epoch, position.group, position.sample + 1)
        if position.group + 1 < self.num_groups(position.epoch):
            return LoaderPosition(position.epoch, position.group + 1, 0)
        return LoaderPosition(position.epoch + 1, 0, 0)

    def lane_totals(self, counts: dict[str, float], epochs: int) -> list[float]:
        """Samples each lane delivers over `epochs`, given each shard's count."""
        return [sum(counts[n] for e in range(epochs) for n in self.lane_shards(e, lane)) for lane in range(self.lanes)]


def has_loss_tokens(tokens: int, loss_tokens: int) -> bool:
    """A planned sample with a loss token: the least any drafter family trains on."""
    return loss_tokens > 0


def train_samples_by_shard(
    store, shards: list[str], heldout_fraction: float, trainable: Callable[[int, int], bool]
) -> dict[str, float]:
    """Training samples of each shard: from the store's plan, those `trainable` (the
    drafter family's `planned_filter`) counts, else estimated from the commit records."""
    plan = store.plan()
    if plan is not None:
        by_name = {shard.name: shard for shard in plan.shards}
        if all(name in by_name for name in shards):
            return {
                n: sum(
                    trainable(s.num_tokens, s.num_loss_tokens) and not is_heldout(s.sample_id, heldout_fraction)
                    for s in by_name[n].samples
                )
                for n in shards
            }
    return {n: store.commit(n).num_samples * (1.0 - heldout_fraction) for n in shards}
