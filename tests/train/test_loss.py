"""DFlash loss: labels and weights, chunked == unchunked (values and gradients),
metrics, noise that never reaches a reference, no training on input tokens."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from train.context_noise import add_context_noise
from train.families.dflash.config import LossConfig, ModelConfig
from train.families.dflash.loss import dflash_loss
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.families.dflash.step import StepSample, dflash_step
from train.families.dflash.targets import block_targets, default_gamma, slot_weights
from train.measures import block_metrics
from train.target_head import TargetHead

HIDDEN, VOCAB, BLOCK, T = 64, 512, 8, 64


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    config = DrafterConfig(
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
        architecture="dflash",
    )
    drafter = DFlashDrafter(config)
    head = TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.2)
    input_ids = torch.randint(0, VOCAB, (T,))
    loss_mask = torch.zeros(T, dtype=torch.long)
    loss_mask[12:40] = 1  # assistant turn
    loss_mask[46:60] = 1  # a second one; 40..45 and 60.. are prompt/template
    features = torch.randn(T, 2 * HIDDEN)
    return drafter, head, input_ids, loss_mask, features


def test_slot_weights_are_exp_decay_normalised():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    input_ids = torch.arange(40)
    targets = block_targets(input_ids, torch.ones(40), torch.tensor([3, 20]), 16, LossConfig(position_weights="decay"))
    raw = torch.tensor([0.0] + [math.exp(-(k - 1) / 7) for k in range(1, 16)])
    torch.testing.assert_close(targets.weights, (raw / (2 * raw.sum())).expand(2, 16), rtol=1e-6, atol=0)
    torch.testing.assert_close(slot_weights(16, 7.0), raw)
    assert targets.weights.sum().item() == pytest.approx(1.0)
    # slot k predicts the token at anchor + k, no shift; slot 0 never scored
    assert torch.equal(targets.labels[1], torch.arange(20, 36)) and not targets.valid[:, 0].any()


def test_loss_mask_and_sequence_end_zero_the_weight():
    input_ids = torch.arange(30)
    loss_mask = torch.ones(30, dtype=torch.long)
    loss_mask[8:10] = 0
    targets = block_targets(
        input_ids, loss_mask, torch.tensor([5, 25]), 8, LossConfig(gamma=4.0, position_weights="decay")
    )
    assert targets.weights[0, 3:5].eq(0).all() and not targets.valid[0, 3:5].any()  # positions 8, 9
    assert targets.weights[0, [1, 2, 5, 6, 7]].gt(0).all()
    assert targets.weights[1, 5:].eq(0).all() and targets.valid[1, 1:5].all()  # 30.. is past the end


def test_no_training_on_input_tokens(setup):
    drafter, head, input_ids, loss_mask, features = setup
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        output, anchors, targets = dflash_step(
            drafter,
            head,
            StepSample(input_ids, loss_mask, features),
            LossConfig(),
            ModelConfig(num_anchors=16),
            generator,
        )
        assert loss_mask[anchors].eq(1).all() and anchors.max() <= T - BLOCK
        positions = anchors[:, None] + torch.arange(BLOCK)
        scored = targets.weights > 0
        assert loss_mask[positions.clamp(max=T - 1)][scored].eq(1).all()
        assert targets.weights[loss_mask[positions.clamp(max=T - 1)] == 0].eq(0).all()
        assert (scored == targets.valid).all() and output.metrics["num_valid"] == scored.sum()


def reference_loss(hidden, weight, targets, kl_mix=0.0):
    """Unchunked: the full [N*B, V] logits, plain autograd."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight).float()
    logprobs = logits.log_softmax(-1)
    w = targets.weights.flatten()
    ce = -(logprobs.gather(1, targets.labels.flatten()[:, None]).squeeze(1) * w).sum()
    if kl_mix == 0:
        return ce
    p = targets.topk_logprobs.flatten(0, 1).exp()
    p = p / p.sum(1, keepdim=True)
    q = logprobs.gather(1, targets.topk_ids.flatten(0, 1))
    kl = ((p * (p.log() - q)).sum(1) * w).sum()
    return (1 - kl_mix) * ce + kl_mix * kl


@pytest.mark.parametrize("kl_mix", [0.0, 0.3])
def test_chunked_loss_and_grads_equal_unchunked(setup, kl_mix):
    drafter, head, input_ids, loss_mask, features = setup
    anchors = torch.tensor([12, 15, 20, 33, 47, 52])
    topk_logprobs, topk_ids = torch.randn(T, VOCAB).log_softmax(-1).topk(8, dim=-1)
    targets = block_targets(
        input_ids,
        loss_mask,
        anchors,
        BLOCK,
        LossConfig(position_weights="decay", kl_mix=kl_mix),
        topk_ids,
        topk_logprobs,
    )
    params = list(drafter.parameters())

    drafter.zero_grad()
    hidden = drafter(features, input_ids, anchors, head.embed_tokens)
    chunked = dflash_loss(hidden, head.lm_head.weight, targets, chunk_rows=5, kl_mix=kl_mix)
    chunked.loss.backward()
    grads = [p.grad.clone() for p in params]

    drafter.zero_grad()
    hidden = drafter(features, input_ids, anchors, head.embed_tokens)
    full = reference_loss(hidden, head.lm_head.weight, targets, kl_mix)
    full.backward()

    torch.testing.assert_close(chunked.loss, full, rtol=0, atol=1e-5)
    for name_param, grad in zip(drafter.named_parameters(), grads):
        torch.testing.assert_close(grad, name_param[1].grad, rtol=1e-4, atol=1e-6, msg=name_param[0])
    assert head.lm_head.weight.grad is None
    if kl_mix == 0:
        assert chunked.kl == 0 and chunked.ce.item() == pytest.approx(full.item(), abs=1e-5)


def test_metrics_from_known_predictions():
    # 3 blocks of B=5. Slots 1..4: correct pattern, validity.
    top1 = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    metrics = block_metrics(top1, top1, top1 | valid, valid)
    # streaks: block 0 -> 2 (slot 3 wrong), block 1 -> 2 (slot 3 invalid), block 2 -> 0
    assert metrics["tau"].item() == pytest.approx((3 + 3 + 1) / 3)
    assert metrics["top1"].item() == pytest.approx(9 / 11) and metrics["top8"].item() == 1.0
    torch.testing.assert_close(metrics["per_position_acc"], torch.tensor([2 / 3, 1.0, 1 / 2, 1.0]))


def test_metrics_in_loss_match_direct_computation(setup):
    drafter, head, input_ids, loss_mask, features = setup
    anchors = torch.tensor([12, 20, 30, 48])
    targets = block_targets(input_ids, loss_mask, anchors, BLOCK, LossConfig(position_weights="decay"))
    with torch.no_grad():
        hidden = drafter(features, input_ids, anchors, head.embed_tokens)
        out = dflash_loss(hidden, head.lm_head.weight, targets, chunk_rows=7)
        logits = head.lm_head(hidden)
    top8 = logits.topk(8, dim=-1).indices
    hit = top8 == targets.labels[..., None]
    expected = block_metrics(hit[..., 0], hit[..., :4].any(-1), hit.any(-1), targets.valid)
    for key in ("top1", "top4", "top8", "tau", "num_valid", "num_blocks"):
        assert out.metrics[key].item() == pytest.approx(expected[key].item()), key


def test_noise_reaches_only_the_drafter_input(setup):
    drafter, head, input_ids, loss_mask, features = setup
    topk_logprobs, topk_ids = torch.randn(T, VOCAB).log_softmax(-1).topk(4, dim=-1)
    kept = features.clone()
    runs = {}
    for scale in (0.0, 0.5):
        generator = torch.Generator().manual_seed(7)
        loss = LossConfig(noise=scale, labels="target", kl_mix=0.5, position_weights="decay")
        with torch.no_grad():
            runs[scale] = dflash_step(
                drafter,
                head,
                StepSample(input_ids, loss_mask, features, topk_ids, topk_logprobs),
                loss,
                ModelConfig(num_anchors=8),
                generator,
            )
    (clean, anchors0, ref0), (noisy, anchors1, ref1) = runs[0.0], runs[0.5]
    assert torch.equal(anchors0, anchors1)
    # labels="target": slot k's label is the target's top-1 for position anchor + k (row anchor + k - 1).
    assert torch.equal(ref0.labels[:, 1:], topk_ids[anchors0[:, None] + torch.arange(BLOCK - 1), 0])
    for field in ("labels", "valid", "weights", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(ref0, field), getattr(ref1, field)), field
    assert clean.metrics["num_valid"] == noisy.metrics["num_valid"]
    assert not torch.isclose(clean.loss, noisy.loss)  # the noise did reach the drafter
    assert torch.equal(features, kept)  # the caller's features are untouched
    noised = add_context_noise(features, 0.5, torch.Generator().manual_seed(0))
    assert noised is not features and (noised - features).abs().max() <= 0.5 + 1e-6
    assert add_context_noise(features, 0.0) is features


def test_target_labels_use_the_prediction_for_that_position():
    input_ids = torch.arange(20)
    target_next = torch.arange(20) + 100  # row p predicts token p + 1: the stored top-1
    targets = block_targets(
        input_ids,
        torch.ones(20),
        torch.tensor([4]),
        4,
        LossConfig(gamma=3.0, labels="target", position_weights="decay"),
        target_next[:, None],
    )
    assert targets.labels[0, 1:].tolist() == [104, 105, 106]  # slot k <- row anchor + k - 1
