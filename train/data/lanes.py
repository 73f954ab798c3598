"""This process's share of a run's sample streams (lanes): one loader and one
anchor/noise generator per lane, and each optimizer step's slots.

Lane j's samples draw their anchors (and noise) from lane j's own generator, in
the lane's order, so a sample's loss does not depend on which rank trains it or
on what the other lanes did. Lane 0's generator is seeded with `train.seed`, the
single-stream run's generator; lane j > 0 with a seed derived from (seed, j).

The deal: the run's samples are dealt into `data.lanes` streams
(`train.data.loader`, fixed when the run starts; default: the world size); rank r
serves the lanes j with j mod N == r, and slot k of optimizer step s is filled
from lane (s * G + k) mod lanes (G: the global batch). Which sample fills which
slot therefore depends on the seed, G and the lane count, never on N: a run on
2 ranks and a run on 1 with the same lanes train on the same samples per step.
A lane that has run dry pads its slots with zero-weight work (a sample re-run
with its loss times 0) so every rank does the same number of backward passes;
the run ends when no rank has a sample left.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from store_schema import StoreReader
from train.config_error import ConfigError
from train.data.loader import LoaderPosition, ShardLoader, TrainSample
from train.data.order import LANE_DEAL
from train.world import World, comm_device


def lane_generator(seed: int, lane: int) -> torch.Generator:
    if lane == 0:
        return torch.Generator().manual_seed(seed)
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, lane]).generate_state(1)[0]))


class LaneFeed:
    """The lanes one rank serves. `take(step)` returns, for each of this rank's
    slots of that optimizer step, (lane, sample or None when the lane has run dry).
    A checkpoint part (torchtitan's Stateful pattern): `state_dict` holds every
    lane's position and generator, `load_state_dict` puts this rank's back."""

    def __init__(
        self,
        loaders: dict[int, ShardLoader],
        generators: dict[int, torch.Generator],
        lanes: int,
        global_batch: int,
        world: World,
        device: torch.device,
    ):
        self.loaders = loaders
        self.generators = generators
        self.lanes = lanes
        self.global_batch = global_batch
        self.world, self.device = world, device
        self.positions: dict[int, LoaderPosition] = {lane: loader.start for lane, loader in loaders.items()}
        self._dry: set[int] = set()

    @classmethod
    def for_rank(
        cls,
        world: World,
        lanes: int,
        global_batch: int,
        seed: int,
        device: torch.device,
        make_loader: Callable[[int], ShardLoader],
    ) -> "LaneFeed":
        """The lanes `world.rank` serves: a loader from `make_loader(lane)` each, and
        its generator (lane 0's is seeded with `seed`, the run's; lane j's from (seed, j))."""
        mine = lanes_of(world.rank, world.size, lanes)
        return cls(
            {lane: make_loader(lane) for lane in mine},
            {lane: lane_generator(seed, lane) for lane in mine},
            lanes,
            global_batch,
            world,
            device,
        )

    def take(self, step: int) -> list[tuple[int, TrainSample | None]]:
        slots = [
            lane
            for lane in step_lanes(step, self.global_batch, self.lanes)
            if lane % self.world.size == self.world.rank
        ]
        taken = []
        for lane in slots:
            sample = None if lane in self._dry else next(self.loaders[lane], None)
            if sample is None:
                self._dry.add(lane)
            else:
                self.positions[lane] = sample.position
            taken.append((lane, sample))
        return taken

    def state_dict(self) -> dict:
        """Every lane's position and the shard list they refer to (JSON), and every
        lane's generator state (tensors: `generator` for lane 0, `generator_lane_<j>`).
        Collective: every rank calls it (each lane's state lives on its rank)."""
        positions, states = gather_lanes(self.world, self.lanes, self.positions, self.generator_states(), self.device)
        order = next(iter(self.loaders.values())).order
        record = {
            "position": positions[0].to_dict(),
            "shards": order.shards,
            "shards_sha256": order.shards_sha256,
            "skipped_shards": self.skipped_shards,
            "world_size": self.world.size,
            "lane_deal": LANE_DEAL,
            "lanes": [
                {"lane": lane, "rank": lane % self.world.size, **positions[lane].to_dict()}
                for lane in range(self.lanes)
            ],
        }
        return {**record, **{generator_key(lane): state for lane, state in states.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Put this rank's lanes where a checkpoint's `state_dict` left them (before
        the first `take`): each loader at its position, each generator in its state."""
        positions = lane_positions(state)
        for lane, loader in self.loaders.items():
            loader.seek(positions[lane])
            self.positions[lane] = positions[lane]
            self.generators[lane].set_state(state[generator_key(lane)])

    def generator_states(self) -> dict[int, torch.Tensor]:
        return {lane: generator.get_state() for lane, generator in self.generators.items()}

    def set_generator_states(self, states: dict[int, torch.Tensor]) -> None:
        for lane, state in states.items():
            self.generators[lane].set_state(state)

    @property
    def wait_seconds(self) -> float:
        return sum(loader.wait_seconds for loader in self.loaders.values())

    @property
    def skipped_shards(self) -> list[str]:
        return sorted({name for loader in self.loaders.values() for name in loader.skipped_shards})

    @property
    def skipped_empty(self) -> int:
        return sum(loader.skipped_empty for loader in self.loaders.values())

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()


def generator_key(lane: int) -> str:
    """A lane's generator in a checkpoint's tensors (lane 0's is the run's `generator`)."""
    return "generator" if lane == 0 else f"generator_lane_{lane}"


def resumed_deal(record: dict, configured: int | None, store: StoreReader, where) -> tuple[int, list[str]]:
    """The lanes and shard list a checkpoint's feed `record` fixes for the rest of its
    run; refused when the config asks for other lanes, when it dealt lanes anew every
    epoch (an older version), or when its shards are not all in the store."""
    lanes = len(lane_positions(record))
    if configured not in (None, lanes):
        raise ConfigError(
            f"--resume: {where} deals its samples into {lanes} lanes; data.lanes={configured} would deal them anew"
        )
    if lanes > 1 and record.get("lane_deal") != LANE_DEAL:
        raise ConfigError(
            f"--resume: {where} dealt its shards to lanes anew every epoch (an older "
            "version); this version deals them once per run and cannot continue it exactly: "
            "finish it with the version that started it, or start a new run"
        )
    missing = sorted(set(record["shards"]) - set(store.committed_shards()))
    if missing:
        raise ValueError(f"--resume: shards {missing[:4]} of the checkpointed run are not in {store.path}")
    return lanes, record["shards"]


def pad_sample(config, length: int) -> TrainSample:
    """Zero-weight work for a slot whose lane ran dry: a sequence of zeros of `length`
    (its family's `pad_length`) for a drafter of `config`, the shape of work, no data."""
    features = [torch.zeros(length, config.hidden_size, dtype=torch.bfloat16) for _ in config.context_layer_ids]
    return TrainSample(
        "<pad>", "", torch.zeros(length, dtype=torch.long), torch.ones(length, dtype=torch.uint8), features
    )


def lane_positions(loader_state: dict) -> dict[int, LoaderPosition]:
    """Each lane's position in a checkpoint's `loader` record (one lane before lanes existed)."""
    lanes = loader_state.get("lanes")
    if not lanes:
        return {0: LoaderPosition.from_dict(loader_state["position"])}
    return {int(entry["lane"]): LoaderPosition.from_dict(entry) for entry in lanes}


# -- the deal: which lane fills which slot ----------------------------------------
def check_world(world_size: int, lanes: int, global_batch: int, resumed: bool) -> None:
    """Refuse a world the run's sample deal cannot serve, saying why."""
    if global_batch % world_size:
        raise ConfigError(
            f"train fit on {world_size} processes: the global batch (train.batch_size x train.grad_accumulation = "
            f"{global_batch} sequences per optimizer step) must be a multiple of the number of processes"
        )
    if lanes % world_size:
        divisors = [d for d in range(1, lanes + 1) if lanes % d == 0]
        why = (
            "it was dealt into data.lanes={lanes} sample streams when it started (its checkpoints record the "
            "position of each); the processes must share them out evenly to continue exactly"
            if resumed
            else f"data.lanes={lanes} sample streams cannot be shared out evenly"
        )
        raise ConfigError(
            f"train fit on {world_size} processes: {why.format(lanes=lanes)}: use "
            f"{' or '.join(map(str, divisors))} processes"
        )


def lanes_of(rank: int, world_size: int, lanes: int) -> list[int]:
    """The lanes rank `rank` serves."""
    return [lane for lane in range(lanes) if lane % world_size == rank]


def step_lanes(step: int, global_batch: int, lanes: int) -> list[int]:
    """The lane of each slot of optimizer step `step` (0-based)."""
    return [(step * global_batch + k) % lanes for k in range(global_batch)]


def total_steps(lane_totals: list[float], global_batch: int) -> int:
    """Optimizer steps until the fullest lane has delivered its samples."""
    lanes = len(lane_totals)
    return max(1, max(math.ceil(total * lanes / global_batch - 1e-9) for total in lane_totals))


def gather_lanes(
    world: World,
    lanes: int,
    positions: dict[int, LoaderPosition],
    states: dict[int, torch.Tensor],
    device: torch.device,
) -> tuple[dict[int, LoaderPosition], dict[int, torch.Tensor]]:
    """Every lane's loader position and generator state, from whichever rank serves
    it (a checkpoint holds them all). Collective: every rank calls it."""
    if not world.distributed:
        return positions, states
    where = comm_device(device)
    size = next(iter(states.values())).numel()
    table = torch.zeros(lanes, 3 + size, dtype=torch.int64, device=where)
    for lane, position in positions.items():
        row = [position.epoch, position.group, position.sample, *states[lane].to(torch.int64).tolist()]
        table[lane] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(table)  # each row is non-zero on exactly one rank
    table = table.cpu()
    return (
        {lane: LoaderPosition(*map(int, table[lane, :3])) for lane in range(lanes)},
        {lane: table[lane, 3:].to(torch.uint8) for lane in range(lanes)},
    )
