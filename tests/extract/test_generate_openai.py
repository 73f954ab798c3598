"""`python -m extract generate --engine openai` against a real vLLM server (its CPU
build) on loopback, on a real local Ray cluster: greedy replies equal the hf engine's
token for token, and the server's own ids; the server killed mid-job and the job
rerun give the corpus an undisturbed run writes, asking only for replies it lacks;
one of two endpoints dying mid-job leaves the other to finish; an endpoint down at
start and a server of another model are refused before any request; a request
that times out is retried, then its record quarantined with the reason. And
benchmarks/generate_bench.py's smoke, on this module's server (`--endpoint --model`).

One vLLM server serves the whole module (~30-60 s to start); the kill test starts a
second one. vLLM's CPU attention needs a head dim >= 32, so the target here is the
tests' tiny Qwen3 with head_dim 32."""

from __future__ import annotations

import shutil
import threading
import time

import builders
import pytest
import served
from benchmark_smoke import SMOKE_KEYS, smoke
from ray_helpers import execution_of

MAX_NEW = 16
pytestmark = pytest.mark.slow  # every test here talks to a vLLM server process


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory, tokenizer_dir):
    path = tmp_path_factory.mktemp("served-qwen3")
    builders.build_model(path, kind="qwen3", vocab_size=512, head_dim=32)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="module")
def server(served_dir, tmp_path_factory):
    vllm = served.VLLMServer(served_dir, tmp_path_factory.mktemp("vllm") / "server.log", served.vllm_python())
    yield vllm
    vllm.kill()


def _records(count: int = 4) -> list[dict]:
    return builders.generate_records(count)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return builders.write_chat_jsonl(tmp_path_factory.mktemp("gen") / "chats.jsonl", _records())


def _config(model, corpus, out, endpoints=None, **overrides):
    from extract.generate.config import ENGINES, GenerateConfig, GenerationSettings, ServerConfig
    from extract.jobs.settings import FaultInjection

    server = None if endpoints is None else ServerConfig(endpoints=tuple(endpoints), **overrides.pop("server", {}))
    settings = GenerationSettings(
        **{
            "max_new_tokens": MAX_NEW,
            "shard_records": 3,
            "max_length": 512,
            "thinking": "off",
            "engine": ENGINES["hf" if server is None else "openai"],
            **overrides.pop("settings", {}),
        }
    )
    return GenerateConfig(
        model=str(model),
        corpus=str(corpus),
        out=str(out),
        settings=settings,
        server=server,
        batch_tokens=400,
        execution=execution_of(overrides, faults=FaultInjection()),
        **overrides,
    )


def _rows(out) -> dict:
    from extract.corpus import open_corpus

    return {r["id"]: r for _, r in open_corpus(out).iter_records()}


def _files(root) -> dict:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".lock" not in p.name
    }


def _quiet(message):
    pass


def test_greedy_replies_equal_the_hf_engine_and_the_servers_ids(served_dir, server, corpus, tmp_path, ray_cluster):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from extract.generate.job import run_generate
    from extract.generate.server import fetch_json
    from extract.generate.turns import render_prompt
    from extract.generated_corpus import read_manifest

    hf = run_generate(_config(served_dir, corpus, tmp_path / "hf", address=ray_cluster), log=_quiet)
    report = run_generate(_config(served_dir, corpus, tmp_path / "oai", [server.url], address=ray_cluster), log=_quiet)
    assert report["status"] == "complete" and report["records"] == hf["records"] == 6
    assert (
        report["generated_tokens"] == hf["generated_tokens"] and report["truncated_records"] == hf["truncated_records"]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(served_dir))

    def tokens(row):  # the conversation as `extract run` tokenizes it
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]

    hf_rows, rows = _rows(tmp_path / "hf"), _rows(tmp_path / "oai")
    assert list(rows) == list(hf_rows)
    for record_id, row in rows.items():
        assert row == hf_rows[record_id], record_id
        assert tokens(row) == tokens(hf_rows[record_id])
    # Every reply came back with the server's ids, and the prompts it saw were the target tokenizer's.
    assert report["token_checked_replies"] == report["replies"] == report["turns"] == 7
    assert report["prompt_mismatched_replies"] == 0 and report["quarantined_while_generating"] == 0
    generation = read_manifest(tmp_path / "oai")["generation"]
    assert generation["engine"] == "openai" and generation["server"] == "vllm" and generation["thinking"] == "off"
    assert generation["server_version"] == fetch_json(f"{server.url}/version")["version"] == report["server_version"]
    assert generation["sampling"]["top_k"] == -1 and generation["temperature"] == 0.0
    assert not (tmp_path / "oai" / ".replies").exists()
    # The server's own ids are transformers' greedy ids, end-of-turn token and all.
    model = AutoModelForCausalLM.from_pretrained(str(served_dir), dtype=torch.float32).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record in _records()[:3]:
        messages = record["messages"][:2] if record["messages"][0]["role"] == "system" else record["messages"][:1]
        _, prompt = render_prompt(tokenizer, messages, "off")
        reply = served.chat(
            server.url,
            dict(
                model=str(served_dir),
                messages=messages,
                max_tokens=MAX_NEW,
                temperature=0,
                return_token_ids=True,
                stop_token_ids=[end],
                skip_special_tokens=False,
            ),
        )
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=end, pad_token_id=end
            )[0, len(prompt) :].tolist()
        assert reply["choices"][0]["token_ids"] == out, record.get("id")
        assert reply["prompt_token_ids"] == prompt


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
    return builders.write_chat_jsonl(tmp_path_factory.mktemp("long") / "chats.jsonl", _records(14))


@pytest.fixture(scope="module")
def reference(served_dir, server, long_corpus, tmp_path_factory, ray_cluster):
    """An undisturbed openai run of `long_corpus` (4 records a shard, 5 shards)."""
    from extract.generate.job import run_generate

    out = tmp_path_factory.mktemp("reference") / "out"
    run_generate(
        _config(served_dir, long_corpus, out, [server.url], address=ray_cluster, settings={"shard_records": 4}),
        log=_quiet,
    )
    return out


def _run_in_thread(config):
    from extract.generate.job import run_generate

    outcome = {}

    def job():
        try:
            outcome["report"] = run_generate(config, log=_quiet)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    return thread, outcome


def _journaled(out) -> tuple[int, int]:
    """(shards committed, replies journaled for shards not committed yet)."""
    from store_schema import layout

    shards = out / layout.SHARDS_DIR
    committed = len(list(shards.glob("shard-*"))) if shards.exists() else 0
    journal = out / ".replies"
    lines = sum(len(p.read_text().splitlines()) for p in journal.rglob("*.jsonl")) if journal.exists() else 0
    return committed, lines


def _wait_for_replies(out, committed: int, replies: int, thread) -> None:
    """Until `committed` shards are committed and `replies` more are journaled for
    shards not committed yet (the job is mid-way), or the job ends."""
    while thread.is_alive():
        done, lines = _journaled(out)
        if done >= committed and lines >= replies:
            return
        time.sleep(0.01)


def _kill_mid_shard(server, out, thread) -> None:
    """Kill `server` while a shard has journaled replies and is not committed: frozen
    (SIGSTOP) when that is seen, killed if it still holds once replies already on
    their way have landed, else let go on and tried again."""
    import os
    import signal

    while thread.is_alive():
        _wait_for_replies(out, committed=1, replies=1, thread=thread)
        os.killpg(server.process.pid, signal.SIGSTOP)
        time.sleep(0.5)
        done, lines = _journaled(out)
        if done >= 1 and lines >= 1:
            break
        os.killpg(server.process.pid, signal.SIGCONT)
    server.kill()


def test_a_killed_server_then_a_rerun_give_the_undisturbed_corpus(
    served_dir, server, long_corpus, reference, tmp_path, ray_cluster
):
    """One reply in flight at a time on a second server, killed (SIGKILL, engine and
    all) once a shard is committed and another has replies journaled: the job stops
    saying how to resume, shards kept. The rerun, answered by a fresh server of the
    same build and model (the module's), asks only for the replies it lacks."""
    from extract.errors import ExtractError
    from extract.generate.job import run_generate

    doomed = served.VLLMServer(served_dir, tmp_path / "doomed.log", served.vllm_python())
    out = tmp_path / "out"
    config = _config(
        served_dir,
        long_corpus,
        out,
        [doomed.url],
        address=ray_cluster,
        settings={"shard_records": 4},
        server={"concurrency": 1},
    )
    thread, outcome = _run_in_thread(config)
    try:
        _kill_mid_shard(doomed, out, thread)
    finally:
        doomed.kill()
    thread.join(300)
    assert isinstance(outcome.get("error"), ExtractError), outcome
    message = str(outcome["error"])
    assert "every endpoint is down" in message and doomed.url in message and "rerun the same command" in message
    assert (out / ".replies").exists()
    rerun = run_generate(
        _config(served_dir, long_corpus, out, [server.url], address=ray_cluster, settings={"shard_records": 4}),
        log=_quiet,
    )
    assert rerun["status"] == "complete" and rerun["plan_reused"] and rerun["shards_skipped"] >= 1
    assert rerun["replies_from_journal"] >= 1
    assert _files(out) == _files(reference)


def test_one_of_two_endpoints_dying_mid_job_leaves_the_other(
    served_dir, server, long_corpus, reference, tmp_path, ray_cluster
):
    """Endpoint 2 is a loopback relay to the same server, cut mid-job (listening
    stops, open connections shut): its requests go to endpoint 1, the job finishes."""
    from extract.generate.job import run_generate

    relay = served.Relay(server.port)
    out = tmp_path / "out"
    thread, outcome = _run_in_thread(
        _config(
            served_dir,
            long_corpus,
            out,
            [server.url, relay.url],
            address=ray_cluster,
            settings={"shard_records": 4},
            server={"concurrency": 1},
        )
    )
    _wait_for_replies(out, committed=0, replies=3, thread=thread)
    relay.close()
    thread.join(300)
    assert "error" not in outcome, outcome
    report = outcome["report"]
    assert report["status"] == "complete" and report["endpoints"] == [server.url, relay.url]
    assert report["quarantined_while_generating"] == 0
    assert _files(out) == _files(reference)
    rerun = run_generate(
        _config(served_dir, long_corpus, out, [server.url], address=ray_cluster, settings={"shard_records": 4}),
        log=_quiet,
    )
    assert rerun["status"] == "nothing_to_do"


def test_an_endpoint_down_at_start_and_a_server_of_another_model_are_refused(
    served_dir, qwen3_dir, server, corpus, tmp_path, capsys
):
    from extract.__main__ import main

    down = f"http://127.0.0.1:{served.free_port()}"
    out = tmp_path / "out"
    common = [
        "generate",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--engine",
        "openai",
        "--no-progress",
        "--max-length",
        "512",
    ]
    assert (
        main(common + ["--model", str(served_dir), "--endpoint", server.url, "--endpoint", down, "--reasoning", "drop"])
        == 1
    )
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"endpoint {down} does not answer" in error
    assert main(common + ["--model", str(qwen3_dir), "--endpoint", server.url, "--reasoning", "drop"]) == 1
    error = capsys.readouterr().err.strip()
    assert f"serves '{served_dir}', not --model {qwen3_dir}" in error
    assert main(common + ["--model", str(served_dir), "--endpoint", server.url]) == 2  # thinking mode unsaid
    assert "--reasoning keep" in capsys.readouterr().err
    assert not out.exists()


def test_a_request_that_times_out_is_retried_then_quarantined(served_dir, server, corpus, tmp_path, ray_cluster):
    from extract.generate.job import run_generate
    from extract.generated_corpus import shard_record

    out = tmp_path / "out"
    report = run_generate(
        _config(
            served_dir,
            corpus,
            out,
            [server.url],
            address=ray_cluster,
            settings={"limit": 2},
            server={"request_timeout": 0.001, "request_retries": 1},
        ),
        log=_quiet,
    )
    assert report["status"] == "complete" and report["records"] == 0
    assert report["quarantined_while_generating"] == 2 and report["quarantined_by_reason"] == {"request_timeout": 2}
    quarantined = shard_record(out, "shard-000000")["quarantined"]
    assert [q["record_index"] for q in quarantined] == [0, 1]
    assert all(q["detail"] == "turn 0: no reply within --request-timeout 0.001 s (after 2 tries)" for q in quarantined)
    assert _rows(out) == {}


def test_generate_bench_smoke_on_this_modules_server(served_dir, server):
    figures = smoke("generate_bench.py", "--endpoint", server.url, "--model", str(served_dir))
    assert SMOKE_KEYS["generate_bench.py"] <= set(figures) and figures["smoke"] is True
    assert figures["openai_tokens_per_s"] > 0 and figures["hf_tokens_per_s"] > 0
