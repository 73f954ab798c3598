"""The trainer end to end on a store of real hidden states of the tiny Qwen3 target:
it learns, it resumes exactly, it refuses stores that do not fit the target, its
log has every key, the CLI export reloads to identical logits, and one optimizer
step's loss and gradients are the weighted mean over all its labels."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import builders
import pytest
import stores
import tiny
import torch
from paths import REPO

from store_schema import FingerprintMismatch, Store
from train.cli import main
from train.config_error import ConfigError
from train.config_loading import load_config
from train.data.heldout import is_heldout
from train.diagnose.report import diagnose
from train.export.drafter_dir import load_drafter
from train.families.dflash.anchors import sample_anchors
from train.fitting.checkpoint import list_checkpoints
from train.fitting.trainer import Trainer

HELDOUT = 0.25
BLOCK = 8
TINY = tiny.drafter_sets(  # a drafter and schedule small enough for CPU tests
    f"model.block_size={BLOCK}",
    "model.num_anchors=64",
    f"data.heldout_fraction={HELDOUT}",
    "data.buffer_shards=2",
    "optim.lr=1e-2",
    "eval.samples=64",
    "train.grad_accumulation=1",
    heads=True,
)
LOG_KEYS = {
    "step",
    "epoch",
    "lr",
    "loss",
    "grad_norm",
    "acc",
    "top4_acc",
    "top8_acc",
    "per_position_acc",
    "tau_per_position",
    "tokens_per_s",
    "loader_wait_frac",
}


@pytest.fixture(scope="session")
def real_store(tmp_path_factory, qwen3_dir, tokenizer) -> Path:
    """48 chats over 4 distinct functions, 8 shards, hidden states of layers 1 and 3."""
    path = tmp_path_factory.mktemp("real") / "store"
    return stores.build_real_store(
        path, qwen3_dir, tokenizer, records=stores.repeated_corpus(48, 4), samples_per_shard=6, max_tokens=128
    )


def config_for(store, target, out, *sets, max_steps):
    return load_config(
        None,
        list(TINY) + list(sets),
        store=str(store),
        target=str(target),
        out=str(out),
        **{"train.max_steps": max_steps},
    )


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def learned(real_store, qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("learned") / "run"
    config = config_for(
        real_store,
        qwen3_dir,
        out,
        "train.epochs=10",
        "train.log_every=50",
        "eval.every=150",
        "train.checkpoint_every=150",
        max_steps=300,
    )
    trainer = Trainer.from_config(config, log=lambda m: None)
    trainer.fit()
    return trainer, out


def majority_baseline(store_path: Path) -> float:
    """Accuracy on held-out scored tokens of always predicting the most common
    training label."""
    store = Store(store_path)
    train, heldout = Counter(), Counter()
    for data in store.iter_shards(store.committed_shards(), layers=[]):
        for i in range(len(data)):
            s = data.sample(i)
            labels = s.input_ids[1:][s.loss_mask[1:].bool()].tolist()
            (heldout if is_heldout(s.sample_id, HELDOUT) else train).update(labels)
    token, _ = train.most_common(1)[0]
    return heldout[token] / sum(heldout.values())


@pytest.mark.slow  # its fixture trains a drafter
def test_it_learns_well_above_the_majority_baseline(learned, real_store):
    trainer, out = learned
    log = read_log(out)
    evals = [r for r in log if "heldout_acc" in r]
    assert [r["step"] for r in evals] == [150, 300]
    assert evals[-1]["heldout_samples"] >= 8
    baseline = majority_baseline(real_store)
    assert baseline < 0.2
    assert evals[-1]["heldout_acc"] >= baseline + 0.3, (evals[-1]["heldout_acc"], baseline)
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    assert evals[-1]["heldout_tau_per_position"] > 1.5
    # The decode-time rollout is logged beside its per-position estimate.
    assert 1.0 < evals[-1]["eval_tau"] <= BLOCK and 1.0 < evals[-1]["eval_tau_per_position"] <= BLOCK
    assert evals[-1]["eval_rounds"] > 0 and all(f"eval_ddtree_{b}" in evals[-1] for b in (8, 32, 128))


@pytest.mark.slow  # its fixture trains a drafter
def test_log_has_every_key_and_config_is_saved(learned):
    _, out = learned
    lines = [r for r in read_log(out) if "loss" in r]
    assert [r["step"] for r in lines] == [50, 100, 150, 200, 250, 300]
    for record in lines:
        assert LOG_KEYS <= set(record), LOG_KEYS - set(record)
        assert len(record["per_position_acc"]) == BLOCK - 1
        assert 1.0 <= record["tau_per_position"] <= BLOCK and 0 <= record["loader_wait_frac"] <= 1
        assert "tau" not in record  # tau alone is the decode-time rollout, never a training-anchor average
        assert record["tokens_per_s"] > 0 and record["lr"] > 0
    assert lines[-1]["epoch"] >= 1  # 300 sequences > one epoch of ~36
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["num_anchors"] == 64 and saved["optim"]["lr"] == 1e-2
    assert (out / "config.yaml").is_file()
    assert [p.name for p in list_checkpoints(out)] == ["step-00000150", "step-00000300"]


@pytest.mark.slow  # its fixture trains a drafter
def test_mask_token_defaults_to_the_tokenizers_and_the_run_records_it(learned, tokenizer, tmp_path):
    trainer, out = learned
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    assert trainer.drafter.config.mask_token_id == mask_id and trainer.run_info["mask_token_rule"] == "tokenizer"
    assert json.loads((out / "config.json").read_text())["model"]["mask_token_id"] == mask_id
    assert main(["export", str(out), "--out", str(tmp_path / "export")]) == 0
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == mask_id and exported["mask_token_rule"] == "tokenizer"


@pytest.mark.slow  # child processes
def test_export_via_cli_gives_identical_logits(learned, tmp_path):
    trainer, out = learned
    drafter, head = trainer.drafter.eval(), trainer.head
    torch.manual_seed(0)
    features = torch.randn(40, 2 * 64)
    input_ids = torch.randint(0, 512, (40,))
    anchors = torch.tensor([0, 9, 21, 30])

    def logits(model):
        with torch.no_grad():
            return head.lm_head(
                model(
                    features.to(model.fc.weight.dtype), input_ids, anchors, head.embed_tokens.to(model.fc.weight.dtype)
                ).float()
            )

    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        target = tmp_path / name
        result = subprocess.run(
            [sys.executable, "-m", "train", "export", str(out), "--out", str(target), "--dtype", name],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        config = json.loads((target / "config.json").read_text())
        assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
        assert config["dflash_config"]["target_layer_ids"] == [1, 3] and config["block_size"] == BLOCK
        reloaded = load_drafter(target)
        reference = DFlashDrafterCopy(drafter, dtype)
        assert torch.equal(logits(reloaded), logits(reference)), name
    head.embed_tokens.float()


def DFlashDrafterCopy(drafter, dtype):
    import copy

    return copy.deepcopy(drafter).to(dtype).eval()


def test_resume_continues_exactly(real_store, qwen3_dir, tmp_path):
    sets = [
        "train.log_every=1",
        "eval.every=0",
        "train.checkpoint_every=3",
        "train.keep_checkpoints=0",
        "train.batch_size=2",
        "train.grad_accumulation=2",
        "model.num_anchors=16",
    ]
    whole = tmp_path / "whole"
    main(
        [
            "fit",
            "--store",
            str(real_store),
            "--target",
            str(qwen3_dir),
            "--out",
            str(whole),
            "--max-steps",
            "12",
            *tiny.cli_sets(TINY + sets),
        ]
    )
    # The interrupted run: what was on disk after step 6 (checkpoint 6 written, later work lost).
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    for path in list_checkpoints(cut)[2:]:
        shutil.rmtree(path)
    assert list_checkpoints(cut)[-1].name == "step-00000006"
    main(["fit", "--out", str(cut), "--resume"])

    expected, got = read_log(whole), read_log(cut)
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(expected[6:], got[6:]):
        assert a["step"] == b["step"] and a["epoch"] == b["epoch"]
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6, (a, b)
        assert a["acc"] == b["acc"] and a["lr"] == b["lr"]
    assert expected[-1]["epoch"] >= 1  # the resumed steps crossed an epoch boundary
    # diagnose checks a real run's logged LR against the trainer's own schedule: exact.
    for run in (whole, cut):
        lr = diagnose(run).lr
        assert lr["checked"] and lr["max_error"] < 1e-12 and lr["config"]["total_steps"] == 12


def test_a_step_is_the_weighted_mean_over_all_its_labels(real_store, qwen3_dir, tmp_path):
    """Three sequences of different lengths in one optimizer step: the loss and
    its gradients equal sum(w * CE) / sum(w) over every scored label of the
    step, computed here with plain cross-entropy (SpecForge's normalisation),
    not the mean of the three sequences' own normalised losses. The divide is
    the optimizer's, folded into its clip (here off, to see the gradients whole)."""
    config = config_for(
        real_store,
        qwen3_dir,
        tmp_path / "run",
        "train.grad_accumulation=3",
        "optim.grad_clip=0",
        *tiny.DFLASH_DECAY,
        max_steps=1,
    )
    trainer = Trainer.from_config(config, log=lambda m: None)
    samples = [next(trainer.loader) for _ in range(3)]
    trainer.loader.close()
    samples = [
        dataclasses.replace(
            s, input_ids=s.input_ids[:n], loss_mask=s.loss_mask[:n], features=[f[:n] for f in s.features]
        )
        for s, n in zip(samples, (128, 90, 60))
    ]
    assert [s.num_tokens for s in samples] == [128, 90, 60]
    drafter, head = trainer.drafter, trainer.head
    state = trainer.generator.get_state()
    grads = {}
    for normalize in ("step", "sequence"):
        trainer.config.loss.normalize = normalize
        trainer.generator.set_state(state)
        sums = trainer.backward_step(samples)
        norm = trainer.optimizer.clip(trainer.gradient_divisor(sums))
        grads[normalize] = {name: p.grad.clone() for name, p in drafter.named_parameters()}

    generator = torch.Generator().manual_seed(0)
    generator.set_state(state)
    gamma = 4.0  # the default for B = 8
    weighted, weights, per_sequence = 0.0, 0.0, []
    for sample in samples:
        ids, mask = sample.input_ids, sample.loss_mask
        anchors = sample_anchors(mask, BLOCK, 64, generator)
        hidden = drafter(sample.context_features(), ids, anchors, head.embed_tokens)
        logits = head.lm_head(hidden.float())  # [N, B, V]
        positions = anchors[:, None] + torch.arange(BLOCK)
        inside = positions.clamp(max=len(ids) - 1)
        valid = (positions < len(ids)) & mask[inside].bool()
        valid[:, 0] = False
        w = torch.exp(-(torch.arange(BLOCK) - 1) / gamma) * valid
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[inside].flatten(), reduction="none").view_as(w)
        weighted = weighted + (w * ce).sum()
        weights += float(w.sum())
        per_sequence.append((w * ce).sum() / w.sum())
    loss = weighted / weights
    assert sums.means()["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)  # the logged loss, too
    for normalize, objective in (("step", loss), ("sequence", sum(per_sequence) / 3)):
        drafter.zero_grad(set_to_none=True)
        objective.backward(retain_graph=True)
        for name, p in drafter.named_parameters():
            assert torch.allclose(grads[normalize][name], p.grad, rtol=1e-4, atol=1e-8), (normalize, name)
    # The two normalisations are different steps (the sequences hold 128, 90 and 60 tokens).
    differ = [(grads["step"][n] - grads["sequence"][n]).norm() / grads["step"][n].norm() for n in grads["step"]]
    assert max(differ) > 1e-2
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads["sequence"].values()]))
    assert float(norm) == pytest.approx(float(total), rel=1e-6)  # the logged norm: of the divided gradients


@pytest.mark.parametrize(
    "field,overrides",
    [
        ("hidden_size", {"hidden_size": 32}),
        ("vocab_size", {"vocab_size": 1024}),
        ("num_target_layers", {"num_target_layers": 8}),
    ],
)
def test_refuses_a_store_from_another_target(qwen3_dir, tmp_path, field, overrides):
    options = dict(num_shards=1, samples_per_shard=2, num_target_layers=6, hidden_size=64, vocab_size=512)
    options.update(overrides)
    builders.random_store(tmp_path / "s", **options)
    config = config_for(tmp_path / "s", qwen3_dir, tmp_path / "run", max_steps=1)
    with pytest.raises(FingerprintMismatch, match=field) as info:
        Trainer.from_config(config)
    assert set(info.value.differences) == {field}


def test_refuses_a_store_with_the_final_layer(qwen3_dir, tmp_path):
    """A fingerprint naming the final layer is refused where the store is opened (the
    layer-id rule in store_schema.layout), so the trainer never sees such a store."""
    from store_schema import Store

    builders.random_store(tmp_path / "s", num_shards=1, samples_per_shard=2, num_target_layers=6, layer_ids=(1, 3))
    root = tmp_path / "s" / "zarr.json"
    meta = json.loads(root.read_text())
    meta["attributes"]["dflash_store"]["fingerprint"]["layer_ids"] = [1, 5]  # 5 = the final layer of 6
    root.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="final layer 5 is never a context layer"):
        Store(tmp_path / "s")
    config = config_for(tmp_path / "s", qwen3_dir, tmp_path / "run", max_steps=1)
    with pytest.raises(ValueError, match="final layer 5 is never a context layer"):
        Trainer.from_config(config)


def test_config_validation_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(None, ["optim.lr=-1"], store="s", target="t", out="o")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["optim.learning_rate=1"], store="s", target="t", out="o")
    with pytest.raises(ConfigError, match="loss.labels"):
        load_config(None, ["loss.labels=logits"], store="s", target="t", out="o")
    with pytest.raises(ConfigError, match="ambiguous, say loss.labels or eval.labels"):
        load_config(None, ["labels=target"], store="s", target="t", out="o")
    with pytest.raises(ConfigError, match="eval.ddtree_budgets"):
        load_config(None, ["eval.ddtree_budgets=[8, 0]"], store="s", target="t", out="o")
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "missing.yaml", store="s", target="t", out="o")
    # Both dtype spellings are accepted; the long one is kept (and saved).
    assert load_config(None, ["train.dtype=bf16"], store="s", target="t", out="o").train.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="train.dtype"):
        load_config(None, ["train.dtype=int8"], store="s", target="t", out="o")
    with pytest.raises(ConfigError, match="store"):
        load_config(None, [], target="t", out="o")
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 3e-4\n  betas: [0.9, 0.99]\nnum_anchors: 128\neval:\n  ddtree_budgets: [4, 16]\n")
    config = load_config(path, ["train.seed=7", "eval.samples=null"], store="s", target="t", out="o")
    assert (config.optim.lr, config.optim.betas, config.model.num_anchors, config.train.seed) == (
        3e-4,
        (0.9, 0.99),
        128,
        7,
    )
    assert config.eval.ddtree_budgets == (4, 16) and config.eval.samples is None
    config.save(tmp_path / "run")
    assert load_config(tmp_path / "run" / "config.yaml") == config
