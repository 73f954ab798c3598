"""`python -m extract plan --dry-run --model M --corpus C [...]`: the job on paper."""

from __future__ import annotations

import argparse

from store_schema.dtypes import STORE_DTYPES
from store_schema.runtime.cli import size_argument
from store_schema.runtime.estimate import DEFAULT_MFU

from ..extraction.config import DEFAULT_BATCH_TOKENS
from .flags import add_plan_arguments


def add_parser(commands) -> None:
    plan = commands.add_parser("plan", help="tokenize the corpus and preview the job plan")
    add_plan_arguments(plan)
    plan.add_argument("--dry-run", action="store_true", help="print counts and the size estimate, write nothing")
    plan.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    add_estimate_arguments(plan)
    plan.set_defaults(handler="extract.commands.plan:run")


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    """The dry-run's sizing flags (plan only)."""
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=DEFAULT_BATCH_TOKENS,
        help="padded tokens per forward batch, as `run --batch-tokens` (default %(default)s)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GIB",
        help="memory of one GPU in GiB (e.g. 96 for an RTX PRO 6000, 141 for an H200): check "
        "the worker's peak against it and print the largest --batch-tokens that fits",
    )
    parser.add_argument(
        "--tokens-per-s",
        type=float,
        metavar="N",
        help="extraction tokens/s of one GPU, to print the job's hours and writer cores",
    )
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (workers) the job runs on (default 1)")
    parser.add_argument(
        "--store-dtype",
        choices=tuple(STORE_DTYPES),
        default="bfloat16",
        help="the store dtype `run --store-dtype` will write: sizes the writer cores (default %(default)s)",
    )
    parser.add_argument(
        "--gpu-tflops",
        type=float,
        metavar="TFLOPS",
        help="one GPU's dense bf16 peak, to print the share of it --tokens-per-s needs",
    )
    parser.add_argument(
        "--cache-size",
        type=size_argument,
        metavar="SIZE",
        help="training reads the store (e.g. s3://...) through a shard cache of SIZE per node "
        "(train's data.cache_size, e.g. 25TB): print the traffic per epoch from the store "
        "and the rate it must sustain at --train-tokens-per-s",
    )
    parser.add_argument(
        "--train-tokens-per-s",
        type=float,
        metavar="N",
        help="training tokens/s of the whole job for --cache-size (default: what `python -m train fit "
        "--dry-run` computes for the default drafter on --gpus GPUs at --gpu-tflops x --mfu)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help="model FLOPs utilisation of training, with --gpu-tflops, for --cache-size's rate (default %(default)s)",
    )
