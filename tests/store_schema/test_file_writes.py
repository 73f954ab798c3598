"""The writer's file output: past the page cache, its crc32c taken on the way out.

The commit record takes a layer file's crc32c from `write_file` instead of reading the
file back, so the checksum it remembers must be the file's, and a file changed after
the write must be read again."""

from __future__ import annotations

import os

import numpy as np
import pytest

from store_schema.commit.records import describe_files
from store_schema.runtime.crc32c import crc32c_file
from store_schema.runtime.file_writes import write_file, written_crc32c

# Around the 4 KiB block and the 16 MiB buffer of an O_DIRECT write: the padded tail is truncated back.
SIZES = [0, 1, 4095, 4096, 4097, (16 << 20) - 3, 16 << 20, (16 << 20) + 5, 40_000_123]


def _parts(size: int) -> list:
    rng = np.random.default_rng(size)
    third = size // 3
    return [
        rng.integers(0, 256, third, dtype=np.uint8),
        rng.bytes(third),
        rng.integers(0, 256, size - 2 * third, np.uint8),
    ]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_a_written_file_holds_its_parts_and_its_remembered_crc32c(tmp_path, size, direct):
    parts = _parts(size)
    path = tmp_path / "layer" / "c"
    path.parent.mkdir()
    write_file(path, parts, direct)
    assert path.read_bytes() == b"".join(bytes(part) for part in parts)
    assert written_crc32c(path) == crc32c_file(path)
    assert written_crc32c(path) is None  # handed out once


def test_a_file_changed_after_its_write_is_read_back_for_the_record(tmp_path):
    path = tmp_path / "c"
    write_file(path, _parts(100_000))
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff\x00")
    os.utime(path, ns=(0, 0))  # a change within the same mtime tick would keep the stat; this one does not
    assert describe_files(tmp_path)["c"]["crc32c"] == crc32c_file(path)


def test_the_commit_record_lists_what_is_on_disk(tmp_path):
    for name in ("a", "b"):
        write_file(tmp_path / name, _parts(70_001))
    (tmp_path / "small.json").write_bytes(b"{}")
    files = describe_files(tmp_path)
    for name in ("a", "b", "small.json"):
        assert files[name] == {"size": (tmp_path / name).stat().st_size, "crc32c": crc32c_file(tmp_path / name)}
