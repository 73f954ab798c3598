"""A generate job's configuration, validated when made; light (no torch, no Ray).

Placement fields (workers, device, cpus_per_worker, address, faults) are named as in
`extract.extraction.config.JobConfig`, so the same Ray start-up and actor pool serve both jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from store_schema.plan import DEFAULT_MAX_LENGTH

from ..jobs.settings import Execution

THINKING = ("on", "off", "keep")  # enable_thinking=True / False / the template's default
REASONING = {"keep": "on", "drop": "off"}  # --reasoning: the thinking mode it sets
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_GENERATE_BATCH_TOKENS = 65536  # (prompt + max new tokens) x rows of one generate batch
DEFAULT_SHARD_RECORDS = 256
ENGINES = {"hf": "transformers", "openai": "openai"}  # --engine -> the name recorded in the manifest
DEFAULT_CONCURRENCY = 64  # requests in flight per endpoint
DEFAULT_REQUEST_TIMEOUT = 1800.0  # seconds for one reply, the server's queue included
DEFAULT_REQUEST_RETRIES = 3
GENERATOR_VERSION = 1  # bump when the same settings would generate something else


@dataclass(frozen=True)
class GenerationSettings:
    """What decides the generated text besides the target, its tokenizer and the corpus;
    recorded in the manifest and compared by a rerun on the same output."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sampling (temperature > 0)
    thinking: str = "keep"
    max_length: int = DEFAULT_MAX_LENGTH  # prompt + reply tokens of any turn
    shard_records: int = DEFAULT_SHARD_RECORDS
    limit: int | None = None  # only the first `limit` records
    engine: str = ENGINES["hf"]

    def __post_init__(self):
        for name in ("max_new_tokens", "max_length", "shard_records"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature!r}")
        if self.thinking not in THINKING:
            raise ValueError(f"--thinking must be one of {THINKING}, got {self.thinking!r}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"--limit must be >= 0, got {self.limit}")
        if self.engine not in ENGINES.values():
            raise ValueError(f"engine must be one of {tuple(ENGINES.values())}, got {self.engine!r}")

    def to_json(self) -> dict:
        return dict(
            engine=self.engine,
            generator_version=GENERATOR_VERSION,
            max_new_tokens=self.max_new_tokens,
            temperature=float(self.temperature),
            seed=self.seed,
            thinking=self.thinking,
            max_length=self.max_length,
            shard_records=self.shard_records,
            limit=self.limit,
        )

    @classmethod
    def from_json(cls, record) -> "GenerationSettings":
        return cls(**{name: record[name] for name in cls.__dataclass_fields__ if name in record})


@dataclass(frozen=True)
class ServerConfig:
    """`--engine openai`: the OpenAI-compatible servers (vLLM, SGLang, transformers
    serve) that generate, and how the job talks to them. None of it decides the
    text: a rerun may name other endpoints."""

    endpoints: tuple[str, ...]
    concurrency: int = DEFAULT_CONCURRENCY  # per endpoint
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    request_retries: int = DEFAULT_REQUEST_RETRIES  # then the record is quarantined
    served_model: str | None = None  # the server's name for --model, when it serves it under an alias

    def __post_init__(self):
        if not self.endpoints:
            raise ValueError("--engine openai needs at least one --endpoint URL")
        for url in self.endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--endpoint {url!r} is not an http(s):// URL")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError("an --endpoint is given twice")
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"--concurrency must be a positive integer, got {self.concurrency!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout!r}")
        if self.request_retries < 0:
            raise ValueError(f"--request-retries must be >= 0, got {self.request_retries!r}")


@dataclass
class GenerateConfig:
    model: str
    corpus: str
    out: str | None  # None only for --dry-run
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    execution: Execution = field(default_factory=Execution)  # actors, retries, progress (validated there)
    batch_tokens: int = DEFAULT_GENERATE_BATCH_TOKENS
    server: ServerConfig | None = None  # --engine openai

    def __post_init__(self):
        if self.batch_tokens <= 0:
            raise ValueError(f"--batch-tokens must be positive, got {self.batch_tokens}")
        if (self.server is not None) != (self.settings.engine == ENGINES["openai"]):
            raise ValueError("the openai engine goes with its servers (--endpoint), and only it")
