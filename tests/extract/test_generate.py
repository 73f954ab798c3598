"""`python -m extract generate` on tiny real targets and a real local Ray cluster:
greedy replies equal transformers' own `model.generate`, multi-turn records are
regenerated turn by turn, a killed worker and a rerun give the same bytes, bad
records are quarantined, another job on the same output is refused, and the
responses' provenance reaches the store, `info` and `train fit`."""

from __future__ import annotations

import json

import builders
import pyarrow.parquet as pq
import pytest
import tiny
import torch
from ray_helpers import execution_of

MAX_NEW = 16
THINK_TEMPLATE = (  # Qwen3-like: reasoning_content rendered in <think>, enable_thinking opens or closes it
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% elif enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)


def _records() -> list[dict]:
    return builders.generate_records(4)


def _config(model, corpus, out, **overrides):
    from extract.generate.config import GenerateConfig, GenerationSettings
    from extract.jobs.settings import FaultInjection

    settings = GenerationSettings(
        **{"max_new_tokens": MAX_NEW, "shard_records": 3, "max_length": 512, **overrides.pop("settings", {})}
    )
    return GenerateConfig(
        model=str(model),
        corpus=str(corpus),
        out=str(out),
        settings=settings,
        batch_tokens=overrides.pop("batch_tokens", 400),
        execution=execution_of(overrides, faults=FaultInjection()),
        **overrides,
    )


def _rows(out) -> dict:
    from extract.corpus import open_corpus

    return {r["id"]: r for _, r in open_corpus(out).iter_records()}


def _reference(model, tokenizer, conversation_messages):
    """transformers' own greedy `generate` of one prompt, batch of one."""
    text = tokenizer.apply_chat_template(conversation_messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=end,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, ids.shape[1] :].tolist()
    new = new[: new.index(end)] if end in new else new
    return tokenizer.decode(new, skip_special_tokens=False), end not in out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return builders.write_chat_jsonl(tmp_path_factory.mktemp("gen") / "chats.jsonl", _records())


@pytest.mark.slow  # a Ray cluster
@pytest.mark.parametrize("kind", ["qwen3_dir", "qwen3_5_dir"])
def test_greedy_replies_equal_model_generate_turn_by_turn(kind, request, corpus, tokenizer, tmp_path, ray_cluster):
    from transformers import AutoModelForCausalLM

    from extract.generate.job import run_generate

    model_dir = request.getfixturevalue(kind)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    report = run_generate(_config(model_dir, corpus, tmp_path / "out", address=ray_cluster), log=lambda m: None)
    assert report["status"] == "complete" and report["records"] == 6 and report["quarantined"] == 0
    assert report["turns"] == 7 and report["generated_tokens"] > 0
    written = [json.loads(line) for line in corpus.read_text().splitlines()]
    rows, source = _rows(tmp_path / "out"), {r["id"]: r for r in written}
    assert list(rows) == [r["id"] for r in written]  # ids kept, corpus order kept
    for record_id, row in rows.items():
        original = source[record_id]["messages"]
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        turns = [i for i, m in enumerate(original) if m["role"] == "assistant"] or [len(original)]
        assert len(messages) == max(len(original), turns[-1] + 1)
        hit_limit = False
        for position in turns:  # each turn's prompt holds the target's own earlier replies
            assert [m for m in messages[:position] if m["role"] != "assistant"] == [
                m for m in original[:position] if m["role"] != "assistant"
            ]
            expected, limited = _reference(model, tokenizer, messages[:position])
            assert messages[position] == {"role": "assistant", "content": expected}, (record_id, position)
            hit_limit = hit_limit or limited
        assert row["truncated"] == hit_limit
    multi = [m for m in rows["multi"]["messages"] if m["role"] == "assistant"]
    assert multi[0]["content"] != "def add(a, b):\n    return a + b\n"


@pytest.mark.slow  # a Ray cluster
def test_a_killed_worker_and_a_rerun_give_the_same_corpus(qwen3_dir, corpus, tmp_path, ray_cluster):
    """The first actor SIGKILLs itself after its 2nd batch, mid-shard (one row per
    batch); its shard is redone on a fresh actor. A rerun after a shard is lost
    regenerates only that shard. Every file is byte-identical to an undisturbed run."""
    import shutil

    from extract.generate.job import run_generate
    from extract.jobs.settings import FaultInjection

    small = dict(batch_tokens=MAX_NEW + 40, settings={"max_length": 40 + MAX_NEW})
    reference = run_generate(
        _config(qwen3_dir, corpus, tmp_path / "ref", address=ray_cluster, **small), log=lambda m: None
    )
    killed = run_generate(
        _config(
            qwen3_dir,
            corpus,
            tmp_path / "out",
            address=ray_cluster,
            faults=FaultInjection(kill_after_batches=(2,)),
            **small,
        ),
        log=lambda m: None,
    )
    assert killed["worker_deaths"] == 1 and killed["shards_retried"] == 2  # the two shards it held
    assert killed["generated_tokens"] == reference["generated_tokens"]

    def files(root):
        return {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and ".lock" not in p.name
        }

    assert files(tmp_path / "out") == files(tmp_path / "ref")
    shutil.rmtree(tmp_path / "out" / "shards" / "shard-000001")
    rerun = run_generate(_config(qwen3_dir, corpus, tmp_path / "out", address=ray_cluster, **small), log=lambda m: None)
    assert rerun["plan_reused"] and rerun["shards_written"] == 1 and rerun["shards_skipped"] == 1
    assert files(tmp_path / "out") == files(tmp_path / "ref")


def test_bad_records_are_quarantined_with_reasons(qwen3_dir, tmp_path):
    from extract.__main__ import main
    from extract.generate.job import plan_generate

    records = [
        {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"id": "no-user", "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]},
        {"id": "long", "messages": [{"role": "user", "content": "word " * 400}]},
        {"id": "no-turn", "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        {"id": "ok", "messages": [{"role": "user", "content": "again"}]},
        {"id": "tokens", "input_ids": [1, 2], "loss_mask": [0, 1]},
    ]
    corpus = builders.write_chat_jsonl(tmp_path / "bad.jsonl", records)
    with open(corpus, "a") as f:
        f.write("{not json\n")
    _, plan = plan_generate(_config(qwen3_dir, corpus, None, settings={"max_length": 128}))
    reasons = {(q.record_index, q.reason) for q in plan.quarantined}
    assert reasons == {
        (1, "no_user_turn"),
        (2, "prompt_too_long"),
        (3, "no_turn_to_generate"),
        (4, "duplicate_id"),
        (5, "missing_field"),
        (6, "malformed_json"),
    }
    assert "no room for a reply" in next(q.detail for q in plan.quarantined if q.reason == "prompt_too_long")
    assert [s.sample_id for shard in plan.shards for s in shard.samples] == ["ok"]
    out = tmp_path / "never"
    assert (
        main(
            [
                "generate",
                "--model",
                str(qwen3_dir),
                "--corpus",
                str(corpus),
                "--out",
                str(out),
                "--max-length",
                "128",
                "--dry-run",
                "--no-progress",
            ]
        )
        == 0
    )
    assert not out.exists()


@pytest.mark.slow  # a Ray cluster
def test_another_job_on_the_same_output_is_refused(qwen3_dir, corpus, tmp_path, ray_cluster):
    from extract.errors import ExtractError
    from extract.generate.job import run_generate
    from store_schema import StoreLock, StoreLockedError

    out = tmp_path / "out"
    run_generate(_config(qwen3_dir, corpus, out, address=ray_cluster, settings={"limit": 2}), log=lambda m: None)
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(ExtractError, match=r"max_new_tokens: corpus has 16, expected 17"):
        run_generate(_config(qwen3_dir, corpus, out, settings={"limit": 2, "max_new_tokens": 17}))
    with StoreLock(out, job="another generate"):
        with pytest.raises(StoreLockedError, match="another live job"):
            run_generate(_config(qwen3_dir, corpus, out, settings={"limit": 2}))
    assert sorted(p.name for p in out.rglob("*")) == before


def test_replies_parse_reasoning_the_template_opens(tokenizer_dir, tmp_path):
    """`<think>` opened by the prompt (enable_thinking on) or by the reply becomes
    reasoning_content; thinking off renders the empty block the template inserts."""
    from transformers import AutoTokenizer

    from extract.generate.turns import render_prompt, reply_message

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = THINK_TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    on, _ = render_prompt(tokenizer, chat, "on")
    off, _ = render_prompt(tokenizer, chat, "off")
    keep, _ = render_prompt(tokenizer, chat, "keep")
    assert on.endswith("<think>\n") and off.endswith("<think>\n\n</think>\n\n") and keep.endswith("assistant\n")
    assert reply_message(on, "plan it\n</think>\n\nanswer") == {
        "role": "assistant",
        "content": "answer",
        "reasoning_content": "plan it",
    }
    assert reply_message(on, "still thinking") == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "still thinking",
    }
    assert reply_message(off, "answer") == {"role": "assistant", "content": "answer"}
    assert reply_message(keep, "<think>\nhm\n</think>\n\nok") == {
        "role": "assistant",
        "content": "ok",
        "reasoning_content": "hm",
    }


def test_an_unfinished_generated_corpus_is_refused_as_a_corpus(tmp_path):
    from extract.corpus import open_corpus
    from extract.errors import GeneratedCorpusError
    from extract.generated_corpus import commit_shard, shard_table, write_manifest

    write_manifest(tmp_path, {"engine": "vllm"}, ["shard-000000", "shard-000001"])
    rows = [
        dict(
            id="a",
            messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}],
            truncated=False,
            generated_tokens=2,
        )
    ]
    assert commit_shard(tmp_path, "shard-000000", shard_table(rows))
    with pytest.raises(GeneratedCorpusError, match="1 of 2 shard"):
        open_corpus(tmp_path)
    assert commit_shard(tmp_path, "shard-000001", shard_table(rows))
    assert not commit_shard(tmp_path, "shard-000001", shard_table(rows))  # committed already: kept
    assert [r["id"] for _, r in open_corpus(tmp_path).iter_records()] == ["a", "a"]
    assert pq.read_table(tmp_path / "shards" / "shard-000000" / "data.parquet").column_names[:2] == ["id", "messages"]


@pytest.mark.slow  # a Ray cluster
def test_provenance_target_other_unknown_and_the_fit_warning(
    qwen3_dir, qwen3_5_dir, corpus, tmp_path, ray_cluster, capsys
):
    from ray_helpers import job_config

    from extract.extraction.job import run_job
    from extract.generate.job import run_generate
    from store_schema import Store
    from store_schema.__main__ import main as store_main
    from store_schema.plan import PlanSettings
    from train.__main__ import main as train_main

    generated = tmp_path / "generated"
    run_generate(_config(qwen3_dir, corpus, generated, address=ray_cluster), log=lambda m: None)
    stores = {}
    for name, model, source in (
        ("target", qwen3_dir, generated),
        ("other", qwen3_5_dir, generated),
        ("unknown", qwen3_dir, corpus),
    ):
        stores[name] = tmp_path / f"store-{name}"
        run_job(
            job_config(
                model,
                source,
                stores[name],
                workers=1,
                address=ray_cluster,
                layers=[1, 3],
                plan_settings=PlanSettings(block_size=4, shard_tokens=1500),
            ),
            log=lambda m: None,
        )
        assert Store(stores[name]).fingerprint.response_provenance == name
    # how the replies were decoded (issue 59.4): greedy, thinking as the template keeps it
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "thinking": "keep"}
    assert Store(stores["target"]).fingerprint.response_sampling == greedy
    assert Store(stores["unknown"]).fingerprint.response_sampling == {}
    assert (
        "response_provenance"
        not in json.loads((stores["unknown"] / "zarr.json").read_text())["attributes"]["dflash_store"]["fingerprint"]
    )  # a plain corpus's store hashes as before
    capsys.readouterr()
    assert store_main(["info", stores["other"].as_posix()]) == 0
    assert "responses    other" in capsys.readouterr().out

    sets = tiny.drafter_sets(
        "model.block_size=4", "loss.gamma=4", "model.num_anchors=4", "eval.every=0", "data.heldout_fraction=0.0"
    )  # the block the stores were planned for (a larger one is refused)
    for name, warned in (("unknown", True), ("target", False)):
        argv = [
            "fit",
            "--store",
            str(stores[name]),
            "--target",
            str(qwen3_dir),
            "--out",
            str(tmp_path / f"run-{name}"),
            "--max-steps",
            "1",
            *tiny.cli_sets(sets),
        ]
        assert train_main(argv) == 0
        err = capsys.readouterr().err
        assert ("not from the target" in err) == warned, err
        if warned:
            assert len([line for line in err.splitlines() if "not from the target" in line]) == 1


def test_a_reply_cut_inside_a_character_has_one_text_whatever_the_engine(tokenizer):
    """Issue 35.9: the openai engine's text is the server's ids decoded by the target's
    tokenizer, exactly the hf engine's rule, never the server's incremental text (which
    holds back or replaces an unfinished UTF-8 sequence its own way)."""
    from extract.generate.client import Completion
    from extract.generate.replies import make_reply
    from extract.generate.turns import render_prompt, reply_text

    messages = [{"role": "user", "content": "Write `sub`."}]
    prompt_text, prompt_ids = render_prompt(tokenizer, messages, "off")
    full = tokenizer("return 'é' + x", add_special_tokens=False)["input_ids"]
    e_bytes = tokenizer("é", add_special_tokens=False)["input_ids"]
    assert len(e_bytes) == 2  # byte-level: C3 A9, neither UTF-8 on its own
    cut = full[: full.index(e_bytes[0]) + 1]  # the limit falls between the two bytes of é
    expected = reply_text(tokenizer, cut)
    assert expected.endswith("\ufffd") and expected == tokenizer.decode(cut, skip_special_tokens=False)
    served_text = expected[:-1]  # vLLM's detokenizer holds the unfinished byte back
    completion = Completion(
        text=served_text,
        reasoning=None,
        token_ids=cut,
        prompt_token_ids=prompt_ids,
        finish_reason="length",
        has_tool_calls=False,
        endpoint="http://127.0.0.1:1",
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = make_reply(completion, tokenizer, messages, prompt_text, prompt_ids, [end])
    assert reply.text == expected and reply.hit_limit and reply.tokens == len(cut) and reply.checked
    ended = Completion(
        text=served_text,
        reasoning=None,
        token_ids=full + [end],
        prompt_token_ids=prompt_ids,
        finish_reason="stop",
        has_tool_calls=False,
        endpoint="http://127.0.0.1:1",
    )
    reply = make_reply(ended, tokenizer, messages, prompt_text, prompt_ids, [end])
    assert reply.text == reply_text(tokenizer, full) == "return 'é' + x" and reply.tokens == len(full) + 1
    assert not reply.mismatch
