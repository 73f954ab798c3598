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


def refuse_unless_it_fits(path: Path, needed: int, what: str, override: str) -> None:
    """Refuse a job whose output needs more than the free space of `path`'s
    filesystem (`store_schema.runtime.host.free_bytes`), naming both figures; better
    now than when the disk fills hours in."""
    from store_schema.runtime.host import free_bytes
    from store_schema.runtime.units import human_bytes

    free = free_bytes(path)
    if needed > free:
        raise ExtractError(
            f"{path}: {what} take about {human_bytes(needed)}, its filesystem has {human_bytes(free)} free -- "
            f"free space or choose another location, or pass {override} to start anyway"
        )
