"""Data-parallel `train fit` on torch.distributed: the process group, which lanes
each rank serves, the reductions of a step, and the `--nproc` launcher.

A run is started by torchrun (`torchrun --nproc-per-node N -m train fit ...`) or
by `python -m train fit --nproc N`, which starts torchrun's launcher (the
elastic agent, `max_restarts=0`) itself. Each process reads RANK / WORLD_SIZE /
LOCAL_RANK from the environment torchrun sets, joins the group (NCCL on GPU,
gloo on CPU) and trains one replica under torch's DistributedDataParallel.

The data: which lanes a rank serves and which lane fills each slot of a step is
`train.data.lanes`'s deal.

A dead rank: the elastic agent sees the process exit (it polls every 0.1 s) and
stops the others; survivors blocked in a collective get an error from gloo (or
are stopped by the agent under NCCL), never the 30-minute collective timeout.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import re
import signal
import subprocess
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel

from store_schema.runtime.host import resolve_device
from train.config_error import ConfigError
from train.fitting.checkpoint import latest_checkpoint
from train.fitting.metrics import MetricSums
from train.world import World, comm_device

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)  # rank 0 evaluates while the others wait in the next collective
LAUNCH_LOGS = "launch"  # RUN/launch/: the other ranks' stdout/stderr under `--nproc`
LAUNCHED_BY_FIT = "DFLASH_FIT_LAUNCHER"  # set in the processes `--nproc` starts: the launcher reports failures


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
                raise ConfigError(
                    f"train fit: local rank {world.local_rank} has no GPU of its own (torch sees "
                    f"{torch.cuda.device_count()}); start at most that many processes per host"
                )
            device = torch.device("cuda", world.local_rank)
    return device


def is_peer_loss(error: BaseException) -> bool:
    """An error from a collective whose peer is gone (gloo raises a plain
    RuntimeError from DDP's reducer, with the transport in the message)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed")
    )


# -- reductions ----------------------------------------------------------------------------
def reduce_step(world: World, sums: MetricSums, epoch: int, device: torch.device) -> tuple[MetricSums, int]:
    """An optimizer step's metric sums over all ranks, and the furthest epoch any
    of its samples came from (every rank gets the same). The counts are read back
    (whether any rank trained decides the loop); the figures stay on the device."""
    if not world.distributed:
        return sums, epoch
    where = comm_device(device)
    vector = sums.as_vector().to(where)
    dist.all_reduce(vector)
    furthest = torch.tensor([epoch], dtype=torch.int64, device=where)
    dist.all_reduce(furthest, op=dist.ReduceOp.MAX)
    reduced = MetricSums.from_vector(sums.positions, vector)
    reduced.totals = reduced.totals.to(device)
    return reduced, int(furthest.item())


def any_rank(world: World, flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag set on any rank (every rank gets the same). Collective."""
    if not world.distributed:
        return list(flags)
    table = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=comm_device(device))
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return [bool(v) for v in table.cpu().tolist()]


class DrafterDDP(torch.nn.parallel.DistributedDataParallel):
    """DDP over the drafter that still answers `.config` (a family's `train_step` reads it)."""

    @property
    def config(self):
        return self.module.config


def no_gradient_sync(replica: torch.nn.Module) -> AbstractContextManager:
    """DDP's `no_sync` (gradients stay local until the step's last backward); nothing for a bare drafter."""
    return replica.no_sync() if isinstance(replica, DistributedDataParallel) else nullcontext()


def wrap(drafter: torch.nn.Module, world: World, device: torch.device, allreduce: str = "fp32") -> torch.nn.Module:
    """The module the training step runs: DDP on more than one process, else the drafter.
    `allreduce` ("fp32" / "bf16", `gradient_allreduce`'s answer) is the gradients' wire dtype."""
    if not world.distributed:
        return drafter
    return data_parallel(drafter, device, allreduce)  # rank 0 alone runs the evaluators


def data_parallel(drafter: torch.nn.Module, device: torch.device, allreduce: str) -> "DrafterDDP":
    """The drafter under DDP in the joined process group, as `wrap` builds it on more
    than one process (gpu_check builds it on one, to run the CUDA path)."""
    ids = [device.index] if device.type == "cuda" else None
    # No buffer sync before each forward: the drafter's only buffers are constants (rotary
    # inv_freq), and DDP's default broadcast of them before every forward, no_sync
    # micro-steps included, made the ranks wait for each other once per sequence rather
    # than once per optimizer step (2 CPU ranks sat a third idle). Newer torch
    # spells it forward_sync_buffers (and warns on broadcast_buffers); older torch lacks it.
    newer = "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    no_sync: dict[str, Any] = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    # Gradients are views into DDP's buckets: no second fp32 copy of every gradient, no copy
    # into the bucket after backward. Not static_graph: torch's reducer asserts
    # (expect_autograd_hooks_) when a step's first backward runs under no_sync, as
    # gradient accumulation's do.
    replica = DrafterDDP(drafter, device_ids=ids, gradient_as_bucket_view=True, **no_sync)
    if allreduce == "bf16":
        replica.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return replica


def gradient_allreduce(setting: str, world: World, device: torch.device) -> tuple[str, str]:
    """`train.grad_allreduce` resolved: (dtype, why). "auto" halves the bytes (bf16) where the
    all-reduce crosses PCIe (CUDA GPUs without NVLink between them), and keeps fp32 elsewhere."""
    if setting == "bf16" and world.distributed and device.type != "cuda":
        raise ConfigError(
            "config train.grad_allreduce: bf16 needs CUDA GPUs (DDP's bf16 hook runs over NCCL); "
            "use fp32 or auto on CPU"
        )
    if setting != "auto":
        return setting, f"train.grad_allreduce={setting}"
    if not world.distributed or device.type != "cuda":
        return "fp32", "auto: no GPU all-reduce to compress"
    linked = nvlink_between_gpus()
    if linked is False:
        return "bf16", "auto: this host's GPUs have no NVLink between them (nvidia-smi topo -m)"
    return "fp32", "auto: " + ("NVLink between the GPUs" if linked else "nvidia-smi could not say how the GPUs connect")


def nvlink_between_gpus() -> bool | None:
    """Whether `nvidia-smi topo -m` shows an NVLink (NV<n>) between this host's GPUs;
    None when it cannot tell (no nvidia-smi, no GPU rows)."""
    try:
        table = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return topology_has_nvlink(table)


def topology_has_nvlink(table: str) -> bool | None:
    """`nvidia-smi topo -m`'s matrix read: a GPU row with an NV<n> cell (NVLink); None without GPU rows."""
    rows = [line.split() for line in table.splitlines() if line.startswith("GPU")]
    if not rows:
        return None
    return any(re.fullmatch(r"NV\d+", cell) for row in rows for cell in row[1:])


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
            raise ConfigError(
                f"train fit: --node-rank {self.rank} is outside 0..{self.count - 1} (--nnodes {self.count})"
            )


def launch(nproc: int, fit_argv: list[str], run_dir: Path, nodes: Nodes = Nodes()) -> int:
    """Run `python -m train fit <fit_argv>` on `nproc` processes under torchrun's
    launcher (torch.distributed.launcher, max_restarts=0), as node `nodes.rank` of
    `nodes.count`: local rank 0 keeps this terminal, the other local ranks' output
    goes to RUN/launch/. A failed job ends with one line naming each failed rank
    (signal or exit code, its last error line) and where the last checkpoint is;
    the exit code is 1."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its failure report is ours, in one line
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for more than one process
    os.environ[LAUNCHED_BY_FIT] = "1"
    logs = run_dir / LAUNCH_LOGS
    specs = DefaultLogsSpecs(log_dir=str(logs), redirects={r: Std.ALL for r in range(1, nproc)})
    if nodes.count == 1:
        backend, endpoint, rdzv_configs = "c10d", "localhost:0", {}
    else:  # node 0 hosts the store the others join, as `torchrun --node-rank R --master-addr A` does
        backend, endpoint, rdzv_configs = "static", f"{nodes.master_addr}:{nodes.master_port}", {"rank": nodes.rank}
    config = LaunchConfig(
        min_nodes=nodes.count,
        max_nodes=nodes.count,
        nproc_per_node=nproc,
        logs_specs=specs,
        max_restarts=0,
        monitor_interval=0.1,
        run_id="fit",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
    )
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
        print(
            f"error: fit on {where} stopped: {failed}; the other ranks were stopped; {kept}; "
            "the same command with --resume continues",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def _describe_failure(rank: int, failure, logs: Path) -> str:
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    text = f"rank {rank} (pid {failure.pid}) {how}"
    errors = [
        line
        for path in sorted(logs.glob(f"*/attempt_*/{rank}/stderr.log"))
        for line in path.read_text(errors="replace").splitlines()
        if line.startswith("error: ")
    ]
    return f"{text} ({errors[-1]})" if errors else text
