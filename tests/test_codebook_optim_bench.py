"""`benchmarks/codebook_optim_bench.py --quick` runs (every benchmark has a smoke
mode the suite runs), and SparseAdam's state is as dense as AdamW's, which the
selector loss's recommendation rests on."""

from __future__ import annotations

import json

from benchmarks.codebook_optim_bench import main, measure


def test_quick_run_and_state_sizes(capsys):
    assert main(["--quick"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["quick_loss_rows"] == 4 * 15 and summary["adamw_fused_state_bytes"] == 2 * 512 * 8 * 4
    dense = measure("adamw_fused", 64, 4, 8, 2, steps=1)
    sparse = measure("sparse_adam", 64, 4, 8, 2, steps=1)
    assert dense["state_bytes"] == sparse["state_bytes"] == 2 * 64 * 4 * 4
    assert 0 < sparse["distinct_rows"] <= sparse["ids_per_step"] == 24
