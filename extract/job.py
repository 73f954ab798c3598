"""The extraction job: corpus -> plan -> Ray workers -> committed shards -> report.

    report = run_job(JobConfig(model=..., corpus=..., store=..., workers=8, device="cuda"))

What the driver does, in order (all of it under the store's lock):

1. Take ``STORE/.lock`` (flock; a second live job is refused, a dead job's lock is
   released by the kernel) and remove the ``.staging/`` leftovers of a dead job.
2. Plan the corpus (`extract.planning.build_plan`). A store that already holds a
   plan must hold this one (same corpus content, tokenizer and settings), else the
   job is refused unless ``overwrite``.
3. Start the workers: ``ray.init()`` locally (dashboard off) or join
   ``address``; one `ExtractionWorker` actor per GPU
   (``num_gpus=1``) or, with ``device="cpu"``, per CPU slot (``num_cpus=1`` and one
   torch thread). Each loads the target once and reports its kernels.
4. Create the store with the fingerprint (or check the existing one's), write the
   plan, and hand the uncommitted shards out as a queue: every worker holds at most
   ``inflight_per_worker`` shards, and gets the next one when one finishes, so fast
   workers take more. Committed shards are never handed out again.
5. A worker whose process dies (`RayActorError`) has its shards put back at the
   front of the queue and is replaced by a fresh actor; a shard gets at most
   ``max_attempts`` tries, then the job stops naming it. Any other failure a worker
   reports (disk full, corpus changed since planning, device out of memory) stops
   the job at once with a clear message; committed shards stay valid and the same
   command resumes.
6. Write the JSON report into the store (``reports/extract.json``) and return it.

Why Ray core actors, not Ray Data: the unit of work is a whole shard that one
writer commits atomically, the worker must keep the model and a store writer for
its lifetime, and retries must be per shard and counted. An actor pool with a
driver-side queue gives exactly that in ~100 lines; Ray Data's ``map_batches``
would re-batch rows across shard boundaries and move the hidden states through
the object store to a separate write stage -- terabytes we never want to move.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from .planning import DEFAULT_BLOCK_SIZE, DEFAULT_SEED, DEFAULT_SHARD_TOKENS
from .tokenization import DEFAULT_MAX_LENGTH

DEFAULT_BATCH_TOKENS = 16384
DEFAULT_MAX_ATTEMPTS = 4
# Fault injection (tests and the fault suite): real SIGKILLs at chosen points.
KILL_ENV = "DFLASH_EXTRACT_KILL_AFTER_BATCHES"  # see JobConfig.kill_after_batches
KILL_DRIVER_ENV = "DFLASH_EXTRACT_KILL_DRIVER_AFTER_SHARDS"  # see JobConfig.kill_driver_after_shards


class ExtractError(RuntimeError):
    """The job cannot go on; the message says why and what to do."""


@dataclass
class JobConfig:
    model: str
    corpus: str
    store: str | None  # None only for `plan --dry-run`, which writes nothing
    tokenizer: str | None = None
    layers: list[int] | None = None
    num_context_layers: int | None = None
    max_length: int = DEFAULT_MAX_LENGTH
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = DEFAULT_SEED
    drop_long: bool = False
    strict: bool = False
    limit: int | None = None
    plan_workers: int = 1  # tokenizer processes for the planning pass
    workers: int = 1  # extraction actors
    device: str = "cpu"
    address: str | None = None  # join a running Ray cluster; None: start a local one
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    target_topk: int | None = None
    overwrite: bool = False
    trust_remote_code: bool = False
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # per shard, counting the first
    inflight_per_worker: int = 2  # 2: one shard computing while the previous one is written
    cpus_per_worker: int = 1  # Ray num_cpus per actor; torch threads for --device cpu
    progress: bool = False
    # Fault injection (tests, the fault suite): the i-th actor created dies (SIGKILL)
    # after kill_after_batches[i] batches; later actors live. Also read from
    # $DFLASH_EXTRACT_KILL_AFTER_BATCHES ("3,7,...") when empty.
    kill_after_batches: tuple[int, ...] = field(default_factory=tuple)
    # The driver SIGKILLs itself once this many shards were committed in this run
    # (a driver death at a reproducible point). Also $DFLASH_EXTRACT_KILL_DRIVER_AFTER_SHARDS.
    kill_driver_after_shards: int | None = None


# --------------------------------------------------------------------------- fingerprint


def build_fingerprint(config: JobConfig, plan, layer_ids: list[int], info: dict):
    from store_schema import Fingerprint, package_versions, target_identity

    settings = plan.settings
    return Fingerprint(
        **target_identity(config.model),
        num_target_layers=int(info["num_layers"]),
        hidden_size=int(info["hidden_size"]),
        vocab_size=int(info["vocab_size"]),
        layer_ids=list(layer_ids),
        max_length=int(settings["max_length"]),
        tokenizer_sha256=settings.get("tokenizer_hash") or "",
        chat_template_sha256=settings.get("chat_template_hash") or "",
        corpus_sha256=settings.get("corpus_hash") or "",
        kernels=dict(info["kernels"]),
        package_versions=package_versions(),
        target_topk=int(config.target_topk or 0),
    )


# Fields a resumed job may differ in: where the model lives and the package versions.
_RESUME_TOLERATES = {"target_model", "package_versions"}


def _check_resumable(store, fingerprint, store_path: Path, ignore=()) -> None:
    """A resumed job must be the same target and settings (`Fingerprint.check`)."""
    from store_schema import FingerprintMismatch

    try:
        store.fingerprint.check(fingerprint, ignore=_RESUME_TOLERATES | set(ignore))
    except FingerprintMismatch as mismatch:
        raise ExtractError(
            f"{store_path} was made with a different target or settings: {mismatch} -- pass --overwrite to start over"
        ) from None


# --------------------------------------------------------------------------- store state


def _open_existing(path: Path):
    """(Store, committed shard names) for a readable store, (None, []) for a store
    that never got as far as its root record (e.g. the disk filled up while creating)."""
    from store_schema import Store, layout

    if not (path / layout.ROOT_RECORD).is_file():
        return None, []
    store = Store(path)
    return store, store.committed_shards()


def _describe_plan_difference(old, new) -> str:
    a, b = old.settings, new.settings
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if keys:
        return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6])
    return "same settings, different samples or shards"


# --------------------------------------------------------------------------- Ray


def _start_ray(config: JobConfig) -> bool:
    """Connect to Ray. Returns True if this call started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    quiet = dict(log_to_driver=True, logging_level="WARNING")
    if config.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=config.address, **quiet)  # a running cluster (or `ray job submit`)
        return True
    needed = config.workers * config.cpus_per_worker if config.device == "cpu" else config.workers
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, needed),
        include_dashboard=False,  # no dashboard / job server for a local run
        **quiet,
    )
    return True


def _check_resources(config: JobConfig, workers: int) -> None:
    import ray

    resources = ray.cluster_resources()
    if config.device == "cuda":
        have, need, what = resources.get("GPU", 0), workers, "GPU"
    else:
        have, need, what = resources.get("CPU", 0), workers * config.cpus_per_worker, "CPU"
    if have < need:
        raise ExtractError(
            f"the Ray cluster has {have:g} {what}(s); {workers} worker(s) need {need} -- lower --workers"
        )


class _Pool:
    """The actors and what each holds. Replaces dead actors on request."""

    def __init__(self, config: JobConfig, plan, layer_ids: list[int], kills: list[int]):
        import ray

        from .worker import ExtractionWorker

        if config.device == "cuda":
            options = dict(num_gpus=1, num_cpus=config.cpus_per_worker)
        else:
            options = dict(num_cpus=config.cpus_per_worker)
        self._remote = ray.remote(max_concurrency=2, max_restarts=0, **options)(ExtractionWorker)
        self._args = (
            str(Path(config.model).resolve()),
            plan.settings["tokenizer_path"],
            str(Path(config.store).resolve()),
            list(layer_ids),
            plan.settings,
        )
        self._kwargs = dict(
            device=config.device,
            topk=config.target_topk,
            batch_tokens=config.batch_tokens,
            torch_threads=config.cpus_per_worker if config.device == "cpu" else None,
            trust_remote_code=config.trust_remote_code,
        )
        self._kills = list(kills)
        self.created = 0
        self.actors: list = []

    def spawn(self):
        kill = self._kills[self.created] if self.created < len(self._kills) else None
        self.created += 1
        return self._remote.remote(*self._args, **self._kwargs, kill_after_batches=kill)

    def start(self, count: int) -> list[dict]:
        import ray

        self.actors = [self.spawn() for _ in range(count)]
        try:
            return ray.get([actor.info.remote() for actor in self.actors])
        except ray.exceptions.RayActorError as error:
            raise ExtractError(f"a worker failed to start (loading the target): {_cause(error)}") from None

    def replace(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self.spawn()

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []


def _cause(error: BaseException) -> str:
    """One readable line: Ray's actor-death messages run to a paragraph."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines()) or type(error).__name__
    for marker in ("The actor is dead because", "The actor died because"):
        if marker in text:
            text = text[text.index(marker):]
    for cut in (" Some common causes", " The actor never ran"):
        text = text.split(cut)[0]
    return text[:300]


def _worker_died_errors():
    import ray.exceptions as rex

    kinds = [rex.RayActorError, rex.WorkerCrashedError]
    for name in ("OutOfMemoryError", "NodeDiedError", "ActorUnavailableError"):
        if hasattr(rex, name):
            kinds.append(getattr(rex, name))
    return tuple(kinds)


# --------------------------------------------------------------------------- the job


def plan_job(config: JobConfig):
    """The job's context layer ids and plan: what `run` writes and `plan --dry-run` previews."""
    from .layers import resolve_layer_ids
    from .planning import build_plan

    layer_ids = resolve_layer_ids(config.model, config.layers, config.num_context_layers)
    plan = build_plan(
        config.corpus,
        config.tokenizer or config.model,
        max_length=config.max_length,
        shard_tokens=config.shard_tokens,
        block_size=config.block_size,
        seed=config.seed,
        drop_long=config.drop_long,
        strict=config.strict,
        workers=config.plan_workers,
        limit=config.limit,
        progress=config.progress,
    )
    return plan, layer_ids


def run_job(config: JobConfig, log=None) -> dict:
    """Run (or resume) one extraction job; returns the report. Raises `ExtractError`
    (and `store_schema.StoreLockedError`, `ValueError`, `FileNotFoundError`) with a
    message meant for the user."""
    from store_schema import StoreLock
    from store_schema.writer import looks_like_store, store_entries

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    started = time.perf_counter()
    store_path = Path(config.store)
    if not (Path(config.model) / "config.json").is_file():
        raise FileNotFoundError(f"{config.model} is not a model directory (no config.json)")
    if not Path(config.corpus).exists():
        raise FileNotFoundError(f"corpus {config.corpus} does not exist")
    if config.workers < 1 or config.max_attempts < 1 or config.batch_tokens < 1:
        raise ValueError("--workers, --batch-tokens and the attempt limit must be positive")
    if config.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {config.device!r}")
    if store_path.exists() and not store_path.is_dir():
        raise ExtractError(f"{store_path} exists and is not a directory")
    if store_entries(store_path) and not looks_like_store(store_path):
        raise ExtractError(
            f"{store_path} is a non-empty directory that is not a dflash store; refusing to write into "
            "(or, with --overwrite, delete) it -- choose a new path"
        )

    lock = StoreLock(store_path, job=f"extract {' '.join(sys.argv[1:])}"[:2000]).acquire()
    try:
        return _run_locked(config, store_path, started, log)
    finally:
        lock.release()


def _run_locked(config: JobConfig, store_path: Path, started: float, log) -> dict:
    from store_schema import StoreWriter, create_store
    from store_schema.writer import remove_staging, store_entries

    from .planning import summarize

    leftovers = remove_staging(store_path)
    if leftovers:
        log(f"removed {len(leftovers)} uncommitted leftover(s) of a previous job from .staging/")

    plan_started = time.perf_counter()
    plan, layer_ids = plan_job(config)
    plan_seconds = time.perf_counter() - plan_started
    summary = summarize(plan)
    if not plan.shards:
        raise ExtractError(
            f"the corpus gives no samples ({summary.quarantined} record(s) quarantined: "
            f"{summary.quarantined_by_reason}); nothing to extract"
        )

    # What is already there?
    fresh = config.overwrite or not store_entries(store_path)
    store, committed = (None, []) if fresh else _open_existing(store_path)
    if not fresh:
        if store is None:
            fresh = True  # never finished creating: no plan, no shards, nothing to lose
        else:
            old_plan = store.plan()
            if old_plan is not None and old_plan.digest() != plan.digest():
                raise ExtractError(
                    f"{store_path} holds a different plan ({_describe_plan_difference(old_plan, plan)}); "
                    "rerun with the settings it was made with, use a new store, or pass --overwrite to start over"
                )
            if old_plan is None and committed:
                raise ExtractError(f"{store_path} has committed shards but no plan; use --overwrite or a new store")
    committed_set = set(committed)
    pending = [s.name for s in plan.shards if s.name not in committed_set]
    skipped = len(plan.shards) - len(pending)
    if skipped:
        log(f"resuming: {skipped} of {len(plan.shards)} shard(s) already committed, {len(pending)} to go")

    counts = Counter()
    info: dict = {}
    worker_infos: list[dict] = []
    dispatch_seconds = startup_seconds = 0.0
    bytes_written = raw_written = 0
    started_ray = False
    pool = None
    try:
        if pending:
            started_ray = _start_ray(config)
            num_workers = min(config.workers, len(pending))
            _check_resources(config, num_workers)
            kills = list(config.kill_after_batches) or _kills_from_env()
            pool = _Pool(config, plan, layer_ids, kills)
            startup_started = time.perf_counter()
            worker_infos = pool.start(num_workers)
            startup_seconds = time.perf_counter() - startup_started
            info = worker_infos[0]
            kernels = {json.dumps(w["kernels"], sort_keys=True) for w in worker_infos}
            if len(kernels) > 1:
                raise ExtractError(
                    f"workers run different kernels ({sorted(kernels)}); a store must come from one "
                    "implementation -- install the same extras on every node"
                )
            fingerprint = build_fingerprint(config, plan, layer_ids, info)
            if fresh:
                writer = create_store(store_path, fingerprint, overwrite=True)
            else:
                _check_resumable(store, fingerprint, store_path)
                writer = StoreWriter(store_path)
            writer.write_plan(plan)
            dispatch_started = time.perf_counter()
            results = _dispatch(config, plan, pending, pool, store_path, counts, log)
            dispatch_seconds = time.perf_counter() - dispatch_started
            bytes_written = sum(r["disk_bytes"] for r in results if r["written"])
            raw_written = sum(r["raw_bytes"] for r in results if r["written"])
        else:
            # Everything is committed: nothing to run, but the target must still match.
            from store_schema.target_config import read_target_config

            dims = read_target_config(config.model)
            probe = {
                "num_layers": dims.num_hidden_layers,
                "hidden_size": dims.hidden_size,
                "vocab_size": store.fingerprint.vocab_size,
                "kernels": store.fingerprint.kernels,
            }
            _check_resumable(store, build_fingerprint(config, plan, layer_ids, probe), store_path, ignore={"kernels"})
            writer = StoreWriter(store_path)
            info = {"kernels": store.fingerprint.kernels}
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ExtractError(_disk_full_message(store_path, "while creating the store or writing its plan")) from None
        raise
    finally:
        if pool is not None:
            pool.shutdown()
        if started_ray:
            import ray

            ray.shutdown()

    wall = time.perf_counter() - started
    tokens_done = counts["tokens_written"]
    report = {
        "status": "complete",
        "store": str(store_path.resolve()),
        "plan_digest": plan.digest(),
        "samples": plan.num_samples,
        "tokens": plan.num_tokens,
        "shards": len(plan.shards),
        "samples_written": counts["samples_written"],
        "tokens_written": tokens_done,
        "shards_written": counts["shards_written"],
        "shards_skipped": skipped,
        "shards_committed_elsewhere": counts["shards_committed_elsewhere"],
        "shards_retried": counts["shards_retried"],
        "shards_committed_before_worker_death": counts["shards_committed_before_worker_death"],
        "worker_deaths": counts["worker_deaths"],
        "quarantined": summary.quarantined,
        "quarantined_by_reason": summary.quarantined_by_reason,
        "layer_ids": list(layer_ids),
        "target_topk": int(config.target_topk or 0),
        "workers": len(worker_infos),
        "workers_started": pool.created if pool is not None else 0,
        "device": config.device,
        "devices": sorted({w["device"] for w in worker_infos}),
        "hosts": sorted({w["host"] for w in worker_infos}),
        "kernels": info.get("kernels", {}),
        "bytes_written": bytes_written,
        "raw_bytes_written": raw_written,
        "tokens_per_s": round(tokens_done / dispatch_seconds, 2) if dispatch_seconds else 0.0,
        "bytes_per_s": round(bytes_written / dispatch_seconds, 2) if dispatch_seconds else 0.0,
        "wall_seconds": round(wall, 3),
        "plan_seconds": round(plan_seconds, 3),
        "startup_seconds": round(startup_seconds, 3),
        "extract_seconds": round(dispatch_seconds, 3),
        "leftovers_cleaned": len(leftovers),
    }
    try:
        writer.write_report("extract", report)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log("warning: disk full, the report was not stored (every shard is committed)")
    return report


def _kills_from_env() -> list[int]:
    raw = os.environ.get(KILL_ENV, "").strip()
    return [int(x) for x in raw.split(",") if x.strip()] if raw else []


def _disk_full_message(store_path: Path, where: str) -> str:
    return (
        f"disk full {where} in {store_path}: free space (or move the store) and rerun the same command; "
        "committed shards are intact and will not be recomputed, half-written ones were never visible"
    )


def _dispatch(config: JobConfig, plan, pending: list[str], pool: _Pool, store_path: Path, counts: Counter, log):
    """The queue: keep every actor busy with up to `inflight_per_worker` shards."""
    import ray

    died = _worker_died_errors()
    queue = deque(pending)
    attempts: Counter = Counter()
    inflight: dict = {}  # ObjectRef -> (actor index, shard name)
    results: list[dict] = []
    shard_sizes = {s.name: (len(s.samples), s.num_tokens) for s in plan.shards}
    bar = _bar(config, plan, pending)
    dispatch_started = time.perf_counter()
    kill_driver = config.kill_driver_after_shards
    if kill_driver is None and os.environ.get(KILL_DRIVER_ENV, "").strip():
        kill_driver = int(os.environ[KILL_DRIVER_ENV])

    def load(index: int) -> int:
        return sum(1 for i, _ in inflight.values() if i == index)

    def fill() -> None:
        for index, actor in enumerate(pool.actors):
            while queue and load(index) < config.inflight_per_worker:
                name = queue.popleft()
                attempts[name] += 1
                inflight[actor.extract_shard.remote(name)] = (index, name)

    try:
        fill()
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            for ref in ready:
                if ref not in inflight:
                    continue  # dropped with its dead actor below
                index, name = inflight.pop(ref)
                try:
                    result = ray.get(ref)
                except died as error:
                    landed = _worker_died(error, index, name, inflight, queue, attempts, pool, store_path, counts,
                                          config, log)
                    for shard in landed:  # committed before the worker died: counted, never recomputed
                        counts["shards_written"] += 1
                        counts["samples_written"] += shard_sizes[shard][0]
                        counts["tokens_written"] += shard_sizes[shard][1]
                        bar.update(shard_sizes[shard][0])
                    continue
                if not result["ok"]:
                    raise ExtractError(_failure_message(result, store_path))
                results.append(result)
                if result["written"]:
                    counts["shards_written"] += 1
                    counts["samples_written"] += result["samples"]
                    counts["tokens_written"] += result["tokens"]
                    if kill_driver is not None and counts["shards_written"] >= kill_driver:
                        os.kill(os.getpid(), signal.SIGKILL)  # fault injection: the driver dies here
                else:
                    counts["shards_committed_elsewhere"] += 1
                bar.update(shard_sizes[name][0])
                elapsed = max(time.perf_counter() - dispatch_started, 1e-9)
                bar.set_postfix(
                    tok_s=f"{counts['tokens_written'] / elapsed:.0f}",
                    MB_s=f"{sum(r['disk_bytes'] for r in results) / elapsed / 1e6:.2f}",
                    shards=f"{len(results)}/{len(pending)}",
                    refresh=False,
                )
            fill()
    finally:
        bar.close()
    return results


def _worker_died(error, index, name, inflight, queue, attempts, pool, store_path, counts, config, log) -> list[str]:
    """Put the dead actor's uncommitted shards back at the front of the queue, replace
    the actor. Returns the shards whose commit landed before the actor died (the
    rename is the commit, so a dead writer's shard is either whole or absent): they
    are done and are not recomputed."""
    from store_schema import layout
    from store_schema.writer import remove_staging

    held = [name] + [n for ref, (i, n) in list(inflight.items()) if i == index]
    for ref in [ref for ref, (i, _) in inflight.items() if i == index]:
        del inflight[ref]
    counts["worker_deaths"] += 1
    landed = [shard for shard in held if layout.is_committed(store_path, shard)]
    lost = [shard for shard in held if shard not in landed]
    counts["shards_committed_before_worker_death"] += len(landed)
    for shard in lost:
        if attempts[shard] >= config.max_attempts:
            raise ExtractError(
                f"shard {shard} failed {attempts[shard]} time(s): its worker died each time "
                f"(last: {_cause(error)}); the job stops -- committed shards are kept, rerun to resume"
            )
        remove_staging(store_path, shard)  # no live writer holds it now
        counts["shards_retried"] += 1
    queue.extendleft(reversed(lost))
    kept = f" ({', '.join(landed)} committed before it died)" if landed else ""
    log(f"worker {index} died ({_cause(error)}); redoing {', '.join(lost) or 'nothing'} on a fresh worker{kept}")
    pool.replace(index)
    return landed


def _failure_message(result: dict, store_path: Path) -> str:
    shard, kind, message = result["shard"], result["kind"], result["message"]
    if kind == "disk_full":
        return _disk_full_message(store_path, f"while writing {shard}") + f" ({message})"
    if kind == "corpus_changed":
        return f"shard {shard}: {message} -- the corpus or tokenizer changed since the plan was made; use --overwrite"
    if kind == "device_oom":
        return f"shard {shard}: the device ran out of memory ({message}); lower --batch-tokens and rerun"
    return f"shard {shard} failed on {result.get('host', '?')}: {message}\n{result.get('traceback', '')}".rstrip()


def _bar(config: JobConfig, plan, pending: list[str]):
    from tqdm import tqdm

    pending_set = set(pending)
    done = sum(len(s.samples) for s in plan.shards if s.name not in pending_set)
    return tqdm(
        total=plan.num_samples,
        initial=done,
        unit="sample",
        desc="extract",
        disable=not config.progress,
        mininterval=1.0,
        smoothing=0.1,
        file=sys.stderr,
    )
