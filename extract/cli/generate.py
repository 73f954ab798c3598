"""`python -m extract generate --model M --corpus C --out DIR [...]`: the target's own replies (resumes)."""

from __future__ import annotations

from store_schema.plan import DEFAULT_MAX_LENGTH
from store_schema.runtime.hub import model_dir_arg

from ..generate.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_GENERATE_BATCH_TOKENS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_REQUEST_RETRIES,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SHARD_RECORDS,
    ENGINES,
    REASONING,
    THINKING,
)
from .flags import add_device_flag, add_ray_flags, add_retry_flags, add_space_flag


def add_parser(commands) -> None:
    gen = commands.add_parser("generate", help="regenerate every assistant turn with the target (resumes)")
    gen.add_argument(
        "--model",
        required=True,
        type=model_dir_arg,
        help="target model directory (config.json, tokenizer), or a hub id in the local Hugging Face cache",
    )
    gen.add_argument(
        "--corpus", required=True, help="chat corpus: JSONL / Parquet file, directory of them, datasets dir"
    )
    gen.add_argument("--out", help="generated corpus directory (Parquet shards + manifest.json)")
    gen.add_argument(
        "--workers", type=int, default=1, help="generate workers, one per GPU with --device cuda (default %(default)s)"
    )
    add_device_flag(gen)
    add_ray_flags(gen)
    add_retry_flags(gen)
    add_reply_flags(gen)
    add_server_flags(gen)
    gen.add_argument("--limit", type=int, help="generate only the first N records")
    gen.add_argument(
        "--max-length",
        type=int,
        default=DEFAULT_MAX_LENGTH,
        help="prompt + reply tokens of a turn; a first prompt that fills it is quarantined (default %(default)s)",
    )
    gen.add_argument(
        "--shard-records",
        type=int,
        default=DEFAULT_SHARD_RECORDS,
        help="records per output shard (default %(default)s)",
    )
    gen.add_argument("--dry-run", action="store_true", help="print records, prompt tokens, quarantine; write nothing")
    add_space_flag(gen)
    gen.set_defaults(handler="extract.commands.generate:run")


def add_reply_flags(gen) -> None:
    """What each reply is: its length, sampling, thinking mode, and the batches it is generated in."""
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="tokens per reply; a reply that reaches it is kept and flagged truncated (default %(default)s)",
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default %(default)g)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed, temperature > 0 (default %(default)s)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument(
        "--thinking",
        choices=THINKING,
        default="keep",
        help="enable_thinking on / off for the chat template; keep: the template's default (default %(default)s)",
    )
    mode.add_argument(
        "--reasoning",
        choices=tuple(REASONING),
        help="thinking mode, spelled out (required with --engine openai): keep = enable_thinking on "
        "(the replies reason), drop = off; serve the drafter in the same mode",
    )
    gen.add_argument(
        "--batch-tokens",
        type=int,
        default=DEFAULT_GENERATE_BATCH_TOKENS,
        help="(prompt + max new tokens) x rows per generate batch (default %(default)s)",
    )


def add_server_flags(gen) -> None:
    """`--engine openai`: the servers that generate and how the job talks to them."""
    gen.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        help="hf: transformers' generate on Ray workers (default without --endpoint); openai: ask "
        "OpenAI-compatible servers of the target (vLLM, SGLang) at --endpoint",
    )
    gen.add_argument(
        "--endpoint",
        action="append",
        metavar="URL",
        help="an OpenAI-compatible server of --model (http://host:8000); repeat for several",
    )
    gen.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help="requests in flight per endpoint (default %(default)s; about the server's max-num-seqs)",
    )
    gen.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds one reply may take, the server's queue included (default %(default)g)",
    )
    gen.add_argument(
        "--request-retries",
        type=int,
        default=DEFAULT_REQUEST_RETRIES,
        help="tries after a timeout or HTTP error before the record is quarantined (default %(default)s)",
    )
    gen.add_argument("--served-model", help="the name the servers give --model, when it is an alias")
