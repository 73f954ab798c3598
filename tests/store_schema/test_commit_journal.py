"""Issue 47.4: the store knows what it committed. Each commit is entered in the
store's journal (`commits/NAME.json`, on object storage too), so a committed shard
whose directory (or objects) vanished is damage naming it (exit 1), not an
unfinished job; `verify --repair` forgets it and the store is incomplete again
(exit 3): the next `extract run` extracts it. A damaged journal entry is named."""

from __future__ import annotations

import json
import shutil

import builders
import pytest

from store_schema import layout
from store_schema.__main__ import main as cli
from store_schema.objstore.bucket import Bucket
from store_schema.objstore.keys import shard_marker
from store_schema.tools.verify import verify_store


def test_every_commit_is_journaled_and_a_vanished_shard_is_damage(tmp_path, capsys):
    store = tmp_path / "s"
    builders.random_store(store, num_shards=3, samples_per_shard=2)
    assert sorted(p.name for p in (store / layout.COMMITS_DIR).iterdir()) == [
        "shard-000000.json",
        "shard-000001.json",
        "shard-000002.json",
    ]
    shutil.rmtree(store / layout.SHARDS_DIR / "shard-000001")  # an rm -rf, a bad sync
    assert cli(["verify", str(store), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "damaged" and report["missing_shards"] == 0
    assert [(p["shard"], p["file"]) for p in report["problems"]] == [("shard-000001", "commits/shard-000001.json")]
    assert "committed shard gone" in report["problems"][0]["what"]

    assert cli(["verify", str(store), "--repair"]) == 3  # forgotten: a rerun of `extract run` extracts it
    assert "now incomplete: 2 of 3 shards committed" in capsys.readouterr().out
    assert not (store / layout.COMMITS_DIR / "shard-000001.json").exists()
    assert verify_store(store).status == "incomplete"

    entry = store / layout.COMMITS_DIR / "shard-000002.json"
    entry.write_bytes(entry.read_bytes().replace(b"shard-000002", b"shard-000009"))
    problems = verify_store(store).problems
    assert any(p["file"] == "commits/shard-000002.json" and "edited or corrupted" in p["what"] for p in problems)


@pytest.mark.slow  # moto
def test_a_vanished_shard_on_object_storage_is_damage_too(url, capsys):
    builders.random_store(url, num_shards=2, samples_per_shard=2)
    bucket = Bucket(url)
    assert sorted(bucket.list(layout.COMMITS_DIR)) == ["commits/shard-000000.json", "commits/shard-000001.json"]
    bucket.delete(shard_marker("shard-000000"))  # the marker, and with it the shard, gone
    assert cli(["verify", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(p["shard"], p["file"]) for p in report["problems"]] == [("shard-000000", "commits/shard-000000.json")]
    assert cli(["verify", url, "--repair"]) == 3
    assert "commits/shard-000000.json" not in bucket.list(layout.COMMITS_DIR)


def test_info_counts_a_committed_shard_by_its_record_and_the_rest_as_found(tmp_path):
    """Issue 47.4: `info`'s disk bytes at many shards without walking every shard's
    files: the same figure as walking the whole store, leftovers and commit-less
    directories included."""
    from store_schema.commit.records import on_disk_bytes
    from store_schema.stores import open_store

    store = tmp_path / "s"
    builders.random_store(store, num_shards=3, samples_per_shard=2)
    (store / ".staging" / "leftover").mkdir(parents=True)
    (store / ".staging" / "leftover" / "x").write_bytes(b"half" * 100)
    (store / layout.SHARDS_DIR / "shard-000002" / layout.COMMIT_RECORD).unlink()  # no longer committed
    assert open_store(store).stored_bytes() == on_disk_bytes(store)
