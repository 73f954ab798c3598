"""A projected store: each context layer's states kept as coordinates on its leading
principal directions, K of the hidden size's H values a token.

Every drafter this project trains reads the stored layers through one bias-free linear
map first (`fc` over their concatenation), so a projection costs the served drafter
nothing: readers lift the coordinates back (`lift`: c P^T, the states' orthogonal
projection onto the kept directions), the drafter trains on those, and export folds
the projection into `fc` (`fold`: W -> W blockdiag(P P^T)), so the exported drafter
reads the target's raw states and computes exactly what it trained to compute.

The directions are the eigenvectors of each layer's uncentered second moment (a mean
could not be folded into a bias-free map), fitted on a sample of the states before
anything is stored, and kept in the store (`layout.PROJECTION_FILE`, safetensors)
whose digest the fingerprint records. A store projected for some layers serves every
drafter whose layers it holds."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

RANK_MULTIPLE = 32  # ranks are rounded up to this: whole fp4 blocks, tensor-core-friendly widths


@dataclass(frozen=True)
class Projection:
    directions: dict[int, np.ndarray]  # layer id -> float32 [H, K], orthonormal columns, by eigenvalue
    energy_kept: dict[int, float]  # layer id -> share of the fitted states' second moment the K directions hold
    fitted_tokens: int  # token states per layer the second moments were taken over

    def rank(self, layer_id: int) -> int:
        return int(self.directions[layer_id].shape[1])

    def _facts(self) -> str:
        """Energy kept and sample size as canonical JSON (the file's metadata)."""
        energy = {str(k): v for k, v in self.energy_kept.items()}
        return json.dumps({"energy_kept": energy, "fitted_tokens": self.fitted_tokens}, sort_keys=True)

    def to_bytes(self) -> bytes:
        """The projection file: a tensor per layer and the rest as metadata."""
        from safetensors.numpy import save  # here: readers of metadata alone never write one

        tensors = {f"layer_{layer}": np.ascontiguousarray(d) for layer, d in self.directions.items()}
        return save(tensors, metadata={"projection": self._facts()})

    def digest(self) -> str:
        """sha256 of the content (safetensors' header order is not fixed, so not of the file)."""
        h = hashlib.sha256(self._facts().encode())
        for layer, directions in sorted(self.directions.items()):
            h.update(f"layer_{layer}{directions.shape}".encode())
            h.update(np.ascontiguousarray(directions, "<f4").tobytes())
        return h.hexdigest()

    @classmethod
    def from_bytes(cls, raw: bytes, what: str) -> "Projection":
        from safetensors.numpy import load  # here: readers of metadata alone never load one

        tensors = load(raw)
        facts = json.loads(_metadata(raw)["projection"])
        energy, fitted = facts["energy_kept"], int(facts["fitted_tokens"])
        directions = {int(name.removeprefix("layer_")): array for name, array in tensors.items()}
        if set(directions) != {int(k) for k in energy}:
            raise ValueError(f"{what}: directions for layers {sorted(directions)}, energy for {sorted(energy)}")
        return cls(dict(sorted(directions.items())), {int(k): float(v) for k, v in energy.items()}, fitted)

    def summary(self) -> dict:
        """What the fingerprint records: ranks, energy kept, the sample size, the content's sha256."""
        return {
            "ranks": {str(layer): self.rank(layer) for layer in self.directions},
            "energy_kept": {str(layer): round(e, 6) for layer, e in self.energy_kept.items()},
            "fitted_tokens": self.fitted_tokens,
            "sha256": self.digest(),
        }


def _metadata(raw: bytes) -> dict:
    """A safetensors file's string metadata (its header is JSON after an 8-byte length)."""
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]).get("__metadata__", {})


def second_moment(states) -> np.ndarray:
    """float64 [H, H] sum of x x^T over the rows of `states` (torch or numpy [T, H])."""
    values = np.asarray(states.float().numpy() if hasattr(states, "float") else states, np.float64)
    return values.T @ values


def spectrum(moment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A second moment's (share of its trace the leading k eigenvectors hold, for each k;
    the eigenvectors [H, H], leading first)."""
    eigenvalues, vectors = np.linalg.eigh(moment)
    eigenvalues = np.clip(eigenvalues[::-1], 0.0, None)
    return np.cumsum(eigenvalues) / max(float(eigenvalues.sum()), np.finfo(float).tiny), vectors[:, ::-1]


def directions_for(cumulative: np.ndarray, energy: float) -> int:
    """The fewest leading directions of a `spectrum` that hold `energy` of it."""
    return int(np.searchsorted(cumulative, energy) + 1)


def fit(moments: dict[int, np.ndarray], tokens: int, energy: float | None = None, rank: int | None = None):
    """Each layer's leading eigenvectors of its second moment, one rank for every layer
    (their coordinates travel stacked, as the layers' states do): the fewest that hold
    `energy` of each layer's trace, or `rank`, rounded up to `RANK_MULTIPLE`. A rank
    that reaches the hidden size saves nothing: then no layer is projected (empty)."""
    if (energy is None) == (rank is None):
        raise ValueError("a projection keeps either an energy share or a rank")
    if energy is not None and not 0.0 < energy < 1.0:
        raise ValueError(f"the energy kept must be in (0, 1), got {energy}")
    spectra = {layer: spectrum(moment) for layer, moment in sorted(moments.items())}
    wanted = int(rank or 0)
    if energy is not None:
        wanted = max(directions_for(cumulative, energy) for cumulative, _ in spectra.values())
    k = -(-max(wanted, 1) // RANK_MULTIPLE) * RANK_MULTIPLE
    if k >= min(len(cumulative) for cumulative, _ in spectra.values()):
        return Projection({}, {}, tokens)
    directions = {layer: np.ascontiguousarray(vectors[:, :k], np.float32) for layer, (_, vectors) in spectra.items()}
    kept = {layer: float(cumulative[k - 1]) for layer, (cumulative, _) in spectra.items()}
    return Projection(directions, kept, tokens)


_ON_DEVICE: dict = {}  # (id of a host directions tensor, device) -> (it, its float32 copy there)


def _on(directions, device):
    """`directions` as float32 on `device`, copied there once (a 27B layer's are ~40 MB)."""
    import torch  # here: torch only where states are (metadata readers need none)

    if directions.device == torch.device(device):
        return directions.float()
    key = (id(directions), str(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = (directions, directions.to(device, torch.float32))
    return _ON_DEVICE[key][1]


def project(states, directions):
    """bf16 coordinates [T, K] of torch states [T, H] on directions [H, K] (float32 math)."""
    import torch  # here: torch only where states are

    return (states.float() @ _on(directions, states.device)).to(torch.bfloat16)


def lift(coordinates, directions):
    """bf16 states [T, H] of coordinates [T, K]: their point in the kept subspace."""
    import torch  # here: torch only where states are

    return (coordinates.float() @ _on(directions, coordinates.device).T).to(torch.bfloat16)


def fold(weight, directions: list):
    """A map's weight [out, n*H] over n concatenated layers, each through P P^T (its
    layer's directions, or None for a layer stored whole): what reads raw states as the
    trained map read the lifted ones."""
    import torch  # here: torch only where weights are

    hidden = weight.shape[1] // len(directions)
    blocks = []
    for index, layer_directions in enumerate(directions):
        part = weight[:, index * hidden : (index + 1) * hidden].double()
        if layer_directions is not None:
            p = torch.as_tensor(layer_directions, dtype=torch.float64, device=weight.device)
            part = (part @ p) @ p.T
        blocks.append(part)
    return torch.cat(blocks, dim=1).to(weight.dtype)
