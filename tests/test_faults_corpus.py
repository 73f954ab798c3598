"""Fault suite, bad corpus: good records mixed with one of each kind of bad one,
through the real `python -m extract run` (a process joining a local Ray cluster).
Every good record is stored, every bad one is quarantined in the store's plan with
its reason, and nothing is written outside the store directory -- the record whose
id is `../../x` included."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from builders import coding_chats
from ray_helpers import REPO, extract_command, ray_cluster  # noqa: F401 - ray_cluster is a fixture

pytestmark = pytest.mark.faults
MAX_LENGTH = 1024


def _corpus(path: Path) -> tuple[list[str], dict[int, str]]:
    """(good ids, record index -> expected quarantine reason); one record per line."""
    good = coding_chats(8, seed=5)
    chat = good[0]["messages"]
    huge = "\n".join(f"    value_{i} = compute({i}) + {i} * offset" for i in range(400))
    lines: list[tuple[bytes, str | None]] = [(json.dumps(r).encode(), None) for r in good[:3]]
    lines += [
        (b'{"id": "bad-truncated", "messages": [{"role": "user", "con', "malformed_json"),
        (json.dumps(["a", "list", "not", "an", "object"]).encode(), "wrong_type"),
        (json.dumps({"id": "bad-types", "messages": "not a list"}).encode(), "wrong_type"),
        (json.dumps({"id": "bad-noassistant", "messages": [{"role": "user", "content": "hi"}]}).encode(),
         "no_assistant_turn"),
        (json.dumps({"id": "bad-empty", "messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": ""}]}).encode(),
         "empty_response"),
        (b'{"id": "bad-utf8", "messages": [{"role": "user", "content": "caf\xc3\x28"}]}', "invalid_utf8"),
        (json.dumps({"id": "bad-huge", "messages": [{"role": "user", "content": "Write it."},
                                                    {"role": "assistant", "content": huge}]}).encode(), "too_long"),
        (json.dumps({"id": "../../x", "messages": chat}).encode(), "unsafe_id"),
    ]
    lines += [(json.dumps(r).encode(), None) for r in good[3:]]
    path.write_bytes(b"\n".join(line for line, _ in lines) + b"\n")
    return [r["id"] for r in good], {i: reason for i, (_, reason) in enumerate(lines) if reason}


def _tree(root: Path, skip: Path | None = None) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = here / name
            if skip is not None and p == skip:
                continue
            st = p.lstat()  # a directory's own mtime changes when the store is made in it
            out[str(p.relative_to(root))] = "dir" if p.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def _repo_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored=no"], cwd=REPO,
                          capture_output=True, text=True).stdout


def test_bad_records_quarantined_good_ones_stored_nothing_outside(ray_cluster, qwen3_dir, tmp_path):
    from store_schema import Store

    corpus = tmp_path / "corpus.jsonl"
    good_ids, expected = _corpus(corpus)
    store = tmp_path / "a" / "b" / "store"  # '../../x' from anywhere inside would land in tmp_path
    store.parent.mkdir(parents=True)
    tmp_root = Path(tempfile.gettempdir())
    before_tmp, before, before_repo = set(os.listdir(tmp_root)), _tree(tmp_path), _repo_status()

    command = extract_command(qwen3_dir, corpus, store, ray_cluster, layers=[1, 3], shard_tokens=600,
                              batch_tokens=1200, extra=["--drop-long", "--max-length", str(MAX_LENGTH)])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    reader = Store(store)
    stored = sorted(sid for name in reader.committed_shards() for sid in reader.read_shard(name).sample_ids)
    assert stored == sorted(good_ids)  # every good record, once; no bad one
    quarantined = {q.record_index: q.reason for q in reader.plan().quarantined}
    assert quarantined == expected
    assert report["quarantined"] == len(expected) == 8
    assert sum(report["quarantined_by_reason"].values()) == len(expected)

    after = _tree(tmp_path, skip=store)
    assert {k: v for k, v in after.items() if not k.startswith("a/b/store")} == {
        k: v for k, v in before.items() if not k.startswith("a/b/store")}, "something was written outside the store"
    assert set(os.listdir(tmp_root)) - before_tmp <= {"ray"}  # Ray's own session directory at most
    assert not list(tmp_path.rglob("x"))  # (a stray /tmp/x would show in the listing above)
    assert _repo_status() == before_repo  # the job's working directory (Ray ships it to the workers)
