"""Stores on object storage against a real S3-compatible server: moto's `moto_server`,
started on 127.0.0.1 for the session (it honours `If-None-Match: *` and `If-Match`).
Racing commits, a claim against a revoke, the lease, a writer SIGKILLed between its
data and its marker, and objects damaged in the bucket, each through the real writer,
reader, `verify` and its CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import builders
import pytest
import torch
from paths import REPO

from store_schema import layout
from store_schema.__main__ import main as cli
from store_schema.commit.lock import Attempt, ShardFenced, StoreLockedError
from store_schema.location import StoreURL, classify_store
from store_schema.objstore.bucket import Bucket
from store_schema.objstore.commit import KILL_BEFORE_ENV, BucketFence, BucketWriter, claim
from store_schema.objstore.keys import ATTEMPTS_DIR, shard_marker
from store_schema.objstore.lease import LeaseLost, StoreLease
from store_schema.stores import open_store
from store_schema.tools.verify import verify_store

pytestmark = pytest.mark.slow


def _keys(url: str, prefix: str) -> set[str]:
    return set(Bucket(classify_store(url)).list(prefix))


def test_store_arguments_are_classified_by_one_rule():
    assert classify_store("/data/store") == Path("/data/store")
    assert classify_store("s3://bucket/a/b/") == StoreURL("s3", "bucket", "a/b")
    assert classify_store("gs://bucket") == StoreURL("gs", "bucket", "")
    assert StoreURL("s3", "bucket", "a/b").key("zarr.json") == "a/b/zarr.json"
    for bad in ("ftp://bucket/x", "s3:///x", "s3://bucket/../x"):
        with pytest.raises(ValueError, match="store URL"):
            classify_store(bad)


def test_a_bucket_store_reads_back_bit_identical_through_both_read_paths(url):
    _, shards = builders.random_store(url, num_shards=2)
    store = open_store(url)
    assert store.committed_shards() == ["shard-000000", "shard-000001"]
    assert store.num_samples() == 8
    whole = store.read_shard("shard-000001")
    for i, written in enumerate(shards["shard-000001"]):
        for layer in (1, 3):
            assert torch.equal(whole.sample(i).hidden[layer], written.hidden[layer].to(torch.bfloat16))
            assert torch.equal(store.read_sample("shard-000001", i).hidden[layer], written.hidden[layer])
    assert verify_store(url).ok
    assert cli(["info", url, "--json"]) == 0


def test_racing_commits_of_one_shard_leave_exactly_one_marker(url):
    _, shards = builders.random_store(url, num_shards=1, with_plan=True)
    bucket = Bucket(classify_store(url))
    bucket.delete(shard_marker("shard-000000"))  # uncommitted again; the first attempt's objects stay behind
    writers = [BucketWriter(classify_store(url)) for _ in range(4)]
    start = threading.Barrier(len(writers))
    results = [None] * len(writers)

    def commit(i):
        start.wait()
        results[i] = writers[i].write_shard("shard-000000", shards["shard-000000"], Attempt(f"race{i}", 1))

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(len(writers))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    committed = [result is not None for result in results]
    assert sorted(committed) == [False, False, False, True]
    winner = committed.index(True)
    assert results[winner] == open_store(url).commit("shard-000000")  # the writer returns what it committed
    markers = [k for k in _keys(url, layout.SHARDS_DIR) if k.endswith(layout.COMMIT_RECORD)]
    assert markers == [f"{layout.SHARDS_DIR}/shard-000000/{layout.COMMIT_RECORD}"]
    assert json.loads(bucket.get(markers[0]))["attempt"] == f"race{winner}-1"
    racers = {k.split("/")[2] for k in _keys(url, ATTEMPTS_DIR) if k.split("/")[2].startswith("race")}
    assert racers == {f"race{winner}-1"}, "a writer that lost the race left its objects"
    report = verify_store(url)
    assert report.ok and len(report.leftovers) == 1  # the first attempt, which no marker names now
    assert cli(["verify", url, "--clean"]) == 0
    assert verify_store(url).leftovers == []


def test_a_claim_against_a_revoke_exactly_one_wins(url):
    _, shards = builders.random_store(url, num_shards=2)
    bucket = Bucket(classify_store(url))
    bucket.delete(shard_marker("shard-000001"))
    fence = BucketFence(bucket, run="r1").open()
    assert fence.revoke("shard-000001", fence.attempt(1))
    with pytest.raises(ShardFenced, match="revoked"):
        BucketWriter(classify_store(url)).write_shard("shard-000001", shards["shard-000001"], fence.attempt(1))
    assert not bucket.exists(shard_marker("shard-000001"))
    assert not [k for k in _keys(url, ATTEMPTS_DIR) if "/r1-1/" in k], "a revoked attempt left its objects"
    claim(bucket, "shard-000001", fence.attempt(2))  # claimed first: the driver's revoke loses
    assert not fence.revoke("shard-000001", fence.attempt(2))
    outcomes = []  # and racing: one of the two wins
    barrier = threading.Barrier(2)

    def revoke():
        barrier.wait()
        outcomes.append(("revoke", fence.revoke("shard-000001", fence.attempt(3))))

    def take():
        barrier.wait()
        try:
            claim(bucket, "shard-000001", fence.attempt(3))
            outcomes.append(("claim", True))
        except ShardFenced:
            outcomes.append(("claim", False))

    threads = [threading.Thread(target=revoke), threading.Thread(target=take)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(won for _, won in outcomes) == [False, True], outcomes


def test_the_lease_is_refused_while_live_taken_over_after_expiry_and_a_stale_renewal_refused(url):
    builders.random_store(url, num_shards=1)
    bucket = Bucket(classify_store(url))
    with StoreLease(bucket, job="extract run A", seconds=300):
        with pytest.raises(StoreLockedError, match="extract run A"):
            StoreLease(bucket, job="extract run B").acquire()
        assert cli(["verify", url, "--clean"]) == 1  # the clean needs the lease
    stale = StoreLease(bucket, job="stalled", seconds=0.0).acquire()  # lapses at once
    taker = StoreLease(bucket, job="taker", seconds=300).acquire()
    with pytest.raises(LeaseLost, match="taken over"):
        stale.renew()
    taker.renew()
    stale.release()  # no longer its own: leaves the taker's lease alone
    with pytest.raises(StoreLockedError, match="taker"):
        StoreLease(bucket, job="third").acquire()
    taker.release()
    StoreLease(bucket, job="after release").acquire().release()


_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import builders
builders.random_store({url!r}, num_shards=2)
"""


@pytest.mark.parametrize("point", ["claim", "marker"])
def test_a_writer_killed_between_its_data_and_its_marker_leaves_garbage_the_rerun_ignores_and_cleans(url, point):
    env = dict(os.environ, **{KILL_BEFORE_ENV: point}, PYTHONPATH=str(REPO))
    died = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tests=str(REPO / "tests"), url=url)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    dead = {k.split("/")[2] for k in _keys(url, ATTEMPTS_DIR)}
    assert len(dead) == 1 and not [k for k in _keys(url, layout.SHARDS_DIR) if k.endswith(layout.COMMIT_RECORD)]
    assert open_store(url).committed_shards() == []  # nothing half-visible
    _, shards = builders.random_store(url, num_shards=2)  # the rerun: same root, same plan
    store = open_store(url)
    assert store.committed_shards() == ["shard-000000", "shard-000001"] and store.num_samples() == 8
    assert torch.equal(store.read_shard("shard-000000").sample(0).hidden[1], shards["shard-000000"][0].hidden[1])
    report = verify_store(url)
    assert report.ok and [name.split(".")[1] for name in report.leftovers] == sorted(dead)
    assert cli(["verify", url, "--clean"]) == 0
    assert not {k.split("/")[2] for k in _keys(url, ATTEMPTS_DIR)} & dead
    assert verify_store(url).ok and verify_store(url).leftovers == []


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_an_object_damaged_in_the_bucket_is_named_by_verify_and_repair_deletes_its_marker(url, damage, capsys):
    writer, shards = builders.random_store(url, num_shards=3)
    store = open_store(url)
    prefix = f"{ATTEMPTS_DIR}/shard-000001/{store.attempt('shard-000001')}"
    key = f"{prefix}/{layout.layer_array(3)}/{layout.chunk_file(2)}"
    bucket = Bucket(classify_store(url))
    if damage == "corrupt":
        data = bytearray(bucket.get(key))
        data[len(data) // 2] ^= 0x40
        bucket.put(key, bytes(data))
    else:
        bucket.delete(key)
    capsys.readouterr()
    assert cli(["verify", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(p["shard"], p["file"]) for p in report["problems"]] == [("shard-000001", "layer_3/c/0/0")]
    assert ("bytes changed" if damage == "corrupt" else "file missing") in report["problems"][0]["what"]
    assert cli(["verify", url, "--repair"]) == 3  # damage gone: intact, incomplete until the rerun
    assert "deleted the commit markers of 1 damaged shard(s): shard-000001" in capsys.readouterr().out
    assert not bucket.exists(shard_marker("shard-000001"))
    assert open_store(url).committed_shards() == ["shard-000000", "shard-000002"]
    assert writer.write_shard("shard-000001", shards["shard-000001"])  # what the rerun of the job does
    assert cli(["verify", url, "--clean"]) == 0
    assert not [k for k in _keys(url, ATTEMPTS_DIR) if k.startswith(prefix)]
    assert verify_store(url).ok


def test_checksums_only_on_a_bucket_compares_the_kept_etags_and_reads_nothing(url, capsys):
    """The uploader records the ETag each file's upload was answered with; `verify
    --checksums-only` lists the shard's objects and compares, reading no object: an
    object replaced after the commit (same size, other bytes) is named; a marker that
    recorded no ETags (an older store) is read and checked by crc32c instead, and the
    report says so."""
    from store_schema.commit.records import parse_record, record_bytes
    from store_schema.objstore.keys import MARKER_ETAGS

    builders.random_store(url, num_shards=3)
    bucket = Bucket(classify_store(url))
    report = verify_store(url, checksums_only=True)
    assert report.ok and report.kept_checksum_shards == report.shards_checked == 3 and report.bytes_read == 0
    key = (
        f"{ATTEMPTS_DIR}/shard-000001/{open_store(url).attempt('shard-000001')}/{layout.layer_array(3)}/"
        f"{layout.chunk_file(2)}"
    )
    data = bytearray(bucket.get(key))
    data[len(data) // 2] ^= 0x40
    bucket.put(key, bytes(data))
    report = verify_store(url, checksums_only=True)
    assert report.bytes_read == 0 and [(p["shard"], p["file"]) for p in report.problems] == [
        ("shard-000001", "layer_3/c/0/0")
    ]
    assert report.problems[0]["what"].startswith("object replaced after its commit: ETag")
    assert not verify_store(url).ok  # and read in full, by its crc32c
    marker = parse_record(bucket.get(shard_marker("shard-000002")), "marker")
    del marker[MARKER_ETAGS]
    bucket.put(shard_marker("shard-000002"), record_bytes(marker))
    capsys.readouterr()
    assert cli(["verify", url, "--checksums-only"]) == 1
    out = capsys.readouterr().out
    assert "2 shard(s) checked by the object store's kept checksums" in out
    assert "1 read and checked by crc32c: their markers recorded no ETags" in out


def test_extract_run_refuses_overwrite_of_a_url_and_spool_flags_for_a_directory(qwen3_dir, tmp_path):
    corpus = builders.write_chat_jsonl(tmp_path / "corpus.jsonl", builders.coding_chats(2))

    def run(store, *extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "extract",
                "run",
                "--model",
                str(qwen3_dir),
                "--corpus",
                str(corpus),
                "--layers",
                "1,3",
                "--store",
                store,
                *extra,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            timeout=300,
        )

    done = run("s3://bucket/jobs/store", "--overwrite")
    assert (
        done.returncode == 1 and "s3://bucket/jobs/store: a store on object storage is never overwritten" in done.stderr
    )
    assert not (tmp_path / "s3:").exists()
    done = run("s3://bucket/jobs/store", "--project-rank", "32")
    assert done.returncode == 1 and "a projected store is made in a directory for now" in done.stderr
    done = run(str(tmp_path / "store"), "--spool-size", "1GB")
    assert done.returncode == 1 and "--spool-dir / --spool-size apply to a store on object storage" in done.stderr
    assert not (tmp_path / "store").exists()
