"""Flags more than one extract command takes: planning (plan, run), device, free space."""

from __future__ import annotations

import argparse

from store_schema.dtypes import BFLOAT16_STORE, FP8_E4M3_STORE
from store_schema.plan import (
    DEFAULT_LOSS_MASK,
    DEFAULT_MAX_LENGTH,
    DEFAULT_MIN_LOSS_TOKENS,
    DEFAULT_SEED,
    DEFAULT_SHARD_TOKENS,
    LOSS_MASK_CONVENTIONS,
)
from store_schema.runtime.cli import SKIP_SPACE_CHECK_FLAG
from store_schema.runtime.host import AUTO_DEVICE, available_cores
from store_schema.runtime.hub import model_dir_arg

from ..jobs.settings import DEFAULT_MAX_ATTEMPTS, DEFAULT_PROGRESS_INTERVAL, DEFAULT_WORKER_TIMEOUT, DEVICES

DEVICE_HELP = "where workers run: auto is cuda when this host sees a GPU, else cpu (default %(default)s)"


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=(AUTO_DEVICE, *DEVICES), default=AUTO_DEVICE, help=DEVICE_HELP)


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    """Where a job's workers run and how it reports progress: run and generate alike."""
    parser.add_argument("--address", help="join a running Ray cluster (default: start a local one, or $RAY_ADDRESS)")
    parser.add_argument(
        "--cpus-per-worker",
        type=int,
        default=1,
        help="Ray CPUs per worker, = torch threads with --device cpu (default %(default)s)",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=DEFAULT_PROGRESS_INTERVAL,
        help="seconds between progress lines when stderr is not a terminal (default %(default)g)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")


def add_retry_flags(parser: argparse.ArgumentParser) -> None:
    """When a job retries a shard and when it gives a silent worker up: run and generate alike."""
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=DEFAULT_MAX_ATTEMPTS,
        help="tries per shard when workers die (default %(default)s)",
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=DEFAULT_WORKER_TIMEOUT,
        help="seconds a worker holding shards may stay silent before it is presumed lost and its "
        "shards are revoked and redone elsewhere (default %(default)g)",
    )


def add_space_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        SKIP_SPACE_CHECK_FLAG,
        action="store_true",
        help="start even when the plan's size estimate exceeds the output filesystem's free space",
    )


def add_source_flags(parser: argparse.ArgumentParser) -> None:
    """What a job reads and writes: the target, its tokenizer, the corpus, the store, the layers."""
    parser.add_argument(
        "--model",
        required=True,
        type=model_dir_arg,
        help="target model directory (config.json, tokenizer), or a hub id in the local Hugging Face cache",
    )
    parser.add_argument("--tokenizer", help="tokenizer directory if not the model's")
    parser.add_argument("--corpus", required=True, help="JSONL / Parquet file, directory of them, or datasets dir")
    parser.add_argument("--store", help="store path the plan is for")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--layers", help="context layer ids, comma-separated (id L = output of decoder layer L)")
    layers.add_argument(
        "--num-context-layers",
        type=int,
        help="use the default spread of N layers (default 5, or --for-drafter's layers for a published family)",
    )
    layers.add_argument(
        "--layers-from",
        metavar="DIR[,DIR...]",
        help="the union of the target layers these drafter directories read (dflash_config."
        "target_layer_ids; published or exported): one store for several drafters",
    )
    layers.add_argument(
        "--for-drafter",
        metavar="KIND[,KIND...]",
        help="the layers the published layouts of these drafter kinds read (dflash2, dflash), for a "
        "target family with published drafters; the default there: the default drafter's (dflash2)",
    )


def add_tokenizer_workers_flag(parser: argparse.ArgumentParser, run: bool) -> None:
    """The planning pass's tokenizer processes: `--plan-workers` on run (`--workers` is its Ray
    actors), `--tokenizer-workers` on plan, whose old `--workers` is refused by name."""
    cores = available_cores()
    if run:
        parser.add_argument(
            "--plan-workers",
            "--tokenizer-workers",
            dest="plan_workers",
            type=int,
            default=cores,
            help="tokenizer processes for planning, as `plan --tokenizer-workers` (default: this "
            "machine's cores, %(default)s)",
        )
    else:
        parser.add_argument(
            "--tokenizer-workers",
            type=int,
            default=cores,
            help="tokenizer processes (default: this machine's cores, %(default)s)",
        )
        parser.add_argument("--workers", help=argparse.SUPPRESS)  # the old spelling, refused by `extract plan`


RESUMED = "a resumed store: its plan's"  # what a plan flag left out means where the store holds a plan


def add_plan_arguments(parser: argparse.ArgumentParser, run: bool = False) -> None:
    """The plan's settings. Each defaults to None: a fresh plan takes the documented
    default, a resumed store its own plan's (`JobConfig.plan_settings_given`)."""
    add_source_flags(parser)
    parser.add_argument(
        "--max-length",
        type=int,
        help=f"tokens per sample; longer records are truncated (default {DEFAULT_MAX_LENGTH}; {RESUMED})",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        help=f"tokens per shard, the unit of work and of a commit (default {DEFAULT_SHARD_TOKENS}; {RESUMED})",
    )
    parser.add_argument(
        "--min-loss-tokens",
        type=int,
        help="quarantine samples with fewer loss tokens (default "
        f"{DEFAULT_MIN_LOSS_TOKENS}: the store serves every drafter, each leaving out at fit what it cannot "
        f"train on; {RESUMED})",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        help="plan for one DFlash block size: --min-loss-tokens 2 x this, recorded in the plan (as every plan "
        "made before drafter families), and fit refuses a larger model.block_size",
    )
    parser.add_argument(
        "--seed", type=int, help=f"seed of the samples' assignment to shards (default {DEFAULT_SEED}; {RESUMED})"
    )
    parser.add_argument(
        "--drop-long",
        action="store_true",
        default=None,
        help=f"quarantine records over --max-length (default: truncate; {RESUMED})",
    )
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record")
    add_tokenizer_workers_flag(parser, run)
    parser.add_argument("--limit", type=int, help=f"plan only the first N records ({RESUMED})")
    parser.add_argument(
        "--loss-mask",
        choices=tuple(LOSS_MASK_CONVENTIONS),
        help="what the loss scores in each assistant turn: the whole turn as served (reasoning, "
        f"content, tool calls, end-of-turn token) or its content only (default {DEFAULT_LOSS_MASK}; {RESUMED})",
    )
    if not run:  # `run` sizes its free-space check with the store dtype's own ratio
        parser.add_argument(
            "--compression-ratio",
            type=float,
            default=BFLOAT16_STORE.size_ratio,
            help="compressed/raw of a bf16 store for the size estimate "
            f"(default %(default)s; fp8: {FP8_E4M3_STORE.size_ratio})",
        )
