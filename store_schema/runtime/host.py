"""Facts about the machine this process runs on that commands size themselves by."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which containers and
    `taskset` narrow; the machine's count where the platform has no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def omp_threads() -> int | None:
    """OMP_NUM_THREADS when it is a positive integer; None when it is unset, empty,
    zero or not a count (then the caller's default applies)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else None


def set_torch_threads(processes: int = 1) -> int:
    """Set torch's intra-op threads to what this process can use: OMP_NUM_THREADS
    when it is set (a positive integer), else its cores shared among `processes`
    (the processes of a job on this host). torch's default, every core of the
    machine per process, oversubscribes a loaded or shared host (greedy decoding ran
    orders of magnitude slower than at one thread on a busy 2-core VM).
    Returns the count set."""
    import torch  # torch only when a device is asked about: `store_schema info` runs without it

    threads = omp_threads() or max(1, available_cores() // max(1, processes))
    torch.set_num_threads(threads)
    return threads


AUTO_DEVICE = "auto"


def choose_device(name: str) -> tuple[str, str]:
    """A job's `--device` as "cpu" or "cuda", and the words that say why (the first line
    the command prints): `auto` is cuda when torch on this host sees a CUDA device, else
    cpu; cpu and cuda stand as given. Without it a user who left the flag out on a GPU
    host ran a 27B extraction on CPU."""
    if name != AUTO_DEVICE:
        return name, f"--device {name}"
    import torch  # torch only when a device is asked about: `store_schema info` runs without it

    if resolve_device(AUTO_DEVICE).type == "cuda":  # the one auto rule
        return "cuda", f"--device auto: torch sees {torch.cuda.device_count()} CUDA device(s)"
    return "cpu", "--device auto: torch sees no CUDA device here (--device cuda for a Ray cluster's GPUs)"


def device_line(device: str, why: str) -> str:
    """A job's first line: where its workers run and why (`choose_device`'s words)."""
    return f"device: {device} ({why})"


def resolve_device(name: str | None, setting: str = "--device"):
    """The torch device a command runs on: `name` (cpu, cuda, cuda:N), or CUDA when
    torch sees one and CPU otherwise for None / "auto". A device this machine does not
    have is refused here, naming `setting`, before anything is loaded (ValueError: one
    line, exit 1), instead of failing deep inside torch with a traceback."""
    import torch  # torch only when a device is asked about: `store_schema info` runs without it

    if name in (None, AUTO_DEVICE):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{setting} {name}: not a device (cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{setting} {name}: only cpu and cuda are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built without CUDA ({torch.__version__})" if torch.version.cuda is None else "sees no GPU"
            raise ValueError(f"{setting} {name}: torch on this machine {build}; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{setting} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(error: BaseException) -> bool:
    """The one rule for "the disk (or the user's quota) is full"."""
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


def free_bytes(path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (or
    its nearest existing parent): the one place that asks the OS (statvfs)."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    stats = os.statvfs(where)
    return stats.f_bavail * stats.f_frsize
