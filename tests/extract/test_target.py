"""The target-model runner against real transformers forwards of tiny real models."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from extract.extraction.runner import TargetRunner
from extract.jobs.batching import batches_by_length
from extract.jobs.kernels import kernel_report
from extract.jobs.target import load_target
from store_schema.dtypes import FP4_E2M1_STORE, FP8_E4M3_STORE
from store_schema.runtime.target_model import decoder_layers

# Mixed lengths: 1 token, shorter and longer than the gated-delta-rule chunk (64),
# and the longest defines the padded width of the batch.
LENGTHS = [37, 1, 90, 64, 13]


def _sequences(lengths, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]


def _token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str):
    """cosine >= 0.9999 per token, comparing bf16 values (what the store keeps)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == torch.bfloat16, what
    cosine = _token_cosine(actual, expected.to(torch.bfloat16))
    assert cosine.min() >= 0.9999, f"{what}: min cosine {cosine.min():.6f} at token {int(cosine.argmin())}"


def _reference_hidden_states(model_dir, kind, sequence):
    """A direct transformers forward of the checkpoint as saved, all hidden states."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    cls = Qwen3_5ForConditionalGeneration if kind == "qwen3_5_vl" else AutoModelForCausalLM
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.from_numpy(sequence.astype(np.int64))[None]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return out.hidden_states, out.logits[0]


@pytest.fixture(scope="module")
def targets(qwen3_dir, qwen3_5_dir, qwen3_5_vl_dir):
    dirs = {"qwen3": qwen3_dir, "qwen3_5": qwen3_5_dir, "qwen3_5_vl": qwen3_5_vl_dir}
    return {kind: (path, load_target(path)) for kind, path in dirs.items()}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "qwen3_5_vl"])
def test_captured_layers_equal_transformers_hidden_states(targets, kind):
    path, target = targets[kind]
    n = target.num_layers
    layer_ids = [0, 2, n - 2]
    sequence = _sequences([70], seed=1)[0]
    expected, _ = _reference_hidden_states(path, kind, sequence)
    assert len(expected) == n + 1

    (out,) = TargetRunner(target, layer_ids).run_batch([sequence])

    assert sorted(key for key in out if isinstance(key, int)) == layer_ids
    assert out["nonfinite"].shape == (len(layer_ids), 70) and not out["nonfinite"].any()
    for layer_id in layer_ids:
        _assert_close(out[layer_id], expected[layer_id + 1][0], f"{kind} layer {layer_id}")
    # The convention is not off by one: layer L's output is not hidden_states[L].
    assert _token_cosine(out[2], expected[2][0]).min() < 0.999


def test_load_defaults_and_multimodal_layout_loads_language_model_only(targets):
    _, target = targets["qwen3_5_vl"]
    assert target.dtype == torch.float32 and target.device.type == "cpu"
    assert target.checkpoint_architectures == ["Qwen3_5ForConditionalGeneration"]
    assert target.architecture == "Qwen3_5ForCausalLM"
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (8, 64, 512)
    names = [name for name, _ in target.model.named_parameters()]
    assert not [name for name in names if "visual" in name]
    # Same parameter count as the text-only model of the same text config.
    _, text_only = targets["qwen3_5"]
    assert sum(p.numel() for p in target.model.parameters()) == sum(p.numel() for p in text_only.model.parameters())
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_batched_right_padding_equals_one_at_a_time(targets, kind):
    _, target = targets[kind]
    runner = TargetRunner(target, [1, 3, target.num_layers - 2])
    sequences = _sequences(LENGTHS, seed=2)

    batched = runner.run_batch(sequences)

    assert len(batched) == len(sequences)
    for i, sequence in enumerate(sequences):
        (single,) = runner.run_batch([sequence])
        for layer_id in runner.layer_ids:
            # no padded position is ever returned, and pads never reach real positions
            assert batched[i][layer_id].shape == (len(sequence), target.hidden_size)
            assert batched[i][layer_id].device.type == "cpu"
            _assert_close(batched[i][layer_id], single[layer_id], f"{kind} sample {i} layer {layer_id}")


def test_leaked_context_would_break_the_batched_tolerance(targets):
    """The batched test can only fail if leakage is visible at its tolerance: show
    that real positions of the hybrid model change beyond it when anything precedes
    them in the row (as pads would with left padding), both after linear-attention
    layers only (layer 0: conv1d + gated delta rule) and after full attention."""
    _, target = targets["qwen3_5"]
    runner = TargetRunner(target, [0, target.num_layers - 2])
    short, long = _sequences([20, 50], seed=3)
    (alone,) = runner.run_batch([short])
    (prefixed,) = runner.run_batch([np.concatenate([long[:30], short])])
    for layer_id in runner.layer_ids:
        assert _token_cosine(prefixed[layer_id][30:], alone[layer_id]).min() < 0.9999, layer_id


@pytest.mark.parametrize("store_dtype", [FP8_E4M3_STORE, FP4_E2M1_STORE], ids=lambda d: d.name)
def test_quantized_states_are_those_of_the_bf16_ones_held_channel_major(targets, store_dtype):
    """An fp8 or fp4 store's runner quantizes on the device: each sample's codes and
    scales are those of its bf16 states, in a batch of mixed lengths; the codes are
    held channel-major (tokens contiguous), the layout the store's `channels` codec
    cuts its streams from."""
    _, target = targets["qwen3"]
    sequences = _sequences(LENGTHS, seed=5)
    plain = TargetRunner(target, [1, 3]).run_batch(sequences)
    quantized = TargetRunner(target, [1, 3], store_dtype=store_dtype).run_batch(sequences)
    for bf16, coded in zip(plain, quantized):
        for layer_id in (1, 3):
            codes, scales = store_dtype.lossy.quantize(bf16[layer_id])
            assert coded[layer_id].shape == tuple(bf16[layer_id].shape)
            assert coded[layer_id].codes.stride(0) == 1 or len(codes) == 1
            assert torch.equal(coded[layer_id].codes.view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(coded[layer_id].scales, scales)


def test_forward_stops_after_last_needed_layer(targets):
    _, target = targets["qwen3_5"]
    layers = decoder_layers(target.model)
    calls = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, layer in enumerate(layers)]
    try:
        TargetRunner(target, [1, 3]).run_batch(_sequences([10, 20], seed=4))
        assert calls == [0, 1, 2, 3]
        calls.clear()
        TargetRunner(target, [1, 3], topk=2).run_batch(_sequences([10], seed=4))
        assert calls == list(range(target.num_layers))  # top-k needs the whole forward
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_vl"])
def test_topk_matches_full_model_logits(targets, kind, monkeypatch):
    path, target = targets[kind]
    # a budget of 3 vocab-sized rows forces the chunked path on these short sequences
    monkeypatch.setattr("extract.extraction.runner.TOPK_LOGITS_BUDGET", 3 * target.vocab_size)
    k = 8
    runner = TargetRunner(target, [2], topk=k)
    sequences = _sequences([25, 9, 40], seed=5)

    outputs = runner.run_batch(sequences)

    for sequence, out in zip(sequences, outputs):
        hidden, logits = _reference_hidden_states(path, kind, sequence)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        expected_values, expected_ids = logprobs.topk(k, dim=-1)
        assert out["topk_ids"].dtype == torch.int32 and out["topk_logprobs"].dtype == torch.float32
        assert out["topk_ids"].shape == out["topk_logprobs"].shape == (len(sequence), k)
        assert torch.equal(out["topk_ids"].long(), expected_ids)
        torch.testing.assert_close(out["topk_logprobs"], expected_values, atol=1e-4, rtol=0)
        _assert_close(out[2], hidden[3][0], f"{kind} layer 2 with topk")


@pytest.mark.parametrize("bad", [[5], [6], [7], [-1], [3, 1], [2, 2], []])
def test_layer_ids_out_of_range_are_refused(targets, bad):
    _, target = targets["qwen3"]  # 6 layers: valid ids 0..4
    with pytest.raises(ValueError, match=r"layer id|no context layer"):
        TargetRunner(target, bad)


def test_bad_sequences_and_topk_are_refused(targets):
    _, target = targets["qwen3"]
    runner = TargetRunner(target, [1])
    for sequences, message in [
        ([], "empty batch"),
        ([np.array([], dtype=np.int32)], "non-empty"),
        ([np.array([1, 512], dtype=np.int32)], "outside the target's vocabulary"),
        ([np.array([-1, 3], dtype=np.int32)], "outside the target's vocabulary"),
        ([np.array([1.0, 2.0])], "integers"),
    ]:
        with pytest.raises(ValueError, match=message):
            runner.run_batch(sequences)
    for topk in (0, 513, True):
        with pytest.raises(ValueError, match="topk"):
            TargetRunner(target, [1], topk=topk)


def _importable(name: str) -> bool:
    import importlib

    try:
        importlib.import_module(name)
        return True
    except Exception:
        return False


def test_kernel_report_names_the_pytorch_fallback(targets):
    if _importable("fla") or _importable("causal_conv1d"):
        pytest.skip("optimized kernels installed here; this checks the fallback report")
    _, hybrid = targets["qwen3_5"]
    _, dense = targets["qwen3"]
    assert hybrid.kernels == {"attention": "sdpa", "linear_attention": "torch", "causal_conv1d": "torch"}
    assert targets["qwen3_5_vl"][1].kernels == hybrid.kernels
    assert dense.kernels == {"attention": "sdpa", "linear_attention": None, "causal_conv1d": None}
    assert kernel_report(hybrid.model) == hybrid.kernels


def test_batches_by_length_counts_padded_tokens():
    lengths = [5, 100, 30, 31, 99, 7, 250, 6, 30]
    budget = 200
    batches = batches_by_length(lengths, budget)

    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= budget or len(batch) == 1  # only a lone oversize sample may exceed it
    assert [6] in batches  # 250 > budget: alone
    assert [1, 4] in batches  # 100 and 99 pad to 200
    assert batches == batches_by_length(lengths, budget)
    assert all(len(b) <= 2 for b in batches_by_length(lengths, 10_000, max_batch_size=2))
    assert batches_by_length([], 10) == []
    with pytest.raises(ValueError):
        batches_by_length(lengths, 0)


# --------------------------------------------------------------------------- only what is captured (issue 15.8)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "qwen3_5_vl"])
def test_workers_load_no_lm_head_and_no_layer_past_the_last_context_layer(targets, kind):
    """`keep_layers=4` (context layers up to 3): decoder layers 0..3 and no head are
    loaded -- the parameters are exactly the full model's minus those -- and the
    captured states are bit-identical to the full model's."""
    path, full = targets[kind]
    part = load_target(path, keep_layers=4)
    names = {name for name, _ in part.model.named_parameters()}
    assert not [n for n in names if "lm_head" in n] and len(decoder_layers(part.model)) == 4
    assert (part.num_layers, part.vocab_size, part.kernels) == (full.num_layers, full.vocab_size, full.kernels)
    kept = {
        n
        for n, _ in full.model.named_parameters()  # (the final norm stays: hidden-size floats)
        if not n.startswith("lm_head") and not any(f"layers.{i}." in n for i in range(4, full.num_layers))
    }
    dropped = sum(p.numel() for n, p in full.model.named_parameters() if n not in kept)
    assert sum(p.numel() for p in part.model.parameters()) == sum(p.numel() for p in full.model.parameters()) - dropped
    assert dropped > full.model.get_output_embeddings().weight.numel()  # the head and the later layers
    sequences = _sequences([40, 7, 65], seed=6)
    for a, b in zip(TargetRunner(full, [1, 3]).run_batch(sequences), TargetRunner(part, [1, 3]).run_batch(sequences)):
        assert all(torch.equal(a[L], b[L]) for L in (1, 3))
    with pytest.raises(ValueError, match="need the whole target"):
        TargetRunner(part, [1, 4])  # a valid id of the target, past what was loaded
    with pytest.raises(ValueError, match="need the whole target"):
        TargetRunner(part, [1], topk=2)


def test_a_cuda_worker_on_the_pytorch_fallback_is_refused_before_loading_when_asked():
    """The rule `--require-fast-kernels` applies, on the class this install would run:
    without fla / causal-conv1d the hybrid model's prefill kernels are the fallback."""
    from transformers import Qwen3_5TextModel, Qwen3Model

    from extract.jobs.kernels import check_fast_kernels, fallback_kernels, kernels_of_class, slow_kernels_message

    if _importable("fla") and _importable("causal_conv1d"):
        pytest.skip("optimized kernels installed here")
    hybrid = kernels_of_class(Qwen3_5TextModel)
    assert fallback_kernels(hybrid) == ["causal_conv1d", "linear_attention"]
    with pytest.raises(
        RuntimeError,
        match=r"PyTorch fallback for causal_conv1d, linear_attention on CUDA.*"
        r"refused by --require-fast-kernels",
    ):
        check_fast_kernels(hybrid, "cuda", "worker on h1")
    check_fast_kernels(hybrid, "cpu", "worker on h1")  # the CPU path is the reference path: never refused
    check_fast_kernels(kernels_of_class(Qwen3Model), "cuda", "worker on h1")  # no linear attention at all
    assert check_fast_kernels({"linear_attention": "fla", "causal_conv1d": "causal-conv1d"}, "cuda", "w") is None
    # issue 60.5: causal-conv1d alone missing (no wheel; a cheap fallback) is said, not refused
    conv_only = {"linear_attention": "fla", "causal_conv1d": "torch"}
    assert check_fast_kernels(conv_only, "cuda", "w") is None
    assert "costs little beside the linear attention" in slow_kernels_message(conv_only, "w")
    assert 'pip install -e ".[gpu]"' in slow_kernels_message(hybrid, "worker on h1")


def test_a_nan_capture_is_refused_in_bf16_naming_sample_layer_and_token(targets):
    """Issue 60.5: bf16 captures holding NaN/Inf are refused as fp8's are (flagged on the
    device with the batch, refused by the worker before anything is written)."""
    from extract.extraction.worker import refuse_nonfinite_capture
    from store_schema import NonFiniteStatesError

    path, target = targets["qwen3"]
    layer = decoder_layers(target.model)[2]

    def poison(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[:, 5] = float("nan")
        return output

    handle = layer.register_forward_hook(poison)
    try:
        outputs = TargetRunner(target, [1, 2]).run_batch(_sequences([20, 12], seed=3))
    finally:
        handle.remove()
    refuse_nonfinite_capture("clean", {1: None, "nonfinite": outputs[0]["nonfinite"][:1]}, [1])  # layer 1 is clean
    for sample_id, out in zip(("a", "b"), outputs):
        with pytest.raises(NonFiniteStatesError, match=rf"sample '{sample_id}' layer 2: NaN/Inf .* first at token 5"):
            refuse_nonfinite_capture(sample_id, out, [1, 2])


@pytest.fixture
def packaged_kernel(monkeypatch):
    """`install(kernel)`: Qwen3.5's chunked gated delta rule routed by transformers' own
    `use_kernel_func_from_hub_with_fallback` to `kernel`, as package "fake_fla" (laid out
    as fla: `ops.gated_delta_rule`), the way an installed fla is picked at import; the
    module's name is restored after the test. Returns the PyTorch reference."""
    import types

    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from transformers.integrations import use_kernel_func_from_hub_with_fallback

    from extract.jobs.kernels import kernel_implementations

    _, reference = kernel_implementations(modeling.torch_chunk_gated_delta_rule)

    def install(kernel):
        names = ["fake_fla", "fake_fla.ops", "fake_fla.ops.gated_delta_rule"]
        packages = [types.ModuleType(name) for name in names]
        packages[0].ops, packages[1].gated_delta_rule = packages[1], packages[2]
        packages[2].chunk_gated_delta_rule = kernel
        for name, package in zip(names, packages):
            monkeypatch.setitem(sys.modules, name, package)
        wrapped = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fake_fla")(reference)
        monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", wrapped)
        return reference

    return install


def test_a_linear_attention_kernel_that_disagrees_with_the_reference_is_replaced_at_load(
    qwen3_5_dir, packaged_kernel, capsys
):
    """Issue 60.5: an installed but broken fla runs without an error; the worker's load
    checks one layer of it against PyTorch's reference, switches to the reference, says
    so, and the fingerprint's kernel report reads "torch"; its states are the reference's."""
    plain = load_target(qwen3_5_dir)
    sequence = _sequences([90])
    want = TargetRunner(plain, [1, 3]).run_batch(sequence)[0]

    def broken(q, k, v, g, beta, **settings):  # right shape, wrong values: what a miscompiled kernel returns
        out, state = reference(q, k, v, g=g, beta=beta, **settings)
        return out.flip(1), state

    reference = packaged_kernel(broken)
    loaded = load_target(qwen3_5_dir)
    err = capsys.readouterr().err
    assert "fake_fla's chunk_gated_delta_rule disagrees with PyTorch's reference" in err and "cosine" in err, err
    assert loaded.kernels["linear_attention"] == "torch"
    got = TargetRunner(loaded, [1, 3]).run_batch(sequence)[0]
    assert all(torch.equal(got[layer], want[layer]) for layer in (1, 3))


def test_a_kernel_that_agrees_is_kept_and_linear_attention_torch_replaces_it(qwen3_5_dir, packaged_kernel, capsys):
    """A package that agrees with the reference is kept (reported by its name); `extract
    run --linear-attention torch` runs the reference anyway, saying so."""
    from extract.jobs.linear_attention import AGREEMENT, agreement

    def faithful(q, k, v, g, beta, **settings):
        return reference(q, k, v, g=g, beta=beta, **settings)

    reference = packaged_kernel(faithful)
    kept = load_target(qwen3_5_dir)
    assert kept.kernels["linear_attention"] == "fake_fla" and "linear attention" not in capsys.readouterr().err
    config = kept.model.config
    assert agreement(faithful, reference, config, torch.device("cpu"), torch.float32) >= AGREEMENT
    switched = load_target(qwen3_5_dir, linear_attention="torch")
    assert "PyTorch's reference instead of fake_fla, as --linear-attention torch asks" in capsys.readouterr().err
    assert switched.kernels["linear_attention"] == "torch"
    with pytest.raises(ValueError, match="choose one of auto, torch"):
        load_target(qwen3_5_dir, linear_attention="fla")
