"""`python -m extract run --model M --corpus C --store S [...]`: hidden states into a store (resumes)."""

from __future__ import annotations

from store_schema.dtypes import STORE_DTYPES
from store_schema.runtime.cli import size_argument

from ..extraction.config import DEFAULT_BATCH_SHARDS, DEFAULT_BATCH_TOKENS
from ..jobs.settings import LINEAR_ATTENTION
from .flags import add_device_flag, add_plan_arguments, add_ray_flags, add_retry_flags, add_space_flag


def add_parser(commands) -> None:
    run = commands.add_parser("run", help="extract hidden states into a store on Ray workers (resumes)")
    add_plan_arguments(run, run=True)
    run.set_defaults(json=False)
    run.add_argument(
        "--workers",
        type=int,
        default=1,
        help="extraction workers, one per GPU with --device cuda (default %(default)s)",
    )
    add_device_flag(run)
    add_ray_flags(run)
    add_retry_flags(run)
    run.add_argument(
        "--batch-tokens",
        type=int,
        default=DEFAULT_BATCH_TOKENS,
        help="padded tokens per forward batch (default %(default)s)",
    )
    run.add_argument("--target-topk", type=int, help="also store the target's top-K next-token ids and log-probs")
    run.add_argument(
        "--store-dtype",
        choices=tuple(STORE_DTYPES),
        default="bfloat16",
        help="hidden states as bf16 (lossless, default), fp8 e4m3 with a scale per token (about 0.6x "
        "the bytes of bf16, lossy) or fp4 e2m1 with a scale per 32 values (about 0.36x, lossier); "
        "a store never mixes them",
    )
    project = run.add_mutually_exclusive_group()
    project.add_argument(
        "--project-energy",
        type=float,
        help="a projected store: each layer's states as coordinates on the fewest directions keeping this "
        "share of their energy (e.g. 0.99; store_schema/projection.py); export folds it into the drafter",
    )
    project.add_argument("--project-rank", type=int, help="a projected store keeping this many directions a layer")
    run.add_argument(
        "--project-fit-tokens",
        type=int,
        default=65_536,
        help="states a layer the projection is fitted on, from the plan's first shards (default %(default)s)",
    )
    run.add_argument("--overwrite", action="store_true", help="delete the store's content and start over")
    run.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code (off)")
    run.add_argument(
        "--batch-shards",
        type=int,
        default=DEFAULT_BATCH_SHARDS,
        help="consecutive shards batched together by length on one worker (default %(default)s; "
        "more: less padding, more host memory)",
    )
    add_kernel_flags(run)
    add_spool_flags(run)
    add_space_flag(run)
    run.set_defaults(handler="extract.commands.run:run")


def add_kernel_flags(run) -> None:
    """Which kernels a hybrid target's workers run, and the refusal of slow ones."""
    run.add_argument(
        "--require-fast-kernels",
        action="store_true",
        help="refuse CUDA workers that would run the PyTorch fallback for linear attention (fla not "
        "installed); causal-conv1d's fallback alone is a warning (no wheel on PyPI, cheap)",
    )
    run.add_argument(
        "--linear-attention",
        choices=LINEAR_ATTENTION,
        default="auto",
        help="hybrid targets' linear attention (default %(default)s): auto runs fla where it imports, after "
        "checking one layer of it against PyTorch's reference at worker start (the reference where they "
        "disagree); torch runs the reference",
    )


def add_spool_flags(run) -> None:
    """A store on object storage: where each node builds its shards before the upload."""
    run.add_argument(
        "--spool-dir",
        help="a store on object storage (--store s3://bucket/prefix): the local directory "
        "on each worker's node where shards are built before their upload "
        "(default: the system's temporary directory)",
    )
    run.add_argument(
        "--spool-size",
        type=size_argument,
        metavar="SIZE",
        help="the most the shards being built and uploaded may take in --spool-dir, per node "
        "(e.g. 20GB; default: its free space); a full spool waits for uploads to free it",
    )
