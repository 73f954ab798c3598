"""The DFlash drafter: parameter names, the training mask (no leaks), agreement with
a one-block-at-a-time reference, split == sdpa (outputs and gradients) and flex ==
sdpa for full and sliding layers, config validation, anchors."""

from __future__ import annotations

import warnings

import pytest
import torch

from store_schema.runtime.target_config import read_target_config
from train.families.dflash import attention as attention_paths
from train.families.dflash.anchors import LayerAttention, anchor_candidates, dense_attention_mask, sample_anchors
from train.families.dflash.model import DFlashDrafter, DrafterConfig, default_context_layer_ids

HIDDEN, VOCAB, BLOCK, T = 64, 512, 8, 48


def tiny_config(**overrides) -> DrafterConfig:
    fields = dict(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        num_target_layers=6,
        context_layer_ids=[1, 3],
        mask_token_id=3,
        num_hidden_layers=2,
        block_size=BLOCK,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return DrafterConfig(**fields, architecture="dflash")


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_config()).eval()
    embed = torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
    features = torch.randn(T, 2 * HIDDEN)
    input_ids = torch.randint(0, VOCAB, (T,))
    return drafter, embed, features, input_ids


def test_parameter_names_are_zlab_checkpoint_names(parts):
    drafter = parts[0]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        expected |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert set(drafter.state_dict()) == expected
    assert drafter.fc.weight.shape == (HIDDEN, 2 * HIDDEN)


def reference_block(drafter, embed, features, input_ids, anchor):
    """One block as inference runs it: the context is only positions < anchor, one
    block, no mask at all. Uses the drafter's own modules, none of its masking."""
    cfg = drafter.config
    context = drafter.hidden_norm(drafter.fc(features[:anchor]))[None]
    ids = torch.full((1, cfg.block_size), cfg.mask_token_id)
    ids[0, 0] = input_ids[anchor]
    x = embed(ids)
    positions = torch.cat([torch.arange(anchor), anchor + torch.arange(cfg.block_size)])
    cos, sin = drafter.rotary_emb(x, positions[None])
    for layer in drafter.layers:
        x = layer(x, context, cos, sin, None)
    return drafter.norm(x)[0]


def test_batched_blocks_equal_one_block_at_a_time(parts):
    drafter, embed, features, input_ids = parts
    anchors = torch.tensor([0, 5, 6, 17, 40])
    with torch.no_grad():
        out = drafter(features, input_ids, anchors, embed, attention="sdpa")
        assert out.shape == (5, BLOCK, HIDDEN)
        for j, anchor in enumerate(anchors.tolist()):
            torch.testing.assert_close(
                out[j], reference_block(drafter, embed, features, input_ids, anchor), rtol=0, atol=1e-5
            )


def test_no_leak_from_future_context_or_other_blocks(parts):
    drafter, embed, features, input_ids = parts
    anchors = torch.tensor([5, 12, 20])
    anchor = 12

    def block_j(feats, ids, anchs, attention="sdpa"):
        with torch.no_grad():
            return drafter(feats, ids, anchs, embed, attention=attention)[list(anchs).index(anchor)]

    base = block_j(features, input_ids, anchors)

    future = features.clone()
    future[anchor:] = torch.randn_like(future[anchor:]) * 5  # position == anchor included
    torch.testing.assert_close(block_j(future, input_ids, anchors), base, rtol=0, atol=1e-6)

    other_tokens = input_ids.clone()
    other_tokens[5] = (other_tokens[5] + 1) % VOCAB  # block 0's anchor token
    other_tokens[20] = (other_tokens[20] + 1) % VOCAB  # block 2's anchor token
    other_tokens[anchor + 1 :] = (other_tokens[anchor + 1 :] + 7) % VOCAB  # the answers
    torch.testing.assert_close(block_j(features, other_tokens, anchors), base, rtol=0, atol=1e-6)

    moved = torch.tensor([2, 12, 30, 35])  # other blocks moved and one added
    torch.testing.assert_close(block_j(features, input_ids, moved), base, rtol=0, atol=1e-6)

    past = features.clone()
    past[anchor - 1] += 1.0  # the last verified position is visible and must matter
    assert (block_j(past, input_ids, anchors) - base).abs().max() > 1e-3


def test_dense_mask_is_strictly_before_anchor_and_own_block():
    mask = dense_attention_mask(torch.tensor([0, 3]), context_len=5, block_size=2)
    expected = torch.zeros(4, 9, dtype=torch.bool)
    expected[0:2, 5:7] = True  # block 0 (anchor 0): no context, its own two tokens
    expected[2:4, 0:3] = True  # block 1 (anchor 3): context 0, 1, 2 only
    expected[2:4, 7:9] = True
    assert torch.equal(mask, expected)


LAYER_SETUPS = {
    "full": dict(),
    # window 12 cuts the context of every anchor past 12; causal inside the block
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=12),
    # window shorter than the block, and bidirectional within it (is_causal false)
    "noncausal_short": dict(layer_types=["sliding_attention"] * 2, sliding_window=5, is_causal=False),
}
EDGE_ANCHORS = torch.tensor([0, 1, 7, 20, 33, 39, T - BLOCK])  # 0: empty context; T - B: block ends at T


def output_and_grads(drafter, embed, features, input_ids, anchors, attention):
    drafter.zero_grad(set_to_none=True)
    out = drafter(features, input_ids, anchors, embed, attention=attention)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in drafter.named_parameters()}


@pytest.mark.parametrize("setup", list(LAYER_SETUPS))
@pytest.mark.parametrize("chunk_scores", [1 << 22, 3000])  # one chunk; a chunk per block or two
def test_split_attention_equals_dense_outputs_and_gradients(parts, setup, chunk_scores, monkeypatch):
    _, embed, features, input_ids = parts
    torch.manual_seed(2)
    drafter = DFlashDrafter(tiny_config(**LAYER_SETUPS[setup]))
    monkeypatch.setattr(attention_paths, "SPLIT_CHUNK_SCORES", chunk_scores)
    dense, dense_grads = output_and_grads(drafter, embed, features, input_ids, EDGE_ANCHORS, "sdpa")
    split, split_grads = output_and_grads(drafter, embed, features, input_ids, EDGE_ANCHORS, "split")
    torch.testing.assert_close(split, dense, rtol=0, atol=2e-6)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    masks = drafter.attention_masks(EDGE_ANCHORS, T, "split")
    assert len(masks) == len({drafter.config.layer_attention(i) for i in range(2)})
    if chunk_scores < 1 << 22:
        assert all(len(mask.chunks) > 1 for mask in masks.values())


@pytest.mark.parametrize(
    "rule", [LayerAttention(), LayerAttention(causal=True, window=12), LayerAttention(causal=False, window=5)], ids=str
)
def test_split_mask_is_the_dense_mask_without_the_other_blocks(rule, monkeypatch):
    """Every chunk's [context columns | own block] is the dense mask's, and the dense
    mask is False everywhere the split path does not look."""
    dense = dense_attention_mask(EDGE_ANCHORS, T, BLOCK, rule)
    rebuilt = torch.zeros_like(dense)
    monkeypatch.setattr(attention_paths, "SPLIT_CHUNK_SCORES", 1000)  # two blocks per chunk
    split = attention_paths.split_mask(EDGE_ANCHORS, T, BLOCK, rule, num_heads=1)
    assert len(split.chunks) > 1
    for chunk in split.chunks:
        visible = ~chunk.blocked
        for n, j in enumerate(range(chunk.start, chunk.stop)):
            rows = slice(j * BLOCK, (j + 1) * BLOCK)
            rebuilt[rows, chunk.key_start : chunk.key_stop] = visible[n, :, :-BLOCK]
            rebuilt[rows, T + j * BLOCK : T + (j + 1) * BLOCK] = visible[n, :, -BLOCK:]
    assert torch.equal(rebuilt, dense)
    if rule.window is not None:  # the window cuts context columns off the late chunks
        assert split.chunks[-1].key_start > 0


@pytest.mark.parametrize("setup", list(LAYER_SETUPS))
def test_flex_attention_equals_sdpa_on_cpu(parts, setup):
    _, embed, features, input_ids = parts
    torch.manual_seed(3)
    drafter = DFlashDrafter(tiny_config(**LAYER_SETUPS[setup])).eval()
    anchors = EDGE_ANCHORS
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without torch.compile warns on CPU
        sdpa = drafter(features, input_ids, anchors, embed, attention="sdpa")
        flex = drafter(features, input_ids, anchors, embed, attention="flex")
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)


def test_sliding_layers_see_only_the_window_and_earlier_slots(parts):
    """A causal sliding layer with window W: slot k ignores later slots of its block,
    and context further than W - 1 before the anchor changes nothing; one position
    inside the window does."""
    _, embed, features, input_ids = parts
    torch.manual_seed(4)
    drafter = DFlashDrafter(tiny_config(layer_types=["sliding_attention"] * 2, sliding_window=6)).eval()
    anchor = 30
    anchors = torch.tensor([anchor])
    with torch.no_grad():
        base = drafter(features, input_ids, anchors, embed)[0]
        far = features.clone()
        far[: anchor - 5] += 3.0  # slot 0 at `anchor` sees anchor-5..anchor-1 only
        assert torch.equal(drafter(features, input_ids, anchors, embed)[0], base)
        moved = drafter(far, input_ids, anchors, embed)[0]
        torch.testing.assert_close(moved[0], base[0], rtol=0, atol=1e-6)
        assert (moved[-1] - base[-1]).abs().max() == 0  # later slots see even less old context
        near = features.clone()
        near[anchor - 5] += 3.0
        assert (drafter(near, input_ids, anchors, embed)[0][0] - base[0]).abs().max() > 1e-4
        other_token = input_ids.clone()
        other_token[anchor] = (other_token[anchor] + 1) % VOCAB  # slot 0's token: every slot sees it
        assert (drafter(features, other_token, anchors, embed)[0] - base).abs().amax(-1).min() > 1e-4


def test_gradients_reach_every_drafter_parameter(parts):
    _, embed, features, input_ids = parts
    torch.manual_seed(1)
    drafter = DFlashDrafter(tiny_config())
    drafter(features, input_ids, torch.tensor([4, 20]), embed).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert embed.weight.grad is None


def test_config_refuses_the_final_target_layer():
    with pytest.raises(ValueError, match="final layer 5"):
        tiny_config(context_layer_ids=[1, 5])
    with pytest.raises(ValueError, match=r"\[6\] are outside 0..4"):
        tiny_config(context_layer_ids=[1, 6])
    with pytest.raises(ValueError, match=r"\[-1\] are outside 0..4"):
        tiny_config(context_layer_ids=[-1, 2])
    with pytest.raises(ValueError, match="increasing order"):  # the store's rule: fc order is the sorted order
        tiny_config(context_layer_ids=[3, 1])


def test_config_refuses_mask_token_outside_vocab():
    with pytest.raises(ValueError, match="mask_token_id 512"):
        tiny_config(mask_token_id=VOCAB)
    with pytest.raises(ValueError, match="mask_token_id -1"):
        tiny_config(mask_token_id=-1)
    tiny_config(mask_token_id=VOCAB - 1)


def test_default_context_layers_and_from_target(qwen3_dir):
    assert default_context_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_context_layer_ids(64, 1) == [32]
    target = read_target_config(qwen3_dir)
    config = DrafterConfig.from_target(
        target,
        mask_token_id=3,
        num_context_layers=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        architecture="dflash",
    )
    assert config.context_layer_ids == [1, 3] and target.num_hidden_layers - 1 not in config.context_layer_ids
    assert (config.hidden_size, config.head_dim, config.num_key_value_heads) == (64, 16, 2)
    with pytest.raises(ValueError, match="final layer"):
        DrafterConfig.from_target(
            target, mask_token_id=3, context_layer_ids=[2, target.num_hidden_layers - 1], architecture="dflash"
        )


def test_anchors_respect_loss_mask_and_block_end():
    loss_mask = torch.zeros(40, dtype=torch.long)
    loss_mask[10:25] = 1
    loss_mask[30:40] = 1
    candidates = anchor_candidates(loss_mask, BLOCK).tolist()
    assert candidates == list(range(10, 25)) + [30, 31, 32]  # 40 - 8 = 32 is the last start
    generator = torch.Generator().manual_seed(0)
    draws = [sample_anchors(loss_mask, BLOCK, num_anchors=6, generator=generator) for _ in range(5)]
    for anchors in draws:
        assert anchors.numel() == 6 and torch.equal(anchors, anchors.sort().values)
        assert len(set(anchors.tolist())) == 6 and set(anchors.tolist()) <= set(candidates)
    assert len({tuple(a.tolist()) for a in draws}) > 1  # redrawn every step
    again = torch.Generator().manual_seed(0)
    assert torch.equal(sample_anchors(loss_mask, BLOCK, 6, again), draws[0])  # reproducible
    assert sample_anchors(loss_mask, BLOCK, 512).tolist() == candidates  # fewer than asked: all
    assert sample_anchors(torch.zeros(40), BLOCK).numel() == 0
