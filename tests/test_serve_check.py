"""`python -m train serve-check`: the exported drafter served by vLLM (the CPU build,
`make vllm-env`) beside this project's `speculate`.

- a drafter trained on the target's own greedy text is served losslessly, at tokens
  per round within 5 % of `speculate`'s, and with matched semantics the rounds agree
  one by one; a random drafter is served losslessly at tau ~1;
- a drafter mixing sliding and full layers is not served on CPU (one line) while
  speculate vs the target still runs; a python without vLLM is refused by name;
- the counting rule: vLLM's last step, cut at the limit, counts what it committed,
  and speculate, decoded past the limit, is cut the same way.

These tests need the vLLM environment: without it they FAIL naming why (CI builds
it: `make test` depends on `make vllm-env`). vLLM's CPU attention takes head_dim 32
and up, so the target here is its own tiny Qwen3 (2 heads x 32), not conftest's.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from transformers import Qwen3ForCausalLM

import builders
import tiny
from stores import greedy_store
from store_schema.runtime.target_config import read_target_config
from train.acceptance import serve_check
from train.cli import main
from train.config import load_config
from train.drafter.model import DFlashDrafter, DrafterConfig
from train.export.drafter_dir import export_drafter
from train.fitting.trainer import Trainer

LAYERS = [1, 3]
BLOCK = 8
HELDOUT = 0.25
NEW_TOKENS = 24
PROMPTS = 3


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM environment's python; a failure naming why when there is none."""
    try:
        python = serve_check.find_vllm_python()
        serve_check.probe(python)
    except (serve_check.ServeRefused, FileNotFoundError) as error:
        pytest.fail(f"serve-check needs vLLM: {error}")
    return python


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer_dir):
    """A tiny dense Qwen3 (hidden 64, 2 heads x 32, 1 KV head) with the tokenizer.
    Weights at 2.5x the default init, seed 2: its greedy replies to the coding
    prompts fall into short loops (1-6 distinct tokens in 48), text a drafter learns
    in a few CPU steps; at the default init (12-20 distinct) 300 steps gave tau 1.06."""
    path = tmp_path_factory.mktemp("qwen3_h32")
    config = builders.qwen3_config(512)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    config.initializer_range = 0.05
    torch.manual_seed(2)
    Qwen3ForCausalLM(config).save_pretrained(str(path))
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="module")
def mask_id(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|mask|>")


@pytest.fixture(scope="module")
def trained(target_dir, tokenizer, tmp_path_factory):
    """(store, export) of a 1-layer full-attention drafter trained 200 steps on the
    target's greedy text: the one trained drafter of this module."""
    root = tmp_path_factory.mktemp("served")
    store = greedy_store(root / "store", target_dir, tokenizer, LAYERS, count=16, new_tokens=2 * NEW_TOKENS)
    config = load_config(None, tiny.drafter_sets(  # heads of 32: vLLM's CPU attention needs head_dim >= 32
        "model.layer_types=[full_attention]", "model.num_attention_heads=2", "model.num_key_value_heads=1",
        "model.head_dim=32", f"model.block_size={BLOCK}", "model.num_anchors=32", f"data.heldout_fraction={HELDOUT}",
        "data.buffer_shards=2", "optim.lr=1e-2", "eval.every=0", "train.epochs=100", "train.log_every=100",
    ), store=str(store), target=str(target_dir), out=str(root / "run"), **{"train.max_steps": 200})
    trainer = Trainer.from_config(config, log=lambda message: None)
    trainer.fit()
    return store, export_drafter(trainer.drafter, root / "export", dtype=torch.float32, heldout_fraction=HELDOUT)


def random_export(target_dir, mask_id, path, **geometry):
    config = DrafterConfig.from_target(read_target_config(target_dir), mask_token_id=mask_id, context_layer_ids=LAYERS,
                                       block_size=BLOCK, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                       **geometry)
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(config).eval(), path, dtype=torch.float32)


def serve(capsys, *argv) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = main(["serve-check", *map(str, argv), "--max-new-tokens", str(NEW_TOKENS), "--json"])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines else {}), err


@pytest.mark.slow  # vLLM (or the probe) runs in a child process
def test_a_trained_drafter_is_served_as_trained(trained, target_dir, vllm_python, capsys, tmp_path):
    store, export = trained
    code, summary, err = serve(capsys, "--drafter", export, "--target", target_dir, "--store", store,
                               "--limit", PROMPTS, "--workdir", tmp_path / "vllm")
    assert code == 0, err
    assert summary["prompts"] == PROMPTS and summary["lossless"] and summary["speculate_lossless"]
    assert summary["vllm_version"] and summary["vllm_device"] == "cpu"
    assert summary["speculate_tokens_per_round"] > 1.3, summary  # it really drafts
    assert abs(summary["tokens_per_round_difference"]) <= 0.05, summary
    counts = summary["per_position_accepted"]
    assert len(counts["served"]) == BLOCK - 1 and counts["served"][0] > 0
    # Same drafter, same semantics, fp32 on both sides: the same rounds, position by position.
    assert summary["rounds_equal_prompts"] == PROMPTS, summary["per_prompt"]
    assert counts["served"] == counts["speculate"]
    assert summary["served_tau"] >= summary["served_tokens_per_round"] - 1e-9  # uncut >= committed


@pytest.mark.slow  # vLLM (or the probe) runs in a child process
def test_a_random_drafter_is_served_losslessly_at_tau_one(target_dir, mask_id, vllm_python, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": r["messages"][:1]}) + "\n" for r in builders.coding_chats(2)))
    export = random_export(target_dir, mask_id, tmp_path / "random", num_hidden_layers=1,
                           layer_types=["full_attention"])
    code, summary, err = serve(capsys, "--drafter", export, "--target", target_dir, "--prompts", prompts)
    assert code == 0, err
    assert summary["lossless"] and summary["served_tau"] < 1.1 and summary["speculate_tau"] < 1.1, summary


@pytest.mark.slow  # vLLM (or the probe) runs in a child process
def test_a_mixed_layout_is_not_served_on_cpu_but_speculate_still_runs(target_dir, mask_id, vllm_python, capsys,
                                                                      tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [10, 20, 30, 40, 50]}) + "\n")
    export = random_export(target_dir, mask_id, tmp_path / "mixed", num_hidden_layers=2, sliding_window=16)
    code, summary, err = serve(capsys, "--drafter", export, "--target", target_dir, "--prompts", prompts)
    assert code == 0, err
    assert "V2 model runner" in summary["served_skipped"] and "Triton" in summary["served_skipped"]
    assert summary["speculate_lossless"] is True
    assert "note: " in err and "only speculate vs the target was checked" in err


@pytest.mark.slow  # vLLM (or the probe) runs in a child process
def test_a_python_without_vllm_is_refused_by_name(target_dir, mask_id, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [10, 20, 30]}) + "\n")
    export = random_export(target_dir, mask_id, tmp_path / "d", num_hidden_layers=1, layer_types=["full_attention"])
    code, _, err = serve(capsys, "--drafter", export, "--target", target_dir, "--prompts", prompts,
                         "--vllm-python", sys.executable)
    assert code == 1 and err.count("\n") == 1 and f"vLLM is not importable by {sys.executable}" in err, err


def test_rounds_cut_by_the_limit_count_what_they_committed():
    # 10 output tokens: 1 from the prefill, a step that accepted 3 (4 committed), and a
    # last step that accepted 7 of 7 but had room for only 5 before the limit.
    assert serve_check.committed_lengths(10, [3, 7]) == [4, 5]
    assert serve_check.per_position_counts([4, 5], 7) == [2, 2, 2, 1, 0, 0, 0]
    assert serve_check.accepted_counts([3, 7], 7) == [2, 2, 2, 1, 1, 1, 1]  # vLLM's own, uncut
    with pytest.raises(ValueError, match="do not add up"):
        serve_check.committed_lengths(30, [3, 7])
    assert serve_check.until_stop([5, 6, 2, 9], [2]) == [5, 6, 2]


def test_speculate_decoded_past_the_limit_is_cut_as_vllm_cuts():
    """vLLM drafts whole blocks to the end; speculate decodes B - 1 past the limit
    and is cut to it: 1 prefill token + rounds 8, 8, 3, 2 and 2 of the next 8."""
    from train.acceptance.speculate import Decoded, PromptResult

    tokens = list(range(35))
    result = PromptResult("p", 3, Decoded(tokens, 7, 1.0, [8, 8, 3, 2, 8, 5]), Decoded(tokens, 34, 1.0))
    cut = serve_check.cut_at_limit(result, 24)
    assert cut.speculative.acceptance_lengths == [8, 8, 3, 2, 2] and cut.speculative.tokens == tokens[:24]
    assert cut.lossless and cut.greedy.tokens == tokens[:24]
