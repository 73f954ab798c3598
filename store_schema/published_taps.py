"""The target layers published drafters read, by target family and drafter kind: what
extraction keeps by default (`extract plan` / `run` without --layers) and what the
trainer's published layouts train on (`train.families.dflash.published`). One table, so a store
extracted for a family holds the layers its default drafter trains on.

The 27B family's taps: the published DFlash 2 (z-lab / Inco Qwen3.8-27B-DFlash2 = SpecForge
configs/qwen3.6-27b-dflash2.json) reads [5, 19, 33, 47, 61]; the published DFlash
(Qwen3.6-27B-DFlash, SpecForge configs/qwen3.6-27b-dflash.json) [1, 16, 31, 46, 61]."""

from __future__ import annotations

DEFAULT_KIND = "dflash2"  # the trainer's default drafter (train.families.dflash.variants.DEFAULT_KIND)
QWEN3_6_27B = "Qwen3.5/3.6/3.8 at 27B (64 layers, hidden 5120)"
QWEN3_6_27B_TAPS = {"dflash2": (5, 19, 33, 47, 61), "dflash": (1, 16, 31, 46, 61)}


def is_qwen3_6_27b(target) -> bool:
    """The Qwen3.5 hybrid architecture at the 27B shape (Qwen3.6 and 3.8 reuse it)."""
    return (
        str(getattr(target, "model_type", "") or "").startswith("qwen3_5")
        and target.num_hidden_layers == 64
        and target.hidden_size == 5120
    )


def published_taps(target) -> dict[str, tuple[int, ...]]:
    """{drafter kind: the layers its published layout reads} for `target`'s family; {} for
    a target no drafter was published for."""
    return dict(QWEN3_6_27B_TAPS) if is_qwen3_6_27b(target) else {}


def taps_for(target, kinds: list[str] | None) -> tuple[list[int] | None, str]:
    """The layers a store for the drafter `kinds` (None: the default kind) keeps on
    `target`, and a line saying which drafters it serves and which it does not; (None, "")
    when nothing is published for the target and no kind was asked for. ValueError for a
    kind the family has no layout of."""
    published = published_taps(target)
    if not published:
        if kinds:
            raise ValueError(
                f"--for-drafter {','.join(kinds)}: no drafter layout is published for this target; "
                "give --layers or --num-context-layers"
            )
        return None, ""
    kinds = kinds or [DEFAULT_KIND]
    unknown = [kind for kind in kinds if kind not in published]
    if unknown:
        raise ValueError(f"--for-drafter {','.join(unknown)}: the family's published kinds are {', '.join(published)}")
    layers = sorted({layer for kind in kinds for layer in published[kind]})
    served = ", ".join(f"{kind} {list(published[kind])}" for kind in kinds)
    missing = [kind for kind in published if not set(published[kind]) <= set(layers)]
    note = ""
    if missing:
        both = sorted(set(layers).union(*(published[kind] for kind in missing)))
        others = ", ".join(f"{kind} {list(published[kind])}" for kind in missing)
        note = f"; not {others} (--for-drafter {','.join([*kinds, *missing])} keeps all: {len(both)} layers)"
    return layers, f"layers {layers}: the published layouts of {QWEN3_6_27B} for {served}{note}"
