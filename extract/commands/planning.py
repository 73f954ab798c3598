"""What the plan, run and generate handlers share: the job config from the planning
flags, the execution settings from the worker flags, and the quarantined records
where a person finds them."""

from __future__ import annotations

import sys
from pathlib import Path

from store_schema.plan import PlanSettings
from store_schema.published_taps import taps_for
from store_schema.runtime.cli import UsageError
from store_schema.runtime.host import choose_device
from store_schema.runtime.progress import default_mode
from store_schema.runtime.target_config import read_target_config

from ..corpus import open_corpus
from ..extraction.config import JobConfig
from ..extraction.layers import layers_from_drafters, parse_layer_ids, union_of
from ..jobs.settings import Execution


def execution(args) -> Execution:
    """How `run` or `generate` runs its workers, from the flags both take (`--device auto`
    settled here: `choose_device`); ValueError naming the flag of an invalid value."""
    device, device_note = choose_device(args.device)
    return Execution(
        workers=args.workers,
        device=device,
        device_note=device_note,
        address=args.address,
        cpus_per_worker=args.cpus_per_worker,
        max_attempts=args.max_attempts,
        worker_timeout=args.worker_timeout,
        progress=default_mode(not args.no_progress),
        progress_interval=args.progress_interval,
        skip_space_check=args.skip_space_check,
    )


def job_config(args, **options) -> JobConfig:
    """The JobConfig `plan` and `run` share (one planning for both), plus each one's own options."""
    try:
        layers = parse_layer_ids(args.layers) if args.layers else None
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.layers_from:
        layers = union_of(layers_from_drafters(args.layers_from))
    if layers is None and args.num_context_layers is None:  # the layers the drafter to train reads
        kinds = [kind.strip() for kind in args.for_drafter.split(",") if kind.strip()] if args.for_drafter else None
        layers, line = taps_for(read_target_config(args.model), kinds)
        if line:
            print(line, file=sys.stderr, flush=True)
    if not Path(args.corpus).exists():  # before any line of work is printed
        raise FileNotFoundError(f"corpus {args.corpus} does not exist")
    named = ("max_length", "shard_tokens", "min_loss_tokens", "block_size", "seed", "drop_long", "limit", "loss_mask")
    given = {name: getattr(args, name) for name in named if getattr(args, name) is not None}
    if {"block_size", "min_loss_tokens"} <= set(given):
        raise UsageError("--block-size B sets --min-loss-tokens to 2 x B: give one of them")
    return JobConfig(
        model=args.model,
        corpus=args.corpus,
        store=args.store,
        tokenizer=args.tokenizer,
        layers=layers,
        num_context_layers=args.num_context_layers,
        plan_settings=PlanSettings(**given),
        plan_settings_given=frozenset(given),
        strict=args.strict,
        **options,
    )


def quarantined_lines(quarantined, corpus_path, shown: int = 10) -> list[str]:
    """The first quarantined records, each where a person finds it (file and 1-based line or row)."""
    if not quarantined:
        return []
    corpus = open_corpus(corpus_path)
    return [
        f"    {corpus.where(record.record_index)}: {record.reason} {record.detail}".rstrip()
        for record in quarantined[:shown]
    ]
