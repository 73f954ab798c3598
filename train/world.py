"""This process's place in a data-parallel job, as torchrun describes it: the one
type `train.fitting` (the process group, the reductions) and `train.data` (which
lanes a rank serves) both speak."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place in the job (a single process is rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> World:
    """The world torchrun describes in the environment; rank 0 of 1 without it."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


def local_world_size(world: World) -> int:
    """Processes of the job on this host (torchrun's LOCAL_WORLD_SIZE; the whole world without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world.size))


def comm_device(device: torch.device) -> torch.device:
    """Where a collective's tensors live: the device under NCCL, the CPU under gloo."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")
