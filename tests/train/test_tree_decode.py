"""`speculate --tree BUDGET`: decoding along a DDTree tree (train/decoding/tree_decode.py).

- the tree is the first BUDGET pops of the rule `eval` reads (one owner), each node
  below its parent, and the tree mask lets a node see exactly its ancestors;
- decoding is lossless (equal to the target's greedy output) on the dense Qwen3 target
  (one tree-masked forward per round) and on the hybrid Qwen3.5 target (chains), and on
  the dense target both verification methods give the same tokens and rounds;
- the command's JSON names the budget and the verification, and refuses --temperature.
Trained drafters (real acceptance, eval's `ddtree` against decoding) are in
test_speculate.py and test_dflash2.py.
"""

from __future__ import annotations

import json
from itertools import islice

import builders
import pytest
import torch
from random_drafters import dflash_drafter
from reference_oracle import load_model

from train.decoding.speculate import greedy_generate, speculative_generate
from train.decoding.target_decode import TargetSession
from train.decoding.tree_decode import grow_tree, verification_method
from train.export.drafter_dir import export_drafter
from train.measures import best_first_tree, ddtree_acceptance

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 24


def test_the_tree_is_the_first_pops_of_evals_rule():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 2
    tree = grow_tree(logits, anchor_id=7, budget=12)
    logprobs, ids = torch.log_softmax(logits, -1).topk(12, -1)
    pops = list(islice(best_first_tree(logprobs.tolist()), 12))
    assert len(tree.tokens) == 13 and tree.tokens[0] == 7
    for node, ranks in enumerate(pops, start=1):
        assert tree.depths[node] == len(ranks) and tree.tokens[node] == ids[len(ranks) - 1, ranks[-1]]
        assert tree.parents[node] < node and tree.depths[tree.parents[node]] == len(ranks) - 1
    visible = tree.visible()
    for node in range(13):
        ancestors, walk = {node}, node
        while walk > 0:
            walk = tree.parents[walk]
            ancestors.add(walk)
        assert set(visible[node].nonzero()[:, 0].tolist()) == ancestors
    # eval's acceptance at this budget: the depth the reference path reaches in this very tree
    path = [tree.tokens[node] for node in tree.best_chain(0)[1:]]
    reference = torch.tensor(path + [0] * (5 - len(path)))[None]
    valid = torch.zeros(1, 5, dtype=torch.bool)
    valid[0, : len(path)] = True
    assert int(ddtree_acceptance(logprobs[None], ids[None], reference, valid, 12)[0]) == len(path) + 1


@pytest.mark.parametrize("target", ["qwen3_dir", "qwen3_5_dir"])
def test_tree_decoding_is_lossless(target, request, tokenizer):
    target_dir = request.getfixturevalue(target)
    model, drafter = load_model(target_dir), dflash_drafter(target_dir)
    expected = "tree_attention" if target == "qwen3_dir" else "chains"
    assert verification_method(model) == expected
    for prompt in builders.chat_prompts(tokenizer, 2):
        greedy = greedy_generate(model, prompt, NEW_TOKENS, []).tokens
        for budget in (1, 8, 22):
            decoded = speculative_generate(model, drafter, prompt, NEW_TOKENS, [], tree_budget=budget)
            assert decoded.tokens == greedy, (budget, decoded.tokens, greedy)
            assert sum(decoded.acceptance_lengths) == len(greedy) - 1


def test_keep_nodes_refuses_a_cache_whose_positions_a_tree_cannot_pick(qwen3_5_dir):
    """Only a plain attention cache can keep a tree's nodes by position (`tree_maskable`, the
    one rule): the hybrid's recurrent layers are refused in one line, never indexed."""
    session = TargetSession(load_model(qwen3_5_dir))
    with pytest.raises(RuntimeError, match="plain attention cache only"):
        session.keep_nodes(0, [0])


def test_both_verification_methods_agree_on_a_dense_target(qwen3_dir, tokenizer, monkeypatch):
    model, drafter = load_model(qwen3_dir), dflash_drafter(qwen3_dir)
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    masked = speculative_generate(model, drafter, prompt, NEW_TOKENS, [], tree_budget=16)
    monkeypatch.setattr(TargetSession, "tree_maskable", lambda self: False)
    chained = speculative_generate(model, drafter, prompt, NEW_TOKENS, [], tree_budget=16)
    assert masked.tokens == chained.tokens and masked.acceptance_lengths == chained.acceptance_lengths
    assert masked.target_forwards == 1 + len(masked.acceptance_lengths) <= chained.target_forwards


def test_cli_tree_json_and_refusal(qwen3_dir, tokenizer, tmp_path, capsys):
    from train.cli import main

    export = export_drafter(dflash_drafter(qwen3_dir), tmp_path / "drafter", dtype=torch.float32)
    prompts = builders.write_chat_jsonl(tmp_path / "p.jsonl", builders.coding_chats(2))
    base = ["speculate", "--drafter", str(export), "--target", str(qwen3_dir), "--prompts", str(prompts)]
    assert main([*base, "--tree", "8", "--max-new-tokens", "12", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["lossless"] and summary["tree"]["budget"] == 8 and summary["tree"]["verify"] == "tree_attention"
    assert summary["speculative"]["target_tokens_per_round"] > 1  # the anchor and the tree's nodes
    assert main([*base, "--tree", "8", "--temperature", "1"]) == 1
    assert "--tree decodes greedily" in capsys.readouterr().err
