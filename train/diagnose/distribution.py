"""The loss's distribution over a run, for `train.diagnose.report`: spikes above its
running median, a second mode (two Gaussians against one, by BIC), and jumps at epoch
boundaries. Each check takes the log's records and returns (details, findings)."""

from __future__ import annotations

import math

import numpy as np

from train.diagnose.checks import Finding
from train.fitting.runlog import series


def _running_median(values: np.ndarray, block: int) -> np.ndarray:
    """Centred running median over `block` records (at most a tenth of the run, so
    that a falling loss is followed rather than cut into steps)."""
    width = max(5, min(block, len(values) // 10)) | 1
    padded = np.pad(values, width // 2, mode="edge")
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, width), axis=1)


def _gaussian_mixture_bic(x: np.ndarray, iterations: int = 200) -> dict:
    """Fit one and two Gaussians to x (EM) and compare by BIC."""
    n = len(x)
    mu, sd = float(x.mean()), float(x.std()) or 1e-9
    loglik1 = float(np.sum(-0.5 * ((x - mu) / sd) ** 2 - math.log(sd) - 0.5 * math.log(2 * math.pi)))
    bic1 = -2 * loglik1 + 2 * math.log(n)
    lo, hi = np.quantile(x, [0.25, 0.75])
    means = np.array([lo, hi], dtype=np.float64)
    sds = np.array([sd, sd], dtype=np.float64)
    weights = np.array([0.5, 0.5])
    floor = max(sd * 1e-3, 1e-9)
    loglik2 = -math.inf
    for _ in range(iterations):
        dens = weights * np.exp(-0.5 * ((x[:, None] - means) / sds) ** 2) / (sds * math.sqrt(2 * math.pi))
        total = dens.sum(1, keepdims=True) + 1e-300
        resp = dens / total
        previous, loglik2 = loglik2, float(np.log(total).sum())
        if abs(loglik2 - previous) < 1e-7 * abs(loglik2):
            break
        mass = resp.sum(0) + 1e-12
        weights = mass / n
        means = (resp * x[:, None]).sum(0) / mass
        sds = np.maximum(np.sqrt((resp * (x[:, None] - means) ** 2).sum(0) / mass), floor)
    bic2 = -2 * loglik2 + 5 * math.log(n)
    separation = abs(means[0] - means[1]) * math.sqrt(2) / math.sqrt(sds[0] ** 2 + sds[1] ** 2)
    order = np.argsort(means)
    return {
        "bic_one": bic1,
        "bic_two": bic2,
        "means": means[order].tolist(),
        "sds": sds[order].tolist(),
        "weights": weights[order].tolist(),
        "separation": float(separation),
    }


SPIKE_SIGMAS = 5.0  # a spike is further above the running median than this many of the run's own noise
BIMODAL_RATIO = 1.5  # the upper loss mode must sit this many times above the lower one to be a second mode


def check_loss_distribution(records, block: int = 200, spike_share: float = 0.01) -> tuple[dict, list[Finding]]:
    """Loss spikes and a second loss mode, both against the loss's running median.
    A spike is above twice the median and `SPIKE_SIGMAS` robust standard deviations
    of the run's own log-ratio to it (one sequence per step is noisy by nature)."""
    steps, loss = series(records, "loss")
    if np.any(loss <= 0):
        return {"note": "non-positive loss values: distribution not checked"}, []
    if len(loss) < 50:
        return {"note": f"too short to judge ({len(loss)} loss values, 50 needed)"}, []
    median = _running_median(loss, block)
    ratio = loss / median
    log_ratio = np.log(ratio)
    noise = 1.4826 * float(np.median(np.abs(log_ratio - np.median(log_ratio))))
    spike_level = max(math.log(2.0), SPIKE_SIGMAS * noise)
    high = log_ratio > spike_level
    share_spikes = float(high.mean())
    info: dict[str, object] = {
        "median": float(np.median(loss)),
        "share_above_2x_running_median": float((ratio > 2.0).mean()),
        "share_above_2x_global_median": float((loss > 2 * np.median(loss)).mean()),
        "block": block,
        "noise_sd": noise,
        "spike_ratio": math.exp(spike_level),
        "share_spikes": share_spikes,
    }
    mixture = _gaussian_mixture_bic(log_ratio)
    bimodal = (
        mixture["bic_one"] - mixture["bic_two"] > 10
        and mixture["separation"] > 2.0
        and min(mixture["weights"]) >= 0.03
        and math.exp(mixture["means"][1] - mixture["means"][0]) >= BIMODAL_RATIO
    )
    info["mixture"], info["bimodal"] = mixture, bool(bimodal)
    findings = []
    if bimodal:
        upper = math.exp(mixture["means"][1])
        findings.append(
            Finding(
                "bimodal_loss",
                f"Bimodal loss: {mixture['weights'][1]:.1%} of steps sit near {upper:.2f}x the running median, "
                f"the rest near {math.exp(mixture['means'][0]):.2f}x ({info['share_above_2x_running_median']:.1%} "
                "of steps above twice the median). Some batches are systematically different: check what they share.",
                [int(s) for s in steps[ratio > 2.0][:10]],
            )
        )
    elif share_spikes > spike_share:
        findings.append(
            Finding(
                "loss_spikes",
                f"Loss spikes: {info['share_spikes']:.1%} of steps are above {info['spike_ratio']:.2f}x the running "
                f"median (twice it, and {SPIKE_SIGMAS:g} of the run's own standard deviations).",
                [int(s) for s in steps[high][:10]],
            )
        )
    return info, findings


def _median_se(values: np.ndarray) -> float:
    """Standard error of a median, from the MAD (robust to a second loss mode)."""
    sigma = 1.4826 * float(np.median(np.abs(values - np.median(values))))
    return 1.2533 * sigma / math.sqrt(len(values))


def check_epochs(records, window: int = 50, rel_threshold: float = 0.05, sigmas: float = 4.0):
    """Median loss over the `window` records before and after each epoch boundary
    (where the integer part of `epoch` increases); medians so that a bimodal loss
    does not hide a jump. The change is net of the loss's own trend, measured over
    the windows next to those two (a falling loss falls across a boundary too); the
    window is at most half an epoch. Flagged when the change is over
    `rel_threshold` of the level and `sigmas` standard errors."""
    epoch_steps, epochs = series(records, "epoch")
    loss_steps, loss = series(records, "loss")
    out: list[dict] = []
    findings: list[Finding] = []
    if not len(epoch_steps) or not len(loss):
        return out, findings
    whole = np.floor(epochs + 1e-9)
    boundaries = [int(epoch_steps[i + 1]) for i in np.nonzero(np.diff(whole) > 0)[0]]
    if len(boundaries) >= 2:
        per_epoch = int(np.median(np.diff([np.searchsorted(loss_steps, b) for b in boundaries])))
        window = max(5, min(window, per_epoch // 2))
    for i, boundary in zip(np.nonzero(np.diff(whole) > 0)[0], boundaries):
        at = int(np.searchsorted(loss_steps, boundary))
        before, after = loss[max(at - window, 0) : at], loss[at : at + window]
        if len(before) < 5 or len(after) < 5:
            continue
        earlier, later = loss[max(at - 2 * window, 0) : max(at - window, 0)], loss[at + window : at + 2 * window]
        level_before, level_after = float(np.median(before)), float(np.median(after))
        trends, trend_se = [], []
        if len(earlier) >= 5:
            trends.append(level_before - float(np.median(earlier)))
            trend_se.append(_median_se(before) ** 2 + _median_se(earlier) ** 2)
        if len(later) >= 5:
            trends.append(float(np.median(later)) - level_after)
            trend_se.append(_median_se(later) ** 2 + _median_se(after) ** 2)
        trend = float(np.mean(trends)) if trends else 0.0
        delta = level_after - level_before - trend
        se = math.sqrt(
            _median_se(before) ** 2 + _median_se(after) ** 2 + (sum(trend_se) / len(trend_se) ** 2 if trend_se else 0.0)
        )
        entry = {
            "epoch": int(whole[i + 1]),
            "step": int(boundary),
            "loss_before": level_before,
            "loss_after": level_after,
            "delta": delta,
            "trend": trend,
        }
        out.append(entry)
        if abs(delta) > rel_threshold * level_before and abs(delta) > sigmas * se:
            findings.append(epoch_jump(entry, float(before.mean())))
    return out, findings


def epoch_jump(entry: dict, mean_before: float) -> Finding:
    """The finding of a loss that jumps at an epoch boundary, with what it suggests."""
    delta = entry["delta"]
    why = (
        "the model does worse on data it has seen: an ordering/distribution shift, or state lost at the boundary"
        if delta > 0
        else "repeated data is easier: the drafter is memorising rather than generalising"
    )
    message = (
        f"Loss {'rises' if delta > 0 else 'drops'} {delta:+.3f} ({delta / mean_before:+.1%}) at the epoch "
        f"{entry['epoch']} boundary (step {entry['step']}): {entry['loss_before']:.3f} -> "
        f"{entry['loss_after']:.3f} (net of the loss's own trend, {entry['trend']:+.3f}); {why}."
    )
    return Finding("epoch_jump", message, [entry["step"]])
