"""Issue 33, the training side: `train fit` and `train eval` from a store on object
storage (a real moto_server on 127.0.0.1, conftest's `s3_server` / `url`), through the
local shard cache (`data.cache_dir`, `data.cache_size`): the same losses as from a
local copy of the store, with a cache holding the whole store or only part of it; the
cache directory is a valid partial store that a second `fit` reuses after checking
it; a shard damaged in the bucket is refused naming it; credentials never reach the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import builders
import pytest
import tiny
from paths import REPO

from store_schema import Store, layout
from store_schema.location import classify_store
from store_schema.objstore.bucket import Bucket
from store_schema.objstore.keys import ATTEMPTS_DIR
from store_schema.stores import open_store
from store_schema.tools.local_copy import LocalCopyError, copied_shards, open_local_copy
from store_schema.tools.verify import verify_store
from train.cli import main
from train.data.cache import CacheTooSmall, pinned_shards

pytestmark = pytest.mark.slow
SHAPE = dict(num_target_layers=6, hidden_size=64, vocab_size=512)  # the tiny Qwen3 target (qwen3_dir)
SHARDS = 5
TINY = tiny.drafter_sets(
    "train.grad_accumulation=1",
    "eval.every=0",
    "data.heldout_fraction=0.0",
    "data.buffer_shards=2",
    "train.checkpoint_every=0",
    "train.epochs=2",
    heads=True,
)


def make_store(where, target_dir, seed=3):
    return builders.random_store(
        where, num_shards=SHARDS, samples_per_shard=3, target_dir=target_dir, seed=seed, **SHAPE
    )


def fit(store, target, out, *extra) -> int:
    return main(
        ["fit", "--store", str(store), "--target", str(target), "--out", str(out), *tiny.cli_sets((*TINY, *extra))]
    )


def losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]
    found = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert found, "the run logged no loss"
    return found


def shard_bytes(store) -> int:
    opened = open_store(store)
    return max(opened.commit(name).disk_bytes for name in opened.committed_shards())


@pytest.fixture
def stores(url, qwen3_dir, tmp_path):
    """The same store twice: in the bucket and in a local directory."""
    make_store(url, qwen3_dir)
    make_store(tmp_path / "local", qwen3_dir)
    return url, tmp_path / "local"


@pytest.mark.parametrize("budget", ["unbounded", "small"])
def test_fit_from_the_bucket_through_the_cache_gives_the_losses_of_fit_from_a_local_copy(
    stores, qwen3_dir, tmp_path, budget, capsys
):
    url, local = stores
    cache = tmp_path / "cache"
    # small: room for one pinned shard beside two streamed ones
    size = [] if budget == "unbounded" else [f"data.cache_size={int(shard_bytes(local) * 3.5)}"]
    assert fit(local, qwen3_dir, tmp_path / "local-run") == 0
    capsys.readouterr()
    assert fit(url, qwen3_dir, tmp_path / "bucket-run", f"data.cache_dir={cache}", *size) == 0
    err = capsys.readouterr().err
    assert losses(tmp_path / "bucket-run") == losses(tmp_path / "local-run")
    assert "0 re-read in full; each shard's commit record and every file's crc32c are checked as it arrives" in err
    held = copied_shards(cache)  # the cache is a store the normal reader and verify read
    report = verify_store(cache)
    assert report.status == ("intact" if budget == "unbounded" else "incomplete") and report.shards_checked == len(held)
    if budget == "unbounded":
        assert held == open_store(url).committed_shards()
        assert "5 of 5 shard(s) pinned" in err and "0 shard(s) reused after checking, 5 fetched" in err
    else:
        on_disk = sum(Store(cache).commit(name).disk_bytes for name in held)
        assert 0 < len(held) < SHARDS and on_disk <= int(shard_bytes(local) * 3.5), held  # only the pinned ones
    assert fit(url, qwen3_dir, tmp_path / "again", f"data.cache_dir={cache}", *size) == 0  # a restart
    err = capsys.readouterr().err
    assert f"{len(held)} shard(s) reused after checking" in err, err
    assert losses(tmp_path / "again") == losses(tmp_path / "local-run")


def test_a_cached_shard_damaged_on_local_disk_is_fetched_again_at_restart(stores, qwen3_dir, tmp_path, capsys):
    url, _ = stores
    cache = tmp_path / "cache"
    assert fit(url, qwen3_dir, tmp_path / "run", f"data.cache_dir={cache}", "train.max_steps=1") == 0
    chunk = layout.shard_dir(cache, "shard-000002") / layout.layer_array(3) / layout.chunk_file(2)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    assert fit(url, qwen3_dir, tmp_path / "again", f"data.cache_dir={cache}") == 0
    assert f"{SHARDS - 1} shard(s) reused after checking, 1 fetched" in capsys.readouterr().err
    assert verify_store(cache).ok and copied_shards(cache) == open_store(url).committed_shards()


def test_a_shard_damaged_in_the_bucket_is_refused_naming_it(stores, qwen3_dir, tmp_path, capsys):
    url, _ = stores
    store = open_store(url)
    key = f"{ATTEMPTS_DIR}/shard-000001/{store.attempt('shard-000001')}/{layout.layer_array(1)}/{layout.chunk_file(2)}"
    bucket = Bucket(classify_store(url))
    data = bytearray(bucket.get(key))
    data[len(data) // 2] ^= 0x40
    bucket.put(key, bytes(data))
    capsys.readouterr()
    assert fit(url, qwen3_dir, tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}") == 1
    err = capsys.readouterr().err
    assert "shard shard-000001: layer_1/c/0/0: crc32c" in err and "(fetched 2 times)" in err, err
    assert "shard-000001" not in copied_shards(tmp_path / "cache")  # never committed into the cache


def test_a_cache_too_small_for_one_shard_or_of_another_store_is_refused(stores, qwen3_dir, tmp_path):
    url, local = stores
    with pytest.raises(CacheTooSmall, match="cannot hold the largest shard"):
        pinned_shards({"a": 100, "b": 300}, 200)
    sizes = {"a": 100, "b": 300, "c": 300, "d": 100}
    assert pinned_shards(sizes, 700) == (["a"], 600)  # room left for 2 of the largest
    assert pinned_shards(sizes, 500) == (["a"], 400)  # or for 1
    assert pinned_shards(sizes, 800) == (["a", "b", "c", "d"], 0)  # all fit: all pinned
    assert pinned_shards({"a": 100, "b": 300}, None) == (["a", "b"], 0)
    open_local_copy(tmp_path / "cache", open_store(url))
    other = builders.random_store(tmp_path / "other", num_shards=1, samples_per_shard=2, seed=9, **SHAPE)[0]
    with pytest.raises(LocalCopyError, match="holds a copy of another store"):
        open_local_copy(tmp_path / "cache", Store(other.path))


def test_eval_reads_the_bucket_store_and_no_credential_reaches_the_run(stores, qwen3_dir, tmp_path, capsys):
    url, _ = stores
    secret = "Secret-Key-7f3a9c"  # moto takes any key; this one must appear nowhere
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY=secret, PYTHONPATH=str(REPO))
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "train",
        "fit",
        "--store",
        url,
        "--target",
        str(qwen3_dir),
        "--out",
        str(run),
        *tiny.cli_sets((*TINY, "train.max_steps=2", f"data.cache_dir={tmp_path / 'cache'}")),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    evaluated = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "eval",
            "--store",
            url,
            "--drafter",
            str(tmp_path / "export"),
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
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    from_bucket = json.loads(evaluated.stdout.splitlines()[-1])
    assert from_bucket["samples"] == 2
    assert url in evaluated.stderr
    # Issue 48.10: through a shard cache, fit's (every shard already there) or a new one (fetched once)
    for cache, fetched in ((tmp_path / "cache", 0), (tmp_path / "eval-cache", None), (tmp_path / "eval-cache", 0)):
        assert (
            main(
                [
                    "eval",
                    "--store",
                    url,
                    "--drafter",
                    str(tmp_path / "export"),
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
                    "--cache-dir",
                    str(cache),
                ]
            )
            == 0
        )
        cached = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert cached["tau"] == from_bucket["tau"] and cached["per_sample"] == from_bucket["per_sample"]
        assert (
            cached["cached_shards_fetched"] == fetched if fetched is not None else cached["cached_shards_fetched"] >= 1
        )
    written = [p for p in run.rglob("*") if p.is_file()] + [p for p in (tmp_path / "export").rglob("*") if p.is_file()]
    for text in (
        done.stdout,
        done.stderr,
        evaluated.stdout,
        evaluated.stderr,
        *(p.read_bytes().decode("latin-1") for p in written),
    ):
        assert secret not in text
    assert json.loads((run / "config.json").read_text())["store"] == url


def test_a_cache_smaller_than_two_shards_fetches_each_shard_once_per_epoch(qwen3_dir, tmp_path, capsys):
    """Issue 48.10: with room for one shard and a half, nothing is pinned and every
    shard is streamed through: fetched once each epoch, never twice in one."""
    store = make_store(tmp_path / "store", qwen3_dir)[0].path
    size = int(shard_bytes(store) * 1.5)
    epochs = 3
    assert (
        fit(
            store,
            qwen3_dir,
            tmp_path / "run",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"data.cache_size={size}",
            f"train.epochs={epochs}",
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"0 of {SHARDS} shard(s) pinned" in err, err
    closing = [line for line in err.splitlines() if "reused after checking" in line]
    assert len(closing) == 1, closing
    fetched = int(closing[0].split("reused after checking, ")[1].split()[0])
    # Each epoch reads every shard once; a shard read last in one epoch and first in the next is kept between.
    assert SHARDS <= fetched <= epochs * SHARDS, closing
