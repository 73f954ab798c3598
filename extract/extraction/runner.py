"""The target-model runner: what one extraction worker holds for its lifetime.

    target = load_target("/models/Qwen3.6-27B", device="cuda")
    runner = TargetRunner(target, layer_ids=[1, 16, 31, 46, 61])
    for batch in batches_by_length([len(s) for s in samples], max_batch_tokens=32768):  # extract.jobs.batching
        outputs = runner.run_batch([samples[i] for i in batch])
        # outputs[j] = {layer_id: bf16 [len_j, H] on CPU, ...}

Layer id ``L`` is the output of decoder layer ``L`` (0-based), i.e. transformers'
``hidden_states[L + 1]``, before the final norm (see ``extract.extraction.layers``).

What it does, in order:

1. ``load_target`` loads the target's language model through the one loader both
   sides share (`store_schema.runtime.target_model`): a multimodal release
   (``Qwen3_5ForConditionalGeneration``: nested ``text_config``, weights under
   ``model.language_model.*``) becomes the text-only model, its vision tower never
   read; missing, mismatched or unexpected weights are refused, because a silently
   random-initialised weight would poison the whole store. Here it adds the kernel
   report and the ``--require-fast-kernels`` rule.
2. ``TargetRunner`` captures only the chosen layers with forward hooks on the
   decoder layers and stops the forward after the last needed layer by raising a
   private exception from that layer's hook (layers after it, the final norm and
   ``lm_head`` never run). With ``topk=K`` it runs the full forward instead and
   returns the target's top-K next-token ids and log-probs, computing the
   ``lm_head`` + ``log_softmax`` over the vocabulary a few rows at a time.
3. Batches are right-padded with an attention mask; only real positions are ever
   gathered, cast to bf16 and copied to the host. With right padding every real
   position precedes every pad in its row, so causal attention, the causal conv1d
   and the gated-delta-rule recurrence of hybrid linear-attention layers cannot
   see pads (transformers also zeroes padded inputs of linear-attention layers);
   ``tests/extract/test_target.py`` checks batched == one-at-a-time.
   On CUDA the device-to-host copy goes into pinned memory with
   ``non_blocking=True``: ``submit`` returns at once and the caller can compress
   and write the previous batch before calling ``result()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from store_schema.dtypes import BFLOAT16_STORE, QuantizedStates, StoreDtype
from store_schema.layout import validate_layer_ids
from store_schema.projection import project
from store_schema.runtime.target_model import decoder_layers

from ..jobs.target import Target

STORE_DTYPE = torch.bfloat16

# Rows of logits materialised at once when computing top-k (rows x vocab floats):
# 2**26 fp32 values = 256 MiB, e.g. 270 positions of a 248K vocabulary.
TOPK_LOGITS_BUDGET = 1 << 26


# --------------------------------------------------------------------------- running


class _StopForward(Exception):
    """Raised by the hook of the last needed layer: the rest of the forward is skipped."""


class PendingBatch:
    """Outputs of a submitted batch. On CUDA the host copies may still be in flight:
    `result()` waits for them. Never read the tensors before calling `result()`."""

    def __init__(self, outputs: list[dict], copied: torch.cuda.Event | None):
        self._outputs = outputs
        self._copied = copied

    def done(self) -> bool:
        return self._copied is None or self._copied.query()

    def result(self) -> list[dict]:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._outputs


class TargetRunner:
    """Turns batches of token sequences into the chosen layers' hidden states.

    Each output is a dict ``{layer_id: bf16 tensor [len, H] on CPU}`` for the sample's
    real positions only (for an fp8 or fp4 ``store_dtype``, ``dtypes.QuantizedStates``
    instead, quantized on the device); with ``topk=K`` it also holds ``"topk_ids"`` (int32 [len, K])
    and ``"topk_logprobs"`` (float32 [len, K]): the target's K most likely next tokens
    at each position and their log-probabilities (log_softmax over the full vocab).
    A sample's tensors are views into one host buffer per batch.
    """

    def __init__(
        self,
        target: Target,
        layer_ids: Sequence[int],
        topk: int | None = None,
        store_dtype: StoreDtype = BFLOAT16_STORE,
    ):
        self.target = target
        self.store_dtype = store_dtype
        self.quantize = store_dtype.scaled
        self.projection: dict | None = None  # a projected store's directions, set once the store holds them
        self.layer_ids = validate_layer_ids(layer_ids, target.num_layers)
        if topk is not None:
            if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= target.vocab_size:
                raise ValueError(f"topk must be an int in 1..{target.vocab_size}, got {topk!r}")
            _check_plain_lm_head(target.model)
        self.topk = topk
        self._layers = decoder_layers(target.model)
        self._decoder = target.model.get_decoder()
        self._lm_head = target.model.get_output_embeddings()
        if self.layer_ids[-1] >= len(self._layers) or (topk is not None and self._lm_head is None):
            raise ValueError(
                f"{target.architecture} was loaded with {len(self._layers)} decoder layers"
                f"{'' if self._lm_head is not None else ' and no lm_head'}; layers {self.layer_ids}"
                f"{f' with top-{topk}' if topk else ''} need the whole target (load_target without keep_layers)"
            )
        pad = getattr(target.model.config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) and 0 <= pad < target.vocab_size else 0

    def run_batch(self, sequences: Sequence[np.ndarray]) -> list[dict]:
        return self.submit(sequences).result()

    @torch.no_grad()
    def submit(self, sequences: Sequence[np.ndarray]) -> PendingBatch:
        lengths = self._check_sequences(sequences)
        device = self.target.device
        batch, width = len(lengths), max(lengths)

        # Right padding: sample b's tokens sit at [b, 0:len_b], pads after them.
        input_ids = torch.full((batch, width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for b, sequence in enumerate(sequences):
            input_ids[b, : lengths[b]] = torch.from_numpy(np.asarray(sequence, dtype=np.int64))
            attention_mask[b, : lengths[b]] = 1
        # Flat indices of the real positions in [batch * width]; gathering with them
        # (instead of a boolean mask) needs no device-to-host sync.
        real = torch.cat([b * width + torch.arange(n) for b, n in enumerate(lengths)])
        input_ids, attention_mask, real = (t.to(device, non_blocking=True) for t in (input_ids, attention_mask, real))

        captured = self._forward(input_ids, attention_mask, real)

        packed = {"hidden": torch.stack([self._kept(captured[L], L) for L in self.layer_ids])}  # [layers, tokens, H|K]
        if not self.quantize:  # a quantizer's NaN scales say the same (the writer refuses either)
            packed["nonfinite"] = ~torch.isfinite(packed["hidden"]).all(
                dim=-1
            )  # [layers, tokens], copied with the rest
        if self.quantize:
            codes, packed["scales"] = self.store_dtype.lossy.quantize(packed["hidden"])  # [layers, tokens, C]
            # Channel-major ([layers, H, tokens]): a transpose costs the device nothing, and the
            # store's `channels` codec codes each channel down the tokens (the writer's largest saving).
            packed["hidden"] = codes.transpose(1, 2).contiguous()
        if self.topk is not None:
            packed["topk_ids"], packed["topk_logprobs"] = self._topk(captured["final"])
        host, copied = _to_host(packed)

        outputs, start = [], 0
        for n in lengths:
            sample: dict[int | str, Any] = {L: self._states(host, j, start, n) for j, L in enumerate(self.layer_ids)}
            if "nonfinite" in host:
                sample["nonfinite"] = host["nonfinite"][:, start : start + n]  # [layers, n] bool
            if self.topk is not None:
                sample["topk_ids"] = host["topk_ids"][start : start + n]
                sample["topk_logprobs"] = host["topk_logprobs"][start : start + n]
            outputs.append(sample)
            start += n
        return PendingBatch(outputs, copied)

    def _kept(self, states, layer_id: int):
        """A layer's captured states as the store keeps them: whole, or a projected
        store's coordinates (`projection`: layer id -> directions [H, K] on the device)."""
        return states if self.projection is None else project(states, self.projection[layer_id])

    def _states(self, host: dict, layer_index: int, start: int, n: int):
        """One sample's states of one layer: bf16, or codes + scales (`quantize`)."""
        if not self.quantize:
            return host["hidden"][layer_index, start : start + n]
        codes = host["hidden"][layer_index, :, start : start + n].T  # [n, H], held channel-major
        scales = host["scales"][layer_index, start : start + n]
        return QuantizedStates(codes, scales, self.store_dtype.values_per_code)

    def _forward(self, input_ids, attention_mask, real) -> dict:
        """Run the decoder, keeping each chosen layer's output at the real positions
        (bf16 [tokens, H]) and, for top-k, the final-norm output (model dtype)."""
        captured: dict = {}
        last_needed = self.layer_ids[-1]
        stop_early = self.topk is None

        def keep(layer_id):
            def hook(module, args, output):
                hidden = output[0] if isinstance(output, tuple) else output
                captured[layer_id] = hidden.reshape(-1, hidden.shape[-1]).index_select(0, real).to(STORE_DTYPE)
                if stop_early and layer_id == last_needed:
                    raise _StopForward

            return hook

        handles = [self._layers[L].register_forward_hook(keep(L)) for L in self.layer_ids]
        try:
            output = self._decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            final = output.last_hidden_state  # after the final norm: what lm_head reads
            captured["final"] = final.reshape(-1, final.shape[-1]).index_select(0, real)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        missing = [L for L in self.layer_ids if L not in captured]
        if missing:
            raise RuntimeError(f"decoder layers {missing} did not run; cannot capture them")
        return captured

    def _topk(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K ids (int32) and log-probs (float32) per row of `final` [tokens, H],
        a few rows at a time so that [tokens, vocab] logits never exist at once."""
        rows = max(1, TOPK_LOGITS_BUDGET // self.target.vocab_size)
        ids, logprobs = [], []
        for chunk in final.split(rows):
            logits = self._lm_head(chunk).float()  # as the CausalLM computes them, then fp32
            values, indices = logits.topk(self.topk, dim=-1)
            logprobs.append(values - logits.logsumexp(dim=-1, keepdim=True))
            ids.append(indices.to(torch.int32))
        return torch.cat(ids), torch.cat(logprobs)

    def _check_sequences(self, sequences: Sequence[np.ndarray]) -> list[int]:
        if len(sequences) == 0:
            raise ValueError("empty batch")
        lengths = []
        for i, sequence in enumerate(sequences):
            array = np.asarray(sequence)
            if array.ndim != 1 or array.size == 0:
                raise ValueError(f"sequence {i} must be a non-empty 1-D array, got shape {array.shape}")
            if array.dtype.kind not in "iu":
                raise ValueError(f"sequence {i} has dtype {array.dtype}; token ids must be integers")
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= self.target.vocab_size:
                raise ValueError(
                    f"sequence {i} has token ids in [{low}, {high}], outside the target's "
                    f"vocabulary 0..{self.target.vocab_size - 1}"
                )
            lengths.append(int(array.size))
        return lengths


def _check_plain_lm_head(model: torch.nn.Module) -> None:
    """Top-k applies `lm_head` itself; refuse models whose logits are post-processed."""
    config = model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"topk is not supported for {type(model).__name__}: its logits use {name}")


def _to_host(tensors: dict) -> tuple[dict, torch.cuda.Event | None]:
    """Copy device tensors to the host: on CUDA into pinned memory without blocking
    (an event marks completion), on CPU they are already there."""
    first = next(iter(tensors.values()))
    if first.device.type != "cuda":
        return tensors, None
    host = {}
    for name, tensor in tensors.items():
        # torch's caching host allocator reuses pinned blocks, so this is cheap after warm-up
        host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host[name].copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
