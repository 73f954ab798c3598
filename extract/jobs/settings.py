"""What every sharded job shares before any worker starts: how it runs
(`Execution`, nested in `extract run`'s and `extract generate`'s configs and validated
once, here), the views of it the driver takes (`Placement`, `DispatchSettings`), and
the fault injection the fault suite arms through the environment (`FaultInjection`;
never a user setting).

Light on purpose (no torch, no Ray): `python -m extract --help` reads these."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from store_schema.runtime.host import resolve_device

from ..errors import ExtractError

DEFAULT_MAX_ATTEMPTS = 4
DEFAULT_WORKER_TIMEOUT = 3600.0
DEFAULT_PROGRESS_INTERVAL = 30.0
DEVICES = ("cpu", "cuda")  # `auto` (the flags' default) is settled before a config is made: host.choose_device
# --linear-attention: the package transformers found (fla), checked at worker start; PyTorch's reference
LINEAR_ATTENTION = ("auto", "torch")
PROGRESS_MODES = ("bar", "lines", "off")  # a live bar on a terminal, else a line every interval (ray job logs)
# Fault injection (tests and the fault suite): real SIGKILLs / SIGSTOPs at chosen points.
KILL_AFTER_BATCHES_ENV = "DFLASH_EXTRACT_KILL_AFTER_BATCHES"  # "3,7,...": see FaultInjection.kill_after_batches
STOP_AFTER_BATCHES_ENV = "DFLASH_EXTRACT_STOP_AFTER_BATCHES"  # "3,...": see FaultInjection.stop_after_batches
KILL_DRIVER_ENV = "DFLASH_EXTRACT_KILL_DRIVER_AFTER_SHARDS"  # see FaultInjection.kill_driver_after_shards
OOM_OVER_TOKENS_ENV = "DFLASH_EXTRACT_OOM_OVER_TOKENS"  # see FaultInjection.oom_over_tokens


def check_linear_attention(choice: str) -> None:
    """`--linear-attention`'s rule, for the job's config and for a target loaded alone."""
    if choice not in LINEAR_ATTENTION:
        raise ValueError(f"--linear-attention {choice!r}: choose one of {', '.join(LINEAR_ATTENTION)}")


@dataclass(frozen=True)
class FaultInjection:
    """Real process deaths at reproducible points, for the fault suite; never a user
    setting. Read from the environment by default, so a test can arm a job started
    through the command line."""

    # The i-th actor created dies (SIGKILL) after kill_after_batches[i] batches; later actors live.
    kill_after_batches: tuple[int, ...] = ()
    # The i-th actor created freezes (SIGSTOP) after stop_after_batches[i] batches.
    stop_after_batches: tuple[int, ...] = ()
    # The driver SIGKILLs itself once this many shards were committed in this run.
    kill_driver_after_shards: int | None = None
    # Every worker's forward of a batch over this many padded tokens raises the device's
    # out-of-memory error, as a GPU would with a batch too large (CPU has no such limit).
    oom_over_tokens: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultInjection":
        environ = os.environ if environ is None else environ

        def numbers(name: str) -> tuple[int, ...]:
            return tuple(int(x) for x in environ.get(name, "").split(",") if x.strip())

        driver = environ.get(KILL_DRIVER_ENV, "").strip()
        oom = environ.get(OOM_OVER_TOKENS_ENV, "").strip()
        return cls(
            kill_after_batches=numbers(KILL_AFTER_BATCHES_ENV),
            stop_after_batches=numbers(STOP_AFTER_BATCHES_ENV),
            kill_driver_after_shards=int(driver) if driver else None,
            oom_over_tokens=int(oom) if oom else None,
        )

    def actor_kill_after(self, actor_number: int) -> int | None:
        """Batches the `actor_number`-th actor created (0-based) lives for; None: all its life."""
        kills = self.kill_after_batches
        return kills[actor_number] if actor_number < len(kills) else None

    def actor_stop_after(self, actor_number: int) -> int | None:
        """Batches after which the `actor_number`-th actor freezes; None: never."""
        stops = self.stop_after_batches
        return stops[actor_number] if actor_number < len(stops) else None


def joins_cluster(address: str | None) -> bool:
    """A job that joins a running Ray cluster (``--address`` or ``$RAY_ADDRESS``) rather than starting one."""
    return bool(address or os.environ.get("RAY_ADDRESS"))


@dataclass(frozen=True)
class Placement:
    """Where a job's actors run (`Execution.placement`)."""

    device: str
    workers: int
    cpus_per_worker: int
    address: str | None
    faults: FaultInjection
    device_note: str = ""  # why that device: said as the job's first line (`run_sharded`)


@dataclass(frozen=True)
class DispatchSettings:
    """How the `Dispatcher` hands shards out and when it gives a worker up."""

    max_attempts: int  # tries per shard, counting the first
    batch_shards: int = 1  # consecutive shards computed together on one worker
    worker_timeout: float = float("inf")  # seconds a worker holding shards may stay silent
    kill_driver_after_shards: int | None = None  # fault injection: the driver dies after this many commits


@dataclass(frozen=True)
class ProgressSettings:
    """How a job reports progress: `desc` and `unit` are the job's ("extract", "sample")."""

    desc: str
    unit: str
    mode: str = "off"  # one of PROGRESS_MODES
    interval: float = DEFAULT_PROGRESS_INTERVAL


@dataclass(frozen=True)
class Execution:
    """How a sharded job runs, whatever it computes: where its actors go, how its shards
    are retried and given up on, how it reports progress, whether it checks free space.
    `extract run` and `extract generate` each nest one; validated once, when made."""

    workers: int = 1  # Ray actors
    device: str = "cpu"  # cpu or cuda: `--device auto` is settled by `store_schema.runtime.host.choose_device`
    device_note: str = ""  # why this device (--device auto's choice): the job's first line says it
    address: str | None = None  # join a running Ray cluster; None: start a local one
    cpus_per_worker: int = 1  # Ray num_cpus per actor; torch threads for --device cpu
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # per shard, counting the first
    # An actor holding shards that replies nothing for this long is presumed lost
    # (hung, or cut off from the driver): its attempts are revoked and redone elsewhere.
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT
    progress: str = "off"  # one of PROGRESS_MODES
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL  # seconds between progress lines ("lines")
    skip_space_check: bool = False  # start even when the size estimate exceeds the output's free space
    faults: FaultInjection = field(default_factory=FaultInjection.from_env)

    def __post_init__(self):
        positive = dict(
            workers=self.workers,
            cpus_per_worker=self.cpus_per_worker,
            max_attempts=self.max_attempts,
            worker_timeout=self.worker_timeout,
            progress_interval=self.progress_interval,
        )
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"progress must be one of {PROGRESS_MODES}, got {self.progress!r}")

    def placement(self) -> Placement:
        return Placement(self.device, self.workers, self.cpus_per_worker, self.address, self.faults, self.device_note)

    def dispatch(self, batch_shards: int = 1) -> DispatchSettings:
        return DispatchSettings(
            self.max_attempts, batch_shards, self.worker_timeout, self.faults.kill_driver_after_shards
        )

    def progress_settings(self, desc: str, unit: str) -> ProgressSettings:
        return ProgressSettings(desc, unit, self.progress, self.progress_interval)

    def torch_threads(self) -> int | None:
        """Each CPU worker's torch threads: its Ray CPUs (None on CUDA: torch's default)."""
        return self.cpus_per_worker if self.device == "cpu" else None

    def refuse_missing_cuda(self) -> None:
        """``--device cuda`` on a machine whose torch sees no GPU, for a job that starts its
        own Ray: refused before anything is planned. A job joining a cluster
        (``--address``) is checked against the cluster's GPUs once it connects."""
        if self.device != "cuda" or joins_cluster(self.address):
            return
        try:
            resolve_device("cuda")
        except ValueError as error:
            raise ExtractError(f"{error} (or --address to join a Ray cluster with GPUs)") from None
