"""An extraction job's configuration: one typed object, validated when it is made.

Light on purpose (no torch, no Ray): `python -m extract --help` reads its defaults.
What decides the plan's content is a `store_schema.plan.PlanSettings` of its own,
handed to the planner as is and recorded in the store; the test-only fault
injection is a `FaultInjection` of its own, kept out of the user's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from store_schema.dtypes import store_dtype
from store_schema.location import is_object_store
from store_schema.plan import PlanSettings
from store_schema.runtime.host import available_cores

from ..jobs.settings import Execution, check_linear_attention

DEFAULT_BATCH_TOKENS = 16384
DEFAULT_BATCH_SHARDS = 4


@dataclass
class JobConfig:
    model: str
    corpus: str
    store: str | None  # None only for `plan --dry-run`, which writes nothing
    tokenizer: str | None = None
    layers: list[int] | None = None
    num_context_layers: int | None = None
    plan_settings: PlanSettings = field(default_factory=PlanSettings)  # what decides the plan's content
    # The settings the command line named (None: all of them): a store that holds a plan
    # resumes with its own for the rest, so a changed default never refuses an old store.
    plan_settings_given: frozenset[str] | None = None
    strict: bool = False  # planning stops at the first bad record instead of quarantining it
    plan_workers: int = field(default_factory=available_cores)  # tokenizer processes for the planning pass
    execution: Execution = field(default_factory=Execution)  # actors, retries, progress (validated there)
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    target_topk: int | None = None
    store_dtype: str = "bfloat16"  # hidden states as stored: bfloat16, or fp8_e4m3 / fp4_e2m1 (lossy, fewer bytes)
    overwrite: bool = False
    trust_remote_code: bool = False
    # Consecutive shards of the plan batched together by length on one worker (less
    # padding); fixed by the plan, so every run batches a sample the same way.
    batch_shards: int = DEFAULT_BATCH_SHARDS
    require_fast_kernels: bool = False  # refuse CUDA workers on the PyTorch linear-attention fallback
    linear_attention: str = "auto"  # the package's kernel, checked at worker start; "torch": PyTorch's reference
    # A store on object storage: where each worker builds a shard before uploading it
    # (on its own node; None: the system's temporary directory), and the most bytes the
    # shards being built and uploaded may take there together (None: its free space).
    spool_dir: str | None = None
    spool_size: int | None = None
    # A projected store (`store_schema.projection`): keep this share of each layer's energy, or
    # this rank, fitted on the plan's first `project_fit_tokens` states before any shard.
    project_energy: float | None = None
    project_rank: int | None = None
    project_fit_tokens: int = 65_536

    def __post_init__(self):
        positive = dict(batch_tokens=self.batch_tokens, plan_workers=self.plan_workers, batch_shards=self.batch_shards)
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        self.store_dtype = store_dtype(self.store_dtype).name  # refuses an unknown one, naming the choices
        check_linear_attention(self.linear_attention)
        if self.project_energy is not None and self.project_rank is not None:
            raise ValueError("--project-energy and --project-rank: a projection keeps one or the other")
        if self.project_fit_tokens <= 0:
            raise ValueError(f"--project-fit-tokens must be positive, got {self.project_fit_tokens}")
        projected = self.project_energy is not None or self.project_rank is not None
        if projected and self.store is not None and is_object_store(self.store):
            raise ValueError(
                f"--project-energy / --project-rank: a projected store is made in a directory for now; extract into "
                f"one and copy it to {self.store} once written"
            )
        if self.spool_size is not None and self.spool_size <= 0:
            raise ValueError(f"--spool-size must be positive, got {self.spool_size}")
        if (self.spool_dir or self.spool_size) and self.store is not None and not is_object_store(self.store):
            raise ValueError(
                f"--spool-dir / --spool-size apply to a store on object storage (s3://, gs://); "
                f"{self.store} is a directory, written in place"
            )
        if self.tokenizer is not None and not Path(self.tokenizer).exists():  # not a hub lookup: one line
            raise FileNotFoundError(f"--tokenizer {self.tokenizer}: no such directory")

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer the plan is made with: --tokenizer, else the model's own."""
        return self.tokenizer or self.model
