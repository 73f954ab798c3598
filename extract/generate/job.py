"""The generate job's driver: corpus -> plan -> Ray workers -> committed Parquet shards -> report.

    report = run_generate(GenerateConfig(model=..., corpus=..., out=..., workers=8, device="cuda"))

The same rules as `extract run` (`extract.extraction.job`), through the same parts:

1. Take ``OUT/.lock`` (`store_schema.StoreLock`: a second live job is refused) and
   remove a dead job's ``.staging/`` leftovers. A job refused before it wrote
   anything leaves nothing behind.
2. An output holding a manifest is resumed with the plan it records if the target,
   tokenizer, source corpus bytes and settings are the ones it was made with; any
   other is refused naming each field that differs. A new output is planned
   (`planning.plan_generation`) and its manifest written before any shard.
3. The rest is the one sharded-job driver (`extract.jobs.driver.run_sharded`) with
   `GenerationWorker` actors built from a `GenerationSpec` (or, with ``--engine
   openai``, `OpenAIGenerationWorker` actors asking the checked endpoints, built
   from an `OpenAIGenerationSpec`): free space, numbered
   attempts (`store_schema.commit.lock.ShardFence`), lost workers' shards revoked and redone
   elsewhere, ``max_attempts`` tries; every planned shard must be committed; the
   JSON report is returned."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer

from store_schema import layout
from store_schema.directory.backend import DirectoryBackend
from store_schema.fingerprint import describe_differences, mapping_differences
from store_schema.plan import Plan
from store_schema.runtime.progress import Progress
from store_schema.runtime.target_config import read_config_json
from store_schema.runtime.target_weights import check_target_weights

from ..corpus import open_corpus, require_corpus
from ..errors import ExtractError
from ..generated_corpus import is_generated_corpus, read_manifest, shard_record, write_manifest
from ..jobs.driver import Planned, ShardedJob, run_sharded
from ..jobs.output import log_to_stderr, output_locked, ready_to_start
from .config import GenerateConfig, GenerationSettings, ServerConfig
from .openai_worker import OpenAIGenerationSpec
from .planning import RERUN_TOLERATES, generation_identity, plan_counts, plan_generation
from .replies import journaled_replies, remove_journal
from .served_report import served_report
from .server import check_servers
from .worker import GenerationSpec

# A rough upper bound on a generated corpus's bytes per token (UTF-8 text in Parquet),
# for the free-space check: generous, since a reply may use its whole --max-new-tokens.
BYTES_PER_TOKEN = 4


def plan_generate(config: GenerateConfig, log=None, served=None):
    """The job's generation identity and a fresh plan (what --dry-run previews)."""
    read_config_json(config.model)  # a model directory, before anything else
    require_corpus(config.corpus)
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    identity = generation_identity(config.model, tokenizer, open_corpus(config.corpus), config.settings, served)

    def progress(records: int) -> Progress:
        return Progress(
            "planning",
            records,
            "record",
            mode=config.execution.progress,
            interval=config.execution.progress_interval,
            log=log,
        )

    return identity, plan_generation(config.corpus, tokenizer, config.settings, identity, progress)


def run_generate(config: GenerateConfig, log=None) -> dict:
    """Run (or resume) one generate job; returns the report. Raises `ExtractError`
    (and `store_schema.StoreLockedError`, `ValueError`, `FileNotFoundError`) with a
    message meant for the user."""
    log = log or log_to_stderr
    started = time.perf_counter()
    if config.out is None:
        raise ValueError("generate needs --out (only --dry-run goes without)")
    out = DirectoryBackend(Path(config.out))  # a generated corpus is always a directory
    read_config_json(config.model)  # a model directory
    if config.server is None:  # the hf engine loads the target; the openai one asks servers that hold it
        check_target_weights(config.model, "--model")
    refusal = "is a non-empty directory that is not a generated corpus; refusing to write into it -- choose a new --out"
    ready_to_start(config, out, is_generated_corpus, refusal)
    served = check_endpoints(config, config.server) if config.server is not None else None
    with output_locked(out):
        job = Generation(config, out, served)
        run = run_sharded(job, log)
        return _report(config, out.location, run, time.perf_counter() - started, served, job.journaled, log)


def check_endpoints(config: GenerateConfig, server: ServerConfig):
    """`--engine openai`: every endpoint answers and serves --model (`server.check_servers`)."""
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    return check_servers(
        server.endpoints,
        config.model,
        tokenizer,
        config.settings.thinking,
        config.settings.max_length,
        server.served_model,
    )


class Generation(ShardedJob):
    """`extract generate` as a sharded job."""

    def __init__(self, config: GenerateConfig, out: DirectoryBackend, served=None):
        execution = config.execution
        super().__init__(
            out,
            execution.placement(),
            execution.dispatch(),
            execution.progress_settings("generate", "record"),
            skip_space_check=execution.skip_space_check,
        )
        self.config = config
        self.out_dir = out.location  # a directory: a generated corpus is never in a bucket
        self.served = served  # the checked endpoints (`server.ServedModel`), --engine openai
        self.journaled = 0  # replies a previous run finished and journaled, asked for no more

    def plan(self, log) -> Planned:
        planned = plan_and_resume(self.config, self.out_dir, log, self.served)
        plan = planned.plan
        if not planned.reused:
            write_manifest(self.out_dir, plan.settings, [s.name for s in plan.shards], plan.to_json())
        if self.served is not None:
            self.journaled = journaled_replies(self.out_dir, planned.pending)
        return planned

    def worker_spec(self, plan):
        config = self.config
        if self.served is not None:
            return self._openai_spec(plan)
        return GenerationSpec(
            model=str(Path(config.model).resolve()),
            corpus=str(Path(config.corpus).resolve()),
            out=self.output.address,
            settings=GenerationSettings.from_json(plan.settings),
            device=config.execution.device,
            batch_tokens=config.batch_tokens,
            torch_threads=config.execution.torch_threads(),
        )

    def _openai_spec(self, plan):
        """Each actor's share of --concurrency per endpoint, and enough shards held to keep
        every endpoint's requests in flight (a slow shard's tail leaves room)."""
        config, server = self.config, self.config.server
        concurrency = -(-server.concurrency // config.execution.workers)
        in_flight = len(self.served) * concurrency
        return OpenAIGenerationSpec(
            model=str(Path(config.model).resolve()),
            corpus=str(Path(config.corpus).resolve()),
            out=self.output.address,
            settings=GenerationSettings.from_json(plan.settings),
            served=tuple(asdict(s) for s in self.served),
            concurrency=concurrency,
            request_timeout=server.request_timeout,
            request_retries=server.request_retries,
            groups_in_flight=2 + 2 * -(-in_flight // config.settings.shard_records),
        )

    def bytes_needed(self, planned: Planned) -> int:
        """Prompts plus every turn's reply at its full --max-new-tokens, `BYTES_PER_TOKEN` each."""
        pending = set(planned.pending)
        samples = [s for shard in planned.plan.shards if shard.name in pending for s in shard.samples]
        tokens = sum(s.num_tokens + s.num_loss_tokens * self.config.settings.max_new_tokens for s in samples)
        return tokens * BYTES_PER_TOKEN


def _report(config: GenerateConfig, out: Path, run, wall: float, served=None, journaled: int = 0, log=print) -> dict:
    plan, pending, counts = run.planned.plan, run.planned.pending, run.counts
    records = {s.name: shard_record(out, s.name) for s in plan.shards}
    generated_now = sum(records[name]["generated_tokens"] for name in pending)
    seconds = run.dispatch_seconds
    served_counts = {}
    if served is not None:
        remove_journal(out)  # every shard is committed: no reply is asked for again
        served_counts = served_report(plan_counts(plan), records.values(), served, journaled, log)
    return dict(
        plan_counts(plan),
        **served_counts,
        status="complete" if pending else "nothing_to_do",
        run=run.run,
        out=str(out.resolve()),
        plan_reused=run.planned.reused,
        shards_written=counts.shards_written,
        shards_skipped=run.planned.skipped,
        shards_retried=counts.shards_retried,
        worker_deaths=counts.worker_deaths,
        generated_tokens=sum(r["generated_tokens"] for r in records.values()),
        generated_tokens_this_run=generated_now,
        truncated_records=sum(r.get("truncated_records", 0) for r in records.values()),
        generated_tokens_per_s=round(generated_now / seconds, 2) if seconds else 0.0,
        padded_tokens=counts.padded_tokens,
        workers=len(run.workers),
        device=config.execution.device,
        devices=sorted({w.device for w in run.workers}),
        generate_seconds=round(seconds, 3),
        wall_seconds=round(wall, 3),
        leftovers_cleaned=run.leftovers,
    )


def plan_and_resume(config: GenerateConfig, out: Path, log, served=None) -> Planned:
    """The manifest's plan when this job is the one that made it, else a fresh plan,
    and the shards left; an output made otherwise is refused naming what differs."""
    if is_generated_corpus(out):
        manifest = read_manifest(out)
        tokenizer = AutoTokenizer.from_pretrained(str(config.model))
        identity = generation_identity(config.model, tokenizer, open_corpus(config.corpus), config.settings, served)
        differences = mapping_differences(manifest["generation"], identity, RERUN_TOLERATES)
        if differences:
            raise ExtractError(
                f"{out} was generated with a different target, corpus or settings: "
                f"{describe_differences(differences, 'corpus')} -- use a new --out"
            )
        plan = Plan.from_json(manifest["plan"])
        log(f"reusing the output's plan ({plan.num_samples} records in {len(plan.shards)} shards)")
        return Planned(plan, True, [s.name for s in plan.shards if not layout.is_committed(out, s.name)])
    _, plan = plan_generate(config, log, served)
    if not plan.shards:
        reasons = sorted({q.reason for q in plan.quarantined})
        raise ExtractError(
            f"the corpus gives no records to generate ({len(plan.quarantined)} quarantined: {reasons}); nothing written"
        )
    return Planned(plan, False, [s.name for s in plan.shards])
