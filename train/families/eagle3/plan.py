"""Which EAGLE-3 drafter a run trains: sized for the target, reading three of the
store's layers (low / middle / high of what is stored, or `model.target_layer_ids`),
or fine-tuned from an EAGLE-3 export (`model.init_from`)."""

from __future__ import annotations

from collections.abc import Callable

from train.config_error import ConfigError
from train.families.eagle3.config import Eagle3Config, aux_layers
from train.families.family import DrafterPlan, StartSource, chosen_layers

AUX_LAYERS = 3  # low, middle, high


def paper_layers(num_target_layers: int) -> list[int]:
    """Without a store: vLLM's default aux layers (2, N // 2, N - 3), in this project's ids."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def default_layers(store_layer_ids: list[int] | None, num_target_layers: int) -> list[int]:
    """Low / middle / high of the store's layers; ConfigError naming the fix when it holds fewer than three."""
    if store_layer_ids is None:
        return paper_layers(num_target_layers)
    if len(store_layer_ids) < AUX_LAYERS:
        raise ConfigError(
            f"config model.architecture: eagle3 reads {AUX_LAYERS} of the store's layers (low, middle, high), but "
            f"the store holds {store_layer_ids}; extract one that holds more with `python -m extract run ... "
            f"--layers-from DIR,DIR` (the union of several drafters' layers) or set model.target_layer_ids"
        )
    return aux_layers(store_layer_ids)


def fresh_config(model, target, store_layer_ids: list[int] | None) -> Eagle3Config:
    chosen = chosen_layers(model.target_layer_ids, store_layer_ids, target.num_hidden_layers)
    layers = chosen or default_layers(store_layer_ids, target.num_hidden_layers)
    try:
        return Eagle3Config.from_target(
            target,
            layers,
            model.draft_vocab_size,
            model.ttt_steps,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            intermediate_size=model.intermediate_size,
        )
    except ValueError as error:
        raise ConfigError(f"config model: {error}") from None


def fits_target(config: Eagle3Config, target, where: str) -> None:
    """A fine-tuned drafter's contract with the target: hidden size, vocabulary, layers."""
    for name, ours, theirs in (
        ("hidden_size", config.hidden_size, target.hidden_size),
        ("vocab_size", config.vocab_size, target.vocab_size),
        ("num_target_layers", config.num_target_layers, target.num_hidden_layers),
    ):
        if ours != theirs:
            raise ConfigError(f"{where}: the drafter's {name} is {ours}, the target's {theirs}")


def plan_drafter(
    model, target_path: str, target, store_layer_ids, resumed, source: StartSource | None, log: Callable[[str], None]
) -> DrafterPlan:
    checkpointed, latest = resumed if resumed is not None else (None, None)
    if model.init_from:
        base = source.config if source is not None else checkpointed
        where = f"--init-from {model.init_from}" if source is not None else f"--resume {latest}"
        if not isinstance(base, Eagle3Config):
            raise ConfigError(f"{where}: not an EAGLE-3 drafter")
        config = base
        fits_target(config, target, where)
        chosen_layers(config.context_layer_ids, store_layer_ids, target.num_hidden_layers)
    else:
        config = fresh_config(model, target, store_layer_ids)
    if checkpointed is None:
        log(
            f"fit: EAGLE-3 over the target's layers {config.context_layer_ids} (vLLM's aux ids "
            f"{[layer + 1 for layer in config.context_layer_ids]}), draft vocabulary {config.draft_vocab_size:,}, "
            f"training-time test {config.ttt_steps} steps"
        )
    else:
        changed = config.differences(checkpointed)
        if changed:
            raise ConfigError(f"--resume: {latest} holds a different drafter: {'; '.join(changed)}")
    run_info = {"init_from": source.record()} if source is not None else {}
    return DrafterPlan(config, run_info, source)
