"""`make demo` shortened (issue 12.5): the embedded target regenerates its corpus,
the pipeline extracts and trains, and `speculate` decodes held-out prompts
losslessly with a drafter that really drafts (decode tau clearly above 1). A rerun
finds the finished run and completes (issue 16.2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--records", "150", "--pretrain-steps", "150", "--train-steps", "150", "--prompts", "4",
         "--max-new-tokens", "48"]


def _demo(out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "scripts/demo.py", "--out", str(out), *SHORT], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_shortened_demo_drafts_losslessly(tmp_path):
    summary = _demo(tmp_path / "demo")
    assert summary["lossless"] is True
    assert summary["decode_tau"] >= 1.3, summary  # a drafter that guesses nothing scores exactly 1.0
    assert summary["offline_tau"] > 1.0 and summary["samples"] > 0 and summary["store_disk_bytes"] > 0



def test_demo_resumes_only_from_a_checkpoint(tmp_path):
    """Issue 16.2: a first demo stopped (Ctrl-C) after `fit` wrote config.yaml but before
    its first checkpoint used to make every later demo fail with `--resume: no
    checkpoint`; it now starts that run afresh, and resumes one that has a checkpoint."""
    sys.path.insert(0, str(REPO / "scripts"))
    from demo import fit_args

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    (run / "train_log.jsonl").write_text("")
    assert fit_args(run) == [] and not run.exists()
    assert fit_args(run) == []  # no run at all
    state = run / "checkpoints" / "step-00000200"
    state.mkdir(parents=True)
    (state / "state.json").write_text("{}")
    assert fit_args(run) == ["--resume"] and state.exists()
