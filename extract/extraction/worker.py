"""One extraction worker: a long-lived Ray actor that holds the target for its lifetime.

The driver (`extract.extraction.job`) creates one per GPU (or per CPU slot with ``--device cpu``)
and hands it a *group* of shard names (`extract.jobs.batching.batch_groups`), each
shard still to write as a numbered attempt (`store_schema.commit.lock.Attempt`). The
worker reads the shards' plan entries from the store, re-tokenizes the records
(`load_samples`, which checks every sample against the plan's digest), batches the
whole group's samples by length through `TargetRunner` (less padding than one
shard's samples alone; the same batches in every run), and commits each shard with
`ShardWriter.write_shard`, which claims the attempt first (a revoked attempt never
commits). A shard of the group that is committed already is computed as a batch
filler and not written. Nothing large crosses Ray's object store: a task's
argument is names, its reply small dataclasses of counts (`ShardDone`).

Overlap. The actor runs two group tasks at once (``max_concurrency=2``) but only
one of them computes at a time (``_compute`` lock): while group k+1 is on the
device, group k's shards are compressed, checksummed, fsynced and renamed into
place by the other thread. Within a group, batch k+1 is submitted before batch k's
host copy is awaited (`TargetRunner.submit` copies into pinned memory without
blocking on CUDA). Re-tokenizing the next group happens outside the compute lock.

Only what is captured is loaded: decoder layers up to the last context layer and no
``lm_head`` (`load_target(keep_layers=...)`), unless top-k is asked for.

Errors. The worker never lets an exception escape a task: it returns a
`ShardFailed` with a ``kind`` so that the driver can tell a
deterministic failure (disk full, corpus changed since planning, a batch too big
for the device) -- which stops the job with a clear message -- from the worker
*process* dying (`ray.exceptions.RayActorError`), which is retried elsewhere.

Fault injection (tests and the fault suite only): ``kill_after_batches=N`` makes
the worker SIGKILL its own process after its N-th batch, i.e. mid-shard, before
that shard's write -- a real process death, not a simulated one;
``stop_after_batches=N`` makes it SIGSTOP itself there instead (a hung or cut-off
worker, alive, that the driver must stop trusting).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from transformers import AutoTokenizer

from store_schema import NonFiniteStatesError, SampleArrays, raw_bytes_per_token
from store_schema.dtypes import store_dtype as lookup_store_dtype
from store_schema.stores import backend

from ..jobs.batching import batches_min_padding
from ..jobs.protocol import (
    GROUPS_IN_FLIGHT,
    BatchFaults,
    GroupDone,
    ShardDone,
    ShardFailed,
    WorkerInfo,
    failure,
    quiet_worker_process,
    ray_node_id,
    worker_info,
)
from ..jobs.target import load_target
from .planning import check_tokenizer, load_samples
from .runner import TargetRunner


@dataclass(frozen=True)
class ForwardTiming:
    """`ExtractionWorker.forward_only`: the forwards alone (benchmarks)."""

    seconds: float
    tokens: int
    padded_tokens: int


@dataclass(frozen=True)
class ExtractionSpec:
    """What every extraction actor is built from (Ray sends it to each): the job's own
    paths (a plan is identified by content, so a copied or moved corpus / tokenizer
    is read where it is now), the context layers, the plan's settings and how to run."""

    model: str
    tokenizer: str
    corpus: str
    store: str
    layer_ids: tuple[int, ...]
    settings: dict  # the plan's recorded settings
    device: str = "cpu"
    topk: int | None = None
    store_dtype: str = "bfloat16"
    batch_tokens: int = 16384
    torch_threads: int | None = None
    trust_remote_code: bool = False
    require_fast_kernels: bool = False
    linear_attention: str = "auto"
    spool_dir: str | None = None  # a bucket store: where this node builds shards before uploading them
    spool_bytes: int | None = None  # ... and the most they may take there together (None: the free space)
    task: ClassVar[str] = "extract_group"
    groups_in_flight: ClassVar[int] = GROUPS_IN_FLIGHT

    @staticmethod
    def actor_class() -> type:
        return ExtractionWorker


class ExtractionWorker:
    """Plain class; `extract.jobs.pool.ActorPool` wraps it with ``ray.remote``. Also usable in-process."""

    def __init__(self, spec: ExtractionSpec, faults: BatchFaults | None = None):
        quiet_worker_process(spec.torch_threads)
        started = time.perf_counter()
        self.store_path = str(spec.store)
        self.spool_dir, self.spool_bytes = spec.spool_dir, spec.spool_bytes
        self.corpus_path = str(spec.corpus)
        self.settings = dict(spec.settings)
        self.faults = faults or BatchFaults()
        self.tokenizer = AutoTokenizer.from_pretrained(str(spec.tokenizer))
        check_tokenizer(self.tokenizer, self.settings)  # fail at start, not on the first shard
        self.target = load_target(
            spec.model,
            device=spec.device,
            trust_remote_code=spec.trust_remote_code,
            require_fast_kernels=spec.require_fast_kernels,
            linear_attention=spec.linear_attention,
            keep_layers=None if spec.topk is not None else max(spec.layer_ids) + 1,  # top-k needs the whole model
        )
        # fp8 / fp4 stores: states are quantized on the device, so a half / quarter of the bytes cross to the host
        self.runner = TargetRunner(self.target, list(spec.layer_ids), spec.topk, lookup_store_dtype(spec.store_dtype))
        self.batch_tokens = int(spec.batch_tokens)
        self._compute = threading.Lock()
        self._writer = None
        self._writer_lock = threading.Lock()
        self.node = ray_node_id()
        # One tiny forward now: lazy initialisation (allocator, kernels) belongs to
        # start-up, and a broken model fails here rather than on a shard.
        self.runner.run_batch([np.arange(16, dtype=np.int64) % self.target.vocab_size])
        self.startup_seconds = time.perf_counter() - started

    # -- facts for the driver ---------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return worker_info(self.target, self.startup_seconds)

    # -- the work -----------------------------------------------------------------------------
    def _store_writer(self):
        with self._writer_lock:
            if self._writer is None:
                writer = backend(self.store_path).writer(self.spool_dir, self.spool_bytes, log=_log)
                if writer.plan() is None:
                    raise RuntimeError(f"{self.store_path} has no plan; the driver writes it before any shard")
                projection = writer.projection()
                if projection is not None:  # a projected store: coordinates leave the device, not states
                    device = self.target.device
                    directions = {layer: torch.from_numpy(d).to(device) for layer, d in projection.directions.items()}
                    self.runner.projection = directions
                self._writer = writer
            return self._writer

    def extract_group(self, names: list[str], attempts: dict) -> GroupDone:
        """Compute a group of shards together and commit those in `attempts` (shard ->
        the driver's `Attempt`); a reply for each of those (counts, never tensors),
        or why it failed."""
        started = time.perf_counter()
        wanted = [name for name in names if name in attempts]
        try:
            writer = self._store_writer()
            samples = {name: self._load(writer, name) for name in names}
            tokenized = time.perf_counter()
            everything = [sample for name in names for sample in samples[name]]
            with self._compute:
                computed_at = time.perf_counter()
                outputs, widths = self._forward(everything)
                forward_seconds = time.perf_counter() - computed_at
        except Exception as error:
            failed = failure(error)
            return GroupDone([dataclasses.replace(failed, shard=name) for name in wanted], 0, 0.0, 0.0)
        replies, start = [], 0
        for name in names:
            count = len(samples[name])
            if name in attempts:
                part = slice(start, start + count)
                replies.append(self._commit(writer, name, attempts[name], samples[name], outputs[part], widths[part]))
            start += count
        filler = sum(len(ids) for name in names if name not in attempts for _, ids, _ in samples[name])
        return GroupDone(replies, filler, round(tokenized - started, 4), round(forward_seconds, 4))

    def second_moments(self, names: list[str], max_tokens: int) -> tuple[dict, int]:
        """Each context layer's sum of x x^T (float64 [H, H]) over the first `max_tokens`
        whole bf16 states of the plan's shards `names`: what a projected store's
        directions are fitted on, before its root (and any shard) exists."""
        plan = backend(self.store_path).read_plan()
        whole = TargetRunner(self.target, list(self.runner.layer_ids))
        moments: dict = {}
        tokens = 0
        with self._compute:
            for name in names:
                for _, input_ids, _ in load_samples(
                    self.corpus_path, self.tokenizer, plan.shard(name).samples, self.settings
                ):
                    take = min(len(input_ids), max_tokens - tokens)
                    if take <= 0:
                        break
                    out = whole.run_batch([input_ids])[0]
                    for layer in whole.layer_ids:
                        x = out[layer][:take].to(self.target.device, torch.float64)
                        moments[layer] = moments[layer] + x.T @ x if layer in moments else x.T @ x
                    tokens += take
        return {layer: moment.cpu().numpy() for layer, moment in moments.items()}, tokens

    def _commit(self, writer, name: str, attempt, samples, outputs, widths) -> ShardDone | ShardFailed:
        started = time.perf_counter()
        try:
            for (sample_id, _, _), out in zip(samples, outputs):
                refuse_nonfinite_capture(sample_id, out, self.runner.layer_ids)
            arrays = [
                SampleArrays(
                    sample_id=sample_id,
                    input_ids=input_ids,
                    loss_mask=loss_mask,
                    hidden={layer: out[layer] for layer in self.runner.layer_ids},
                    topk_ids=None if self.runner.topk is None else out["topk_ids"].numpy(),
                    topk_logprobs=None if self.runner.topk is None else out["topk_logprobs"].numpy(),
                )
                for (sample_id, input_ids, loss_mask), out in zip(samples, outputs)
            ]
            commit = writer.write_shard(name, arrays, attempt=attempt)
            upload = writer.upload_of(name)
        except Exception as error:
            return dataclasses.replace(failure(error), shard=name)
        num_tokens = sum(len(ids) for _, ids, _ in samples)
        return ShardDone(
            shard=name,
            written=commit is not None,
            samples=len(samples),
            tokens=num_tokens,
            raw_bytes=num_tokens * raw_bytes_per_token(self.target.hidden_size, len(self.runner.layer_ids)),
            disk_bytes=0 if commit is None else commit.disk_bytes,
            padded_tokens=int(sum(widths)),
            write_seconds=round(time.perf_counter() - started, 4),
            pid=os.getpid(),
            node=self.node,
            upload_bytes=upload.sent,
            upload_seconds=round(upload.seconds, 4),
            spool_wait_seconds=round(upload.spool_wait_seconds, 4),
        )

    def _load(self, writer, name: str):
        return load_samples(self.corpus_path, self.tokenizer, writer.plan().shard(name).samples, self.settings)

    def _forward(self, samples) -> tuple[list[dict], list[int]]:
        """`_forward_batches`; a batch that runs the device out of memory halves the worker's
        batch budget (for this and every later group) and the group runs again, down to
        one sample a batch; only then is the OOM the shard's failure (`device_oom`)."""
        while True:
            try:
                return self._forward_batches(samples)
            except torch.OutOfMemoryError as error:
                longest = max(len(ids) for _, ids, _ in samples)
                if self.batch_tokens <= longest:
                    raise
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.batch_tokens = max(self.batch_tokens // 2, longest)
                print(
                    f"worker (pid {os.getpid()}): out of device memory ({str(error).splitlines()[0][:160]}); "
                    f"--batch-tokens halved to {self.batch_tokens} for this worker, the group runs again",
                    file=sys.stderr,
                    flush=True,
                )

    def _forward_batches(self, samples) -> tuple[list[dict], list[int]]:
        """All samples through the target, batched by length; outputs in the order of
        `samples`, and each sample's padded width (its batch's longest). Batch k+1 is
        submitted before batch k is collected."""
        lengths = [len(ids) for _, ids, _ in samples]
        outputs: list[dict | None] = [None] * len(samples)
        widths = [0] * len(samples)
        pending = None
        for batch in batches_min_padding(lengths, self.batch_tokens):
            width = max(lengths[i] for i in batch)
            self.faults.before_batch(width * len(batch))
            submitted = (batch, self.runner.submit([samples[i][1] for i in batch]))
            for i in batch:
                widths[i] = width
            if pending is not None:
                self._collect(pending, outputs)
            pending = submitted
            self.faults.batch_done()
        if pending is not None:
            self._collect(pending, outputs)
        done = [out for out in outputs if out is not None]
        assert len(done) == len(outputs)  # every sample was in one batch
        return done, widths

    @staticmethod
    def _collect(pending, outputs) -> None:
        batch, result = pending
        for index, out in zip(batch, result.result()):
            outputs[index] = out

    # -- benchmark support --------------------------------------------------------------------
    def forward_only(self, groups: list[list[str]], start_at: float | None = None) -> ForwardTiming:
        """Time the forward passes alone for these groups of shards: same samples, same
        batching, no writes. Tokenization happens before the clock starts, which
        starts at the wall-clock time ``start_at`` if given (to start several workers
        together)."""
        writer = self._store_writer()
        loaded = [[sample for name in group for sample in self._load(writer, name)] for group in groups]
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        started = time.perf_counter()
        padded = 0
        for samples in loaded:
            padded += sum(self._forward(samples)[1])
        return ForwardTiming(
            seconds=time.perf_counter() - started,
            tokens=sum(len(ids) for samples in loaded for _, ids, _ in samples),
            padded_tokens=padded,
        )


def _log(line: str) -> None:
    """A worker's own line (a full spool it waits on): Ray forwards it to the job's log."""
    print(line, file=sys.stderr, flush=True)


def refuse_nonfinite_capture(sample_id: str, out: dict, layer_ids) -> None:
    """A bf16 capture's NaN/Inf refused as an fp8 store refuses it (`TargetRunner` flags
    the tokens on the device; fp8 captures carry NaN scales the writer refuses)."""
    flags = out.get("nonfinite")
    if flags is None:
        return
    for index, layer_id in enumerate(layer_ids):
        bad = flags[index].nonzero().flatten()
        if bad.numel():
            raise NonFiniteStatesError.at_tokens(bad.tolist(), f"sample {sample_id!r} layer {layer_id}")
