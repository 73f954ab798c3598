"""The streaming loader: whole shards in, shuffled training sequences out.

Reading (see DESIGN.md "Read whole shards, not random windows"):
- Every epoch takes the store's committed shards in a random order seeded by
  (seed, epoch) and reads each shard whole through `Store.iter_shards` (one
  sequential read per file, crc32c checked, chunks decoded in parallel threads,
  the next shard's files read ahead). Only the drafter's context layers are read.
- Samples are shuffled through a buffer of `buffer_shards` shards: the epoch's
  shard order is cut into groups of that many shards, and a group's training
  samples are delivered in a random permutation seeded by (seed, epoch, group).
- Two background threads keep the trainer fed: one decodes the *next* group while
  the other crops the current group's samples and queues them
  (`prefetch_samples` ahead). At most two groups are decoded at a time (plus
  one shard's files read ahead), so memory is ~2 x buffer_shards shards.
  `wait_seconds` counts the time the trainer spent blocked on the queue.

Cropping: a sequence longer than `max_length` keeps its first `max_length`
tokens (the prompt and the start of the answer, as DFlash/SpecForge truncate);
the drafter family's sample filter (`DrafterFamily.sample_filter`: DFlash, an anchor
with a whole block inside the crop; EAGLE-3, a reply token after the second) decides
whether the crop has anything to train on; a sample without is not delivered
(`skipped_empty`).

Held-out split: a sample is held out when a stable hash of its id falls below
`heldout_fraction` (`train.data.heldout.is_heldout`, the one owner of the rule); the
training iterator never yields it. `heldout_samples()` yields only those, reading
just their rows through the held-out index (`train.data.heldout`), built once from
the store's plan and kept for the run: evaluation never scans the shards.

Lanes (data-parallel runs, `train.data.lanes`): the shards are dealt once for the run
into `lanes` independent sample streams (`SampleOrder.shard_lanes`); every epoch, lane
j reads its own shards in the epoch's order, grouped and shuffled as above. Every
training sample is in exactly one lane, so the lanes of a run together see each once
per epoch, and a lane (a node's shard cache) reads the same shards every epoch. One
loader serves one lane; `lanes=1` is the single stream.

Position: where the loader stands is (epoch, group, samples of that group
already delivered). Because every permutation is derived from (seed, epoch,
group), that position *is* the RNG state: resuming from it delivers exactly the
samples an uninterrupted run would. Each delivered sample carries the position
just after it, so the trainer checkpoints the position of what it consumed,
not what the prefetch threads ran ahead to.

To the GPU: with a CUDA `device`, the delivery thread also moves each sample's
features there ahead of use (`train.data.device_copy.DeviceCopier`: pinned host memory,
asynchronous copy on a side stream), so the training step neither waits for a
~157 MB host-to-device copy nor pays for page-locking it. fp8 and fp4 stores deliver
their codes and scales (half or a quarter of the bytes), and `context_features`
dequantizes them to bf16 on the device; a projected store's coordinates are lifted
back to the hidden size there too (`store_schema.projection.lift`).

Cache (`data.cache_dir`): shards are read through a local copy of the store that
`train.data.cache.ShardCache` fills ahead along this loader's order (one per lane,
`cache_share` of them sharing `data.cache_size`); a shard is released to it once read.

Corrupt shards: a `CorruptShardError` stops the run with the shard, file and
defect named; with `skip_corrupt_shards` the shard is left out of its group
(never trained on), reported once per run through `log` (`CorruptShards`, shared
by a rank's lanes, also holds the shards the integrity pass found before step 1,
which are never read), and listed in `skipped_shards`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from store_schema import CorruptShardError, ShardData, StoreReader
from store_schema.dtypes import BFLOAT16_STORE, StoreDtype
from store_schema.projection import lift
from store_schema.runtime.host import available_cores
from store_schema.runtime.units import parse_bytes
from train.data.cache import ShardCache, upcoming_shards
from train.data.config import DataConfig
from train.data.device_copy import DeviceCopier
from train.data.heldout import SampleLocation, heldout_locations, is_heldout, read_located
from train.data.order import LoaderPosition, SampleOrder, has_loss_tokens, train_samples_by_shard

__all__ = ["CorruptShards", "LoaderPosition", "LoaderSpec", "ShardLoader", "TrainSample", "check_lanes"]


@dataclass
class TrainSample:
    """One cropped sequence, ready for its drafter family's `train_step`."""

    sample_id: str
    shard: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    features: list  # [T, H] per context layer in layer-id order, as stored: bf16, or codes (`dtype`)
    topk_ids: torch.Tensor | None = None  # int32 [T, K]: target's next-token top-k at each position
    topk_logprobs: torch.Tensor | None = None
    position: LoaderPosition = field(default_factory=LoaderPosition)  # loader position after this sample
    epoch: int = 0  # the epoch this sample belongs to
    scales: list = field(default_factory=list)  # fp8 / fp4 stores: the scales per context layer
    dtype: StoreDtype = BFLOAT16_STORE  # how `features` and `scales` hold the states
    lifts: list = field(default_factory=list)  # a projected store: directions [H, K] (or None) per context layer
    ready: object = None  # a CUDA event: features were copied to the GPU ahead (DeviceCopier)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.features, *self.scales))

    def context_features(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[T, n_layers*H] bf16, layers concatenated in order (the drafter's `fc` input);
        quantized features are dequantized on `device`."""
        if self.ready is not None:
            DeviceCopier.wait(self.ready, [*self.features, *self.scales])
            self.ready = None
        scales = self.scales or [None] * len(self.features)
        lifts = self.lifts or [None] * len(self.features)
        layers = [self.dtype.as_bf16(f, s, device) for f, s in zip(self.features, scales)]
        return torch.cat([x if p is None else lift(x, p) for x, p in zip(layers, lifts)], dim=-1)


class _Stop(Exception):
    pass


def check_lanes(store_path, lanes: int, shards: int) -> None:
    """Each lane (sample stream) reads whole shards: there must be one per lane at least."""
    if lanes > shards:
        raise ValueError(
            f"data.lanes: {lanes} lanes (default: one per process) need at least as many shards; "
            f"{store_path} has {shards}: train on at most {shards} process(es), or extract the store "
            "into more shards with a smaller `python -m extract run --shard-tokens`"
        )


class CorruptShards:
    """The shards of a run known to be corrupt, each reported once (shared by lanes)."""

    def __init__(self, known=(), log: Callable[[str], None] = print):
        self.known = set(known)
        self.log = log
        self._lock = threading.Lock()

    def found(self, shard: str, file: str, what: str) -> None:
        with self._lock:
            if shard in self.known:
                return
            self.known.add(shard)
        self.log(f"loader: skipping corrupt shard {shard} ({file}: {what}); it is never trained on")


@dataclass(frozen=True)
class LoaderSpec:
    """What one loader reads and where it stands in the run: the values beside the
    run's `data` section that the drafter, the `train` section and the world decide."""

    layers: list[int]  # the context layer ids to read (the drafter's, in fc order)
    trainable: Callable[[torch.Tensor], bool]  # the drafter family's: whether a crop's loss mask has anything to train
    seed: int  # the run's (`train.seed`): the order
    epochs: int  # when to stop
    lane: int = 0  # the sample stream this loader serves (module docstring)
    lanes: int = 1  # of how many
    shards: list[str] | None = None  # a checkpoint's shard list; None: the store's committed shards
    device: torch.device | str | None = None  # where training runs; CUDA gets samples copied there ahead
    cache_share: int = 1  # loaders sharing data.cache_size on this node
    planned_trainable: Callable[[int, int], bool] = has_loss_tokens  # `trainable` from a plan's counts


class ShardLoader:
    """Iterate training samples of `store`; see the module docstring.

    config: the run's `data` section (max_length, heldout_fraction, buffer_shards,
        loader_threads, prefetch_samples, skip_corrupt_shards, cache_dir, cache_size).
    spec: the layers, block size, order, lane and device (`LoaderSpec`).
    position: where to start (a checkpoint's); corrupt: the run's known corrupt
        shards, shared by a rank's lanes."""

    def __init__(
        self,
        store: StoreReader,
        config: DataConfig,
        spec: LoaderSpec,
        *,
        position: LoaderPosition | None = None,
        log: Callable[[str], None] = print,
        corrupt: CorruptShards | None = None,
    ):
        self.store = store
        self.config = config
        self.spec = spec
        self.layers = store.require_layers(spec.layers)
        self.log = log
        names = sorted(store.committed_shards() if spec.shards is None else spec.shards)
        if not names:
            raise ValueError(f"{store.path}: no committed shards to train on")
        if not 0 <= spec.lane < spec.lanes:
            raise ValueError(f"loader lane {spec.lane} is not one of {spec.lanes} lanes")
        check_lanes(store.path, spec.lanes, len(names))
        self.order = SampleOrder(names, spec.seed, config.buffer_shards, spec.lane, spec.lanes)
        self.start = position or LoaderPosition()
        self.corrupt = corrupt or CorruptShards(log=log)
        self.skipped_shards: list[str] = []
        self.skipped_empty, self.wait_seconds = 0, 0.0
        self._queue: queue.Queue | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._heldout: list[SampleLocation] | None = None  # the held-out index, built on first use
        self.cache: ShardCache | None = None  # built when reading starts (train.data.cache)
        device = spec.device
        self._to_device = DeviceCopier(device) if device is not None and torch.device(device).type == "cuda" else None

    def seek(self, position: LoaderPosition) -> None:
        """Start reading at `position` (a checkpoint's) instead; only before the first sample."""
        if self._queue is not None:
            raise RuntimeError(f"loader lane {self.spec.lane}: cannot move to {position} once reading has started")
        self.start = position

    # -- the order (`self.order`, train.data.order) ----------------------------------------
    def epoch_order(self, epoch: int) -> list[str]:
        """The epoch's shard order (every lane's): which shards come first."""
        return self.order.epoch_order(epoch)

    def lane_shards(self, epoch: int) -> list[str]:
        """This loader's shards of `epoch`, in the order it reads them."""
        return self.order.lane_shards(epoch)

    def lane_totals(self, epochs: int | None = None) -> list[float]:
        """Training samples each lane delivers over `epochs` (default the run's); known corrupt shards: none."""
        trainable, heldout = self.spec.planned_trainable, self.config.heldout_fraction
        counts = train_samples_by_shard(self.store, self.order.shards, heldout, trainable)
        counts = {n: 0 if n in self.corrupt.known else c for n, c in counts.items()}
        return self.order.lane_totals(counts, self.spec.epochs if epochs is None else epochs)

    # -- reading --------------------------------------------------------------------------
    def _read(self, names: list[str]) -> Iterator[ShardData]:
        """Whole shards in order; a corrupt one is refused or (if allowed) skipped."""
        remaining = [name for name in names if name not in self.corrupt.known]
        self.skipped_shards += [
            name for name in names if name in self.corrupt.known and name not in self.skipped_shards
        ]
        while remaining:
            try:
                threads = self.config.loader_threads or available_cores()
                source = self.cache.reader if self.cache is not None else self.store
                for data in source.iter_shards(list(remaining), layers=self.layers, threads=threads, prefetch=1):
                    remaining.remove(data.name)
                    if self.cache is not None:
                        self.cache.release(data.name)  # read and decoded: its files may go
                    yield data
                return
            except CorruptShardError as exc:
                if not self.config.skip_corrupt_shards:
                    raise CorruptShardError(
                        exc.shard,
                        exc.file,
                        f"{exc.what}. Refusing to train on a corrupt shard: check the store with "
                        "`python -m store_schema verify`, re-extract the shard, or set "
                        "data.skip_corrupt_shards=true to leave it out",
                    ) from None
                if exc.shard not in self.skipped_shards:
                    self.skipped_shards.append(exc.shard)
                self.corrupt.found(exc.shard, exc.file, exc.what)
                remaining = remaining[remaining.index(exc.shard) + 1 :] if exc.shard in remaining else remaining[1:]

    def _crop(self, data: ShardData, index: int, position: LoaderPosition, epoch: int = 0) -> TrainSample | None:
        start, stop = int(data.offsets[index]), int(data.offsets[index + 1])
        stop = min(stop, start + self.config.max_length)
        loss_mask = data.loss_mask[start:stop]
        if not self.spec.trainable(loss_mask):
            return None
        return TrainSample(
            sample_id=data.sample_ids[index],
            shard=data.name,
            input_ids=data.input_ids[start:stop].long(),
            loss_mask=loss_mask,
            features=[data.hidden[layer][start:stop] for layer in self.layers],
            topk_ids=None if data.topk_ids is None else data.topk_ids[start:stop],
            topk_logprobs=None if data.topk_logprobs is None else data.topk_logprobs[start:stop],
            position=position,
            epoch=epoch,
            scales=[data.scales[layer][start:stop] for layer in self.layers] if data.scales else [],
            dtype=data.dtype,
            lifts=[data.lifts.get(layer) for layer in self.layers] if data.lifts else [],
        )

    def _decode_groups(self, out: queue.Queue) -> None:
        """Thread 1: decode groups of shards, from the start position on."""
        first = self.start
        for epoch in range(first.epoch, self.spec.epochs):
            groups = self.order.groups(epoch)
            start_group = first.group if epoch == first.epoch else 0
            names = [n for g in groups[start_group:] for n in g]
            decoded = self._read(names)
            pending: dict[str, ShardData] = {}
            for g in range(start_group, len(groups)):
                self._wait_until_taken(out)  # at most two groups decoded: one delivering, one next
                for name in groups[g]:
                    while name not in pending and name not in self.skipped_shards:
                        data = next(decoded, None)
                        if data is None:
                            break
                        pending[data.name] = data
                self._put(out, (epoch, g, [pending.pop(n) for n in groups[g] if n in pending]))
        self._put(out, None)

    def _deliver(self, groups: queue.Queue, out: queue.Queue) -> None:
        """Thread 2: permute each decoded group's training samples, crop, queue them."""
        while (item := self._get(groups)) is not None:
            if isinstance(item, BaseException):
                raise item
            epoch, group, shards = item
            fraction = self.config.heldout_fraction
            samples = [
                (data, i) for data in shards for i in range(len(data)) if not is_heldout(data.sample_ids[i], fraction)
            ]
            order = self.order.group_permutation(epoch, group, len(samples))
            first = self.start.sample if (epoch, group) == (self.start.epoch, self.start.group) else 0
            position = LoaderPosition(epoch, group, first)
            for k in range(first, len(samples)):
                position = self.order.next_position(LoaderPosition(epoch, group, k), len(samples))
                data, i = samples[order[k]]
                sample = self._crop(data, i, position, epoch)
                if sample is None:
                    self.skipped_empty += 1
                    continue
                self._put(out, self._to_device(sample) if self._to_device else sample)
        self._put(out, None)

    def _wait_until_taken(self, q: queue.Queue) -> None:
        while not q.empty():
            if self._stop.wait(0.002):
                raise _Stop

    def _put(self, q: queue.Queue, item) -> None:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise _Stop

    def _get(self, q: queue.Queue):
        while not self._stop.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue
        raise _Stop

    def _run(self, work, inbox, outbox: queue.Queue) -> None:
        """Run a thread's work; an error goes downstream (to the next thread, then
        to the consumer, where it is raised)."""
        try:
            work(*([inbox, outbox] if inbox is not None else [outbox]))
        except _Stop:
            pass
        except BaseException as exc:
            try:
                self._put(outbox, exc)
            except _Stop:
                pass

    def start_threads(self) -> queue.Queue:
        """The queue the loader threads fill, starting them on the first call."""
        if self._queue is not None:
            return self._queue
        if self.config.cache_dir is not None:
            bound = self.config.cache_size
            size = None if bound is None else parse_bytes(bound) // self.spec.cache_share
            upcoming = upcoming_shards(self.order, self.start, self.spec.epochs, skip=self.corrupt.known)
            self.cache = ShardCache(self.store, self.config.cache_dir, size, upcoming, self.log, self.spec.lane)
        groups: queue.Queue = queue.Queue(maxsize=1)
        self._queue = queue.Queue(maxsize=self.config.prefetch_samples)
        self._threads = [
            threading.Thread(
                target=self._run, args=(self._decode_groups, None, groups), daemon=True, name="loader-decode"
            ),
            threading.Thread(
                target=self._run, args=(self._deliver, groups, self._queue), daemon=True, name="loader-deliver"
            ),
        ]
        for thread in self._threads:
            thread.start()
        return self._queue

    def __iter__(self) -> Iterator[TrainSample]:
        return self

    def __next__(self) -> TrainSample:
        samples = self.start_threads()
        began = time.perf_counter()
        while True:
            try:
                item = samples.get(timeout=0.1)
                break
            except queue.Empty:
                if not any(t.is_alive() for t in self._threads) and samples.empty():
                    item = None
                    break
        self.wait_seconds += time.perf_counter() - began
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item is None:
            self.close()
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        if self.cache is not None:
            self.cache.close()

    def __del__(self):
        if hasattr(self, "_stop"):  # not when __init__ refused its arguments
            self._stop.set()

    # -- held-out -------------------------------------------------------------------------
    def heldout_samples(self, limit: int | None = None) -> Iterator[TrainSample]:
        """Held-out samples (cropped like training ones), shards in sorted order, up
        to `limit`. Only their rows are read, through the held-out index built on
        the first call and kept (`train.data.heldout`); read on the caller's thread, never
        sharing state with training. Samples of shards skipped as corrupt are left out."""
        if self._heldout is None:
            self._heldout = heldout_locations(self.store, self.order.shards, self.config.heldout_fraction)
        count = 0
        for location in self._heldout:
            if limit is not None and count >= limit:
                return
            if location.shard in self.skipped_shards or location.shard in self.corrupt.known:
                continue
            sample = read_located(self.store, location, self.layers, self.config.max_length)
            if not self.spec.trainable(sample.loss_mask):
                continue
            count += 1
            yield TrainSample(
                sample_id=sample.sample_id,
                shard=location.shard,
                input_ids=sample.input_ids.long(),
                loss_mask=sample.loss_mask,
                features=[sample.hidden[layer] for layer in self.layers],
                topk_ids=sample.topk_ids,
                topk_logprobs=sample.topk_logprobs,
            )
