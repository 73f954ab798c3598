"""Command line: ``python -m extract {plan,run,generate} ...``.

``plan --dry-run`` answers "what would this job be?" before any GPU time is
spent: samples, tokens, quarantine reasons and the store's estimated size.
``run`` plans the same way, then extracts on Ray workers into the store (or
resumes it) and prints the job's JSON report as its last line. ``generate`` has
the target regenerate every assistant turn of a corpus into a generated corpus
(Parquet shards + manifest) that ``run`` takes as its ``--corpus``.

Exit codes follow `store_schema.runtime.cli`: 0 done, 1 refused (a store made with other
settings or held by a live job, a bad layer id, a worker failure), 2 usage (bad
arguments, a model or corpus path that does not exist), 130 interrupted (Ctrl-C:
one line says how to resume).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import fields
from pathlib import Path

from store_schema.dtypes import BFLOAT16_STORE, FP8_E4M3_STORE, SPACE_HEADROOM, STORE_DTYPES, space_needed
from store_schema.errors import StoreError
from store_schema.layout import LAYER_ID_CONVENTION
from store_schema.plan import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOSS_MASK,
    DEFAULT_MAX_LENGTH,
    DEFAULT_SEED,
    DEFAULT_SHARD_TOKENS,
    LOSS_MASK_CONVENTIONS,
    PlanSettings,
)
from store_schema.runtime.cli import (
    SKIP_SPACE_CHECK_FLAG,
    CommandParser,
    UsageError,
    interrupted,
    run_command,
    show_defaults,
    size_argument,
)
from store_schema.runtime.host import AUTO_DEVICE, available_cores, choose_device, device_line, set_torch_threads
from store_schema.runtime.progress import default_mode
from store_schema.runtime.startup import preload
from store_schema.runtime.target_config import read_target_config
from store_schema.runtime.target_weights import check_target_weights
from store_schema.runtime.units import human_bytes

from .errors import ExtractError
from .extraction.config import DEFAULT_BATCH_SHARDS, DEFAULT_BATCH_TOKENS, JobConfig
from .extraction.estimate import add_arguments as add_estimate_arguments
from .extraction.estimate import cache_traffic, cache_traffic_lines, estimate_lines, extraction_estimate
from .extraction.layers import layers_from_drafters, parse_layer_ids, resolve_layer_ids, union_of
from .generate.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_GENERATE_BATCH_TOKENS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_REQUEST_RETRIES,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SHARD_RECORDS,
    ENGINES,
    REASONING,
    THINKING,
    GenerateConfig,
    GenerationSettings,
    ServerConfig,
)
from .jobs.settings import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_PROGRESS_INTERVAL,
    DEFAULT_WORKER_TIMEOUT,
    DEVICES,
)

# The job modules (planning, the drivers and their workers) are imported by the
# command that runs them: they pull numpy, transformers and torch, which `--help`
# and a usage error should not wait for.


def _add_plan_arguments(parser: argparse.ArgumentParser, run: bool = False) -> None:
    parser.add_argument("--model", required=True, help="local target model directory (config.json, tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer directory if not the model's")
    parser.add_argument("--corpus", required=True, help="JSONL / Parquet file, directory of them, or datasets dir")
    parser.add_argument("--store", help="store path the plan is for")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--layers", help="context layer ids, comma-separated (id L = output of decoder layer L)")
    layers.add_argument("--num-context-layers", type=int, help="use the default spread of N layers (default 5)")
    layers.add_argument("--layers-from", metavar="DIR[,DIR...]",
                        help="the union of the target layers these drafter directories read (dflash_config."
                             "target_layer_ids; published or exported): one store for several drafters")
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                        help="tokens per sample; longer records are truncated (default %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="tokens per shard, the unit of work and of a commit (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="the drafter's block size: a sample needs 2 x this many loss tokens (default %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help="seed of the samples' assignment to shards (default %(default)s)")
    parser.add_argument("--drop-long", action="store_true", help="quarantine records over --max-length (default: truncate)")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record")
    cores = available_cores()
    if run:
        parser.add_argument("--plan-workers", "--tokenizer-workers", dest="plan_workers", type=int, default=cores,
                            help="tokenizer processes for planning, as `plan --tokenizer-workers` (default: this "
                                 "machine's cores, %(default)s)")
    else:
        parser.add_argument("--tokenizer-workers", type=int, default=cores,
                            help="tokenizer processes (default: this machine's cores, %(default)s)")
        parser.add_argument("--workers", help=argparse.SUPPRESS)  # the old spelling, refused by `cmd_plan`
    parser.add_argument("--limit", type=int, help="plan only the first N records")
    parser.add_argument("--loss-mask", choices=tuple(LOSS_MASK_CONVENTIONS), default=DEFAULT_LOSS_MASK,
                        help="what the loss scores in each assistant turn: the whole turn as served (reasoning, "
                             "content, tool calls, end-of-turn token; default) or its content only")
    if not run:  # `run` sizes its free-space check with the store dtype's own ratio
        parser.add_argument("--compression-ratio", type=float, default=BFLOAT16_STORE.size_ratio,
                            help="compressed/raw of a bf16 store for the size estimate "
                                 f"(default %(default)s; fp8: {FP8_E4M3_STORE.size_ratio})")


DEVICE_HELP = "where workers run: auto is cuda when this host sees a GPU, else cpu (default %(default)s)"

# `extract plan --workers` meant tokenizer processes while `extract run --workers` means Ray actors.
RENAMED_WORKERS_NOTE = ("`extract plan --workers` is now --tokenizer-workers (tokenizer processes); "
                        "--workers is for `extract run` (Ray actors)")

# JobConfig fields `_job_config` fills from the planning flags for `plan` and `run` alike.
_PLAN_FIELDS = ("model", "corpus", "store", "tokenizer", "layers", "num_context_layers", "plan_settings", "strict",
                "progress")


def _job_config(args, **execution):
    """The JobConfig `plan` and `run` share (one planning for both), plus each one's own options."""
    try:
        layers = parse_layer_ids(args.layers) if args.layers else None
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.layers_from:
        layers = union_of(layers_from_drafters(args.layers_from))
    if not Path(args.corpus).exists():  # before any line of work is printed
        raise FileNotFoundError(f"corpus {args.corpus} does not exist")
    settings = PlanSettings(
        max_length=args.max_length,
        shard_tokens=args.shard_tokens,
        block_size=args.block_size,
        seed=args.seed,
        drop_long=args.drop_long,
        limit=args.limit,
        loss_mask=args.loss_mask,
    )
    return JobConfig(
        model=args.model,
        corpus=args.corpus,
        store=args.store,
        tokenizer=args.tokenizer,
        layers=layers,
        num_context_layers=args.num_context_layers,
        plan_settings=settings,
        strict=args.strict,
        **execution,
    )


def cmd_plan(args) -> int:
    preload("extract.extraction.job")  # torch, the tokenizer, the store's writer: what the job runs on
    from .extraction.job import plan_job  # job modules load here, not for --help (see the note above)
    from .extraction.planning import estimate_store_bytes, summarize

    if args.workers is not None:
        raise UsageError(RENAMED_WORKERS_NOTE)
    if not args.dry_run:
        raise UsageError(
            "`plan` only previews a job (--dry-run); the plan is written into the store by "
            "`python -m extract run`, which plans again with the same settings"
        )
    config = _job_config(args, plan_workers=args.tokenizer_workers, progress=default_mode(not args.json))
    dims = read_target_config(args.model)
    layer_ids = resolve_layer_ids(dims, config.layers, config.num_context_layers)
    plan = plan_job(config)
    summary = summarize(plan)
    estimate = estimate_store_bytes(plan, len(layer_ids), dims.hidden_size, args.compression_ratio)
    store_bytes = {"raw": estimate.raw_bytes, "bfloat16": estimate.compressed_bytes, "fp8_e4m3": estimate.fp8_bytes}
    job = extraction_estimate(args.model, layer_ids, plan.num_tokens, store_bytes, args.batch_tokens, args.gpu_memory,
                              args.tokens_per_s, args.gpus, args.gpu_tflops, args.store_dtype)
    if args.cache_size is not None:
        job["cache"] = cache_traffic(store_bytes, max(s.num_tokens for s in plan.shards), plan.num_tokens,
                                     args.cache_size, args.train_tokens_per_s)
    report = dict(
        summary.to_json(),
        job=job,
        layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        num_target_layers=dims.num_hidden_layers,
        hidden_size=dims.hidden_size,
        estimated_raw_bytes=estimate.raw_bytes,
        estimated_compressed_bytes=estimate.compressed_bytes,
        compression_ratio=args.compression_ratio,
        estimated_fp8_bytes=estimate.fp8_bytes,
        fp8_compression_ratio=FP8_E4M3_STORE.size_ratio,
        space_needed_bytes={"bfloat16": space_needed(estimate.compressed_bytes),
                            "fp8_e4m3": space_needed(estimate.fp8_bytes)},
        corpus_records=plan.settings["corpus_records"],
        corpus_hash=plan.settings["corpus_hash"],
        plan_digest=plan.digest(),
        store=args.store,
        dry_run=True,
    )
    if args.layers_from:
        report["layers_from"] = _sizes_per_drafter(args, plan, dims)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_plan(report, plan, config.plan_settings, args.corpus)
    return 0


def _sizes_per_drafter(args, plan, dims) -> dict:
    """`--layers-from`: each drafter's own layers and the store it alone would need, beside the union's."""
    from .extraction.planning import estimate_store_bytes  # with the job modules, as in cmd_plan

    sizes = {}
    for directory, ids in layers_from_drafters(args.layers_from).items():
        estimate = estimate_store_bytes(plan, len(ids), dims.hidden_size, args.compression_ratio)
        sizes[directory] = {"layer_ids": ids, "bfloat16": estimate.compressed_bytes, "fp8_e4m3": estimate.fp8_bytes}
    return sizes


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
    print(f"            {human_bytes(report['estimated_fp8_bytes'])} with --store-dtype fp8_e4m3 "
          f"(ratio {FP8_E4M3_STORE.size_ratio} of raw bf16)")
    for directory, own in report.get("layers_from", {}).items():
        print(f"  alone     {directory} {own['layer_ids']}: {human_bytes(own['bfloat16'])} bf16, "
              f"{human_bytes(own['fp8_e4m3'])} fp8 (the store above serves every --layers-from drafter)")
    print(f"free space  `run` asks for the size plus {SPACE_HEADROOM:.0%}: "
          f"{human_bytes(report['space_needed_bytes']['bfloat16'])} bf16, "
          f"{human_bytes(report['space_needed_bytes']['fp8_e4m3'])} fp8")
    for line in estimate_lines(report["job"]) + (cache_traffic_lines(report["job"]["cache"])
                                                  if "cache" in report["job"] else []):
        print(line)
    print("dry run: nothing written")


def quarantined_lines(quarantined, corpus_path, shown: int = 10) -> list[str]:
    """The first quarantined records, each where a person finds it (file and 1-based line or row)."""
    if not quarantined:
        return []
    from .corpus import open_corpus

    corpus = open_corpus(corpus_path)
    return [f"    {corpus.where(record.record_index)}: {record.reason} {record.detail}".rstrip()
            for record in quarantined[:shown]]


def cmd_run(args) -> int:
    check_target_weights(args.model, "--model")  # before Ray or torch: one line, not a worker's traceback
    preload("extract.extraction.job")  # torch, the tokenizer, the store's writer: what the job runs on
    from .extraction.job import run_job  # job modules load here, not for --help (see the note above)
    from .extraction.report import summary_line

    if not args.store:
        raise UsageError("run needs --store PATH")
    args.device, args.device_note = choose_device(args.device)
    execution = {f.name: getattr(args, f.name) for f in fields(JobConfig)  # the flags named as the fields
                 if f.name not in _PLAN_FIELDS and hasattr(args, f.name)}
    config = _job_config(args, **execution, progress=default_mode(not args.no_progress))
    warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
    try:
        report = run_job(config)  # Ray and the workers are shut down on the way out, Ctrl-C included
    except KeyboardInterrupt:
        return interrupted("the plan and committed shards are kept",
                           f"rerun the same command to resume ({args.store})")
    print(summary_line(report), file=sys.stderr)
    print(json.dumps(report, sort_keys=True))
    return 0


def _server_config(args):
    """`--engine openai`'s servers (None for hf), refusing a flag of the other engine."""
    engine = args.engine or ("openai" if args.endpoint else "hf")
    if engine == "hf":
        if args.endpoint:
            raise UsageError("--endpoint goes with --engine openai")
        return engine, None
    if not args.endpoint:
        raise UsageError("--engine openai needs --endpoint URL (one per server)")
    if args.reasoning is None and args.thinking == "keep":
        raise UsageError("--engine openai needs the thinking mode spelled out: --reasoning keep (thinking on) or "
                         f"--reasoning drop (off); a drafter is served in one of them ({sorted(REASONING)})")
    return engine, ServerConfig(endpoints=tuple(args.endpoint), concurrency=args.concurrency,
                                request_timeout=args.request_timeout, request_retries=args.request_retries,
                                served_model=args.served_model)


def cmd_generate(args) -> int:
    preload("extract.generate.job")  # torch, the tokenizer, the corpus writer: what the job runs on
    from .generate.job import plan_generate, run_generate
    from .generate.planning import plan_counts

    if not args.out and not args.dry_run:
        raise UsageError("generate needs --out CORPUS_DIR")
    args.device, why = choose_device(args.device)
    try:
        engine, server = _server_config(args)
        thinking = REASONING[args.reasoning] if args.reasoning else args.thinking
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                                      thinking=thinking, max_length=args.max_length,
                                      shard_records=args.shard_records, limit=args.limit, engine=ENGINES[engine])
        config = GenerateConfig(
            model=args.model, corpus=args.corpus, out=args.out, settings=settings, workers=args.workers,
            device=args.device, device_note=why, address=args.address, batch_tokens=args.batch_tokens,
            cpus_per_worker=args.cpus_per_worker, max_attempts=args.max_attempts, worker_timeout=args.worker_timeout,
            progress=default_mode(not args.no_progress), progress_interval=args.progress_interval, server=server,
            skip_space_check=args.skip_space_check,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    if engine == "hf" and not args.dry_run:
        check_target_weights(args.model, "--model")  # the servers hold the weights with --engine openai
    if args.dry_run:
        print(device_line(args.device, why), file=sys.stderr)
        _, plan = plan_generate(config)
        counts = plan_counts(plan)
        print(f"records     {counts['records']} ({counts['turns']} turns to generate) in {counts['shards']} shard(s)",
              file=sys.stderr)
        print(f"prompt      {counts['prompt_tokens']} tokens (first turns)", file=sys.stderr)
        print(f"quarantined {counts['quarantined']} {counts['quarantined_by_reason']}", file=sys.stderr)
        for line in quarantined_lines(plan.quarantined, config.corpus):
            print(line, file=sys.stderr)
        print("dry run: nothing written", file=sys.stderr)
        print(json.dumps(dict(counts, dry_run=True, out=args.out), sort_keys=True))
        return 0
    try:
        report = run_generate(config)
    except KeyboardInterrupt:
        return interrupted("the plan and committed shards are kept", f"rerun the same command to resume ({args.out})")
    print(f"generated {report['records']} record(s) ({report['generated_tokens']} tokens, "
          f"{report['truncated_records']} truncated), {report['quarantined']} quarantined; "
          f"{report['generated_tokens_per_s']:.0f} generated tokens/s on {report['workers']} worker(s)", file=sys.stderr)
    print(json.dumps(report, sort_keys=True))
    return 0


def _add_generate_parser(commands) -> None:
    gen = commands.add_parser("generate", help="regenerate every assistant turn with the target (resumes)")
    gen.add_argument("--model", required=True, help="local target model directory (config.json, tokenizer)")
    gen.add_argument("--corpus", required=True,
                     help="chat corpus: JSONL / Parquet file, directory of them, datasets dir")
    gen.add_argument("--out", help="generated corpus directory (Parquet shards + manifest.json)")
    gen.add_argument("--workers", type=int, default=1,
                     help="generate workers, one per GPU with --device cuda (default %(default)s)")
    gen.add_argument("--device", choices=(AUTO_DEVICE, *DEVICES), default=AUTO_DEVICE, help=DEVICE_HELP)
    gen.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                     help="tokens per reply; a reply that reaches it is kept and flagged truncated (default "
                          "%(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default %(default)g)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed, temperature > 0 (default %(default)s)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--thinking", choices=THINKING, default="keep",
                      help="enable_thinking on / off for the chat template; keep: the template's default "
                           "(default %(default)s)")
    mode.add_argument("--reasoning", choices=tuple(REASONING),
                      help="thinking mode, spelled out (required with --engine openai): keep = enable_thinking on "
                           "(the replies reason), drop = off; serve the drafter in the same mode")
    gen.add_argument("--engine", choices=tuple(ENGINES),
                     help="hf: transformers' generate on Ray workers (default without --endpoint); openai: ask "
                          "OpenAI-compatible servers of the target (vLLM, SGLang) at --endpoint")
    gen.add_argument("--endpoint", action="append", metavar="URL",
                     help="an OpenAI-compatible server of --model (http://host:8000); repeat for several")
    gen.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                     help="requests in flight per endpoint (default %(default)s; about the server's max-num-seqs)")
    gen.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                     help="seconds one reply may take, the server's queue included (default %(default)g)")
    gen.add_argument("--request-retries", type=int, default=DEFAULT_REQUEST_RETRIES,
                     help="tries after a timeout or HTTP error before the record is quarantined (default %(default)s)")
    gen.add_argument("--served-model", help="the name the servers give --model, when it is an alias")
    gen.add_argument("--batch-tokens", type=int, default=DEFAULT_GENERATE_BATCH_TOKENS,
                     help="(prompt + max new tokens) x rows per generate batch (default %(default)s)")
    gen.add_argument("--limit", type=int, help="generate only the first N records")
    gen.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                     help="prompt + reply tokens of a turn; a first prompt that fills it is quarantined "
                          "(default %(default)s)")
    gen.add_argument("--shard-records", type=int, default=DEFAULT_SHARD_RECORDS,
                     help="records per output shard (default %(default)s)")
    gen.add_argument("--address", help="join a running Ray cluster (default: start a local one, or $RAY_ADDRESS)")
    gen.add_argument("--dry-run", action="store_true", help="print records, prompt tokens, quarantine; write nothing")
    gen.add_argument("--cpus-per-worker", type=int, default=1,
                     help="Ray CPUs per worker, = torch threads on cpu (default %(default)s)")
    gen.add_argument("--max-attempts", type=int, default=DEFAULT_MAX_ATTEMPTS,
                     help="tries per shard (default %(default)s)")
    gen.add_argument("--worker-timeout", type=float, default=DEFAULT_WORKER_TIMEOUT,
                     help="seconds a worker holding shards may stay silent before it is presumed lost "
                          "(default %(default)g)")
    gen.add_argument("--progress-interval", type=float, default=DEFAULT_PROGRESS_INTERVAL,
                     help="seconds between progress lines when stderr is not a terminal (default %(default)g)")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    _add_space_flag(gen)
    gen.set_defaults(handler=cmd_generate)


def _add_space_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(SKIP_SPACE_CHECK_FLAG, action="store_true",
                        help="start even when the plan's size estimate exceeds the output filesystem's free space")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m extract", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="tokenize the corpus and preview the job plan")
    _add_plan_arguments(plan)
    plan.add_argument("--dry-run", action="store_true", help="print counts and the size estimate, write nothing")
    plan.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    add_estimate_arguments(plan)
    plan.set_defaults(handler=cmd_plan)

    run = commands.add_parser("run", help="extract hidden states into a store on Ray workers (resumes)")
    _add_plan_arguments(run, run=True)
    run.set_defaults(json=False)
    run.add_argument("--workers", type=int, default=1,
                     help="extraction workers, one per GPU with --device cuda (default %(default)s)")
    run.add_argument("--device", choices=(AUTO_DEVICE, *DEVICES), default=AUTO_DEVICE, help=DEVICE_HELP)
    run.add_argument("--address", help="join a running Ray cluster (default: start a local one, or $RAY_ADDRESS)")
    run.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                     help="padded tokens per forward batch (default %(default)s)")
    run.add_argument("--target-topk", type=int, help="also store the target's top-K next-token ids and log-probs")
    run.add_argument("--store-dtype", choices=tuple(STORE_DTYPES), default="bfloat16",
                     help="hidden states as bf16 (lossless, default) or fp8 e4m3 with a scale per token "
                          "(about 0.6x the bytes of bf16, lossy; a store never mixes them)")
    run.add_argument("--overwrite", action="store_true", help="delete the store's content and start over")
    run.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code (off)")
    run.add_argument("--max-attempts", type=int, default=DEFAULT_MAX_ATTEMPTS,
                     help="tries per shard when workers die (default %(default)s)")
    run.add_argument("--batch-shards", type=int, default=DEFAULT_BATCH_SHARDS,
                     help="consecutive shards batched together by length on one worker (default %(default)s; "
                          "more: less padding, more host memory)")
    run.add_argument("--worker-timeout", type=float, default=DEFAULT_WORKER_TIMEOUT,
                     help="seconds a worker holding shards may stay silent before it is presumed lost and its "
                          "shards are revoked and redone elsewhere (default %(default)g)")
    run.add_argument("--cpus-per-worker", type=int, default=1,
                     help="Ray CPUs per worker, = torch threads with --device cpu (default %(default)s)")
    run.add_argument("--require-fast-kernels", action="store_true",
                     help="refuse CUDA workers that would run the PyTorch fallback for linear attention / "
                          "causal conv1d (fla, causal-conv1d not installed)")
    run.add_argument("--progress-interval", type=float, default=DEFAULT_PROGRESS_INTERVAL,
                     help="seconds between progress lines when stderr is not a terminal (default %(default)g)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    run.add_argument("--spool-dir", help="a store on object storage (--store s3://bucket/prefix): the local directory "
                                         "on each worker's node where shards are built before their upload "
                                         "(default: the system's temporary directory)")
    run.add_argument("--spool-size", type=size_argument, metavar="SIZE",
                     help="the most the shards being built and uploaded may take in --spool-dir, per node "
                          "(e.g. 20GB; default: its free space); a full spool waits for uploads to free it")
    _add_space_flag(run)
    run.set_defaults(handler=cmd_run)
    _add_generate_parser(commands)
    show_defaults(parser)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("run", "generate"):  # the driver tokenizes; its workers set their own threads
        set_torch_threads()
    return run_command(args.handler, args, refusals=(ExtractError, StoreError))


if __name__ == "__main__":
    sys.exit(main())
