"""Fault suite, bad input on the corpus side.

- Bad records: good records mixed with one of each kind of bad one, through the
  real `python -m extract run` (a process joining a local Ray cluster). Every good
  record is stored, every bad one is quarantined in the store's plan with its
  reason, and nothing is written outside the store directory and the job's own
  temp directory -- the record whose id is `../../x` included.
- Planning processes that cannot start, or die: the pass stops with a one-line
  reason instead of waiting forever (multiprocessing.Pool respawns them endlessly)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import coding_chats
from ray_helpers import REPO, extract_command

pytestmark = [pytest.mark.faults, pytest.mark.slow]  # fault injection, a Ray cluster
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
        (
            json.dumps({"id": "bad-noassistant", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            "no_assistant_turn",
        ),
        (
            json.dumps(
                {
                    "id": "bad-empty",
                    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
                }
            ).encode(),
            "empty_response",
        ),
        (b'{"id": "bad-utf8", "messages": [{"role": "user", "content": "caf\xc3\x28"}]}', "invalid_utf8"),
        (
            json.dumps(
                {
                    "id": "bad-huge",
                    "messages": [{"role": "user", "content": "Write it."}, {"role": "assistant", "content": huge}],
                }
            ).encode(),
            "too_long",
        ),
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
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout


def test_bad_records_quarantined_good_ones_stored_nothing_outside(ray_cluster, qwen3_dir, tmp_path):
    from store_schema import Store

    corpus = tmp_path / "corpus.jsonl"
    good_ids, expected = _corpus(corpus)
    store = tmp_path / "a" / "b" / "store"  # '../../x' from anywhere inside would land in tmp_path
    store.parent.mkdir(parents=True)
    job_tmp = tmp_path / "job-tmp"  # the job's own temp root: other processes may write to /tmp meanwhile
    job_tmp.mkdir()
    before, before_repo = _tree(tmp_path, skip=job_tmp), _repo_status()

    command = extract_command(
        qwen3_dir,
        corpus,
        store,
        ray_cluster,
        layers=[1, 3],
        shard_tokens=600,
        batch_tokens=1200,
        extra=["--drop-long", "--max-length", str(MAX_LENGTH)],
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(job_tmp))
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

    after = _tree(tmp_path, skip=job_tmp)
    assert {k: v for k, v in after.items() if not k.startswith("a/b/store")} == {
        k: v for k, v in before.items() if not k.startswith("a/b/store")
    }, "something was written outside the store"
    assert set(os.listdir(job_tmp)) <= {"ray"}  # in the job's temp root: Ray's own session directory at most
    assert not list(tmp_path.rglob("x"))  # (a stray /tmp/x would show in the listing above)
    assert _repo_status() == before_repo  # the job's working directory (Ray ships it to the workers)


# --------------------------------------------------------------------------- planning processes


_PLAN_SCRIPT = """
import sys
from transformers import AutoTokenizer
from extract.errors import ExtractError
from extract.extraction.planning import build_plan
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
try:
    plan = build_plan(sys.argv[1], sys.argv[3], tokenizer=tokenizer, workers=2, chunk_records=8)
except ExtractError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(1)
print(f"planned {plan.num_samples} samples", flush=True)
"""


def _planning(corpus: Path, tokenizer_dir: Path, worker_tokenizer: Path) -> subprocess.Popen:
    """`build_plan` with 2 processes in a process of its own: the parent has its
    tokenizer from `tokenizer_dir`, the planning processes load `worker_tokenizer`."""
    return subprocess.Popen(
        [sys.executable, "-c", _PLAN_SCRIPT, str(corpus), str(tokenizer_dir), str(worker_tokenizer)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_planning_process_that_cannot_start_stops_the_pass_with_its_reason(tokenizer_dir, tmp_path):
    """Issue 15.3: the planning processes cannot load their tokenizer (here: an empty
    directory). Before, the pool respawned them forever and the pass never ended
    (the timeout below is a hang guard)."""
    from builders import write_chat_jsonl

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(40, seed=2))
    broken = tmp_path / "no-tokenizer"
    broken.mkdir()
    planning = _planning(corpus, tokenizer_dir, broken)
    try:
        out, err = planning.communicate(timeout=240)
    finally:
        planning.kill()
    assert planning.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: a planning process failed to start: ") and str(broken) in lines[-1], err
    assert "Traceback" not in err


def test_a_planning_process_that_dies_stops_the_pass(tokenizer_dir, tmp_path):
    """A planning process SIGKILLed mid-pass (as the OOM killer would): the pass stops
    with a message naming the way out, instead of waiting for a chunk that never comes."""
    from builders import write_chat_jsonl

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(1500, seed=4))
    planning = _planning(corpus, tokenizer_dir, tokenizer_dir)
    try:
        children = []
        for _ in range(3000):  # poll bound (a hang guard, not a timing)
            children = _children(planning.pid)
            if len(children) >= 2 or planning.poll() is not None:
                break
            time.sleep(0.05)
        assert children, "the planning processes never started"
        os.kill(children[-1], signal.SIGKILL)
        out, err = planning.communicate(timeout=240)
    finally:
        planning.kill()
    if planning.returncode == 0:
        pytest.skip(f"the pass finished before the kill landed ({out.strip()})")
    assert planning.returncode == 1, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: a planning process died or could not start"), err
    assert "--plan-workers 1" in err


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (spawned planning processes), oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)
