"""An extraction job's configuration: one typed object, validated when it is made.

Light on purpose (no torch, no Ray): `python -m extract --help` reads its defaults.
What decides the plan's content is a `store_schema.plan.PlanSettings` of its own,
handed to the planner as is and recorded in the store; the test-only fault
injection is a `FaultInjection` of its own, kept out of the user's settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from store_schema.dtypes import store_dtype
from store_schema.plan import PlanSettings

DEFAULT_BATCH_TOKENS = 16384
DEFAULT_MAX_ATTEMPTS = 4
DEVICES = ("cpu", "cuda")
# Fault injection (tests and the fault suite): real SIGKILLs at chosen points.
KILL_AFTER_BATCHES_ENV = "DFLASH_EXTRACT_KILL_AFTER_BATCHES"  # "3,7,...": see FaultInjection.kill_after_batches
KILL_DRIVER_ENV = "DFLASH_EXTRACT_KILL_DRIVER_AFTER_SHARDS"  # see FaultInjection.kill_driver_after_shards


@dataclass(frozen=True)
class FaultInjection:
    """Real process deaths at reproducible points, for the fault suite; never a user
    setting. Read from the environment by default, so a test can arm a job started
    through the command line."""

    # The i-th actor created dies (SIGKILL) after kill_after_batches[i] batches; later actors live.
    kill_after_batches: tuple[int, ...] = ()
    # The driver SIGKILLs itself once this many shards were committed in this run.
    kill_driver_after_shards: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultInjection":
        environ = os.environ if environ is None else environ
        batches = environ.get(KILL_AFTER_BATCHES_ENV, "").strip()
        driver = environ.get(KILL_DRIVER_ENV, "").strip()
        return cls(
            kill_after_batches=tuple(int(x) for x in batches.split(",") if x.strip()),
            kill_driver_after_shards=int(driver) if driver else None,
        )

    def actor_kill_after(self, actor_number: int) -> int | None:
        """Batches the `actor_number`-th actor created (0-based) lives for; None: all its life."""
        kills = self.kill_after_batches
        return kills[actor_number] if actor_number < len(kills) else None


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
    plan_workers: int = 1  # tokenizer processes for the planning pass
    workers: int = 1  # extraction actors
    device: str = "cpu"
    address: str | None = None  # join a running Ray cluster; None: start a local one
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    target_topk: int | None = None
    store_dtype: str = "bfloat16"  # hidden states as stored: bfloat16, or fp8_e4m3 (half the bytes, lossy)
    overwrite: bool = False
    trust_remote_code: bool = False
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # per shard, counting the first
    inflight_per_worker: int = 2  # 2: one shard computing while the previous one is written
    cpus_per_worker: int = 1  # Ray num_cpus per actor; torch threads for --device cpu
    progress: bool = False
    faults: FaultInjection = field(default_factory=FaultInjection.from_env)

    def __post_init__(self):
        if self.workers < 1 or self.max_attempts < 1 or self.batch_tokens < 1:
            raise ValueError("--workers, --batch-tokens and the attempt limit must be positive")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        self.store_dtype = store_dtype(self.store_dtype).name  # refuses an unknown one, naming the choices

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer the plan is made with: --tokenizer, else the model's own."""
        return self.tokenizer or self.model
