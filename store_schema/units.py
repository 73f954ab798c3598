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
