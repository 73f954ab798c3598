"""The drafter's CUDA attention path, checked on CPU: the BlockMask built from the
anchors equals torch's `create_block_mask` over the full grid, compiled flex needs
one graph per layer rule, grad mode and dtype whatever the sequence lengths (counted
with a counting torch.compile backend), more than the budget is an error, and under
bf16 autocast q, k and v reach the attention in one dtype."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from train.families.dflash.anchors import LayerAttention, dflash_mask_mod
from train.families.dflash.flex_compile import CompiledFlex, FlexRecompileError
from train.families.dflash.flex_mask import FLEX_TILE, dflash_block_mask, padded
from train.families.dflash.model import DFlashDrafter, DrafterConfig

RULES = {
    "full": LayerAttention(),
    "sliding": LayerAttention(causal=True, window=40),
    "short_window": LayerAttention(causal=True, window=3),
    "noncausal": LayerAttention(causal=False, window=50),
}
SHAPES = [(300, 10, 16), (517, 20, 16), (130, 1, 16), (1000, 33, 8), (700, 70, 4)]  # context, anchors, block


def _anchors(context_len, count, block, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(context_len - block + 1, generator=generator)[:count].sort().values


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
def test_block_mask_from_anchors_equals_the_full_grid(rule):
    for context_len, count, block in SHAPES:
        anchors = _anchors(context_len, count, block)
        mine = dflash_block_mask(anchors, context_len, block, rule)
        queries, keys = mine.seq_lengths
        assert (queries, keys) == (padded(count * block), padded(context_len + count * block))
        assert queries % FLEX_TILE == 0 and keys % FLEX_TILE == 0 and queries >= 2 * FLEX_TILE
        grid = create_block_mask(
            dflash_mask_mod(anchors, context_len, block, rule), None, None, queries, keys, device="cpu"
        )
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(mine, name), getattr(grid, name)), (name, context_len, count, block)


def _flex_inputs(context_len, count, block, dtype=torch.float32, heads=4, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask = dflash_block_mask(_anchors(context_len, count, block, seed), context_len, block, RULES["full"])
    queries, keys = mask.seq_lengths
    q = torch.randn(1, heads, queries, dim, generator=generator).to(dtype)
    k, v = (torch.randn(1, 2, keys, dim, generator=generator).to(dtype) for _ in range(2))
    return q, k, v, mask


def test_compiled_flex_needs_one_graph_per_rule_and_dtype_whatever_the_lengths():
    torch._dynamo.reset()  # compiled graphs are kept per code object: flex_attention's, process-wide
    counter = CompileCounter()
    compiled = CompiledFlex(backend=counter)
    sliding = RULES["sliding"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager reference below warns on CPU
        for context_len, count, block in SHAPES[:3]:
            for rule in (RULES["full"], sliding):
                q, k, v, _ = _flex_inputs(context_len, count, block)
                mask = dflash_block_mask(_anchors(context_len, count, block), context_len, block, rule)
                out = compiled(q, k, v, mask, 0.25)
                if count == SHAPES[0][1]:  # the compiled call computes what eager flex does
                    torch.testing.assert_close(
                        out, flex_attention(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)
                    )
        assert counter.frame_count == 2  # full and sliding, not one per sequence length
        for context_len, count, block in SHAPES[:2]:
            q, k, v, mask = _flex_inputs(context_len, count, block, dtype=torch.bfloat16)
            compiled(q, k, v, mask, 0.25)
        assert counter.frame_count == 3  # another dtype is another graph: evaluation runs under training's autocast

    torch._dynamo.reset()
    tight = CompiledFlex(backend=CompileCounter(), limit=1)
    with torch.no_grad():
        tight(*_flex_inputs(300, 10, 16), 0.25)
        with pytest.raises(FlexRecompileError, match="more than 1 compiled graphs"):
            tight(*_flex_inputs(300, 10, 16, dtype=torch.bfloat16), 0.25)
    torch._dynamo.reset()


def test_queries_keys_and_values_share_a_dtype_under_bf16_autocast():
    config = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=300,
        num_target_layers=8,
        context_layer_ids=[1, 3],
        mask_token_id=5,
        num_hidden_layers=1,
        block_size=4,
        architecture="dflash",
    )
    attention = DFlashDrafter(config).layers[0].self_attn
    x, context = torch.randn(1, 8, 64), torch.randn(1, 20, 64)
    cos, sin = torch.randn(1, 28, 16), torch.randn(1, 28, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.q_norm(attention.q_proj(x).view(1, 8, 4, 16)).dtype == torch.float32  # the norm upcasts
        q, k, v = attention.queries_keys_values(x, context, cos, sin)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert q.shape == (1, 4, 8, 16) and k.shape == v.shape == (1, 2, 28, 16)


def test_a_flex_compile_error_falls_back_to_the_split_path_with_one_line(monkeypatch, capsys):
    """Issue 60.3: flex that fails to compile (here a backend that raises, as inductor
    does on a kernel that does not fit the device) gives way to the split path: one
    line, the same values, and later forwards go straight to split."""
    from train.families.dflash import attention, flex_compile

    def broken(graph, example_inputs):
        raise RuntimeError("out of resource: shared memory, Required: 131072, Hardware limit: 101376")

    monkeypatch.setattr(flex_compile, "DISABLED", [])
    monkeypatch.setattr(attention, "DISABLED", flex_compile.DISABLED)
    monkeypatch.setattr(attention, "compiles_flex", lambda device: True)  # the CUDA path, on CPU
    monkeypatch.setattr(attention, "_COMPILED", CompiledFlex(backend=broken))
    config = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=300,
        num_target_layers=8,
        context_layer_ids=[1, 3],
        mask_token_id=5,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        block_size=4,
        architecture="dflash",
    )
    torch.manual_seed(0)
    drafter, embed = DFlashDrafter(config).eval(), torch.nn.Embedding(300, 64)
    features, ids = torch.randn(40, 128), torch.randint(0, 300, (40,))
    anchors = torch.tensor([2, 9, 17, 30])
    torch._dynamo.reset()
    with torch.no_grad():
        fell_back = drafter(features, ids, anchors, embed, attention="flex")
        split = drafter(features, ids, anchors, embed, attention="split")
        again = drafter(features, ids, anchors, embed, attention="flex")
    torch._dynamo.reset()
    torch.testing.assert_close(fell_back, split)
    torch.testing.assert_close(again, split)
    err = capsys.readouterr().err
    assert err.count("warning: flex_attention failed here") == 1 and "out of resource: shared memory" in err
    assert len(flex_compile.DISABLED) == 1 and attention.resolve_attention("auto", torch.device("cuda")) == "split"


def test_flex_tiles_shrink_where_shared_memory_is_small():
    """Issue 60.3, by configuration (no GPU here): sm_120's ~99 KB per block gets tiles that
    divide the BlockMask's 128-token blocks; an H100 / H200 (227 KB) and the CPU keep
    flex's defaults."""
    from train.families.dflash.flex_compile import SMALL_TILES, kernel_options, tiles_for

    small = tiles_for(101_376)  # sm_120's opt-in shared memory per block
    assert small == SMALL_TILES and all(128 % size == 0 for size in small.values())
    assert tiles_for(232_448) is None and tiles_for(None) is None  # H100 / H200; unknown
    assert kernel_options(torch.device("cpu")) is None
