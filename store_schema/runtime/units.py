"""How sizes are printed: one format for every command (SI units, as disks and
throughput figures are quoted: 1 GB = 10**9 bytes)."""

from __future__ import annotations

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB", "EB")


def human_bytes(count: float) -> str:
    """`1234567` -> `"1.23 MB"`; bytes below 1 kB print as an integer."""
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """`3725` -> `"1h02m05s"`, `42.4` -> `"42s"`; unknown (NaN/inf) -> `"?"`."""
    if not seconds >= 0 or seconds == float("inf"):
        return "?"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
