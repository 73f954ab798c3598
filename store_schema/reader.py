"""Reading a store: committed shards only, checksums checked, bf16 as torch.

Two ways in:
- `read_sample` / `read_window`: partial reads through zarr-python (touch only the
  inner chunks a window needs) for inspection and spot checks;
- `read_shard` / `iter_shards`: the training path. A shard's hidden-state file is
  read with one sequential read, its crc32c checked against the commit record,
  and its inner chunks decoded by blosc in parallel threads straight into the
  output buffer, while the next shard's files are already being read. Measured
  here this is what lets a compressed store keep up with per-sample files."""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import google_crc32c
import numpy as np
import torch
import zarr
from numcodecs import VLenUTF8, Zstd, blosc

from . import layout
from .fingerprint import Fingerprint
from .plan import Plan
from .plan_io import read_plan
from .records import RecordError, ShardCommit, read_record

_EMPTY = 2**64 - 1


class CorruptShardError(RuntimeError):
    def __init__(self, shard: str, file: str, what: str):
        self.shard, self.file, self.what = shard, file, what
        super().__init__(f"shard {shard}: {file}: {what}")


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
    """A whole shard in memory; `sample(i)` gives views, no copies."""

    name: str
    sample_ids: list[str]
    offsets: np.ndarray
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict = field(default_factory=dict)
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.hidden.values())

    def sample(self, index: int) -> Sample:
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return Sample(
            self.sample_ids[index],
            self.input_ids[start:stop],
            self.loss_mask[start:stop],
            {layer: h[start:stop] for layer, h in self.hidden.items()},
            None if self.topk_ids is None else self.topk_ids[start:stop],
            None if self.topk_logprobs is None else self.topk_logprobs[start:stop],
        )


class Store:
    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / "zarr.json").is_file():
            raise FileNotFoundError(f"{self.path}: not a zarr store (no zarr.json)")
        try:
            root_meta = json.loads((self.path / "zarr.json").read_bytes())
            attrs = root_meta["attributes"][layout.ROOT_ATTR]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.path}/zarr.json: not a dflash store root ({exc!r})") from None
        if attrs.get("schema_version") != layout.SCHEMA_VERSION:
            raise ValueError(
                f"{self.path}: schema version {attrs.get('schema_version')!r}, this code reads {layout.SCHEMA_VERSION}"
            )
        self.attrs = attrs
        self.fingerprint = Fingerprint.from_json(attrs["fingerprint"])
        self.codec = layout.CodecConfig(**attrs["codec"])
        self._commits: dict[str, ShardCommit] = {}

    # -- metadata -----------------------------------------------------------------------
    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.fingerprint.layer_ids

    @property
    def hidden_size(self) -> int:
        return self.fingerprint.hidden_size

    def check_fingerprint(self, **expected) -> None:
        self.fingerprint.check(**expected)

    def require_layers(self, layer_ids) -> list[int]:
        layer_ids = list(self.layer_ids if layer_ids is None else layer_ids)
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise KeyError(f"{self.path}: store has no layer(s) {missing}; it holds layers {list(self.layer_ids)}")
        return layer_ids

    def committed_shards(self) -> list[str]:
        shards = self.path / layout.SHARDS_DIR
        if not shards.is_dir():
            return []
        return sorted(p.name for p in shards.iterdir() if layout.is_committed(self.path, p.name))

    def is_committed(self, name: str) -> bool:
        return layout.is_committed(self.path, name)

    def commit(self, name: str) -> ShardCommit:
        """The shard's commit record; CorruptShardError if it is missing or damaged."""
        if name not in self._commits:
            try:
                body = read_record(layout.shard_dir(self.path, name) / layout.COMMIT_RECORD)
                self._commits[name] = ShardCommit.from_record(body)
            except RecordError as exc:
                raise CorruptShardError(name, layout.COMMIT_RECORD, str(exc)) from None
        return self._commits[name]

    def plan(self) -> Plan | None:
        if not (self.path / layout.PLAN_DIR / layout.COMMIT_RECORD).exists():
            return None
        return read_plan(self.path)

    def num_samples(self) -> int:
        return sum(self.commit(n).num_samples for n in self.committed_shards())

    def num_tokens(self) -> int:
        return sum(self.commit(n).num_tokens for n in self.committed_shards())

    # -- partial reads (zarr-python) -----------------------------------------------------
    def _group(self, name: str):
        if not self.is_committed(name):
            raise KeyError(f"{self.path}: no committed shard {name!r}")
        return zarr.open_group(str(layout.shard_dir(self.path, name)), mode="r")

    def read_window(self, shard: str, index: int, start: int, stop: int, layers=None) -> Sample:
        """Tokens [start, stop) of sample `index` in `shard`, reading only the chunks they span."""
        layers = self.require_layers(layers)
        group = self._group(shard)
        offsets = group[layout.SAMPLE_OFFSETS][index : index + 2]
        length = int(offsets[1] - offsets[0])
        if not 0 <= start <= stop <= length:
            raise IndexError(f"window [{start}, {stop}) outside sample of {length} tokens")
        a, b = int(offsets[0]) + start, int(offsets[0]) + stop
        hidden = {
            layer: torch.from_numpy(group[layout.layer_array(layer)][a:b].view(np.int16)).view(torch.bfloat16)
            for layer in layers
        }
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

    def read_sample(self, shard: str, index: int, layers=None) -> Sample:
        group = self._group(shard)
        offsets = group[layout.SAMPLE_OFFSETS][index : index + 2]
        return self.read_window(shard, index, 0, int(offsets[1] - offsets[0]), layers)

    # -- whole-shard reads (training path) ----------------------------------------------
    def read_shard(self, name: str, layers=None, verify: bool = True, threads: int = 2) -> ShardData:
        with ThreadPoolExecutor(threads) as pool:
            raw = _read_shard_files(self, name, self.require_layers(layers), verify)
            return _start_decode(self, raw, pool).result()

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


@dataclass
class _RawShard:
    """A shard's needed files, read (and checksum-checked) but not yet decoded."""

    name: str
    commit: ShardCommit
    files: dict  # array name -> (chunk file bytes, array metadata)


def _read_shard_files(store: Store, name: str, layers: list[int], verify: bool) -> _RawShard:
    commit = store.commit(name)
    directory = layout.shard_dir(store.path, name)
    arrays = [layout.layer_array(i) for i in layers] + [
        layout.INPUT_IDS, layout.LOSS_MASK, layout.SAMPLE_OFFSETS, layout.SAMPLE_IDS
    ]
    if commit.target_topk:
        arrays += [layout.TOPK_IDS, layout.TOPK_LOGPROBS]
    files = {}
    for array in arrays:
        meta = json.loads(_read_checked(directory, f"{array}/zarr.json", commit, name, verify))
        chunk_key = "c/" + "/".join("0" * len(meta["shape"]))
        files[array] = (_read_checked(directory, f"{array}/{chunk_key}", commit, name, verify), meta)
    if verify:  # the rest of the shard's metadata too, so a damaged shard is refused whole
        unread_layers = tuple(f"{layout.layer_array(i)}/" for i in store.layer_ids if i not in layers)
        for rel in commit.files:
            if rel.split("/")[0] not in files and not rel.startswith(unread_layers):
                _read_checked(directory, rel, commit, name, verify)
    return _RawShard(name, commit, files)


def _read_checked(directory: Path, rel: str, commit: ShardCommit, shard: str, verify: bool) -> bytes:
    path = directory / rel
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptShardError(shard, rel, "file missing") from None
    if verify:
        expected = commit.files.get(rel)
        if expected is None:
            raise CorruptShardError(shard, rel, "file not in the commit record")
        if len(data) != expected.size:
            raise CorruptShardError(shard, rel, f"size {len(data)} != committed {expected.size}")
        crc = f"{google_crc32c.value(data):08x}"
        if crc != expected.crc32c:
            raise CorruptShardError(shard, rel, f"crc32c {crc} != committed {expected.crc32c}")
    return data


@dataclass
class _PendingShard:
    """A shard whose chunk decodes are queued; `result()` waits for them."""

    name: str
    num_tokens: int
    hidden: dict  # layer id -> uint16 buffer being filled
    small: dict  # array name -> decoded numpy array
    futures: list
    topk: bool

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
            {
                layer: torch.from_numpy(out[: self.num_tokens].view(np.int16)).view(torch.bfloat16)
                for layer, out in self.hidden.items()
            },
            torch.from_numpy(small[layout.TOPK_IDS]) if self.topk else None,
            torch.from_numpy(small[layout.TOPK_LOGPROBS]) if self.topk else None,
        )


def _start_decode(store: Store, raw: _RawShard, pool: ThreadPoolExecutor) -> _PendingShard:
    num_tokens = raw.commit.num_tokens
    hidden, futures = {}, []
    for layer in store.layer_ids:
        array = layout.layer_array(layer)
        if array not in raw.files:
            continue
        data, meta = raw.files[array]
        out = np.empty((layout.padded_shard_shape(num_tokens, _chunk_rows(meta)), store.hidden_size), np.uint16)
        futures += _decode_sharded(data, meta, out, pool, raw.name, layer)
        hidden[layer] = out
    small = {name: _decode_small(raw.name, name, *raw.files[name]) for name in raw.files if not name.startswith("layer_")}
    return _PendingShard(raw.name, num_tokens, hidden, small, futures, bool(raw.commit.target_topk))


_NUMERIC = {"int32": np.int32, "int64": np.int64, "uint8": np.uint8, "float32": np.float32}


def _decode_small(shard: str, array: str, data: bytes, meta: dict) -> np.ndarray:
    """Decode a single-chunk array ([bytes|vlen-utf8], zstd) as the writer makes them."""
    names = [c["name"] for c in meta["codecs"]]
    if names[1:] == ["zstd"]:
        data = Zstd().decode(data)
    elif names[1:]:
        raise CorruptShardError(shard, array, f"unsupported codecs {names}")
    if names[0] == "vlen-utf8":
        return VLenUTF8().decode(data)
    if names[0] != "bytes" or meta["data_type"] not in _NUMERIC:
        raise CorruptShardError(shard, array, f"unsupported encoding {names} / {meta['data_type']}")
    dtype = np.dtype(_NUMERIC[meta["data_type"]]).newbyteorder("<")
    values = np.frombuffer(data, dtype=dtype)
    if values.size != int(np.prod(meta["shape"])):
        raise CorruptShardError(shard, array, f"{values.size} values for shape {meta['shape']}")
    return values.reshape(meta["shape"]).astype(dtype.newbyteorder("="))  # a writable copy; small arrays


def _chunk_rows(meta: dict) -> int:
    return meta["codecs"][0]["configuration"]["chunk_shape"][0]


def _decode_sharded(data: bytes, meta: dict, out: np.ndarray, pool, shard: str, layer: int) -> list:
    """Decode a zarr v3 `sharding_indexed` file (index at the end, crc32c-checked)
    into `out`, one thread task per inner chunk."""
    sharding = meta["codecs"][0]
    config = sharding["configuration"]
    inner = [c["name"] for c in config["codecs"]]
    if (
        sharding["name"] != "sharding_indexed"
        or config.get("index_location", "end") != "end"
        or [c["name"] for c in config["index_codecs"]] != ["bytes", "crc32c"]
        or inner not in (["bytes"], ["bytes", "blosc"])
    ):
        raise CorruptShardError(shard, layout.layer_array(layer), f"unsupported encoding {sharding!r}")
    rows = config["chunk_shape"][0]
    num_chunks = out.shape[0] // rows
    index_size = num_chunks * 16
    if len(data) < index_size + 4:
        raise CorruptShardError(shard, layout.layer_array(layer), "shard file shorter than its index")
    index_bytes = data[-index_size - 4 : -4]
    (index_crc,) = struct.unpack("<I", data[-4:])
    if google_crc32c.value(index_bytes) != index_crc:
        raise CorruptShardError(shard, layout.layer_array(layer), "shard index fails its crc32c")
    index = np.frombuffer(index_bytes, dtype="<u8").reshape(num_chunks, 2)
    compressed = inner[-1] == "blosc"
    view = memoryview(data)
    flat = out.reshape(num_chunks, -1)

    def decode(i: int) -> None:
        offset, nbytes = int(index[i, 0]), int(index[i, 1])
        if offset == _EMPTY:
            flat[i] = 0
        elif compressed:
            blosc.decompress(view[offset : offset + nbytes], flat[i])
        else:
            flat[i] = np.frombuffer(view[offset : offset + nbytes], dtype="<u2")

    return [pool.submit(decode, i) for i in range(num_chunks)]


def on_disk_bytes(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


__all__ = [
    "CorruptShardError",
    "Sample",
    "ShardData",
    "Store",
    "on_disk_bytes",
]
