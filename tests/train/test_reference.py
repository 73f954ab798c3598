"""z-lab's reference package (`dflash` 0.1.0 on PyPI, installed by the Makefile) as
the oracle: the training mask equals its `_attention_mask` for every layer rule, an
export loads in its `DFlashDraftModel` with no missing or unexpected weights and
gives the same logits (full and sliding layers, every attention path), and a drafter
it saves loads here with identical weights and logits."""

from __future__ import annotations

import warnings

import builders
import pytest
import torch
from dflash.model import _attention_mask
from eval_stores import everything, make_samples, write_store
from reference_oracle import ANCHORS, BLOCK, T, inputs, load_reference, reference_logits

from store_schema.runtime.target_config import read_target_config
from train.export.drafter_dir import export_drafter, load_drafter
from train.families.dflash.anchors import LayerAttention, dense_attention_mask
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.target_head import load_target_head

GEOMETRIES = {
    # 4 heads x 16, 2 KV heads (grouped queries), every layer full attention.
    "full": dict(
        num_hidden_layers=2,
        layer_types=["full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    # The published layout and default sizes (1 head x 128 at hidden 64); window 8 cuts the context.
    "sliding": dict(num_hidden_layers=3, sliding_window=8),
    # A window shorter than the block: causal and cut inside the block too.
    "short_window": dict(
        num_hidden_layers=2, sliding_window=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    ),
    # is_causal false (as DFlash2 configs set): sliding layers bidirectional within +-window.
    "noncausal": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention"] * 3,
        sliding_window=5,
        is_causal=False,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
    ),
}


@pytest.mark.parametrize(
    "rule",
    [
        LayerAttention(),
        LayerAttention(causal=True),
        LayerAttention(causal=True, window=6),
        LayerAttention(causal=True, window=3),
        LayerAttention(causal=False, window=4),
    ],
    ids=str,
)
def test_training_mask_equals_the_reference_mask_per_block(rule):
    """Block j's rows of the training mask: the reference's mask over its keys at
    inference ([context < anchor | the block]), False everywhere else."""
    anchors = torch.tensor(ANCHORS)
    mask = dense_attention_mask(anchors, T, BLOCK, rule)
    for j, anchor in enumerate(ANCHORS):
        query, key = torch.zeros(1, 1, BLOCK, 1), torch.zeros(1, 1, anchor + BLOCK, 1)
        reference = _attention_mask(query, key, is_causal=rule.causal, sliding_window=rule.window)[0, 0]
        expected = torch.zeros(BLOCK, T + len(ANCHORS) * BLOCK, dtype=torch.bool)
        expected[:, :anchor] = reference[:, :anchor]
        own = T + j * BLOCK
        expected[:, own : own + BLOCK] = reference[:, anchor:]
        assert torch.equal(mask[j * BLOCK : (j + 1) * BLOCK], expected), (j, anchor)


def make_drafter(qwen3_dir, geometry: dict) -> DFlashDrafter:
    target = read_target_config(qwen3_dir)
    config = DrafterConfig.from_target(
        target, mask_token_id=3, context_layer_ids=[1, 3], block_size=BLOCK, **geometry, architecture="dflash"
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_export_loads_in_the_reference_and_gives_the_same_logits(qwen3_dir, tmp_path, geometry):
    drafter = make_drafter(qwen3_dir, GEOMETRIES[geometry])
    head = load_target_head(qwen3_dir)
    reference = load_reference(export_drafter(drafter, tmp_path / "drafter", dtype=torch.float32))
    for i, layer in enumerate(reference.layers):
        rule = drafter.config.layer_attention(i)
        assert (layer.self_attn.is_causal, layer.self_attn.sliding_window) == (rule.causal, rule.window)
    assert reference.block_size == BLOCK and reference.target_layer_ids == [1, 3]

    features, input_ids = inputs()
    anchors = torch.tensor(ANCHORS)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without torch.compile warns on CPU
        expected = torch.stack([reference_logits(reference, head, features, input_ids, a) for a in ANCHORS])
        for attention in ("split", "sdpa", "flex"):
            ours = head.lm_head(drafter(features, input_ids, anchors, head.embed_tokens, attention=attention))
            assert (ours - expected).abs().max() < 1e-4, attention


@pytest.fixture(scope="module")
def zlab_dir(tmp_path_factory):
    """A z-lab-format directory written by the reference's own save_pretrained:
    sliding layers with window 6, then full attention; returns (dir, the model)."""
    path = tmp_path_factory.mktemp("zlab") / "drafter"
    return path, builders.save_reference_drafter(path, BLOCK)


def test_a_drafter_the_reference_saves_loads_here_and_back(qwen3_dir, zlab_dir, tmp_path):
    """It loads with identical weights and logits, and our export of it reloads in
    the reference with identical weights."""
    path, saved = zlab_dir
    config = saved.config
    drafter = load_drafter(path).eval()
    assert drafter.config.layer_types == config.layer_types and drafter.config.sliding_window == 6
    assert drafter.config.mask_token_id == 5 and drafter.config.block_size == BLOCK
    theirs = saved.state_dict()
    assert set(drafter.state_dict()) == set(theirs)
    assert all(torch.equal(t, theirs[name]) for name, t in drafter.state_dict().items())

    head = load_target_head(qwen3_dir)
    features, input_ids = inputs(seed=2)
    with torch.no_grad():
        ours = head.lm_head(drafter(features, input_ids, torch.tensor(ANCHORS), head.embed_tokens))
        for j, anchor in enumerate(ANCHORS):
            assert (ours[j] - reference_logits(saved, head, features, input_ids, anchor)).abs().max() < 1e-4, anchor

    again = load_reference(export_drafter(drafter, tmp_path / "again", dtype=torch.float32))
    assert all(torch.equal(t, theirs[name]) for name, t in again.state_dict().items())


def test_eval_takes_a_drafter_the_reference_saved(qwen3_dir, zlab_dir, tmp_path, capsys):
    """`train eval` on the reference's directory (no `heldout_split` record, sliding
    layers) measures what evaluating the loaded drafter directly measures."""
    import json

    from store_schema import Store
    from train.__main__ import main
    from train.evaluation import evaluate as ev

    target = read_target_config(qwen3_dir)
    write_store(tmp_path / "store", target, make_samples(target, count=4, seed=7))
    argv = [
        "eval",
        "--store",
        str(tmp_path / "store"),
        "--drafter",
        str(zlab_dir[0]),
        "--target",
        str(qwen3_dir),
        "--split",
        "all",
        "--ddtree-budgets",
        "4",
        "--json",
    ]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    direct = ev.evaluate(
        load_drafter(zlab_dir[0]).eval(),
        load_target_head(qwen3_dir),
        Store(tmp_path / "store"),
        everything(ddtree_budgets=(4,)),
        split="all",
    )
    assert printed["samples"] == 4 and 1.0 <= printed["tau"] <= BLOCK
    assert printed["tau"] == pytest.approx(direct["tau"], abs=1e-6)
