"""What every drafter family provides (torchtitan's `ModelSpec`): the trainer, loader,
evaluation, export and dry run call a family only through this interface, and find
it by the architecture a config names (`train.families.kinds`).

A family is a folder (`train/families/dflash/`: DFlash and DFlash 2;
`train/families/eagle3/`: EAGLE-3) holding one `DrafterFamily` subclass, which the
registry instantiates. Its config is the drafter config its `build` takes (every one
names its `architecture` and its `context_layer_ids`, the store's layers it reads, in
order); the run's `model` / `loss` sections (`train.families.config`, composed from
each family's own) reach it unchanged."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from store_schema import file_sha256
from store_schema.layout import validate_layer_ids
from train.config_error import ConfigError
from train.data.order import has_loss_tokens
from train.measures import ddtree_acceptance, rollout
from train.sampling import Draft, Sampling

WEIGHTS = "model.safetensors"  # a drafter directory's (export or checkpoint) weights


class FamilyConfig(Protocol):
    """What every family's drafter config says: its architecture and the store's
    layers it reads, in order; `to_dict` is what checkpoints and exports record."""

    architecture: str
    context_layer_ids: list[int]

    def to_dict(self) -> dict: ...


class Drafter(nn.Module):
    """What the trainer, evaluation and export hold of any family's drafter: a module
    and its config (each family's drafter names its own config class)."""

    config: FamilyConfig
    gradient_checkpointing: bool  # recompute each layer in backward (model.gradient_checkpointing)


@dataclass(frozen=True)
class StepSample:
    """One sequence as a training step reads it: tokens and features on the step's
    device, the loss mask and the top-k anywhere (the trainer makes one of a loader's
    `TrainSample` and leaves the mask on the host, where positions are drawn from it
    without a read-back; a family moves what it indexes with)."""

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


@dataclass(frozen=True)
class StartSource:
    """The drafter a fine-tuning run starts from (`model.init_from`), as read once:
    the directory whose weights it loads and that drafter's config."""

    path: Path
    config: FamilyConfig

    def record(self) -> dict:
        """Where the run started: the directory and its weights' sha256 (checkpoints keep it)."""
        path = self.path.resolve()
        return {"path": str(path), "model_sha256": file_sha256(path / WEIGHTS)}


@dataclass(frozen=True)
class DrafterPlan:
    """The drafter a run trains and how the run started (checkpoints keep `run_info`)."""

    config: FamilyConfig
    run_info: dict
    source: StartSource | None  # the `model.init_from` drafter a new run loads; None otherwise


def chosen_layers(
    wanted: list[int] | None, store_layer_ids: list[int] | None, num_target_layers: int
) -> list[int] | None:
    """`model.target_layer_ids`, checked: the layer-id rule, and every one in the store
    (ConfigError naming the missing ones and how to extract them; `store_layer_ids`
    None: no store, as on paper); None when unset."""
    if wanted is None:
        return None
    try:
        ids = validate_layer_ids(list(wanted), num_target_layers)
    except ValueError as error:
        raise ConfigError(f"config model.target_layer_ids: {error}") from None
    missing = [layer for layer in ids if store_layer_ids is not None and layer not in store_layer_ids]
    if missing:
        raise ConfigError(
            f"config model.target_layer_ids: {ids} needs layers {missing} the store does not hold (it "
            f"holds {store_layer_ids}); extract a store for several drafters with `python -m extract run "
            "... --layers-from DIR,DIR` (their union)"
        )
    return ids


@dataclass(frozen=True)
class Served:
    """How an engine serves a drafter (`serve-check`, vLLM's `speculative_config`)."""

    title: str  # as messages name the drafter's variant ("DFlash 2")
    exported_class: str  # its export's config.json `architectures`
    method: str  # vLLM's speculative method ("dflash")
    round_tokens: int  # the most tokens a round commits: num_speculative_tokens + 1
    mixed_layers: bool  # sliding and full attention layers both (vLLM's CPU build sizes them apart)
    cpu_serves: bool  # vLLM's CPU build serves it (DFlash 2's selector walk is a Triton kernel)


class DraftSession(ABC):
    """The drafter's side of speculative decoding (`speculate`): the target's features
    of verified positions in, one round's draft out. `round_tokens`: the most tokens a
    round verifies (the anchor and the drafted ones)."""

    round_tokens: int

    @abstractmethod
    def extend(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """The next n verified positions: the target's context features there [n, F]
        and the tokens at them [n]."""

    @abstractmethod
    def draft(self, anchor_id: int, size: int, sampling: Sampling, generator) -> Draft:
        """`size - 1` tokens drafted after the anchor (the token at the next position):
        greedy along the path the drafter decodes, or drawn at `sampling`'s settings with
        the distributions they came from."""

    @abstractmethod
    def position_logits(self, anchor_id: int, size: int) -> torch.Tensor:
        """[size - 1, V] logits at each drafted position (DDTree grows its tree from them)."""


class DrafterFamily(ABC):
    """One family of drafters: its variants (the `model.architecture` names it builds)
    and every operation the product runs on one of them. `config` below is the
    family's drafter config (`build`'s argument, a drafter's `.config`)."""

    name: str  # as messages name the family
    variants: tuple[str, ...]  # the architectures it builds

    exported_classes: tuple[str, ...]  # config.json `architectures` of its exports

    @abstractmethod
    def build(self, config) -> Drafter:
        """A fresh drafter of the variant `config.architecture` names."""

    @abstractmethod
    def config_from_dict(self, data: dict):
        """A drafter config from its `to_dict()` (what checkpoints record)."""

    # -- planning a run ---------------------------------------------------------------------
    @abstractmethod
    def plan(
        self, model, target_path: str, target, store_layer_ids: list[int] | None, resumed, source, log
    ) -> DrafterPlan:
        """The drafter a run trains: sized for `target` (its `TargetConfig`; `target_path`
        its directory) from the run's `model` section and the store's layers, or
        fine-tuned from `source` (a `StartSource`); `resumed`: (the checkpoint's
        drafter config, its path) when a run continues, else None: the plan must
        equal it. ConfigError naming the field when something does not fit."""

    @abstractmethod
    def load_start(self, drafter, source: StartSource) -> None:
        """The `model.init_from` weights into a new run's drafter."""

    @abstractmethod
    def start_fresh(self, drafter, store, heldout_fraction: float, log) -> None:
        """What a new run (not fine-tuned, not resumed) takes from the store before
        step 1 (EAGLE-3: its draft vocabulary, from the training split's replies)."""

    @abstractmethod
    def check_store(self, config, loss, store, log) -> None:
        """Refuse (ConfigError naming the field) a planned drafter the store's samples
        or the run's `loss` section cannot train; say what the loss will be where the
        store decides it."""

    @abstractmethod
    def resolved_model(self, model, config):
        """The run's `model` section with what planning fixed (DFlash: the mask token
        id), as the run saves and resumes it."""

    # -- training ---------------------------------------------------------------------------
    @abstractmethod
    def drafted_positions(self, config) -> int:
        """How many positions one drafted chain scores (per-position metrics' length);
        a decoding round commits at most this plus one tokens."""

    @abstractmethod
    def trainable_positions(self, loss_mask: torch.Tensor, config) -> torch.Tensor:
        """The positions [N] a training step may draft from in a sequence of this loss
        mask (DFlash: its anchors); none: the sequence has nothing to train on."""

    def round_tokens(self, config) -> int:
        """The most tokens a decoding round commits: the drafted positions and the target's
        bonus token (`Served.round_tokens`, `DraftSession.round_tokens`)."""
        return self.drafted_positions(config) + 1

    @abstractmethod
    def sample_filter(self, config) -> Callable[[torch.Tensor], bool]:
        """Whether a loss mask has a trainable position: what the loader keeps."""

    def planned_filter(self, config) -> Callable[[int, int], bool]:
        """Whether a planned sample of (tokens, loss tokens) passes `sample_filter`, from
        the plan's counts alone: how many samples an epoch holds before any shard is
        read (the LR schedule's length). True only where the filter is (a crop to a
        shorter `data.max_length` aside): a sample it misses trains uncounted."""
        return has_loss_tokens

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

    # -- decoding ---------------------------------------------------------------------------
    @abstractmethod
    def draft_session(self, drafter, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> DraftSession:
        """A fresh decoding session of `drafter` with the target's embedding and LM head."""

    @abstractmethod
    def served(self, config) -> Served:
        """How vLLM serves a drafter of `config`."""

    # -- the dry run (`fit --dry-run`) -------------------------------------------------------
    @abstractmethod
    def activation_bytes(self, config, model, act_bytes: int, sequence_tokens: int) -> dict:
        """What one sequence of `sequence_tokens` keeps for backward (`act_bytes`: the
        autocast dtype's size): a dict whose `bytes` is the total."""

    @abstractmethod
    def activation_text(self, figures: dict) -> str:
        """How `activation_bytes`' total (`figures["activations"]`) is made up, in words
        for the dry run's line."""

    @abstractmethod
    def sample_flops(self, config, model, sequence_tokens: float) -> dict:
        """Training FLOPs of one sample: `drafter_forward`, `head_forward`, `total`
        (forward and backward, the frozen head's input gradient included)."""

    @abstractmethod
    def paper_figures(self, drafter) -> dict:
        """What the dry run reports of the drafter (its JSON keys)."""

    @abstractmethod
    def paper_lines(self, figures: dict) -> list[str]:
        """The dry run's lines about the drafter, from the whole figures dict."""

    # -- export -----------------------------------------------------------------------------
    def context_map(self, drafter) -> nn.Linear:
        """The bias-free map that reads the stored layers first (their concatenation, in
        `context_layer_ids` order): where a projected store's projection folds at export.
        Every family so far names it `fc`."""
        return drafter.fc

    @abstractmethod
    def export(self, drafter, out_dir: Path, dtype: torch.dtype, extra_config: dict) -> Path:
        """`config.json` and `model.safetensors` as the engines load them, into `out_dir`."""

    @abstractmethod
    def claims_export(self, data: dict) -> bool:
        """Whether a drafter directory whose config.json holds `data` is this family's."""

    @abstractmethod
    def read_export_config(self, model_dir: Path):
        """The drafter config of an export's (or a published drafter's) config.json."""

    @abstractmethod
    def load(self, model_dir: Path, dtype: torch.dtype | None, device) -> nn.Module:
        """Rebuild the drafter of an export directory (dtype None: as stored)."""
