"""The generate job's driver: corpus -> plan -> Ray workers -> committed Parquet shards -> report.

    report = run_generate(GenerateConfig(model=..., corpus=..., out=..., workers=8, device="cuda"))

The same rules as `extract run` (`extract.job`), through the same parts:

1. Take ``OUT/.lock`` (`store_schema.StoreLock`: a second live job is refused) and
   remove a dead job's ``.staging/`` leftovers. A job refused before it wrote
   anything leaves nothing behind.
2. An output holding a manifest is resumed with the plan it records if the target,
   tokenizer, source corpus bytes and settings are the ones it was made with; any
   other is refused naming each field that differs. A new output is planned
   (`planning.plan_generation`) and its manifest written before any shard.
3. Pending shards go to `GenerationWorker` actors through extraction's
   `ActorPool` and `Dispatcher`: numbered attempts (`store_schema.lock.ShardFence`),
   lost workers' shards revoked and redone elsewhere, ``max_attempts`` tries.
4. Every planned shard must be committed; the JSON report is returned."""

from __future__ import annotations

import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from ..dispatch import ActorPool
from ..errors import ExtractError
from store_schema.runtime.progress import Progress
from .config import GenerateConfig


class GenerationPool(ActorPool):
    """The generate actors: one `GenerationWorker` each, or with `--engine openai`
    (`served`: the checked endpoints) one `OpenAIGenerationWorker`, holding enough
    shards to keep every endpoint's ``concurrency`` requests in flight."""

    def __init__(self, config: GenerateConfig, plan, served=None):
        args = (str(Path(config.model).resolve()), str(Path(config.corpus).resolve()), str(Path(config.out).resolve()),
                plan.settings)
        if config.server is None:
            from .worker import GenerationWorker

            kwargs = dict(device=config.device, batch_tokens=config.batch_tokens,
                          torch_threads=config.cpus_per_worker if config.device == "cpu" else None)
            super().__init__(config, GenerationWorker, args, kwargs, task="generate_group")
            return
        from dataclasses import asdict

        from .openai_worker import OpenAIGenerationWorker

        server = config.server
        concurrency = -(-server.concurrency // config.workers)  # --concurrency per endpoint, over the actors
        kwargs = dict(served=[asdict(s) for s in served], concurrency=concurrency,
                      request_timeout=server.request_timeout, request_retries=server.request_retries)
        in_flight = len(served) * concurrency
        shards = 2 + 2 * -(-in_flight // config.settings.shard_records)  # a slow shard's tail leaves room
        super().__init__(config, OpenAIGenerationWorker, args, kwargs, task="generate_group", groups_in_flight=shards)


def plan_generate(config: GenerateConfig, log=None, served=None):
    """The job's generation identity and a fresh plan (what --dry-run previews)."""
    from transformers import AutoTokenizer

    from store_schema.runtime.target_config import read_config_json

    from ..corpus import open_corpus
    from .planning import generation_identity, plan_generation

    read_config_json(config.model)  # a model directory, before anything else
    if not Path(config.corpus).exists():
        raise FileNotFoundError(f"corpus {config.corpus} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    identity = generation_identity(config.model, tokenizer, open_corpus(config.corpus), config.settings, served)
    def progress(records: int) -> Progress:
        return Progress("planning", records, "record", mode=config.progress, interval=config.progress_interval, log=log)

    return identity, plan_generation(config.corpus, tokenizer, config.settings, identity, progress)


def run_generate(config: GenerateConfig, log=None) -> dict:
    """Run (or resume) one generate job; returns the report. Raises `ExtractError`
    (and `store_schema.StoreLockedError`, `ValueError`, `FileNotFoundError`) with a
    message meant for the user."""
    from ..generated_corpus import is_generated_corpus
    from ..output import output_locked, refuse_foreign_output

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    started = time.perf_counter()
    out = Path(config.out)
    refusal = "is a non-empty directory that is not a generated corpus; refusing to write into it -- choose a new --out"
    refuse_foreign_output(out, is_generated_corpus, refusal)
    served = check_endpoints(config) if config.server is not None else None
    with output_locked(out):
        return _run_locked(config, out, started, log, served)


def check_endpoints(config: GenerateConfig):
    """`--engine openai`: every endpoint answers and serves --model (`server.check_servers`)."""
    from transformers import AutoTokenizer

    from .server import check_servers

    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    return check_servers(config.server.endpoints, config.model, tokenizer, config.settings.thinking,
                         config.settings.max_length, config.server.served_model)


def _run_locked(config: GenerateConfig, out: Path, started: float, log, served=None) -> dict:
    from store_schema import layout
    from store_schema.lock import ShardFence
    from store_schema.writer import remove_staging

    from ..dispatch import Dispatcher, started_workers
    from ..generated_corpus import shard_record, write_manifest
    from .planning import plan_counts

    leftovers = remove_staging(out)
    if leftovers:
        log(f"removed {len(leftovers)} uncommitted leftover(s) of a previous job from .staging/")
    plan, reused = _plan_or_resume(config, out, log, served)
    pending = [s.name for s in plan.shards if not layout.is_committed(out, s.name)]
    if not reused:
        write_manifest(out, plan.settings, [s.name for s in plan.shards], plan.to_json())
    elif pending and len(pending) < len(plan.shards):
        log(f"resuming: {len(plan.shards) - len(pending)} of {len(plan.shards)} shard(s) already committed, "
            f"{len(pending)} to go")
    run = uuid.uuid4().hex[:8]
    counts, seconds, workers = None, 0.0, []
    journaled = 0
    if served is not None:
        from .replies import journaled_replies

        journaled = journaled_replies(out, pending)
    if pending:
        sizes = {s.name: len(s.samples) for s in plan.shards}
        progress = Progress("generate", plan.num_samples, "record", mode=config.progress,
                            interval=config.progress_interval, log=log,
                            initial=plan.num_samples - sum(sizes[name] for name in pending))
        with ExitStack() as stack:
            count = min(config.workers, len(pending))
            pool = stack.enter_context(started_workers(config, lambda: GenerationPool(config, plan, served), count))
            fence = ShardFence(out, run).open()
            stack.callback(fence.close)
            dispatcher = Dispatcher(pool, plan, pending, out, fence, max_attempts=config.max_attempts, batch_shards=1,
                                    worker_timeout=config.worker_timeout, progress=progress, log=log,
                                    kill_driver_after_shards=config.faults.kill_driver_after_shards)
            begun = time.perf_counter()
            counts = dispatcher.run()
            seconds, workers = time.perf_counter() - begun, pool.infos
    remove_staging(out)
    missing = [s.name for s in plan.shards if not layout.is_committed(out, s.name)]
    if missing:
        raise ExtractError(f"{len(missing)} planned shard(s) are not committed after the run "
                           f"({', '.join(missing[:5])}); rerun the same command to finish them")
    records = {s.name: shard_record(out, s.name) for s in plan.shards}
    generated_now = sum(records[name]["generated_tokens"] for name in pending)
    served_counts = {}
    if served is not None:
        from .replies import remove_journal
        from .served_report import served_report

        remove_journal(out)  # every shard is committed: no reply is asked for again
        served_counts = served_report(plan_counts(plan), records.values(), served, journaled, log)
    return dict(
        plan_counts(plan),
        **served_counts,
        status="complete" if pending else "nothing_to_do",
        run=run,
        out=str(out.resolve()),
        plan_reused=reused,
        shards_written=counts.shards_written if counts else 0,
        shards_skipped=len(plan.shards) - len(pending),
        shards_retried=counts.shards_retried if counts else 0,
        worker_deaths=counts.worker_deaths if counts else 0,
        generated_tokens=sum(r["generated_tokens"] for r in records.values()),
        generated_tokens_this_run=generated_now,
        truncated_records=sum(r.get("truncated_records", 0) for r in records.values()),
        generated_tokens_per_s=round(generated_now / seconds, 2) if seconds else 0.0,
        padded_tokens=counts.padded_tokens if counts else 0,
        workers=len(workers),
        device=config.device,
        devices=sorted({w.device for w in workers}),
        generate_seconds=round(seconds, 3),
        wall_seconds=round(time.perf_counter() - started, 3),
        leftovers_cleaned=len(leftovers),
    )


def _plan_or_resume(config: GenerateConfig, out: Path, log, served=None):
    """(plan, reused): the manifest's plan when this job is the one that made it,
    else a fresh plan; an output made otherwise is refused naming what differs."""
    from store_schema.fingerprint import describe_differences, mapping_differences
    from store_schema.plan import Plan

    from ..generated_corpus import is_generated_corpus, read_manifest
    from .planning import RERUN_TOLERATES

    if is_generated_corpus(out):
        from transformers import AutoTokenizer

        from ..corpus import open_corpus
        from .planning import generation_identity

        manifest = read_manifest(out)
        tokenizer = AutoTokenizer.from_pretrained(str(config.model))
        identity = generation_identity(config.model, tokenizer, open_corpus(config.corpus), config.settings, served)
        differences = mapping_differences(manifest["generation"], identity, RERUN_TOLERATES)
        if differences:
            raise ExtractError(f"{out} was generated with a different target, corpus or settings: "
                               f"{describe_differences(differences, 'corpus')} -- use a new --out")
        plan = Plan.from_json(manifest["plan"])
        log(f"reusing the output's plan ({plan.num_samples} records in {len(plan.shards)} shards)")
        return plan, True
    _, plan = plan_generate(config, log, served)
    if not plan.shards:
        reasons = sorted({q.reason for q in plan.quarantined})
        raise ExtractError(f"the corpus gives no records to generate ({len(plan.quarantined)} quarantined: "
                           f"{reasons}); nothing written")
    return plan, False
