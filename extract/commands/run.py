"""`extract run`: plan, then extract hidden states into the store on Ray workers (resumes)."""

from __future__ import annotations

import json
import sys
import warnings

from store_schema.runtime.cli import UsageError, interrupted
from store_schema.runtime.host import choose_device
from store_schema.runtime.progress import default_mode

from ..extraction.job import run_job
from ..extraction.report import summary_line
from .planning import job_config


def run(args) -> int:
    if not args.store:
        raise UsageError("run needs --store PATH")
    device, device_note = choose_device(args.device)
    config = job_config(
        args, plan_workers=args.plan_workers, workers=args.workers, device=device, device_note=device_note,
        address=args.address, batch_tokens=args.batch_tokens, target_topk=args.target_topk,
        store_dtype=args.store_dtype, overwrite=args.overwrite, trust_remote_code=args.trust_remote_code,
        max_attempts=args.max_attempts, batch_shards=args.batch_shards, worker_timeout=args.worker_timeout,
        cpus_per_worker=args.cpus_per_worker, require_fast_kernels=args.require_fast_kernels,
        skip_space_check=args.skip_space_check, spool_dir=args.spool_dir, spool_size=args.spool_size,
        progress=default_mode(not args.no_progress), progress_interval=args.progress_interval,
    )
    warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
    try:
        report = run_job(config)  # Ray and the workers are shut down on the way out, Ctrl-C included
    except KeyboardInterrupt:
        return interrupted("the plan and committed shards are kept",
                           f"rerun the same command to resume ({args.store})")
    print(summary_line(report), file=sys.stderr)
    print(json.dumps(report, sort_keys=True))
    return 0
