"""The extraction job's errors meant for the user, and the one rule for a full disk
(the driver and the workers both meet it, and say the same thing about it)."""

from __future__ import annotations

import errno
from pathlib import Path

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class ExtractError(RuntimeError):
    """The job cannot go on; the message says why and what to do."""


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in _DISK_FULL


def disk_full_message(store_path: Path, where: str) -> str:
    return (
        f"disk full {where} in {store_path}: free space (or move the store) and rerun the same command; "
        "committed shards are intact and will not be recomputed, half-written ones were never visible"
    )
