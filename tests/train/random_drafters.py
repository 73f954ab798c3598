"""Random drafters the tests decode and serve: a DFlash with perturbed weights, a
DFlash 2 away from its identity start, and a DFlash export with vLLM's CPU head size."""

from __future__ import annotations

import builders
import torch
from reference_oracle import BLOCK

from store_schema.runtime.target_config import read_target_config
from train.export.drafter_dir import export_drafter
from train.families.dflash.dflash2 import DFlash2Drafter
from train.families.dflash.model import DFlashDrafter, DrafterConfig

LAYERS = [1, 3]
SIZES = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)
GEOMETRIES = {
    "full": dict(num_hidden_layers=2, layer_types=["full_attention"] * 2),
    "sliding": dict(num_hidden_layers=3, sliding_window=8),
}


def dflash_drafter(qwen3_dir, geometry=GEOMETRIES["sliding"], mask_token_id=3, seed=0) -> DFlashDrafter:
    config = DrafterConfig.from_target(
        read_target_config(qwen3_dir),
        mask_token_id=mask_token_id,
        context_layer_ids=LAYERS,
        block_size=BLOCK,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **geometry,
        architecture="dflash",
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()


def random_dflash2(qwen3_dir, geometry=GEOMETRIES["sliding"], mask_token_id=3, seed=0, sizes=SIZES) -> DFlash2Drafter:
    """A DFlash 2 away from its identity start: convolutions with real taps and
    dynamic coefficients, codebooks large enough to change the selector's choices."""
    drafter = builders.warm_started(dflash_drafter(qwen3_dir, geometry, mask_token_id, seed), **sizes)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            scale = 0.2 if "conv" in name else 1.0 if "codebook" in name else 0.3 if "selector" in name else 0.0
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return drafter.eval()


def random_export(target_dir, mask_id, path, **geometry):
    """A random DFlash export with 2 heads of 32: vLLM's CPU attention needs head_dim >= 32."""
    config = DrafterConfig.from_target(
        read_target_config(target_dir),
        mask_token_id=mask_id,
        context_layer_ids=LAYERS,
        block_size=BLOCK,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        **geometry,
        architecture="dflash",
    )
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(config).eval(), path, dtype=torch.float32)
