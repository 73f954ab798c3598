"""What an EAGLE-3 drafter costs to train, for `fit --dry-run` (`train.fitting.estimate`
adds what every family costs).

- activations kept for backward, per sequence: each of the `ttt_steps` steps runs
  the one layer over every position: per position its 2H-wide attention input, q, k,
  v and their rotated copies, the attention output, the MLP's input, gate, act(gate),
  up and product (2H + 2 q + 4 kv + q + H + 4 I) in the autocast dtype, three
  RMSNorms' fp32 inputs (3 x 4 H) and the draft-vocabulary logits, log-probs and
  gradient in fp32 (3 x 4 d); and the attention's fp32 scores and weights over the
  positions before it (heads x T x T x 8: training-time test runs eager attention).
- FLOPs of one sample (`sample_flops`): forward x 3 (backward: input and weight
  gradients); the frozen embedding costs none."""

from __future__ import annotations

FP32 = 4


def per_position_bytes(config, act: int) -> int:
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    layer = act * (2 * h + 3 * q + 4 * kv + h + 4 * config.intermediate_size)
    return layer + 3 * FP32 * h + 3 * FP32 * config.draft_vocab_size


def activation_bytes(config, model, act: int, sequence_tokens: int) -> dict:
    steps = config.ttt_steps
    per_position = per_position_bytes(config, act)
    scores = config.num_attention_heads * sequence_tokens * sequence_tokens * 2 * FP32
    return dict(
        steps=steps,
        positions=sequence_tokens,
        per_position_step=per_position,
        scores_per_step=scores,
        bytes=steps * (sequence_tokens * per_position + scores),
    )


def activation_text(a: dict) -> str:
    return (
        f"{a['steps']} steps x ({a['positions']} positions x {a['per_position_step']} B + "
        f"attention scores {a['scores_per_step']} B)"
    )


def sample_flops(config, model, sequence_tokens: float) -> dict:
    """Matmuls, 2 per multiply-add: `fc` once, then per step and position the layer's
    projections and MLP, attention over the positions before it (T / 2 on average)
    and the draft-vocabulary head."""
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    layer = 2 * (2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * config.intermediate_size)
    attention = 2 * 2 * q * (sequence_tokens / 2)
    head = 2 * h * config.draft_vocab_size
    fc = 2 * config.num_context_layers * h * h
    drafter = sequence_tokens * (fc + config.ttt_steps * (layer + attention + head))
    return dict(drafter_forward=drafter, head_forward=0, total=3 * drafter)


def figures(drafter) -> dict:
    c = drafter.config
    return dict(
        architecture=c.architecture,
        drafter_layers=1,
        context_layer_ids=list(c.context_layer_ids),
        draft_vocab_size=c.draft_vocab_size,
        ttt_steps=c.ttt_steps,
    )


def lines(e: dict) -> list[str]:
    return [
        f"drafter     {e['drafter_parameters']:,} parameters, EAGLE-3 (1 layer), aux layers {e['context_layer_ids']}, "
        f"draft vocabulary {e['draft_vocab_size']:,}, training-time test {e['ttt_steps']} steps"
    ]
