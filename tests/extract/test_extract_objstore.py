"""Issue 33, extraction to object storage: `python -m extract run --store s3://...` on a
real local Ray cluster and a real moto_server on 127.0.0.1 (conftest's `s3_server` /
`url`), then `store_schema verify`, `train fit` through the shard cache and `train
eval` on the same URL; no credential reaches the output, the report or the bucket.
Each worker builds its shards in a bounded local spool, uploads them and frees them;
a worker SIGKILLed between its data and its marker leaves only garbage that the
rerun ignores and cleans. The spool's bound waits rather than fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import builders
import pytest
import tiny
from paths import REPO

from store_schema.__main__ import main as store_cli
from store_schema.location import classify_store
from store_schema.objstore.bucket import Bucket
from store_schema.objstore.commit import KILL_BEFORE_ENV
from store_schema.objstore.keys import ATTEMPTS_DIR
from store_schema.objstore.spool import LOCK_NAME, POLL_SECONDS, Spool, SpoolTooSmall
from store_schema.stores import open_store
from store_schema.tools.verify import verify_store

pytestmark = pytest.mark.slow
SECRET = "Secret-Key-5e1d0b"  # moto takes any key; this one must appear nowhere
FIT_SETS = tiny.drafter_sets(
    "train.grad_accumulation=1",
    "eval.every=0",
    "data.heldout_fraction=0.0",
    "data.buffer_shards=2",
    "train.checkpoint_every=0",
    "train.max_steps=2",
    heads=True,
)


def _extract(model, corpus, url, tmp_path, *extra, env=None):
    command = [
        sys.executable,
        "-m",
        "extract",
        "run",
        "--model",
        str(model),
        "--corpus",
        str(corpus),
        "--store",
        url,
        "--layers",
        "1,3",
        "--shard-tokens",
        "1500",
        "--batch-tokens",
        "1200",
        "--workers",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--spool-dir",
        str(tmp_path / "spool"),
        *extra,
    ]
    environment = dict(os.environ, AWS_SECRET_ACCESS_KEY=SECRET, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=900)


def _attempts(url: str) -> set[str]:
    return {key.split("/")[2] for key in Bucket(classify_store(url)).list(ATTEMPTS_DIR)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return builders.write_chat_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", builders.coding_chats(6))


def test_extract_run_into_a_bucket_then_verify_fit_through_the_cache_and_eval(url, qwen3_dir, corpus, tmp_path):
    done = _extract(qwen3_dir, corpus, url, tmp_path, "--spool-size", "50MB")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["store"] == url and report["status"] == "complete"
    assert report["shards_written"] == report["shards"] >= 2
    assert report["upload_bytes"] > 0 and report["upload_seconds"] > 0 and report["upload_mb_per_s"] > 0
    assert 0 <= report["spool_wait_seconds"] < report["wall_seconds"]  # 50 MB holds a shard: no real wait
    assert [p.name for p in (tmp_path / "spool").iterdir()] == [LOCK_NAME], "the spool kept a shard"
    assert not (tmp_path / "s3:").exists()
    store = open_store(url)
    assert store.committed_shards() == [s.name for s in store.plan().shards]
    assert report["upload_bytes"] >= sum(store.commit(name).disk_bytes for name in store.committed_shards())
    assert store_cli(["verify", url]) == 0

    from train.cli import main as train

    run, export = tmp_path / "run", tmp_path / "export"
    assert (
        train(
            [
                "fit",
                "--store",
                url,
                "--target",
                str(qwen3_dir),
                "--out",
                str(run),
                *tiny.cli_sets((*FIT_SETS, f"data.cache_dir={tmp_path / 'cache'}")),
            ]
        )
        == 0
    )
    assert train(["export", str(run), "--out", str(export)]) == 0
    evaluated = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "eval",
            "--store",
            url,
            "--drafter",
            str(export),
            "--target",
            str(qwen3_dir),
            "--split",
            "all",
            "--max-samples",
            "2",
            "--max-blocks-per-sample",
            "4",
            "--ddtree-budgets",
            "4",
            "--json",
        ],
        env=dict(os.environ, AWS_SECRET_ACCESS_KEY=SECRET, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout.splitlines()[-1])["samples"] == 2

    again = _extract(qwen3_dir, corpus, url, tmp_path)  # the same command: nothing left to do
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1])["status"] == "nothing_to_do"
    bucket = Bucket(classify_store(url))
    stored = b"".join(bucket.get_many(bucket.list("")).values())
    for text in (done.stdout, done.stderr, again.stdout, again.stderr, evaluated.stdout, evaluated.stderr):
        assert SECRET not in text
    assert SECRET.encode() not in stored


def test_a_worker_killed_between_its_data_and_its_marker_leaves_garbage_the_rerun_ignores_and_cleans(
    url, qwen3_dir, corpus, tmp_path
):
    died = _extract(qwen3_dir, corpus, url, tmp_path, "--max-attempts", "1", env={KILL_BEFORE_ENV: "marker"})
    assert died.returncode == 1 and "its worker was lost" in died.stderr, died.stderr[-3000:]
    dead = _attempts(url)
    assert dead and open_store(url).committed_shards() == []  # data and a claim, no marker: nothing visible
    done = _extract(qwen3_dir, corpus, url, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    store = open_store(url)
    assert store.committed_shards() == [s.name for s in store.plan().shards]
    assert not _attempts(url) & dead, "the rerun kept a dead attempt's objects"
    report = verify_store(url)
    assert report.ok and report.leftovers == []
    assert [p.name for p in (tmp_path / "spool").iterdir()] == [LOCK_NAME]


def test_a_full_spool_waits_for_room_and_a_shard_larger_than_it_is_refused(tmp_path):
    lines = []
    spool = Spool(tmp_path / "spool", limit=1000, log=lines.append)
    with pytest.raises(SpoolTooSmall, match="--spool-size 1.00 kB cannot hold one shard"):
        with spool.shard_dir("big", 1001, lambda local: None):
            pass
    first_in, second_in, release = threading.Event(), threading.Event(), threading.Event()
    order = []

    def hold():
        with spool.shard_dir("a", 600, lambda local: (local / "x").write_bytes(b"1")):
            order.append("a in")
            first_in.set()
            release.wait(60)
            order.append("a out")

    def wait_then_write():
        first_in.wait(60)
        with spool.shard_dir("b", 600, lambda local: None):
            order.append("b in")
            second_in.set()

    threads = [threading.Thread(target=hold), threading.Thread(target=wait_then_write)]
    [t.start() for t in threads]
    first_in.wait(60)
    while not lines:  # b logged that it waits
        threading.Event().wait(0.05)
    assert not second_in.is_set()
    release.set()
    [t.join(60) for t in threads]
    assert order == ["a in", "a out", "b in"]
    assert "spool" in lines[0] and "waiting for uploads" in lines[0]
    assert spool.wait_of("b") >= POLL_SECONDS and spool.wait_of("b") == 0.0  # measured, then taken
    assert spool.wait_of("a") < POLL_SECONDS
    assert [p.name for p in (tmp_path / "spool").iterdir()] == [LOCK_NAME]


def test_a_dead_writers_reservation_is_freed(tmp_path):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)  # a process that has exited
    spool = Spool(tmp_path / "spool", limit=1000)
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / f"shard-000000.r-1~{socket.gethostname()}~{dead_pid}~abc~900").mkdir()
    with spool.shard_dir("shard-000001", 900, lambda local: None) as (local, _):
        assert local.exists()
    assert [p.name for p in (tmp_path / "spool").iterdir()] == [LOCK_NAME]
