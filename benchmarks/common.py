"""Shared benchmark plumbing: cold-cache reads, results table, machine line, smoke flag,
and an S3-compatible server on loopback (also the tests' `s3_server` fixture)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"


def tiny_target(path: Path, hidden: int, vocab: int, layers: int) -> Path:
    """A Qwen3 target of random weights saved with save_pretrained: what `fit` needs
    beside a store (its embedding and head) in benchmarks that time the trainer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(str(path))
    return path


def drop_page_cache(*roots) -> str:
    """Evict every file below `roots` from the page cache. posix_fadvise(DONTNEED)
    needs no special rights; `drop_caches` is tried too where allowed."""
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                path = os.path.join(dirpath, name)
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "posix_fadvise(DONTNEED) + drop_caches"
    except OSError:
        return "posix_fadvise(DONTNEED)"


@contextlib.contextmanager
def loopback_s3():
    """A moto_server (the test extra's) on a free 127.0.0.1 port, and the standard AWS
    variables pointing at it (test credentials only) for this process and its children,
    restored afterwards. Yields the endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    variables = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("moto_server did not start")
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def new_bucket(endpoint: str) -> str:
    """Create a fresh bucket on the server at `endpoint`; its name."""
    import boto3

    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def machine() -> str:
    import torch

    return f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, py {platform.python_version()}"


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


SMOKE_HELP = "tiny sizes, seconds: checks the benchmark runs (tests/test_benchmarks.py); RESULTS.md untouched"


def add_smoke_flag(parser) -> None:
    """Every benchmark's `--smoke`: the suite runs each one so none can rot unnoticed."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def append_results(title: str, rows: list[tuple[str, str, str]], figures: dict, smoke: bool = False) -> None:
    """Append a section (figure, goal, measured) with machine and command to RESULTS.md,
    then print the figures as one JSON line. A smoke run only prints: its tiny sizes
    measure nothing worth keeping, and the suite must not edit the repository."""
    if smoke:
        print(json.dumps(figures))
        return
    lines = [
        f"\n## {title} ({time.strftime('%Y-%m-%d %H:%M')})\n",
        f"Machine: {machine()}. Command: `{command()}`\n",
        "| figure | goal | measured |",
        "| --- | --- | --- |",
        *[f"| {name} | {goal} | {value} |" for name, goal, value in rows],
        "",
    ]
    with RESULTS.open("a") as f:
        if RESULTS.stat().st_size == 0:
            f.write("# Benchmark results\n")
        f.write("\n".join(lines))
    print(json.dumps(figures))
