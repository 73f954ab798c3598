"""The DFlash 2 drafter: the DFlash drafter (train/families/dflash/model.py) plus two small
modules, laid out and named as z-lab's reference (`dflash` 0.1.0's
`DFlash2DraftModel`) and vLLM's `qwen3_dflash2` lay them out:

    layers.{i}.attention_conv.{base_kernel, kernel_projection.weight}
    layers.{i}.mlp_conv.{base_kernel, kernel_projection.weight}
    candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}

- every decoder layer wraps its attention and its MLP in a block-local convolution
  (`train.families.dflash.conv.BlockConv`): `prepare` on the normed input, `finish` on the
  sublayer's output, inside the residual;
- the candidate selector (`train.families.dflash.selector.CandidateSelector`) reranks the
  top-K of each drafted position's logits along a path walked from the anchor.

Identity start: a fresh DFlash 2 has identity convolutions and a zero successor
codebook, so with its DFlash backbone's weights (the warm start,
`train.families.dflash.init_from`) it computes exactly that drafter's hidden states, logits
and greedy drafts.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config

from train.families.dflash.conv import BlockConv
from train.families.dflash.model import DFlashDecoderLayer, DFlashDrafter, DrafterConfig
from train.families.dflash.selector import CandidateSelector
from train.families.dflash.variants import DFLASH2


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DrafterConfig, qwen3_config: Qwen3Config, layer: int):
        super().__init__(config, qwen3_config, layer)
        self.attention_conv = BlockConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = BlockConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def sublayers(self, x, attention, block_size: int):
        normed, coefficients = self.attention_conv.prepare(self.input_layernorm(x), block_size)
        x = x + self.attention_conv.finish(attention(normed), coefficients, block_size)
        normed, coefficients = self.mlp_conv.prepare(self.post_attention_layernorm(x), block_size)
        return x + self.mlp_conv.finish(self.mlp(normed), coefficients, block_size)


class DFlash2Drafter(DFlashDrafter):
    """`state_dict()` keys are exactly the reference's DFlash 2 checkpoint names."""

    kind = DFLASH2
    layer_class = DFlash2DecoderLayer

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k, config.initializer_range
        )

    def reset_parameters(self):
        """Qwen's init for the backbone, then the identity start (module docstring)."""
        super().reset_parameters()
        for module in self.modules():
            if isinstance(module, (BlockConv, CandidateSelector)):
                module.reset_parameters()

    def greedy_tokens(self, hidden: torch.Tensor, anchor_id: int, lm_head: nn.Linear) -> torch.Tensor:
        """The selector's greedy walk from the anchor over the drafted slots' `hidden` [L, H]."""
        logits = lm_head(hidden.to(lm_head.weight.dtype))
        anchor = torch.tensor([anchor_id], device=hidden.device)
        return self.candidate_selector.walk(hidden[None], logits[None], anchor)[0]

    def sampled_tokens(self, hidden: torch.Tensor, anchor_id: int, lm_head: nn.Linear, sampling, generator):
        """The selector's walk at temperature (`CandidateSelector.sample_walk`; the
        reference applies neither top-p nor top-k there) -> (tokens [L], distributions
        [L, K], candidate ids [L, K])."""
        logits = lm_head(hidden.to(lm_head.weight.dtype))
        anchor = torch.tensor([anchor_id], device=hidden.device)
        path, ids, probs = self.candidate_selector.sample_walk(
            hidden[None], logits[None], anchor, sampling.temperature, generator
        )
        return path[0], probs[0], ids[0]

    @property
    def path_top_k(self) -> int:
        return self.candidate_selector.top_k

    def drafted_path(
        self, hidden: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor, anchor_ids: torch.Tensor
    ) -> torch.Tensor:
        """The selector's walk over the top candidates (DFlashDrafter.drafted_path)."""
        return self.candidate_selector.walk_candidates(hidden, top_values, top_ids, anchor_ids)
