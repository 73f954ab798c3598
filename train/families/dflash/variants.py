"""The drafter kinds, one table: everything the trainer, the export and the checks
need to know about a kind is looked up here, never told apart by its name.

A kind's network is its class (`train.families.dflash.model.DFlashDrafter`,
`train.families.dflash.dflash2.DFlash2Drafter`, each naming its kind), built by
`train.families.dflash.build.build_drafter`. This module imports nothing of the network so
that the shape rule (`train.families.dflash.geometry`) can read it too.
"""

from __future__ import annotations

from dataclasses import dataclass

# DrafterConfig fields DFlash 2 adds; the reference reads them from `dflash_config`.
DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DrafterKind:
    name: str  # `model.architecture`, `DrafterConfig.architecture`
    title: str  # as messages name it
    exported_class: str  # config.json `architectures`, as z-lab's reference and vLLM name it
    sizes: tuple[str, ...]  # DrafterConfig fields only this kind reads, exported in `dflash_config`
    added_modules: tuple[str, ...]  # submodules a warm start from `warm_start_from` lacks
    warm_start_from: str | None  # the kind whose drafter warm-starts this one (identity start)
    has_block_conv: bool  # wraps each layer's sublayers in block-local convolutions (`attention_conv`, `mlp_conv`)
    has_selector: bool  # reranks candidates with `candidate_selector` (training loss and decode path)
    decode_path: str  # what a greedy decode drafts, as reports name it
    vllm_cpu_serves: bool  # vLLM's CPU build serves it (DFlash 2's selector walk is a Triton kernel)

    def adds(self, tensor_name: str) -> bool:
        """Whether a state-dict name belongs to a module a warm start lacks."""
        return any(part in self.added_modules for part in tensor_name.split("."))


DFLASH = DrafterKind(
    name="dflash",
    title="DFlash",
    exported_class="DFlashDraftModel",
    sizes=(),
    added_modules=(),
    warm_start_from=None,
    has_block_conv=False,
    has_selector=False,
    decode_path="argmax chain",
    vllm_cpu_serves=True,
)
DFLASH2 = DrafterKind(
    name="dflash2",
    title="DFlash 2",
    exported_class="DFlash2DraftModel",
    sizes=DFLASH2_SIZES,
    added_modules=("attention_conv", "mlp_conv", "candidate_selector"),
    warm_start_from="dflash",
    has_block_conv=True,
    has_selector=True,
    decode_path="selector walk",
    vllm_cpu_serves=False,
)
KINDS = {kind.name: kind for kind in (DFLASH, DFLASH2)}
DEFAULT_KIND = DFLASH2  # the run default (README, "Which drafter")


def kind_named(name: str) -> DrafterKind:
    """The kind `model.architecture` names; ValueError listing the kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"architecture must be one of {', '.join(KINDS)}, got {name!r}") from None


def kind_exported_as(class_name: str) -> DrafterKind | None:
    """The kind whose export config.json names `class_name` in `architectures`."""
    return next((kind for kind in KINDS.values() if kind.exported_class == class_name), None)
