"""The drafters the field publishes, as data: for a known target family, each kind's
published layout (block size, layer kinds, window, mask rule, target layers) is
what a fresh run trains unless the run config says otherwise. Other targets keep
the formulas of `DrafterConfig.from_target`.

Each entry cites the config it was read from. The DFlash layout for this family
is recorded as z-lab describe their Qwen3.6 drafters (interleaved sliding-window
layers, the last full: z-lab/dflash#126) with the taps and window of SpecForge's
qwen3.6-27b-dflash config; SpecForge's older configs/qwen3.5-27b-dflash.json
(@95d22a7: five full-attention layers, head_dim 256, taps [3, 15, 31, 47, 59])
is the Qwen3.5 release, not followed."""

from __future__ import annotations

from dataclasses import dataclass

from store_schema.published_taps import QWEN3_6_27B, QWEN3_6_27B_TAPS, is_qwen3_6_27b
from train.families.dflash.model import DrafterConfig
from train.families.dflash.variants import DFLASH, DFLASH2


@dataclass(frozen=True)
class PublishedLayout:
    kind: str  # `model.architecture`
    family: str  # the targets it was published for, as messages name them
    source: str  # the config it was read from: repository, file, revision
    block_size: int
    layer_types: tuple[str, ...]
    sliding_window: int
    is_causal: bool | None  # None: each layer's rule (sliding causal, full bidirectional)
    target_layer_ids: tuple[int, ...]

    def fills(self, geometry: dict) -> dict:
        """`geometry` (the run config's `model` sizes, None where unset) with this
        layout wherever the user set nothing; layer kinds only when neither the
        layer count nor the kinds are set."""
        filled = dict(geometry)
        defaults: dict[str, object] = {
            "block_size": self.block_size,
            "sliding_window": self.sliding_window,
            "is_causal": self.is_causal,
        }
        if geometry.get("num_hidden_layers") is None and geometry.get("layer_types") is None:
            defaults["layer_types"] = list(self.layer_types)
        for key, value in defaults.items():
            if filled.get(key) is None:
                filled[key] = value
        return filled

    def describe(self) -> str:
        kinds = ", ".join(f"{self.layer_types.count(t)} {t.split('_')[0]}" for t in dict.fromkeys(self.layer_types))
        mask = {None: "per layer kind", False: "non-causal", True: "causal"}[self.is_causal]
        return (
            f"block {self.block_size}, {len(self.layer_types)} layers ({kinds}, window {self.sliding_window}), "
            f"{mask}, taps {list(self.target_layer_ids)}; from {self.source}"
        )


LAYOUTS = (
    PublishedLayout(
        kind=DFLASH2.name,
        family=QWEN3_6_27B,
        source="z-lab Qwen3.8-27B-DFlash2 = SpecForge configs/qwen3.6-27b-dflash2.json @5943b2f",
        block_size=8,
        layer_types=("sliding_attention",) * 5,
        sliding_window=2048,
        is_causal=False,
        target_layer_ids=QWEN3_6_27B_TAPS[DFLASH2.name],
    ),
    PublishedLayout(
        kind=DFLASH.name,
        family=QWEN3_6_27B,
        source="z-lab Qwen3.6-27B-DFlash (SpecForge configs/qwen3.6-27b-dflash.json; z-lab/dflash#126)",
        block_size=16,
        layer_types=("sliding_attention",) * 4 + ("full_attention",),
        sliding_window=2048,
        is_causal=None,
        target_layer_ids=QWEN3_6_27B_TAPS[DFLASH.name],
    ),
)


def published_layout(kind: str, target) -> PublishedLayout | None:
    """The layout published for drafters of `kind` on `target`'s family, or None."""
    if not is_qwen3_6_27b(target):
        return None
    return next((layout for layout in LAYOUTS if layout.kind == kind), None)


def layout_taps(layout: PublishedLayout, store_layer_ids: list[int] | None) -> tuple[list[int], str]:
    """The context layers a fresh run trains on: the layout's taps, which the store must
    hold (on paper, without a store, they are promised); and a line saying so. A store
    without them is refused in one line saying how to get them: a drafter on other layers
    matches no published layout (no published warm start, no published comparison)."""
    taps = list(layout.target_layer_ids)
    if store_layer_ids is None or set(taps) <= set(store_layer_ids):
        return taps, f"taps {taps} (the published layout's)"
    raise ValueError(
        f"the store holds layers {list(store_layer_ids)}, not the published {layout.kind} taps {taps} "
        f"(it lacks {sorted(set(taps) - set(store_layer_ids))}): extract them "
        f"(python -m extract run ... --for-drafter {layout.kind}, or --layers-from a published drafter), "
        "or train on the store's layers with --set model.target_layer_ids=[...]"
    )


def fresh_drafter_config(
    target,
    mask_token_id: int,
    store_layer_ids: list[int] | None,
    geometry: dict,
    log=None,
    chosen_layer_ids: list[int] | None = None,
):
    """The drafter a fresh run trains on `target`: the run config's sizes, the kind's
    published layout where the target is of its family and the config is silent,
    `DrafterConfig.from_target`'s formulas for the rest. `chosen_layer_ids`
    (`model.target_layer_ids`) wins over the layout's taps. `log` hears the layout used."""
    layout = published_layout(geometry.get("architecture") or DFLASH2.name, target)
    layer_ids = chosen_layer_ids or store_layer_ids
    if layout is not None:
        geometry = layout.fills(geometry)
        layer_ids, taps = (
            (chosen_layer_ids, f"model.target_layer_ids {chosen_layer_ids}")
            if chosen_layer_ids
            else layout_taps(layout, store_layer_ids)
        )
        if log is not None:
            log(f"fit: the published {layout.kind} layout for {layout.family}: {layout.describe()}; training on {taps}")
    return DrafterConfig.from_target(target, mask_token_id=mask_token_id, context_layer_ids=layer_ids, **geometry)
