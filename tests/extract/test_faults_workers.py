"""Fault suite, extraction processes: real SIGKILLs and SIGSTOPs on a real local Ray cluster.

- Worker death, ten times over one run (seeded kill points, each mid-shard): the job
  completes, `verify` is clean, every planned sample is stored exactly once, the
  content equals an uninterrupted run's, and no committed shard is computed again.
- Driver death at three points (after the first commit, mid-run, after the last
  commit but before the report), the same command rerun each time: the final store
  equals an uninterrupted run's, and committed shards keep their inodes.
- Two jobs, one store: a second job is refused while the first lives (stopped with
  SIGSTOP, so it holds the lock without racing us); after the first is SIGKILLed a
  new job takes over and completes the store.
- A worker frozen (SIGSTOP) past its deadline, its shards reassigned, then resumed
  (SIGCONT): it can no longer commit; the store is the uninterrupted run's and the
  report says what happened (issue 15.7). The same with the driver's and the
  writer's side of the fence raced by hand.
- A store on a filesystem whose flock is not implemented (Lustre without `-o flock`):
  one line naming the mount option, nothing left behind.

One cluster, one corpus and one uninterrupted reference run are shared by the module.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from builders import coding_chats, write_chat_jsonl
from ray_helpers import (
    REPO,
    committed_inodes,
    extract_command,
    job_config,
    kill,
    store_content,
    verify_cli,
    wait_for_no_workers,
    worker_pids,
)

pytestmark = [pytest.mark.faults, pytest.mark.slow]  # fault injection, a Ray cluster

# Small shards of one-sample batches: ~60 batches in ~22 shards of ~3 batches, so that
# ten seeded kill points (1..4 batches into each dying actor's life) always fall
# inside a shard and the run always has work left for the next dying actor.
RECORDS = 60
SHARD_TOKENS = 700
BATCH_TOKENS = 150
WORKER_KILLS = 10
KILL_SEED = 20240607


def _config(model, corpus, store, **overrides):
    return job_config(model, corpus, store, shard_tokens=SHARD_TOKENS, batch_tokens=BATCH_TOKENS, **overrides)


def _command(model, corpus, store, address, workers=2):
    return extract_command(
        model, corpus, store, address, shard_tokens=SHARD_TOKENS, batch_tokens=BATCH_TOKENS, workers=workers
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    records = coding_chats(RECORDS, seed=3)
    return write_chat_jsonl(tmp_path_factory.mktemp("corpus") / "chats.jsonl", records), records


@pytest.fixture(scope="module")
def reference(ray_cluster, qwen3_5_dir, corpus, tmp_path_factory):
    """An uninterrupted 2-worker run of the same corpus and settings."""
    from extract.extraction.job import run_job

    store = tmp_path_factory.mktemp("ref") / "store"
    report = run_job(_config(qwen3_5_dir, corpus[0], store))
    assert report["status"] == "complete" and report["shards_written"] == report["shards"] >= 20
    return store, report, store_content(store)


def _assert_complete_and_clean(store, reference_content, planned_ids):
    from store_schema import Store
    from store_schema.tools.verify import verify_store

    result = verify_store(store)
    assert result.ok and not result.leftovers, result.problems
    verified = verify_cli(store)
    assert verified.returncode == 0 and json.loads(verified.stdout.strip().splitlines()[-1])["ok"], verified.stdout
    reader = Store(store)
    stored = Counter(sid for name in reader.committed_shards() for sid in reader.read_shard(name).sample_ids)
    assert stored == Counter(planned_ids), "every planned sample stored exactly once"
    assert store_content(store) == reference_content


def _committed_only_missing(store) -> int:
    """After a death: what is there is clean, what is missing is only whole shards."""
    from store_schema.tools.verify import verify_store

    result = verify_store(store)
    assert all(p["what"].startswith("planned shard missing") for p in result.problems), result.problems
    return result.shards_checked


# --------------------------------------------------------------------------- worker death x10


def test_ten_worker_deaths_mid_shard(reference, qwen3_5_dir, corpus, tmp_path):
    from extract.extraction.job import run_job
    from extract.jobs.settings import FaultInjection

    ref_store, ref_report, ref_content = reference
    rng = random.Random(KILL_SEED)
    kills = tuple(rng.randint(1, 4) for _ in range(WORKER_KILLS))  # batches into the i-th actor's life
    store = tmp_path / "store"
    messages = []
    report = run_job(
        _config(
            qwen3_5_dir,
            corpus[0],
            store,
            faults=FaultInjection(kill_after_batches=kills),
            max_attempts=WORKER_KILLS + 1,
        ),
        log=messages.append,
    )

    assert report["status"] == "complete"
    assert report["worker_deaths"] == WORKER_KILLS, (kills, report)
    assert report["workers_started"] == 2 + WORKER_KILLS  # each dead actor replaced once
    assert sum("died:" in m for m in messages) == WORKER_KILLS
    assert report["shards_retried"] >= WORKER_KILLS  # each death interrupted at least its current shard
    # Committed shards never recomputed: a shard is computed again only when no commit of it
    # exists; a worker finding its shard already committed (`committed_elsewhere`) would mean
    # the driver handed out a committed shard.
    assert report["shards_committed_elsewhere"] == 0
    assert report["shards_written"] == ref_report["shards"]
    assert report["samples_written"] == ref_report["samples"] == RECORDS
    _assert_complete_and_clean(store, ref_content, [r["id"] for r in corpus[1]])
    assert report["plan_digest"] == ref_report["plan_digest"]


class _Pool:  # stands in for the Ray actor pool: records which actor is replaced
    def __init__(self):
        self.actors, self.replaced = [], []

    def replace(self, index):
        self.replaced.append(index)


def test_a_dead_workers_committed_shard_is_kept_not_redone(tmp_path):
    """The driver's bookkeeping when an actor dies holding a group of two shards, one
    of which it had committed just before dying (the rename landed, the reply did
    not): the group is queued again for the other only, its attempt revoked and its
    staging removed; the committed one is counted as written."""
    import builders

    from extract.jobs.dispatch import DispatchCounts, Dispatcher, _Held
    from extract.jobs.settings import DispatchSettings
    from store_schema import Store
    from store_schema.commit.lock import ShardFence, ShardFenced, claim

    builders.random_store(tmp_path / "s", num_shards=2, samples_per_shard=2)
    store = tmp_path / "s"
    fence = ShardFence(store).open()
    first = fence.attempt(1)
    half_written = store / ".staging" / f"shard-000002.{first.token}.abc123"
    half_written.mkdir()  # the dead writer's half-written shard

    plan = Store(store).plan()
    log, pool = [], _Pool()
    dispatcher = Dispatcher(
        pool,
        plan,
        ["shard-000002", "shard-000004"],
        fence,
        DispatchSettings(max_attempts=4, batch_shards=2),
        log=log.append,
    )
    dispatcher.queue.clear()
    dying = _Held(0, ("shard-000001", "shard-000002"), {"shard-000001": first, "shard-000002": first}, 0.0)
    other = _Held(1, ("shard-000003", "shard-000004"), {"shard-000004": first}, 0.0)
    dispatcher.inflight = {"ref-a": dying, "ref-b": other}
    dispatcher.left |= {"shard-000001"}
    dispatcher.attempts.update({"shard-000002": 1, "shard-000001": 1, "shard-000004": 1})
    landed = dispatcher.worker_died(RuntimeError("killed"), 0)
    assert landed == ["shard-000001"]  # committed by random_store: whole, kept
    assert list(dispatcher.queue) == [("shard-000001", "shard-000002")]  # redone first; 000001 only as a filler
    assert dispatcher.left == {"shard-000002", "shard-000004"}
    assert dispatcher.inflight == {"ref-b": other} and pool.replaced == [0]
    shard = plan.shard("shard-000001")
    assert dispatcher.counts == DispatchCounts(
        worker_deaths=1,
        shards_retried=1,
        shards_committed_before_worker_death=1,
        attempts_revoked=2,
        shards_written=1,
        samples_written=len(shard.samples),
        tokens_written=shard.num_tokens,
    )
    assert not half_written.exists()
    with pytest.raises(ShardFenced, match="revoked"):  # the dead writer's attempt can never commit now
        claim(store, "shard-000002", first)
    assert "died: killed" in log[0] and "shard-000001 committed before" in log[0]


def test_a_shard_whose_worker_dies_too_often_stops_the_job(tmp_path):
    """`max_attempts` tries per shard, then the job stops naming the shard."""
    import builders

    from extract.errors import ExtractError
    from extract.jobs.dispatch import Dispatcher, _Held
    from extract.jobs.settings import DispatchSettings
    from store_schema import Store
    from store_schema.commit.lock import ShardFence

    builders.random_store(tmp_path / "s", num_shards=1, samples_per_shard=2)

    class Pool(_Pool):
        def replace(self, index):
            raise AssertionError("no replacement once the job stops")

    fence = ShardFence(tmp_path / "s").open()
    dispatcher = Dispatcher(
        Pool(),
        Store(tmp_path / "s").plan(),
        [],
        fence,
        DispatchSettings(max_attempts=2, batch_shards=2),
        log=lambda message: None,
    )
    dispatcher.inflight = {"ref": _Held(0, ("shard-000009",), {"shard-000009": fence.attempt(2)}, 0.0)}
    dispatcher.attempts["shard-000009"] = 2
    with pytest.raises(ExtractError, match=r"shard shard-000009 failed 2 time\(s\).*rerun to resume"):
        dispatcher.worker_died(RuntimeError("killed"), 0)


# --------------------------------------------------------------------------- driver death x3


def test_driver_killed_at_three_points_then_rerun(reference, ray_cluster, qwen3_5_dir, corpus, tmp_path):
    """Run the same command four times: the first three drivers SIGKILL themselves
    (after their 1st commit; after half the remaining shards; after the last shard
    was committed but before the report), the fourth finishes."""
    from extract.extraction.job import run_job
    from extract.jobs.settings import KILL_DRIVER_ENV

    ref_store, ref_report, ref_content = reference
    total = ref_report["shards"]
    store = tmp_path / "store"
    command = _command(qwen3_5_dir, corpus[0], store, ray_cluster)
    kept: dict = {}
    points = []
    for point in ("first_commit", "mid_run", "after_last_commit"):
        remaining = total - len(committed_inodes(store))
        after = {"first_commit": 1, "mid_run": max(1, remaining // 2), "after_last_commit": remaining}[point]
        env = dict(__import__("os").environ, **{KILL_DRIVER_ENV: str(after)})
        died = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert died.returncode == -signal.SIGKILL, (point, died.stderr[-2000:])
        wait_for_no_workers()  # its actors go with it; none may commit behind the next run
        now = committed_inodes(store)
        assert {n: now[n] for n in kept} == kept, "a committed shard was rewritten"
        assert _committed_only_missing(store) == len(now)
        points.append((point, after, len(now)))
        kept = now
        if point == "after_last_commit":
            assert len(now) == total and not list((store / "reports").glob("extract-*.json"))
        else:
            assert len(now) < total, points
    assert [p[2] for p in points] == sorted(p[2] for p in points) and points[0][2] >= 1

    report = run_job(_config(qwen3_5_dir, corpus[0], store))  # the same job, uninterrupted now
    assert report["shards_skipped"] == total and report["shards_written"] == 0 and report["workers"] == 0
    assert report["status"] == "nothing_to_do" and report["plan_reused"]
    assert committed_inodes(store) == kept
    assert json.loads((store / report["report"]).read_text())["plan_digest"] == ref_report["plan_digest"]
    _assert_complete_and_clean(store, ref_content, [r["id"] for r in corpus[1]])


# --------------------------------------------------------------------------- two jobs, one store


def test_second_job_refused_while_first_lives_then_takes_over(
    reference, ray_cluster, qwen3_5_dir, corpus, tmp_path, capsys
):
    from extract.__main__ import main
    from extract.extraction.job import run_job

    ref_store, ref_report, ref_content = reference
    store = tmp_path / "store"
    command = _command(qwen3_5_dir, corpus[0], store, ray_cluster)
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Let it commit a shard, then freeze it: alive, holding the lock, doing nothing.
        for _ in range(3000):  # poll bound (a hang guard, not a timing)
            if committed_inodes(store) or first.poll() is not None:
                break
            time.sleep(0.02)
        first.send_signal(signal.SIGSTOP)
        assert first.poll() is None, first.stderr.read()[-2000:]
        assert committed_inodes(store), "the first job never committed a shard"
        holder = json.loads((store / ".lock").read_text())
        assert holder["pid"] == first.pid

        code = main(
            [
                "run",
                "--model",
                str(qwen3_5_dir),
                "--corpus",
                str(corpus[0]),
                "--store",
                str(store),
                "--layers",
                "1,3,5",
                "--shard-tokens",
                str(SHARD_TOKENS),
                "--batch-tokens",
                str(BATCH_TOKENS),
                "--no-progress",
            ]
        )
        err = capsys.readouterr().err
        assert code == 1 and "held by another live job" in err and f"(pid {first.pid} on " in err, err
    finally:
        kill(first.pid, signal.SIGKILL)
        first.wait()
        first.stderr.close()
    assert first.returncode == -signal.SIGKILL
    wait_for_no_workers()
    kept = committed_inodes(store)
    assert 1 <= len(kept) < ref_report["shards"]

    report = run_job(_config(qwen3_5_dir, corpus[0], store))  # the lock died with its holder
    assert report["shards_skipped"] == len(kept)
    assert report["shards_written"] == ref_report["shards"] - len(kept)
    assert {n: committed_inodes(store)[n] for n in kept} == kept
    _assert_complete_and_clean(store, ref_content, [r["id"] for r in corpus[1]])


# --------------------------------------------------------------------------- a partitioned worker (15.7)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def test_a_frozen_worker_resumed_after_its_group_was_redone_cannot_commit(reference, qwen3_5_dir, corpus, tmp_path):
    """Worker A freezes (a real SIGSTOP, after its first batch) holding a group of four
    shards; the driver's side revokes A's attempts and hands the group to worker B;
    A is resumed (SIGCONT) before B is done and finishes first: each of its commits
    is refused (without the fence, A's shards would land). B commits the group; the
    store is byte-equal to the reference."""
    import shutil

    import ray

    from extract.extraction.job import Extraction
    from extract.jobs.batching import batch_groups
    from extract.jobs.pool import ActorPool
    from extract.jobs.settings import FaultInjection
    from store_schema import Store
    from store_schema.commit.lock import ShardFence
    from store_schema.runtime.target_config import read_target_config
    from store_schema.stores import backend
    from store_schema.tools.verify import verify_store

    ref_store, _, ref_content = reference
    store = tmp_path / "store"
    shutil.copytree(ref_store, store)
    plan = Store(store).plan()
    group = batch_groups([s.name for s in plan.shards], 4)[1]
    for name in group:
        shutil.rmtree(store / "shards" / name)
    config = _config(qwen3_5_dir, corpus[0], store, faults=FaultInjection(stop_after_batches=(1,)))
    spec = Extraction(config, backend(store), read_target_config(qwen3_5_dir), [1, 3, 5], {}).worker_spec(plan)
    pool = ActorPool(config.execution.placement(), spec)
    pool.start(2)
    frozen = pool.infos[0].pid
    try:
        fence = ShardFence(store).open()
        first = {name: fence.attempt(1) for name in group}
        held = pool.actors[0].extract_group.remote(list(group), first)
        for _ in range(3000):  # poll bound (a hang guard, not a timing)
            if _stopped(frozen):
                break
            time.sleep(0.02)
        assert _stopped(frozen), "worker A never froze"

        assert all(fence.revoke(name, attempt) for name, attempt in first.items())  # the driver gives A up
        second = {n: fence.attempt(2) for n in group}
        kill(frozen, signal.SIGCONT)
        late = ray.get(held, timeout=300)
        assert [(r.shard, getattr(r, "kind", None)) for r in late.replies] == [(n, "fenced") for n in group], late
        assert all("revoked by the driver" in r.message for r in late.replies)
        assert not [n for n in group if n in committed_inodes(store)]  # nothing of A's landed
        assert not list((store / ".staging").glob(f"*.{first[group[0]].token}.*"))  # A removed its own staging

        redone = ray.get(pool.actors[1].extract_group.remote(list(group), second))
        assert [(r.shard, r.written) for r in redone.replies] == [(n, True) for n in group]
        fence.close()
        result = verify_store(store)
        assert result.ok and not result.leftovers, (result.problems, result.leftovers)
        assert store_content(store) == ref_content
    finally:
        kill(frozen, signal.SIGCONT)
        pool.shutdown()


def test_claim_and_revoke_race_for_one_file(tmp_path):
    """The fence's two sides: whichever comes first wins, the other learns it; a
    closed fence (the run is over) refuses every claim."""
    from store_schema.commit.lock import ShardFence, ShardFenced, claim

    fence = ShardFence(tmp_path).open()
    attempt = fence.attempt(1)
    claim(tmp_path, "shard-000001", attempt)  # the writer first: it is committing
    assert not fence.revoke("shard-000001", attempt)  # the driver must leave its staging alone
    assert fence.revoke("shard-000002", attempt)  # the driver first: the writer can never commit
    with pytest.raises(ShardFenced):
        claim(tmp_path, "shard-000002", attempt)
    fence.close()
    with pytest.raises(ShardFenced):
        claim(tmp_path, "shard-000003", fence.attempt(2))
    assert not list((tmp_path / ".staging").iterdir())  # closing removed the fence, leaving nothing


def test_a_worker_frozen_past_its_deadline_is_replaced_and_the_report_says_so(reference, qwen3_5_dir, corpus, tmp_path):
    """Through the job: the first actor freezes (SIGSTOP) after its 2nd batch; after
    `worker_timeout` of silence the driver revokes its attempts and redoes its groups
    on a fresh actor; the moment it says so, the frozen actor is resumed (SIGCONT) to
    race it. The job completes byte-equal to the reference, and the report counts
    the timeout, the revoked attempts and every shard exactly once."""
    from extract.extraction.job import run_job
    from extract.jobs.settings import FaultInjection
    from store_schema.tools.verify import verify_store

    ref_store, ref_report, ref_content = reference
    store = tmp_path / "store"
    messages, resumed = [], []

    def log(message):
        messages.append(message)
        if "no reply for" in message:
            for pid in worker_pids():
                if _stopped(pid):
                    kill(pid, signal.SIGCONT)
                    resumed.append(pid)

    try:
        report = run_job(
            _config(qwen3_5_dir, corpus[0], store, faults=FaultInjection(stop_after_batches=(2,)), worker_timeout=20),
            log=log,
        )
    finally:
        for pid in worker_pids():
            kill(pid, signal.SIGCONT)
    assert resumed, messages
    assert report["status"] == "complete" and report["shards_committed"] == report["shards"] == ref_report["shards"]
    assert report["workers_timed_out"] == 1 and report["worker_deaths"] == 1 and report["workers_started"] == 3
    assert report["attempts_revoked"] >= 1 and report["shards_retried"] >= 1
    assert (report["shards_written"] + report["shards_committed_elsewhere"]) == ref_report["shards"]
    assert report["samples_written"] == ref_report["samples"]
    wait_for_no_workers()
    result = verify_store(store)
    assert result.ok, result.problems
    stale = [name for name in result.leftovers if f".{report['run']}-1." not in name]
    assert not stale, result.leftovers  # at most the revoked attempts' files, written after the job ended
    assert store_content(store) == ref_content


# --------------------------------------------------------------------------- flock not supported (15.6)


_NO_FLOCK = """
import ctypes, errno, sys
# seccomp-bpf: flock(2) fails with ENOSYS in this process, as on a Lustre client
# mounted without -o flock ("noflock": applications get ENOSYS). x86_64 only.
class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]
LD, JEQ, RET, ALLOW, ERRNO = 0x20, 0x15, 0x06, 0x7FFF0000, 0x00050000
code = [(LD, 0, 0, 4), (JEQ, 1, 0, 0xC000003E), (RET, 0, 0, ALLOW),  # arch x86_64, else allow
        (LD, 0, 0, 0), (JEQ, 0, 1, 73), (RET, 0, 0, ERRNO | errno.ENOSYS), (RET, 0, 0, ALLOW)]  # nr 73: flock
program = Program(len(code), (Filter * len(code))(*[Filter(*c) for c in code]))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(program), 0, 0):  # NO_NEW_PRIVS, SECCOMP filter
    print("seccomp unavailable", ctypes.get_errno())
    sys.exit(77)
from extract.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="the seccomp filter is written for x86_64")
def test_a_store_on_a_filesystem_without_flock_is_refused_in_one_line(qwen3_dir, corpus, tmp_path):
    """Lustre without the flock mount option: flock(2) gives ENOSYS (reproduced with a
    seccomp filter on the real syscall). One line naming the mount option, exit 1, and
    what the refused job made (the store directory) is gone; what was there stays."""
    existing = tmp_path / "existing"
    existing.mkdir()
    for store, stays in ((tmp_path / "new" / "store", False), (existing, True)):
        argv = [
            "run",
            "--model",
            str(qwen3_dir),
            "--corpus",
            str(corpus[0]),
            "--store",
            str(store),
            "--layers",
            "1,3",
            "--no-progress",
        ]
        result = subprocess.run(
            [sys.executable, "-c", _NO_FLOCK, *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=dict(__import__("os").environ, PYTHONPATH=str(REPO)),
            timeout=300,
        )
        if result.returncode == 77:
            pytest.skip(f"cannot install a seccomp filter here: {result.stdout.strip()}")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
        assert lines[0].startswith(f"error: cannot lock {store}: its filesystem does not support flock (ENOSYS")
        assert "-o flock" in lines[0] and "Lustre" in lines[0]
        assert store.exists() == stays and (not stays or not list(store.iterdir()))
    assert not (tmp_path / "new").exists()  # the parent the refused job made went too


# --------------------------------------------------------------------------- device out of memory


def test_an_out_of_memory_batch_halves_the_batch_and_the_job_finishes(reference, qwen3_5_dir, corpus, tmp_path):
    """Issue 60.5: a batch too large for the device (injected: over 800 padded tokens, more
    than the longest sample's 766, at --batch-tokens 3200) halves the worker's batch
    budget and reruns the group, instead of failing the shard as `device_oom` and stopping
    the job; the store verifies and holds every planned sample (other batches pad
    differently: the states are not bit-equal)."""
    from extract.extraction.job import run_job
    from extract.jobs.settings import FaultInjection

    _, _, ref_content = reference
    from store_schema.tools.verify import verify_store

    store = tmp_path / "store"
    config = job_config(
        qwen3_5_dir,
        corpus[0],
        store,
        shard_tokens=SHARD_TOKENS,
        batch_tokens=3200,
        faults=FaultInjection(oom_over_tokens=800),
    )
    report = run_job(config)
    assert report["status"] == "complete" and report["shards_written"] == report["shards"]
    assert verify_store(store).ok and store_content(store).keys() == ref_content.keys()
