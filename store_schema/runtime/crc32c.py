"""crc32c, the one checksum of the project: of a store's files and of a target's weights."""

from __future__ import annotations

from pathlib import Path

import google_crc32c
import numpy as np


def crc32c_file(path: Path) -> str:
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            checksum.update(block)
    return checksum.hexdigest().decode()


def crc32c_bytes(data) -> str:
    """crc32c of any buffer (bytes, or a memory map's view, which google_crc32c takes as numpy)."""
    return f"{google_crc32c.value(data if isinstance(data, bytes) else np.frombuffer(data, np.uint8)):08x}"
