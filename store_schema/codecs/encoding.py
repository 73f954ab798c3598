"""How a hidden-state layer is encoded on disk: the lossless chunk codec and the
writer of a layer's one zarr shard file.

Codec v2, `bytesplit` (the default for new stores). On bf16 activations the high byte
of a value (sign + 7 exponent bits) compresses well with zstd, the low byte (exponent
LSB + 7 mantissa bits) hardly at all, and entropy-decoding the low byte costs about as
much time as the high byte for a few percent of bytes (benchmarks/store_bench.py
measures both per codec; the figures are in benchmarks/RESULTS.md). So each chunk's bytes are
split by position within the element, and a byte stream is zstd-coded only where
that saves at least `min_saving` of it; the rest is stored raw.

The chunk format is blosc1's, unchanged: one block per chunk, byte shuffle, the
block split into one stream per byte of the element, each stream either a zstd
frame or, when its stored size equals its raw size, the raw bytes (every blosc
decoder copies such a stream). zarr.json therefore lists the standard `blosc`
codec: plain zarr-python (or any Zarr v3 reader with blosc) decodes these arrays
without this package, and the fast reader (`store_schema.shard_decoder`) decodes them with the
same C call (zstd + SIMD unshuffle, GIL released) as v1 chunks. The encoder's
choice is recorded in the root's codec settings and the array's attributes.

Codec v3, `channels` (the default for fp8 stores): the same chunk format, cut so
that each stream is one channel. zstd-1 reaches an e4m3 code's order-0 entropy over a
whole chunk, but each channel's own distribution is narrower: the gain needs one zstd
frame, hence one Huffman table, per channel. An inner chunk is
therefore 16 bytes wide (16 fp8 channels, 8 bf16 ones) and blosc's element is one
row of it (typesize 16, blosc's widest split): stream j holds channel j (bf16: one
byte of a channel) down the chunk's rows. c-blosc's SIMD unshuffle turns the
streams back into rows; numpy or torch would have to transpose bytes, and a
channel-major chunk through Zarr's `transpose` codec decodes slower than this layout.
zstd pays a fixed cost per frame, so the chunks are tall: a shard's rows split evenly
into chunks of at most `channel_rows` (64K: a default shard is one chunk tall); short
chunks decode at about half the rate of tall ones at the same ratio.

v1 (`blosc`: blosc zstd-1, byte shuffle, every stream coded) and `none` (raw) go
through zarr-python's own encoder.

Decoding: `blosc_chunk.decode_split_zstd_chunk`."""

from __future__ import annotations

import itertools
import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal, get_args

import google_crc32c
import numpy as np
import zstandard

from ..runtime.file_writes import write_file
from ..runtime.units import human_bytes
from .arrays import RowBlocks, is_channel_major, scratch
from .blosc_chunk import (
    BLOSC_BYTE_SHUFFLE,
    BLOSC_HEADER,
    BLOSC_MAX_SPLITS,
    BLOSC_MIN_STREAM,
    BLOSC_NOT_SPLIT,
    BLOSC_ONE_BLOCK_START,
    BLOSC_STREAM_SIZE,
    BLOSC_VERSION,
    BLOSC_ZSTD_FORMAT,
    BLOSC_ZSTD_VERSIONLZ,
)

CODEC_NAMES = ("bytesplit", "channels", "blosc", "none")
BloscName = Literal["zstd", "lz4", "lz4hc", "zlib", "blosclz"]  # the blosc compressors a `blosc` store may name
BloscShuffle = Literal["shuffle", "bitshuffle", "noshuffle"]
MatchTable = Literal["auto", "full", "small"]  # zstd's match finder in a split codec's streams (`CodecConfig`)
SPLIT_CODECS = ("bytesplit", "channels")  # written by `write_bytesplit_shard`; the others by zarr
ARRAY_CODEC_ATTR = "dflash_codec"  # a layer array's attribute naming the encoder that wrote it

_INDEX_ENTRY = struct.Struct("<QQ")  # sharding index entry: offset, nbytes
TRIAL_BYTES = 64 << 10  # a longer stream is first tried on this much of it: one that saves nothing there stays raw
TRIAL_PIECES = 4  # ... taken as this many pieces spread from its head to its tail (a padded chunk ends in zeros)


@dataclass(frozen=True)
class CodecConfig:
    """The lossless codec of hidden-state chunks, recorded in the store's root.

    name: `bytesplit` (v2, the default for bf16), `channels` (v3, the default for
    fp8), `blosc` (v1: blosc `cname`, `shuffle`, every stream coded), or `none` (raw).
    level: zstd level of coded streams (blosc's clevel for `blosc` and `channels`).
    min_saving: `bytesplit` and `channels` code a byte stream only when zstd saves this
    fraction of it.
    chunk_bytes: target size of one inner chunk of a hidden-state array.
    channel_rows: `channels`: the most tokens in one chunk, hence one channel's zstd
    frame (see the module docstring); `chunk_bytes` does not apply.
    match_table: split codecs' zstd match finder: `full` (the level's table), `small`
    (`SMALL_HASH_LOG`; a state's stream saves nearly all through the entropy coder), or
    `auto`: each layer of a shard codes its first chunk both ways, keeping `full` where
    it saves `FULL_TABLE_SAVING` of the bytes (states a token decides, repeated text)."""

    name: str = "bytesplit"
    level: int = 1
    min_saving: float = 0.1
    cname: BloscName = "zstd"
    shuffle: BloscShuffle = "shuffle"
    chunk_bytes: int = 4 << 20
    channel_rows: int = 65536
    match_table: MatchTable = "auto"

    def __post_init__(self):
        if self.name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.name!r}; choose one of {', '.join(CODEC_NAMES)}")
        if self.cname not in get_args(BloscName):
            raise ValueError(f"unknown blosc cname {self.cname!r}")
        if self.shuffle not in get_args(BloscShuffle):
            raise ValueError(f"unknown shuffle {self.shuffle!r}")
        if self.name != "blosc" and (self.cname, self.shuffle) != ("zstd", "shuffle"):
            raise ValueError(f"cname and shuffle are settings of the blosc codec, not of {self.name!r}")
        if not 0.0 <= self.min_saving < 1.0:
            raise ValueError(f"min_saving must be in [0, 1), got {self.min_saving}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        if self.channel_rows < 128:
            raise ValueError(f"channel_rows must be >= 128 (blosc's smallest block), got {self.channel_rows}")
        if self.match_table not in get_args(MatchTable):
            raise ValueError(
                f"unknown match_table {self.match_table!r}; choose one of {', '.join(get_args(MatchTable))}"
            )

    def chunk_shape(self, num_tokens: int, hidden_size: int, itemsize: int) -> tuple[int, int]:
        """(rows, columns) of one inner chunk of a shard's [num_tokens, hidden_size]
        hidden-state array. Row-major codecs: whole rows, `chunk_bytes` of them.
        `channels`: the rows split evenly into chunks of at most `channel_rows` (a
        shard pads at most a row per chunk), and the most channels up to 16 bytes
        that divide `hidden_size`."""
        if self.name != "channels":
            return max(1, self.chunk_bytes // (hidden_size * itemsize)), hidden_size
        row_chunks = max(1, math.ceil(num_tokens / self.channel_rows))
        rows = max(1, math.ceil(num_tokens / row_chunks))
        widest = max(1, BLOSC_MAX_SPLITS // itemsize)
        return rows, max(c for c in range(1, min(widest, hidden_size) + 1) if hidden_size % c == 0)

    def compressors(self, chunk_shape: tuple[int, int], itemsize: int = 2):
        """The zarr codecs zarr.json lists (what any reader needs to decode)."""
        from zarr.codecs import BloscCodec  # zarr only where zarr.json is written: decoding runs without it

        rows, cols = chunk_shape
        if self.name == "none":
            return None
        if self.name in SPLIT_CODECS:
            typesize = self.element_bytes(cols, itemsize)
            shuffle: BloscShuffle = "shuffle" if typesize > 1 else "noshuffle"
            return [
                BloscCodec(
                    cname="zstd",
                    clevel=self.level,
                    shuffle=shuffle,
                    typesize=typesize,
                    blocksize=rows * cols * itemsize,
                )
            ]
        return [
            BloscCodec(
                cname=self.cname,
                clevel=self.level,
                shuffle=self.shuffle,
                typesize=itemsize,
                blocksize=rows * cols * itemsize,
            )
        ]

    def element_bytes(self, chunk_cols: int, itemsize: int) -> int:
        """blosc's element (typesize) in a chunk of `chunk_cols` values a row: one value,
        or for `channels` one row of the chunk (a stream per channel byte)."""
        return chunk_cols * itemsize if self.name == "channels" else itemsize

    def describe(self) -> str:
        """One line for `info`."""
        if self.name == "channels":
            return (
                f"channels (zstd level {self.level}, {BLOSC_MAX_SPLITS}-byte-wide chunks of <= {self.channel_rows}"
                " tokens)"
            )
        coded = "" if self.name == "none" else f"{self.cname if self.name == 'blosc' else 'zstd'} level {self.level}, "
        return f"{self.name} ({coded}{human_bytes(self.chunk_bytes)} chunks)"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "CodecConfig":
        """Also reads the settings v1 stores recorded (`cname`, `clevel`, `shuffle`,
        `chunk_bytes`, no `name`): blosc, or raw where cname was "none"."""
        if "name" not in data:
            cname = data["cname"]
            if cname == "none":
                return cls(name="none", level=0, chunk_bytes=data["chunk_bytes"])
            return cls(
                name="blosc",
                level=data["clevel"],
                cname=cname,
                shuffle=data["shuffle"],
                chunk_bytes=data["chunk_bytes"],
            )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# -- the bytesplit chunk encoder --------------------------------------------------------------
def encode_bytesplit_chunk(chunk: np.ndarray, level: int, min_saving: float, typesize: int | None = None) -> bytes:
    """One blosc1 chunk (see the module docstring) holding `chunk`'s bytes, split into
    one stream per byte of a `typesize`-byte element (default: one value)."""
    typesize = typesize or chunk.dtype.itemsize
    flat = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    return b"".join(_chunk_parts(flat, typesize, StreamCoder(level, min_saving), np.empty_like(flat)))


def _chunk_parts(flat: np.ndarray, typesize: int, coder: "StreamCoder", scratch: np.ndarray) -> list:
    """The chunk of `flat`'s bytes as its parts in order, its byte streams split into
    `scratch` (as many bytes as `flat`), which raw streams among the parts point into."""
    if not _splits(flat.nbytes, typesize):
        return _blosc_parts([flat], typesize, flat.nbytes, coder)
    return _blosc_parts(_byte_streams(flat, typesize, scratch), typesize, flat.nbytes, coder)


def _splits(nbytes: int, typesize: int) -> bool:
    """Whether blosc splits a one-block chunk of `nbytes` into one stream per byte of its elements."""
    return 1 < typesize <= BLOSC_MAX_SPLITS and nbytes // typesize >= BLOSC_MIN_STREAM


def _blosc_parts(streams: list[np.ndarray], typesize: int, nbytes: int, coder: "StreamCoder") -> list:
    """The one-block blosc1 chunk of `streams` (one per byte of a `typesize`-byte
    element, or one unsplit) as its parts in order; a stream stored raw is not copied."""
    split = len(streams) > 1
    body = []
    for stream in streams:
        stored = coder.stored(stream)
        body.append(BLOSC_STREAM_SIZE.pack(len(stored)))
        body.append(stored)
    bstarts = BLOSC_STREAM_SIZE.pack(BLOSC_ONE_BLOCK_START)  # one block, right after the header and this table
    total = BLOSC_HEADER.size + len(bstarts) + sum(len(b) for b in body)
    flags = BLOSC_ZSTD_FORMAT | (BLOSC_BYTE_SHUFFLE if split else BLOSC_NOT_SPLIT)
    header = BLOSC_HEADER.pack(BLOSC_VERSION, BLOSC_ZSTD_VERSIONLZ, flags, typesize, nbytes, nbytes, total)
    return [header, bstarts, *body]


def _channel_streams(channels: np.ndarray, r: int, c: int, chunk_shape: tuple[int, int]) -> list[np.ndarray]:
    """The streams of chunk (r, c) of a `channels` layer held channel-major (`channels`
    [cols, rows]): row k of the block is channel k down the chunk's rows, so an fp8
    channel's stream is a view and a bf16 channel's two are one strided copy each."""
    chunk_rows, chunk_cols = chunk_shape
    block = channels[c * chunk_cols : (c + 1) * chunk_cols, r * chunk_rows : (r + 1) * chunk_rows]
    if block.shape[1] < chunk_rows:  # the last row of chunks, zero-padded
        padded = np.zeros((chunk_cols, chunk_rows), channels.dtype)
        padded[:, : block.shape[1]] = block
        block = padded
    if block.itemsize == 1:
        return list(block.view(np.uint8))
    size = block.itemsize
    channel_bytes = block.view(np.uint8)
    return [np.ascontiguousarray(channel_bytes[k, j::size]) for k in range(chunk_cols) for j in range(size)]


def _byte_streams(flat: np.ndarray, typesize: int, out: np.ndarray) -> list[np.ndarray]:
    """Byte j of every `typesize`-byte element of `flat`, for each j, in `out` (as many
    bytes as `flat`): blosc's shuffle. Two-byte values split by a cast and a shift;
    wider elements by one transpose."""
    streams = out.reshape(typesize, -1)
    if typesize == 2:
        values = flat.view("<u2")
        np.copyto(streams[0], values, casting="unsafe")  # uint16 -> uint8 keeps the low byte
        np.right_shift(values, 8, out=streams[1], casting="unsafe")
    else:
        np.copyto(streams, flat.reshape(-1, typesize).T)
    return list(streams)


_COMPRESSORS = threading.local()  # each encoding thread's zstd contexts, by (level, small table)
SMALL_HASH_LOG = 6  # `match_table` small: 64 entries (level 1's own at a 2 MB stream: 16K)
FULL_TABLE_SAVING = 0.02  # `match_table` auto keeps the level's table where it saves this of a chunk


@dataclass(frozen=True)
class StreamCoder:
    """How a split codec stores each byte stream of a chunk: its zstd code at `level`
    (the match finder's table small, or the level's own) where that saves
    `min_saving` of it, else its raw bytes."""

    level: int
    min_saving: float
    small_table: bool = False

    def stored(self, stream: np.ndarray):
        """The stream's code, or the stream. A stream longer than two trials is first
        coded on a trial (pieces spread over it): where that saves under half of
        `min_saving` (a bf16 mantissa byte saves ~0 %) it stays raw without coding the
        rest, the writer's largest single saving of time."""
        if len(stream) > 2 * TRIAL_BYTES:
            piece = TRIAL_BYTES // TRIAL_PIECES
            starts = np.linspace(0, len(stream) - piece, TRIAL_PIECES).astype(np.int64)
            trial = np.concatenate([stream[s : s + piece] for s in starts])
            if len(self.compress(trial)) > len(trial) * (1.0 - self.min_saving / 2):
                return stream
        coded = self.compress(stream)
        # A stream whose stored size equals its raw size is read as raw: never store a code that long.
        return coded if len(coded) <= len(stream) * (1.0 - self.min_saving) and len(coded) < len(stream) else stream

    def compress(self, stream: np.ndarray) -> bytes:
        """One zstd frame (content size in its header, as numcodecs' and blosc's
        decoders read it) from a context this thread keeps: a fresh context per call,
        as numcodecs' `zstd.compress` makes, costs more than coding a channel's stream."""
        compressors: dict = _COMPRESSORS.__dict__.setdefault("by_setting", {})
        setting = (self.level, self.small_table)
        if setting not in compressors and self.small_table:
            small = zstandard.ZstdCompressionParameters.from_level(self.level, hash_log=SMALL_HASH_LOG)
            compressors[setting] = zstandard.ZstdCompressor(compression_params=small)
        elif setting not in compressors:  # zstd's parameters for the level at each stream's size
            compressors[setting] = zstandard.ZstdCompressor(level=self.level)
        return compressors[setting].compress(stream.data)


def write_bytesplit_shard(
    path: Path, data: np.ndarray | RowBlocks, codec: CodecConfig, threads: int = 2, direct: bool = True
):
    """Write `data` [rows, cols] as a zarr v3 `sharding_indexed` file (`encode_shard`),
    past the page cache where `direct` (`runtime.file_writes`)."""
    parts = encode_shard(data, codec, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, parts, direct)


def encode_shard(data: np.ndarray | RowBlocks, codec: CodecConfig, threads: int = 2) -> list:
    """The bytes of a zarr v3 `sharding_indexed` file holding `data` [rows, cols] (values or
    codes as the store holds them, one array or the samples' `RowBlocks`) in `codec`'s inner
    chunks, as parts (bytes, or byte arrays valid until this thread's next call) in order:
    the chunks (the last row of them zero-padded), each encoded as by `encode_bytesplit_chunk`,
    then the index (C order of the chunk grid) + its crc32c: exactly the layout zarr writes.
    Split streams go to this thread's scratch buffer and raw ones are written from there:
    fresh arrays and one joined copy per chunk cost more in page faults than the split
    itself. `data` may be held channel-major (tokens contiguous, as fp8 codes leave the
    device): a `channels` chunk's streams are then cut without transposing, same bytes."""
    rows, cols = data.shape
    chunk_rows, chunk_cols = chunk_shape = codec.chunk_shape(rows, cols, data.itemsize)
    typesize = codec.element_bytes(chunk_cols, data.itemsize)
    grid = (max(1, -(-rows // chunk_rows)), cols // chunk_cols)
    chunk_bytes = chunk_rows * chunk_cols * data.itemsize
    if isinstance(data, RowBlocks) and chunk_cols < cols:  # chunks narrower than a row: cut from one array
        data = data.joined()
    blocks = data if isinstance(data, RowBlocks) else RowBlocks([data])
    one_row_each = typesize == chunk_cols * data.itemsize and _splits(chunk_bytes, typesize)  # a stream per channel
    channels = data.T if isinstance(data, np.ndarray) and is_channel_major(data) and one_row_each else None
    split = scratch("streams", 0 if channels is not None else grid[0] * grid[1] * chunk_bytes)  # channel-major: views

    def encode(i: int, coder: StreamCoder) -> list:
        r, c = divmod(i, grid[1])
        if channels is not None:
            streams = _channel_streams(channels, r, c, chunk_shape)
            return _blosc_parts(streams, typesize, chunk_bytes, coder)
        chunk = blocks.rows(r * chunk_rows, (r + 1) * chunk_rows)[:, c * chunk_cols : (c + 1) * chunk_cols]
        if chunk.shape[0] < chunk_rows or not chunk.flags.c_contiguous:  # padded, or narrower than the shard
            whole = np.zeros((chunk_rows, chunk_cols), data.dtype)
            whole[: chunk.shape[0]] = chunk
            chunk = whole
        flat = chunk.reshape(-1).view(np.uint8)
        return _chunk_parts(flat, typesize, coder, split[i * chunk_bytes : (i + 1) * chunk_bytes])

    first, coder = _first_chunk(encode, codec)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        encoded = [first, *pool.map(lambda i: encode(i, coder), range(1, grid[0] * grid[1]))]
    sizes = [_stored_size(parts) for parts in encoded]
    offsets = itertools.accumulate(sizes[:-1], initial=0)
    index_bytes = b"".join(_INDEX_ENTRY.pack(offset, size) for offset, size in zip(offsets, sizes))
    return [
        *(part for parts in encoded for part in parts),
        index_bytes,
        struct.pack("<I", google_crc32c.value(index_bytes)),
    ]


def _first_chunk(encode, codec: CodecConfig) -> tuple[list, StreamCoder]:
    """A shard's first chunk encoded (`encode(0, coder)`), and the coder of the rest:
    `codec.match_table`'s, or for `auto` the small table unless the level's own
    saves `FULL_TABLE_SAVING` of this chunk (coded both ways; a raw stream of either
    points into the same scratch bytes, split the same both times)."""
    full = StreamCoder(codec.level, codec.min_saving)
    small = StreamCoder(codec.level, codec.min_saving, small_table=True)
    if codec.match_table != "auto":
        coder = small if codec.match_table == "small" else full
        return encode(0, coder), coder
    small_parts, full_parts = encode(0, small), encode(0, full)
    if _stored_size(full_parts) <= _stored_size(small_parts) * (1.0 - FULL_TABLE_SAVING):
        return full_parts, full
    return small_parts, small


def _stored_size(parts: list) -> int:
    return sum(len(part) for part in parts)
