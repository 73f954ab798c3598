"""Context layer ids: the default spread, refusals, and the convention against real model code."""

from __future__ import annotations

import json

import pytest
import torch

from extract.extraction.layers import parse_layer_ids, resolve_layer_ids
from store_schema.layout import default_layer_ids, validate_layer_ids
from store_schema.runtime.target_config import read_target_config


@pytest.mark.parametrize(
    "num_layers, n, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B, as published
        (64, 5, [1, 16, 31, 46, 61]),  # Qwen3.6-27B
        (36, 1, [18]),
        (64, 1, [32]),
        (11, 3, [1, 4, 8]),  # 1 + 3.5 = 4.5 rounds half to even, like the reference code
        (28, 2, [1, 25]),
    ],
)
def test_default_spread(num_layers, n, expected):
    assert default_layer_ids(num_layers, n) == expected


@pytest.mark.parametrize("num_layers", [8, 12, 36, 48, 64, 80])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_default_spread_spans_layer_1_to_n_minus_3(num_layers, n):
    ids = default_layer_ids(num_layers, n)
    assert ids[0] == 1 and ids[-1] == num_layers - 3
    assert ids == sorted(set(ids)) and len(ids) == n


@pytest.mark.parametrize(
    "ids, message",
    [
        ([1, 5], "outside 0..4"),  # 5 is the final layer of a 6-layer target
        ([-1, 2], "outside 0..4"),
        ([1, 1, 3], "duplicate"),
        ([3, 1], "increasing order; pass [1, 3]"),
        ([1, True], "not an integer"),
        ([], "no context layer"),
    ],
)
def test_refuses_bad_ids(ids, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_layer_ids(ids, 6)


def test_refuses_more_layers_than_fit():
    with pytest.raises(ValueError, match="cannot spread 5 context layers over a 6-layer target"):
        default_layer_ids(6, 5)


def test_parse_layer_ids():
    assert parse_layer_ids("1, 9,17") == [1, 9, 17]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_layer_ids("1;2")


def test_reads_dims_from_plain_and_nested_configs(qwen3_dir, qwen3_5_vl_dir):
    assert json.loads((qwen3_5_vl_dir / "config.json").read_text())["text_config"]["num_hidden_layers"] == 8
    plain, nested = read_target_config(qwen3_dir), read_target_config(qwen3_5_vl_dir)
    assert (plain.num_hidden_layers, plain.hidden_size) == (6, 64)
    assert (nested.num_hidden_layers, nested.hidden_size) == (8, 64)
    assert resolve_layer_ids(qwen3_5_vl_dir) == [1, 2, 3, 4, 5]
    assert resolve_layer_ids(qwen3_dir, num_context_layers=1) == [3]
    assert resolve_layer_ids(qwen3_dir, [0, 4]) == [0, 4]
    with pytest.raises(ValueError, match="final layer 5"):
        resolve_layer_ids(qwen3_dir, [1, 5])


def test_id_is_the_decoder_layer_output_in_real_model_code(qwen3_dir):
    """Id L must equal what decoder layer L returns, i.e. hidden_states[L + 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen3_dir)).eval()
    captured = {}
    hooks = [
        layer.register_forward_hook(
            lambda module, args, output, i=i: captured.__setitem__(
                i, output[0] if isinstance(output, tuple) else output
            )
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        out = model(torch.arange(3, 40)[None], output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    num_layers = len(model.model.layers)
    for layer_id in range(num_layers - 1):
        assert torch.equal(out.hidden_states[layer_id + 1], captured[layer_id])  # id L = hidden_states[L + 1]
    # The last entry is after the final norm: why the final layer is never a context layer.
    assert not torch.equal(out.hidden_states[num_layers], captured[num_layers - 1])
