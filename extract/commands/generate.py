"""`extract generate`: the target regenerates every assistant turn of a corpus (resumes)."""

from __future__ import annotations

import json
import sys

from store_schema.runtime.cli import UsageError, interrupted
from store_schema.runtime.host import device_line

from ..generate.config import ENGINES, REASONING, GenerateConfig, GenerationSettings, ServerConfig
from ..generate.job import plan_generate, run_generate
from ..generate.planning import plan_counts
from .planning import execution, quarantined_lines


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
        raise UsageError(
            "--engine openai needs the thinking mode spelled out: --reasoning keep (thinking on) or "
            f"--reasoning drop (off); a drafter is served in one of them ({sorted(REASONING)})"
        )
    return engine, ServerConfig(
        endpoints=tuple(args.endpoint),
        concurrency=args.concurrency,
        request_timeout=args.request_timeout,
        request_retries=args.request_retries,
        served_model=args.served_model,
    )


def run(args) -> int:
    if not args.out and not args.dry_run:
        raise UsageError("generate needs --out CORPUS_DIR")
    try:
        engine, server = _server_config(args)
        thinking = REASONING[args.reasoning] if args.reasoning else args.thinking
        settings = GenerationSettings(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            thinking=thinking,
            max_length=args.max_length,
            shard_records=args.shard_records,
            limit=args.limit,
            engine=ENGINES[engine],
        )
        config = GenerateConfig(
            model=args.model,
            corpus=args.corpus,
            out=args.out,
            settings=settings,
            execution=execution(args),
            batch_tokens=args.batch_tokens,
            server=server,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.dry_run:
        print(device_line(config.execution.device, config.execution.device_note), file=sys.stderr)
        _, plan = plan_generate(config)
        counts = plan_counts(plan)
        print(
            f"records     {counts['records']} ({counts['turns']} turns to generate) in {counts['shards']} shard(s)",
            file=sys.stderr,
        )
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
    print(
        f"generated {report['records']} record(s) ({report['generated_tokens']} tokens, "
        f"{report['truncated_records']} truncated), {report['quarantined']} quarantined; "
        f"{report['generated_tokens_per_s']:.0f} generated tokens/s on {report['workers']} worker(s)",
        file=sys.stderr,
    )
    print(json.dumps(report, sort_keys=True))
    return 0
