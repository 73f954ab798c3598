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

import pytest

REPO = Path(__file__).resolve().parents[1]
# ~2 minutes on 2 idle cores (the stages' own timings are in the summary's `stage_s`):
# a hidden-128 target pretrained on batches of 4 (its replies are repetitive: easy to
# draft), 120 records of 32 new tokens, 200 drafter steps.
SMALL_TARGET = ["--target-set", "hidden_size=128", "--target-set", "num_heads=4", "--target-set", "pretrain_batch=4"]
SHORT = ["--records", "120", "--pretrain-steps", "150", *SMALL_TARGET, "--train-steps", "200", "--prompts", "3",
         "--max-new-tokens", "32"]


def _demo(out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "scripts/demo.py", "--out", str(out), *SHORT], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # child processes
def test_shortened_demo_drafts_losslessly(tmp_path):
    summary = _demo(tmp_path / "demo")
    assert summary["lossless"] is True
    assert summary["decode_tau"] >= 1.3, summary  # a drafter that guesses nothing scores exactly 1.0
    assert summary["offline_tau"] > 1.0 and summary["samples"] > 0 and summary["store_disk_bytes"] > 0
    assert set(summary["stage_s"]) == {"target", "regenerate", "extract", "verify", "fit", "export", "eval",
                                       "speculate", "diagnose", "serve"}
    # CI builds the vLLM environment (`make test` -> `make vllm-env`): the demo serves its drafter.
    assert summary["served_lossless"] is True, summary.get("served_note") or summary


def test_target_settings_name_the_bad_override():
    sys.path.insert(0, str(REPO / "scripts"))
    import embedded

    assert embedded.target_settings(["hidden_size=128", "lr=0.01"]) == {"hidden_size": 128, "lr": 0.01}
    with pytest.raises(ValueError, match="'width=3'.*hidden_size"):
        embedded.target_settings(["width=3"])
    with pytest.raises(ValueError, match="'num_layers=six'.*int"):
        embedded.target_settings(["num_layers=six"])


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
