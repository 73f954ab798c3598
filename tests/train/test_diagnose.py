"""`train.diagnose.report` on synthetic train_log.jsonl files with planted problems: each
is found, at the planted steps, and a clean log gives no finding. The logs are
written to disk in the trainer's format and read back through the real reader;
the run's config is a real RunConfig saved as `fit` saves it."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import stores
from demo import DRAFTER_SETTINGS

from train.cli import main
from train.config_loading import load_config
from train.diagnose import report as dg
from train.diagnose.compare import compare
from train.diagnose.lr import lr_schedule
from train.diagnose.plot import plot
from train.fitting.runlog import read_log
from train.fitting.schedule import lr_at
from train.fitting.trainer import Trainer

STEPS = 20_000
LR = 6e-4


def planted_lr(step: int, warmup: int, total: int = STEPS, lr: float = LR) -> float:
    """Linear warmup then cosine to 0, written out independently of the module."""
    if step < warmup:
        return lr * step / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def synthetic_log(
    path, *, plateau_at=None, cliff_at=None, cliff_len=270, lr_warmup=800, bimodal_share=0.0, epoch_jump_at=None, seed=0
):
    """A 20K-step run: per-step loss/acc/lr/epoch (5000 steps per epoch) and a
    held-out acceptance evaluation (`AcceptanceEval`'s keys) every 100 steps on
    its own line."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, STEPS + 1)
    if plateau_at:
        clean = 0.05 + 0.25 * np.minimum(steps, plateau_at) / plateau_at
    else:
        clean = 0.05 + 0.35 * (1 - np.exp(-steps / 20_000))
    acc = clean + rng.normal(0, 0.02, STEPS)
    if cliff_at:
        acc[cliff_at - 1 : cliff_at - 1 + cliff_len] = 0.005 + rng.normal(0, 0.002, cliff_len)
    loss = (3.5 - 6 * (clean - 0.05)) * np.exp(rng.normal(0, 0.05, STEPS))
    high = np.zeros(STEPS, bool)
    if bimodal_share:
        high = rng.random(STEPS) < bimodal_share
        loss[high] *= 2.5
    if epoch_jump_at:
        loss[steps >= epoch_jump_at] *= 1.12
    lines = []
    for i, step in enumerate(steps):
        record = {
            "step": int(step),
            "epoch": step / 5000,
            "lr": planted_lr(int(step), lr_warmup),
            "loss": float(loss[i]),
            "acc": float(acc[i]),
            "top4_acc": float(min(acc[i] + 0.2, 1.0)),
            "top8_acc": float(min(acc[i] + 0.3, 1.0)),
            "tau_per_position": float(1 + 6 * max(acc[i], 0)),
        }
        lines.append(json.dumps(record))
        if step % 100 == 0:
            tau = 1 + 8 * clean[i] + rng.normal(0, 0.02)
            lines.append(
                json.dumps(
                    {
                        "step": int(step),
                        "eval_tau": tau,
                        "eval_tau_per_position": tau + 1.5,
                        "eval_ddtree_8": tau + 0.5,
                        "eval_ddtree_32": tau + 0.9,
                    }
                )
            )
    path.mkdir(parents=True, exist_ok=True)
    (path / "train_log.jsonl").write_text("\n".join(lines) + "\n")
    return path, steps[high]


SCHEDULE = [f"optim.lr={LR}", "optim.warmup_fraction=0.04", f"train.max_steps={STEPS}", "optim.schedule=cosine"]


def write_config(run, *sets):
    """RUN/config.yaml as `fit` saves it: the planted schedule (warmup 800 steps), then `sets`."""
    load_config(None, SCHEDULE + list(sets), store="store", target="target", out=str(run)).save(run)


def kinds(diagnosis):
    return sorted({f.kind for f in diagnosis.findings})


def test_clean_log_reports_nothing(tmp_path):
    run, _ = synthetic_log(tmp_path / "clean")
    write_config(run)
    result = dg.diagnose(run)
    assert result.findings == [], result.render()
    assert result.plateau["verdict"] == "improving"
    assert result.plateau["metric"] == "eval_ddtree_8"  # held-out DDTree drives the verdict
    assert result.lr["checked"] and result.lr["peak_step"] == 800
    assert [e["step"] for e in result.epochs] == [5000, 10000, 15000]
    assert result.render().splitlines()[2].startswith("VERDICT: No problems found")


def test_planted_plateau_is_found_with_its_start(tmp_path):
    run, _ = synthetic_log(tmp_path / "plateau", plateau_at=8000)
    write_config(run)
    result = dg.diagnose(run)
    assert kinds(result) == ["plateau"], result.render()
    assert abs(result.plateau["since_step"] - 8000) <= 300
    finding = result.findings[0]
    assert abs(finding.steps[0] - 8000) <= 300
    # Windows before the plateau gain, the ones after it do not.
    windows = result.improvement["eval_ddtree_8"]
    assert all(w["gain_per_1k"] > 0.2 for w in windows if w["end"] <= 8000)  # 8 x 0.25 / 8K steps
    assert all(abs(w["gain_per_1k"]) < 0.03 for w in windows if w["start"] >= 8000)
    assert result.render().splitlines()[2].startswith("VERDICT: 1 problem(s) found (plateau)")


def test_planted_cliff_is_found_at_its_step_with_recovery(tmp_path):
    run, _ = synthetic_log(tmp_path / "cliff", cliff_at=6000, cliff_len=270)
    write_config(run)
    result = dg.diagnose(run)
    assert kinds(result) == ["cliff"], result.render()
    (cliff,) = result.cliffs
    assert abs(cliff["step"] - 6000) <= 3
    assert abs(cliff["recovered_step"] - 6270) <= 5
    assert cliff["before"] > 0.12 and cliff["lowest"] < 0.02  # clean acc at step 6000 is 0.14


def test_wrong_warmup_is_found_against_the_run_config(tmp_path):
    run, _ = synthetic_log(tmp_path / "warmup", lr_warmup=400)  # the config says 4 % of 20K = 800
    write_config(run)
    result = dg.diagnose(run)
    assert kinds(result) == ["lr_schedule"], result.render()
    assert result.lr["peak_step"] == 400
    assert {400, 800} <= set(result.findings[0].steps)
    assert "peaks at step 400" in result.findings[0].message


def test_lr_is_checked_with_the_trainers_schedule(tmp_path):
    run, _ = synthetic_log(tmp_path / "schedule")
    records = read_log(run)  # read once; each diagnose below still reads the run's config.yaml
    write_config(run)
    schedule = dg.read_run_config(run)
    expected = lr_schedule(schedule, records)
    # The log line of step S carries the LR of optimizer step S - 1: the trainer's own function.
    assert [expected.expected(s) for s in (1, 800, 9000)] == [
        lr_at(s - 1, STEPS, schedule.optim) for s in (1, 800, 9000)
    ]
    assert dg.diagnose(run, records=records).findings == []
    # No max_steps: epochs x steps per epoch, estimated from the log's fractional epoch (5000 steps).
    write_config(run, "train.max_steps=null", "train.epochs=4")
    result = dg.diagnose(run, records=records)
    assert result.lr["config"]["total_steps"] == STEPS and result.lr["config"]["estimated"] == ["total_steps"]
    assert result.findings == [], result.render()
    write_config(run, "optim.warmup_fraction=0.08")
    assert kinds(dg.diagnose(run, records=records)) == ["lr_schedule"]
    write_config(run, "optim.schedule=constant")
    assert kinds(dg.diagnose(run, records=records)) == ["lr_schedule"]
    # A config the project's loader refuses is reported, not guessed at.
    (run / "config.yaml").write_text("optim:\n  learning_rate: 0.1\n")
    result = dg.diagnose(run, records=records)
    assert not result.lr["checked"] and any("unknown key 'learning_rate'" in n for n in result.notes)


def test_bimodal_loss_is_flagged_with_high_loss_steps(tmp_path):
    run, planted = synthetic_log(tmp_path / "bimodal", bimodal_share=0.1)
    write_config(run)
    result = dg.diagnose(run)
    assert kinds(result) == ["bimodal_loss"], result.render()
    assert result.loss["bimodal"]
    assert 0.07 < result.loss["share_above_2x_running_median"] < 0.13
    assert set(result.findings[0].steps) <= set(int(s) for s in planted)


def test_epoch_boundary_jump_is_found_at_that_boundary_only(tmp_path):
    run, _ = synthetic_log(tmp_path / "epoch", epoch_jump_at=10_000)
    write_config(run)
    result = dg.diagnose(run)
    assert kinds(result) == ["epoch_jump"], result.render()
    assert result.findings[0].steps == [10_000]
    jumps = {e["step"]: e["delta"] for e in result.epochs}
    assert jumps[10_000] > 0.15 and abs(jumps[5000]) < 0.1  # net of the trend: noisier than a raw difference


def test_all_problems_at_once_and_json(tmp_path):
    run, _ = synthetic_log(
        tmp_path / "all", plateau_at=8000, cliff_at=12_000, lr_warmup=400, bimodal_share=0.1, epoch_jump_at=15_000
    )
    write_config(run)
    result = dg.diagnose(run)
    assert kinds(result) == ["bimodal_loss", "cliff", "epoch_jump", "lr_schedule", "plateau"], result.render()
    assert abs(result.cliffs[0]["step"] - 12_000) <= 3
    assert [f.steps for f in result.findings if f.kind == "epoch_jump"] == [[15_000]]
    data = json.loads(json.dumps(result.to_dict()))
    assert data["healthy"] is False and len(data["findings"]) == 5


def test_without_config_lr_is_reported_not_judged(tmp_path):
    run, _ = synthetic_log(tmp_path / "noconfig", lr_warmup=400)
    result = dg.diagnose(run)
    assert result.findings == []
    assert result.lr["checked"] is False and result.lr["peak_step"] == 400
    assert "LR not checked" in result.verdict()


def test_torn_last_line_and_merged_steps(tmp_path):
    run, _ = synthetic_log(tmp_path / "torn")
    with (run / "train_log.jsonl").open("a") as f:
        f.write('{"step": 20001, "loss": 1.')
    records = read_log(run)
    assert records[-1]["step"] == STEPS
    assert records[99]["step"] == 100 and "eval_tau" in records[99] and "loss" in records[99]


def test_a_log_from_before_the_rollout_is_read_under_per_position_names(tmp_path):
    """Older logs held per-position estimates under `tau`, `heldout_tau`,
    `eval_tau` and `eval_ddtree_<b>`; read as they are, an old run's numbers would
    pass for decode-time ones."""
    path = tmp_path / "old" / "train_log.jsonl"
    path.parent.mkdir()
    path.write_text(
        json.dumps({"step": 10, "loss": 2.0, "tau": 1.4})
        + "\n"
        + json.dumps({"step": 10, "eval_tau": 1.9, "eval_ddtree_8": 2.2, "heldout_tau": 1.5})
        + "\n"
        + json.dumps({"step": 20, "eval_tau": 1.7, "eval_tau_per_position": 2.1, "eval_ddtree_8": 2.0})
        + "\n"
    )
    old, new = read_log(path.parent)
    assert old == {
        "step": 10,
        "loss": 2.0,
        "tau_per_position": 1.4,
        "eval_tau_per_position": 1.9,
        "eval_ddtree_per_position_8": 2.2,
        "heldout_tau_per_position": 1.5,
    }
    assert new == {"step": 20, "eval_tau": 1.7, "eval_tau_per_position": 2.1, "eval_ddtree_8": 2.0}


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_and_overlays_a_second_run(tmp_path):
    run_a, _ = synthetic_log(tmp_path / "a")
    run_b, _ = synthetic_log(tmp_path / "b", plateau_at=8000, seed=1)
    single = plot([run_a], tmp_path / "one.png")
    both = plot([run_a, run_b], tmp_path / "two.png")
    assert _png_size(single) == (1100, 1400)
    assert _png_size(both) == (1100, 1400)
    assert single.stat().st_size > 20_000
    assert both.read_bytes() != single.read_bytes()


def test_compare_aligns_runs_by_step(tmp_path):
    run_a, _ = synthetic_log(tmp_path / "a")
    run_b, _ = synthetic_log(tmp_path / "b", plateau_at=8000, seed=1)
    table = compare(read_log(run_a), read_log(run_b), points=4)
    assert table["steps"] == [5001, 10000, 15000, 20000]
    a, b = table["eval_ddtree_8"]["a"], table["eval_ddtree_8"]["b"]
    assert b[-1] == pytest.approx(b[-2], abs=0.05)  # the plateaued run is flat at the end
    assert a[-1] > a[-2] + 0.1


def test_diagnose_cli_json_plot_compare_and_exit_codes(tmp_path, capsys):
    def diagnose_cli(argv):
        return main(["diagnose", *argv])

    clean, _ = synthetic_log(tmp_path / "clean")
    write_config(clean)
    flat, _ = synthetic_log(tmp_path / "flat", plateau_at=8000, seed=1)
    write_config(flat)
    assert diagnose_cli([str(clean)]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("VERDICT: No problems found")
    png = tmp_path / "cmp.png"
    assert diagnose_cli([str(flat), "--compare", str(clean), "--plot", str(png), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["kind"] for f in data["findings"]] == ["plateau"]
    assert data["compare"]["diagnosis"]["healthy"] is True
    assert data["compare"]["at_steps"]["steps"][-1] == STEPS
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert diagnose_cli([str(tmp_path / "missing")]) == 2
    assert diagnose_cli([str(clean), "--config", str(tmp_path / "missing.yaml")]) == 2
    # --config: a run.yaml as `fit --config` takes it (no paths), checked against the same log.
    (tmp_path / "run.yaml").write_text("optim:\n  lr: 6.0e-4\n  warmup_fraction: 0.08\ntrain:\n  max_steps: 20000\n")
    capsys.readouterr()
    assert diagnose_cli([str(clean), "--config", str(tmp_path / "run.yaml"), "--json"]) == 1
    assert [f["kind"] for f in json.loads(capsys.readouterr().out)["findings"]] == ["lr_schedule"]


def test_gains_fading_at_the_end_of_a_cosine_schedule_are_not_a_plateau(tmp_path):
    """The same flattening is a plateau when it starts while the LR is high, and the
    schedule ending when it starts only once the LR is under 7 % of the peak (cosine
    to 0 over 20K steps: 3.8 % at step 17,500)."""
    run, _ = synthetic_log(tmp_path / "ending", plateau_at=17_500)
    write_config(run)
    result = dg.diagnose(run, window=2500)
    assert result.findings == [] and result.plateau["verdict"] == "schedule ending", result.render()
    assert 0.03 < result.plateau["lr_to_peak"] < 0.07 and result.plateau["since_step"] == 17_500
    assert "the schedule is ending, not a plateau" in result.verdict()
    flat_early, _ = synthetic_log(tmp_path / "early", plateau_at=8000)
    assert kinds(dg.diagnose(flat_early, window=2500)) == ["plateau"]  # there the LR is still high


def test_too_short_or_disjoint_runs_say_there_is_nothing_to_judge(tmp_path, capsys):
    short = tmp_path / "short"
    short.mkdir()
    (short / "train_log.jsonl").write_text(
        "".join(json.dumps({"step": s, "lr": 1e-3, "loss": 5.0 - s / 10, "acc": 0.01 * s}) + "\n" for s in (1, 2, 3))
    )
    verdict = dg.diagnose(short).verdict()
    assert verdict.startswith("Too short to judge improvement (3 records, steps 1-3)") and "no metric" not in verdict
    long, _ = synthetic_log(tmp_path / "long")
    assert main(["diagnose", str(long), "--compare", str(short)]) == 0
    out = capsys.readouterr().out
    assert "VERDICT: Too short to judge improvement" in out and "No problems found: no metric" not in out
    later = tmp_path / "later"
    later.mkdir()
    (later / "train_log.jsonl").write_text(json.dumps({"step": 30_000, "loss": 1.0}) + "\n")
    table = compare(read_log(long), read_log(later))
    assert table["steps"] == [] and "do not overlap" in table["note"]
    from train.diagnose.compare import render_compare

    assert render_compare("A", "B", table).startswith("Nothing to compare between A = A and B = B: the runs' logged")


def test_plot_shows_heldout_loss_markers_on_sparse_series_and_the_verdict(tmp_path):
    from train.diagnose.plot import figure

    run, _ = synthetic_log(tmp_path / "run")
    with (run / "train_log.jsonl").open("a") as log:  # held-out loss, evaluated 4 times
        for step in (5000, 10000, 15000, 20000):
            log.write(json.dumps({"step": step, "heldout_loss": 3.0 - step / 20000}) + "\n")
    drawn = figure([run], verdicts=["No problems found: eval_ddtree_8 improving."])
    loss_panel, _, tau_panel = drawn.axes[:3]
    lines = {line.get_label(): line for line in loss_panel.get_lines()}
    assert "heldout_loss" in lines and lines["heldout_loss"].get_marker() == "o"
    assert lines["loss"].get_marker() in ("None", None, "")  # 20K points: a line
    assert {line.get_label(): line.get_marker() for line in tau_panel.get_lines()}["eval_tau"] == "None"  # 200 points
    assert drawn._suptitle.get_text() == f"{run}: No problems found: eval_ddtree_8 improving."


# -- issue 35.4: right both ways, on the demo's shape -------------------------------------------------------
DEMO_STEPS, DEMO_WARMUP = 1500, 60  # the demo: 1500 steps, a line every 5, an acceptance evaluation every 500


def demo_like_log(path, heldout_tau=(1.89, 2.40, 2.59), loss_noise=0.35, flat_from=None, seed=0):
    """A log shaped like the demo's healthy run (issue 35): one sequence per step (a
    noisy loss), a learning curve that saturates early, cosine LR annealed to 0, and
    eval_tau at steps 500, 1000 and 1500. `flat_from`: the training metrics stop
    improving at that step."""
    rng = np.random.default_rng(seed)
    lines = []
    for step in range(5, DEMO_STEPS + 1, 5):
        progress = 1 - math.exp(-min(step, flat_from or step) / 250)
        acc = 0.6 * progress + rng.normal(0, 0.03)
        lr = planted_lr(step, DEMO_WARMUP, DEMO_STEPS, 3e-3)
        record = {
            "step": step,
            "epoch": step / 570,
            "lr": lr,
            "loss": (6.2 - 3.5 * progress) * math.exp(rng.normal(0, loss_noise)),
            "acc": acc,
            "tau_per_position": 1 + 5 * max(acc, 0),
        }
        if step % 500 == 0:
            record.update(eval_tau=heldout_tau[step // 500 - 1], eval_tau_per_position=heldout_tau[step // 500 - 1] + 1)
        lines.append(json.dumps(record))
    path.mkdir(parents=True, exist_ok=True)
    (path / "train_log.jsonl").write_text("\n".join(lines) + "\n")
    load_config(
        None, ["optim.lr=3e-3", f"train.max_steps={DEMO_STEPS}"], store="store", target="target", out=str(path)
    ).save(path)
    return path


def test_windows_stay_inside_the_run():
    steps = np.arange(5, DEMO_STEPS + 1, 5)
    windows = dg.improvement_windows(steps, steps * 0.001, 200)
    assert windows[-1]["end"] == DEMO_STEPS + 1 and windows[-1]["start"] == 1400  # was 1400-1599
    assert all(w["end"] <= DEMO_STEPS + 1 for w in windows)
    short_tail = dg.improvement_windows(np.arange(5, 1421, 5), np.arange(5, 1421, 5) * 0.001, 200)
    assert [w["start"] for w in short_tail][-1] == 1200 and short_tail[-1]["end"] == 1421  # 1400-1420 merged


def test_the_demos_healthy_run_reports_nothing(tmp_path, capsys):
    """The issue's healthy demo run: the training metrics flatten early, the LR anneals
    to 0, one-sequence steps are noisy, eval_tau still rises 1.89 -> 2.59. It was
    "2 problem(s) (plateau, loss_spikes)", exit 1."""
    run = demo_like_log(tmp_path / "demo")
    result = dg.diagnose(run)
    assert result.findings == [], result.render()
    assert result.plateau["verdict"] in ("held-out improving", "schedule ending"), result.plateau
    assert result.loss["share_above_2x_running_median"] > 0.01  # what was called spikes: the run's own noise
    assert result.learning["learning"] is True
    assert main(["diagnose", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("VERDICT: No problems found: it learns")


def test_a_plateau_while_the_lr_is_high_and_heldout_flat_is_still_called(tmp_path):
    run = demo_like_log(tmp_path / "flat", heldout_tau=(2.40, 2.41, 2.40), loss_noise=0.05, flat_from=300)
    result = dg.diagnose(run)
    assert kinds(result) == ["plateau"], result.render()


def test_rising_heldout_tau_overrules_a_flat_training_metric(tmp_path):
    run = demo_like_log(tmp_path / "rising", heldout_tau=(2.40, 2.60, 2.90), loss_noise=0.05, flat_from=300)
    result = dg.diagnose(run)
    assert result.findings == [] and result.plateau["verdict"] == "held-out improving", result.render()
    assert result.plateau["heldout"]["key"] == "eval_tau" and result.plateau["heldout"]["to"] == 2.90
    assert "eval_tau still rose 2.4 -> 2.9" in result.verdict()


def test_loss_spikes_are_judged_against_the_runs_own_noise(tmp_path):
    run = demo_like_log(tmp_path / "spiky", loss_noise=0.05)
    lines = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    for record in lines[100::40]:  # 5 steps in 300 (1.7 %) at 3x their neighbours, in a quiet run
        record["loss"] *= 3
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = dg.diagnose(run)
    assert kinds(result) == ["loss_spikes"], result.render()
    assert result.findings[0].steps == [r["step"] for r in lines[100::40]]


def test_a_run_that_does_not_learn_is_flagged_on_its_log(tmp_path):
    """Loss stuck near ln 512 and top-1 at 1 %: the issue's unflagged run."""
    run = tmp_path / "stuck"
    run.mkdir()
    rng = np.random.default_rng(0)
    (run / "train_log.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "lr": 3e-3, "loss": 6.2 + rng.normal(0, 0.02), "acc": 0.01 + rng.normal(0, 0.002)})
            + "\n"
            for s in range(5, 1501, 5)
        )
    )
    result = dg.diagnose(run)
    assert "not_learning" in kinds(result), result.render()
    assert result.findings[0].kind == "not_learning" and "it has not moved" in result.findings[0].message
    assert main(["diagnose", str(run)]) == 1


# -- real short runs: the demo's recipe learns clean, a run that cannot learn is flagged ----------------------
REAL_STEPS = 300
REAL_RUN = [
    *DRAFTER_SETTINGS,  # then the tiny target's shape, a held-out share that holds samples of 48
    "model.block_size=8",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.head_dim=16",
    "data.heldout_fraction=0.25",
    f"eval.every={REAL_STEPS // 3}",
    "eval.samples=8",
    "eval.max_blocks_per_sample=32",
    "eval.ddtree_budgets=[8]",
    "train.checkpoint_every=0",
    "train.epochs=100",
]


@pytest.fixture(scope="module")
def chat_store(tmp_path_factory, qwen3_dir, tokenizer):
    """48 chats over 4 distinct functions, as tests/train/test_trainer.py's real store: learnable."""
    return stores.build_real_store(
        tmp_path_factory.mktemp("diagnose") / "store",
        qwen3_dir,
        tokenizer,
        records=stores.repeated_corpus(48, 4),
        samples_per_shard=6,
        max_tokens=128,
    )


def fit_run(store, target, out, *extra):
    config = load_config(
        None, [*REAL_RUN, *extra], store=str(store), target=str(target), out=str(out), **{"train.max_steps": REAL_STEPS}
    )
    Trainer.from_config(config, log=lambda m: None).fit()
    return out


@pytest.mark.slow
def test_a_real_run_with_the_demos_recipe_is_clean(chat_store, qwen3_dir, tmp_path, capsys):
    run = fit_run(chat_store, qwen3_dir, tmp_path / "demo")
    assert main(["diagnose", str(run)]) == 0, capsys.readouterr().out
    report = capsys.readouterr().out
    assert report.splitlines()[2].startswith("VERDICT: No problems found: it learns"), report
    result = dg.diagnose(run)
    assert result.learning["acc_end"] > 0.3, result.learning
    # D-PACE (the default) weighs each slot's CE by its share of the accepted length: its loss
    # is not on ln(vocabulary)'s scale, so that reference is neither printed nor judged (48.10)
    assert result.learning["vocab_size"] is None and "ln(vocabulary" not in report, report


@pytest.mark.slow
def test_a_real_run_at_lr_zero_is_flagged_not_learning(chat_store, qwen3_dir, tmp_path, capsys):
    """The config refuses an LR of exactly 0; 1e-9 moves no weight: the loss stays at
    its start, near ln 512, and top-1 at chance."""
    # decay CE: its untrained loss is near ln V (D-PACE's is on another scale: no reference)
    run = fit_run(chat_store, qwen3_dir, tmp_path / "run", "optim.lr=1e-9", "loss.position_weights=decay")
    assert main(["diagnose", str(run), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["kind"] == "not_learning", data["verdict"]
    assert data["learning"]["acc_end"] < 0.05 and data["learning"]["loss_end"] > 0.9 * math.log(512), data["learning"]


def test_dflash2_selector_metrics_are_diagnosed(tmp_path):
    """Issue 32.4: a DFlash 2 run's recall@K and selector accuracy (train and held out)
    get their improvement per 1K steps in the report, as acc does."""
    records = []
    for step in range(1, 3001):
        selector = 0.2 + 0.3 * step / 3000
        record = {
            "step": step,
            "loss": 3.0 - step / 3000,
            "acc": 0.1 + 0.3 * step / 3000,
            "recall_at_k": 0.5 + 0.3 * step / 3000,
            "selector_acc": selector,
        }
        if step % 100 == 0:
            record.update(heldout_recall_at_k=0.45 + 0.3 * step / 3000, heldout_selector_acc=selector - 0.05)
        records.append(record)
    result = dg.diagnose(tmp_path / "run", records=records, window=1000)
    for key in ("recall_at_k", "selector_acc", "heldout_recall_at_k", "heldout_selector_acc"):
        assert [round(w["gain_per_1k"], 3) for w in result.improvement[key]] == [0.1, 0.1, 0.1], key
    assert "  selector_acc: 0-999: +0.1000" in result.render()
