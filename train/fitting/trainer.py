"""The fit loop: stream the store, train the drafter, log, evaluate, checkpoint.

Order of a run (`Trainer.from_config`):
1. Read the target's config and its frozen `embed_tokens` / `lm_head` from its
   safetensors (the target model is never built).
2. Check the store against the target: hidden size, vocabulary and layer count
   must match (refused naming the field), the target directory must be the
   checkpoint the store was extracted from (`train.target_check`), and no context
   layer may be the target's final layer (its features produce the logits: a
   shortcut that does not exist at inference, bug 2 of the seeds). Then the rest
   of `train.fitting.preflight`: the plan's block size, an incomplete store, the
   integrity pass, an empty held-out split, lanes against shards, and the epochs
   `--max-steps` needs.
3. Resolve the mask token (`train.drafter.mask_token`) and build the drafter from the
   store's layer ids, or, fine-tuning (`model.init_from`), from a published
   drafter's shape and weights once they fit (`train.fitting.init_from`); AdamW over
   fp32 master weights (bf16 autocast on CUDA), linear warmup then cosine, the
   streaming loader.
4. Every optimizer step: the global batch, `batch_size x grad_accumulation`
   sequences (8 by default), each its own `dflash_step` (anchors drawn from the
   loss mask, targets built from clean tokens before any noise, chunked loss
   through the frozen head); the loss normalised over all weighted labels of the
   step (`loss.normalize`), gradients clipped, stepped.
5. Data-parallel (torchrun, or `fit --nproc N`; `train.fitting.distributed`): each
   process trains a DDP replica on its lanes' samples (`train.data.lanes`), the
   step's loss normalised over the weighted labels of every rank; rank 0 alone
   logs, evaluates and checkpoints (with every lane's position and generator).
6. `train_log.jsonl` gets one line per logged step, evaluators run every
   `eval.every` steps (their `heldout_*` / `eval_*` keys go into the same log),
   and a checkpoint (safetensors + JSON) every `checkpoint_every` steps and at
   the end; the checkpoint records the run's held-out split.

Evaluation hook: `Trainer.evaluators` is a list of callables
`(trainer, step) -> dict`; their dicts are merged into the log line of that
step. The defaults are `train.fitting.evaluators.HeldoutEval` (held-out loss and
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
from store_schema.stores import open_store
from store_schema.runtime.progress import default_mode
from store_schema.runtime.target_config import read_target_config
from store_schema.runtime.target_model import compute_dtype
from train.config import ConfigError, RunConfig
from train.data.cache import lanes_per_node
from train.data.heldout import heldout_record
from train.data.lanes import LaneFeed, check_world, lane_generator, lane_positions, pad_sample
from train.data.lanes import total_steps as lane_steps
from train.data.loader import CorruptShards, ShardLoader, TrainSample, check_lanes
from train.data.order import LANE_DEAL
from train.drafter.dflash2 import build_drafter
from train.drafter.model import DFlashDrafter
from train.drafter.targets import default_gamma
from train.dtypes import torch_dtype
from train.fitting.init_from import load_start_weights
from train.fitting import checkpoint as ckpt
from train.fitting import preflight
from train.fitting.distributed import device_for, init_process_group, reduce_step, wrap
from train.fitting.evaluators import AcceptanceEval, HeldoutEval
from train.fitting.metrics import MetricSums
from train.fitting.preflight import FitChecks
from train.fitting.progress import DataStopped, TrainingInterrupted, fit_progress, headline, sigint_deferred
from train.fitting.runlog import LOG_FILE, append_log, samples_log, truncate_log
from train.fitting.schedule import lr_at
from train.fitting.setup import build_optimizer, plan_drafter
from train.fitting.step import dflash_step
from train.fitting.tblog import TensorBoardLog
from train.fitting.target_head import TargetHead, load_target_head
from train.target_check import check_target
from train.world import World, local_world_size, world_from_env


# -- the trainer -------------------------------------------------------------------------
class Trainer:
    def __init__(self, config: RunConfig, head: TargetHead, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer,
                 feed: LaneFeed, *, total_steps: int, device: torch.device, start_step: int = 0,
                 world: World | None = None, store_info: dict | None = None, run_info: dict | None = None,
                 log: Callable[[str], None] = print):
        """A run's parts, built by `from_config`: `feed` serves this process's lanes
        (its first loader is `loader`, whose generator is the run's `generator`)."""
        self.config = config
        self.head = head
        self.drafter = drafter
        self.optimizer = optimizer
        self.feed = feed  # this process's lanes of the sample streams (one lane in a single-stream run)
        self.loader = next(iter(feed.loaders.values()))
        self.generator = feed.generators[self.loader.lane]
        self.total_steps = total_steps
        self.device = device
        self.step = start_step
        self.world = world or World()
        self.replica = wrap(drafter, self.world, device)  # what training steps run: DDP on more than one process
        self.store_info = store_info or {}
        self.run_info = run_info or {}  # how the run started (mask token rule, ...): checkpoints and exports keep it
        self.log = log
        self.run_dir = Path(config.out)
        self.evaluators: list[Callable[[Trainer, int], dict]] = [
            HeldoutEval(config.eval),
            AcceptanceEval(config.eval, attention=config.model.attention),
        ]
        self._last_eval_step: int | None = None
        self.epoch = self.loader.start.epoch
        compute = compute_dtype(device, on_cuda=torch_dtype(config.train.dtype))
        # steps and evaluators alike (fp32 master weights): compiled flex sees one dtype
        self.autocast = (lambda: torch.autocast("cuda", dtype=compute)) if compute != torch.float32 else nullcontext

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: RunConfig, resume: bool = False, log: Callable[[str], None] = print,
                    world: World | None = None, checks: FitChecks = FitChecks()) -> "Trainer":
        """Build a run from its config after the checks of `train.fitting.preflight`
        (`checks` relaxes them)."""
        world = world or world_from_env()
        if not world.is_main:
            log = _quiet  # rank 0 speaks for the job
        run_dir = Path(config.out)
        latest = ckpt.latest_checkpoint(run_dir) if resume else None
        if resume and latest is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / ckpt.CHECKPOINTS}")
        if not resume and ckpt.latest_checkpoint(run_dir) is not None:
            raise FileExistsError(f"{run_dir} already holds checkpoints; pass --resume to continue it or use a new --out")

        device = device_for(world, config.train.device)
        init_process_group(world, device)
        target = read_target_config(config.target)
        store = open_store(config.store)
        layer_ids = preflight.check_store_against_target(store, target)
        other_target = check_target(store, config.target, allow_other_target=checks.allow_other_target, log=log)
        preflight.check_block_size(store, config)
        if config.loss.labels == "target" or config.loss.kl_mix > 0 or config.eval.labels == "target":
            if not store.fingerprint.target_topk:
                raise ConfigError(
                    "config loss.labels=target / loss.kl_mix > 0 / eval.labels=target need the target's top-k "
                    f"in the store; {store.path} was extracted without it"
                )
        if config.loss.gamma is None:
            default_gamma(config.model.block_size)  # refuse a block size without a default before any work
        drafter_config, run_info = plan_drafter(config, target, layer_ids, latest, log)
        run_info.update(other_target)
        preflight.check_complete(store, checks, log)
        damaged = preflight.integrity_pass(store, config, log, world, device) if checks.verify else []
        preflight.check_heldout(store, config, log)
        layer_ids = drafter_config.context_layer_ids  # a fine-tuned drafter reads its own layers of the store
        head_dtype = compute_dtype(device, on_cuda=torch_dtype(config.train.dtype))
        head = load_target_head(config.target, dtype=head_dtype, device=device)
        torch.manual_seed(config.train.seed)
        drafter = build_drafter(drafter_config)
        if latest is None and config.model.init_from:
            load_start_weights(drafter, config.model.init_from)  # fine-tuning starts from the published weights
        drafter = drafter.to(device)  # fp32 master weights
        drafter.gradient_checkpointing = config.model.gradient_checkpointing
        optimizer = build_optimizer(drafter, config.optim)
        generator = lane_generator(config.train.seed, 0)

        start_step, positions, generator_states = 0, {}, {}
        shards = None
        lanes = config.data.lanes or world.size
        if latest is not None:
            state = ckpt.load_checkpoint(latest, drafter, optimizer, generator)
            start_step = state["step"]
            positions = lane_positions(state["loader"])
            generator_states = ckpt.load_lane_generators(latest)
            if config.data.lanes not in (None, len(positions)):
                raise ConfigError(f"--resume: {latest} deals its samples into {len(positions)} lanes; "
                                  f"data.lanes={config.data.lanes} would deal them anew")
            lanes = len(positions)
            if lanes > 1 and state["loader"].get("lane_deal") != LANE_DEAL:
                raise ConfigError(f"--resume: {latest} dealt its shards to lanes anew every epoch (an older "
                                  "version); this version deals them once per run and cannot continue it exactly: "
                                  "finish it with the version that started it, or start a new run")
            shards = state["loader"]["shards"]
            run_info.update(state.get("run_info", {}))  # how the run first started (e.g. the rule that chose the mask)
            missing = sorted(set(shards) - set(store.committed_shards()))
            if missing:
                raise ValueError(f"--resume: shards {missing[:4]} of the checkpointed run are not in {store.path}")
            log(f"fit: resumed from {latest} at step {start_step} "
                f"({start_step * config.train.sequences_per_step:,} samples trained on), "
                f"{positions[0].describe()}{' (lane 0)' if len(positions) > 1 else ''}")
        config.data.lanes = lanes  # fixed for the run: its config and checkpoints record it
        global_batch = config.train.sequences_per_step
        check_world(world.size, lanes, global_batch, resumed=latest is not None)

        corrupt = CorruptShards(damaged, log)
        check_lanes(store.path, lanes, len(shards or store.committed_shards()))

        def make_loader(lane: int, epochs: int = config.train.epochs) -> ShardLoader:
            return ShardLoader(store, config.data, layer_ids, drafter_config.block_size, seed=config.train.seed,
                               epochs=epochs, position=positions.get(lane), log=log, shards=shards, device=device,
                               lane=lane, lanes=lanes, corrupt=corrupt,
                               cache_share=lanes_per_node(lanes, world.size, local_world_size(world)))

        order = make_loader(0)  # reads nothing: the sample order, to size the run
        epochs = preflight.epochs_for(config.train.max_steps, config.train.epochs,
                                      lambda e: lane_steps(order.lane_totals(e), global_batch), log)
        feed = LaneFeed.for_rank(world, lanes, global_batch, config.train.seed, generator, generator_states,
                                 lambda lane: make_loader(lane, epochs))
        total_steps = config.train.max_steps or lane_steps(order.lane_totals(epochs), global_batch)
        if world.is_main:
            config.save(run_dir)
        store_info = {"store": str(store.path), "fingerprint_sha256": store.fingerprint.sha256(), "layer_ids": layer_ids}
        return cls(config, head, drafter, optimizer, feed, total_steps=total_steps, device=device, start_step=start_step,
                   world=world, store_info=store_info, run_info=run_info, log=log)

    # -- one sequence ------------------------------------------------------------------------
    def run_sequence(self, sample: TrainSample, generator: torch.Generator, noise: float | None = None,
                     replica: torch.nn.Module | None = None):
        """dflash_step on one loader sample: (LossOutput, anchors, BlockTargets).
        `noise` overrides `loss.noise` (the held-out pass scores with 0); `replica`
        defaults to the bare drafter (training steps pass the DDP module)."""
        loss = self.config.loss if noise is None else dataclasses.replace(self.config.loss, noise=noise)
        device = self.device
        with self.autocast():
            return dflash_step(
                replica if replica is not None else self.drafter,
                self.head,
                sample.input_ids.to(device),
                sample.loss_mask.to(device),
                sample.context_features(device),
                loss,
                self.config.model,
                generator,
                target_topk_ids=sample.topk_ids,
                target_topk_logprobs=sample.topk_logprobs,
                step=self.step,
            )

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train until `total_steps` or the data runs out on every rank. Returns the
        last log record. Every rank runs the loop; rank 0 alone writes."""
        train, every = self.config.train, self.config.eval.every
        main = self.world.is_main
        log_path = self.run_dir / LOG_FILE
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            truncate_log(log_path, self.step)
        board = TensorBoardLog(self.run_dir, self.step) if main and self.config.log.tensorboard else None
        trained = samples_log(self.run_dir, self.world.rank) if self.config.log.samples else None
        if trained is not None:
            trained.parent.mkdir(parents=True, exist_ok=True)
            truncate_log(trained, self.step)

        def write(record: dict) -> None:
            append_log(log_path, record)
            if board is not None:
                board.write(record)

        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.drafter.train()
        sums = MetricSums(self.drafter.config.block_size)
        interval_start, wait_start = time.perf_counter(), self.feed.wait_seconds
        last: dict = {}
        progress = fit_progress(self.total_steps, self.step, train.progress_interval, default_mode(main))
        committed = self._committed_state()  # positions and RNGs as of the last completed step
        try:
            while self.step < self.total_steps:
                lr = lr_at(self.step, self.total_steps, self.config.optim)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                slots = self.feed.take(self.step)
                if not self.world.distributed and all(sample is None for _, sample in slots):
                    break  # out of data
                step_sums = self.backward_step([sample for _, sample in slots],
                                               [self.feed.generators[lane] for lane, _ in slots])
                if step_sums.sequences == 0:
                    break  # out of data on every rank
                if trained is not None:
                    for lane, sample in slots:
                        if sample is not None:
                            append_log(trained, {"step": self.step + 1, "lane": lane, "epoch": sample.epoch,
                                                 "sample_id": sample.sample_id})
                clip = self.config.optim.grad_clip or float("inf")  # 0 disables clipping
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
                with sigint_deferred():  # a step is applied whole or not at all
                    self.optimizer.step()
                    self.step += 1
                    committed = self._committed_state()
                sums.merge(step_sums)
                record: dict = {}
                if self.step % train.log_every == 0 or self.step == self.total_steps:
                    elapsed = max(time.perf_counter() - interval_start, 1e-9)
                    record = {
                        "step": self.step,
                        "epoch": self.epoch,
                        "lr": lr,
                        **sums.means(),
                        "grad_norm": grad_norm,
                        "tokens_per_s": sums.tokens / elapsed,
                        "sequences_per_s": sums.sequences / elapsed,
                        "loader_wait_frac": (self.feed.wait_seconds - wait_start) / elapsed,
                        "world_size": self.world.size,
                    }
                    sums = MetricSums(self.drafter.config.block_size)
                if main and every and self.step % every == 0:
                    record = {"step": self.step, "epoch": self.epoch, **record, **self.evaluate()}
                if record and main:
                    write(record)
                    last = record
                    progress.show(**headline(record))
                if record:
                    interval_start, wait_start = time.perf_counter(), self.feed.wait_seconds
                if train.checkpoint_every and self.step % train.checkpoint_every == 0:
                    self.save_checkpoint()
                progress.update(1, tokens=step_sums.tokens, samples=f"{self.step * train.sequences_per_step:,}")
            if main and every and self._last_eval_step != self.step:  # the final model is always evaluated
                began = time.perf_counter()
                self.log(f"fit: evaluating the final drafter on up to {self.config.eval.samples or 'all'} "
                         "held-out sample(s)")
                record = {"step": self.step, "epoch": self.epoch, **self.evaluate()}
                self.log(f"fit: final evaluation done in {time.perf_counter() - began:.1f} s")
                write(record)
                last = {**last, **record}
            if not (train.checkpoint_every and self.step % train.checkpoint_every == 0):
                self.save_checkpoint()
        except KeyboardInterrupt:
            raise TrainingInterrupted(self.step, self.checkpoint_last_step(committed, "interrupted")) from None
        except CorruptShardError as error:
            raise DataStopped(self.step, self.checkpoint_last_step(committed, f"shard {error.shard} is corrupt"),
                              error) from None
        finally:
            progress.close()
            self.feed.close()
            if board is not None:
                board.close()
        if self.feed.skipped_shards:
            self.log(f"skipped corrupt shards (never trained on): {self.feed.skipped_shards}")
        if self.step < self.total_steps:
            empty = sum(loader.skipped_empty for loader in self.feed.loaders.values())
            self.log(f"warning: the data ran out after step {self.step} of the {self.total_steps} planned "
                     f"(the LR schedule was built for {self.total_steps}; {empty} sample(s) had no whole block "
                     "to train on)")
        return last

    def backward_step(self, samples: list[TrainSample | None], generators: list[torch.Generator] | None = None
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
        self.optimizer.zero_grad(set_to_none=True)
        per_step = self.config.loss.normalize == "step"
        sums = MetricSums(self.drafter.config.block_size)
        generators = generators or [self.generator] * len(samples)
        epoch = self.epoch
        for i, (sample, generator) in enumerate(zip(samples, generators)):
            real = sample is not None
            if not real and not self.world.distributed:
                continue  # no replica waits on this process's all-reduce: nothing to pad
            if not real:
                sample, generator = pad_sample(self.drafter.config), torch.Generator().manual_seed(0)
            sync = not self.world.distributed or i == len(samples) - 1  # DDP all_reduces on the last backward only
            with nullcontext() if sync else self.replica.no_sync():
                output, _, targets = self.run_sequence(sample, generator, replica=self.replica)
                scale = float(targets.weight_sum) if per_step else 1.0
                (output.loss * (scale if real else 0.0)).backward()
            if real:
                sums.add(float(output.loss.detach()), output.metrics, targets, sample.num_tokens)
                epoch = max(epoch, sample.epoch)
        sums, self.epoch = reduce_step(self.world, sums, epoch, self.device)
        total = sums.weight if per_step else sums.sequences
        if total > 0:
            divisor = total / self.world.size  # DDP averaged the ranks' gradient sums
            for param in self.drafter.parameters():
                if param.grad is not None:
                    param.grad.div_(divisor)
        return sums

    def release_replica(self) -> None:
        """Drop the DDP module, which must go before its process group does."""
        self.replica = self.drafter

    def evaluate(self) -> dict:
        self._last_eval_step = self.step
        result: dict = {}
        for evaluator in self.evaluators:
            result.update(evaluator(self, self.step))
        return result

    def _committed_state(self) -> tuple:
        """What a checkpoint of the last completed step needs that the next step's
        sampling changes: every lane's position and generator, and the global RNGs."""
        return dict(self.feed.positions), self.feed.generator_states(), ckpt.rng_state(self.generator)

    def checkpoint_last_step(self, committed: tuple, why: str) -> Path | None:
        """After Ctrl-C or a corrupt shard: the checkpoint of the last completed step
        (written now unless it already is, a second Ctrl-C ignored meanwhile).
        Data-parallel runs keep their last periodic checkpoint: writing one needs
        every rank's collective, and the launcher is already stopping them."""
        if self.world.distributed:
            return ckpt.latest_checkpoint(self.run_dir)
        positions, generator_states, rng = committed
        self.feed.positions.update(positions)
        for lane, state in generator_states.items():
            self.feed.generators[lane].set_state(state)
        ckpt.restore_rng(*rng, self.generator)
        done = ckpt.checkpoint_dir(self.run_dir, self.step)
        if ckpt.latest_checkpoint(self.run_dir) == done:
            return done
        self.log(f"{why}: saving a checkpoint of step {self.step}")
        with sigint_deferred(reraise=False):
            return self.save_checkpoint()

    def save_checkpoint(self) -> Path | None:
        """Every rank calls it (each lane's position and generator are gathered);
        rank 0 writes."""
        loader_state, states = self.feed.state_dict(self.world, self.device)
        if not self.world.is_main:
            return None
        generator = torch.Generator()
        generator.set_state(states[0])
        state = {
            "scheduler": {"step": self.step, "total_steps": self.total_steps,
                          "lr": lr_at(max(self.step - 1, 0), self.total_steps, self.config.optim)},
            "loader": loader_state,
            "epoch": self.epoch,
            "drafter_config": self.drafter.config.to_dict(),
            "config": self.config.to_dict(),
            "heldout_split": heldout_record(self.config.data.heldout_fraction),
            "store": self.store_info,
            "run_info": self.run_info,
        }
        return ckpt.save_checkpoint(
            self.run_dir, self.step, self.drafter, self.optimizer, generator, state, keep=self.config.train.keep_checkpoints,
            lane_generators=states,
        )


def _quiet(message: str) -> None:
    """The log of ranks other than 0."""

