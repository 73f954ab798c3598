"""The worker protocol every sharded job's actors speak: the replies a worker sends
the driver (`GroupDone` of `ShardDone` / `ShardFailed`, `WorkerInfo` at start-up),
the one rule that turns a worker-side exception into a `ShardFailed` of a ``kind``
(`failure`), the worker process's setup, and the fault injection a worker obeys
(`BatchFaults`, armed from `extract.jobs.settings.FaultInjection`).

A worker never lets an exception escape a task: the driver tells a deterministic
failure (disk full, corpus changed since planning, a batch too big for the device)
-- which stops the job with a clear message -- from the worker *process* dying
(`ray.exceptions.RayActorError`), which is retried elsewhere. Nothing large crosses
Ray's object store: replies are small dataclasses of counts."""

from __future__ import annotations

import os
import signal
import socket
import traceback
from dataclasses import dataclass

from store_schema.commit.lock import ShardFenced
from store_schema.runtime.host import is_disk_full

from ..errors import SampleMismatchError

GROUPS_IN_FLIGHT = 2  # group tasks per actor: one on the device while the previous one is written


@dataclass(frozen=True)
class WorkerInfo:
    """The target as this worker loaded it, and where it runs."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    architecture: str
    # What ran, for the fingerprint: the kernels and the compute dtype (a bf16 GPU
    # forward and an fp32 CPU forward give slightly different states).
    kernels: dict
    device: str
    torch_threads: int
    pid: int
    host: str
    startup_seconds: float
    node: str = ""  # the Ray node id it runs on ("" outside Ray)


@dataclass(frozen=True)
class ShardDone:
    """A shard this worker committed (or found committed already)."""

    shard: str
    written: bool  # False: already committed (by a worker presumed dead)
    samples: int
    tokens: int
    raw_bytes: int
    disk_bytes: int  # the files it committed (0 where it committed none)
    padded_tokens: int  # what the device computed for its samples (each padded to its batch's longest)
    write_seconds: float
    pid: int
    node: str = ""  # the Ray node id of the worker that replied ("" outside Ray)
    upload_bytes: int = 0  # sent to object storage (0 for a directory store)
    upload_seconds: float = 0.0  # the upload alone: files, claim and marker
    spool_wait_seconds: float = 0.0  # waited for room in the local spool before building the shard


@dataclass(frozen=True)
class GroupDone:
    """A group's replies: one per shard the driver asked to write, in its order."""

    replies: list  # ShardDone | ShardFailed
    filler_tokens: int  # tokens of its already-committed shards, computed again so that batches stay the same
    tokenize_seconds: float
    forward_seconds: float


@dataclass(frozen=True)
class ShardFailed:
    """A shard this worker could not do, for a reason that would not go away on
    another worker; the driver stops the job with a message for its ``kind``."""

    shard: str
    kind: str  # "disk_full", "corpus_changed", "device_oom", "fenced" or "error"
    message: str
    traceback: str
    host: str


def failure(error: BaseException) -> ShardFailed:
    """A worker-side exception as the reply the driver reads (its shard filled in by the caller)."""
    return ShardFailed(
        shard="",
        kind=_classify(error),
        message=f"{type(error).__name__}: {error}",
        traceback=traceback.format_exc(limit=8),
        host=socket.gethostname(),
    )


def _classify(error: BaseException) -> str:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ShardFenced):  # the driver gave this attempt up; nobody waits for the reply
            return "fenced"
        if is_disk_full(seen):  # stop the job, free space, rerun
            return "disk_full"
        if isinstance(seen, SampleMismatchError):
            return "corpus_changed"
        if type(seen).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
            return "device_oom"
        kind = getattr(seen, "failure_kind", None)
        if isinstance(kind, str):  # an error that names its own kind
            return kind
        seen = seen.__cause__ or seen.__context__
    return "error"


def ray_node_id() -> str:
    """The Ray node this process runs on ("" outside Ray): several nodes may share a host name."""
    try:
        import ray  # a worker has Ray loaded already; the driver reads this module's replies without it
    except ImportError:  # the worker's code run in-process where Ray is not installed (gpu_check on a device)
        return ""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def quiet_worker_process(torch_threads: int | None) -> None:
    """A worker process's setup: transformers' model code imported without the cycle
    collector (`preload`), its torch thread count, and no transformers progress bars or
    warnings in the job's log."""
    # in the worker process only: the driver reads this module's replies without torch
    from store_schema.runtime.startup import preload

    preload("torch", "transformers.modeling_utils")  # the model code `load_target` builds on
    import torch
    from transformers.utils import logging as hf_logging

    if torch_threads:
        torch.set_num_threads(int(torch_threads))
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def worker_info(target, startup_seconds: float) -> WorkerInfo:
    """What a worker that loaded `target` (`extract.jobs.target.load_target`) tells the driver."""
    import torch  # in the worker process only, as above

    device_name = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    return WorkerInfo(
        num_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        architecture=target.architecture,
        kernels={**target.kernels, "compute_dtype": str(target.dtype).replace("torch.", "")},
        device=device_name,
        torch_threads=torch.get_num_threads(),
        pid=os.getpid(),
        host=socket.gethostname(),
        startup_seconds=round(startup_seconds, 3),
        node=ray_node_id(),
    )


class BatchFaults:
    """Fault injection in a worker: after its N-th batch the process SIGKILLs itself
    (`kill`: a real, unannounced death, mid-shard) or SIGSTOPs itself (`stop`: frozen
    until someone sends SIGCONT); a batch over `oom_over` padded tokens runs out of
    device memory. None: never."""

    def __init__(self, kill: int | None = None, stop: int | None = None, oom_over: int | None = None):
        self.kill, self.stop, self.oom_over, self.batches = kill, stop, oom_over, 0

    def before_batch(self, padded_tokens: int) -> None:
        """`oom_over`: a batch over that many padded tokens fails as a full device does."""
        if self.oom_over is not None and padded_tokens > self.oom_over:
            import torch  # the worker has torch loaded; the driver never calls this

            raise torch.OutOfMemoryError(
                f"CUDA out of memory (fault injection: a batch of {padded_tokens} padded tokens > {self.oom_over})"
            )

    def batch_done(self) -> None:
        self.batches += 1
        if self.kill is not None and self.batches >= self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop is not None and self.batches == self.stop:
            os.kill(os.getpid(), signal.SIGSTOP)
