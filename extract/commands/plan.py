"""`extract plan --dry-run`: the job on paper (samples, tokens, quarantine, store size, hours)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from store_schema.dtypes import FP8_E4M3_STORE, SPACE_HEADROOM, STORE_DTYPES, space_needed
from store_schema.layout import LAYER_ID_CONVENTION
from store_schema.location import is_object_store
from store_schema.plan import PlanSettings
from store_schema.projection import RANK_MULTIPLE
from store_schema.runtime import host
from store_schema.runtime.cli import UsageError
from store_schema.runtime.progress import default_mode
from store_schema.runtime.target_config import read_target_config
from store_schema.runtime.units import human_bytes

from ..extraction.estimate import cache_traffic, cache_traffic_lines, estimate_lines, extraction_estimate
from ..extraction.job import plan_job
from ..extraction.layers import layers_from_drafters, resolve_layer_ids
from ..extraction.planning import estimate_store_bytes, summarize
from ..extraction.training_rate import dry_run_rate, stated_rate
from ..jobs.settings import Execution
from .planning import job_config, quarantined_lines

# `extract plan --workers` meant tokenizer processes while `extract run --workers` means Ray actors.
RENAMED_WORKERS_NOTE = (
    "`extract plan --workers` is now --tokenizer-workers (tokenizer processes); "
    "--workers is for `extract run` (Ray actors)"
)


@dataclass(frozen=True)
class PaperJob:
    """The flags `extract plan` sizes the job on paper with (extract/cli/plan.py's `add_estimate_arguments`
    and the plan's own), read once at the handler's top."""

    model: str
    batch_tokens: int
    gpu_memory: float | None
    tokens_per_s: float | None
    gpus: int
    gpu_tflops: float | None
    store_dtype: str
    cache_size: int | None
    train_tokens_per_s: float | None
    mfu: float
    compression_ratio: float
    layers_from: str | None  # the drafter directories, comma-separated

    @classmethod
    def from_args(cls, args) -> "PaperJob":
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls)})


def run(args) -> int:
    if args.workers is not None:
        raise UsageError(RENAMED_WORKERS_NOTE)
    if not args.dry_run:
        raise UsageError(
            "`plan` only previews a job (--dry-run); the plan is written into the store by "
            "`python -m extract run`, which plans again with the same settings"
        )
    config = job_config(
        args, plan_workers=args.tokenizer_workers, execution=Execution(progress=default_mode(not args.json))
    )
    dims = read_target_config(args.model)
    layer_ids = resolve_layer_ids(dims, config.layers, config.num_context_layers)
    paper = PaperJob.from_args(args)
    plan = plan_job(config)
    summary = summarize(plan)
    estimate = estimate_store_bytes(plan, len(layer_ids), dims.hidden_size, args.compression_ratio)
    report = dict(
        summary.to_json(),
        job=job_on_paper(paper, plan, layer_ids, estimate),
        layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        num_target_layers=dims.num_hidden_layers,
        hidden_size=dims.hidden_size,
        estimated_raw_bytes=estimate.raw_bytes,
        estimated_compressed_bytes=estimate.compressed_bytes,
        compression_ratio=args.compression_ratio,
        estimated_fp8_bytes=estimate.fp8_bytes,
        fp8_compression_ratio=FP8_E4M3_STORE.size_ratio,
        space_needed_bytes={name: space_needed(size) for name, size in estimate.by_dtype.items()},
        store_dtypes=store_dtype_sizes(estimate, args.store),
        projected_store_bytes=projected_sizes(estimate, dims.hidden_size),
        corpus_records=plan.settings["corpus_records"],
        corpus_hash=plan.settings["corpus_hash"],
        plan_digest=plan.digest(),
        store=args.store,
        dry_run=True,
    )
    if paper.layers_from:
        report["layers_from"] = sizes_per_drafter(paper.layers_from, paper.compression_ratio, plan, dims)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_plan(report, plan, config.plan_settings, args.corpus)
    return 0


def job_on_paper(paper: PaperJob, plan, layer_ids: list[int], estimate) -> dict:
    """The extraction's hours, GPUs and writer cores for the plan (and, with --cache-size,
    the trainer's shard-cache traffic)."""
    store_bytes = estimate.store_bytes()
    job = extraction_estimate(
        paper.model,
        layer_ids,
        plan.num_tokens,
        store_bytes,
        paper.batch_tokens,
        paper.gpu_memory,
        paper.tokens_per_s,
        paper.gpus,
        paper.gpu_tflops,
        paper.store_dtype,
    )
    if paper.cache_size is not None:
        largest = max(s.num_tokens for s in plan.shards)
        rate = (
            stated_rate(paper.train_tokens_per_s)
            if paper.train_tokens_per_s is not None
            else dry_run_rate(paper.model, paper.gpus, paper.gpu_tflops, paper.mfu, plan.settings["max_length"])
        )
        job["cache"] = cache_traffic(store_bytes, largest, plan.num_tokens, paper.cache_size, rate)
    return job


def sizes_per_drafter(layers_from: str, compression_ratio: float, plan, dims) -> dict:
    """`--layers-from`: each drafter's own layers and the store it alone would need, beside the union's."""
    sizes = {}
    for directory, ids in layers_from_drafters(layers_from).items():
        estimate = estimate_store_bytes(plan, len(ids), dims.hidden_size, compression_ratio)
        sizes[directory] = {"layer_ids": ids, **estimate.by_dtype}
    return sizes


def store_dtype_sizes(estimate, store) -> dict:
    """Per store dtype: its ratio to raw bf16, the store's bytes, the space `run` asks
    for, and whether that fits the free space where the store would be (a directory's
    filesystem; a bucket's room is not known here: `fits` is None)."""
    free = None if store is None or is_object_store(store) else host.free_bytes(store)  # tests fake it there
    return {
        name: {
            "size_ratio": STORE_DTYPES[name].size_ratio,
            "bytes": size,
            "space_needed_bytes": space_needed(size),
            "free_bytes": free,
            "fits": None if free is None else space_needed(size) <= free,
        }
        for name, size in estimate.by_dtype.items()
    }


def projected_sizes(estimate, hidden_size: int) -> dict:
    """`run --project-rank K` at K = 1/2, 1/4, 1/8 of the hidden size (whole blocks of
    `RANK_MULTIPLE`): each dtype's store scaled by K / H, the share of values kept (the
    codecs were measured to compress coordinates about as they do states)."""
    ranks = sorted({max(RANK_MULTIPLE, hidden_size // d // RANK_MULTIPLE * RANK_MULTIPLE) for d in (2, 4, 8)})
    return {
        str(rank): {name: round(size * rank / hidden_size) for name, size in estimate.by_dtype.items()}
        for rank in ranks
        if rank < hidden_size
    }


def projected_size_lines(sizes: dict, hidden_size: int) -> list[str]:
    """`plan --dry-run`'s lines for `projected_sizes`."""
    return [
        f"  --project-rank {rank} of {hidden_size}: "
        + ", ".join(f"{human_bytes(size)} {name}" for name, size in by_dtype.items())
        for rank, by_dtype in sizes.items()
    ]


def dtype_size_lines(sizes: dict) -> list[str]:
    """`plan --dry-run`'s lines for `store_dtype_sizes`: one per --store-dtype."""
    lines = [f"            with --store-dtype (`run` asks for the size plus {SPACE_HEADROOM:.0%} free):"]
    for name, entry in sizes.items():
        fits = {None: "", True: ", fits", False: ", does NOT fit"}[entry["fits"]]
        free = "" if entry["free_bytes"] is None else f" of {human_bytes(entry['free_bytes'])} free"
        lines.append(
            f"  {name:<10}{human_bytes(entry['bytes'])} (ratio {entry['size_ratio']} of raw bf16), "
            f"asks {human_bytes(entry['space_needed_bytes'])}{free}{fits}"
        )
    return lines


def _print_plan(report: dict, plan, chosen: PlanSettings, corpus_path: str) -> None:
    """`plan --dry-run`'s text: the `report` it would print as JSON, for a person."""
    s = plan.settings
    print(f"corpus      {s['corpus_path']} ({s['corpus_format']}, {s['corpus_records']} records)")
    print(f"samples     {report['samples']} in {report['shards']} shards of <= {chosen.shard_tokens} tokens")
    print(f"tokens      {report['tokens']} ({report['loss_tokens']} loss tokens), max length {chosen.max_length}")
    print(f"quarantined {report['quarantined']}")
    for reason, count in report["quarantined_by_reason"].items():
        print(f"  {reason:<22}{count}")
    for line in quarantined_lines(plan.quarantined, corpus_path):
        print(line)
    print(f"layers      {report['layer_ids']} of {report['num_target_layers']} (id L = {LAYER_ID_CONVENTION})")
    print(
        f"store size  {human_bytes(report['estimated_raw_bytes'])} raw, "
        f"{human_bytes(report['estimated_compressed_bytes'])} compressed (ratio {report['compression_ratio']}, "
        f"hidden {report['hidden_size']}, bf16)"
    )
    for line in dtype_size_lines(report["store_dtypes"]):
        print(line)
    for line in projected_size_lines(report["projected_store_bytes"], report["hidden_size"]):
        print(line)
    for directory, own in report.get("layers_from", {}).items():
        sizes = ", ".join(f"{human_bytes(own[name])} {name}" for name in STORE_DTYPES)
        print(f"  alone     {directory} {own['layer_ids']}: {sizes}")
    if report.get("layers_from"):
        print("            (the store above serves every --layers-from drafter)")
    for line in estimate_lines(report["job"]) + (
        cache_traffic_lines(report["job"]["cache"]) if "cache" in report["job"] else []
    ):
        print(line)
    print("dry run: nothing written")
