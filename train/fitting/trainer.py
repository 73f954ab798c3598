"""The fit loop: stream the store, train the drafter, log, evaluate, checkpoint.

Order of a run (`Trainer.from_config`: `train.fitting.preflight`, then `train.fitting.build`):
1. Read the target's config and its frozen `embed_tokens` / `lm_head` from its
   safetensors (the target model is never built).
2. Check the store against the target: hidden size, vocabulary and layer count
   must match (refused naming the field), the target directory must be the
   checkpoint the store was extracted from (`train.target_check`), and no context
   layer may be the target's final layer (its features produce the logits: a
   shortcut that does not exist at inference). Then the rest
   of `train.fitting.preflight`: the plan's block size, an incomplete store, the
   integrity pass, an empty held-out split, lanes against shards, and the epochs
   `--max-steps` needs.
3. Plan the drafter (`train.families.dflash.plan`: DFlash resolves its mask token)
   and build it through its family (`train.families.kinds`) from the store's layer
   ids, or, fine-tuning (`model.init_from`), from a published drafter's shape and
   weights once they fit (`train.families.dflash.init_from`); AdamW over fp32 master
   weights (bf16 autocast on CUDA), linear warmup then cosine
   (`train.fitting.optimizer`), the lanes of streaming loaders (`train.data.lanes`).
4. Every optimizer step: the global batch, `batch_size x grad_accumulation`
   sequences (8 by default), each its own family's `train_step` (DFlash:
   anchors drawn from the loss mask, targets built from clean tokens before any
   noise, chunked loss through the frozen head); the loss normalised over all weighted labels of the
   step (`loss.normalize`), gradients clipped, stepped.
5. Data-parallel (torchrun, or `fit --nproc N`; `train.fitting.distributed`): each
   process trains a DDP replica on its lanes' samples (`train.data.lanes`), the
   step's loss normalised over the weighted labels of every rank; rank 0 alone
   logs, evaluates and checkpoints (with every lane's position and generator).
6. `train_log.jsonl` gets one line per logged step, evaluators run every
   `eval.every` steps (their `heldout_*` / `eval_*` keys go into the same log),
   and a checkpoint (safetensors + JSON) every `checkpoint_every` steps and at
   the end (`train.fitting.checkpoint.Checkpointer`: each part keeps its own
   state); the checkpoint records the run's held-out split.

Evaluation hook: `Trainer.evaluators` is a list of callables
`(trainer, step) -> dict`; their dicts are merged into the log line of that
step. The defaults are `train.fitting.periodic_eval.HeldoutEval` (held-out loss and
accuracies) and `AcceptanceEval` (tau, DDTree); more can be appended without
touching the loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from store_schema import CorruptShardError
from store_schema.runtime.progress import default_mode
from store_schema.runtime.target_model import compute_dtype
from train.config import RunConfig
from train.data.heldout import heldout_record
from train.data.lanes import pad_sample
from train.data.loader import TrainSample
from train.dtypes import torch_dtype
from train.families.family import StepResult, StepSample
from train.families.kinds import family_of
from train.fitting.build import RunParts, build_run, checkpoint_parts
from train.fitting.checkpoint import Checkpointer, checkpoint_dir
from train.fitting.distributed import gradient_allreduce, no_gradient_sync, reduce_step, wrap
from train.fitting.global_rng import GlobalRNG
from train.fitting.interrupts import DataStopped, TrainingInterrupted, sigint_deferred
from train.fitting.metrics import LogInterval, MetricSums
from train.fitting.periodic_eval import AcceptanceEval, HeldoutEval
from train.fitting.preflight import FitChecks
from train.fitting.progress import fit_progress, headline
from train.fitting.run_writer import RunWriter
from train.world import World


class Trainer:
    def __init__(self, parts: RunParts):
        """A run's parts (`train.fitting.build`): `feed` serves this process's lanes
        (its first loader is `loader`, whose generator is the run's `generator`)."""
        self.config = config = parts.config
        self.drafter, self.head, self.optimizer, self.feed = parts.drafter, parts.head, parts.optimizer, parts.feed
        self.checkpointer, self.world, self.device, self.log = parts.checkpointer, parts.world, parts.device, parts.log
        self.family = family_of(self.drafter)
        self.loader = next(iter(self.feed.loaders.values()))
        self.generator = self.feed.generators[self.loader.spec.lane]
        self.total_steps = self.optimizer.total_steps
        self.step = parts.start_step
        self.epoch = self.loader.start.epoch
        allreduce, why = gradient_allreduce(config.train.grad_allreduce, self.world, self.device)
        if self.world.distributed and self.world.is_main:
            self.log(f"fit: gradients all-reduced in {allreduce} ({why})")
        self.replica = wrap(self.drafter, self.world, self.device, allreduce)  # DDP on more than one process
        self.store = parts.store
        self.store_info, self.run_info = parts.record["store"], parts.record["run_info"]
        self.run_dir = Path(config.out)
        self.evaluators: list[Callable[[Trainer, int], dict]] = [
            HeldoutEval(config.eval),
            AcceptanceEval(config.eval, attention=config.model.attention),
        ]
        self.last_eval_step: int | None = None
        self.committed: tuple = ()
        compute = compute_dtype(self.device, on_cuda=torch_dtype(config.train.dtype))
        # steps and evaluators alike (fp32 master weights): compiled flex sees one dtype
        self.autocast = (lambda: torch.autocast("cuda", dtype=compute)) if compute != torch.float32 else nullcontext

    @classmethod
    def from_config(
        cls,
        config: RunConfig,
        resume: bool = False,
        log: Callable[[str], None] = print,
        world: World | None = None,
        checks: FitChecks = FitChecks(),
    ) -> "Trainer":
        """Build a run from its config after the checks of `train.fitting.preflight`
        (`checks` relaxes them); `config` itself is left as it was. `resume`: continue
        the newest checkpoint in `config.out` (else a new run, refused over an old one)."""
        return cls.from_start(config, Checkpointer(config.out).resume_point(resume), log, world, checks)

    @classmethod
    def from_start(
        cls,
        config: RunConfig,
        latest: Path | None,
        log: Callable[[str], None] = print,
        world: World | None = None,
        checks: FitChecks = FitChecks(),
    ) -> "Trainer":
        """`from_config` from the checkpoint `Checkpointer.resume_point` already chose
        (None: a new run), as `fit` resolves it before reading the config."""
        return cls(build_run(config, latest, log, world, checks))

    # -- one sequence ------------------------------------------------------------------------
    def run_sequence(
        self,
        sample: TrainSample,
        generator: torch.Generator,
        noise: float | None = None,
        replica: torch.nn.Module | None = None,
    ) -> StepResult:
        """The family's training step on one loader sample.
        `noise` overrides `loss.noise` (the held-out pass scores with 0); `replica`
        defaults to the bare drafter (training steps pass the DDP module)."""
        loss = self.config.loss if noise is None else dataclasses.replace(self.config.loss, noise=noise)
        device = self.device
        with self.autocast():
            inputs = StepSample(
                sample.input_ids.to(device),
                sample.loss_mask,
                sample.context_features(device),
                sample.topk_ids,
                sample.topk_logprobs,
            )
            return self.family.train_step(
                replica if replica is not None else self.drafter,
                self.head,
                inputs,
                loss,
                self.config.model,
                generator,
                self.step,
            )

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train until `total_steps` or the data runs out on every rank. Returns the
        last log record. Every rank runs the loop; rank 0 alone writes."""
        writer = RunWriter(self.run_dir, self.step, self.world, self.config.log)
        progress = fit_progress(
            self.total_steps, self.step, self.config.train.progress_interval, default_mode(self.world.is_main)
        )
        positions = self.family.drafted_positions(self.drafter.config)
        interval = LogInterval(positions, lambda: self.feed.wait_seconds, self.device)
        last: dict = {}
        self.drafter.train()
        self.committed = self.committed_state()  # positions and RNGs as of the last completed step
        try:
            while self.step < self.total_steps:
                done = self.train_step(writer)
                if done is None:
                    break  # out of data on every rank
                step_sums, lr, grad_norm = done
                interval.sums.merge(step_sums)
                record = self.step_record(interval, lr, grad_norm)
                if record and self.world.is_main:
                    writer.write(record)
                    last = record
                    progress.show(**headline(record))
                if record:
                    interval.restart_clock()
                if self.checkpointer.due(self.step):
                    self.save_checkpoint(background=True)
                progress.update(
                    1, tokens=step_sums.tokens, samples=f"{self.step * self.config.train.sequences_per_step:,}"
                )
            last = {**last, **self.final_evaluation(writer)}
            if not self.checkpointer.due(self.step):
                self.save_checkpoint()
            self.checkpointer.wait()
        except KeyboardInterrupt:
            raise TrainingInterrupted(self.step, self.checkpoint_last_step("interrupted")) from None
        except CorruptShardError as error:
            raise DataStopped(self.step, self.checkpoint_last_step(f"shard {error.shard} is corrupt"), error) from None
        finally:
            self.finish_background_save()
            progress.close()
            self.feed.close()
            writer.close()
        self.report_data_end()
        return last

    def train_step(self, writer: RunWriter) -> tuple[MetricSums, float, torch.Tensor] | None:
        """One optimizer step over this rank's slots of the global batch, applied
        whole or not at all: (metric sums over all ranks, LR, grad norm where the
        gradients are: read when a line is logged), or None when every lane has run dry."""
        slots = self.feed.take(self.step)
        if not self.world.distributed and all(sample is None for _, sample in slots):
            return None
        step_sums = self.backward_step(
            [sample for _, sample in slots], [self.feed.generators[lane] for lane, _ in slots]
        )
        if step_sums.sequences == 0:
            return None
        writer.samples(self.step + 1, slots)
        grad_norm = self.optimizer.clip(self.gradient_divisor(step_sums))
        with sigint_deferred():  # a step is applied whole or not at all
            lr = self.optimizer.step(self.step)
            self.step += 1
            self.committed = self.committed_state()
        return step_sums, lr, grad_norm

    def step_record(self, interval: LogInterval, lr: float, grad_norm: torch.Tensor) -> dict:
        """The log line of the step just done: training figures every `train.log_every`
        steps and at the end, evaluations every `eval.every` (rank 0); {} for none."""
        record: dict = {}
        if self.step % self.config.train.log_every == 0 or self.step == self.total_steps:
            record = {
                "step": self.step,
                "epoch": self.epoch,
                "lr": lr,
                **interval.figures(),
                "grad_norm": float(grad_norm),
                "world_size": self.world.size,
            }
        every = self.config.eval.every
        if self.world.is_main and every and self.step % every == 0:
            record = {"step": self.step, "epoch": self.epoch, **record, **self.evaluate()}
        return record

    def final_evaluation(self, writer: RunWriter) -> dict:
        """The final model is always evaluated (rank 0, when evaluation is on)."""
        if not (self.world.is_main and self.config.eval.every and self.last_eval_step != self.step):
            return {}
        began = time.perf_counter()
        self.log(f"fit: evaluating the final drafter on up to {self.config.eval.samples or 'all'} held-out sample(s)")
        record = {"step": self.step, "epoch": self.epoch, **self.evaluate()}
        self.log(f"fit: final evaluation done in {time.perf_counter() - began:.1f} s")
        writer.write(record)
        return record

    def report_data_end(self) -> None:
        """Say which shards were skipped and whether the data ran out before the schedule did."""
        if self.feed.skipped_shards:
            self.log(f"skipped corrupt shards (never trained on): {self.feed.skipped_shards}")
        if self.step < self.total_steps:
            self.log(
                f"warning: the data ran out after step {self.step} of the {self.total_steps} planned "
                f"(the LR schedule was built for {self.total_steps}; {self.feed.skipped_empty} sample(s) had "
                "no whole block to train on)"
            )

    def backward_step(
        self, samples: list[TrainSample | None], generators: list[torch.Generator] | None = None
    ) -> MetricSums:
        """Gradients of one optimizer step over this rank's `samples` of the
        global batch, each sequence its own forward and backward with its lane's
        generator (default: the run's). `loss.normalize="step"`: the loss is
        normalised over all weighted labels of the step on every rank, so each
        sequence's own normalised loss counts by its label weight
        (`BlockTargets.weight_sum`) and the gradients, summed over sequences and
        ranks, are divided by the step's total weight (an all_reduce of the
        ranks' sums); "sequence": the mean of the sequences' own normalised
        losses. A None sample (its lane ran dry) is skipped in a single process
        and zero-weight work on more (a pad sequence's backward times 0, so
        every rank joins the same gradient all_reduces). Returns the step's metric sums over all ranks and sets
        `epoch` to the furthest epoch among its samples."""
        self.optimizer.zero_grad()
        per_step = self.config.loss.normalize == "step"
        sums = MetricSums(self.family.drafted_positions(self.drafter.config), self.device)
        generators = generators or [self.generator] * len(samples)
        epoch = self.epoch
        for i, (sample, generator) in enumerate(zip(samples, generators)):
            real = sample is not None
            if sample is None:
                if not self.world.distributed:
                    continue  # no replica waits on this process's all-reduce: nothing to pad
                pad_length = self.family.pad_length(self.drafter.config)
                sample, generator = pad_sample(self.drafter.config, pad_length), torch.Generator().manual_seed(0)
            sync = not self.world.distributed or i == len(samples) - 1  # DDP all_reduces on the last backward only
            with nullcontext() if sync else no_gradient_sync(self.replica):
                result = self.run_sequence(sample, generator, replica=self.replica)
                scale = result.weight.detach() if per_step else 1.0  # on the device: no read-back per sequence
                (result.loss * (scale if real else 0.0)).backward()
            if real:
                sums.add(result, sample.num_tokens)
                epoch = max(epoch, sample.epoch)
        sums, self.epoch = reduce_step(self.world, sums, epoch, self.device)
        return sums

    def gradient_divisor(self, sums: MetricSums) -> torch.Tensor | float:
        """What the step's summed gradients are divided by: its total label weight
        (`loss.normalize="step"`, on the device) or its sequences, over the ranks DDP
        averaged over."""
        if self.config.loss.normalize == "step":
            return sums.weight().float().clamp_min(1e-30) / self.world.size  # 0 weight: zero gradients stay zero
        return max(sums.sequences, 1) / self.world.size

    def release_replica(self) -> None:
        """Drop the DDP module, which must go before its process group does."""
        self.replica = self.drafter

    def evaluate(self) -> dict:
        self.last_eval_step = self.step
        result: dict = {}
        for evaluator in self.evaluators:
            result.update(evaluator(self, self.step))
        return result

    # -- checkpoints -----------------------------------------------------------------------------
    def committed_state(self) -> tuple:
        """What a checkpoint of the last completed step needs that the next step's
        sampling changes: every lane's position and generator, and the global RNGs."""
        return dict(self.feed.positions), self.feed.generator_states(), GlobalRNG().state_dict()

    def checkpoint_last_step(self, why: str) -> Path | None:
        """After Ctrl-C or a corrupt shard: the checkpoint of the last completed step
        (written now unless it already is, a second Ctrl-C ignored meanwhile).
        Data-parallel runs keep their last periodic checkpoint: writing one needs
        every rank's collective, and the launcher is already stopping them."""
        self.finish_background_save()
        if self.world.distributed:
            return self.checkpointer.latest()
        positions, generator_states, rng = self.committed
        self.feed.positions.update(positions)
        self.feed.set_generator_states(generator_states)
        GlobalRNG().load_state_dict(rng)
        done = checkpoint_dir(self.run_dir, self.step)
        if self.checkpointer.latest() == done:
            return done
        self.log(f"{why}: saving a checkpoint of step {self.step}")
        with sigint_deferred(reraise=False):
            return self.save_checkpoint()

    def save_checkpoint(self, background: bool = False) -> Path | None:
        """Every rank calls it (the feed gathers each lane's position and generator);
        rank 0 writes, in the background when asked (`Checkpointer.save`)."""
        feed = FrozenState(self.feed.state_dict())  # a collective gather: every rank joins
        if not self.world.is_main:
            return None
        parts = checkpoint_parts(self.drafter, self.optimizer, feed, self.store)
        return self.checkpointer.save(self.step, parts, self.checkpoint_record(), background)

    def finish_background_save(self) -> None:
        """On the way out: let a background save finish; if it failed, say so here (an
        error is already on its way) -- the last good checkpoint is what `latest` finds."""
        try:
            self.checkpointer.wait()
        except Exception as error:
            self.log(f"warning: the checkpoint written in the background failed: {error}")

    def checkpoint_record(self) -> dict:
        """What every checkpoint says about the run, beside its parts' states."""
        return {
            "scheduler": {
                "step": self.step,
                "total_steps": self.total_steps,
                "lr": self.optimizer.lr(max(self.step - 1, 0)),
            },
            "epoch": self.epoch,
            "drafter_config": self.drafter.config.to_dict(),
            "config": self.config.to_dict(),
            "heldout_split": heldout_record(self.config.data.heldout_fraction),
            "store": self.store_info,
            "run_info": self.run_info,
        }


class FrozenState:
    """A part's state taken ahead of the save (a collective one, taken on every rank)."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state
