"""An extraction job's configuration: one typed object, validated when it is made.

Light on purpose (no torch, no Ray): `python -m extract --help` reads its defaults.
What decides the plan's content is a `store_schema.plan.PlanSettings` of its own,
handed to the planner as is and recorded in the store; the test-only fault
injection is a `FaultInjection` of its own, kept out of the user's settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from store_schema.dtypes import store_dtype
from store_schema.plan import PlanSettings

DEFAULT_BATCH_TOKENS = 16384
DEFAULT_MAX_ATTEMPTS = 4
DEFAULT_BATCH_SHARDS = 4
DEFAULT_WORKER_TIMEOUT = 3600.0
DEFAULT_PROGRESS_INTERVAL = 30.0
DEVICES = ("cpu", "cuda")
PROGRESS_MODES = ("bar", "lines", "off")  # a live bar on a terminal, else a line every interval (ray job logs)
# Fault injection (tests and the fault suite): real SIGKILLs / SIGSTOPs at chosen points.
KILL_AFTER_BATCHES_ENV = "DFLASH_EXTRACT_KILL_AFTER_BATCHES"  # "3,7,...": see FaultInjection.kill_after_batches
STOP_AFTER_BATCHES_ENV = "DFLASH_EXTRACT_STOP_AFTER_BATCHES"  # "3,...": see FaultInjection.stop_after_batches
KILL_DRIVER_ENV = "DFLASH_EXTRACT_KILL_DRIVER_AFTER_SHARDS"  # see FaultInjection.kill_driver_after_shards


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask, which containers and
    batch schedulers set), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultInjection":
        environ = os.environ if environ is None else environ
        def numbers(name: str) -> tuple[int, ...]:
            return tuple(int(x) for x in environ.get(name, "").split(",") if x.strip())

        driver = environ.get(KILL_DRIVER_ENV, "").strip()
        return cls(
            kill_after_batches=numbers(KILL_AFTER_BATCHES_ENV),
            stop_after_batches=numbers(STOP_AFTER_BATCHES_ENV),
            kill_driver_after_shards=int(driver) if driver else None,
        )

    def actor_kill_after(self, actor_number: int) -> int | None:
        """Batches the `actor_number`-th actor created (0-based) lives for; None: all its life."""
        kills = self.kill_after_batches
        return kills[actor_number] if actor_number < len(kills) else None

    def actor_stop_after(self, actor_number: int) -> int | None:
        """Batches after which the `actor_number`-th actor freezes; None: never."""
        stops = self.stop_after_batches
        return stops[actor_number] if actor_number < len(stops) else None


@dataclass
class JobConfig:
    model: str
    corpus: str
    store: str | None  # None only for `plan --dry-run`, which writes nothing
    tokenizer: str | None = None
    layers: list[int] | None = None
    num_context_layers: int | None = None
    plan_settings: PlanSettings = field(default_factory=PlanSettings)  # what decides the plan's content
    strict: bool = False  # planning stops at the first bad record instead of quarantining it
    plan_workers: int = field(default_factory=available_cpus)  # tokenizer processes for the planning pass
    workers: int = 1  # extraction actors
    device: str = "cpu"
    device_note: str = ""  # why this device (--device auto's choice): the job's first line says it
    address: str | None = None  # join a running Ray cluster; None: start a local one
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    target_topk: int | None = None
    store_dtype: str = "bfloat16"  # hidden states as stored: bfloat16, or fp8_e4m3 (half the bytes, lossy)
    overwrite: bool = False
    trust_remote_code: bool = False
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # per shard, counting the first
    # Consecutive shards of the plan batched together by length on one worker (less
    # padding); fixed by the plan, so every run batches a sample the same way.
    batch_shards: int = DEFAULT_BATCH_SHARDS
    # An actor holding shards that replies nothing for this long is presumed lost
    # (hung, or cut off from the driver): its attempts are revoked and redone elsewhere.
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT
    cpus_per_worker: int = 1  # Ray num_cpus per actor; torch threads for --device cpu
    require_fast_kernels: bool = False  # refuse CUDA workers on the PyTorch linear-attention fallback
    skip_space_check: bool = False  # start even when the size estimate exceeds the store's free space
    progress: str = "off"  # one of PROGRESS_MODES
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL  # seconds between progress lines ("lines")
    faults: FaultInjection = field(default_factory=FaultInjection.from_env)

    def __post_init__(self):
        positive = dict(workers=self.workers, batch_tokens=self.batch_tokens, max_attempts=self.max_attempts,
                        plan_workers=self.plan_workers, batch_shards=self.batch_shards,
                        worker_timeout=self.worker_timeout, progress_interval=self.progress_interval)
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        self.store_dtype = store_dtype(self.store_dtype).name  # refuses an unknown one, naming the choices
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"progress must be one of {PROGRESS_MODES}, got {self.progress!r}")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():  # not a hub lookup: one line
            raise FileNotFoundError(f"--tokenizer {self.tokenizer}: no such directory")

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer the plan is made with: --tokenizer, else the model's own."""
        return self.tokenizer or self.model
