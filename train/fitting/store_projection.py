"""A projected store's directions as a part of every checkpoint (`projection.safetensors`):
the drafter trains on states lifted from the store's coordinates
(`store_schema.projection`), so the projection is part of what it computes, and export
folds it into the drafter's first map from the checkpoint alone, the store not needed."""

from __future__ import annotations

import numpy as np
import torch

from store_schema.projection import Projection, fold

LAYER_PREFIX = "layer_"


class ProjectionPart:
    """Stateful (train.fitting.checkpoint): the directions as tensors, the fingerprint's
    summary of them as JSON; a resume checks the store still has the same."""

    def __init__(self, projection: Projection):
        self.projection = projection

    def state_dict(self) -> dict:
        tensors = {f"{LAYER_PREFIX}{layer}": torch.from_numpy(d) for layer, d in self.projection.directions.items()}
        return {**tensors, "summary": self.projection.summary()}

    def load_state_dict(self, state: dict) -> None:
        if state["summary"] != self.projection.summary():
            raise ValueError(
                "the checkpoint's store projection is not the store's (sha256 "
                f"{state['summary'].get('sha256', '?')[:12]} vs {self.projection.summary()['sha256'][:12]})"
            )


def checkpoint_directions(tensors: dict[str, torch.Tensor]) -> dict[int, np.ndarray]:
    """Layer id -> directions [H, K] of a checkpoint's projection file."""
    return {int(name.removeprefix(LAYER_PREFIX)): t.float().numpy() for name, t in tensors.items()}


def fold_into(context_map: torch.nn.Linear, context_layer_ids: list[int], directions: dict[int, np.ndarray]) -> None:
    """Fold the projection into the map that reads the concatenated stored layers
    (`DrafterFamily.context_map`), in place: it then reads raw states as it read lifted ones."""
    with torch.no_grad():
        weight = context_map.weight
        weight.copy_(fold(weight, [directions.get(layer) for layer in context_layer_ids]))
