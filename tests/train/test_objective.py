"""The objective as a choice: D-PACE position weights against a hand computation,
decay unchanged byte for byte, and DFlash 2's selector loss (hand computation on
V = 8, K = 3, the outside-top-K rule, gradcheck, chunked == dense, chunk size)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from train.config_error import ConfigError
from train.config_loading import load_config
from train.families.dflash.config import LossConfig, ModelConfig
from train.families.dflash.loss import dflash_loss, dpace_weights
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.families.dflash.selector_loss import selector_loss, selector_weight_at
from train.families.dflash.step import dflash_step
from train.families.dflash.targets import block_targets
from train.families.family import StepResult, StepSample
from train.measures import block_metrics
from train.target_head import TargetHead


class PairSelector(nn.Module):
    """The reference CandidateSelector's bilinear term <A[prev] * (W h), B[cand]>."""

    def __init__(self, vocab: int, hidden: int, rank: int, dtype=torch.float32):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(vocab, rank, dtype=dtype)
        self.successor_codebook = nn.Embedding(vocab, rank, dtype=dtype)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False, dtype=dtype)

    def pair_scores(self, hidden, predecessor_ids, candidate_ids):
        context = self.predecessor_codebook(predecessor_ids) * self.hidden_projection(hidden)
        return torch.einsum("nr,nkr->nk", context, self.successor_codebook(candidate_ids))


def test_dpace_weights_by_hand():
    # q on slots 1..3; block 1 has slot 2 invalid (a no-op in the products, weight 0)
    confidence = torch.tensor([[0.0, 0.5, 0.2, 0.8], [0.0, 0.5, 0.2, 0.8]])
    valid = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)
    # s = 0.5 q + 0.5 -> 0.75, 0.6, 0.9; prefixes 0.75, 0.45, 0.405; suffix sums of the prefixes
    expected = torch.tensor([[0.0, 1.605, 0.855, 0.405], [0.0, 1.425, 0.0, 0.675]])
    torch.testing.assert_close(dpace_weights(confidence, valid, 0.5), expected, rtol=0, atol=1e-6)
    # alpha = 1: every prefix is 1, so w_k counts the valid slots from k on
    torch.testing.assert_close(dpace_weights(confidence, valid, 1.0), torch.tensor([[0.0, 3, 2, 1], [0, 2, 0, 1]]))


def log_probs_rows(probabilities: list[list[float]]) -> torch.Tensor:
    """Hidden rows whose logits through an identity head are log p: softmax gives p back."""
    return torch.tensor(probabilities).log()


def test_dpace_loss_by_hand():
    # one block at anchor 0, B = 4, V = 4: labels are tokens 2, 3, 0 on slots 1..3
    input_ids = torch.tensor([1, 2, 3, 0, 1])
    targets = block_targets(
        input_ids, torch.ones(5), torch.tensor([0]), 4, LossConfig(position_weights="dpace", dpace_alpha=0.5)
    )
    assert targets.weight_sum.item() == 3 and targets.position_weights == "dpace"
    hidden = log_probs_rows([[0.25] * 4, [0.1, 0.1, 0.5, 0.3], [0.3, 0.2, 0.3, 0.2], [0.8, 0.1, 0.05, 0.05]])
    hidden = hidden[None].requires_grad_()
    out = dflash_loss(hidden, torch.eye(4), targets, chunk_rows=2)
    # q = 0.5, 0.2, 0.8 -> weights 1.605, 0.855, 0.405 (test above), over 3 valid labels
    expected = (1.605 * -math.log(0.5) + 0.855 * -math.log(0.2) + 0.405 * -math.log(0.8)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    out.loss.backward()
    # weights are constants: slot 1's gradient is 1.605 / 3 x (softmax - onehot)
    slot1 = torch.tensor([0.1, 0.1, 0.5 - 1.0, 0.3]) * 1.605 / 3
    torch.testing.assert_close(hidden.grad[0, 1], slot1, rtol=1e-5, atol=1e-6)
    assert hidden.grad[0, 0].eq(0).all()


def pre_change_decay_loss(hidden, weight, targets, chunk_rows):
    """The decay objective's arithmetic as it was before position weights became a
    choice (same ops, same order): the byte-for-byte reference."""
    scored = targets.valid.flatten().nonzero().flatten()
    rows = hidden.detach().reshape(-1, hidden.shape[-1])[scored]
    labels, w_all = targets.labels.flatten()[scored], targets.weights.flatten()[scored].float()
    ce_sum = rows.new_zeros((), dtype=torch.float32)
    grad = torch.zeros_like(rows)
    for start in range(0, rows.shape[0], chunk_rows):
        end = min(start + chunk_rows, rows.shape[0])
        logprobs = torch.log_softmax(F.linear(rows[start:end], weight).float(), dim=-1)
        label, w = labels[start:end, None], w_all[start:end]
        ce_sum += -(logprobs.gather(1, label).squeeze(1) * w).sum()
        grad_logits = logprobs.exp()
        grad_logits.scatter_add_(1, label, torch.full_like(label, -1.0, dtype=grad_logits.dtype))
        grad_logits *= w[:, None]
        grad[start:end] = (grad_logits.to(weight.dtype) @ weight).to(rows.dtype)
    full = torch.zeros_like(hidden).reshape(-1, hidden.shape[-1])
    full[scored] = grad
    return (1.0 - 0.0) * ce_sum + 0.0 * rows.new_zeros((), dtype=torch.float32), full.view_as(hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decay_is_unchanged_byte_for_byte(dtype):
    torch.manual_seed(3)
    input_ids, mask = torch.randint(0, 50, (40,)), torch.ones(40)
    mask[9:12] = 0
    targets = block_targets(input_ids, mask, torch.tensor([0, 6, 20, 31]), 8, LossConfig(position_weights="decay"))
    assert targets.position_weights == "decay"
    weight = torch.randn(50, 16).to(dtype)
    hidden = torch.randn(4, 8, 16).to(dtype).requires_grad_()
    out = dflash_loss(hidden, weight, targets, chunk_rows=3)
    out.loss.backward()
    loss, grad = pre_change_decay_loss(hidden, weight, targets, chunk_rows=3)
    assert torch.equal(out.loss.detach(), loss) and torch.equal(hidden.grad, grad)


def test_the_defaults_are_dflash2_with_dpace():
    """The defaults follow drafter_bench's measurement; the soft-KL recipe is told to set decay."""
    config = load_config(None, [], require_paths=False)
    assert (config.model.architecture, config.loss.position_weights) == ("dflash2", "dpace")
    with pytest.raises(ConfigError, match="set loss.position_weights=decay"):
        load_config(None, ["loss.kl_mix=0.3"], require_paths=False)
    assert load_config(None, ["loss.kl_mix=0.3", "loss.position_weights=decay"], require_paths=False).loss.kl_mix == 0.3


def test_config_keys():
    config = LossConfig()
    # D-PACE is the default: drafter_bench measured it ahead of decay for both drafters.
    assert (config.position_weights, config.dpace_alpha, config.selector_weight, config.selector_warmup_steps) == (
        "dpace",
        0.5,
        1.0,
        0,
    )
    for bad in (
        LossConfig(position_weights="linear"),
        LossConfig(dpace_alpha=1.5),
        LossConfig(selector_weight=-1),
        LossConfig(selector_warmup_steps=-1),
        LossConfig(position_weights="dpace", kl_mix=0.2),
    ):
        with pytest.raises(ConfigError, match="config loss."):
            bad.validate()
    LossConfig(position_weights="dpace").validate()


def test_selector_weight_ramp():
    assert [selector_weight_at(s, 2.0, 4) for s in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    assert selector_weight_at(0, 1.0, 0) == 1.0


def hand_selector() -> PairSelector:
    """V = H = 8, r = 2, with W h = (h[5], h[2]), A[4] = (1, 2), B[1] = (1, 0), B[3] = (0, 1), B[2] = (1, 1)."""
    selector = PairSelector(8, 8, 2)
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.zero_()
        selector.hidden_projection.weight[0, 5] = 1.0
        selector.hidden_projection.weight[1, 2] = 1.0
        selector.predecessor_codebook.weight[4] = torch.tensor([1.0, 2.0])
        selector.successor_codebook.weight[1] = torch.tensor([1.0, 0.0])
        selector.successor_codebook.weight[3] = torch.tensor([0.0, 1.0])
        selector.successor_codebook.weight[2] = torch.tensor([1.0, 1.0])
    return selector


def test_selector_loss_by_hand_and_outside_top_k():
    selector = hand_selector()
    # row 0: logits h; top-3 = ids 1 (3), 3 (2), 2 (1); W h = (0.5, 1), A[4] * W h = (0.5, 2)
    # pair scores 0.5, 2, 2.5 -> scores 3.5, 4, 3.5; label 3 -> CE = log(1 + 2 e^-0.5)
    # row 1: same logits, label 7 is outside the top-3 -> skipped
    row = torch.tensor([0.0, 3, 1, 2, -1, 0.5, -2, 0])
    hidden = torch.stack([row, row])
    unary, candidates = hidden.topk(3, dim=-1)
    out = selector_loss(
        selector, hidden, unary, candidates, torch.tensor([3, 7]), torch.tensor([4, 4]), torch.tensor([0.25, 0.75])
    )
    assert out.loss.item() == pytest.approx(0.25 * math.log(1 + 2 * math.exp(-0.5)), rel=1e-6)
    assert out.in_topk.tolist() == [True, False] and out.hit.tolist() == [True, False]
    # without the selector term the unary argmax (id 1) would miss label 3: the pair term is what picks it


def test_metrics_recall_and_selector_accuracy():
    valid = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    in_topk = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    hit = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    none = torch.zeros_like(valid)
    metrics = block_metrics(none, none, none, valid, in_topk=in_topk, selector_hit=hit)
    assert metrics["recall_at_k"].item() == pytest.approx(4 / 5) and metrics["selector_acc"].item() == pytest.approx(
        2 / 5
    )
    assert "recall_at_k" not in block_metrics(none, none, none, valid)


def tiny_problem(dtype, position_weights="decay", seed=0):
    torch.manual_seed(seed)
    vocab, size, block = 8, 4, 4
    input_ids = torch.randint(0, vocab, (14,))
    mask = torch.ones(14)
    mask[6] = 0
    targets = block_targets(
        input_ids, mask, torch.tensor([0, 3, 9]), block, LossConfig(gamma=3.0, position_weights=position_weights)
    )
    hidden = torch.randn(3, block, size, dtype=dtype)
    head = torch.randn(vocab, size, dtype=dtype)
    selector = PairSelector(vocab, size, 3, dtype=dtype)
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.normal_()
    return targets, hidden, head, selector


def dense_loss(hidden, head, targets, selector, top_k, selector_weight):
    """Full [rows, V] logits and plain autograd: the reference for the chunked walk."""
    scored = targets.valid.flatten().nonzero().flatten()
    rows = hidden.reshape(-1, hidden.shape[-1])[scored]
    labels = targets.labels.flatten()[scored]
    logits = F.linear(rows, head)
    ce = -logits.log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    weights = targets.weights.flatten()[scored]
    if targets.position_weights == "dpace":
        confidence = torch.zeros(targets.valid.numel(), dtype=ce.dtype)
        confidence[scored] = torch.exp(-ce.detach())
        dynamic = dpace_weights(confidence.view_as(targets.valid), targets.valid, targets.dpace_alpha)
        weights = weights * dynamic.flatten()[scored]
    weights = weights.to(logits.dtype)
    unary, candidates = logits.topk(top_k, dim=-1)
    picked = selector_loss(selector, rows, unary, candidates, labels, targets.predecessors.flatten()[scored], weights)
    return (ce * weights).sum() + selector_weight * picked.loss


def test_selector_gradcheck_float64():
    targets, hidden, head, selector = tiny_problem(torch.float64)
    params = list(selector.parameters())

    def chunked(h, *selector_params):
        for parameter, value in zip(params, selector_params):
            parameter.data = value
        return dflash_loss(
            h, head, targets, chunk_rows=2, selector=selector, selector_top_k=3, selector_weight=0.7
        ).loss

    def dense(h, *selector_params):
        for parameter, value in zip(params, selector_params):
            parameter.data = value
        return dense_loss(h, head, targets, selector, 3, 0.7)

    inputs = (hidden.clone().requires_grad_(), *[p.detach().clone().requires_grad_() for p in params])
    for parameter in params:
        parameter.requires_grad_(False)
    # selector params enter through .data, so they are checked via explicit grads below; gradcheck covers hidden
    assert torch.autograd.gradcheck(lambda h: chunked(h, *inputs[1:]), (inputs[0],), eps=1e-6, atol=1e-6)
    for parameter in params:
        parameter.requires_grad_(True)
    grads = {}
    for name, fn in (("chunked", chunked), ("dense", dense)):
        selector.zero_grad()
        h = hidden.clone().requires_grad_()
        loss = fn(h, *[p.detach() for p in inputs[1:]])
        loss.backward()
        grads[name] = (loss.detach(), h.grad, [p.grad.clone() for p in params])
    torch.testing.assert_close(grads["chunked"][0], grads["dense"][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads["chunked"][1], grads["dense"][1], rtol=1e-10, atol=1e-12)
    for chunked_grad, dense_grad in zip(grads["chunked"][2], grads["dense"][2]):
        torch.testing.assert_close(chunked_grad, dense_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("position_weights", ["decay", "dpace"])
def test_chunked_equals_dense_and_chunk_size_does_not_matter(position_weights):
    targets, hidden, head, selector = tiny_problem(torch.float64, position_weights, seed=1)
    results = []
    for chunk_rows in (1, 3, 100, "dense"):
        selector.zero_grad()
        h = hidden.clone().requires_grad_()
        if chunk_rows == "dense":
            loss = dense_loss(h, head, targets, selector, 3, 1.0)
        else:
            out = dflash_loss(h, head, targets, chunk_rows=chunk_rows, selector=selector, selector_top_k=3)
            loss = out.loss
            assert set(out.metrics) >= {"recall_at_k", "selector_acc"} and out.selector is not None
        loss.backward()
        results.append((loss.detach(), h.grad, [p.grad.clone() for p in selector.parameters()]))
    first = results[0]
    for other in results[1:]:
        torch.testing.assert_close(other[0], first[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(other[1], first[1], rtol=1e-10, atol=1e-12)
        for a, b in zip(other[2], first[2]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert first[1].abs().sum() > 0 and all(g.abs().sum() > 0 for g in first[2])


def test_selector_metrics_match_direct_computation():
    targets, hidden, head, selector = tiny_problem(torch.float32, seed=2)
    with torch.no_grad():
        out = dflash_loss(hidden, head, targets, chunk_rows=4, selector=selector, selector_top_k=3)
        logits = F.linear(hidden, head)
        unary, candidates = logits.topk(3, dim=-1)
        flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
        scores = flat(unary) + selector.pair_scores(flat(hidden), targets.predecessors.flatten(), flat(candidates))
        chosen = flat(candidates).gather(1, scores.argmax(1, keepdim=True)).squeeze(1).view_as(targets.labels)
    valid = targets.valid
    in_topk = (candidates == targets.labels[..., None]).any(-1)
    assert out.metrics["recall_at_k"].item() == pytest.approx(((in_topk & valid).sum() / valid.sum()).item())
    assert out.metrics["selector_acc"].item() == pytest.approx(
        (((chosen == targets.labels) & valid).sum() / valid.sum()).item()
    )


def test_predecessors_are_teacher_forced():
    input_ids = torch.arange(10, 30)
    targets = block_targets(
        input_ids, torch.ones(20), torch.tensor([2, 9]), 4, LossConfig(gamma=3.0, position_weights="decay")
    )
    # slot 1: the anchor token; slot k >= 2: the true previous token
    assert targets.predecessors.tolist() == [[12, 12, 13, 14], [19, 19, 20, 21]]


def test_dflash_step_applies_the_configured_position_weights():
    torch.manual_seed(0)
    config = DrafterConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=64,
        num_target_layers=4,
        context_layer_ids=[1],
        mask_token_id=3,
        num_hidden_layers=1,
        block_size=8,
        rope_theta=10000.0,
        architecture="dflash",
    )
    drafter, head = DFlashDrafter(config), TargetHead(torch.randn(64, 32), torch.randn(64, 32))
    input_ids, loss_mask, features = torch.randint(0, 64, (40,)), torch.ones(40, dtype=torch.long), torch.randn(40, 32)
    runs = {}
    for rule in ("decay", "dpace"):
        generator = torch.Generator().manual_seed(1)
        output, _, targets = dflash_step(
            drafter,
            head,
            StepSample(input_ids, loss_mask, features),
            LossConfig(position_weights=rule),
            ModelConfig(num_anchors=4),
            generator,
        )
        runs[rule] = (output.loss.item(), targets)
    assert runs["dpace"][1].position_weights == "dpace" and runs["decay"][1].position_weights == "decay"
    assert runs["dpace"][1].weight_sum == runs["dpace"][1].valid.sum()  # normalised by the scored labels
    assert runs["dpace"][0] != pytest.approx(runs["decay"][0])


def test_dflash_step_trains_the_dflash2_selector_and_logs_its_metrics():
    """Bug (issue 32.4): the training step never handed DFlash 2's selector to the loss,
    so `fit` trained a DFlash 2 whose selector stayed at its identity start and logged
    no recall@K / selector accuracy. Now the step adds the selector's CE (ramped by
    loss.selector_warmup_steps) and the run's log means carry both metrics."""
    from train.families.dflash.build import build_drafter
    from train.fitting.metrics import MetricSums

    torch.manual_seed(0)
    config = DrafterConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=64,
        num_target_layers=4,
        context_layer_ids=[1],
        mask_token_id=3,
        num_hidden_layers=1,
        block_size=8,
        rope_theta=10000.0,
        architecture="dflash2",
        selector_rank=8,
        selector_top_k=4,
    )
    drafter, head = build_drafter(config), TargetHead(torch.randn(64, 32), torch.randn(64, 32))
    input_ids, loss_mask, features = torch.randint(0, 64, (40,)), torch.ones(40, dtype=torch.long), torch.randn(40, 32)
    losses = {}
    for step, warmup in ((0, 0), (0, 4)):
        drafter.zero_grad()
        loss = LossConfig(selector_weight=2.0, selector_warmup_steps=warmup)
        output, _, targets = dflash_step(
            drafter,
            head,
            StepSample(input_ids, loss_mask, features),
            loss,
            ModelConfig(num_anchors=4),
            torch.Generator().manual_seed(1),
            step=step,
        )
        output.loss.backward()
        losses[warmup] = (
            output.loss.item(),
            output.ce.item() if torch.is_tensor(output.ce) else output.ce,
            output.selector.item(),
        )
        assert drafter.candidate_selector.successor_codebook.grad.abs().sum() > 0  # the selector learns
    full, ramped = losses[0], losses[4]
    assert full[0] - ramped[0] == pytest.approx((2.0 - 2.0 / 4) * full[2], rel=1e-5)  # weight 2 vs 2 x 1/4
    sums = MetricSums(config.block_size - 1)
    sums.add(StepResult(output.loss, targets.weight_sum, output.metrics, targets.valid[:, 1:].sum(0)), 40)
    means = sums.means("heldout_")
    assert means["heldout_recall_at_k"] == pytest.approx(output.metrics["recall_at_k"].item())
    assert means["heldout_selector_acc"] == pytest.approx(output.metrics["selector_acc"].item())
    assert "recall_at_k" not in MetricSums(config.block_size - 1).means()  # DFlash logs neither
    merged = MetricSums.from_vector(config.block_size - 1, sums.as_vector())  # summed over ranks in one all_reduce
    assert merged.means()["selector_acc"] == pytest.approx(sums.means()["selector_acc"])
