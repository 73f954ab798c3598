"""One extraction worker: a long-lived Ray actor that holds the target for its lifetime.

The driver (`extract.job`) creates one per GPU (or per CPU slot with ``--device cpu``)
and hands it shard *names*; the worker reads its shard's plan entry from the store,
re-tokenizes the records (`load_samples`, which checks every sample against the
plan's digest), runs length-sorted batches through `TargetRunner`, and commits the
shard with `StoreWriter.write_shard`. Nothing large crosses Ray's object store: a
task's argument is a name, its reply a small dataclass of counts (`ShardDone`).

Overlap. The actor runs two shard tasks at once (``max_concurrency=2``) but only
one of them computes at a time (``_compute`` lock): while shard k+1 is on the
device, shard k is compressed, checksummed, fsynced and renamed into place by the
other thread. Within a shard, batch k+1 is submitted before batch k's host copy is
awaited (`TargetRunner.submit` copies into pinned memory without blocking on CUDA).
Re-tokenizing the next shard also happens outside the compute lock.

Errors. The worker never lets an exception escape a task: it returns a
`ShardFailed` with a ``kind`` so that the driver can tell a
deterministic failure (disk full, corpus changed since planning, a batch too big
for the device) -- which stops the job with a clear message -- from the worker
*process* dying (`ray.exceptions.RayActorError`), which is retried elsewhere.

Fault injection (tests and the fault suite only): ``kill_after_batches=N`` makes
the worker SIGKILL its own process after its N-th batch, i.e. mid-shard, before
that shard's write -- a real process death, not a simulated one.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np

# --------------------------------------------------------------------------- replies
# What a worker sends back to the driver (Ray pickles them between the processes).


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


@dataclass(frozen=True)
class ShardDone:
    """A shard this worker committed (or found committed already)."""

    shard: str
    written: bool  # False: already committed (by a worker presumed dead)
    samples: int
    tokens: int
    raw_bytes: int
    disk_bytes: int
    tokenize_seconds: float
    forward_seconds: float
    write_seconds: float
    pid: int


@dataclass(frozen=True)
class ShardFailed:
    """A shard this worker could not do, for a reason that would not go away on
    another worker; the driver stops the job with a message for its ``kind``."""

    shard: str
    kind: str  # "disk_full", "corpus_changed", "device_oom" or "error"
    message: str
    traceback: str
    host: str


@dataclass(frozen=True)
class ForwardTiming:
    """`ExtractionWorker.forward_only`: the forwards alone (benchmarks)."""

    seconds: float
    tokens: int


def _classify(error: BaseException) -> str:
    from .errors import is_disk_full
    from .planning import SampleMismatchError

    seen = error
    while seen is not None:
        if is_disk_full(seen):  # stop the job, free space, rerun
            return "disk_full"
        if isinstance(seen, SampleMismatchError):
            return "corpus_changed"
        if type(seen).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
            return "device_oom"
        seen = seen.__cause__ or seen.__context__
    return "error"


class ExtractionWorker:
    """Plain class; `extract.job` wraps it with ``ray.remote``. Also usable in-process."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str,
        store_path: str,
        layer_ids: list[int],
        settings: dict,
        *,
        device: str = "cpu",
        topk: int | None = None,
        store_dtype: str = "bfloat16",
        batch_tokens: int = 16384,
        torch_threads: int | None = None,
        trust_remote_code: bool = False,
        kill_after_batches: int | None = None,
    ):
        import torch
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from .planning import check_tokenizer
        from .target import TargetRunner, load_target

        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        started = time.perf_counter()
        self.store_path = str(store_path)
        self.settings = dict(settings)
        self.batch_tokens = int(batch_tokens)
        self.kill_after_batches = kill_after_batches
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        check_tokenizer(self.tokenizer, self.settings)  # fail at start, not on the first shard
        self.target = load_target(model_path, device=device, trust_remote_code=trust_remote_code)
        from store_schema.dtypes import store_dtype as lookup_store_dtype

        # fp8 stores: states are quantized on the device, so half the bytes cross to the host
        self.runner = TargetRunner(self.target, layer_ids, topk, quantize=lookup_store_dtype(store_dtype).scaled)
        self._compute = threading.Lock()
        self._writer = None
        self._writer_lock = threading.Lock()
        self._batches = 0
        # One tiny forward now: lazy initialisation (allocator, kernels) belongs to
        # start-up, and a broken model fails here rather than on a shard.
        self.runner.run_batch([np.arange(16, dtype=np.int64) % self.target.vocab_size])
        self.startup_seconds = time.perf_counter() - started

    # -- facts for the driver ---------------------------------------------------------------
    def info(self) -> WorkerInfo:
        import torch

        target = self.target
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
            startup_seconds=round(self.startup_seconds, 3),
        )

    # -- the work -----------------------------------------------------------------------------
    def _store_writer(self):
        with self._writer_lock:
            if self._writer is None:
                from store_schema import StoreWriter

                writer = StoreWriter(self.store_path)
                if writer.plan() is None:
                    raise RuntimeError(f"{self.store_path} has no plan; the driver writes it before any shard")
                self._writer = writer
            return self._writer

    def extract_shard(self, name: str) -> ShardDone | ShardFailed:
        """Compute and commit one shard; its counts (never tensors), or why it failed."""
        try:
            return self._extract_shard(name)
        except Exception as error:  # noqa: BLE001 - reported to the driver, which stops the job
            return ShardFailed(
                shard=name,
                kind=_classify(error),
                message=f"{type(error).__name__}: {error}",
                traceback=traceback.format_exc(limit=8),
                host=socket.gethostname(),
            )

    def _extract_shard(self, name: str) -> ShardDone:
        from store_schema import SampleArrays, raw_bytes_per_token

        from .planning import load_samples

        started = time.perf_counter()
        writer = self._store_writer()
        planned = writer.plan().shard(name)
        samples = load_samples(self.settings["corpus_path"], self.tokenizer, planned.samples, self.settings)
        tokenized = time.perf_counter()
        with self._compute:
            computed_at = time.perf_counter()
            outputs = self._forward(samples)
            forward_seconds = time.perf_counter() - computed_at
        arrays = []
        for (sample_id, input_ids, loss_mask), out in zip(samples, outputs):
            arrays.append(
                SampleArrays(
                    sample_id=sample_id,
                    input_ids=input_ids,
                    loss_mask=loss_mask,
                    hidden={layer: out[layer] for layer in self.runner.layer_ids},
                    topk_ids=None if self.runner.topk is None else out["topk_ids"].numpy(),
                    topk_logprobs=None if self.runner.topk is None else out["topk_logprobs"].numpy(),
                )
            )
        write_started = time.perf_counter()
        written = writer.write_shard(name, arrays)
        write_seconds = time.perf_counter() - write_started
        num_tokens = sum(len(ids) for _, ids, _ in samples)
        disk_bytes = _committed_bytes(self.store_path, name)
        return ShardDone(
            shard=name,
            written=bool(written),
            samples=len(samples),
            tokens=num_tokens,
            raw_bytes=num_tokens * raw_bytes_per_token(self.target.hidden_size, len(self.runner.layer_ids)),
            disk_bytes=disk_bytes,
            tokenize_seconds=round(tokenized - started, 4),
            forward_seconds=round(forward_seconds, 4),
            write_seconds=round(write_seconds, 4),
            pid=os.getpid(),
        )

    def _forward(self, samples) -> list[dict]:
        """All of a shard's samples through the target, batched by length; outputs in
        the order of `samples`. Batch k+1 is submitted before batch k is collected."""
        from .target import batches_by_length

        lengths = [len(ids) for _, ids, _ in samples]
        outputs: list[dict | None] = [None] * len(samples)
        pending = None
        for batch in batches_by_length(lengths, self.batch_tokens):
            submitted = (batch, self.runner.submit([samples[i][1] for i in batch]))
            if pending is not None:
                self._collect(pending, outputs)
            pending = submitted
            self._count_batch()
        if pending is not None:
            self._collect(pending, outputs)
        return outputs

    @staticmethod
    def _collect(pending, outputs) -> None:
        batch, result = pending
        for index, out in zip(batch, result.result()):
            outputs[index] = out

    def _count_batch(self) -> None:
        self._batches += 1
        if self.kill_after_batches is not None and self._batches >= self.kill_after_batches:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: a real, unannounced death

    # -- benchmark support --------------------------------------------------------------------
    def forward_only(self, names: list[str], start_at: float | None = None) -> ForwardTiming:
        """Time the forward passes alone for these shards: same samples, same batching,
        no writes. Tokenization happens before the clock starts, which starts at the
        wall-clock time ``start_at`` if given (to start several workers together)."""
        from .planning import load_samples

        writer = self._store_writer()
        shards = [
            load_samples(self.settings["corpus_path"], self.tokenizer, writer.plan().shard(n).samples, self.settings)
            for n in names
        ]
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        started = time.perf_counter()
        tokens = 0
        for samples in shards:
            self._forward(samples)
            tokens += sum(len(ids) for _, ids, _ in samples)
        return ForwardTiming(seconds=time.perf_counter() - started, tokens=tokens)


def _committed_bytes(store_path: str, name: str) -> int:
    from store_schema import Store

    try:
        return Store(store_path).commit(name).disk_bytes
    except Exception:  # noqa: BLE001 - a size figure for the report only
        return 0
