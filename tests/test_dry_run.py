"""The Qwen3.6-27B job on paper (issue 27.2): `extract plan --dry-run` and `train fit
--dry-run` on a config-only directory (the published architecture's config.json and
the real-vocabulary tokenizer; the models are built on the meta device) print figures
that equal the hand computations written out here."""

from __future__ import annotations

import json
import math

import builders
import pytest
from paths import REPO

from store_schema.dtypes import FP8_E4M3_STORE, STORE_DTYPES
from train.data.config import DataConfig

pytestmark = pytest.mark.slow  # the real vocabulary (~30 s to build)

GIB = 2**30
H, I, V = 5120, 17408, 248_320  # noqa: E741 - hidden, intermediate, embedding rows, as the papers name them
MLP = 3 * H * I
LINEAR_LAYER = (
    H * (10240 + 6144 + 48 + 48)  # in_proj qkv (2 x 16 x 128 + 48 x 128), z (48 x 128), b, a
    + 10240 * 4
    + 48
    + 48
    + 128  # conv1d (kernel 4), dt_bias, A_log, gated norm
    + 6144 * H
    + MLP
    + 2 * H
)  # out_proj, MLP, the two layer norms
FULL_LAYER = (
    H * (2 * 24 * 256 + 2 * 4 * 256)  # q_proj (query + output gate), k_proj, v_proj
    + 24 * 256 * H
    + 2 * 256
    + MLP
    + 2 * H
)  # o_proj, q/k norms, MLP, layer norms
LAYERS = [5, 19, 33, 47, 61]  # the default drafter's (DFlash 2's) published taps (issue 62.1)


@pytest.fixture(scope="module")
def qwen3_6_27b(real_vocab_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_6_27b")
    from extract.__main__ import main as extract_cli

    model = root / "model"  # through its CLI, as the README tells a user to make it
    assert extract_cli(["config-only-target", str(model), "--tokenizer", str(real_vocab_tokenizer_dir)]) == 0
    corpus = builders.write_chat_jsonl(root / "corpus.jsonl", builders.real_vocab.tool_call_chats(12))
    return model, corpus


def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plan_dry_run_sizes_the_27b_extraction(qwen3_6_27b, capsys):
    from extract.__main__ import main

    model, corpus = qwen3_6_27b
    assert (
        main(
            [
                "plan",
                "--dry-run",
                "--json",
                "--model",
                str(model),
                "--corpus",
                str(corpus),
                "--tokenizer-workers",
                "1",
                "--gpu-memory",
                "96",
                "--tokens-per-s",
                "20000",
                "--gpus",
                "8",
                "--gpu-tflops",
                "500",
            ]
        )
        == 0
    )
    report = _json_out(capsys)
    job = report["job"]
    assert report["layer_ids"] == LAYERS and job["loaded_layers"] == 62  # decoder layers 0..61, not 62-63
    full = len(range(3, 62, 4))  # layers 3, 7, .., 59
    assert full == 15
    embed = V * H * 2
    layers = 2 * ((62 - full) * LINEAR_LAYER + full * FULL_LAYER)
    assert job["embed_bytes"] == embed and job["layer_bytes"] == layers
    assert job["layer_bytes_by_kind"] == {"linear_attention": 2 * LINEAR_LAYER, "full_attention": 2 * FULL_LAYER}
    weights = embed + layers + 2 * H  # + the final norm
    assert job["weights_bytes"] == weights
    per_token = 2 * (2 * H + 3 * I) + 5 * H * 2  # the MLP's transients + five captured layers, bf16
    assert job["activation_bytes_per_token"] + job["capture_bytes_per_token"] == per_token == 176_128
    assert job["peak_gpu_bytes"] == weights + 2 * GIB + per_token * 16384
    assert job["fits"] is True
    assert job["largest_batch_tokens"] == (96 * GIB - weights - 2 * GIB) // per_token // 1024 * 1024 == 289_792
    raw_token = 5 * H * 2 + 4 + 1
    assert job["store_bytes"]["raw"] == report["tokens"] * raw_token
    assert job["store_bytes"]["fp8_e4m3"] == round(report["tokens"] * raw_token * 0.351)
    assert job["store_dtype"] == "bfloat16"  # sized with each dtype's measured per-core write rate
    assert job["writer_cores_per_gpu_by_dtype"] == {
        dtype.name: math.ceil(20000 * raw_token / (dtype.write_mb_s_per_core * 1e6)) for dtype in STORE_DTYPES.values()
    }
    assert job["writer_cores_per_gpu"] == job["writer_cores_per_gpu_by_dtype"]["bfloat16"]
    assert job["job_hours"] == round(report["tokens"] / (20000 * 8) / 3600, 3)
    stored = job["store_bytes"]  # the job's sustained writes: 8 GPUs' raw bytes, and as each dtype writes them
    assert job["write_bytes_per_s"] == {
        "raw": 20000 * 8 * raw_token,
        **{name: round(20000 * 8 * raw_token * stored[name] / stored["raw"]) for name in STORE_DTYPES},
    }
    assert job["forward_flops_per_token"] == 2 * (layers + 2 * H) // 2  # 2 FLOPs per loaded weight, embedding aside
    assert job["gpu_utilisation"] == round(20000 * (layers + 2 * H) / 500e12, 3)


def test_plan_dry_run_says_the_write_rate_and_warns_of_an_optimistic_rate(qwen3_6_27b, capsys):
    """Issue 35.8's figures: 9000 tokens/s on a ~500 TFLOPS GPU is ~85 % of its peak."""
    from extract.__main__ import main

    model, corpus = qwen3_6_27b
    argv = [
        "plan",
        "--dry-run",
        "--model",
        str(model),
        "--corpus",
        str(corpus),
        "--tokenizer-workers",
        "1",
        "--tokens-per-s",
        "9000",
        "--gpus",
        "8",
    ]
    assert main([*argv, "--gpu-tflops", "500"]) == 0
    lines = capsys.readouterr().out.splitlines()
    writes = next(line for line in lines if line.startswith("writes"))
    assert writes.startswith("writes      3.69 GB/s raw to the store's filesystem for ") and (
        "(2.26 GB/s compressed bf16, 1.29 GB/s fp8)" in writes
    ), writes
    gpu = next(line for line in lines if line.startswith("GPU"))
    assert " is 85% of a 500 TFLOPS GPU; warning: above 60%, rarely sustained" in gpu, gpu
    assert main([*argv, "--gpu-tflops", "2000"]) == 0  # 21 %: no warning
    gpu = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("GPU"))
    assert gpu.endswith(" is 21% of a 2000 TFLOPS GPU"), gpu
    assert main([*argv, "--store-dtype", "fp8_e4m3"]) == 0  # writer cores at fp8's own measured rate
    job = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("job"))
    cores = math.ceil(9000 * (5 * 5120 * 2 + 5) / (FP8_E4M3_STORE.write_mb_s_per_core * 1e6))
    assert cores == 1  # issue 47.1: one core writes what a GPU extracts into an fp8 store
    assert f"writer cores per GPU: {cores} for fp8_e4m3 (~{FP8_E4M3_STORE.write_mb_s_per_core:g} MB/s" in job, job


def test_plan_dry_run_says_the_traffic_and_rate_a_cached_store_must_deliver(qwen3_6_27b, capsys):
    """Issue 33.7: with --cache-size, per store dtype the bytes an epoch fetches past the
    cache (the shards that do not stay pinned beside room for two streamed ones) and
    the rate that is at --train-tokens-per-s."""
    from extract.__main__ import main

    model, corpus = qwen3_6_27b
    argv = [
        "plan",
        "--dry-run",
        "--model",
        str(model),
        "--corpus",
        str(corpus),
        "--tokenizer-workers",
        "1",
        "--shard-tokens",
        "2048",
        "--train-tokens-per-s",
        "1000",
    ]
    assert main([*argv, "--json", "--cache-size", "100MB"]) == 0
    report = _json_out(capsys)
    cache, stored, tokens = report["job"]["cache"], report["job"]["store_bytes"], report["tokens"]
    assert cache["cache_bytes"] == 100 * 10**6 and cache["train_tokens_per_s"] == 1000
    for dtype in ("bfloat16", "fp8_e4m3"):
        shard = cache[dtype]["largest_shard_bytes"]
        assert 0 < shard <= stored[dtype] * 2048 // tokens  # the largest shard holds <= 2048 tokens
        pinned = min(stored[dtype], max(0, 100 * 10**6 - 2 * shard))  # beside room for two streamed shards
        traffic = 0 if stored[dtype] <= 100 * 10**6 else stored[dtype] - pinned
        assert cache[dtype]["traffic_bytes_per_epoch"] == traffic, dtype
        assert cache[dtype]["bytes_per_s"] == round(traffic * 1000 / tokens)
    assert main([*argv, "--cache-size", "1TB"]) == 0  # the whole store stays in the cache
    lines = capsys.readouterr().out.splitlines()
    assert "cache       1.00 TB per node, training at 1,000 tokens/s (--train-tokens-per-s)" in lines
    assert "  bfloat16  0 B per epoch from the store, 0 B/s sustained" in lines
    with pytest.raises(SystemExit) as usage:  # not a size: a usage error naming the flag
        main([*argv, "--cache-size", "lots"])
    assert usage.value.code == 2 and "argument --cache-size: 'lots' is not a size" in capsys.readouterr().err


def test_plan_dry_run_trains_at_the_pace_fit_dry_run_computes(qwen3_6_27b, tmp_path, capsys):
    """Issue 62.4: one pace. Without --train-tokens-per-s, --cache-size's rate is what
    `train fit --dry-run` computes for the default drafter on --gpus GPUs at
    --gpu-tflops x --mfu, said with its rule; with neither, a usage error naming both."""
    from extract.__main__ import main
    from train.cli import main as train_main

    model, corpus = qwen3_6_27b
    argv = ["plan", "--dry-run", "--model", str(model), "--corpus", str(corpus), "--cache-size", "25TB"]
    assert main([*argv, "--tokenizer-workers", "1", "--gpus", "8", "--gpu-tflops", "989", "--json"]) == 0
    cache = _json_out(capsys)["job"]["cache"]
    fit = ["fit", "--dry-run", "--target", str(model), "--out", str(tmp_path / "run"), "--nproc", "8"]
    assert train_main([*fit, "--samples", "1", "--gpu-tflops", "989"]) == 0
    per_gpu = _json_out(capsys)["tokens_per_s"]
    assert cache["train_tokens_per_s"] == pytest.approx(8 * per_gpu)
    assert cache["train_rate_rule"].startswith("`train fit --dry-run` for the default dflash2 drafter: 8 GPU(s) x ")
    assert "MFU 0.4" in cache["train_rate_rule"]
    assert main([*argv, "--tokenizer-workers", "1"]) == 2  # a usage error
    assert "--train-tokens-per-s N, or --gpu-tflops TFLOPS" in capsys.readouterr().err


def test_plan_dry_run_names_a_gpu_too_small(qwen3_6_27b, capsys):
    from extract.__main__ import main

    model, corpus = qwen3_6_27b
    assert (
        main(
            [
                "plan",
                "--dry-run",
                "--model",
                str(model),
                "--corpus",
                str(corpus),
                "--tokenizer-workers",
                "1",
                "--gpu-memory",
                "48",
                "--batch-tokens",
                "32768",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "does NOT fit in 48 GiB; the largest --batch-tokens that fits: 0" in out  # 46.3 GiB weights + reserve


def test_fit_dry_run_sizes_the_27b_drafter(qwen3_6_27b, tmp_path, capsys):
    from train.cli import main

    model, _ = qwen3_6_27b
    assert (
        main(
            [
                "fit",
                "--dry-run",
                "--target",
                str(model),
                "--nproc",
                "8",
                "--samples",
                "902000",
                "--tokens-per-s",
                "20000",
                "--gpu-memory",
                "96",
                "--set",
                "model.architecture=dflash",
            ]
        )
        == 0
    )  # no --out: nothing is written anyway
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    q, kv = 32 * 128, 8 * 128  # the published drafter: 32 heads x 128, 8 KV heads
    layer = 2 * H * q + 2 * H * kv + 2 * 128 + MLP + 2 * H  # q, o, k, v, q/k norms, MLP, layer norms
    params = 5 * layer + 5 * H * H + 2 * H  # 5 layers, fc over 5 context layers, hidden_norm + final norm
    assert report["drafter_parameters"] == params == 1_730_213_120
    assert report["state_bytes"] == {
        "weights": 4 * params,
        "gradients": 4 * params,
        "adam_moments": 8 * params,
        "ddp_buckets": 0,  # the gradients are views into DDP's buckets
    }
    assert report["mask_token_id"] == 248_070 and report["mask_token_rule"] == "first_unused_row"
    assert report["target_head_bytes"] == 2 * V * H * 2  # embed_tokens + lm_head, bf16
    assert report["loss_chunk_bytes"] == 1024 * V * 16  # fp32 logits, log-probs, gradient + one buffer
    block_token = 2 * ((H + 4 * I) + (H + 4 * q + 4 * kv)) + 2 * 4 * H
    context_token = 2 * (5 * H + 5 * (H + 2 * kv))
    activations = report["activations"]
    assert activations["per_block_token_layer"] == block_token and activations["per_context_token"] == context_token
    assert activations["bytes"] == 512 * 16 * 5 * block_token + 3072 * context_token
    assert report["peak_gpu_bytes"] == 16 * params + 2 * V * H * 2 + 1024 * V * 16 + activations["bytes"]
    training = round(902000 * (1 - DataConfig.heldout_fraction))  # issue 48.10: an epoch is the training split
    assert report["training_samples"] == training and report["sequences_per_gpu_per_step"] == 1
    # one sequence per GPU a step: the optimizer's and the all-reduce's bytes, and a warning
    assert report["optimizer_bytes_per_step"] == 7 * 4 * params  # fused AdamW: 4 fp32 tensors read, 3 written
    assert report["allreduce_bytes_per_step"] == 4 * params and report["allreduce_dtype"] == "fp32"
    assert report["allreduce_wire_bytes_per_gpu"] == round(2 * 7 / 8 * 4 * params)
    assert "warning: each GPU trains 1 sequence(s) a step, then waits on the optimizer and the all-reduce" in out
    assert report["steps_per_epoch"] == math.ceil(training / 8)
    assert report["total_steps"] == 6 * math.ceil(training / 8) and report["total_steps_rule"] == "6 epochs"
    assert report["run_tokens"] == 6 * math.ceil(training / 8) * 8 * 3072  # no store: data.max_length long
    assert report["run_hours"] == round(report["run_tokens"] / (20000 * 8) / 3600, 3)
    assert report["fits"] is True and report["peak_gpu_bytes"] <= 96 * GIB
    assert "            fits in 96 GiB per GPU" in out and f"time        {report['run_hours']:.2f} h on 8 GPU(s)" in out
    assert main(["fit", "--dry-run", "--target", str(model), "--max-steps", "1000", "--gpu-memory", "40"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["total_steps"] == 1000 and report["fits"] is False and report["peak_gpu_bytes"] > 40 * GIB
    assert "does NOT fit in 40 GiB per GPU" in out and "run_hours" not in report
    assert report["allreduce_bytes_per_step"] == 0 and "warning: each GPU" not in out  # 8 sequences, one GPU


def test_fit_dry_run_sizes_the_27b_dflash2_drafter(qwen3_6_27b, tmp_path, capsys):
    """Issue 32.9: DFlash 2, the default architecture, at the published 27B shape
    (SpecForge's qwen3.6-27b-dflash2: 1.92B parameters, ~127M of them the two V x 256
    codebooks), counted by formula."""
    from train.cli import main

    model, _ = qwen3_6_27b
    assert (
        main(
            [
                "fit",
                "--dry-run",
                "--target",
                str(model),
                "--out",
                str(tmp_path / "run"),
                "--nproc",
                "8",
                "--samples",
                "902000",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    q, kv = 32 * 128, 8 * 128
    layer = 2 * H * q + 2 * H * kv + 2 * 128 + MLP + 2 * H
    backbone = 5 * layer + 5 * H * H + 2 * H
    k, g, r = 2, 16, 256  # conv_kernel_size, conv_group_size, selector_rank
    conv = 2 * k * H + H * (2 * k * H // g)  # base_kernel [2, k, H] + kernel_projection H -> 2k H/g
    convolutions = 5 * 2 * conv  # attention_conv and mlp_conv in each of 5 layers
    codebooks, projection = 2 * V * r, r * H
    params = backbone + convolutions + codebooks + projection
    assert report["architecture"] == "dflash2"
    assert report["parameter_groups"] == {
        "backbone": backbone,
        "convolutions": convolutions,
        "selector_codebooks": codebooks,
        "selector_projection": projection,
    }
    assert codebooks == 127_139_840 and report["drafter_parameters"] == params == 1_924_404_480
    assert report["state_bytes"] == {
        "weights": 4 * params,
        "gradients": 4 * params,
        "adam_moments": 8 * params,
        "ddp_buckets": 0,  # the gradients are views into DDP's buckets
    }
    block_token = 2 * ((H + 4 * I) + (H + 4 * q + 4 * kv)) + 2 * 4 * H
    block_token += 2 * 2 * 2 * k * (H + H // g)  # 2 convolutions x bf16 x 2 sides x k taps (rows + coefficients)
    context_token = 2 * (5 * H + 5 * (H + 2 * kv))
    activations = report["activations"]
    assert activations["per_block_token_layer"] == block_token
    assert activations["bytes"] == 512 * 8 * 5 * block_token + 3072 * context_token
    assert report["peak_gpu_bytes"] == 16 * params + 2 * V * H * 2 + 1024 * V * 16 + activations["bytes"]
    assert "selector codebooks 127,139,840 (2 x V x r)" in out
    # Issue 45.1: the published DFlash 2 layout for this family, with its source
    assert report["block_size"] == 8 and report["layer_types"] == ["sliding_attention"] * 5
    assert report["is_causal"] is False and report["context_layer_ids"] == [5, 19, 33, 47, 61]
    assert (
        "fit: the published dflash2 layout for Qwen3.5/3.6/3.8 at 27B (64 layers, hidden 5120): block 8, 5 layers "
        "(5 sliding, window 2048), non-causal, taps [5, 19, 33, 47, 61]; from z-lab Qwen3.8-27B-DFlash2 = "
        "SpecForge configs/qwen3.6-27b-dflash2.json"
    ) in out
    assert not (tmp_path / "run").exists()


def test_fit_dry_run_prints_hours_from_flops_and_refuses_a_rate_above_the_peak(qwen3_6_27b, capsys):
    """Issue 48.4: a sample's training FLOPs by hand (matmuls, 2 per multiply-add; the
    drafter's forward x 3, the frozen head's x 2), the rate at --gpu-tflops x --mfu, and
    a --tokens-per-s no GPU reaches refused as impossible."""
    from train.cli import main

    model, _ = qwen3_6_27b
    argv = ["fit", "--dry-run", "--target", str(model), "--nproc", "8", "--samples", "902000", "--gpu-tflops", "989"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    q, kv, k, g, r, T = 32 * 128, 8 * 128, 2, 16, 256, 3072
    per_layer = 2 * (2 * H * q + 2 * H * kv + 3 * H * I) + 2 * 2 * (2 * k * (H // g)) * H
    B = 8  # the published DFlash 2 layout's block (issue 45.1)
    attention = 5 * 2 * 2 * q * (T / 2 + B)  # five sliding layers, window 2048 > T / 2
    context = T * (2 * 5 * H * H + 5 * 2 * 2 * H * kv)
    drafter = 512 * B * (5 * per_layer + attention) + context + 512 * (B - 1) * 2 * H * r
    total = 3 * drafter + 2 * 512 * (B - 1) * 2 * H * V
    assert report["flops_per_sample"] == pytest.approx(total, rel=1e-9) and 55e12 < total < 70e12
    assert report["tokens_per_s"] == pytest.approx(989e12 * 0.4 / total * T, abs=0.1)
    assert report["run_hours"] == round(report["run_tokens"] / (report["tokens_per_s"] * 8) / 3600, 3)
    assert 25 < report["run_hours"] < 35 and "(--gpu-tflops 989 at MFU 0.4;" in out
    assert main([*argv, "--tokens-per-s", "80000"]) == 1  # 80K x 64 TFLOP / 3,072 tokens: above 989 TFLOP/s
    assert "--tokens-per-s 80000 is impossible" in capsys.readouterr().err


def test_the_commands_config_only_target_prints_run_as_printed(tmp_path, capsys):
    """Issue 48.7: with a tokenizer, both `next:` lines run (CORPUS.jsonl standing for a
    corpus); without one, the fit line runs as printed and the tokenizer hint's commands
    make a directory that `plan --dry-run` takes."""
    import shlex
    import subprocess
    import sys

    from extract.__main__ import main as extract_cli
    from store_schema.__main__ import main as store_cli
    from train.cli import main as train_cli

    clis = {"extract": extract_cli, "train": train_cli, "store_schema": store_cli}
    corpus = builders.write_chat_jsonl(tmp_path / "corpus.jsonl", builders.real_vocab.tool_call_chats(12))

    def run_printed(line: str) -> dict:
        words = shlex.split(line.replace("CORPUS.jsonl", str(corpus)))
        assert words[:2] == ["python", "-m"], line
        assert clis[words[2]](words[3:] + (["--json"] if words[2] == "extract" else [])) == 0, line
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert extract_cli(["config-only-target", str(tmp_path / "bare")]) == 0
    printed = capsys.readouterr().out.splitlines()
    fit = run_printed(printed[-1].removeprefix("next: "))
    assert fit["run_hours"] > 0 and fit["mask_token_id"] == 248_070 and fit["gpus"] == 8
    hint = printed[1].split("offline: ", 1)[1]
    make_tokenizer, remake = hint.split(" && ")
    words = shlex.split(make_tokenizer.replace("TOK", str(tmp_path / "tok")))
    assert words[:2] == ["python", "scripts/real_vocab.py"]
    repo = REPO
    subprocess.run([sys.executable, *words[1:]], cwd=repo, check=True, capture_output=True, timeout=300)
    assert extract_cli(shlex.split(remake.replace("TOK", str(tmp_path / "tok")))[3:]) == 0
    printed = capsys.readouterr().out.splitlines()
    planned = run_printed(printed[-2].removeprefix("next: "))
    assert planned["layer_ids"] == LAYERS and planned["samples"] > 0
    assert run_printed(printed[-1].strip())["mask_token_id"] == 248_070


def test_fit_dry_run_sizes_the_27b_eagle3_drafter(qwen3_6_27b, tmp_path, capsys):
    """Issue 63.4: EAGLE-3 for the 27B target, counted by formula: `fc` over three layers,
    one Llama layer at the target's attention geometry (24 x 256 queries, 4 x 256 keys)
    over the 2H-wide [embedding | hidden] row, four norms, a 32,000-token head."""
    from train.cli import main

    model, _ = qwen3_6_27b
    argv = ["fit", "--dry-run", "--target", str(model), "--out", str(tmp_path / "run"), "--nproc", "8"]
    assert main([*argv, "--samples", "902000", "--gpu-tflops", "989", "--set", "model.architecture=eagle3"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    q, kv, draft_vocab = 24 * 256, 4 * 256, 32_000
    params = 3 * H * H + 2 * H * q + 2 * 2 * H * kv + q * H + MLP + 4 * H + draft_vocab * H
    assert report["architecture"] == "eagle3" and report["drafter_parameters"] == params
    assert report["draft_vocab_size"] == draft_vocab and report["ttt_steps"] == 7
    assert report["context_layer_ids"] == [1, 31, 60]  # vLLM's default aux layers (2, 32, 61), in this project's ids
    per_position = 2 * (2 * H + 3 * q + 4 * kv + H + 4 * I) + 3 * 4 * H + 3 * 4 * draft_vocab
    scores = 24 * 3072 * 3072 * 8
    assert report["activations"]["bytes"] == 7 * (3072 * per_position + scores)
    assert "EAGLE-3 (1 layer), aux layers [1, 31, 60], draft vocabulary 32,000, training-time test 7 steps" in out
    assert report["tokens_per_s"] > 0 and report["run_hours"] > 0
