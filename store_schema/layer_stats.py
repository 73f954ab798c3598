"""Per-layer statistics of the states a shard stores: evidence that a capture carries
signal, recorded in the shard's commit record (`records.ShardCommit.layer_stats`).

Other pipelines have shipped captures that were silently empty (a hybrid target's
hook wrote all-zero states; the drafter "converged" and served acceptance was ~0).
Checksums and NaN tests pass on such a store, so three rules, written once here:

- the writer refuses to commit a layer that is all zeros or constant across tokens
  (`refuse_empty_capture`, naming shard and layer);
- `verify` flags the same, a share of all-zero tokens above `MAX_ZERO_TOKEN_SHARE`,
  and a layer whose median token RMS is more than `MEDIAN_FACTOR` times off the
  store's median for that layer id (`outliers`: a layer swapped with another of a
  different scale, a capture of the wrong layer); it recomputes the statistics from
  the data and compares them with the recorded ones (`differs`), so a store written
  before they were recorded is checked too.

The statistics are taken over at most `SAMPLED_TOKENS` evenly spaced tokens of the
shard (all of them in a smaller shard): a fixed, small cost per layer whatever the
shard's size, and the same rows for writer and verify."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

from .codecs.arrays import RowBlocks, is_channel_major
from .dtypes import BFLOAT16_STORE, FP8_E4M3_STORE, StoreDtype
from .errors import EmptyCaptureError

SAMPLED_TOKENS = 4096  # token rows the statistics are taken over, at most
CONSTANT_SPREAD = 1e-4  # token spread <= this x RMS: every token's states the same
MAX_ZERO_TOKEN_SHARE = 0.01  # verify: real states never have an all-zero token; a few % means a broken capture
MEDIAN_FACTOR = 2.0  # verify: median token RMS outside [median / F, median x F] of the layer across shards
MIN_SHARDS_FOR_MEDIAN = 3  # fewer shards: no median to be far from
# the store dtype a numpy array of stored values is, where its type alone says (fp4 codes are uint8: callers name it)
STORE_VALUE_DTYPES = {BFLOAT16_STORE.values: BFLOAT16_STORE, FP8_E4M3_STORE.values: FP8_E4M3_STORE}
SIGNIFICANT_DIGITS = 6  # as recorded: deterministic, readable, far finer than any rule here
STATS_BLOCK_ROWS = 256  # sampled rows summed at a time (a few MB of float32 at any width)


@dataclass(frozen=True)
class LayerStats:
    """What one shard stores for one layer, over its sampled tokens (as float values,
    fp8 codes times their scales; NaN/Inf counted as 0, verify reports those apart)."""

    tokens: int  # token rows the statistics were taken over
    rms: float  # over every value
    median_token_rms: float  # median over tokens of each token's RMS: robust to a few massive-activation tokens
    token_spread: float  # RMS over channels of each channel's std across tokens: 0 when every token is the same
    zero_token_share: float  # tokens whose states are all zero
    min: float
    max: float

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict) -> "LayerStats":
        return cls(
            tokens=int(body["tokens"]),
            **{
                k: float(body[k]) for k in ("rms", "median_token_rms", "token_spread", "zero_token_share", "min", "max")
            },
        )


def _rounded(value: float) -> float:
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


def sampled_rows(num_tokens: int) -> np.ndarray:
    """The token rows the statistics of a `num_tokens`-token shard are taken over."""
    if num_tokens <= SAMPLED_TOKENS:
        return np.arange(num_tokens)
    return np.linspace(0, num_tokens - 1, SAMPLED_TOKENS).round().astype(np.int64)


def layer_stats(
    values: np.ndarray | RowBlocks, scales: np.ndarray | None = None, dtype: StoreDtype | None = None
) -> LayerStats:
    """Statistics of one layer's stored states: `values` [tokens, columns] as `dtype`
    stores them (bfloat16; float8_e4m3fn codes with float32 per-token `scales`; fp4
    packed codes with their block scales: `dtype` says which, by default the one whose
    values `values` holds)."""
    if not isinstance(values, RowBlocks):
        values = np.asarray(values)
    rows = sampled_rows(len(values))
    if not rows.size or not values.shape[1]:
        return LayerStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    hidden = values.shape[1] * (dtype.values_per_code if dtype else 1)
    token_sq, channel_sq, channel_sum = [], np.zeros(hidden), np.zeros(hidden)
    low, high = math.inf, -math.inf
    # Blocks of rows: the float temporaries stay small and are reused, where one [4096, hidden]
    # array (84 MB at 5,120 channels) cost more in fresh pages than the sums themselves.
    for start in range(0, len(rows), STATS_BLOCK_ROWS):
        block = rows[start : start + STATS_BLOCK_ROWS]
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf bits: verify reports them apart
            x = _as_float32(_sampled(values, block), None if scales is None else scales[block], dtype)
        x[~np.isfinite(x)] = 0.0
        # Sums of squares in float64 (squares of bf16's largest values overflow float32), by einsum.
        token_sq.append(np.einsum("ij,ij->i", x, x, dtype=np.float64) / hidden)
        channel_sq += np.einsum("ij,ij->j", x, x, dtype=np.float64)
        channel_sum += x.sum(axis=0, dtype=np.float64)
        low, high = min(low, float(x.min())), max(high, float(x.max()))
    squares = np.concatenate(token_sq)
    channel_var = channel_sq / len(rows) - np.square(channel_sum / len(rows))
    return LayerStats(
        tokens=len(rows),
        rms=_rounded(math.sqrt(float(squares.mean()))),
        median_token_rms=_rounded(math.sqrt(float(np.median(squares)))),
        token_spread=_rounded(math.sqrt(float(np.maximum(channel_var, 0.0).mean()))),
        zero_token_share=_rounded(float((squares == 0).mean())),
        min=_rounded(low),
        max=_rounded(high),
    )


def _sampled(values: np.ndarray | RowBlocks, rows: np.ndarray) -> np.ndarray:
    """values[rows], gathered along whichever axis the array holds contiguously (fp8
    codes arrive channel-major: a row gather there touches every byte one at a time)."""
    if isinstance(values, RowBlocks):
        return values.take(rows)
    if is_channel_major(values):
        return np.take(values.T, rows, axis=1).T
    return np.take(values, rows, axis=0)


def _as_float32(values: np.ndarray, scales: np.ndarray | None, dtype: StoreDtype | None) -> np.ndarray:
    """Stored `values` (and their `scales`) as float32, exactly (`StoreDtype.float32`:
    ml_dtypes' own casts run element by element, and a bf16 shard's statistics took
    longer than encoding it); plain float arrays as float64."""
    if dtype is None:
        dtype = STORE_VALUE_DTYPES.get(values.dtype)
    if dtype is None:
        return values.astype(np.float64)
    return dtype.float32(values, scales)


def empty_capture(stats: LayerStats) -> str | None:
    """Why these states carry no signal (all zeros, constant across tokens), or None."""
    if stats.tokens and stats.rms == 0.0:
        return "all zeros"
    if stats.tokens > 1 and stats.token_spread <= CONSTANT_SPREAD * stats.rms:
        return f"constant across tokens (spread {stats.token_spread:g} at RMS {stats.rms:g})"
    return None


def refuse_empty_capture(shard: str, layer_id: int, stats: LayerStats) -> None:
    """The writer's rule: a captured layer without signal is never committed."""
    why = empty_capture(stats)
    if why:
        raise EmptyCaptureError(
            f"shard {shard}: captured layer {layer_id} is {why} over {stats.tokens} token(s); "
            "not committed -- the target's capture of that layer is broken (hook, kernel "
            "or layer id)"
        )


def problems(stats: LayerStats) -> list[str]:
    """What verify flags in one shard's layer on its own."""
    found = [f"states are {why}" for why in [empty_capture(stats)] if why]
    if not found and stats.zero_token_share > MAX_ZERO_TOKEN_SHARE:
        found.append(
            f"{stats.zero_token_share:.1%} of the sampled tokens are all zeros (more than {MAX_ZERO_TOKEN_SHARE:.0%})"
        )
    return found


def outliers(per_shard: dict[str, dict[int, LayerStats]]) -> list[tuple[str, int, str]]:
    """(shard, layer id, what) for every layer whose median token RMS is more than
    `MEDIAN_FACTOR` times off the store's median for that layer id."""
    found = []
    layer_ids = sorted({layer for layers in per_shard.values() for layer in layers})
    for layer in layer_ids:
        values = {
            shard: layers[layer].median_token_rms
            for shard, layers in per_shard.items()
            if layer in layers and layers[layer].tokens
        }
        if len(values) < MIN_SHARDS_FOR_MEDIAN:
            continue
        median = statistics.median(values.values())
        for shard, value in sorted(values.items()):
            if median > 0 and not (median / MEDIAN_FACTOR <= value <= median * MEDIAN_FACTOR):
                found.append(
                    (
                        shard,
                        layer,
                        f"median token RMS {value:g} is {value / median:.2f}x the store's "
                        f"median {median:g} for layer {layer} (allowed 1/{MEDIAN_FACTOR:g}.."
                        f"{MEDIAN_FACTOR:g}x): a capture of another layer, or layers swapped?",
                    )
                )
    return found


def differs(recorded: LayerStats, computed: LayerStats, tolerance: float = 1e-3) -> bool:
    """Whether statistics recomputed from a shard's data disagree with those its commit
    recorded (beyond float noise between numpy builds)."""
    a, b = recorded.to_json(), computed.to_json()
    return any(not math.isclose(a[k], b[k], rel_tol=tolerance, abs_tol=1e-6) for k in a)
