"""`python -m store_schema lossy STORE`: what each lossy way of storing would do to
this store's own states, before a job commits to one.

Per context layer, over the states of the first shards (read as bf16, so run it on a
small bf16 store of your own target first: `extract run --limit 200`):

- each lossy store dtype's error on these states (fp8, fp4: relative RMS and the worst
  token's cosine), quantized and dequantized exactly as a store of that dtype holds them;
- the rank their energy needs: how many directions of the states' second moment
  (uncentered, as a projection folded into the drafter's bias-free `fc` must be) keep
  90 %, 99 % and 99.9 % of it. A deep model's residual stream is far from full rank
  and has outlier channels that dominate its energy, so energy kept is a guide; the
  trained drafter's tau is the verdict (benchmarks/drafter_bench.py --store-dtype)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..dtypes import STORE_DTYPES
from ..projection import directions_for, second_moment, spectrum
from ..reader import StoreReader

ENERGY_KEPT = (0.9, 0.99, 0.999)  # the shares of the second moment `directions_for` is asked


@dataclass(frozen=True)
class LayerCheck:
    layer_id: int
    tokens: int
    hidden: int
    errors: dict  # store dtype -> {"relative_rms": ..., "worst_token_cosine": ...}
    directions: dict  # "0.99" -> directions of the second moment that keep that share of its energy


def directions_kept(moment: np.ndarray, shares=ENERGY_KEPT) -> dict[str, int]:
    """The fewest leading eigenvectors of a second moment (float64 [H, H]) that hold
    each share of its energy (`projection.directions_for`, the rule a projection keeps)."""
    cumulative, _ = spectrum(moment)
    return {str(share): directions_for(cumulative, share) for share in shares}


def dtype_errors(states: torch.Tensor) -> dict[str, dict[str, float]]:
    """Each lossy store dtype's error on bf16 `states` [tokens, H] (float32 arithmetic)."""
    reference = states.float()
    errors = {}
    for name, dtype in STORE_DTYPES.items():
        if not dtype.scaled:
            continue
        restored = dtype.as_bf16(*dtype.lossy.quantize(states)).float()
        cosine = torch.nn.functional.cosine_similarity(reference, restored, dim=-1)
        nonzero = reference.norm(dim=-1) > 0
        errors[name] = {
            "relative_rms": round(float((restored - reference).norm() / reference.norm().clamp_min(1e-30)), 4),
            "worst_token_cosine": round(float(cosine[nonzero].min()) if bool(nonzero.any()) else 1.0, 4),
        }
    return errors


def check_store(store: StoreReader, max_tokens: int) -> list[LayerCheck]:
    """The check over whole shards, in order, until `max_tokens` states a layer are read."""
    parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in store.layer_ids}
    tokens = 0
    for name in store.committed_shards():
        data = store.read_shard(name)
        for layer in store.layer_ids:
            parts[layer].append(data.states(layer))
        tokens += int(data.offsets[-1])
        if tokens >= max_tokens:
            break
    if not tokens:
        raise ValueError(f"{store.path}: no committed shard to check")
    checks = []
    for layer, states in parts.items():
        joined = torch.cat(states)[:max_tokens]
        directions = directions_kept(second_moment(joined))
        checks.append(LayerCheck(layer, len(joined), joined.shape[1], dtype_errors(joined), directions))
    return checks


def report(checks: list[LayerCheck]) -> dict:
    """The JSON `lossy --json` prints: each layer's check and each dtype's size ratio."""
    ratios = {name: dtype.size_ratio for name, dtype in STORE_DTYPES.items()}
    return {"layers": [asdict(check) for check in checks], "size_ratio": ratios, "energy_kept": list(ENERGY_KEPT)}


def lines(checks: list[LayerCheck]) -> list[str]:
    """The text `lossy` prints: a line per layer."""
    out = []
    for check in checks:
        errors = ", ".join(
            f"{name} {e['relative_rms']:.1%} error (worst token cosine {e['worst_token_cosine']:.4f})"
            for name, e in check.errors.items()
        )
        ranks = ", ".join(f"{float(share):.1%} in {count}" for share, count in check.directions.items())
        out.append(f"layer {check.layer_id:>3}  {check.tokens:,} tokens  {errors}")
        out.append(f"           energy: {ranks} of {check.hidden} directions")
    ratios = ", ".join(f"{name} {dtype.size_ratio}" for name, dtype in STORE_DTYPES.items())
    out.append(f"store size / raw bf16 (store_bench --quick): {ratios}")
    return out
