"""Writing a large file once, its crc32c taken on the way out.

A store's layer files are written once and read by another process much later, so
the page cache buys the writer nothing and costs it most of its kernel time: copying
a shard's gigabyte into the cache, reclaiming the pages that copy displaces, and
reading the file back to checksum it for the commit record. `write_file` therefore
writes through `O_DIRECT` where the OS and filesystem accept it (an aligned buffer
handed straight to the device), buffered where they do not (an OS without the flag, a
filesystem that answers EINVAL), and takes the crc32c of the very bytes it hands over.
`written_crc32c` gives that checksum to the commit record (`commit.records.describe_files`)
instead of a read-back, as long as the file's size, inode and mtime are still what the
write left."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import google_crc32c
import numpy as np

_BUFFER_BYTES = 16 << 20  # one O_DIRECT write; a multiple of every device's logical block
_BLOCK = 4096  # O_DIRECT's alignment of the last, padded write (then truncated back)
_REMEMBERED = 4096  # files whose checksum is kept until the commit record asks for it

_buffers = threading.local()
_written: OrderedDict[str, tuple[tuple[int, int, int], str]] = OrderedDict()
_written_lock = threading.Lock()


def write_file(path: Path, parts: Iterable, direct: bool = True) -> None:
    """Write `parts` (byte buffers, in order) as the new file `path`, past the page
    cache where `direct` and the filesystem allow, and remember its crc32c."""
    parts = list(parts)
    crc = None
    if direct and hasattr(os, "O_DIRECT"):
        crc = _write_direct(path, parts)
    if crc is None:
        crc = _write_buffered(path, parts)
    stat = os.stat(path)
    with _written_lock:
        _written[str(path)] = ((stat.st_size, stat.st_ino, stat.st_mtime_ns), crc)
        while len(_written) > _REMEMBERED:
            _written.popitem(last=False)


def written_crc32c(path: Path) -> str | None:
    """The crc32c `write_file` took of `path` (then forgotten), or None where it did
    not write it or the file changed since."""
    with _written_lock:
        entry = _written.pop(str(path), None)
    if entry is None:
        return None
    stat = os.stat(path)
    return entry[1] if (stat.st_size, stat.st_ino, stat.st_mtime_ns) == entry[0] else None


def _write_buffered(path: Path, parts: list) -> str:
    checksum = google_crc32c.Checksum()
    with open(path, "wb") as f:
        for part in parts:
            checksum.update(_bytes_of(part))
            f.write(part)
    return checksum.hexdigest().decode()


def _write_direct(path: Path, parts: list) -> str | None:
    """`parts` through this thread's aligned buffer with O_DIRECT; None (nothing left
    at `path`) where the filesystem refuses it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return None
        raise
    try:
        crc = _fill_and_write(fd, parts)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        crc = None
    finally:
        os.close(fd)
    if crc is None:
        os.unlink(path)
    return crc


def _fill_and_write(fd: int, parts: list) -> str:
    """Copy `parts` into the aligned buffer, writing it each time it fills; the tail
    is padded to a block and the file truncated back to the bytes given."""
    buffer = _aligned_buffer()
    checksum = google_crc32c.Checksum()
    fill = total = 0
    for part in parts:
        data = _bytes_of(part)
        while len(data):
            n = min(len(data), _BUFFER_BYTES - fill)
            buffer[fill : fill + n] = data[:n]
            fill, data = fill + n, data[n:]
            if fill == _BUFFER_BYTES:
                total += _write_out(fd, buffer, fill, checksum)
                fill = 0
    if fill:
        total += _write_out(fd, buffer, fill, checksum)
    os.ftruncate(fd, total)
    return checksum.hexdigest().decode()


def _write_out(fd: int, buffer: np.ndarray, fill: int, checksum) -> int:
    """Write the buffer's first `fill` bytes (padded with zeros to a block); returns `fill`."""
    checksum.update(buffer[:fill])
    padded = -(-fill // _BLOCK) * _BLOCK
    buffer[fill:padded] = 0
    written = 0
    while written < padded:
        written += os.write(fd, buffer[written:padded].data)
    return fill


def _aligned_buffer() -> np.ndarray:
    """This thread's page-aligned buffer (an anonymous memory map), made once."""
    if not hasattr(_buffers, "array"):
        _buffers.array = np.frombuffer(mmap.mmap(-1, _BUFFER_BYTES), np.uint8)
    return _buffers.array


def _bytes_of(part) -> np.ndarray:
    """A part's bytes as a flat uint8 array (what google_crc32c and the copy take), no copy."""
    return np.frombuffer(part, np.uint8)
