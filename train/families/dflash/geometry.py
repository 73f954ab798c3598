"""The one rule for a valid drafter shape (the kinds themselves: train.families.dflash.variants).

Both the run config's `model` section (sizes a user sets, None where the drafter's
default applies) and `DrafterConfig` (every size known) check a shape; they call
`shape_problems` so the rule is written once and only the wording of the error
differs (`config model.X: ...` against `X ...`)."""

from __future__ import annotations

from collections.abc import Callable

from train.families.dflash.variants import DFLASH, DFLASH2_SIZES, KINDS

LAYER_TYPES = ("full_attention", "sliding_attention")  # the drafter layer kinds (train/families/dflash/model.py)
ATTENTION_KINDS = ("auto", "split", "sdpa", "flex")  # training attention paths (train/families/dflash/attention.py)
POSITIVE_SIZES = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "sliding_window",
)
BLOCK_SIZE = 16  # B: anchor + B-1 drafted tokens (z-lab's published DFlash drafters)


def shape_problems(shape: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(field, what is wrong) for each rule `shape` breaks, fields named `prefix` + name.
    A size that is None (absent) is not checked; `hidden_size` and `vocab_size`, when
    given, bound the DFlash 2 sizes."""

    def name(field: str) -> str:
        return f"{prefix}{field}"

    problems = []
    kind = KINDS.get(shape.get("architecture", DFLASH.name))
    kind_sizes = kind.sizes if kind else ()
    for field in (*POSITIVE_SIZES, *DFLASH2_SIZES):
        value = shape.get(field)
        if value is not None and value < 1:
            problems.append((name(field), f"must be >= 1, got {value}"))
    heads, kv_heads = shape.get("num_attention_heads"), shape.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        rule = f"must divide {name('num_attention_heads')} ({heads})"
        problems.append((name("num_key_value_heads"), rule if prefix else f"{kv_heads} {rule}"))
    problems += _layer_type_problems(shape, name)
    if shape.get("block_size") is not None and shape["block_size"] < 2:
        problems.append((name("block_size"), f"must be >= 2 (slot 0 is the anchor), got {shape['block_size']}"))
    if kind is None:
        problems.append((name("architecture"), f"must be one of {', '.join(KINDS)}, got {shape['architecture']!r}"))
    hidden, group = shape.get("hidden_size"), shape.get("conv_group_size")
    if "conv_group_size" in kind_sizes and hidden and group and group >= 1 and hidden % group:
        problems.append((name("conv_group_size"), f"{group} must divide hidden_size {hidden}"))
    vocab, top_k = shape.get("vocab_size"), shape.get("selector_top_k")
    if "selector_top_k" in kind_sizes and vocab and top_k and top_k > vocab:
        problems.append((name("selector_top_k"), f"{top_k} exceeds the vocabulary ({vocab})"))
    return problems


def _layer_type_problems(shape: dict, name: Callable[[str], str]) -> list[tuple[str, str]]:
    layer_types, layers = shape.get("layer_types"), shape.get("num_hidden_layers")
    if layer_types is None:
        return []
    if not layer_types:
        return [(name("layer_types"), "must name at least one layer")]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        return [(name("layer_types"), f"entries must be {' or '.join(LAYER_TYPES)}, got {unknown}")]
    if layers is not None and len(layer_types) != layers:
        return [(name("layer_types"), f"has {len(layer_types)} entries, {name('num_hidden_layers')} is {layers}")]
    return []
