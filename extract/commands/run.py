"""`extract run`: plan, then extract hidden states into the store on Ray workers (resumes)."""

from __future__ import annotations

import json
import sys
import warnings

from store_schema.runtime.cli import UsageError, interrupted

from ..extraction.job import run_job
from ..extraction.report import summary_line
from .planning import execution, job_config


def run(args) -> int:
    if not args.store:
        raise UsageError("run needs --store PATH")
    config = job_config(
        args,
        plan_workers=args.plan_workers,
        execution=execution(args),
        batch_tokens=args.batch_tokens,
        target_topk=args.target_topk,
        store_dtype=args.store_dtype,
        overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code,
        batch_shards=args.batch_shards,
        require_fast_kernels=args.require_fast_kernels,
        linear_attention=args.linear_attention,
        spool_dir=args.spool_dir,
        spool_size=args.spool_size,
        project_energy=args.project_energy,
        project_rank=args.project_rank,
        project_fit_tokens=args.project_fit_tokens,
    )
    warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
    try:
        report = run_job(config)  # Ray and the workers are shut down on the way out, Ctrl-C included
    except KeyboardInterrupt:
        return interrupted("the plan and committed shards are kept", f"rerun the same command to resume ({args.store})")
    print(summary_line(report), file=sys.stderr)
    print(json.dumps(report, sort_keys=True))
    return 0
