"""`train.evaluation.evaluate` on a real store, a real drafter and the tiny Qwen3 target's
frozen head: the result equals acceptance counted block by block by hand; a store
whose recorded target predictions are the drafter's own gives tau = B; the
held-out split, and `train eval` evaluating exactly the samples the exported run
held out; the eval CLI's JSON."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import builders
import numpy as np
import pytest
import tiny
import torch
from eval_stores import LAYERS, everything, make_samples, write_store

from store_schema import Fingerprint, SampleArrays, Store, create_store
from store_schema.runtime.target_config import read_target_config
from train.cli import main
from train.commands.eval import render_table
from train.config_loading import load_config
from train.data.heldout import is_heldout, store_samples
from train.evaluation import evaluate as ev
from train.evaluation.config import EvalConfig
from train.export.drafter_dir import export_drafter
from train.families.dflash.anchors import anchor_candidates
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.fitting.periodic_eval import AcceptanceEval, log_fields
from train.fitting.trainer import Trainer
from train.target_head import load_target_head

B = 8


def eval_main(argv) -> int:
    return main(["eval", *argv])


@pytest.fixture(scope="module")
def parts(qwen3_dir):
    target = read_target_config(qwen3_dir)
    config = DrafterConfig.from_target(
        target, mask_token_id=3, context_layer_ids=LAYERS, num_hidden_layers=1, block_size=B, architecture="dflash"
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval(), load_target_head(qwen3_dir), target


def draft_one(drafter, head, features, ids, anchor):
    """The drafter's top-1 at slots 0..B-1 of one block anchored at `anchor`, alone."""
    with torch.no_grad():
        hidden = drafter(features, ids, torch.tensor([anchor]), head.embed_tokens)
        return head.lm_head(hidden[0].float()).argmax(-1)


def by_hand(drafter, head, sample: SampleArrays):
    """One sample, one block at a time: chain acceptance lengths and per-slot hits
    at every anchor candidate (the per-position estimate), and the rounds of
    decoding each response (the rollout), with chain and with a 1-node DDTree."""
    ids = torch.from_numpy(sample.input_ids).long()
    mask = torch.from_numpy(sample.loss_mask)
    features = torch.cat([sample.hidden[layer] for layer in LAYERS], dim=-1)
    length = len(ids)

    def usable(position):
        return position < length and mask[position] == 1

    def accepted(guess, anchor):
        count = 0
        while count < B - 1 and usable(anchor + 1 + count) and guess[1 + count] == ids[anchor + 1 + count]:
            count += 1
        return count

    lengths, hits = [], []
    for anchor in anchor_candidates(mask, B).tolist():
        if mask[anchor + 1] == 0:
            continue  # slot 1 is not part of the response: not a drafted block
        guess = draft_one(drafter, head, features, ids, anchor)
        lengths.append(accepted(guess, anchor) + 1)
        hits.append([(int(guess[k] == ids[anchor + k]), int(mask[anchor + k])) for k in range(1, B)])
    starts = [p for p in range(length) if mask[p] == 1 and (p == 0 or mask[p - 1] == 0)]
    chain_rounds, tree1_rounds = [], []
    for start in starts:  # each response is decoded from its first token on
        for rounds, one_node in ((chain_rounds, False), (tree1_rounds, True)):
            anchor = start
            while usable(anchor) and usable(anchor + 1):
                guess = draft_one(drafter, head, features, ids, anchor)
                n = int(guess[1] == ids[anchor + 1]) if one_node else accepted(guess, anchor)
                rounds.append(n + 1)
                anchor += n + 1
    return lengths, hits, chain_rounds, tree1_rounds


def test_evaluate_equals_acceptance_counted_by_hand(tmp_path, parts):
    drafter, head, target = parts
    samples = make_samples(target, count=3)
    store = write_store(tmp_path / "store", target, samples)
    result = ev.evaluate(drafter, head, store, everything(ddtree_budgets=(1, 8, 32), batch_blocks=16), split="all")

    per_sample = [by_hand(drafter, head, s) for s in samples]
    # tau: the rounds of decoding each response, per sample then over samples.
    assert result["tau"] == pytest.approx(np.mean([np.mean(rounds) for _, _, rounds, _ in per_sample]), abs=1e-9)
    assert result["rounds"] == sum(len(rounds) for _, _, rounds, _ in per_sample)
    assert [s["tau"] for s in result["per_sample"]] == pytest.approx([np.mean(r) for _, _, r, _ in per_sample])
    # tau_per_position: every anchor position, per sample then over samples.
    expected = np.mean([np.mean(lengths) for lengths, *_ in per_sample])
    assert result["tau_per_position"] == pytest.approx(expected, abs=1e-9)
    assert result["samples"] == len(samples)
    assert result["blocks"] == sum(len(lengths) for lengths, *_ in per_sample)
    all_hits = np.array([h for _, hits, *_ in per_sample for h in hits])  # [blocks, B-1, (hit, valid)]
    correct = (all_hits[..., 0] * all_hits[..., 1]).sum(0)
    expected_pos = correct / all_hits[..., 1].sum(0)
    assert result["per_position_acc"] == pytest.approx(expected_pos.tolist(), abs=1e-9)
    assert result["top1_acc"] == pytest.approx(correct.sum() / all_hits[..., 1].sum(), abs=1e-9)
    assert result["top1_acc"] <= result["top4_acc"] <= result["top8_acc"]
    # Budget 1: only slot 1's top-1 is drafted, so a round accepts 1 token exactly
    # when slot 1 is right; rolled out like the chain.
    assert result["ddtree"][1] == pytest.approx(np.mean([np.mean(r) for *_, r in per_sample]), abs=1e-9)
    assert result["ddtree"][1] <= result["ddtree"][8] + 1e-9
    assert sum(result["acceptance_histogram"]) == pytest.approx(1.0)
    # A stride thins the per-position estimate only; the rollout is the same.
    strided = ev.evaluate(drafter, head, store, everything(ddtree_budgets=(8,), anchor_stride=3), split="all")
    assert strided["blocks"] < result["blocks"] and strided["tau"] == result["tau"]
    # A cap rolls out the first positions of the responses only.
    capped = ev.evaluate(drafter, head, store, everything(ddtree_budgets=(8,), max_blocks_per_sample=5), split="all")
    assert sum(s["tokens"] for s in capped["per_sample"]) < sum(s["tokens"] for s in result["per_sample"])
    # The table names the numbers.
    table = render_table(result)
    assert "tau (decode-time" in table and "DDTree acceptance @ 32" in table and "tau per position" in table


def test_named_samples_are_rolled_out_over_their_first_response_only(tmp_path, parts):
    """`evaluate_sample_ids` is what `speculate`'s prompts are compared on: the
    named samples in the given order, each decoded from its first response token
    for at most `max_new_tokens` tokens (the second response is never reached)."""
    drafter, head, target = parts
    samples = make_samples(target, count=4, seed=6)
    store = write_store(tmp_path / "store", target, samples)
    picked = [samples[2], samples[0]]
    result = ev.evaluate_sample_ids(
        drafter, head, store, [s.sample_id for s in picked], everything(ddtree_budgets=(8,)), max_new_tokens=10
    )
    assert [s["sample_id"] for s in result["per_sample"]] == [s.sample_id for s in picked]
    for got, sample in zip(result["per_sample"], picked):
        cut = SampleArrays(sample.sample_id, sample.input_ids, np.zeros_like(sample.loss_mask), sample.hidden)
        cut.loss_mask[8:18] = 1  # the first response starts at 8; its first 10 tokens
        _, _, rounds, _ = by_hand(drafter, head, cut)
        assert got["rounds"] == len(rounds) and got["tau"] == pytest.approx(np.mean(rounds))
    with pytest.raises(KeyError, match="no committed sample 'nope'"):
        ev.evaluate_sample_ids(drafter, head, store, ["nope"], everything())


def test_target_labels_that_are_the_drafters_own_predictions_give_tau_B(tmp_path, parts):
    drafter, head, target = parts
    samples = make_samples(target, count=2, seed=1, full_mask=True)
    # Record, as the target's top-k, the drafter's own top-1 at every slot of the
    # blocks anchored every B positions (row p holds the prediction for token p + 1).
    recorded_blocks = 0
    for sample in samples:
        ids = torch.from_numpy(sample.input_ids).long()
        features = torch.cat([sample.hidden[layer] for layer in LAYERS], dim=-1)
        anchors = anchor_candidates(torch.from_numpy(sample.loss_mask), B)[::B]
        with torch.no_grad():
            guess = head.lm_head(drafter(features, ids, anchors, head.embed_tokens).float()).argmax(-1)
        topk = np.zeros((len(ids), 2), np.int32)
        for block, anchor in enumerate(anchors.tolist()):
            for k in range(1, B):
                topk[anchor + k - 1, 0] = int(guess[block, k])
        sample.topk_ids = topk
        recorded_blocks += len(anchors)
        sample.topk_logprobs = np.full((len(ids), 2), -0.5, np.float32)
    store = write_store(tmp_path / "store", target, samples, topk=2)
    result = ev.evaluate(
        drafter, head, store, everything(labels="target", anchor_stride=B, ddtree_budgets=(B - 1, 32)), split="all"
    )
    assert result["tau_per_position"] == B
    # Decoding from position 0 accepts whole blocks, so it anchors exactly at the
    # recorded blocks: each of them is a round of length B; past the last one
    # (nothing recorded there) the rounds are short.
    assert round(result["acceptance_histogram"][B - 1] * result["rounds"]) >= recorded_blocks
    assert result["rounds"] > recorded_blocks and 1 < result["tau"] < B
    # DDTree always drafts slot 1's top-1, so its first round at a recorded block
    # accepts at least that; how deep its tree goes depends on the drafter's
    # confidence (this random one spreads its budget over slot 1's alternatives),
    # and its rollout then leaves the recorded anchors.
    assert all(1 < value <= B for value in result["ddtree"].values())
    assert result["top1_acc"] == 1.0 and result["per_position_acc"] == [1.0] * (B - 1)
    # The stored tokens are random: against them the same drafter is far from perfect.
    tokens = ev.evaluate(drafter, head, store, everything(anchor_stride=B, ddtree_budgets=(8,)), split="all")
    assert tokens["tau"] < 2
    # labels="target" on a store without top-k is refused by name.
    plain = write_store(tmp_path / "plain", target, make_samples(target, count=2, seed=2))
    with pytest.raises(ValueError, match="top-k"):
        ev.evaluate(drafter, head, plain, everything(labels="target"), split="all")


def test_heldout_split_is_a_stable_partition(tmp_path, parts):
    drafter, head, target = parts
    samples = make_samples(target, count=8, seed=3)
    store = write_store(tmp_path / "store", target, samples)
    ids = [s.sample_id for s in samples]
    held = [i for i in ids if is_heldout(i, 0.5)]
    assert 0 < len(held) < len(ids)
    assert held == [i for i in ids if is_heldout(i, 0.5)]  # a function of the id alone
    assert not any(is_heldout(i, 0.0) for i in ids) and all(is_heldout(i, 1.0) for i in ids)
    got_held = [s.sample_id for s in store_samples(store, LAYERS, "heldout", 0.5)]
    got_train = [s.sample_id for s in store_samples(store, LAYERS, "train", 0.5)]
    assert got_held == held and sorted(got_held + got_train) == sorted(ids)
    result = ev.evaluate(drafter, head, store, everything(ddtree_budgets=(8,)), heldout_fraction=0.5)
    assert result["samples"] == len(held) and result["split"] == "heldout" and result["heldout_fraction"] == 0.5
    assert ev.evaluate(drafter, head, store, everything(samples=3, ddtree_budgets=(8,)), split="all")["samples"] == 3
    with pytest.raises(ValueError, match="held-out fraction"):  # no silent default split
        ev.evaluate(drafter, head, store, everything(ddtree_budgets=(8,)), split="heldout")
    fields = log_fields(result)
    assert set(fields) >= {
        "eval_tau",
        "eval_tau_per_position",
        "eval_ddtree_8",
        "eval_top1_acc",
        "eval_per_position_acc",
    }
    # The training-loop evaluator reads held-out samples from the trainer's loader
    # (here the store's own held-out samples stand in for ShardLoader.heldout_samples).
    trainer = SimpleNamespace(
        drafter=drafter,
        head=head,
        autocast=contextlib.nullcontext,
        loader=SimpleNamespace(heldout_samples=lambda n: store_samples(store, LAYERS, "heldout", 0.5, max_samples=n)),
    )
    section = EvalConfig(samples=2, ddtree_budgets=(8,), max_blocks_per_sample=10)
    logged = AcceptanceEval(section)(trainer, step=100)
    direct = ev.evaluate(drafter, head, store, section, heldout_fraction=0.5)
    assert logged == log_fields(direct) and logged["eval_samples"] == 2


def test_eval_cli_prints_json_of_an_exported_drafter(tmp_path, parts, qwen3_dir, capsys):
    drafter, head, target = parts
    write_store(tmp_path / "store", target, make_samples(target, count=4, seed=4))
    run_dir = tmp_path / "run"
    export_drafter(drafter, run_dir / "export", dtype=torch.float32)
    argv = [
        "--store",
        str(tmp_path / "store"),
        "--drafter",
        str(run_dir),
        "--target",
        str(qwen3_dir),
        "--split",
        "all",
        "--ddtree-budgets",
        "4,16",
        "--json",
    ]
    assert eval_main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    direct = ev.evaluate(drafter, head, Store(tmp_path / "store"), everything(ddtree_budgets=(4, 16)), split="all")
    assert printed["tau"] == pytest.approx(direct["tau"], abs=1e-6)
    assert printed["ddtree"] == {"4": pytest.approx(direct["ddtree"][4]), "16": pytest.approx(direct["ddtree"][16])}
    assert printed["samples"] == 4 and printed["drafter"] == str(run_dir / "export")
    assert printed["max_samples"] == 256 and printed["split_samples"] == 4  # capped by default, said in the JSON
    assert printed["stands_for"]["proxy"] is True  # the fixture's replies are not the target's own
    assert eval_main(argv[:-1]) == 0
    table = capsys.readouterr().out
    assert "tau (decode-time" in table and "tau stands for: a proxy: the store's replies come from a plain" in table
    # A cap below the split's size is said on stderr; "all" lifts it.
    assert eval_main(argv + ["--max-samples", "2"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["samples"] == 2 and "evaluated the first 2 of 4 all samples" in captured.err
    assert eval_main(argv + ["--max-samples", "all"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["max_samples"] is None and "note" not in captured.err
    # A store from another target is refused with the reason.
    other = Fingerprint(
        target_model="x",
        num_target_layers=8,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        layer_ids=LAYERS,
        max_length=128,
    )
    writer = create_store(tmp_path / "other", other)
    writer.write_shard("shard-000000", make_samples(target, count=1, seed=5))
    assert eval_main(["--store", str(tmp_path / "other")] + argv[2:]) == 1  # refused: exit 1, one line
    assert "num_target_layers: store has 8, expected 6" in capsys.readouterr().err
    assert eval_main(argv[:2] + ["--drafter", str(tmp_path / "missing")] + argv[4:]) == 2  # no such path: usage
    assert eval_main(argv + ["--anchor-stride", "0"]) == 2  # a bad flag value: usage, naming the flag
    assert "--anchor-stride" in capsys.readouterr().err


def test_eval_uses_the_held_out_split_the_run_trained_with(qwen3_dir, tmp_path, capsys):
    """The bug: `train eval` held out its own default 1 % instead of the run's
    `data.heldout_fraction`, so a run trained with 0.005 was "held-out" evaluated
    partly on samples it trained on. Now the export records the run's split and
    eval selects exactly the samples the run held out."""
    _, shards = builders.random_store(tmp_path / "store", num_shards=28, samples_per_shard=6, num_target_layers=6)
    ids = [s.sample_id for samples in shards.values() for s in samples]
    held_by_run = {i for i in ids if is_heldout(i, 0.005)}
    held_by_default = {i for i in ids if is_heldout(i, 0.01)}
    assert held_by_run and held_by_run < held_by_default  # the old default takes trained-on samples too
    config = load_config(
        None,
        tiny.drafter_sets(f"model.block_size={B}", "data.heldout_fraction=0.005", "eval.every=0", "train.max_steps=2"),
        store=str(tmp_path / "store"),
        target=str(qwen3_dir),
        out=str(tmp_path / "run"),
    )
    trainer = Trainer.from_config(config, log=lambda m: None)
    trainer.fit()
    assert {s.sample_id for s in trainer.loader.heldout_samples()} == held_by_run
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "drafter"), "--dtype", "fp32"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["dtype"] == "float32" and exported["heldout_fraction"] == 0.005
    recorded = json.loads((tmp_path / "drafter" / "config.json").read_text())["heldout_split"]
    assert recorded == {"fraction": 0.005, "rule": "sha256(sample_id)[:8] / 2**64 < fraction"}

    argv = [
        "--store",
        str(tmp_path / "store"),
        "--drafter",
        str(tmp_path / "drafter"),
        "--target",
        str(qwen3_dir),
        "--ddtree-budgets",
        "4",
        "--json",
    ]
    assert eval_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["heldout_fraction"] == 0.005 and result["samples"] == len(held_by_run)
    assert eval_main(argv + ["--split", "train", "--max-samples", "200"]) == 0  # the complement: what it trained on
    assert json.loads(capsys.readouterr().out)["samples"] == len(ids) - len(held_by_run)
    assert eval_main(argv + ["--heldout-fraction", "0.01"]) == 0  # an explicit fraction still overrides
    assert json.loads(capsys.readouterr().out)["samples"] == len(held_by_default)
    # A drafter directory without the record (a z-lab published drafter) gets the default, with a note.
    config_path = tmp_path / "drafter" / "config.json"
    data = json.loads(config_path.read_text())
    del data["heldout_split"]
    config_path.write_text(json.dumps(data))
    assert eval_main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["samples"] == len(held_by_default)
    assert "records no held-out split" in captured.err and "--heldout-fraction" in captured.err


def selector_rounds(drafter, head, sample: SampleArrays) -> tuple[list[int], int]:
    """Each response decoded block by block along DFlash 2's selector path
    (`greedy_tokens`, as `speculate` drafts); and how many blocks' paths differ
    from the slots' own argmax."""
    ids = torch.from_numpy(sample.input_ids).long()
    mask = torch.from_numpy(sample.loss_mask)
    features = torch.cat([sample.hidden[layer] for layer in LAYERS], dim=-1)

    def usable(position):
        return position < len(ids) and mask[position] == 1

    rounds, differ = [], 0
    starts = [p for p in range(len(ids)) if mask[p] == 1 and (p == 0 or mask[p - 1] == 0)]
    for anchor in starts:
        while usable(anchor) and usable(anchor + 1):
            with torch.no_grad():
                hidden = drafter(features, ids, torch.tensor([anchor]), head.embed_tokens)[0, 1:]
                path = drafter.greedy_tokens(hidden, int(ids[anchor]), head.lm_head)
                differ += int((path != head.lm_head(hidden.float()).argmax(-1)).any())
            n = 0
            while n < B - 1 and usable(anchor + 1 + n) and path[n] == ids[anchor + 1 + n]:
                n += 1
            rounds.append(n + 1)
            anchor += n + 1
    return rounds, differ


def test_eval_tau_of_a_dflash2_is_the_rollout_along_its_selector_walk(tmp_path, parts, qwen3_dir):
    """Issue 44.1: for DFlash 2, `tau` is the rollout along the selector's walk (what
    speculate drafts), counted here block by block; `tau_unary` is the argmax chain;
    the table and the training log carry both, and say which path `tau` follows."""
    from train.families.dflash.build import build_drafter

    _, head, target = parts
    config = DrafterConfig.from_target(
        target,
        mask_token_id=3,
        context_layer_ids=LAYERS,
        num_hidden_layers=1,
        block_size=B,
        architecture="dflash2",
        selector_rank=8,
        selector_top_k=4,
    )
    torch.manual_seed(1)
    drafter = build_drafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        drafter.candidate_selector.successor_codebook.normal_(0, 3.0)  # a selector that overrules the argmax
    drafter.eval()
    samples = make_samples(target, count=3, seed=2)
    store = write_store(tmp_path / "store", target, samples)
    result = ev.evaluate(drafter, head, store, everything(ddtree_budgets=(8,), batch_blocks=16), split="all")
    walked = [selector_rounds(drafter, head, s) for s in samples]
    assert sum(differ for _, differ in walked) > 0  # the two paths are not the same here
    assert result["path"] == "selector walk"
    assert result["tau"] == pytest.approx(np.mean([np.mean(r) for r, _ in walked]), abs=1e-9)
    assert [s["tau"] for s in result["per_sample"]] == pytest.approx([np.mean(r) for r, _ in walked])
    rebatched = ev.evaluate(drafter, head, store, everything(ddtree_budgets=(8,), batch_blocks=5), split="all")
    assert (rebatched["tau"], rebatched["tau_unary"]) == (
        result["tau"],
        result["tau_unary"],
    )  # batching changes nothing
    table = render_table(result)
    assert "tau (decode-time, selector walk)" in table and "tau along the argmax chain" in table
    fields = log_fields(result)
    assert (fields["eval_tau"], fields["eval_tau_unary"]) == (result["tau"], result["tau_unary"])
    dflash = ev.evaluate(parts[0], head, store, everything(ddtree_budgets=(8,)), split="all")
    assert dflash["path"] == "argmax chain" and dflash["tau_unary"] == dflash["tau"]
    assert "eval_tau_unary" not in log_fields(dflash) and "tau along the argmax chain" not in render_table(dflash)


def test_what_evals_tau_stands_for_follows_how_the_replies_were_generated():
    """Issue 59.4: the target's greedy replies -> greedy decoding; sampled at T -> decoding at
    T; replies of unknown origin -> a proxy; the target's own top-1 labels -> greedy."""
    from train.evaluation.stands_for import describe, tau_stands_for

    def fingerprint(provenance, sampling):
        return Fingerprint(
            target_model="x",
            num_target_layers=6,
            hidden_size=64,
            vocab_size=512,
            layer_ids=LAYERS,
            max_length=128,
            response_provenance=provenance,
            response_sampling=sampling,
        )

    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "thinking": "on"}
    sampled = dict(greedy, temperature=0.7)
    assert tau_stands_for(fingerprint("target", greedy), "stored") == {
        "decoding": "greedy",
        "thinking": "on",
        "proxy": False,
        "note": "the target's own replies, generated greedy, thinking on",
    }
    assert tau_stands_for(fingerprint("target", sampled), "stored")["decoding"] == "temperature 0.7 (top-p 1, top-k 0)"
    proxy = tau_stands_for(fingerprint("other", sampled), "stored")
    assert proxy["proxy"] and "another model" in describe(proxy)
    assert tau_stands_for(fingerprint("unknown", {}), "target")["decoding"] == "greedy"
    # a store from before the field hashes as before: the empty default is left out
    assert "response_sampling" not in fingerprint("unknown", {}).to_json()
