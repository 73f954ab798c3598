"""`python -m train diagnose RUN --compare RUN2`: two runs' metrics side by side
at common steps."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from train.fitting.runlog import TAU_KEYS, accuracy_key, ddtree_keys, series


def compare(records_a: Sequence[dict], records_b: Sequence[dict], points: int = 5, window: int = 50) -> dict:
    """Both runs' metrics at common steps (mean of the `window` records up to each
    step), for the keys both logged: {"steps": [...], metric: {"a": [...], "b": [...]}}."""
    last = min(records_a[-1]["step"], records_b[-1]["step"])
    first = max(records_a[0]["step"], records_b[0]["step"])
    if last < first:
        return {
            "steps": [],
            "note": f"the runs' logged steps do not overlap (A {records_a[0]['step']}-"
            f"{records_a[-1]['step']}, B {records_b[0]['step']}-{records_b[-1]['step']})",
        }
    checkpoints = [int(round(s)) for s in np.linspace(first, last, points + 1)[1:]] if last > first else [last]
    keys = ["loss", accuracy_key(records_a), "top4_acc", "top8_acc", *TAU_KEYS]
    keys += sorted(set(ddtree_keys(records_a)) & set(ddtree_keys(records_b)))
    out: dict = {"steps": checkpoints}
    for key in dict.fromkeys(k for k in keys if k):
        sa, va = series(records_a, key)
        sb, vb = series(records_b, key)
        if not len(sa) or not len(sb):
            continue

        def at(steps, values, s):
            upto = values[steps <= s][-window:]
            return float(upto.mean()) if len(upto) else None

        row = {"a": [at(sa, va, s) for s in checkpoints], "b": [at(sb, vb, s) for s in checkpoints]}
        if any(a is not None and b is not None for a, b in zip(row["a"], row["b"])):
            out[key] = row
    if len(out) == 1:
        out["note"] = "the runs share no metric logged at or before a common step"
    return out


def render_compare(label_a: str, label_b: str, table: dict) -> str:
    if "note" in table:
        return f"Nothing to compare between A = {label_a} and B = {label_b}: {table['note']}."
    lines = [
        f"Comparison at common steps (mean of the last records up to each step): A = {label_a}, B = {label_b}",
        f"{'metric':<22}" + "".join(f"{s:>16}" for s in table["steps"]),
    ]
    for key, values in table.items():
        if key == "steps":
            continue
        cells = []
        for a, b in zip(values["a"], values["b"]):
            cells.append("-" if a is None or b is None else f"{a:.3f}/{b:.3f}")
        lines.append(f"{key + ' A/B':<22}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)
