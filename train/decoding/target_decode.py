"""The target at decode time: loaded whole (`store_schema.runtime.target_model`), run over a growing
cache, its cache rolled back after a partly rejected block.

Rolling back differs by layer kind:

- Attention layers hold keys/values per position: they are cropped to the
  rejected positions.
- Linear-attention layers (Qwen3.5's Gated DeltaNet) hold a recurrent state and a
  short-convolution window that have absorbed every token of the block. Two ways
  back, both exact (`ROLLBACKS`):
  - "native" (transformers >= 5.25): asked to keep the states after each of the last
    `rollback_tokens` tokens (`activate_past_recording(recurrent_states_to_keep=...)`),
    its `crop` puts back the state after the last accepted token, without another
    forward, at the price of recording every verified token's states;
  - "rerun" (any version): `save()` copies each linear-attention layer's states
    (convolution window, recurrent state, length) before a verification, and `keep()`
    of a partly accepted block crops the attention layers back to the block's start,
    puts the copies back and re-runs the accepted tokens through the target: one more
    forward (counted in `reruns`). A fully accepted block keeps the state as it is.
  "auto" is native where transformers has it. gpu_check's speculate phase times both
  on a GPU (the choice is a measurement: recording costs memory traffic every round, a
  rerun costs a forward on a partly accepted one). A target without linear-attention
  layers is only cropped.

z-lab's `dflash_generate` crops and nothing else, so on a hybrid target before
5.25 its recurrent states keep the rejected tokens and its output drifts from the
target's greedy output (tests/train/test_speculate.py shows it); on 5.25 it fails.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from store_schema.runtime.target_model import decoder_layers
from train.decoding.config import ROLLBACKS

# transformers >= 5.25: a linear-attention layer keeps its last tokens' recurrent states on
# request, and `crop` restores them (see the module docstring).
NATIVE_RECURRENT_ROLLBACK = (
    "recurrent_states_to_keep" in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
)


def resolve_rollback(rollback: str) -> str:
    """ "auto" as "native" where transformers keeps recurrent states, else "rerun"; "native"
    refused where it cannot."""
    if rollback not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {', '.join(ROLLBACKS)}, got {rollback!r}")
    if rollback == "auto":
        return "native" if NATIVE_RECURRENT_ROLLBACK else "rerun"
    if rollback == "native" and not NATIVE_RECURRENT_ROLLBACK:
        raise ValueError("rollback native needs transformers >= 5.25 (recurrent_states_to_keep); use rerun")
    return rollback


# End-of-turn tokens of common chat templates; a target stops at any of them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")


def stop_token_ids(model, tokenizer=None) -> list[int]:
    """EOS ids of the generation config and model config, the tokenizer's EOS and
    any end-of-turn token (END_OF_TURN_TOKENS) the tokenizer has."""
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        found.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            found.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        found.update(vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
    return sorted(found)


def clock(device: torch.device) -> float:
    """Wall time, after the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def plain_attention_cache(cache) -> bool:
    """Whether every layer of a cache keeps plain per-position keys/values (not
    recurrent, not a sliding window)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def tree_maskable(model) -> bool:
    """Whether `model`'s cache layout (its config's, no forward run) is `plain_attention_cache`."""
    return plain_attention_cache(DynamicCache(config=model.config))


class TargetSession:
    """One sequence through the target: positions [0, length) are in the cache.

    rollback_tokens=0 gives a plain cache (what greedy decoding uses); n > 0 records
    what `keep` needs to undo up to the last n tokens of a verification (the drafter's
    block size; see the module docstring)."""

    def __init__(self, model, context_layer_ids: Sequence[int] = (), rollback_tokens: int = 0, rollback: str = "auto"):
        self.model = model
        self.context_layer_ids = list(context_layer_ids)
        self.cache = DynamicCache(config=model.config)
        self.rollback = resolve_rollback(rollback)
        linear = [layer for layer in self.cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.recurrent = []  # the layers `save()` copies ("rerun")
        if rollback_tokens and linear and self.rollback == "native":
            self.cache.activate_past_recording(recurrent_states_to_keep=rollback_tokens)
        elif rollback_tokens:
            self.recurrent = linear
        self.length = 0
        self.forwards = 0
        self.reruns = 0
        self.tokens = 0  # tokens run through the target, the prompt's included
        self._saved: list[tuple[dict, dict, torch.Tensor]] | None = None  # per layer: conv, recurrent, length

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, features: bool = False, last_only: bool = False):
        """Run `ids` [n] at positions length .. length+n-1. Returns logits [n, V]
        (or [1, V] with last_only) and, with `features`, the context layers' outputs
        [n, n_ctx*H] (`captured`) or None."""
        count = ids.shape[0]
        positions = torch.arange(self.length, self.length + count, device=ids.device)[None]
        with self.captured(features) as layers:
            out = self.model(
                input_ids=ids[None],
                position_ids=positions,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
        self.length += count
        self.forwards += 1
        self.tokens += count
        return out.logits[0], self.features(layers) if features else None

    @contextmanager
    def captured(self, wanted: bool = True):
        """The context layers' outputs of the forward inside the block, by forward hooks on
        those layers alone, as extraction captures them (layer id L = decoder layer L's
        output): `output_hidden_states` would keep every layer's states of the whole
        prompt (~21 GB for a 64-layer target at a 32K-token prompt)."""
        layers: dict[int, torch.Tensor] = {}
        if not wanted:
            yield layers
            return

        def keep(layer_id):
            def hook(module, args, output):
                layers[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        decoder = decoder_layers(self.model)
        handles = [decoder[layer].register_forward_hook(keep(layer)) for layer in self.context_layer_ids]
        try:
            yield layers
        finally:
            for handle in handles:
                handle.remove()

    def features(self, layers: dict) -> torch.Tensor:
        """[n, n_ctx*H]: the captured layers, concatenated in `context_layer_ids` order."""
        return torch.cat([layers[layer][0] for layer in self.context_layer_ids], dim=-1)

    def tree_maskable(self) -> bool:
        """Whether this session's cache is `plain_attention_cache`: a forward can take a
        tree mask and `keep_nodes` can pick positions."""
        return plain_attention_cache(self.cache)

    @torch.no_grad()
    def forward_tree(self, ids: torch.Tensor, depths: list[int], visible: torch.Tensor):
        """Run the tree `ids` [n] (node 0 the anchor) in one forward: node i at position
        length + depths[i], attending to the cached prefix and to the nodes `visible[i]`.
        Returns logits [n, V] and the context layers' features [n, n_ctx*H]."""
        device, dtype = self.device, self.model.get_output_embeddings().weight.dtype
        blocked = torch.zeros(ids.shape[0], self.length + ids.shape[0], dtype=dtype)
        blocked[:, self.length :].masked_fill_(~visible, torch.finfo(dtype).min)
        positions = torch.tensor(depths, device=device) + self.length
        with self.captured() as layers:
            out = self.model(
                input_ids=ids.to(device)[None],
                position_ids=positions[None],
                attention_mask=blocked.to(device)[None, None],
                past_key_values=self.cache,
                use_cache=True,
            )
        self.length += ids.shape[0]
        self.forwards += 1
        self.tokens += ids.shape[0]
        return out.logits[0], self.features(layers)

    def keep_nodes(self, start: int, nodes: list[int]) -> None:
        """After `forward_tree` at `start`, keep the prefix and the tree nodes `nodes`, in order."""
        if not self.tree_maskable():
            raise RuntimeError("keep_nodes picks positions of a plain attention cache only (`tree_maskable`)")
        index = torch.cat([torch.arange(start), torch.tensor(nodes) + start]).to(self.device)
        for layer in cast(list[DynamicLayer], self.cache.layers):  # every layer one, as tree_maskable says
            assert layer.keys is not None and layer.values is not None  # forward_tree filled every layer
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self.length = start + len(nodes)

    def save(self) -> None:
        """Copy the linear-attention layers' states (before a verification; nothing to
        copy where transformers keeps them, "native")."""
        self._saved = [
            (
                {i: state.clone() for i, state in layer.conv_states.items() if state is not None},
                {i: state.clone() for i, state in layer.recurrent_states.items() if state is not None},
                getattr(layer, "cumulative_length_linear", torch.zeros(())).clone(),  # transformers >= 5.25
            )
            for layer in self.recurrent
        ]

    def keep(self, start: int, tokens: torch.Tensor, count: int) -> None:
        """After verifying `tokens` at positions start.. (with `save()` before it),
        keep only the first `count` of them in the cache."""
        if not self.recurrent:
            self._crop_to(start + count)
            return
        if count == tokens.shape[0]:
            return  # every token kept: the states are the ones to go on from
        if self._saved is None:
            raise RuntimeError("keep() of a partly accepted block needs save() before the verification")
        self._crop_to(start)
        for layer, (conv, recurrent, length) in zip(self.recurrent, self._saved):
            layer.conv_states.update(conv)
            layer.recurrent_states.update(recurrent)
            layer.cumulative_length_linear = length
        self._saved = None
        self.forward(tokens[:count])
        self.reruns += 1

    def _crop_to(self, length: int) -> None:
        """Drop the positions from `length` on: every layer's where transformers rolls the
        linear ones back itself, else the attention layers' (`keep` puts the others back)."""
        removed = self.length - length
        if not self.recurrent:
            self.cache.crop(-removed)  # crop(0) too: a recording layer trims its states back then
        elif removed:
            for layer in self.cache.layers:
                if isinstance(layer, DynamicLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin):
                    layer.crop(-removed)  # an attention layer's keys and values
        self.length = length
