"""`python -m extract run` argument handling and `cluster.yaml`, without starting Ray."""

from __future__ import annotations

import json

import pytest
from builders import coding_chats, write_chat_jsonl
from paths import REPO


def test_cluster_yaml_is_a_valid_launcher_config_with_dashboard_on_loopback():
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    text = (REPO / "cluster.yaml").read_text()
    config = yaml.safe_load(text)
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "local" and config["provider"]["worker_ips"] == []
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "--num-gpus=8" in head
    assert "0.0.0.0" not in text
    assert any("[gpu]" in command for command in config["setup_commands"])


def test_run_refuses_a_directory_that_is_not_a_store(qwen3_dir, tmp_path, capsys):
    from extract.__main__ import main

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(4))
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    argv = ["run", "--model", str(qwen3_dir), "--corpus", str(corpus), "--store", str(precious), "--overwrite"]
    assert main(argv) == 1
    assert "not a dflash store" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me"


def test_run_needs_a_store(qwen3_dir, tmp_path, capsys):
    from extract.__main__ import main

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(2))
    assert main(["run", "--model", str(qwen3_dir), "--corpus", str(corpus)]) == 2
    assert "--store" in capsys.readouterr().err


def test_a_model_directory_without_a_tokenizer_names_it_and_the_flag(qwen3_dir, tokenizer_dir, tmp_path, capsys):
    """Issue 62.8: a model directory holding weights but no tokenizer files is said to be
    one, with `--tokenizer`, before any work (transformers would build a tokenizer that
    knows no chat template); with `--tokenizer` the same directory plans."""
    import shutil

    from extract.__main__ import main

    bare = tmp_path / "bare"
    shutil.copytree(qwen3_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special*"))
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(2))
    argv = ["plan", "--model", str(bare), "--corpus", str(corpus), "--store", str(tmp_path / "s"), "--dry-run"]
    argv += ["--layers", "1,3"]
    assert main(argv) == 1  # a directory that exists but is refused
    err = capsys.readouterr().err
    assert f"{bare} holds no tokenizer" in err and "pass --tokenizer DIR" in err and "Traceback" not in err
    assert main([*argv, "--tokenizer", str(tokenizer_dir)]) == 0


def test_run_rejects_bad_layers_before_any_work(qwen3_dir, tmp_path, capsys):
    from extract.__main__ import main

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(2))
    store = tmp_path / "store"
    argv = ["run", "--model", str(qwen3_dir), "--corpus", str(corpus), "--store", str(store), "--layers", "1,5"]
    assert main(argv) == 1  # qwen3_dir has 6 layers: 5 is the final layer
    assert "outside 0..4" in capsys.readouterr().err
    assert not (store / "zarr.json").exists()


def test_exit_codes_follow_the_one_rule(qwen3_dir, tmp_path, capsys):
    """store_schema.runtime.cli's rule: 2 for usage (a path that does not exist, a malformed
    flag value), 1 for input that exists but is refused; one `error:` line each."""
    from extract.__main__ import main

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(2))
    store = tmp_path / "store"
    common = ["--corpus", str(corpus), "--store", str(store)]
    cases = [
        (["run", "--model", str(tmp_path / "no-model"), *common], 2, "no-model"),
        (["plan", "--dry-run", "--model", str(tmp_path / "no-model"), *common], 2, "no-model"),
        (
            ["run", "--model", str(qwen3_dir), "--corpus", str(tmp_path / "none.jsonl"), "--store", str(store)],
            2,
            "none.jsonl",
        ),
        (["run", "--model", str(qwen3_dir), *common, "--layers", "1,x"], 2, "--layers"),
        (["run", "--model", str(qwen3_dir), *common, "--max-length", "0"], 1, "max_length must be a positive"),
        (["run", "--model", str(qwen3_dir), *common, "--workers", "0"], 1, "--workers"),
    ]
    for argv, code, named in cases:
        assert main(argv) == code, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], (argv, err)
    assert not store.exists()


def test_fault_injection_is_armed_from_the_environment_only_for_tests():
    from extract.extraction.config import JobConfig
    from extract.jobs.settings import KILL_AFTER_BATCHES_ENV, KILL_DRIVER_ENV, STOP_AFTER_BATCHES_ENV, FaultInjection

    assert FaultInjection.from_env({}) == FaultInjection()
    faults = FaultInjection.from_env(
        {KILL_AFTER_BATCHES_ENV: "3, 7", KILL_DRIVER_ENV: "2", STOP_AFTER_BATCHES_ENV: "5"}
    )
    assert faults == FaultInjection(kill_after_batches=(3, 7), stop_after_batches=(5,), kill_driver_after_shards=2)
    assert [faults.actor_kill_after(i) for i in range(3)] == [3, 7, None]  # later actors live
    assert [faults.actor_stop_after(i) for i in range(2)] == [5, None]
    assert JobConfig(model="m", corpus="c", store="s").execution.faults == FaultInjection.from_env()


def test_a_refused_job_leaves_nothing_behind(qwen3_dir, tmp_path, capsys):
    """Issue 16.8: a job refused after it took the store's lock (here: no record of the
    corpus gives a sample) removes what it made -- the lock file and the store
    directory with its new parents -- and nothing that was there before."""
    from extract.__main__ import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')  # no assistant turn
    existing = tmp_path / "existing"
    existing.mkdir()
    for store in (tmp_path / "new" / "store", existing):
        argv = [
            "run",
            "--model",
            str(qwen3_dir),
            "--corpus",
            str(corpus),
            "--store",
            str(store),
            "--layers",
            "1,3",
            "--no-progress",
        ]
        assert main(argv) == 1
        assert "gives no samples" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert existing.is_dir() and not list(existing.iterdir())


def test_new_flags_are_validated_and_plan_workers_default_to_the_cores(capsys):
    from extract.__main__ import build_parser
    from extract.extraction.config import JobConfig
    from extract.jobs.settings import Execution
    from store_schema.runtime.host import available_cores

    args = build_parser().parse_args(["run", "--model", "m", "--corpus", "c", "--store", "s"])
    assert args.plan_workers == available_cores() and JobConfig(model="m", corpus="c", store="s").plan_workers >= 1
    assert (args.batch_shards, args.worker_timeout, args.require_fast_kernels) == (4, 3600.0, False)
    assert args.linear_attention == "auto"
    with pytest.raises(ValueError, match="--linear-attention 'fla': choose one of auto, torch"):
        JobConfig(model="m", corpus="c", store="s", linear_attention="fla")  # a config built without the CLI
    for field, value in (("batch_shards", 0), ("worker_timeout", 0.0), ("progress_interval", -1.0)):
        try:
            if field == "batch_shards":
                JobConfig(model="m", corpus="c", store="s", batch_shards=value)
            else:
                Execution(**{field: value})
        except ValueError as error:
            assert f"--{field.replace('_', '-')} must be positive" in str(error)
        else:
            raise AssertionError(f"{field}={value} accepted")


def test_device_auto_is_the_default_and_the_first_line_says_what_it_chose(qwen3_dir, tmp_path, capsys):
    """Issue 35.6: `run` and `generate` default to --device auto (cuda when this host's
    torch sees a GPU, else cpu), said first; cpu and cuda are still taken as given."""
    import torch

    from extract.__main__ import build_parser, main

    for command in ("run", "generate"):
        assert build_parser().parse_args([command, "--model", "m", "--corpus", "c"]).device == "auto"
    chosen = (
        f"cuda (--device auto: torch sees {torch.cuda.device_count()} CUDA device(s))"
        if torch.cuda.is_available()
        else "cpu (--device auto: torch sees no CUDA device here (--device cuda for a Ray cluster's GPUs))"
    )
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')  # refused after planning
    run = [
        "run",
        "--model",
        str(qwen3_dir),
        "--corpus",
        str(corpus),
        "--store",
        str(tmp_path / "s"),
        "--layers",
        "1,3",
        "--no-progress",
    ]
    capsys.readouterr()
    for argv, first in (
        (run, f"device: {chosen}"),
        ([*run, "--device", "cpu"], "device: cpu (--device cpu)"),
        (
            ["generate", "--model", str(qwen3_dir), "--corpus", str(corpus), "--dry-run", "--no-progress"],
            f"device: {chosen}",
        ),
    ):
        assert main(argv) in (0, 1)  # run: no sample in the corpus; generate: a dry run
        err = capsys.readouterr().err
        assert err.splitlines()[0] == first, err
        assert argv[0] == "generate" or "gives no samples" in err, err


def test_plan_names_a_quarantined_record_by_its_1_based_line(qwen3_dir, tmp_path, capsys):
    """Issue 35.10: `record 3` was printed for line 4 (the plan's 0-based index)."""
    from extract.__main__ import main

    chats = coding_chats(2)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(chat) + "\n" for chat in chats) + "\n{not json\n")  # line 3 is blank
    assert (
        main(
            [
                "plan",
                "--dry-run",
                "--model",
                str(qwen3_dir),
                "--corpus",
                str(corpus),
                "--layers",
                "1,3",
                "--tokenizer-workers",
                "1",
            ]
        )
        == 0
    )
    assert "    c.jsonl line 4: malformed_json " in capsys.readouterr().out


def test_plan_workers_is_renamed_tokenizer_workers_and_the_old_spelling_refused(qwen3_dir, tmp_path, capsys):
    """Issue 34.4: `--workers` meant tokenizer processes under `plan` and Ray actors under `run`."""
    from extract.__main__ import build_parser, main
    from extract.commands.plan import RENAMED_WORKERS_NOTE

    plan_parser = build_parser()._subparsers._group_actions[0].choices["plan"]
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(3))
    common = ["plan", "--dry-run", "--model", str(qwen3_dir), "--corpus", str(corpus), "--layers", "1,3"]
    assert main([*common, "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {RENAMED_WORKERS_NOTE}"] and "--tokenizer-workers" in err[0]
    assert plan_parser.parse_args(common[1:] + ["--tokenizer-workers", "3"]).tokenizer_workers == 3
    assert "--workers" not in plan_parser.format_help()  # only the new spelling is offered
    run_parser = build_parser()._subparsers._group_actions[0].choices["run"]
    assert run_parser.parse_args(["--model", "m", "--corpus", "c", "--tokenizer-workers", "3"]).plan_workers == 3


def test_config_only_target_cli_writes_the_27b_config_and_no_weights(tmp_path, tokenizer_dir, capsys):
    from extract.__main__ import main as cli
    from extract.qwen3_6_27b import QWEN3_6_27B
    from store_schema.runtime.target_config import read_target_config

    out = tmp_path / "qwen3.6-27b"
    assert cli(["config-only-target", str(out), "--tokenizer", str(tokenizer_dir)]) == 0
    printed = capsys.readouterr().out
    assert f"python -m extract plan --dry-run --model {out}" in printed and "no weights" in printed
    assert json.loads((out / "config.json").read_text()) == QWEN3_6_27B
    target = read_target_config(out)
    assert (target.hidden_size, target.num_hidden_layers, target.vocab_size) == (5120, 64, 248_320)
    assert (out / "tokenizer_config.json").is_file()
    assert not list(out.glob("*.safetensors")) and not list(out.glob("*.bin"))
    assert cli(["config-only-target", str(tmp_path / "other"), "--tokenizer", str(tmp_path / "nowhere")]) == 2
    assert "no tokenizer_config.json" in capsys.readouterr().err
