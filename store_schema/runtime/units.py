"""How sizes are printed and read: one format for every command (SI units, as disks
and throughput figures are quoted: 1 GB = 10**9 bytes; binary ones read too: 1 GiB = 2**30)."""

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


def parse_bytes(text) -> int:
    """`"2TB"` -> 2 * 10**12, `"1.5 GiB"` -> 1.5 * 2**30, `4096` / `"4096"` -> 4096 bytes;
    ValueError naming the text otherwise (a negative or unknown unit among them)."""
    if isinstance(text, int) and not isinstance(text, bool):
        number, unit = float(text), "B"
    else:
        spelled = str(text).strip()
        split = len(spelled.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
        number_text, unit = spelled[:split].strip(), spelled[split:] or "B"
        try:
            number = float(number_text)
        except ValueError:
            number = -1.0
    scale = (
        {u.lower(): 1000**i for i, u in enumerate(_UNITS)}
        | {f"{u[0].lower()}ib": 1024 ** (i + 1) for i, u in enumerate(_UNITS[1:])}
        | {"": 1, "k": 1000}
    )
    if unit.lower() not in scale or not number >= 0:
        raise ValueError(
            f"{text!r} is not a size: a number of bytes with an optional unit (kB, MB, GB, TB, PB; "
            "KiB, MiB, GiB, TiB), e.g. 500GB or 2TiB"
        )
    return int(number * scale[unit.lower()])


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
