"""A drafter trained on a projected store (`store_schema project`): it trains on the
states lifted from the stored coordinates, its checkpoints carry the projection, and
export folds it into `fc`, so the exported drafter reads the target's raw states:
z-lab's reference loads it and computes on raw states what the trained drafter computed
on lifted ones (1e-4), and `speculate` decodes losslessly with it."""

from __future__ import annotations

import json

import pytest
import stores
import tiny
import torch
from dflash.model import DFlash2DraftModel
from reference_oracle import load_reference, reference_logits

from store_schema import Store
from store_schema.__main__ import main as store_cli
from train.cli import main as train_cli
from train.config_loading import load_config
from train.families.kinds import config_from_state, family_of
from train.fitting.checkpoint import latest_checkpoint, load_model_weights, read_state
from train.fitting.trainer import Trainer
from train.target_head import load_target_head

LAYERS = (1, 3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, qwen3_dir, tokenizer):
    """(bf16 store, projected store, run, float32 export) of a few steps on the projected store."""
    root = tmp_path_factory.mktemp("projected")
    kwargs = dict(records=stores.repeated_corpus(24, 4), samples_per_shard=6, max_tokens=128, layer_ids=LAYERS)
    bf16 = stores.build_real_store(root / "bf16", qwen3_dir, tokenizer, **kwargs)
    projected = root / "projected"
    assert store_cli(["project", str(bf16), "--out", str(projected), "--rank", "32", "--json"]) == 0  # of 64
    run = root / "run"
    sets = tiny.drafter_sets("model.num_anchors=16", "data.heldout_fraction=0.25", "eval.every=0", "train.max_steps=6")
    config = load_config(None, sets, store=str(projected), target=str(qwen3_dir), out=str(run))
    Trainer.from_config(config, log=lambda message: None).fit()
    export = root / "drafter"
    assert train_cli(["export", str(run), "--out", str(export), "--dtype", "float32"]) == 0
    return bf16, projected, run, export


def _lifted(raw: torch.Tensor, lifts: dict) -> torch.Tensor:
    """Each context layer's raw states through P P^T (what the trainer saw, in exact arithmetic)."""
    hidden = raw.shape[1] // len(LAYERS)
    parts = []
    for index, layer in enumerate(LAYERS):
        x = raw[:, index * hidden : (index + 1) * hidden].double()
        p = lifts[layer].double() if layer in lifts else None
        parts.append(x if p is None else x @ p @ p.T)
    return torch.cat(parts, dim=1).float()


def test_the_export_reads_raw_states_as_the_trained_drafter_read_lifted_ones(trained, qwen3_dir, capsys):
    bf16, projected, run, export = trained
    lifts = Store(projected).lifts()
    assert lifts and all(p.shape[1] < p.shape[0] for p in lifts.values()), "some layer is projected"
    checkpoint = latest_checkpoint(run)
    assert (checkpoint / "projection.safetensors").is_file()
    config = config_from_state(read_state(checkpoint))
    drafter = family_of(config).build(config)
    drafter.load_state_dict(load_model_weights(checkpoint))
    drafter = drafter.float().eval()
    reference = load_reference(export, DFlash2DraftModel)  # every tensor in place
    head = load_target_head(qwen3_dir)

    store = Store(bf16)
    sample = store.read_sample(store.committed_shards()[0], 0)
    raw = torch.cat([sample.hidden[layer].float() for layer in LAYERS], dim=1)
    input_ids = sample.input_ids.long()
    anchors = [1, 9, len(input_ids) - 9]
    with torch.no_grad():
        hidden = drafter(_lifted(raw, lifts), input_ids, torch.tensor(anchors), head.embed_tokens, attention="sdpa")
        for j, anchor in enumerate(anchors):
            theirs = reference_logits(reference, head, raw, input_ids, anchor)
            assert (head.lm_head(hidden[j]) - theirs).abs().max() < 1e-4, anchor
        unfolded = reference_logits(reference, head, _lifted(raw, lifts), input_ids, anchors[1])
        assert (head.lm_head(hidden[1]) - unfolded).abs().max() < 1e-4, "P P^T is idempotent"

    capsys.readouterr()
    command = ["speculate", "--drafter", str(export), "--target", str(qwen3_dir), "--store", str(projected)]
    assert train_cli([*command, "--limit", "2", "--max-new-tokens", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["lossless"] is True


def test_a_resume_on_a_store_with_another_projection_is_refused(trained, tmp_path, capsys):
    """The checkpoint's projection is part of what the drafter computes: resuming it on
    a store projected otherwise stops before step 1, naming the store."""
    bf16, _, run, _ = trained
    other = tmp_path / "other"
    assert store_cli(["project", str(bf16), "--out", str(other), "--rank", "32", "--fit-tokens", "200", "--json"]) == 0
    capsys.readouterr()
    assert train_cli(["fit", "--out", str(run), "--resume", "--store", str(other), "--max-steps", "8"]) == 1
    assert "projection" in capsys.readouterr().err


def test_an_eagle3_folds_the_projection_into_its_own_first_map(qwen3_dir):
    """EAGLE-3 reads its three layers through its own `fc` (`DrafterFamily.context_map`):
    folded, it computes on raw states what it computed on lifted ones."""
    from store_schema.runtime.target_config import read_target_config
    from train.families.eagle3.config import Eagle3Config
    from train.families.eagle3.model import Eagle3Drafter
    from train.fitting.store_projection import fold_into

    layers = [1, 2, 4]
    config = Eagle3Config.from_target(read_target_config(qwen3_dir), layers, 64, 3)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).float().eval()
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(1)
    lifts = {layer: torch.linalg.qr(torch.randn(hidden, 32, generator=generator))[0] for layer in (1, 4)}
    raw = torch.randn(20, len(layers) * hidden, generator=generator)
    lifted = torch.cat(
        [
            raw[:, i * hidden : (i + 1) * hidden] @ lifts[layer] @ lifts[layer].T
            if layer in lifts
            else raw[:, i * hidden : (i + 1) * hidden]
            for i, layer in enumerate(layers)
        ],
        dim=1,
    )
    input_ids = torch.randint(0, config.vocab_size, (20,), generator=generator)
    embed = load_target_head(qwen3_dir).embed_tokens
    with torch.no_grad():
        before = torch.stack(drafter(lifted, input_ids, embed, 3))
        fold_into(family_of(config).context_map(drafter), layers, {k: v.numpy() for k, v in lifts.items()})
        after = torch.stack(drafter(raw, input_ids, embed, 3))
    assert (after - before).abs().max() < 1e-4
