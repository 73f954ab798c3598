"""Facts about the machine this process runs on that commands size themselves by."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which containers and
    `taskset` narrow; the machine's count where the platform has no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
