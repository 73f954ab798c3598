"""`python -m extract run` argument handling and `cluster.yaml`, without starting Ray."""

from __future__ import annotations

from pathlib import Path


from builders import coding_chats, write_chat_jsonl

REPO = Path(__file__).resolve().parents[1]


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


def test_run_rejects_bad_layers_before_any_work(qwen3_dir, tmp_path, capsys):
    from extract.__main__ import main

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(2))
    store = tmp_path / "store"
    argv = ["run", "--model", str(qwen3_dir), "--corpus", str(corpus), "--store", str(store), "--layers", "1,5"]
    assert main(argv) == 1  # qwen3_dir has 6 layers: 5 is the final layer
    assert "outside 0..4" in capsys.readouterr().err
    assert not (store / "zarr.json").exists()
