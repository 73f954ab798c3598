"""What every drafter family provides (torchtitan's `ModelSpec`): the trainer, loader,
evaluation, export and dry run call a family only through this interface, and find
it by the architecture a config names (`train.families.kinds`).

A family is a folder (`train/families/dflash/`: DFlash and DFlash 2) whose
`__init__.py` exposes one `DrafterFamily`. Its config is the drafter config its
`build` takes (every one names its `architecture` and its `context_layer_ids`, the
store's layers it reads, in order); the run's `model` / `loss` sections reach it
unchanged."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from train.measures import ddtree_acceptance, rollout


@dataclass(frozen=True)
class StepSample:
    """One sequence as a training step reads it: tokens, mask and features on the
    step's device, the top-k anywhere (the trainer makes one of a loader's `TrainSample`)."""

    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T]
    context_features: torch.Tensor  # [T, n_ctx*H], clean, from the store
    topk_ids: torch.Tensor | None = None  # [T, K]: the store's target top-k (row p predicts token p + 1)
    topk_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class StepResult:
    """One sequence's training step, as the trainer and its metrics read it.

    loss: the sequence's own normalised loss, to backpropagate.
    weight: its label weight (0-dim): how much it counts when a step is normalised
        over all weighted labels (`loss.normalize="step"`).
    metrics: detached figures: `num_valid` scored labels, `num_blocks` drafted
        chains, `top1` / `top4` / `top8` accuracies, `tau` (mean accepted length of
        the chains), `per_position_acc` [P], and optionally `recall_at_k` /
        `selector_acc` (DFlash 2).
    position_valid: [P] scored labels per drafted position (the per-position means' weights)."""

    loss: torch.Tensor
    weight: torch.Tensor
    metrics: dict
    position_valid: torch.Tensor


@dataclass
class DraftedBlocks:
    """One sample's blocks at `positions` [N] (sorted), on the CPU: the reference
    and validity of slots 1..B-1 [N, D], the drafter's top-K there [N, D, K], and
    the chain acceptance of each block [N] along the path the drafter decodes
    (`accepted`: the selector's walk for DFlash 2) and along the unary argmax chain
    (`unary_accepted`: each slot's top-1; equal to `accepted` for DFlash)."""

    positions: torch.Tensor
    reference: torch.Tensor
    valid: torch.Tensor
    logprobs: torch.Tensor
    ids: torch.Tensor
    accepted: torch.Tensor
    unary_accepted: torch.Tensor

    def chain_rounds(self, unary: bool = False) -> list[int]:
        """Rollout round lengths along the path the drafter decodes (what `speculate`
        drafts), or (`unary`) along the unary argmax chain."""
        values = self.unary_accepted if unary else self.accepted
        accepted = dict(zip(self.positions.tolist(), values.tolist()))
        return rollout(list(accepted), accepted.__getitem__)

    def ddtree_rounds(self, budgets: Sequence[int]) -> dict[int, list[int]]:
        """{budget: round lengths} of DDTree rollouts; a block's tree is grown once
        (for every budget) the first time a walk visits it."""
        row_of = {p: i for i, p in enumerate(self.positions.tolist())}
        grown: dict[int, dict[int, int]] = {}

        def accepted_at(budget: int):
            def at(position: int) -> int:
                if position not in grown:
                    i = slice(row_of[position], row_of[position] + 1)
                    trees = ddtree_acceptance(self.logprobs[i], self.ids[i], self.reference[i], self.valid[i], budgets)
                    grown[position] = {b: int(trees[b][0]) - 1 for b in budgets}
                return grown[position][budget]

            return at

        anchors = list(row_of)
        return {b: rollout(anchors, accepted_at(b)) for b in budgets}


class DrafterFamily(ABC):
    """One family of drafters: its variants (the `model.architecture` names it builds)
    and every operation the product runs on one of them. `config` below is the
    family's drafter config (`build`'s argument, a drafter's `.config`)."""

    name: str  # as messages name the family
    variants: tuple[str, ...]  # the architectures it builds

    @abstractmethod
    def build(self, config) -> nn.Module:
        """A fresh drafter of the variant `config.architecture` names."""

    # -- training ---------------------------------------------------------------------------
    @abstractmethod
    def drafted_positions(self, config) -> int:
        """How many positions one drafted chain scores (per-position metrics' length);
        a decoding round commits at most this plus one tokens."""

    @abstractmethod
    def trainable_positions(self, loss_mask: torch.Tensor, config) -> torch.Tensor:
        """The positions [N] a training step may draft from in a sequence of this loss
        mask (DFlash: its anchors); none: the sequence has nothing to train on."""

    def sample_filter(self, config) -> Callable[[torch.Tensor], bool]:
        """Whether a loss mask has a trainable position: what the loader keeps."""
        return partial(_has_positions, self, config)

    @abstractmethod
    def pad_length(self, config) -> int:
        """The length of a zero-weight pad sequence (a rank whose lane ran dry) that
        `train_step` accepts: the shape of work, no data."""

    @abstractmethod
    def train_step(
        self, drafter, head, sample: StepSample, loss, model, generator: torch.Generator | None, step: int
    ) -> StepResult:
        """The loss of one sequence. `drafter` may be a DDP replica (its `.module` the
        bare drafter); `head`: the target's frozen embedding and LM head; `loss` /
        `model`: the run's sections; `generator`: the lane's (drawn positions, noise);
        `step`: the optimizer step (0-based)."""

    # -- offline acceptance -----------------------------------------------------------------
    @abstractmethod
    def draft_blocks(
        self, drafter, head, sample, features: torch.Tensor, positions: torch.Tensor, config, k: int, attention: str
    ) -> DraftedBlocks:
        """What `drafter` drafts at each round start `positions` [N] of `sample` (its
        context `features` [T, n_ctx*H] on the drafter's device), scored against the
        sample's reference (`config`: the `eval` section; `k`: top-k kept per position)."""

    @abstractmethod
    def decode_path(self, config) -> str:
        """The path a greedy decode drafts, as reports name it ("argmax chain", ...)."""


def _has_positions(family: DrafterFamily, config, loss_mask: torch.Tensor) -> bool:
    return family.trainable_positions(loss_mask, config).numel() > 0
