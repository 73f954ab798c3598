"""Issue 26, the training side: `fit`, `eval`, `speculate` refuse a target that is not
the store's; nothing is cut short without a word (--max-steps against train.epochs,
an incomplete store, an empty held-out split, lanes beyond the shards); a damaged
store is refused before step 1 and a shard damaged mid-run leaves a checkpoint and
a resume command that works; config mistakes say "did you mean"; usage errors exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import builders
import pytest
import tiny
import torch

from store_schema.fingerprint import target_identity
from train.cli import main
from train.config_error import ConfigError
from train.config_loading import load_config
from train.fitting.interrupts import DataStopped
from train.fitting.preflight import DamagedStoreError, FitChecks
from train.fitting.schedule import lr_at
from train.fitting.trainer import Trainer
from train.target_check import OtherTargetError

TINY = tiny.drafter_sets(
    "train.grad_accumulation=1",
    "eval.every=0",
    "data.heldout_fraction=0.0",
    "data.buffer_shards=1",
    "train.checkpoint_every=0",
    heads=True,
)
SHAPE = dict(num_target_layers=6, hidden_size=64, vocab_size=512)  # the tiny Qwen3 target (qwen3_dir)


def sets(*extra: str) -> list[str]:
    return tiny.cli_sets((*TINY, *extra))


def config_for(store, target, out, *extra, max_steps=None):
    return load_config(
        None, [*TINY, *extra], store=str(store), target=str(target), out=str(out), **{"train.max_steps": max_steps}
    )


def corrupt(store: Path, shard: str) -> None:
    chunk = store / "shards" / shard / "layer_3" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x04
    chunk.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def store(tmp_path_factory, qwen3_dir) -> Path:
    """3 shards x 4 random samples, fingerprinted with the tiny target's identity."""
    path = tmp_path_factory.mktemp("trust") / "store"
    builders.random_store(path, num_shards=3, samples_per_shard=4, target_dir=qwen3_dir, **SHAPE)
    return path


@pytest.fixture(scope="module")
def reinitialised(tmp_path_factory, qwen3_dir, tokenizer_dir) -> Path:
    """The target's config and tokenizer, every weight drawn afresh."""
    path = tmp_path_factory.mktemp("other-weights")
    builders.build_model(path, kind="qwen3", vocab_size=512, seed=7)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    shutil.copy(qwen3_dir / "config.json", path / "config.json")
    return path


# -- 1: the target is the store's ------------------------------------------------------------------
def test_a_copy_of_the_target_with_random_weights_is_refused(store, qwen3_dir, reinitialised, tmp_path, capsys):
    mine, other = target_identity(qwen3_dir), target_identity(reinitialised)
    # Same shapes, same headers: only the sampled weight bytes tell them apart.
    assert mine["target_weights_index_sha256"] == other["target_weights_index_sha256"]
    assert mine["target_config_sha256"] == other["target_config_sha256"]
    with pytest.raises(OtherTargetError, match="target_weights_sample_sha256: store has") as refused:
        Trainer.from_config(config_for(store, reinitialised, tmp_path / "run", max_steps=1))
    assert set(refused.value.differences) == {"target_weights_sample_sha256"}
    assert not (tmp_path / "run").exists()
    for command in (
        ["fit", "--store", str(store), "--out", str(tmp_path / "cli"), "--max-steps", "1"],
        ["eval", "--store", str(store), "--drafter", str(tmp_path / "none")],
    ):
        assert main([*command, "--target", str(reinitialised)]) == 1
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert (
            error.startswith(f"error: --target {reinitialised} is not the checkpoint")
            and "--allow-other-target" in error
        )

    messages = []
    trainer = Trainer.from_config(
        config_for(store, reinitialised, tmp_path / "allowed", max_steps=1),
        log=messages.append,
        checks=FitChecks(allow_other_target=True),
    )
    assert any(m.startswith("warning:") and "target_weights_sample_sha256" in m for m in messages)
    assert list(trainer.run_info["other_target"]) == ["target_weights_sample_sha256"]  # recorded in checkpoints


def test_another_config_of_the_same_sizes_is_refused(store, qwen3_dir, tmp_path):
    other = tmp_path / "target"
    shutil.copytree(qwen3_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(OtherTargetError) as refused:
        Trainer.from_config(config_for(store, other, tmp_path / "run", max_steps=1))
    assert "target_config_sha256" in refused.value.differences
    # Issue 62.8: the field that differs, not two hashes (the store records its target's config.json).
    assert f"config.json fields (store's target -> {other}): rms_norm_eps: 1e-06 -> 1e-05" in str(refused.value)


def test_one_top_k_rule_names_every_setting_that_reads_it(store, qwen3_dir, tmp_path):
    """Issue 61.2: the top-k rule is written once (train.compatibility.check_topk) and its
    message names the settings that read the target's top-k and how to extract it."""
    from train.evaluation.config import EvalConfig
    from train.evaluation.evaluate import evaluate
    from train.families.dflash.build import build_drafter
    from train.fitting.preflight import topk_readers
    from train.target_head import load_target_head

    sets = ("loss.labels=target", "loss.position_weights=decay", "eval.labels=target")
    config = config_for(store, qwen3_dir, tmp_path / "run", *sets, max_steps=1)
    assert topk_readers(config) == ["loss.labels=target", "eval.labels=target"]
    with pytest.raises(ConfigError, match="config loss.labels=target / eval.labels=target need the target's top-k"):
        Trainer.from_config(config)
    trainer_config = config_for(store, qwen3_dir, tmp_path / "ok", max_steps=1)
    drafter = build_drafter(Trainer.from_config(trainer_config).drafter.config)
    with pytest.raises(ConfigError, match=r"config eval.labels=target need .* \(extract with --target-topk K\)"):
        evaluate(drafter, load_target_head(qwen3_dir), str(store), EvalConfig(labels="target"))


# -- 4: nothing cut short ---------------------------------------------------------------------------
def test_max_steps_wins_over_epochs_and_the_schedule_is_built_for_them(store, qwen3_dir, tmp_path):
    messages = []
    config = config_for(store, qwen3_dir, tmp_path / "run", "train.epochs=1", "train.log_every=1", max_steps=30)
    trainer = Trainer.from_config(config, log=messages.append)  # 12 samples an epoch, one a step
    last = trainer.fit()
    assert trainer.step == last["step"] == 30
    assert any("--max-steps 30 (train.max_steps) overrides train.epochs=1: 3 epoch(s)" in m for m in messages), messages
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([lr_at(s, 30, config.optim) for s in range(30)])
    assert not any("ran out" in m for m in messages)


def test_an_incomplete_store_is_named_and_refused_when_required(store, qwen3_dir, tmp_path):
    partial = tmp_path / "store"
    shutil.copytree(store, partial)
    (partial / "shards" / "shard-000002" / "commit.json").unlink()
    (partial / "commits" / "shard-000002.json").unlink()  # never committed (journaled: gone, damage)
    messages = []
    Trainer.from_config(config_for(partial, qwen3_dir, tmp_path / "run", max_steps=1), log=messages.append)
    assert any(
        "2 of 3 planned shards committed (8 of 12 samples)" in m and "--require-complete" in m for m in messages
    ), messages
    with pytest.raises(ValueError, match="2 of 3 planned shards committed"):
        Trainer.from_config(
            config_for(partial, qwen3_dir, tmp_path / "strict", max_steps=1), checks=FitChecks(require_complete=True)
        )


def test_an_empty_heldout_split_is_named_at_the_start(store, qwen3_dir, tmp_path):
    messages = []
    Trainer.from_config(
        config_for(store, qwen3_dir, tmp_path / "run", "data.heldout_fraction=0.01", "eval.every=5", max_steps=1),
        log=messages.append,
    )
    assert any(m.startswith("warning: data.heldout_fraction=0.01 holds out 0 of 12 samples") for m in messages), (
        messages
    )


def test_more_processes_than_shards_is_one_line_naming_shard_tokens(store, qwen3_dir, tmp_path, capsys):
    assert (
        main(
            [
                "fit",
                "--store",
                str(store),
                "--target",
                str(qwen3_dir),
                "--out",
                str(tmp_path / "run"),
                "--nproc",
                "4",
                *sets(),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 3" in err and "--shard-tokens" in err, err
    assert not (tmp_path / "run").exists()  # no process was started


def test_block_size_has_one_owner_the_stores_plan(qwen3_dir, tmp_path):
    builders.random_store(
        tmp_path / "store", num_shards=1, samples_per_shard=2, plan_settings={"block_size": 4}, **SHAPE
    )
    with pytest.raises(ConfigError, match="model.block_size: 8, but .* was planned for block size 4"):
        Trainer.from_config(config_for(tmp_path / "store", qwen3_dir, tmp_path / "run", max_steps=1))


def test_an_epoch_counts_only_the_planned_samples_the_family_trains_on(qwen3_dir, tmp_path):
    """A store planned for every family keeps short replies; a DFlash epoch is sized
    without those that hold no whole block, so its data never runs out early."""
    builders.random_store(tmp_path / "store", num_shards=2, samples_per_shard=4, short_replies=1, **SHAPE)
    messages = []
    trainer = Trainer.from_config(
        config_for(tmp_path / "store", qwen3_dir, tmp_path / "run", "train.epochs=1"), log=messages.append
    )
    trainer.fit()
    assert trainer.total_steps == trainer.step == 6  # 2 shards x 3 samples with an anchor
    assert trainer.feed.skipped_empty == 2 and not any("ran out" in m for m in messages), messages


# -- 2: damaged stores ------------------------------------------------------------------------------
def test_a_damaged_store_is_refused_before_step_1_naming_the_repair(store, qwen3_dir, tmp_path):
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    corrupt(damaged, "shard-000001")
    with pytest.raises(
        DamagedStoreError,
        match=r"shard shard-000001: layer_3/c/0/0: .*1 damaged shard\(s\) of 3: "
        rf"shard-000001; repair with `python -m store_schema verify {damaged} "
        "--repair`",
    ):
        Trainer.from_config(config_for(damaged, qwen3_dir, tmp_path / "run", max_steps=1))
    messages = []
    trainer = Trainer.from_config(
        config_for(damaged, qwen3_dir, tmp_path / "skip", "data.skip_corrupt_shards=true", "train.epochs=3"),
        log=messages.append,
    )
    trainer.fit()
    assert trainer.step == 24  # 2 good shards x 4 samples x 3 epochs
    # Named once before step 1 (never read), once in the closing summary; the schedule knew.
    assert sum("shard-000001" in m for m in messages) == 2, messages
    assert any(
        m.startswith("fit: 1 damaged shard(s) left out (data.skip_corrupt_shards): shard-000001") for m in messages[:3]
    )
    assert not any("ran out" in m for m in messages)


def test_a_shard_corrupt_mid_run_leaves_a_checkpoint_and_a_resume_command_that_works(
    store, qwen3_dir, tmp_path, capsys
):
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    order = Trainer.from_config(config_for(damaged, qwen3_dir, tmp_path / "probe", max_steps=1)).loader.epoch_order(0)
    corrupt(damaged, order[2])  # read third: two shards (8 steps) train first
    out = tmp_path / "run"
    capsys.readouterr()
    assert (
        main(
            [
                "fit",
                "--store",
                str(damaged),
                "--target",
                str(qwen3_dir),
                "--out",
                str(out),
                "--skip-verify",
                *sets("train.epochs=2"),
            ]
        )
        == 1
    )  # damage the check did not see
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: shard {order[2]}: layer_3/c/0/0: crc32c"), line
    assert f"checkpoint of step 8 saved in {out / 'checkpoints'}" in line and "--repair" in line, line
    assert f"then resume with `python -m train fit --out {out} --resume`" in line, line
    resume = line.split("resume leaving the shard out: `")[1].rstrip("`").split()
    assert resume[:4] == ["python", "-m", "train", "fit"] and "--resume" in resume
    assert main(resume[3:]) == 0
    captured = capsys.readouterr()
    assert "resumed from" in captured.err and f"skipping corrupt shard {order[2]}" not in captured.err
    assert captured.err.count(order[2]) == 2, captured.err  # the integrity pass, then the closing summary
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 16  # 8 + the 8 good samples of epoch 2


def test_the_start_reads_no_shard_but_a_sample_and_a_byte_changed_after_it_is_caught_before_its_step(
    store, qwen3_dir, tmp_path
):
    """Issue 47.2: the start re-reads `data.verify_sampled_shards` in full and reads
    nothing else per shard; a byte changed after the start, or a file truncated in a
    shard the sample missed, is still caught by the loader before its step."""
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    order = Trainer.from_config(config_for(damaged, qwen3_dir, tmp_path / "probe", max_steps=1)).loader.epoch_order(0)
    messages = []
    trainer = Trainer.from_config(
        config_for(damaged, qwen3_dir, tmp_path / "run", "train.epochs=2", "data.verify_sampled_shards=1"),
        log=messages.append,
    )
    assert any(
        m.startswith("fit: start check: 3 committed shard(s) against the commit journal, 1 re-read") for m in messages
    ), messages
    corrupt(damaged, order[2])  # after the start: only the loader can see it
    with pytest.raises(DataStopped) as stopped:
        trainer.fit()
    assert stopped.value.step == 8 and stopped.value.error.shard == order[2]  # two good shards trained first

    sampled_out = "data.verify_sampled_shards=0"  # a changed byte keeps its size: only a re-read finds it
    Trainer.from_config(config_for(damaged, qwen3_dir, tmp_path / "sizes", sampled_out, max_steps=1))
    with pytest.raises(DamagedStoreError, match=rf"shard {order[2]}: layer_3/c/0/0: crc32c"):
        Trainer.from_config(
            config_for(damaged, qwen3_dir, tmp_path / "first", sampled_out, max_steps=1),
            checks=FitChecks(verify_first=True),
        )
    chunk = damaged / "shards" / order[0] / "layer_1" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-1])
    truncated = Trainer.from_config(config_for(damaged, qwen3_dir, tmp_path / "truncated", sampled_out, max_steps=1))
    with pytest.raises(DataStopped) as stopped:
        truncated.fit()
    assert stopped.value.step == 0 and stopped.value.error.shard == order[0]
    assert stopped.value.error.file == "layer_1/c/0/0", stopped.value.error


def test_a_committed_shard_that_is_gone_is_refused_before_step_1_as_damage(store, qwen3_dir, tmp_path):
    """Issue 47.4 at fit's start: the commit journal records the shard, its directory
    is gone: damage naming it and the repair command, not an incomplete store."""
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    shutil.rmtree(damaged / "shards" / "shard-000002")
    with pytest.raises(DamagedStoreError, match=r"shard shard-000002: commits/shard-000002.json: committed shard gone"):
        Trainer.from_config(config_for(damaged, qwen3_dir, tmp_path / "run", max_steps=1))
    messages = []
    Trainer.from_config(
        config_for(damaged, qwen3_dir, tmp_path / "skip", "data.skip_corrupt_shards=true", max_steps=1),
        log=messages.append,
    )
    assert any(
        m.startswith("fit: 1 damaged shard(s) left out (data.skip_corrupt_shards): shard-000002") for m in messages
    )


def test_a_global_batch_the_processes_cannot_share_is_refused_once_before_they_start(
    store, qwen3_dir, tmp_path, capsys
):
    """Issue 48.10: refused by the launching command, in one line, no process started."""
    out = tmp_path / "run"
    assert (
        main(
            [
                "fit",
                "--store",
                str(store),
                "--target",
                str(qwen3_dir),
                "--out",
                str(out),
                "--nproc",
                "2",
                *sets("train.batch_size=1", "train.grad_accumulation=1"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: train fit on 2 processes: the global batch (train.batch_size x train.grad_accumulation = "
        "1 sequences per optimizer step) must be a multiple of the number of processes"
    ], err
    assert not (out / "checkpoints").exists()


def test_a_resume_with_nothing_left_to_train_says_so(store, qwen3_dir, tmp_path, capsys):
    """Issue 48.10: `--resume --max-steps N` below the run's step trains nothing and says so."""
    out = tmp_path / "run"
    assert (
        main(["fit", "--store", str(store), "--target", str(qwen3_dir), "--out", str(out), "--max-steps", "3", *sets()])
        == 0
    )
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert main(["fit", "--out", str(out), "--resume", "--max-steps", "2"]) == 0
    captured = capsys.readouterr()
    assert f"fit: nothing to train: {out} is already at step 3 of 2 planned (raise --max-steps" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1]) == {"step": 3, "trained_steps": 0}
    assert "evaluating" not in captured.err and sorted(p.name for p in (out / "checkpoints").iterdir()) == checkpoints


# -- 12: config and usage ------------------------------------------------------------------------------
def test_config_mistakes_say_did_you_mean(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("lr: 1.0e-3\noptim:\n  lr: 6.0e-4\n")
    with pytest.raises(ConfigError, match="top-level 'lr' and optim.lr are both set \\(did you mean optim.lr"):
        load_config(both, require_paths=False)
    typo = tmp_path / "typo.yaml"
    typo.write_text("optim:\n  learning_rat: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'learning_rat'"):
        load_config(typo, require_paths=False)
    with pytest.raises(ConfigError, match=r"did you mean optim.warmup_fraction\?"):
        load_config(None, ["optim.warmup_fractoin=0.1"], require_paths=False)


def test_usage_errors_exit_2_and_export_never_writes_into_a_store(store, qwen3_dir, tmp_path, capsys):
    assert main(["fit", "--target", str(qwen3_dir), "--out", str(tmp_path / "a")]) == 2
    assert "--store is required" in capsys.readouterr().err
    assert (
        main(
            [
                "fit",
                "--store",
                str(store),
                "--target",
                str(qwen3_dir),
                "--out",
                str(tmp_path / "b"),
                "--set",
                "optim.lr",
            ]
        )
        == 2
    )
    assert "expected key=value" in capsys.readouterr().err
    assert (
        main(
            [
                "fit",
                "--store",
                str(store),
                "--target",
                str(qwen3_dir),
                "--out",
                str(tmp_path / "c"),
                "--set",
                "optim.lrr=1",
            ]
        )
        == 2
    )
    assert "did you mean optim.lr" in capsys.readouterr().err
    assert (
        main(
            [
                "fit",
                "--store",
                str(store),
                "--target",
                str(qwen3_dir),
                "--out",
                str(tmp_path / "d"),
                "--verify-first",
                "--skip-verify",
            ]
        )
        == 2
    )
    assert "--verify-first and --skip-verify exclude each other" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--out", str(store / "drafter")]) == 1
    assert "is a hidden-state store" in capsys.readouterr().err
    assert not (store / "drafter").exists()


# -- 11: threads --------------------------------------------------------------------------------------
def test_torch_threads_follow_omp_num_threads_or_the_cores_per_process(monkeypatch):
    from store_schema.runtime.host import available_cores, omp_threads, set_torch_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_torch_threads(processes=1) == 1 == torch.get_num_threads()
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert set_torch_threads(processes=2) == max(1, available_cores() // 2) == torch.get_num_threads()
        for not_a_count in ("", " ", "0", "two"):  # the demo crashed on an empty one
            monkeypatch.setenv("OMP_NUM_THREADS", not_a_count)
            assert omp_threads() is None
            assert set_torch_threads(processes=2) == max(1, available_cores() // 2)
        monkeypatch.setenv("OMP_NUM_THREADS", " 3 ")
        assert omp_threads() == 3
    finally:
        torch.set_num_threads(before)


# -- 10/8: diagnose judges only what the log can show -----------------------------------------------------
@pytest.mark.parametrize("steps", [3, 50])
def test_diagnose_finds_no_false_problem_in_short_runs(store, qwen3_dir, tmp_path, capsys, steps):
    out = tmp_path / "run"
    Trainer.from_config(config_for(store, qwen3_dir, out, max_steps=steps), log=lambda m: None).fit()
    capsys.readouterr()
    assert main(["diagnose", str(out)]) == 0
    report = capsys.readouterr().out
    assert "problem" not in report.split("Details")[0], report
    if steps == 3:  # one LR value, three loss values: no verdict from that
        assert "LR too short to judge" in report and "too short to judge (1 logged LR value(s)" in report, report
    else:  # logged every 10 steps, the LR never lands on the peak of step 2: the shape is what is judged
        assert "LR matches the config" in report and "largest deviation 0.0%" in report, report


# -- 9: long phases say what they do ----------------------------------------------------------------------
def test_the_final_evaluation_and_eval_say_what_they_are_doing(store, qwen3_dir, tmp_path, capsys):
    out, messages = tmp_path / "run", []
    held = [
        "data.heldout_fraction=0.25",
        "eval.every=100",
        "eval.samples=2",
        "eval.max_blocks_per_sample=4",
        "eval.ddtree_budgets=[4]",
    ]
    Trainer.from_config(config_for(store, qwen3_dir, out, *held, max_steps=2), log=messages.append).fit()
    assert any(m == "fit: evaluating the final drafter on up to 2 held-out sample(s)" for m in messages), messages
    assert any(m.startswith("fit: final evaluation done in ") for m in messages), messages
    assert main(["export", str(out), "--out", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--store",
                str(store),
                "--drafter",
                str(tmp_path / "export"),
                "--target",
                str(qwen3_dir),
                "--max-samples",
                "2",
                "--max-blocks-per-sample",
                "4",
                "--ddtree-budgets",
                "4",
                "--json",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"eval: 2 heldout sample(s) of {store} on cpu" in err, err


def test_a_key_other_trainers_name_so_is_pointed_at_this_configs_own():
    """Issue 62.8: `optim.learning_rate` (transformers' name) suggests optim.lr, not
    min_lr_ratio; `gradient_accumulation_steps` suggests train.grad_accumulation."""
    from train.config_loading import did_you_mean

    assert did_you_mean("optim.learning_rate") == " (did you mean optim.lr?)"
    assert did_you_mean("gradient_accumulation_steps") == " (did you mean train.grad_accumulation?)"
    assert did_you_mean("optim.l").startswith(" (did you mean optim.lr")  # close spellings still found
