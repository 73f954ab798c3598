"""EAGLE-3, the second drafter family (issue 63), trained from a store extracted as
for DFlash:

- training-time test (every chain's steps at once) computes what drafting one token
  at a time computes, KV cache and growing positions included;
- the draft vocabulary is the training split's most frequent reply tokens, written as
  the engines read it (target id = draft id + d2t[draft id]);
- the export is `LlamaForCausalLMEagle3` with vLLM's aux ids (this project's id + 1),
  loads back to the same drafter, and carries no target tensor;
- the config refuses another family's keys and a store with too few layers, naming the fix;
- a drafter trained on the target's greedy replies decodes losslessly (greedy, and
  in distribution at temperature), above a random drafter's tau, and eval's tau along
  its greedy chain is within 5 % of the tau decoding measures on the same prompts;
- vLLM's own `llama_eagle3` (the CPU build, `make vllm-env`) drafts the same logits
  for a round of steps (within 1e-4), and serves the trained export losslessly with
  the same rounds as `speculate`, position by position.

The served tests use the vLLM-sized tiny target (2 heads of 32: tests/train/conftest.py);
an EAGLE-3 drafter takes its target's attention geometry.
"""

from __future__ import annotations

import json

import builders
import pytest
import torch
from random_drafters import random_export
from reference_oracle import load_model
from served import captured_first_round
from stores import greedy_store

from store_schema.runtime.target_config import read_target_config
from store_schema.runtime.target_model import load_target_model
from train.cli import main
from train.config_error import ConfigError
from train.config_loading import load_config
from train.data.prompts import store_prompts
from train.decoding.speculate import decode_prompt, summarize
from train.decoding.target_decode import TargetSession
from train.evaluation.config import EvalConfig
from train.evaluation.evaluate import evaluate_sample_ids
from train.export.drafter_dir import export_drafter, load_drafter
from train.families.eagle3.config import Eagle3Config
from train.families.eagle3.decoding import ChainDraftSession
from train.families.eagle3.export import engine_aux_ids, project_layer_ids
from train.families.eagle3.model import Eagle3Drafter
from train.families.eagle3.plan import default_layers
from train.families.eagle3.step import chain_labels, step_loss
from train.families.eagle3.vocab import draft_vocabulary
from train.families.family import StepSample
from train.families.kinds import family_of
from train.fitting.trainer import Trainer
from train.sampling import Sampling
from train.target_head import load_target_head

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = [1, 2, 3]
HELDOUT = 0.25
NEW_TOKENS = 32
STEPS = 4
TOLERANCE = 1e-4
PROMPT = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]


def random_eagle3(target_dir, draft_vocab_size=300, seed=0, dtype=torch.float32) -> Eagle3Drafter:
    config = Eagle3Config.from_target(read_target_config(target_dir), LAYERS, draft_vocab_size, STEPS)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config).to(dtype).eval()
    chosen = torch.randperm(config.vocab_size)[:draft_vocab_size].sort().values
    drafter.d2t.copy_(chosen - torch.arange(draft_vocab_size))
    drafter.t2d[chosen] = True
    return drafter


@torch.no_grad()
def test_training_time_test_equals_drafting_one_token_at_a_time(qwen3_dir):
    drafter = random_eagle3(qwen3_dir, dtype=torch.float64)
    embed = torch.nn.Embedding(drafter.config.vocab_size, drafter.config.hidden_size).double()
    length = 24
    features = torch.randn(length, 3 * drafter.config.hidden_size, dtype=torch.float64)
    tokens = torch.randint(0, drafter.config.vocab_size, (length,))
    outputs = drafter(features, tokens, embed, STEPS)
    for chain in (0, 5, length - STEPS - 2):
        session = ChainDraftSession(drafter, embed, STEPS + 1)
        session.extend(features[: chain + 1], tokens[: chain + 1])
        fed = iter(tokens[chain + 2 :].tolist())  # each step fed the token training feeds it
        drafted = session.chain(int(tokens[chain + 1]), STEPS + 1, lambda logits: next(fed))
        for step in range(STEPS):
            trained = drafter.target_logits(drafter.lm_head(outputs[step][chain]))
            finite = torch.isfinite(trained)
            assert torch.equal(finite, torch.isfinite(drafted[step])) and int(finite.sum()) == 300
            assert (trained[finite] - drafted[step][finite]).abs().max() < 1e-6, (chain, step)


def test_the_draft_vocabulary_is_the_most_frequent_reply_tokens():
    counts = torch.tensor([0, 5, 9, 5, 1, 7, 5, 0])
    d2t, t2d = draft_vocabulary(counts, 4)
    targets = torch.arange(4) + d2t  # vLLM: target id = draft id + d2t[draft id]
    assert targets.tolist() == [1, 2, 3, 5]  # 9, 7 and the lower ids of the three 5s, in id order
    assert t2d.nonzero().flatten().tolist() == targets.tolist()


def test_the_export_writes_vllms_aux_ids_and_loads_back(qwen3_dir, tmp_path):
    drafter = random_eagle3(qwen3_dir)
    assert engine_aux_ids([1, 31, 61]) == [2, 32, 62] and project_layer_ids([2, 32, 62]) == [1, 31, 61]
    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32, heldout_fraction=HELDOUT)
    data = json.loads((out / "config.json").read_text())
    assert data["architectures"] == ["LlamaForCausalLMEagle3"] and data["num_hidden_layers"] == 1
    assert data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert data["draft_vocab_size"] == 300 and data["vocab_size"] == drafter.config.vocab_size
    loaded = load_drafter(out)
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.lm_head.weight.shape == (300, drafter.config.hidden_size)
    assert not [name for name in loaded.state_dict() if "embed_tokens" in name]


def test_the_config_refuses_another_familys_keys():
    with pytest.raises(ConfigError, match=r"model.block_size: model.architecture eagle3 does not read it"):
        load_config(None, ["model.architecture=eagle3", "model.block_size=8"], store="s", target="t", out="o")
    with pytest.raises(ConfigError, match=r"model.ttt_steps: model.architecture dflash2 does not read it"):
        load_config(None, ["model.ttt_steps=3"], store="s", target="t", out="o")
    config = load_config(None, ["model.architecture=eagle3", "model.ttt_steps=3"], store="s", target="t", out="o")
    assert config.model.ttt_steps == 3


def test_a_store_with_too_few_layers_is_refused_with_the_fix():
    assert default_layers([1, 16, 31, 46, 61], 64) == [1, 31, 61]  # the published DFlash store's triple
    with pytest.raises(ConfigError, match=r"holds \[1, 3\].*--layers-from"):
        default_layers([1, 3], 6)


# -- a drafter trained on the target's own outputs -------------------------------------
@pytest.fixture(scope="module")
def trained(target_dir, tokenizer, tmp_path_factory):
    """(target dir, store, export dir) of an EAGLE-3 trained 300 steps on a greedy store."""
    root = tmp_path_factory.mktemp("eagle3")
    store = greedy_store(root / "store", target_dir, tokenizer, LAYERS, count=24, new_tokens=NEW_TOKENS)
    sets = [
        "model.architecture=eagle3",
        f"model.ttt_steps={STEPS}",
        "model.draft_vocab_size=256",
        f"data.heldout_fraction={HELDOUT}",
        "data.buffer_shards=2",
        "optim.lr=1e-2",
        "eval.every=0",
        "train.epochs=100",
        "train.log_every=100",
    ]
    config = load_config(None, sets, store=str(store), target=str(target_dir), out=str(root / "run"))
    config.train.max_steps = 300
    trainer = Trainer.from_config(config, log=lambda message: None)
    trainer.fit()
    export = export_drafter(trainer.drafter, root / "export", dtype=torch.float32, heldout_fraction=HELDOUT)
    return target_dir, store, export


@pytest.mark.slow  # its fixture trains a drafter
def test_a_trained_eagle3_decodes_losslessly_and_eval_measures_its_tau(trained):
    target_dir, store, export = trained
    model, drafter = load_model(target_dir), load_drafter(export).eval()
    prompts = store_prompts(store, HELDOUT, limit=4)
    results = [decode_prompt(model, drafter, p.id, p.input_ids, NEW_TOKENS, stop_ids=[]) for p in prompts]
    decoded = summarize(results)
    assert decoded["lossless"], [r.first_mismatch() for r in results]
    assert decoded["tau"] > 1.3 and max(max(r.speculative.acceptance_lengths) for r in results) >= 3
    evaluated = evaluate_sample_ids(
        drafter,
        load_target_head(target_dir),
        store,
        [p.id for p in prompts],
        EvalConfig(samples=None),
        max_new_tokens=NEW_TOKENS,
    )
    print(f"eagle3: decoded tau {decoded['tau']}, eval tau {evaluated['tau']}")
    assert evaluated["tau"] == pytest.approx(decoded["tau"], rel=0.05)
    hot = Sampling(temperature=1.0)
    sampled = [decode_prompt(model, drafter, p.id, p.input_ids, NEW_TOKENS, [], hot, seed=3) for p in prompts]
    assert summarize(sampled)["passed"]


def test_a_random_eagle3_is_lossless(qwen3_dir, tokenizer):
    model, drafter = load_model(qwen3_dir), random_eagle3(qwen3_dir)
    prompt = builders.chat_prompts(tokenizer, 1, seed=4)[0]
    result = decode_prompt(model, drafter, "p", prompt, 16, stop_ids=[])
    assert result.lossless and result.speculative.acceptance_lengths


@pytest.mark.slow  # vLLM runs in a child process
def test_a_trained_eagle3_is_served_as_trained(trained, vllm_python, capsys, tmp_path):
    target_dir, store, export = trained
    argv = ["serve-check", "--drafter", export, "--target", target_dir, "--store", store, "--limit", "3"]
    code = main([*map(str, argv), "--max-new-tokens", "24", "--workdir", str(tmp_path / "vllm"), "--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0, err
    assert summary["lossless"] and summary["speculate_lossless"] and summary["vllm_device"] == "cpu"
    assert summary["speculate_tokens_per_round"] > 1.3, summary
    assert summary["rounds_equal_prompts"] == 3, summary["per_prompt"]  # the same rounds, one by one
    counts = summary["per_position_accepted"]
    assert len(counts["served"]) == STEPS and counts["served"] == counts["speculate"]


@pytest.mark.slow  # vLLM runs in a child process
@torch.no_grad()
def test_vllms_eagle3_drafts_the_same_logits_as_the_project(target_dir, vllm_python, tmp_path):
    export = export_drafter(random_eagle3(target_dir), tmp_path / "drafter", dtype=torch.float32)
    drafter = load_drafter(export, dtype=torch.float32).eval()
    how = family_of(drafter).served(drafter.config)
    served = captured_first_round(vllm_python, target_dir, export, how, PROMPT, tmp_path / "vllm")
    model = load_target_model(target_dir, torch.device("cpu"), torch.float32).model.eval()
    logits, features = TargetSession(model, LAYERS).forward(torch.tensor(PROMPT), features=True)
    assert (served["target_features"] - features).abs().max() < TOLERANCE  # vLLM's target agrees with transformers
    assert (served["context"] - drafter.fc(features)).abs().max() < TOLERANCE
    bonus, length = int(logits[-1].argmax()), len(PROMPT)
    # Step 0 over the prompt: each position's token shifted by one (the bonus token last), then one row a step.
    assert served["step_ids"][:length].tolist() == PROMPT[1:] + [bonus]
    assert served["step_positions"].tolist() == list(range(length)) + list(range(length, length + STEPS - 1))
    session = ChainDraftSession(drafter, model.get_input_embeddings(), STEPS + 1)
    session.extend(features, torch.tensor(PROMPT))
    ours = session.chain(bonus, STEPS + 1, lambda row: int(row.argmax()))
    theirs = served["draft_logits"]
    assert theirs.shape == ours.shape == (STEPS, drafter.config.vocab_size)
    finite = torch.isfinite(ours)
    assert torch.equal(finite, torch.isfinite(theirs))  # the draft vocabulary, through d2t
    assert (ours[finite] - theirs[finite]).abs().max() < TOLERANCE
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert served["step_ids"][length:].tolist() == ours.argmax(-1)[:-1].tolist()  # each step fed the last draft


@pytest.mark.slow  # its fixture trains a drafter
def test_fine_tuning_starts_from_an_eagle3_and_refuses_another_family(trained, mask_id, tmp_path, capsys):
    target_dir, store, export = trained
    argv = ["fit", "--store", str(store), "--target", str(target_dir), "--max-steps", "2"]
    sets = ["--set", "model.architecture=eagle3", "--set", f"data.heldout_fraction={HELDOUT}", "--set", "eval.every=0"]
    assert main([*argv, "--out", str(tmp_path / "tuned"), "--init-from", str(export), *sets]) == 0
    dflash = random_export(target_dir, mask_id, tmp_path / "dflash")
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "refused"), "--init-from", str(dflash), *sets]) == 1
    assert "a dflash drafter, and model.architecture eagle3 is another family's (EAGLE-3)" in capsys.readouterr().err


def test_the_kl_loss_renormalises_the_targets_top_k_over_the_draft_vocabulary(qwen3_dir):
    """With the store's top-k, step k's loss at chain t is the cross-entropy to the
    target's top-k at row t+1+k renormalised over the draft vocabulary; a row whose
    top-k lies wholly outside it is not scored."""
    drafter = random_eagle3(qwen3_dir)
    length, k = 10, 3
    inside = (torch.arange(drafter.config.draft_vocab_size) + drafter.d2t)[:8]  # target ids drafted
    outside = torch.nonzero(~drafter.t2d).flatten()[:k]
    topk_ids = inside[torch.arange(length * k) % 8].view(length, k)
    topk_ids[:, 2] = outside[0]  # one of every row's three outside the draft vocabulary
    topk_ids[4] = outside  # row 4: all three outside
    logprobs = torch.log_softmax(torch.randn(length, k), -1)
    sample = StepSample(torch.arange(length), torch.ones(length), torch.zeros(length, 1), topk_ids, logprobs)
    labels = chain_labels(drafter, sample, STEPS, use_target=False, soft=True)
    assert not labels.valid[3, 0] and labels.valid[2, 0]  # chain 3, step 0 reads row 4
    logits = torch.randn(length - 1, drafter.config.draft_vocab_size)
    loss = step_loss(logits, labels, 0)
    teacher = torch.softmax(logprobs[3, :2], -1)  # chain 2 step 0 reads row 3: its two drafted ids
    drafted = drafter.draft_ids_of(topk_ids[3, :2])
    expected = -(teacher * torch.log_softmax(logits[2], -1)[drafted]).sum()
    assert loss[2] == pytest.approx(float(expected), rel=1e-5) and loss[3] == 0
