"""A run's `train_log.jsonl`: written by the trainer, read by `diagnose`.

One JSON object per line, each with `step` (optimizer steps done). The trainer
writes one line per logged step (loss, acc, top4_acc, top8_acc, per_position_acc,
tau_per_position, lr, grad_norm, epoch, tokens_per_s, sequences_per_s,
loader_wait_frac, world_size; the sums behind the means are over every rank of a
data-parallel run) and the
evaluators' keys (`heldout_*` from the trainer's held-out pass, `eval_*` from the
acceptance evaluation: eval_tau (decode-time rollout), eval_tau_per_position,
eval_ddtree_<budget>, ...), sometimes on a line of their own for the same step.
Readers merge lines that share a step.

`tau` alone means the decode-time rollout. Logs written before that held
per-position estimates under `tau`, `heldout_tau`, `eval_tau` and
`eval_ddtree_<budget>`; `read_log` renames those (`_LEGACY_KEYS`) so an old run
is never read as if it had been rolled out."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Sequence

import numpy as np

LOG_FILE = "train_log.jsonl"
SAMPLES_DIR = "samples"  # log.samples=true: RUN/samples/rank-<r>.jsonl, one line per trained sample
_DDTREE_KEY = re.compile(r"^(?:(heldout|eval)_)?ddtree\D*?(\d+)$")
# The tau keys, headline first: decode-time rollout, then the per-position estimates.
TAU_KEYS = ("eval_tau", "eval_tau_per_position", "heldout_tau_per_position", "tau_per_position")
_LEGACY_KEYS = {"tau": "tau_per_position", "heldout_tau": "heldout_tau_per_position"}


# -- writing -------------------------------------------------------------------------------
def append_log(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def samples_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"rank-{rank}.jsonl"


def truncate_log(path: Path, step: int) -> None:
    """On resume, drop lines logged after the checkpoint (they will be redone)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))


# -- reading -------------------------------------------------------------------------------
def log_path(run) -> Path:
    """`run` is a run directory (holding train_log.jsonl) or the log file itself."""
    path = Path(run)
    if path.is_dir():
        path = path / LOG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    return path


class Log(list):
    """Records of one run (a list) that remembers the series already extracted."""

    def __init__(self, records=()):
        super().__init__(records)
        self.cache: dict = {}


def read_log(run) -> Log:
    """Records of a train_log.jsonl, merged by step and sorted by step. Blank and
    unreadable lines are skipped (a crash can leave a torn last line)."""
    by_step: dict[int, dict] = {}
    for line in log_path(run).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            continue
        step = int(record["step"])
        by_step.setdefault(step, {}).update(_upgrade(record))
        by_step[step]["step"] = step
    return Log(by_step[s] for s in sorted(by_step))


def _upgrade(record: dict) -> dict:
    """A log line with per-position estimates under the old names renamed: the
    training / held-out `tau` keys, and an acceptance evaluation written before
    it rolled out (an `eval_tau` without `eval_tau_per_position`)."""
    old_eval = "eval_tau" in record and "eval_tau_per_position" not in record

    def name(key: str) -> str:
        if old_eval and key == "eval_tau":
            return "eval_tau_per_position"
        if old_eval and key.startswith("eval_ddtree"):
            return key.replace("eval_ddtree", "eval_ddtree_per_position", 1)
        return _LEGACY_KEYS.get(key, key)

    return {name(key): value for key, value in record.items()}


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a scalar key, skipping records without a finite value."""
    cache = getattr(records, "cache", None)
    if cache is not None and key in cache:
        return cache[key]
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(record["step"])
        values.append(float(value))
    out = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if cache is not None:
        cache[key] = out
    return out


def ddtree_keys(records: Sequence[dict]) -> dict[str, tuple[str, int]]:
    """{key: (prefix, budget)} of the DDTree acceptance keys present in the log."""
    found = {}
    for record in records:
        for key in record:
            match = _DDTREE_KEY.match(key)
            if match and key not in found:
                found[key] = (match.group(1) or "", int(match.group(2)))
    return found


def ddtree_keys_by_budget(records: Sequence[dict]) -> list[str]:
    """The DDTree keys, ordered by budget, then prefix."""
    keys = ddtree_keys(records)
    return sorted(keys, key=lambda k: keys[k][::-1])


def accuracy_key(records: Sequence[dict]) -> str | None:
    """The training accuracy key ("acc", top-1 over scored slots) if the log has it."""
    return "acc" if len(series(records, "acc")[0]) else None
