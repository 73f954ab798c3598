"""The one-block blosc1 chunk every split codec writes (`encoding`): its layout, and
its decoder.

c-blosc's decoder, called from the reader's threads, runs each chunk through a fresh
context and a scratch copy of the whole block before unshuffling, which made a
bytesplit chunk decode no faster than v1. The chunks `encoding` writes (and v1's,
which have the same one-block zstd form) are decoded here instead
(`decode_split_zstd_chunk`): each zstd stream straight from the file's bytes, raw streams
not copied at all, and the two bytes of a bf16 value joined by one shift-or pass
(store_bench's decode figures per codec, benchmarks/RESULTS.md). Any other blosc
chunk is left to c-blosc."""

from __future__ import annotations

import struct

import numpy as np
from numcodecs import zstd

BLOSC_HEADER = struct.Struct("<BBBBiii")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
BLOSC_VERSION, BLOSC_ZSTD_VERSIONLZ = 2, 1
BLOSC_SHUFFLE_BITS, BLOSC_BYTE_SHUFFLE = 0x07, 0x01  # the shuffle bits of `flags`, and byte shuffle
BLOSC_NOT_SPLIT = 0x10  # flag: the block is one stream, not one per byte of a value
BLOSC_COMPRESSOR_BITS, BLOSC_ZSTD_FORMAT = 0xE0, 4 << 5  # compressor enumeration in the top three flag bits
BLOSC_MIN_STREAM = 128  # blosc splits a block into streams only when each holds at least this many bytes
BLOSC_MAX_SPLITS = 16  # ... and only for elements of at most this many bytes
BLOSC_STREAM_SIZE = struct.Struct("<i")  # the block-start table's entry, and each stream's stored size
BLOSC_ONE_BLOCK_START = BLOSC_HEADER.size + BLOSC_STREAM_SIZE.size  # after the header and a one-entry table


def decode_split_zstd_chunk(chunk: memoryview, out: np.ndarray) -> bool:
    """Fill `out` (a flat array of 1- or 2-byte values) from a one-block blosc1 zstd
    chunk: byte-shuffled streams (one per byte of a value, each zstd or raw) or one
    unshuffled stream of 1-byte values. Returns False, touching nothing, for any
    other blosc chunk (the caller hands those to c-blosc); raises ValueError when
    the chunk claims this form but its streams do not add up."""
    if len(chunk) < BLOSC_ONE_BLOCK_START:
        return False
    version, _, flags, typesize, nbytes, blocksize, cbytes = BLOSC_HEADER.unpack_from(chunk)
    split = not flags & BLOSC_NOT_SPLIT
    layout_known = (
        version == BLOSC_VERSION
        and flags & BLOSC_COMPRESSOR_BITS == BLOSC_ZSTD_FORMAT
        and nbytes == blocksize == out.nbytes
        and cbytes == len(chunk)
        and typesize == out.itemsize
        and BLOSC_STREAM_SIZE.unpack_from(chunk, BLOSC_HEADER.size)[0] == BLOSC_ONE_BLOCK_START
        and (
            (
                split
                and flags & BLOSC_SHUFFLE_BITS == BLOSC_BYTE_SHUFFLE
                and typesize in (1, 2)
                and nbytes // typesize >= BLOSC_MIN_STREAM
            )
            or (not split and flags & BLOSC_SHUFFLE_BITS == 0 and typesize == 1)
        )
    )
    if not layout_known:
        return False
    count = nbytes // typesize
    streams, offset = [], BLOSC_ONE_BLOCK_START
    for _ in range(typesize if split else 1):
        (stored,) = BLOSC_STREAM_SIZE.unpack_from(chunk, offset)
        start = offset + BLOSC_STREAM_SIZE.size
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
