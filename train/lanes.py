"""This process's share of a run's sample streams (lanes): one loader and one
anchor/noise generator per lane, and each optimizer step's slots.

Lane j's samples draw their anchors (and noise) from lane j's own generator, in
the lane's order, so a sample's loss does not depend on which rank trains it or
on what the other lanes did. Lane 0's generator is seeded with `train.seed`, the
single-stream run's generator; lane j > 0 with a seed derived from (seed, j).
"""

from __future__ import annotations

import numpy as np
import torch

from train.distributed import step_lanes
from train.loader import LoaderPosition, ShardLoader, TrainSample


def lane_generator(seed: int, lane: int) -> torch.Generator:
    if lane == 0:
        return torch.Generator().manual_seed(seed)
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, lane]).generate_state(1)[0]))


class LaneFeed:
    """The lanes one rank serves. `take(step)` returns, for each of this rank's
    slots of that optimizer step, (lane, sample or None when the lane has run dry)."""

    def __init__(self, loaders: dict[int, ShardLoader], generators: dict[int, torch.Generator], lanes: int,
                 global_batch: int, rank: int, world_size: int):
        self.loaders = loaders
        self.generators = generators
        self.lanes = lanes
        self.global_batch = global_batch
        self.rank, self.world_size = rank, world_size
        self.positions: dict[int, LoaderPosition] = {lane: loader.start for lane, loader in loaders.items()}
        self._dry: set[int] = set()

    def take(self, step: int) -> list[tuple[int, TrainSample | None]]:
        slots = [lane for lane in step_lanes(step, self.global_batch, self.lanes) if lane % self.world_size == self.rank]
        taken = []
        for lane in slots:
            sample = None if lane in self._dry else next(self.loaders[lane], None)
            if sample is None:
                self._dry.add(lane)
            else:
                self.positions[lane] = sample.position
            taken.append((lane, sample))
        return taken

    def generator_states(self) -> dict[int, torch.Tensor]:
        return {lane: generator.get_state() for lane, generator in self.generators.items()}

    @property
    def wait_seconds(self) -> float:
        return sum(loader.wait_seconds for loader in self.loaders.values())

    @property
    def skipped_shards(self) -> list[str]:
        return sorted({name for loader in self.loaders.values() for name in loader.skipped_shards})

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()
