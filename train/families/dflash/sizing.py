"""What a DFlash drafter costs to train, for `fit --dry-run` (`train.fitting.estimate`
sums it with what every family costs: weights, optimizer, the frozen head, the loss chunk).

- activations kept for backward, per sequence in flight (`train.batch_size`): each
  block token (anchors x B queries) in each drafter layer keeps, in the autocast
  dtype, the MLP's input, gate, act(gate), up and product (H + 4 I) and the
  attention's input, q, k, v, their normed/rotated copies and output
  (H + 4 q + 4 kv), plus the two RMSNorms' fp32 inputs (2 x 4 H); each context token
  keeps its fc input (layers x H) and, per layer, its normed K/V input and K, V
  (H + 2 kv). Flex attention (the CUDA path) keeps no queries x keys matrix.
  DFlash 2 adds, per block token and layer, its two convolutions' inputs: per
  module and side (before and after the sublayer) k tap rows of H and k x H/g
  coefficients. Its selector loss adds K x r per scored row, not V (negligible).
- FLOPs of one sample (`sample_flops`)."""

from __future__ import annotations

from store_schema.runtime.estimate import gib
from train.families.dflash.selector import CODEBOOKS

FP32 = 4


def parameter_groups(drafter) -> dict:
    """Parameters by part: the DFlash backbone, and DFlash 2's additions (the per-layer
    `attention_conv` / `mlp_conv`, the selector's two V x r codebooks and its
    projection), so the 27B job shows what DFlash 2 costs; all zero but the backbone
    for DFlash. Each part trains with the same fp32 AdamW (dense codebook moments:
    train.families.dflash.selector_loss says why)."""
    groups = dict(backbone=0, convolutions=0, selector_codebooks=0, selector_projection=0)
    for name, parameter in drafter.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "attention_conv." in name or "mlp_conv." in name:
            part = "convolutions"
        elif "candidate_selector." in name:
            part = "selector_codebooks" if leaf in CODEBOOKS else "selector_projection"
        else:
            part = "backbone"
        groups[part] += parameter.numel()
    return groups


def activation_bytes(model, drafter_config, act: int, sequence_tokens: int) -> dict:
    """Bytes one sequence keeps for backward (`act`: the autocast dtype's bytes): block
    tokens and context tokens."""
    d = drafter_config
    q, kv, h = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim, d.hidden_size
    per_block_token = act * ((h + 4 * d.intermediate_size) + (h + 4 * q + 4 * kv)) + 2 * FP32 * h
    if d.kind.has_block_conv:  # two convolutions, each: per side its k taps' rows and coefficients
        per_block_token += 2 * act * 2 * d.conv_kernel_size * (h + h // d.conv_group_size)
    per_context_token = act * (len(d.context_layer_ids) * h + d.num_hidden_layers * (h + 2 * kv))
    block_tokens = model.num_anchors * drafter_config.block_size
    return dict(
        per_block_token_layer=per_block_token,
        per_context_token=per_context_token,
        block_tokens=block_tokens,
        context_tokens=sequence_tokens,
        bytes=block_tokens * d.num_hidden_layers * per_block_token + sequence_tokens * per_context_token,
    )


def sample_flops(model, drafter_config, sequence_tokens: float) -> dict:
    """Training FLOPs of one sample of `sequence_tokens` with `model.num_anchors` blocks
    (matmuls, 2 per multiply-add): the drafter's forward x 3 (backward: input and weight
    gradients) and the frozen head's x 2 (input gradient only). Attention keys per block:
    the context before its anchor (anchors spread over the sequence: T / 2 on average,
    at most the window of a sliding layer) and its own block."""
    d, block = drafter_config, drafter_config.block_size
    h, q, kv = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    block_tokens, scored_rows = model.num_anchors * block, model.num_anchors * (block - 1)
    per_layer = 2 * (2 * h * q + 2 * h * kv + 3 * h * d.intermediate_size)  # q, o, k, v projections and the MLP
    if d.kind.has_block_conv:  # two convolutions' coefficient projections
        per_layer += 2 * 2 * (2 * d.conv_kernel_size * (h // d.conv_group_size)) * h
    keys = [
        min(d.sliding_window, sequence_tokens / 2) if kind == "sliding_attention" else sequence_tokens / 2
        for kind in d.layer_types
    ]
    attention = sum(2 * 2 * q * (k + block) for k in keys)  # QK^T and AV, per block token
    context = sequence_tokens * (2 * len(d.context_layer_ids) * h * h + d.num_hidden_layers * 2 * 2 * h * kv)
    selector = scored_rows * 2 * h * d.selector_rank if d.kind.has_selector else 0
    drafter = block_tokens * (d.num_hidden_layers * per_layer + attention) + context + selector
    head = 2 * scored_rows * 2 * h * d.vocab_size
    return dict(drafter_forward=drafter, head_forward=head // 2, total=3 * drafter + head)


def activation_text(a: dict, drafter_layers: int) -> str:
    """How the activations are made up, for the dry run's line."""
    return (
        f"{a['block_tokens']} block tokens x {drafter_layers} layers x {a['per_block_token_layer']} B + "
        f"{a['context_tokens']} context tokens x {a['per_context_token']} B"
    )


def figures(drafter) -> dict:
    """What the dry run reports of the drafter itself."""
    d = drafter.config
    return dict(
        parameter_groups=parameter_groups(drafter),
        architecture=d.architecture,
        drafter_layers=d.num_hidden_layers,
        context_layer_ids=list(d.context_layer_ids),
        mask_token_id=d.mask_token_id,
        block_size=d.block_size,
        layer_types=list(d.layer_types),
        is_causal=d.is_causal,
    )


def lines(e: dict) -> list[str]:
    """The dry run's lines about the drafter."""
    return [
        f"drafter     {e['drafter_parameters']:,} parameters, {e['drafter_layers']} layers, context layers "
        f"{e['context_layer_ids']}, mask token {e['mask_token_id']}",
        *dflash2_lines(e),
    ]


def dflash2_lines(e: dict) -> list[str]:
    """DFlash 2's additions and their fp32 weights + gradients + AdamW moments (16 B a
    parameter); nothing for DFlash."""
    g = e["parameter_groups"]
    added = g["convolutions"] + g["selector_codebooks"] + g["selector_projection"]
    if not added:
        return []
    return [
        f"DFlash 2    backbone {g['backbone']:,} + convolutions {g['convolutions']:,} + selector codebooks "
        f"{g['selector_codebooks']:,} (2 x V x r) + selector projection {g['selector_projection']:,}; the "
        f"additions' weights, gradients and AdamW: {gib(added * 4 * FP32)} GiB (fp32)"
    ]
