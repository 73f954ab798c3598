"""`extract run` at many shards: a real extraction of N one-sample shards, then the
same command again, which finds every shard committed and has nothing to do
(scale_bench's `--rerun-shards` / `--bucket-rerun-shards`).

The target is a tiny random Qwen3 (hidden 64, 2 layers) and each record a short chat,
so each of the N shards is one ~40-token sample (`--block-size 4`: 8 loss tokens
suffice): what is timed is the rerun's work that grows with the shard count (the
plan's check, the listing of committed shards, the report), not the model's. The
rerun runs as a user runs it, in a fresh process, with the page cache emptied first
(local stores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import Timer, drop_page_cache

REPO = Path(__file__).resolve().parents[1]


def inputs(root: Path, records: int) -> tuple[Path, Path]:
    """A tiny target with its tokenizer, and a corpus of `records` short chats."""
    sys.path.insert(0, str(REPO / "tests"))
    import builders  # the tests' tokenizer and model builders: nothing downloaded

    model = root / "model"
    builders.build_model(model, kind="qwen3", vocab_size=512, hidden_size=64, num_layers=2, head_dim=16)
    builders.build_tokenizer(model)
    chats = [
        {
            "id": f"r{i:06d}",
            "messages": [
                {"role": "user", "content": f"What is {i} plus one?"},
                {"role": "assistant", "content": f"{i} plus one is {i + 1}, and {i + 1} plus one is {i + 2}."},
            ],
        }
        for i in range(records)
    ]
    return model, builders.write_chat_jsonl(root / "corpus.jsonl", chats)


def extract_argv(model: Path, corpus: Path, store: str) -> list[str]:
    """`extract run` writing one shard per record (each record's ~40 tokens exceed --shard-tokens)."""
    return [
        sys.executable,
        "-m",
        "extract",
        "run",
        "--model",
        str(model),
        "--corpus",
        str(corpus),
        "--store",
        store,
        "--layers",
        "0",
        "--max-length",
        "128",
        "--block-size",
        "4",
        "--shard-tokens",
        "8",
        "--workers",
        "2",
        "--device",
        "cpu",
        "--batch-shards",
        "64",
        "--progress-interval",
        "30",
    ]


def run(argv: list[str]) -> tuple[dict, str]:
    """The command's JSON report (its last stdout line) and its stderr; raises on failure."""
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:5])} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def rerun_figures(root: Path, shards: int, store: str, prefix: str) -> dict:
    """Extract `shards` one-sample shards into `store` (a directory or s3:// URL), then
    time the rerun; `{prefix}_build_s`, `{prefix}_rerun_s`, `{prefix}_shards`."""
    root.mkdir(parents=True, exist_ok=True)
    model, corpus = inputs(root, shards)
    argv = extract_argv(model, corpus, store)
    with Timer() as built:
        report, _ = run(argv)
    if report["shards"] != shards:
        raise RuntimeError(f"expected {shards} shards, the plan made {report['shards']}")
    if not store.startswith("s3://"):
        drop_page_cache(Path(store))
    with Timer() as rerun:
        _, stderr = run(argv)
    if "nothing to do" not in stderr:
        raise RuntimeError(f"the rerun had work to do: {stderr[-2000:]}")
    return {
        f"{prefix}_shards": shards,
        f"{prefix}_build_s": round(built.seconds, 1),
        f"{prefix}_rerun_s": round(rerun.seconds, 2),
    }
