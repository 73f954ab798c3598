"""Data-parallel `train fit` on torch.distributed: the process group, which lanes
each rank serves, the reductions of a step, and the `--nproc` launcher.

A run is started by torchrun (`torchrun --nproc-per-node N -m train fit ...`) or
by `python -m train fit --nproc N`, which starts torchrun's launcher (the
elastic agent, `max_restarts=0`) itself. Each process reads RANK / WORLD_SIZE /
LOCAL_RANK from the environment torchrun sets, joins the group (NCCL on GPU,
gloo on CPU) and trains one replica under torch's DistributedDataParallel.

The data: the run's samples are dealt into `data.lanes` streams
(`train.data.loader`, fixed when the run starts; default: the world size); rank r
serves the lanes j with j mod N == r, and slot k of optimizer step s is filled
from lane (s * G + k) mod lanes (G: the global batch). Which sample fills which
slot therefore depends on the seed, G and the lane count, never on N: a run on
2 ranks and a run on 1 with the same lanes train on the same samples per step.
A lane that has run dry pads its slots with zero-weight work (a sample re-run
with its loss times 0) so every rank does the same number of backward passes;
the run ends when no rank has a sample left.

A dead rank: the elastic agent sees the process exit (it polls every 0.1 s) and
stops the others; survivors blocked in a collective get an error from gloo (or
are stopped by the agent under NCCL), never the 30-minute collective timeout.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from store_schema.runtime.host import resolve_device
from train.config import ConfigError
from train.data.loader import LoaderPosition
from train.fitting.metrics import MetricSums

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)  # rank 0 evaluates while the others wait in the next collective
LAUNCH_LOGS = "launch"  # RUN/launch/: the other ranks' stdout/stderr under `--nproc`
LAUNCHED_BY_FIT = "DFLASH_FIT_LAUNCHER"  # set in the processes `--nproc` starts: the launcher reports failures


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


def init_process_group(world: World, device: torch.device) -> None:
    """Join the job's group: NCCL for CUDA devices, gloo on CPU."""
    if not world.distributed or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=device if device.type == "cuda" else None)


def close_process_group() -> None:
    """Leave the group together (after every DDP module over it is released:
    a DDP reducer outliving its gloo group waits forever on a departed peer)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def device_for(world: World, name: str) -> torch.device:
    """`train.device` for this rank: "auto"/"cuda" take this process's local GPU."""
    device = resolve_device(name, "config train.device")
    if device.type == "cuda":
        if world.distributed:
            if world.local_rank >= torch.cuda.device_count():
                raise ConfigError(f"train fit: local rank {world.local_rank} has no GPU of its own (torch sees "
                                  f"{torch.cuda.device_count()}); start at most that many processes per host")
            device = torch.device("cuda", world.local_rank)
    return device


def is_peer_loss(error: BaseException) -> bool:
    """An error from a collective whose peer is gone (gloo raises a plain
    RuntimeError from DDP's reducer, with the transport in the message)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed"))


# -- the deal ------------------------------------------------------------------------------
def check_world(world_size: int, lanes: int, global_batch: int, resumed: bool) -> None:
    """Refuse a world the run's sample deal cannot serve, saying why."""
    if global_batch % world_size:
        raise ConfigError(
            f"train fit on {world_size} processes: the global batch (train.batch_size x train.grad_accumulation = "
            f"{global_batch} sequences per optimizer step) must be a multiple of the number of processes")
    if lanes % world_size:
        divisors = [d for d in range(1, lanes + 1) if lanes % d == 0]
        why = ("it was dealt into data.lanes={lanes} sample streams when it started (its checkpoints record the "
               "position of each); the processes must share them out evenly to continue exactly"
               if resumed else f"data.lanes={lanes} sample streams cannot be shared out evenly")
        raise ConfigError(f"train fit on {world_size} processes: {why.format(lanes=lanes)}: use "
                          f"{' or '.join(map(str, divisors))} processes")


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


# -- reductions ----------------------------------------------------------------------------
def _comm_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def reduce_step(world: World, sums: MetricSums, epoch: int, device: torch.device) -> tuple[MetricSums, int]:
    """An optimizer step's metric sums over all ranks, and the furthest epoch any
    of its samples came from (every rank gets the same)."""
    if not world.distributed:
        return sums, epoch
    where = _comm_device(device)
    vector = sums.as_vector().to(where)
    dist.all_reduce(vector)
    furthest = torch.tensor([epoch], dtype=torch.int64, device=where)
    dist.all_reduce(furthest, op=dist.ReduceOp.MAX)
    return MetricSums.from_vector(sums.block_size, vector.cpu()), int(furthest.item())


def any_rank(world: World, flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag set on any rank (every rank gets the same). Collective."""
    if not world.distributed:
        return list(flags)
    table = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=_comm_device(device))
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return [bool(v) for v in table.cpu().tolist()]


def gather_lanes(world: World, lanes: int, positions: dict[int, LoaderPosition], states: dict[int, torch.Tensor],
                 device: torch.device) -> tuple[dict[int, LoaderPosition], dict[int, torch.Tensor]]:
    """Every lane's loader position and generator state, from whichever rank serves
    it (a checkpoint holds them all). Collective: every rank calls it."""
    if not world.distributed:
        return positions, states
    where = _comm_device(device)
    size = next(iter(states.values())).numel()
    table = torch.zeros(lanes, 3 + size, dtype=torch.int64, device=where)
    for lane, position in positions.items():
        row = [position.epoch, position.group, position.sample, *states[lane].to(torch.int64).tolist()]
        table[lane] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(table)  # each row is non-zero on exactly one rank
    table = table.cpu()
    return ({lane: LoaderPosition(*map(int, table[lane, :3])) for lane in range(lanes)},
            {lane: table[lane, 3:].to(torch.uint8) for lane in range(lanes)})


class DrafterDDP(torch.nn.parallel.DistributedDataParallel):
    """DDP over the drafter that still answers `.config` (dflash_step reads the block size)."""

    @property
    def config(self):
        return self.module.config


def wrap(drafter: torch.nn.Module, world: World, device: torch.device) -> torch.nn.Module:
    """The module the training step runs: DDP on more than one process, else the drafter."""
    if not world.distributed:
        return drafter
    ids = [device.index] if device.type == "cuda" else None
    # broadcast_buffers=False: the drafter's only buffers are constants (rotary inv_freq),
    # and DDP's default broadcast of them before every forward, no_sync micro-steps
    # included, made the ranks wait for each other once per sequence rather than
    # once per optimizer step (measured: 2 CPU ranks at ~65 % busy each).
    return DrafterDDP(drafter, device_ids=ids, broadcast_buffers=False)  # rank 0 alone runs the evaluators


# -- `python -m train fit --nproc N` ---------------------------------------------------------
DEFAULT_MASTER_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class Nodes:
    """This host's place among the job's hosts (torchrun's --nnodes, --node-rank,
    --master-addr, --master-port; a static rendezvous, as torchrun's default)."""

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self):
        if not 0 <= self.rank < self.count:
            raise ConfigError(f"train fit: --node-rank {self.rank} is outside 0..{self.count - 1} "
                              f"(--nnodes {self.count})")


def launch(nproc: int, fit_argv: list[str], run_dir: Path, nodes: Nodes = Nodes()) -> int:
    """Run `python -m train fit <fit_argv>` on `nproc` processes under torchrun's
    launcher (torch.distributed.launcher, max_restarts=0), as node `nodes.rank` of
    `nodes.count`: local rank 0 keeps this terminal, the other local ranks' output
    goes to RUN/launch/. A failed job ends with one line naming each failed rank
    (signal or exit code, its last error line) and where the last checkpoint is;
    the exit code is 1."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from train.fitting.checkpoint import latest_checkpoint

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its failure report is ours, in one line
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for more than one process
    os.environ[LAUNCHED_BY_FIT] = "1"
    logs = run_dir / LAUNCH_LOGS
    specs = DefaultLogsSpecs(log_dir=str(logs), redirects={r: Std.ALL for r in range(1, nproc)})
    if nodes.count == 1:
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0")
    else:  # node 0 hosts the store the others join, as `torchrun --node-rank R --master-addr A` does
        rendezvous = dict(rdzv_backend="static", rdzv_endpoint=f"{nodes.master_addr}:{nodes.master_port}",
                          rdzv_configs={"rank": nodes.rank})
    config = LaunchConfig(min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=nproc, logs_specs=specs,
                          max_restarts=0, monitor_interval=0.1, run_id="fit", **rendezvous)
    try:
        elastic_launch(config, sys.executable)("-m", "train", "fit", *fit_argv)
    except ChildFailedError as error:
        latest = latest_checkpoint(run_dir)
        failures = sorted(error.failures.items())
        # SIGTERM is how the launcher stops the survivors: the cause is whatever else happened.
        causes = [(r, f) for r, f in failures if f.exitcode != -signal.SIGTERM] or failures
        failed = "; ".join(_describe_failure(rank, failure, logs) for rank, failure in causes)
        kept = f"the last checkpoint is {latest}" if latest else "no checkpoint was written yet"
        where = f"{nproc} processes" + (f" of node {nodes.rank} of {nodes.count}" if nodes.count > 1 else "")
        print(f"error: fit on {where} stopped: {failed}; the other ranks were stopped; {kept}; "
              "the same command with --resume continues", file=sys.stderr, flush=True)
        return 1
    return 0


def _describe_failure(rank: int, failure, logs: Path) -> str:
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    text = f"rank {rank} (pid {failure.pid}) {how}"
    errors = [line for path in sorted(logs.glob(f"*/attempt_*/{rank}/stderr.log"))
              for line in path.read_text(errors="replace").splitlines() if line.startswith("error: ")]
    return f"{text} ({errors[-1]})" if errors else text
