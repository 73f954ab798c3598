"""What a run writes while it trains, besides checkpoints: `train_log.jsonl`
(`train.fitting.runlog`) and its TensorBoard copy (`log.tensorboard`) on rank 0,
and each rank's trained-samples log (`log.samples`). A resumed run first drops
the lines after its checkpoint's step, so every file reads as one run."""

from __future__ import annotations

from pathlib import Path

from train.fitting.config import LogConfig
from train.fitting.runlog import LOG_FILE, append_log, samples_log, truncate_log
from train.fitting.tblog import TensorBoardLog
from train.world import World


class RunWriter:
    def __init__(self, run_dir: Path, step: int, world: World, config: LogConfig):
        self.main = world.is_main
        self.log_path = run_dir / LOG_FILE
        if self.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            truncate_log(self.log_path, step)
        self.board = TensorBoardLog(run_dir, step) if self.main and config.tensorboard else None
        self.trained = samples_log(run_dir, world.rank) if config.samples else None
        if self.trained is not None:
            self.trained.parent.mkdir(parents=True, exist_ok=True)
            truncate_log(self.trained, step)

    def write(self, record: dict) -> None:
        """One line of train_log.jsonl (rank 0 only)."""
        if not self.main:
            return
        append_log(self.log_path, record)
        if self.board is not None:
            self.board.write(record)

    def samples(self, step: int, slots: list) -> None:
        """This rank's samples of optimizer step `step` (1-based), with `log.samples`."""
        if self.trained is None:
            return
        for lane, sample in slots:
            if sample is not None:
                append_log(
                    self.trained, {"step": step, "lane": lane, "epoch": sample.epoch, "sample_id": sample.sample_id}
                )

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
