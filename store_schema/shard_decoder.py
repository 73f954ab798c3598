"""The training path's shard decoder: a committed shard's files read whole (one
sequential read each), checked against the commit record, and decoded here instead
of by zarr-python.

zarr-python decodes a sharded array chunk by chunk through asyncio, which costs more
than the decode itself; parsing the two encodings the writer makes lets the inner
chunks be decoded by parallel threads straight into one output buffer. This module
must therefore agree with zarr-python bit for bit: tests/store_schema/test_shard_codec.py pins it
against plain `zarr.open_array` for every array and codec the writer makes.

Codec v2 (`bytesplit`, see `encoding`) writes standard blosc chunks, so its inner
chunks go through the same `blosc` entry as v1's: `blosc_chunk.decode_split_zstd_chunk`
for the one-block zstd chunks both write, c-blosc for anything else (codec v3,
`channels`, whose chunks are 16-byte-wide column blocks of the shard, included).

A new codec is one decoder function added to a table, keyed by the codec's name as
the array's zarr.json lists it: `CHUNK_DECODERS` (the inner chunks of a sharded
hidden-state array), `BYTES_DECODERS` / `ARRAY_DECODERS` (one-chunk token arrays)."""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass
from pathlib import Path

import google_crc32c
import numpy as np
from numcodecs import VLenUTF8, Zstd, blosc

from . import layout
from .codecs.blosc_chunk import decode_split_zstd_chunk
from .commit.records import ShardCommit, file_mismatch
from .dtypes import STORE_DTYPES
from .errors import CorruptShardError
from .runtime.crc32c import crc32c_bytes

_EMPTY_CHUNK = 2**64 - 1  # a sharding index entry for a chunk that was never written
_INDEX_ENTRY_BYTES = 16  # (offset, nbytes), both uint64 little-endian
_CRC_BYTES = 4
_MAP_AT_BYTES = 1 << 20  # files this large are mapped rather than read (`read_file`)


@dataclass(frozen=True)
class EncodedArray:
    """One array of a shard as stored: its metadata and the bytes of its one chunk
    file (a whole-shard `sharding_indexed` file for hidden states)."""

    shard: str
    name: str
    meta: dict
    data: bytes


# -- reading the files ---------------------------------------------------------------------
def read_arrays(
    shard: str,
    read: Callable[[str], bytes],
    commit: ShardCommit,
    arrays: Iterable[str],
    verify: bool,
    skip: Iterable[str] = (),
) -> dict[str, EncodedArray]:
    """Read `arrays` of `shard`, each file through `read(path relative to the shard)`
    (FileNotFoundError where it is missing: a directory's files, a bucket's objects). With `verify`, every file read is
    checked against the commit record, and so is every other committed file except
    those of the arrays in `skip` (layers not asked for), so a damaged shard is
    refused whole rather than partly used."""
    files: dict[str, bytes] = {}
    for array in arrays:
        meta_file = f"{array}/{layout.ZARR_METADATA}"
        files[meta_file] = _read_checked(shard, read, meta_file, commit, verify)
        data_file = array_data_file(array, json.loads(bytes(files[meta_file])))
        files[data_file] = _read_checked(shard, read, data_file, commit, verify)
    encoded = encoded_arrays(shard, files, arrays)
    if verify:
        skipped = set(skip)
        for rel in commit.files:
            if layout.array_of(rel) not in encoded and layout.array_of(rel) not in skipped:
                _read_checked(shard, read, rel, commit, verify)
    return encoded


def array_data_file(array: str, meta: dict) -> str:
    """The one chunk file of `array` (relative to the shard) given its zarr.json."""
    return f"{array}/{layout.chunk_file(len(meta['shape']))}"


def encoded_arrays(shard: str, files: Mapping[str, bytes], arrays: Iterable[str]) -> dict[str, EncodedArray]:
    """`arrays` of a shard from its files' bytes ({path relative to the shard: bytes}),
    however they were read."""
    encoded = {}
    for array in arrays:
        try:
            meta = json.loads(bytes(files[f"{array}/{layout.ZARR_METADATA}"]))
            encoded[array] = EncodedArray(shard, array, meta, files[array_data_file(array, meta)])
        except KeyError as exc:
            raise CorruptShardError(shard, array, f"no file {exc}") from None
        except ValueError as exc:
            raise CorruptShardError(shard, f"{array}/{layout.ZARR_METADATA}", f"unreadable metadata ({exc})") from None
    return encoded


def _read_checked(shard: str, read: Callable[[str], bytes], rel: str, commit: ShardCommit, verify: bool):
    """One file's bytes (`read(rel)`); with `verify`, its size and crc32c as committed."""
    try:
        data = read(rel)
    except FileNotFoundError:
        raise CorruptShardError(shard, rel, "file missing") from None
    if verify:
        expected = commit.files.get(rel)
        if expected is None:
            raise CorruptShardError(shard, rel, "file not in the commit record")
        what = file_mismatch(asdict(expected), len(data), lambda: crc32c_bytes(data))
        if what:
            raise CorruptShardError(shard, rel, what)
    return data


def read_file(path: Path):
    """A file's bytes: `bytes` for a small file; for a large one a read-only view of a
    memory map, so decoding reads the page cache in place. Measured here, copying a
    shard's files into Python bytes cost as much as decoding them (one more pass over
    memory, into freshly faulted pages) and kept the store slower than per-sample
    files; with the map the file is read once, by the decoder. The map lives as long
    as a view of it (shards are immutable once committed)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < max(1, _MAP_AT_BYTES):  # (an empty file cannot be mapped)
            return f.read()
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_WILLNEED)  # read it all ahead (MADV_SEQUENTIAL reads slower cold)
    return memoryview(mapped)


# -- one-chunk arrays (token ids, masks, offsets, sample ids, top-k) -------------------------
def _zstd(data: bytes, config: dict) -> bytes:
    return Zstd().decode(data)


def _numbers(array: EncodedArray, data: bytes) -> np.ndarray:
    dtype = _SMALL_DTYPES.get(array.meta["data_type"])
    if dtype is None:
        raise _unsupported(array, f"data type {array.meta['data_type']!r}")
    values = np.frombuffer(data, dtype=dtype.newbyteorder("<"))
    if values.size != int(np.prod(array.meta["shape"])):
        raise CorruptShardError(array.shard, array.name, f"{values.size} values for shape {array.meta['shape']}")
    return values.reshape(array.meta["shape"]).astype(dtype)  # a writable native-order copy; small arrays


def _strings(array: EncodedArray, data: bytes) -> np.ndarray:
    return VLenUTF8().decode(data)


_SMALL_DTYPES = {name: np.dtype(name) for name in ("int32", "int64", "uint8", "float32")}
# bytes -> bytes codecs, undone last to first
BYTES_DECODERS: dict[str, Callable[[bytes, dict], bytes]] = {"zstd": _zstd}
# the array -> bytes codec (the first in the list), undone last
ARRAY_DECODERS: dict[str, Callable[[EncodedArray, bytes], np.ndarray]] = {"bytes": _numbers, "vlen-utf8": _strings}


def decode_array(array: EncodedArray) -> np.ndarray:
    """Decode a one-chunk array as `layout.write_small_array` writes it."""
    codecs = array.meta["codecs"]
    names = [c["name"] for c in codecs]
    if not codecs or names[0] not in ARRAY_DECODERS or any(n not in BYTES_DECODERS for n in names[1:]):
        raise _unsupported(array, f"codecs {names}")
    _require_little_endian(array, codecs[0])
    data = array.data
    for codec in reversed(codecs[1:]):
        data = BYTES_DECODERS[codec["name"]](data, codec.get("configuration") or {})
    return ARRAY_DECODERS[names[0]](array, data)


# -- sharded hidden-state arrays ------------------------------------------------------------
def _raw_chunk(chunk: memoryview, out: np.ndarray) -> None:
    out[...] = np.frombuffer(chunk, dtype=out.dtype.newbyteorder("<")).reshape(out.shape)


def _blosc_chunk(chunk: memoryview, out: np.ndarray) -> None:
    if out.flags.c_contiguous:
        if not decode_split_zstd_chunk(chunk, out.reshape(-1)):
            blosc.decompress(chunk, out)
        return
    # A chunk narrower than the shard (`channels`): c-blosc (SIMD unshuffle of the
    # channel streams) into a scratch block, then its rows copied as single elements
    # (several times faster than copying them byte by byte).
    block = np.empty(out.shape, out.dtype)
    blosc.decompress(chunk, block)
    row = np.dtype(f"V{out.shape[1] * out.itemsize}")
    out.view(row)[...] = block.view(row)


# The inner codec chain of a `sharding_indexed` array (names in zarr.json order) ->
# the function that fills one chunk's [rows, cols] block of the output from that
# chunk's stored bytes.
CHUNK_DECODERS: dict[tuple[str, ...], Callable[[memoryview, np.ndarray], None]] = {
    ("bytes",): _raw_chunk,
    ("bytes", "blosc"): _blosc_chunk,
}
# zarr data type -> the numpy type of its raw bits (hidden states stay bits until torch views them)
HIDDEN_BITS = {d.zarr_name: d.bits for d in STORE_DTYPES.values()}


def chunk_shape(meta: dict) -> tuple[int, int]:
    """(rows, cols) of one inner chunk of a sharded hidden-state array."""
    rows, cols = meta["codecs"][0]["configuration"]["chunk_shape"]
    return rows, cols


def start_sharded_decode(
    array: EncodedArray, num_rows: int, num_cols: int, pool: Executor
) -> tuple[np.ndarray, list[Future]]:
    """Queue the decode of a zarr v3 `sharding_indexed` file (index at the end,
    crc32c-checked), one task per inner chunk, into a new buffer. Returns the
    [num_rows, num_cols] buffer of raw bits (filled once the futures are done) and
    the futures."""
    sharding = array.meta["codecs"][0]
    config = sharding["configuration"]
    chain = config["codecs"]
    inner = tuple(c["name"] for c in chain)
    decode_chunk = CHUNK_DECODERS.get(inner)
    bits = HIDDEN_BITS.get(array.meta["data_type"])
    rows, cols = chunk_shape(array.meta)
    if (
        sharding["name"] != "sharding_indexed"
        or config.get("index_location", "end") != "end"
        or [c["name"] for c in config["index_codecs"]] != ["bytes", "crc32c"]
        or decode_chunk is None
        or bits is None
        or num_cols % cols
    ):
        raise _unsupported(array, f"encoding {sharding!r} / {array.meta['data_type']!r}")
    _require_little_endian(array, chain[0])
    if list(array.meta["shape"]) != [num_rows, num_cols]:
        raise _unsupported(array, f"shape {array.meta['shape']}, expected [{num_rows}, {num_cols}]")
    out = np.empty((layout.padded_shard_shape(num_rows, rows), num_cols), bits)
    grid = (out.shape[0] // rows, num_cols // cols)
    index = _shard_index(array, grid[0] * grid[1])
    data = memoryview(array.data)

    def decode(i: int) -> None:
        r, c = divmod(i, grid[1])
        block = out[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols]
        offset, nbytes = int(index[i, 0]), int(index[i, 1])
        if offset == _EMPTY_CHUNK:
            block[...] = 0
            return
        try:
            decode_chunk(data[offset : offset + nbytes], block)
        except (ValueError, RuntimeError) as exc:  # numcodecs and blosc raise these for a damaged chunk
            raise CorruptShardError(array.shard, array.name, f"inner chunk {i} does not decode ({exc})") from None

    return out[:num_rows], [pool.submit(decode, i) for i in range(len(index))]


def _shard_index(array: EncodedArray, num_chunks: int) -> np.ndarray:
    """The (offset, nbytes) of every inner chunk, from the crc32c-checked index at
    the end of a sharding_indexed file."""
    data = array.data
    index_size = num_chunks * _INDEX_ENTRY_BYTES
    if len(data) < index_size + _CRC_BYTES:
        raise CorruptShardError(array.shard, array.name, "shard file shorter than its index")
    index_bytes = bytes(data[-index_size - _CRC_BYTES : -_CRC_BYTES])
    (index_crc,) = struct.unpack("<I", data[-_CRC_BYTES:])
    if google_crc32c.value(index_bytes) != index_crc:
        raise CorruptShardError(array.shard, array.name, "shard index fails its crc32c")
    return np.frombuffer(index_bytes, dtype="<u8").reshape(num_chunks, 2)


def _require_little_endian(array: EncodedArray, codec: dict) -> None:
    endian = (codec.get("configuration") or {}).get("endian", "little")
    if endian != "little":
        raise _unsupported(array, f"byte order {endian!r}")


def _unsupported(array: EncodedArray, what: str) -> CorruptShardError:
    return CorruptShardError(array.shard, array.name, f"unsupported {what}")
