"""A full disk in `fit` (issue 48.2): the run's checkpoints are checked against
--out's free space before step 1 and each checkpoint before it is written; a disk
that fills anyway (a real ENOSPC, on a small tmpfs) is one line naming the last good
checkpoint and the resume command (exit 1), leaves no partial checkpoint, and the
resumed run finishes once there is space."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import builders
import pytest
import tiny

from train.cli import main
from train.fitting.checkpoint import CHECKPOINTS, latest_checkpoint

SETS = tiny.drafter_sets(
    "train.log_every=1",
    "eval.every=0",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=0",
    "train.progress_interval=0",
    "train.epochs=1000",
    heads=True,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("diskfull") / "store"
    builders.random_store(path, num_shards=2, samples_per_shard=4, num_target_layers=6, hidden_size=64, vocab_size=512)
    return path


def fit(store, target, out, max_steps: int, *extra: str) -> int:
    return main(
        [
            "fit",
            "--store",
            str(store),
            "--target",
            str(target),
            "--out",
            str(out),
            "--max-steps",
            str(max_steps),
            "--skip-verify",
            *tiny.cli_sets(SETS),
            *extra,
        ]
    )


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size (root or CAP_SYS_ADMIN needed), resizable in place."""
    mount = tmp_path / "disk"
    mount.mkdir()

    def mount_at(size: int, remount: bool = False) -> Path:
        options = f"remount,size={size}" if remount else f"size={size}"
        try:
            made = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True
            )
        except OSError as error:
            pytest.skip(f"cannot mount a small tmpfs here: {error}")
        if made.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {made.stderr.strip()}")
        return mount

    yield mount_at
    if not os.path.ismount(mount):
        return
    # A mount left behind outlives the run (pytest cannot delete its directory): a busy one
    # is detached lazily, and a failure names the mount.
    for command in (["umount", str(mount)], ["umount", "--lazy", str(mount)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0:
            return
    raise RuntimeError(f"could not unmount the test's tmpfs at {mount}: {done.stderr.strip()}")


def checkpoint_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def test_a_run_whose_checkpoints_do_not_fit_is_refused_before_step_1(store, qwen3_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("store_schema.runtime.host.free_bytes", lambda path: 100_000)
    out = tmp_path / "run"
    assert fit(store, qwen3_dir, out, 6) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {out}: the run's checkpoints need about ") and "(4 of ~" in line, err
    assert "its filesystem has 100.00 kB free" in line and "--skip-space-check" in line and "Traceback" not in err
    assert not (out / "train_log.jsonl").exists()  # refused before step 1


def test_a_disk_that_fills_names_the_last_checkpoint_and_resume_finishes(
    store, qwen3_dir, tmp_path, small_disk, monkeypatch, capsys
):
    reference = tmp_path / "reference"
    assert fit(store, qwen3_dir, reference, 2) == 0
    each = checkpoint_size(latest_checkpoint(reference))
    disk = small_disk(int(each * 1.6))
    out = disk / "run"
    (out / CHECKPOINTS / "step-00000099.tmp").mkdir(parents=True)  # a killed save's leftover
    capsys.readouterr()

    # The first checkpoint fits; the second is refused before it is written.
    assert fit(store, qwen3_dir, out, 6, "--skip-space-check") == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    checkpoint = out / CHECKPOINTS / "step-00000002"
    assert line.startswith(f"error: no space for the checkpoint of step 4 in {out / CHECKPOINTS}: it takes about "), err
    assert line.endswith(
        f"; the last good checkpoint is {checkpoint} (step 2), the steps after it are lost; "
        f"free space in {out} and resume with `python -m train fit --out {out} --resume`"
    ), line
    assert "Traceback" not in err
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == ["step-00000002"]  # leftover cleaned at start

    # The free space says it fits (as on a filesystem whose statvfs is optimistic): the
    # disk fills while writing, and the partial checkpoint is removed.
    monkeypatch.setattr("store_schema.runtime.host.free_bytes", lambda path: 1 << 40)
    assert fit(store, qwen3_dir, out, 6, "--resume") == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: disk full writing the checkpoint of step 4 in {out / CHECKPOINTS} "), line
    assert f"the last good checkpoint is {checkpoint} (step 2)" in line and "--resume`" in line
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == ["step-00000002"]

    small_disk(each * 8, remount=True)
    monkeypatch.undo()
    assert fit(store, qwen3_dir, out, 6, "--resume") == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 6
    assert latest_checkpoint(out).name == "step-00000006"
