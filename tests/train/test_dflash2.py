"""The DFlash 2 drafter (train/families/dflash/dflash2.py) against z-lab's reference
(`dflash` 0.1.0's `DFlash2DraftModel`), in fp32 with the tiny Qwen3 target:

- identity start: a fresh DFlash 2 computes exactly its DFlash backbone's logits;
- block-local: no convolution tap reaches across a block's start, in training's
  layout of many blocks and in decoding (`DraftCache`);
- our export loads in the reference with every tensor in place and the same block
  logits; a DFlash 2 the reference saves loads here with the same weights;
- `propose` walks the same paths as our selector's greedy walk; `speculate` with a
  DFlash 2 is lossless, drafts the blocks `dflash_generate` drafts and accepts the
  same lengths on the same prompts and target.
"""

from __future__ import annotations

import dataclasses
import warnings

import builders
import pytest
import torch
from dflash.model import DFlash2DraftModel
from random_drafters import GEOMETRIES, SIZES, dflash_drafter, random_dflash2
from reference_oracle import ANCHORS, BLOCK, inputs, load_model, reference_generate, reference_logits
from reference_oracle import load_reference as load_reference_as
from stores import greedy_store

from store_schema.runtime.target_config import read_target_config
from train.config_error import ConfigError
from train.config_loading import load_config
from train.data.prompts import store_prompts
from train.decoding.speculate import decode_prompt, summarize
from train.export.drafter_dir import export_drafter, load_drafter
from train.families.dflash.build import build_drafter
from train.families.dflash.conv import BlockConv
from train.families.dflash.dflash2 import DFlash2Drafter
from train.families.dflash.draft_cache import DraftCache
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.families.dflash.selector import CandidateSelector
from train.fitting.trainer import Trainer
from train.target_head import load_target_head

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 32
HELDOUT = 0.25


def argmax_chain(drafter, hidden, head):
    return DFlashDrafter.greedy_tokens(drafter, hidden, 0, head.lm_head)


# -- the model -------------------------------------------------------------------------------
def test_identity_start_computes_the_dflash_logits(qwen3_dir):
    dflash = dflash_drafter(qwen3_dir)
    fresh = DFlash2Drafter(dataclasses.replace(dflash.config, architecture="dflash2", **SIZES)).eval()
    result = fresh.load_state_dict(dflash.state_dict(), strict=False)
    assert not result.unexpected_keys and all("conv" in k or "selector" in k for k in result.missing_keys)
    warm = builders.warm_started(dflash, **SIZES).eval()
    head = load_target_head(qwen3_dir)
    features, input_ids = inputs()
    anchors = torch.tensor(ANCHORS)
    with torch.no_grad():
        for attention in ("split", "sdpa"):
            expected = head.lm_head(dflash(features, input_ids, anchors, head.embed_tokens, attention=attention))
            for drafter in (fresh, warm):
                ours = head.lm_head(drafter(features, input_ids, anchors, head.embed_tokens, attention=attention))
                assert (ours - expected).abs().max() < 1e-6, attention
        hidden = dflash(features, input_ids, anchors, head.embed_tokens)[:, 1:]
        for j, anchor in enumerate(ANCHORS):  # the zero successor codebook: the selector drafts the argmax chain
            chain = dflash.greedy_tokens(hidden[j], int(input_ids[anchor]), head.lm_head)
            assert torch.equal(warm.greedy_tokens(hidden[j], int(input_ids[anchor]), head.lm_head), chain)


def test_block_conv_never_crosses_a_block_start():
    """Row t of a block mixes rows t-1 .. t-k+1 of the same block only: changing the
    last row of block 0 leaves block 1 as it was, changing a row of block 1
    changes the rows after it there."""
    torch.manual_seed(0)
    conv = BlockConv(32, kernel_size=3, group_size=8)
    with torch.no_grad():
        conv.base_kernel.add_(torch.randn_like(conv.base_kernel))
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 2 * 4, 32)
    changed = x.clone()
    changed[0, 3] += 1.0  # block 0's last row
    inside = x.clone()
    inside[0, 4] += 1.0  # block 1's anchor row
    with torch.no_grad():
        for side in ("prepare", "finish"):

            def run(rows):
                if side == "prepare":
                    return conv.prepare(rows, 4)[0]
                return conv.finish(rows, conv.prepare(x, 4)[1], 4)

            base, out = run(x), run(changed)
            assert torch.equal(out[0, 4:], base[0, 4:]) and not torch.equal(out[0, 3], base[0, 3]), side
            moved = run(inside)
            assert not torch.equal(moved[0, 5], base[0, 5]) and not torch.equal(moved[0, 6], base[0, 6]), side
            assert torch.equal(moved[0, 7], base[0, 7]), side  # 3 taps: row 7 sees rows 5..7
    with pytest.raises(ValueError, match="not whole blocks of 3"):
        conv.prepare(x, 3)


def test_pair_scores_are_the_bilinear_term_in_fp32():
    """<A[prev] * (W h), B[cand]> summed by hand over the rank, for every row and
    candidate; fp32 under a bf16 autocast too; the walk ranks unary + pair score."""
    torch.manual_seed(0)
    selector = CandidateSelector(hidden_size=8, vocab_size=20, rank=3, top_k=4)
    with torch.no_grad():
        selector.successor_codebook.normal_()
    hidden, previous = torch.randn(5, 8), torch.tensor([0, 7, 7, 19, 3])
    candidates = torch.randint(0, 20, (5, 4))
    A, B, W = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    expected = torch.zeros(5, 4)
    for n in range(5):
        projected = [sum(float(W[i, j]) * float(hidden[n, j]) for j in range(8)) for i in range(3)]
        for k in range(4):
            expected[n, k] = sum(
                float(A[previous[n], i]) * projected[i] * float(B[candidates[n, k], i]) for i in range(3)
            )
    with torch.no_grad():
        torch.testing.assert_close(selector.pair_scores(hidden, previous, candidates), expected)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = selector.pair_scores(hidden.bfloat16(), previous, candidates)
        assert scores.dtype == torch.float32
        torch.testing.assert_close(scores, selector.pair_scores(hidden.bfloat16().float(), previous, candidates))

        logits = torch.randn(1, 2, 20)
        path = selector.walk(hidden[None, :2], logits, torch.tensor([7]))
        unary, ids = selector.candidates(logits[0])
        first = unary[0] + selector.pair_scores(hidden[:1], torch.tensor([7]), ids[:1])[0]
        assert path[0, 0] == ids[0, first.argmax()]
        second = unary[1] + selector.pair_scores(hidden[1:2], path[0, :1], ids[1:2])[0]
        assert path[0, 1] == ids[1, second.argmax()]


def test_a_block_ignores_the_other_blocks(qwen3_dir):
    """In training's layout ([block 0 | block 1 | ...] side by side), changing the
    previous block (its anchor token, and so its last row) or a far one leaves a
    block's logits unchanged; its own anchor changes them."""
    drafter = random_dflash2(qwen3_dir)
    head = load_target_head(qwen3_dir)
    features, input_ids = inputs()
    anchors = torch.tensor(ANCHORS)
    j = 3

    def logits(ids):
        with torch.no_grad():
            return head.lm_head(drafter(features, ids, anchors, head.embed_tokens, attention="sdpa"))

    base = logits(input_ids)
    for other in (j - 1, len(ANCHORS) - 1, j):
        ids = input_ids.clone()
        ids[ANCHORS[other]] = (ids[ANCHORS[other]] + 1) % 512
        out = logits(ids)
        assert not torch.equal(out[other], base[other])
        if other != j:
            assert torch.equal(out[j], base[j]), other


def test_dflash2_config_refuses_what_it_cannot_build(qwen3_dir):
    config = dflash_drafter(qwen3_dir).config
    for sizes, message in (
        ({"conv_group_size": 24}, "conv_group_size 24 must divide hidden_size 64"),
        ({"selector_top_k": 513}, "selector_top_k 513 exceeds the vocabulary"),
        ({"selector_rank": 0}, "selector_rank must be >= 1"),
        ({"conv_kernel_size": 0}, "conv_kernel_size must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(config, architecture="dflash2", **sizes)
    with pytest.raises(ValueError, match="architecture must be one of dflash, dflash2"):
        DrafterConfig.from_dict({**config.to_dict(), "architecture": "eagle3"})
    with pytest.raises(ConfigError, match="model.architecture: must be one of dflash, dflash2"):
        load_config(None, ["model.architecture=eagle"], require_paths=False)
    with pytest.raises(ConfigError, match="model.selector_top_k: must be >= 1"):
        load_config(None, ["model.selector_top_k=0"], require_paths=False)
    run = load_config(None, ["model.architecture=dflash2", "model.selector_rank=32"], require_paths=False)
    sized = DrafterConfig.from_target(
        read_target_config(qwen3_dir), mask_token_id=3, context_layer_ids=[1, 3], **run.model.geometry()
    )
    assert (sized.architecture, sized.selector_rank, sized.selector_top_k) == ("dflash2", 32, 16)
    assert isinstance(build_drafter(sized), DFlash2Drafter)


def test_the_draft_cache_convolves_the_drafted_block_alone(qwen3_dir):
    drafter = random_dflash2(qwen3_dir)
    embed = load_target_head(qwen3_dir).embed_tokens
    features, ids = inputs(seed=3)
    cache = DraftCache(drafter, embed)
    for chunk in (7, 1, 16, 3, 9):
        cache.extend(features[cache.length : cache.length + chunk])
        anchor = cache.length
        block = torch.full((BLOCK,), 3)
        block[0] = ids[anchor]
        with torch.no_grad():
            expected = drafter(
                features[: anchor + 1], ids[: anchor + 1], torch.tensor([anchor]), embed, attention="sdpa"
            )[0]
            torch.testing.assert_close(cache.draft(block), expected, atol=2e-5, rtol=1e-5)
            short = block[:5]  # the last round's shorter block is a block of its own length
            assert cache.draft(short).shape == (5, 64)


# -- the reference ---------------------------------------------------------------------------
def load_reference(path) -> DFlash2DraftModel:
    return load_reference_as(path, DFlash2DraftModel)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_export_loads_in_the_reference_with_the_same_logits_and_paths(qwen3_dir, tmp_path, geometry):
    drafter = random_dflash2(qwen3_dir, GEOMETRIES[geometry])
    head = load_target_head(qwen3_dir)
    out = export_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    reference = load_reference(out)
    assert reference.block_size == BLOCK and reference.candidate_selector.top_k == SIZES["selector_top_k"]
    theirs = reference.state_dict()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(theirs[name if "codebook" not in name else f"{name}.weight"], tensor), name

    features, input_ids = inputs()
    anchors = torch.tensor(ANCHORS)
    with torch.no_grad():
        expected = torch.stack([reference_logits(reference, head, features, input_ids, a) for a in ANCHORS])
        for attention in ("flex", "sdpa", "split"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex without torch.compile warns on CPU
                hidden = drafter(features, input_ids, anchors, head.embed_tokens, attention=attention)
            assert (head.lm_head(hidden) - expected).abs().max() < 1e-4, attention

        drafted = hidden[:, 1:]
        paths, candidates, _ = reference.propose(drafted, input_ids[anchors], head.lm_head, 0.0)
        ours = torch.stack(
            [drafter.greedy_tokens(drafted[j], int(input_ids[a]), head.lm_head) for j, a in enumerate(ANCHORS)]
        )
        assert torch.equal(ours, paths)
        assert not torch.equal(ours, argmax_chain(drafter, drafted, head))  # the selector changed some choices
        assert torch.equal(
            candidates.sort(-1).values, drafter.candidate_selector.candidates(head.lm_head(drafted))[1].sort(-1).values
        )

    reloaded = load_drafter(out)
    assert isinstance(reloaded, DFlash2Drafter) and reloaded.config == drafter.config
    assert all(torch.equal(t, drafter.state_dict()[n]) for n, t in reloaded.state_dict().items())


def test_a_dflash2_the_reference_saves_loads_here(qwen3_dir, tmp_path):
    """The reference's save_pretrained writes the codebooks as `.weight`: read too."""
    export = export_drafter(random_dflash2(qwen3_dir, seed=4), tmp_path / "ours", dtype=torch.float32)
    saved = load_reference(export)
    saved.save_pretrained(str(tmp_path / "theirs"))
    drafter = load_drafter(tmp_path / "theirs")
    assert isinstance(drafter, DFlash2Drafter) and drafter.config.selector_rank == SIZES["selector_rank"]
    theirs = saved.state_dict()
    assert all(
        torch.equal(t, theirs[n if "codebook" not in n else f"{n}.weight"]) for n, t in drafter.state_dict().items()
    )


# -- decoding --------------------------------------------------------------------------------
def recording(method, calls: list, keep_arguments: bool = False):
    """`method`, unchanged, with each call's result (its first item if a tuple)
    appended to `calls`, or with `keep_arguments` (arguments, result)."""

    def record(*args):
        result = method(*args)
        first = result[0] if isinstance(result, tuple) else result
        calls.append((args, first) if keep_arguments else first)
        return result

    return record


def test_speculate_walks_the_selector_losslessly_as_dflash_generate_does(qwen3_dir, tokenizer, tmp_path):
    """Same prompts and target: the same drafted block every round, the same
    accepted lengths, and the target's own greedy output."""
    model = load_model(qwen3_dir)
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    export = export_drafter(random_dflash2(qwen3_dir, mask_token_id=mask_id), tmp_path / "drafter", dtype=torch.float32)
    drafter, reference = load_drafter(export).eval(), load_reference(export)
    ours, theirs = [], []
    drafter.greedy_tokens = recording(drafter.greedy_tokens, ours)
    reference.propose = recording(reference.propose, theirs)
    for i, prompt in enumerate(builders.chat_prompts(tokenizer, 2)):
        result = decode_prompt(model, drafter, str(i), prompt, NEW_TOKENS, stop_ids=[])
        generated = reference_generate(reference, model, prompt, NEW_TOKENS)
        assert result.lossless, result.first_mismatch()
        assert result.speculative.tokens == generated.output_ids[0, prompt.shape[0] :].tolist()
        assert result.speculative.acceptance_lengths == generated.acceptance_lengths
    assert len(ours) == len(theirs) > 4
    assert all(torch.equal(a, b[0]) for a, b in zip(ours, theirs))


@pytest.fixture(scope="module")
def trained_export(qwen3_dir, tokenizer, tmp_path_factory):
    """(store, export) of a `model.architecture=dflash2` run trained 300 steps on the
    dense target's own greedy outputs (cross-entropy through the backbone and the
    convolutions: `loss.selector_weight=0`, since the selector is then set at random
    so that its walk leaves the argmax chain on some slots)."""
    root = tmp_path_factory.mktemp("dflash2")
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    store = greedy_store(root / "store", qwen3_dir, tokenizer, [1, 3], count=24, new_tokens=NEW_TOKENS)
    config = load_config(
        None,
        [
            "model.architecture=dflash2",
            "model.selector_rank=16",
            "model.selector_top_k=8",
            "model.num_hidden_layers=2",
            "model.sliding_window=12",
            "model.num_attention_heads=4",
            "model.num_key_value_heads=2",
            "model.head_dim=16",
            f"model.block_size={BLOCK}",
            "model.num_anchors=32",
            f"model.mask_token_id={mask_id}",
            f"data.heldout_fraction={HELDOUT}",
            "data.buffer_shards=2",
            "optim.lr=1e-2",
            "eval.every=0",
            "train.epochs=100",
            "train.log_every=100",
            "loss.selector_weight=0",
        ],
        store=str(store),
        target=str(qwen3_dir),
        out=str(root / "run"),
        **{"train.max_steps": 300},
    )
    trainer = Trainer.from_config(config, log=lambda message: None)
    trainer.fit()
    selector = trainer.drafter.candidate_selector
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor, scale in (
            (selector.predecessor_codebook, 1.0),
            (selector.hidden_projection.weight, 0.3),
            (selector.successor_codebook, 0.05),
        ):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)
    return store, export_drafter(trainer.drafter, root / "export", dtype=torch.float32, heldout_fraction=HELDOUT)


@pytest.mark.slow  # trains a drafter
def test_a_trained_dflash2_decodes_as_dflash_generate_does(qwen3_dir, trained_export):
    """Real acceptance (whole runs of drafted tokens accepted), lossless, the same
    accepted lengths and drafted blocks as the reference, and the selector's walk
    differing from the argmax chain on some rounds."""
    store, export = trained_export
    model = load_model(qwen3_dir)
    drafter, reference = load_drafter(export).eval(), load_reference(export)
    head = model.get_output_embeddings()
    ours, theirs = [], []
    drafter.greedy_tokens = recording(drafter.greedy_tokens, ours, keep_arguments=True)
    reference.propose = recording(reference.propose, theirs)
    prompts = store_prompts(store, HELDOUT, limit=4)
    results = [decode_prompt(model, drafter, p.id, p.input_ids, NEW_TOKENS, stop_ids=[]) for p in prompts]
    assert summarize(results)["lossless"], [r.first_mismatch() for r in results]
    for prompt, result in zip(prompts, results):
        generated = reference_generate(reference, model, prompt.input_ids, NEW_TOKENS)
        assert result.speculative.acceptance_lengths == generated.acceptance_lengths, prompt.id
    assert summarize(results)["tau"] > 1.3 and max(max(r.speculative.acceptance_lengths) for r in results) >= 3
    assert len(ours) == len(theirs) and all(torch.equal(a[1], b[0]) for a, b in zip(ours, theirs))
    chains = [DFlashDrafter.greedy_tokens(drafter, hidden, anchor, head) for (hidden, anchor, _), _ in ours]
    assert any(not torch.equal(chain, path) for chain, (_, path) in zip(chains, ours))


@pytest.mark.slow  # trains a drafter
def test_eval_tau_of_a_trained_dflash2_is_what_speculate_decodes(qwen3_dir, trained_export):
    """Issue 44.1: `eval`'s headline tau on the prompts `speculate` decodes, cut to the
    same new tokens, is within 5 % of speculate's decode tau (the store holds the
    target's own greedy replies, so the rollout walks what decoding walks); the argmax
    chain's `tau_unary` is the other figure, not the headline."""
    from train.evaluation.config import EvalConfig
    from train.evaluation.evaluate import evaluate_sample_ids

    store, export = trained_export
    model, drafter = load_model(qwen3_dir), load_drafter(export).eval()
    prompts = store_prompts(store, HELDOUT, limit=4)
    decoded = summarize([decode_prompt(model, drafter, p.id, p.input_ids, NEW_TOKENS, stop_ids=[]) for p in prompts])
    assert decoded["lossless"]
    evaluated = evaluate_sample_ids(
        drafter,
        load_target_head(qwen3_dir),
        store,
        [p.id for p in prompts],
        EvalConfig(samples=None, ddtree_budgets=(8,)),
        max_new_tokens=NEW_TOKENS,
    )
    assert evaluated["path"] == "selector walk"
    assert evaluated["tau"] == pytest.approx(decoded["tau"], rel=0.05), (evaluated["tau"], evaluated["tau_unary"])
    assert evaluated["tau_unary"] != evaluated["tau"]


@pytest.mark.slow  # trains a drafter
def test_a_trained_dflash2_along_a_tree_decodes_what_evals_ddtree_counts(qwen3_dir, trained_export):
    """Issue 59.3 for DFlash 2: the tree is grown over its unary per-slot lists (not the
    selector's walk), as eval's `ddtree` grows it; decoding along it is lossless and its
    tau is within 5 % of `ddtree[8]` on the same prompts."""
    from train.evaluation.config import EvalConfig
    from train.evaluation.evaluate import evaluate_sample_ids

    store, export = trained_export
    model, drafter = load_model(qwen3_dir), load_drafter(export).eval()
    prompts = store_prompts(store, HELDOUT, limit=4)
    decoded = summarize(
        [decode_prompt(model, drafter, p.id, p.input_ids, NEW_TOKENS, stop_ids=[], tree_budget=8) for p in prompts]
    )
    assert decoded["lossless"]
    evaluated = evaluate_sample_ids(
        drafter,
        load_target_head(qwen3_dir),
        store,
        [p.id for p in prompts],
        EvalConfig(samples=None, ddtree_budgets=(8,)),
        max_new_tokens=NEW_TOKENS,
    )
    print(f"dflash2: tree tau {decoded['tau']}, eval ddtree[8] {evaluated['ddtree'][8]}, chain {evaluated['tau']}")
    assert evaluated["ddtree"][8] == pytest.approx(decoded["tau"], rel=0.05)


@pytest.mark.slow  # trains a drafter
def test_a_bf16_dflash2_walks_the_path_the_reference_selects(qwen3_dir, trained_export):
    """Issue 44.6: in bf16 the selector scores its edges in bf16 as the reference's
    `select` and vLLM do, so on every block of a bf16 decode (the same hidden states
    and lm_head) it walks the path the reference proposes, near ties included. (The
    bf16 backbones themselves differ in rounding: each sums attention in its own order.)"""
    store, export = trained_export
    model = load_model(qwen3_dir).to(torch.bfloat16)
    drafter = load_drafter(export, dtype=torch.bfloat16).eval()
    reference = load_reference(export).to(torch.bfloat16)
    blocks = []
    drafter.greedy_tokens = recording(drafter.greedy_tokens, blocks, keep_arguments=True)
    for prompt in store_prompts(store, HELDOUT, limit=4):
        decode_prompt(model, drafter, prompt.id, prompt.input_ids, NEW_TOKENS, stop_ids=[])
    assert len(blocks) > 20
    with torch.no_grad():
        for (hidden, anchor, lm_head), path in blocks:
            proposed = reference.propose(hidden[None], torch.tensor([anchor]), lm_head, 0.0)[0][0]
            assert path.tolist() == proposed.tolist()
