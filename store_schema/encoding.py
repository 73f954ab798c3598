"""How a hidden-state layer is encoded on disk: the lossless chunk codec and the
writer of a layer's one zarr shard file.

Codec v2, `bytesplit` (the default for new stores). Measured on bf16 activations
(benchmarks/store_bench.py reports it per codec): the high byte of a bf16 value
(sign + 7 exponent bits) compresses to ~0.2-0.3 with zstd, the low byte (exponent
LSB + 7 mantissa bits) to 0.96-1.0, and entropy-decoding the low byte costs about as
much time as the high byte for a few percent of bytes. So each chunk's bytes are
split by position within the element, and a byte stream is zstd-coded only where
that saves at least `min_saving` of it; the rest is stored raw.

The chunk format is blosc1's, unchanged: one block per chunk, byte shuffle, the
block split into one stream per byte of the element, each stream either a zstd
frame or, when its stored size equals its raw size, the raw bytes (every blosc
decoder copies such a stream). zarr.json therefore lists the standard `blosc`
codec: plain zarr-python (or any Zarr v3 reader with blosc) decodes these arrays
without this package, and the fast reader (`shard_codec`) decodes them with the
same C call (zstd + SIMD unshuffle, GIL released) as v1 chunks. The encoder's
choice is recorded in the root's codec settings and the array's attributes.

v1 (`blosc`: blosc zstd-1, byte shuffle, every stream coded) and `none` (raw) stay
readable and writable; they go through zarr-python's own encoder.

Decoding (`decode_split_zstd_chunk`): c-blosc's decoder, called from the reader's
threads, runs each chunk through a fresh context and a scratch copy of the whole
block before unshuffling; measured here that made a bytesplit chunk decode at 0.43
GB/s per thread, no faster than v1. The chunks this module writes (and v1's, which
have the same one-block zstd form) are decoded here instead: each zstd stream
straight from the file's bytes, raw streams not copied at all, and the two bytes
of a bf16 value joined by one shift-or pass (~3x faster per thread). Any other blosc
chunk is left to c-blosc."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import google_crc32c
import numpy as np
from numcodecs import zstd

CODEC_NAMES = ("bytesplit", "blosc", "none")
ARRAY_CODEC_ATTR = "dflash_codec"  # a layer array's attribute naming the encoder that wrote it

_BLOSC_HEADER = struct.Struct("<BBBBiii")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
_BLOSC_VERSION, _BLOSC_ZSTD_VERSIONLZ = 2, 1
_BLOSC_SHUFFLE_BITS, _BLOSC_BYTE_SHUFFLE = 0x07, 0x01  # the shuffle bits of `flags`, and byte shuffle
_BLOSC_NOT_SPLIT = 0x10  # flag: the block is one stream, not one per byte of a value
_BLOSC_COMPRESSOR_BITS, _BLOSC_ZSTD_FORMAT = 0xE0, 4 << 5  # compressor enumeration in the top three flag bits
_BLOSC_MIN_STREAM = 128  # blosc splits a block into streams only when each holds at least this many bytes
_BLOSC_STREAM_SIZE = struct.Struct("<i")  # the block-start table's entry, and each stream's stored size
_BLOSC_ONE_BLOCK_START = _BLOSC_HEADER.size + _BLOSC_STREAM_SIZE.size  # after the header and a one-entry table
_INDEX_ENTRY = struct.Struct("<QQ")  # sharding index entry: offset, nbytes


@dataclass(frozen=True)
class CodecConfig:
    """The lossless codec of hidden-state chunks, recorded in the store's root.

    name: `bytesplit` (v2, the default), `blosc` (v1: blosc `cname`, `shuffle`,
    every stream coded), or `none` (raw bytes).
    level: zstd level of coded streams (blosc's clevel for `blosc`).
    min_saving: `bytesplit` codes a byte stream only when zstd saves this fraction of it.
    chunk_bytes: target size of one inner chunk of a hidden-state array."""

    name: str = "bytesplit"
    level: int = 1
    min_saving: float = 0.1
    cname: str = "zstd"
    shuffle: str = "shuffle"
    chunk_bytes: int = 4 << 20

    def __post_init__(self):
        if self.name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.name!r}; choose one of {', '.join(CODEC_NAMES)}")
        if self.cname not in ("zstd", "lz4", "lz4hc", "zlib", "blosclz"):
            raise ValueError(f"unknown blosc cname {self.cname!r}")
        if self.shuffle not in ("shuffle", "bitshuffle", "noshuffle"):
            raise ValueError(f"unknown shuffle {self.shuffle!r}")
        if self.name != "blosc" and (self.cname, self.shuffle) != ("zstd", "shuffle"):
            raise ValueError(f"cname and shuffle are settings of the blosc codec, not of {self.name!r}")
        if not 0.0 <= self.min_saving < 1.0:
            raise ValueError(f"min_saving must be in [0, 1), got {self.min_saving}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")

    def chunk_tokens(self, hidden_size: int, itemsize: int = 2) -> int:
        return max(1, self.chunk_bytes // (hidden_size * itemsize))

    def compressors(self, chunk_nbytes: int, itemsize: int = 2):
        """The zarr codecs zarr.json lists (what any reader needs to decode)."""
        from zarr.codecs import BloscCodec

        if self.name == "none":
            return None
        if self.name == "bytesplit":
            shuffle = "shuffle" if itemsize > 1 else "noshuffle"
            return [BloscCodec(cname="zstd", clevel=self.level, shuffle=shuffle, typesize=itemsize, blocksize=chunk_nbytes)]
        return [BloscCodec(cname=self.cname, clevel=self.level, shuffle=self.shuffle, typesize=itemsize,
                           blocksize=chunk_nbytes)]

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
            return cls(name="blosc", level=data["clevel"], cname=cname, shuffle=data["shuffle"],
                       chunk_bytes=data["chunk_bytes"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# -- the bytesplit chunk encoder --------------------------------------------------------------
def encode_bytesplit_chunk(chunk: np.ndarray, level: int, min_saving: float) -> bytes:
    """One blosc1 chunk (see the module docstring) holding `chunk`'s bytes."""
    typesize = chunk.dtype.itemsize
    nbytes = chunk.nbytes
    planes = chunk.reshape(-1).view(np.uint8).reshape(-1, typesize)
    split = typesize > 1 and nbytes // typesize >= _BLOSC_MIN_STREAM
    streams = [np.ascontiguousarray(planes[:, j]) for j in range(typesize)] if split else [planes.reshape(-1)]
    body = []
    for stream in streams:
        raw = stream.tobytes()
        coded = zstd.compress(raw, level)
        # A stream whose stored size equals its raw size is read as raw: never store a code that long.
        stored = coded if len(coded) <= len(raw) * (1.0 - min_saving) and len(coded) < len(raw) else raw
        body.append(_BLOSC_STREAM_SIZE.pack(len(stored)))
        body.append(stored)
    bstarts = _BLOSC_STREAM_SIZE.pack(_BLOSC_ONE_BLOCK_START)  # one block, right after the header and this table
    total = _BLOSC_HEADER.size + len(bstarts) + sum(len(b) for b in body)
    flags = _BLOSC_ZSTD_FORMAT | (_BLOSC_BYTE_SHUFFLE if split else _BLOSC_NOT_SPLIT)
    header = _BLOSC_HEADER.pack(_BLOSC_VERSION, _BLOSC_ZSTD_VERSIONLZ, flags, typesize, nbytes, nbytes, total)
    return b"".join([header, bstarts, *body])


def decode_split_zstd_chunk(chunk: memoryview, out: np.ndarray) -> bool:
    """Fill `out` (a flat array of 1- or 2-byte values) from a one-block blosc1 zstd
    chunk: byte-shuffled streams (one per byte of a value, each zstd or raw) or one
    unshuffled stream of 1-byte values. Returns False, touching nothing, for any
    other blosc chunk (the caller hands those to c-blosc); raises ValueError when
    the chunk claims this form but its streams do not add up."""
    if len(chunk) < _BLOSC_ONE_BLOCK_START:
        return False
    version, _, flags, typesize, nbytes, blocksize, cbytes = _BLOSC_HEADER.unpack_from(chunk)
    split = not flags & _BLOSC_NOT_SPLIT
    layout_known = (
        version == _BLOSC_VERSION
        and flags & _BLOSC_COMPRESSOR_BITS == _BLOSC_ZSTD_FORMAT
        and nbytes == blocksize == out.nbytes
        and cbytes == len(chunk)
        and typesize == out.itemsize
        and _BLOSC_STREAM_SIZE.unpack_from(chunk, _BLOSC_HEADER.size)[0] == _BLOSC_ONE_BLOCK_START
        and (
            (split and flags & _BLOSC_SHUFFLE_BITS == _BLOSC_BYTE_SHUFFLE and typesize in (1, 2)
             and nbytes // typesize >= _BLOSC_MIN_STREAM)
            or (not split and flags & _BLOSC_SHUFFLE_BITS == 0 and typesize == 1)
        )
    )
    if not layout_known:
        return False
    count = nbytes // typesize
    streams, offset = [], _BLOSC_ONE_BLOCK_START
    for _ in range(typesize if split else 1):
        (stored,) = _BLOSC_STREAM_SIZE.unpack_from(chunk, offset)
        start = offset + _BLOSC_STREAM_SIZE.size
        body = chunk[start : start + stored]
        if stored <= 0 or len(body) != stored:
            raise ValueError(f"blosc stream of {stored} bytes in a chunk of {len(chunk)}")
        if stored != count:
            body = zstd.decompress(body)
            if len(body) != count:
                raise ValueError(f"zstd stream decodes to {len(body)} bytes, expected {count}")
        streams.append(np.frombuffer(body, np.uint8))
        offset = start + stored
    if offset != len(chunk):
        raise ValueError(f"blosc chunk has {len(chunk) - offset} bytes after its last stream")
    if typesize == 1:
        out.view(np.uint8)[...] = streams[0]
    else:
        bits = out.view("<u2")
        np.left_shift(streams[1], 8, out=bits, dtype=np.uint16)
        np.bitwise_or(bits, streams[0], out=bits)
    return True


def write_bytesplit_shard(path: Path, data: np.ndarray, chunk_rows: int, level: int, min_saving: float,
                          threads: int = 2) -> None:
    """Write `data` [rows, cols] as a zarr v3 `sharding_indexed` file (inner chunks of
    `chunk_rows` rows, the last one zero-padded; index + crc32c at the end), exactly
    the layout zarr writes, with each inner chunk encoded by `encode_bytesplit_chunk`."""
    rows, cols = data.shape
    num_chunks = max(1, -(-rows // chunk_rows))

    def encode(i: int) -> bytes:
        chunk = data[i * chunk_rows : (i + 1) * chunk_rows]
        if chunk.shape[0] < chunk_rows:
            padded = np.zeros((chunk_rows, cols), data.dtype)
            padded[: chunk.shape[0]] = chunk
            chunk = padded
        return encode_bytesplit_chunk(np.ascontiguousarray(chunk), level, min_saving)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        encoded = list(pool.map(encode, range(num_chunks)))
    index, offset = [], 0
    for chunk in encoded:
        index.append(_INDEX_ENTRY.pack(offset, len(chunk)))
        offset += len(chunk)
    index_bytes = b"".join(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for chunk in encoded:
            f.write(chunk)
        f.write(index_bytes)
        f.write(struct.pack("<I", google_crc32c.value(index_bytes)))
