"""A run is its parts (issue 34): `Trainer.from_config` leaves the loaded config as it
was and saves a resolved copy; the data feed's `state_dict` / `load_state_dict` put a
fresh feed where another stood; and a checkpoint keeps the layout earlier versions
wrote, so their checkpoints resume."""

from __future__ import annotations

import json
from pathlib import Path

import builders
import pytest
import tiny
import torch

from train.config_loading import load_config
from train.fitting.checkpoint import latest_checkpoint, read_state
from train.fitting.trainer import Trainer
from train.tensor_files import read_tensors

TINY = tiny.drafter_sets(
    "train.grad_accumulation=2",
    "eval.every=0",
    "data.heldout_fraction=0.0",
    "data.buffer_shards=1",
    "train.checkpoint_every=0",
    "data.lanes=2",
    heads=True,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory, qwen3_dir) -> Path:
    path = tmp_path_factory.mktemp("parts") / "store"
    builders.random_store(
        path,
        num_shards=4,
        samples_per_shard=3,
        target_dir=qwen3_dir,
        num_target_layers=6,
        hidden_size=64,
        vocab_size=512,
    )
    return path


def build(store, target, out, max_steps=3) -> Trainer:
    config = load_config(
        None, TINY, store=str(store), target=str(target), out=str(out), **{"train.max_steps": max_steps}
    )
    return Trainer.from_config(config, log=lambda m: None)


def test_the_loaded_config_is_left_as_it_was_and_the_resolved_one_saved(store, qwen3_dir, tmp_path):
    config = load_config(
        None,
        [*TINY, "data.lanes=null"],
        store=str(store),
        target=str(qwen3_dir),
        out=str(tmp_path / "run"),
        **{"train.max_steps": 1},
    )
    before = config.to_dict()
    trainer = Trainer.from_config(config, log=lambda m: None)
    trainer.feed.close()
    assert config.to_dict() == before and config.data.lanes is None and config.model.mask_token_id is None
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["lanes"] == trainer.config.data.lanes == 1
    assert saved["model"]["mask_token_id"] == trainer.config.model.mask_token_id == trainer.drafter.config.mask_token_id


def test_a_fresh_feed_continues_where_another_stood(store, qwen3_dir, tmp_path):
    first = build(store, qwen3_dir, tmp_path / "first")
    taken = [first.feed.take(step) for step in range(2)]
    state = first.feed.state_dict()
    after = [(lane, sample.sample_id) for lane, sample in first.feed.take(2)]
    draws = {lane: torch.randint(0, 1 << 30, (4,), generator=g).tolist() for lane, g in first.feed.generators.items()}
    first.feed.close()
    assert all(sample is not None for slots in taken for _, sample in slots)

    second = build(store, qwen3_dir, tmp_path / "second")
    second.feed.load_state_dict(state)
    assert [(lane, sample.sample_id) for lane, sample in second.feed.take(2)] == after
    assert {
        lane: torch.randint(0, 1 << 30, (4,), generator=g).tolist() for lane, g in second.feed.generators.items()
    } == draws
    second.feed.close()


def test_a_checkpoint_keeps_the_layout_earlier_versions_wrote(store, qwen3_dir, tmp_path):
    """The files and keys `--resume` of every version reads: weights, optimizer moments
    by parameter name, the global RNGs and each lane's generator, and state.json's records."""
    trainer = build(store, qwen3_dir, tmp_path / "run", max_steps=2)
    trainer.fit()
    path = latest_checkpoint(tmp_path / "run")
    assert sorted(p.name for p in path.iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
    ]
    names = {name for name, _ in trainer.drafter.named_parameters()}
    assert set(read_tensors(path / "model.safetensors")) == set(trainer.drafter.state_dict())
    assert {key.rsplit("/", 1)[0] for key in read_tensors(path / "optimizer.safetensors")} <= names
    assert {"torch_cpu", "numpy_key", "generator", "generator_lane_1"} <= set(read_tensors(path / "rng.safetensors"))
    state = read_state(path)
    assert {
        "step",
        "epoch",
        "scheduler",
        "loader",
        "optimizer",
        "rng",
        "drafter_config",
        "config",
        "heldout_split",
        "store",
        "run_info",
    } <= set(state)
    assert state["step"] == 2 and set(state["optimizer"]) == {"param_groups", "scalars"}
    assert set(state["rng"]) == {"numpy", "python"}
    assert {"position", "shards", "shards_sha256", "skipped_shards", "world_size", "lane_deal", "lanes"} <= set(
        state["loader"]
    )
    assert [entry["lane"] for entry in state["loader"]["lanes"]] == [0, 1]


def test_adamw_is_fused_on_cuda_and_per_parameter_elsewhere(store, qwen3_dir, tmp_path):
    """Issue 60.4, by configuration (no GPU here): the fused kernel on CUDA; on CPU the
    per-parameter loop the exact-resume checks were measured with, as built by `fit`."""
    from train.fitting.optimizer import adamw_implementation

    assert adamw_implementation("cuda") == {"fused": True}
    assert adamw_implementation("cpu") == {"foreach": False}
    optimizer = build(store, qwen3_dir, tmp_path / "run").optimizer.adamw
    assert optimizer.defaults["foreach"] is False and not optimizer.defaults["fused"]


def test_the_clip_divides_and_clips_in_one_multiply_as_clip_grad_norm_does():
    """Issue 60.4: the step's divide folded into the clip, the norm left on the device:
    the same gradients and norm as dividing, then `clip_grad_norm_`."""
    from train.fitting.config import OptimConfig
    from train.fitting.optimizer import Optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    sums = [torch.randn_like(p) * 5 for p in model.parameters()]
    for clip, divisor in ((1.0, torch.tensor(7.5)), (1.0, 1.0), (0.0, torch.tensor(3.0)), (1e3, 2.0)):
        expected = [torch.nn.Parameter(torch.zeros_like(g)) for g in sums]
        for p, g in zip(expected, sums):
            p.grad = g / divisor
        reference = torch.nn.utils.clip_grad_norm_(expected, clip or float("inf"))
        for p, g in zip(model.parameters(), sums):
            p.grad = g.clone()
        norm = Optimizer(model, OptimConfig(grad_clip=clip), 10).clip(divisor)
        assert isinstance(norm, torch.Tensor) and float(norm) == pytest.approx(float(reference), rel=1e-6)
        for p, want in zip(model.parameters(), expected):
            assert want.grad is not None and torch.allclose(p.grad, want.grad, rtol=1e-6, atol=1e-7)


def test_gradients_cross_pcie_in_bf16_and_nvlink_in_fp32():
    """Issue 60.4: `train.grad_allreduce=auto` reads the GPUs' links from `nvidia-smi topo -m`
    (its matrix as printed on an NVLink host and on a PCIe one); a setting is taken as given,
    bf16 only where DDP's bf16 hook runs (CUDA: gpu_check's DDP phase runs it)."""
    from train.config_error import ConfigError
    from train.fitting.distributed import gradient_allreduce, topology_has_nvlink
    from train.world import World

    nvlink = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV18\t0-55\t0\t\tN/A\n"
        "GPU1\tNV18\t X \t0-55\t0\t\tN/A\n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set"
    )
    pcie = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPHB\t0-31\nGPU1\tPHB\t X \t0-31\n\nLegend:\n  NV#  = NVLink"
    assert topology_has_nvlink(nvlink) is True and topology_has_nvlink(pcie) is False
    assert topology_has_nvlink("NVIDIA-SMI has failed") is None
    two = World(rank=0, size=2)
    assert gradient_allreduce("bf16", World(), torch.device("cpu"))[0] == "bf16"  # one process: nothing sent
    with pytest.raises(ConfigError, match="config train.grad_allreduce: bf16 needs CUDA GPUs"):
        gradient_allreduce("bf16", two, torch.device("cpu"))
    assert gradient_allreduce("auto", two, torch.device("cpu")) == ("fp32", "auto: no GPU all-reduce to compress")
