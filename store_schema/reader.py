"""Reading a store: committed shards only, checksums checked, states as torch.

Two ways in:
- `read_sample` / `read_window`: partial reads through zarr-python (touch only the
  inner chunks a window needs) for inspection and spot checks;
- `read_shard` / `iter_shards`: the training path. A shard's files are read whole
  and checked against the commit record, and its inner chunks decoded in parallel
  threads straight into the output buffer (`store_schema.shard_decoder`), while the next shard's
  files are already being read. Measured here this is what lets a compressed
  store keep up with per-sample files.

fp8 and fp4 stores: `Sample.hidden` is always bf16 (dequantized); `ShardData.hidden`
holds the states as stored (float8_e4m3fn or packed e2m1 codes beside
`ShardData.scales`), so the trainer can move the small codes to the GPU and
dequantize there."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from . import layout
from .codecs import zarr_dtypes  # noqa: F401  registers bfloat16 / float8_e4m3fn with zarr
from .commit.records import ShardCommit
from .dtypes import BFLOAT16_STORE, StoreDtype
from .metadata import StoreMetadata
from .projection import lift
from .shard_decoder import (
    EncodedArray,
    decode_array,
    encoded_arrays,
    read_arrays,
    start_sharded_decode,
)


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # int32 [tokens]
    loss_mask: torch.Tensor  # uint8 [tokens]
    hidden: dict  # layer id -> bf16 [tokens, hidden]
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


@dataclass
class ShardData:
    """A whole shard in memory, states as stored: bf16, or codes with their `scales`
    (`dtype`). `sample(i)` gives views of a bf16 store (no copies) and dequantized
    copies of a quantized one; `states` dequantizes a range on any device."""

    name: str
    sample_ids: list[str]
    offsets: np.ndarray
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict = field(default_factory=dict)  # layer id -> [tokens, hidden], the stored dtype
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    scales: dict = field(default_factory=dict)  # fp8 / fp4 stores: layer id -> scales (`dtype.scale_shape`)
    dtype: StoreDtype = BFLOAT16_STORE  # how `hidden` and `scales` hold the states
    lifts: dict = field(default_factory=dict)  # projected layers: layer id -> directions float32 [H, K]

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def nbytes(self) -> int:
        tensors = [*self.hidden.values(), *self.scales.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def states(self, layer: int, start: int = 0, stop: int | None = None, device=None) -> torch.Tensor:
        """bf16 states of `layer`, tokens [start, stop), on `device` (`StoreDtype.as_bf16`;
        a projected layer's coordinates lifted back to the hidden size, `projection.lift`)."""
        scales = self.scales[layer][start:stop] if layer in self.scales else None
        states = self.dtype.as_bf16(self.hidden[layer][start:stop], scales, device)
        return lift(states, self.lifts[layer]) if layer in self.lifts else states

    def sample(self, index: int) -> Sample:
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return Sample(
            self.sample_ids[index],
            self.input_ids[start:stop],
            self.loss_mask[start:stop],
            {layer: self.states(layer, start, stop) for layer in self.hidden},
            None if self.topk_ids is None else self.topk_ids[start:stop],
            None if self.topk_logprobs is None else self.topk_logprobs[start:stop],
        )


class StoreReader(StoreMetadata):
    """A store's states as torch tensors, on top of its metadata, for every backend: written
    once over what `StoreMetadata` says a backend answers (`shard_group` for partial reads,
    `commit` and `shard_file` for whole shards). A directory's reader is
    `directory.reader.Store`, a bucket's `objstore.reader.BucketStore`."""

    # -- partial reads (zarr-python) -----------------------------------------------------
    def read_window(self, shard: str, index: int, start: int, stop: int, layers=None) -> Sample:
        """Tokens [start, stop) of sample `index` in `shard`, reading only the chunks they span."""
        layers = self.require_layers(layers)
        group = self.shard_group(shard)
        offsets = group[layout.SAMPLE_OFFSETS][index : index + 2]
        length = int(offsets[1] - offsets[0])
        if not 0 <= start <= stop <= length:
            raise IndexError(f"window [{start}, {stop}) outside sample of {length} tokens")
        a, b = int(offsets[0]) + start, int(offsets[0]) + stop
        hidden = {}
        for layer in layers:
            stored = as_torch(group[layout.layer_array(layer)][a:b].view(self.dtype.bits), self.dtype)
            scales = torch.from_numpy(group[layout.scale_array(layer)][a:b]) if self.dtype.scaled else None
            hidden[layer] = self.dtype.as_bf16(stored, scales)
            if layer in self.lifts():
                hidden[layer] = lift(hidden[layer], self.lifts()[layer])
        topk_ids = topk_logprobs = None
        if layout.TOPK_IDS in group:
            topk_ids = torch.from_numpy(group[layout.TOPK_IDS][a:b])
            topk_logprobs = torch.from_numpy(group[layout.TOPK_LOGPROBS][a:b])
        return Sample(
            str(group[layout.SAMPLE_IDS][index]),
            torch.from_numpy(group[layout.INPUT_IDS][a:b]),
            torch.from_numpy(group[layout.LOSS_MASK][a:b]),
            hidden,
            topk_ids,
            topk_logprobs,
        )

    def lifts(self) -> dict:
        """Projected layers' directions as torch float32 [H, K] (empty: stored whole), the
        same tensors for every shard: `projection.lift` copies each to a device once, by identity."""
        if getattr(self, "_lifts", None) is None:
            projection = self.projection()
            directions = {} if projection is None else projection.directions
            self._lifts = {layer: torch.from_numpy(d) for layer, d in directions.items()}
        return self._lifts

    def sample_length(self, shard: str, index: int) -> int:
        """Tokens in sample `index` of `shard` (reads only the shard's offsets)."""
        offsets = self.shard_group(shard)[layout.SAMPLE_OFFSETS][index : index + 2]
        return int(offsets[1] - offsets[0])

    def read_sample(self, shard: str, index: int, layers=None) -> Sample:
        return self.read_window(shard, index, 0, self.sample_length(shard, index), layers)

    # -- whole-shard reads (training path) ----------------------------------------------
    def read_shard(self, name: str, layers=None, verify: bool = True, threads: int = 2) -> ShardData:
        with ThreadPoolExecutor(threads) as pool:
            raw = _read_shard_files(self, name, self.require_layers(layers), verify)
            return _start_decode(self, raw, pool).result()

    def decode_files(self, name: str, files, layers=None) -> ShardData:
        """Decode a shard from its files' bytes already in memory ({path relative to the
        shard: bytes}; `verify` reads each file once and checks it itself), in this
        thread: callers that want parallelism run several shards at once. The states
        come as stored (a projected layer's coordinates are not lifted: verify checks
        what is stored, and the projection file on its own)."""
        commit = self.commit(name)
        arrays = _shard_arrays(self, commit, self.require_layers(layers))
        raw = _RawShard(name, commit, encoded_arrays(name, files, arrays))
        return _start_decode(self, raw, _INLINE, lifts={}).result()

    def iter_shards(self, names, layers=None, verify: bool = True, threads: int = 2, prefetch: int = 2):
        """Yield ShardData for `names` in order. A background thread reads the next
        `prefetch` shards' files and queues their chunk decodes on `threads` while
        the consumer still works on the current shard."""
        layers = self.require_layers(layers)
        ready: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        stop = threading.Event()

        with ThreadPoolExecutor(threads) as pool:

            def read_ahead():
                for name in names:
                    if stop.is_set():
                        return
                    try:
                        item = _start_decode(self, _read_shard_files(self, name, layers, verify), pool)
                    except Exception as exc:  # handed to the consumer, raised there
                        item = exc
                    ready.put(item)
                ready.put(None)

            reader = threading.Thread(target=read_ahead, daemon=True, name="shard-read-ahead")
            reader.start()
            try:
                while (item := ready.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item.result()
            finally:
                stop.set()
                while reader.is_alive():
                    try:
                        ready.get_nowait()
                    except queue.Empty:
                        reader.join(0.01)


class _InlineExecutor(Executor):
    """Runs each submitted task at once in the caller's thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to whoever waits on the future, as a pool would
            future.set_exception(exc)
        return future


_INLINE = _InlineExecutor()


@dataclass
class _RawShard:
    """A shard's needed files, read (and checksum-checked) but not yet decoded."""

    name: str
    commit: ShardCommit
    arrays: dict[str, EncodedArray]


def as_torch(bits: np.ndarray, dtype: StoreDtype) -> torch.Tensor:
    """Raw bits of hidden states (numpy, `dtype.bits`) as a torch tensor of the stored type
    (through a signed view: torch has no uint16)."""
    signed = {1: np.int8, 2: np.int16}[dtype.itemsize]
    return torch.from_numpy(bits.view(signed)).view(getattr(torch, dtype.torch_name))


def as_bits(states: torch.Tensor, dtype: StoreDtype) -> np.ndarray:
    """The raw bits (numpy `dtype.bits`, no copy) of CPU states of the stored type."""
    signed = {1: torch.int8, 2: torch.int16}[dtype.itemsize]
    return states.view(signed).numpy().view(dtype.bits)


def _layer_arrays(store: StoreReader, layers) -> list[str]:
    """The arrays holding `layers`' states: values, and scales in a quantized store."""
    names = [layout.layer_array(i) for i in layers]
    return names + ([layout.scale_array(i) for i in layers] if store.dtype.scaled else [])


def _shard_arrays(store: StoreReader, commit: ShardCommit, layers) -> list[str]:
    """Every array a read of `layers` needs."""
    arrays = _layer_arrays(store, layers) + [
        layout.INPUT_IDS,
        layout.LOSS_MASK,
        layout.SAMPLE_OFFSETS,
        layout.SAMPLE_IDS,
    ]
    return arrays + ([layout.TOPK_IDS, layout.TOPK_LOGPROBS] if commit.target_topk else [])


def _read_shard_files(store: StoreReader, name: str, layers: list[int], verify: bool) -> _RawShard:
    commit = store.commit(name)
    arrays = _shard_arrays(store, commit, layers)
    unread_layers = _layer_arrays(store, [i for i in store.layer_ids if i not in layers])
    return _RawShard(
        name, commit, read_arrays(name, partial(store.shard_file, name), commit, arrays, verify, skip=unread_layers)
    )


@dataclass
class _PendingShard:
    """A shard whose chunk decodes are queued; `result()` waits for them."""

    name: str
    hidden: dict  # layer id -> raw bits [tokens, hidden], a buffer being filled
    small: dict  # array name -> decoded numpy array
    futures: list
    topk: bool
    dtype: StoreDtype
    lifts: dict

    def result(self) -> ShardData:
        for future in self.futures:
            future.result()
        small = self.small
        return ShardData(
            self.name,
            [str(s) for s in small[layout.SAMPLE_IDS]],
            small[layout.SAMPLE_OFFSETS],
            torch.from_numpy(small[layout.INPUT_IDS]),
            torch.from_numpy(small[layout.LOSS_MASK]),
            {layer: as_torch(bits, self.dtype) for layer, bits in self.hidden.items()},
            torch.from_numpy(small[layout.TOPK_IDS]) if self.topk else None,
            torch.from_numpy(small[layout.TOPK_LOGPROBS]) if self.topk else None,
            {layer: torch.from_numpy(small[layout.scale_array(layer)]) for layer in self.hidden}
            if self.dtype.scaled
            else {},
            self.dtype,
            {layer: lift for layer, lift in self.lifts.items() if layer in self.hidden},
        )


def _start_decode(store: StoreReader, raw: _RawShard, pool: Executor, lifts: dict | None = None) -> _PendingShard:
    """Queue a shard's decode; `lifts` (default the store's) lift projected layers in `states`."""
    hidden, futures = {}, []
    for layer in store.layer_ids:  # the store's layer order, whatever order they were asked in
        array = raw.arrays.get(layout.layer_array(layer))
        if array is not None:
            columns = store.dtype.stored_columns(store.fingerprint.layer_width(layer))
            hidden[layer], tasks = start_sharded_decode(array, raw.commit.num_tokens, columns, pool)
            futures += tasks
    small = {name: decode_array(array) for name, array in raw.arrays.items() if layout.layer_id_of(name) is None}
    lifts = store.lifts() if lifts is None else lifts
    return _PendingShard(raw.name, hidden, small, futures, bool(raw.commit.target_topk), store.dtype, lifts)
