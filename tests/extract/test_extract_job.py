"""The extraction job end to end on a real local Ray cluster (one, shared by the module),
the tiny Qwen3.5 hybrid target and a real tokenizer, into real Zarr stores.

Jobs are the expensive part (every job starts fresh actors that import torch and load
the model), so each test reuses the reference store built once by `reference`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import coding_chats, ctrl_c_when, write_chat_jsonl
from ray_helpers import (
    BATCH_TOKENS,
    LAYERS,
    REPO,
    SHARD_TOKENS,
)
from ray_helpers import (
    job_config as _config,
)
from ray_helpers import (
    store_content as _content,
)
from ray_helpers import (
    verify_cli as _verify_cli,
)

pytestmark = pytest.mark.slow  # a Ray cluster


def _records() -> tuple[list, dict]:
    """Good single- and multi-turn chats plus one record of each kind of bad one."""
    good = coding_chats(16)
    chats = coding_chats(24, seed=1)
    for i in range(0, 8, 2):
        first, second = chats[i]["messages"], chats[i + 1]["messages"]
        good.append(
            {
                "id": f"multi-{i:02d}",
                "messages": [
                    {"role": "system", "content": "You write Python."},
                    *first,
                    *second,
                ],
            }
        )
    bad = {
        "unsafe_id": {"id": "../../x", "messages": first},
        "no_assistant_turn": {"id": "bad-noassistant", "messages": [{"role": "user", "content": "hi"}]},
        "empty_response": {
            "id": "bad-empty",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
        },
    }
    return good, bad


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    good, bad = _records()
    path = tmp_path_factory.mktemp("corpus") / "chats.jsonl"
    write_chat_jsonl(path, good[:10] + list(bad.values()) + good[10:])
    with path.open("a") as f:
        f.write('{"id": "bad-json", "messages": [\n')  # truncated JSON
    return path, good, bad


@pytest.fixture(scope="module")
def reference(ray_cluster, qwen3_5_dir, corpus, tmp_path_factory):
    """An uninterrupted 2-worker run: the store every other run must equal."""
    from extract.extraction.job import run_job

    store = tmp_path_factory.mktemp("ref") / "store"
    report = run_job(_config(qwen3_5_dir, corpus[0], store))
    return store, report


# --------------------------------------------------------------------------- the reference run


def test_reference_run_report_quarantine_and_verify(reference, corpus):
    from store_schema import Store

    store, report = reference
    _, good, bad = corpus
    assert report["status"] == "complete"
    assert report["shards_written"] == report["shards"] > 2 and report["shards_skipped"] == 0
    assert report["samples"] == report["samples_written"] == len(good)
    assert report["quarantined_by_reason"] == {**{reason: 1 for reason in bad}, "malformed_json": 1}
    assert "chats.jsonl line " in report["quarantined_first"]  # issue 62.5: by file and line
    assert report["workers"] == 2 and report["kernels"]["linear_attention"] in ("torch", "fla")
    assert report["tokens_per_s"] > 0 and report["bytes_per_s"] > 0
    assert report["shards_committed"] == report["shards"] and not report["plan_reused"]
    # Each sample padded to its batch's longest: computed >= real tokens, as the worker counted them.
    assert report["padded_tokens"] >= report["tokens_written"] > 0
    assert report["padded_token_ratio"] == round(report["padded_tokens"] / report["tokens_written"], 4)

    reader = Store(store)
    stored = [sid for name in reader.committed_shards() for sid in reader.read_shard(name).sample_ids]
    assert sorted(stored) == sorted(r["id"] for r in good)  # every good record once, no bad one
    assert json.loads((store / report["report"]).read_text()) == report
    fp = reader.fingerprint
    assert list(fp.layer_ids) == LAYERS and fp.num_target_layers == 8 and fp.hidden_size == 64
    assert fp.target_config["num_hidden_layers"] == 8  # its config.json, to name a differing field later
    assert fp.corpus_sha256 and fp.tokenizer_sha256 and fp.chat_template_sha256 and fp.target_config_sha256
    assert fp.kernels == report["kernels"] and fp.kernels["compute_dtype"] == "float32"

    verified = _verify_cli(store)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout.strip().splitlines()[-1])["ok"]


def test_stored_states_equal_a_plain_transformers_forward(reference, qwen3_5_dir):
    """Each sample alone through transformers (`output_hidden_states`, no hooks, no
    batching) vs what the batched job stored: hidden_states[L+1], cosine >= 0.9999."""
    from transformers import AutoModelForCausalLM

    from store_schema import Store

    store, _ = reference
    reader = Store(store)
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_5_dir), dtype=torch.float32).eval()
    checked = batched = 0
    for name in reader.committed_shards()[:3]:
        data = reader.read_shard(name)
        batched += len(data) > 1
        for i in range(len(data)):
            sample = data.sample(i)
            with torch.no_grad():
                states = model(input_ids=sample.input_ids.long()[None], output_hidden_states=True).hidden_states
            for layer in LAYERS:
                cosine = torch.nn.functional.cosine_similarity(
                    states[layer + 1][0], sample.hidden[layer].float(), dim=-1
                )
                assert cosine.min() >= 0.9999, (name, sample.sample_id, layer, float(cosine.min()))
            checked += 1
    assert checked >= 6 and batched >= 1  # shards of several samples went through as padded batches


@pytest.mark.parametrize("store_dtype", ["fp8_e4m3", "fp4_e2m1"])
def test_lossy_job_stores_the_reference_within_rounding_and_a_store_never_mixes_dtypes(
    reference, qwen3_5_dir, corpus, tmp_path, store_dtype
):
    """`--store-dtype fp8_e4m3 | fp4_e2m1`: the workers quantize on their device; the
    store holds the reference (bf16) job's states within the codes' rounding, verifies,
    and refuses to be resumed as a bf16 store (and the bf16 store as a lossy one),
    naming the dtype."""
    from builders import ROUNDING_BOUNDS

    from extract.errors import ExtractError
    from extract.extraction.job import run_job
    from store_schema import Store

    store = tmp_path / store_dtype
    report = run_job(_config(qwen3_5_dir, corpus[0], store, store_dtype=store_dtype))
    assert report["status"] == "complete"
    verified = _verify_cli(store)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    lossy, exact = Store(store), Store(reference[0])
    assert lossy.fingerprint.dtype == store_dtype and lossy.committed_shards() == exact.committed_shards()
    rounding_bound = ROUNDING_BOUNDS[store_dtype]
    for name in exact.committed_shards():
        coded, want = lossy.read_shard(name), exact.read_shard(name)
        assert coded.sample_ids == want.sample_ids
        for layer in LAYERS:
            reference_states = want.hidden[layer].float()
            error = (coded.states(layer).float() - reference_states).abs()
            assert bool((error <= rounding_bound(reference_states, coded.scales[layer])).all()), (name, layer)
    with pytest.raises(ExtractError, match=f"dtype: store has '{store_dtype}', expected 'bfloat16'"):
        run_job(_config(qwen3_5_dir, corpus[0], store))
    with pytest.raises(ExtractError, match=f"dtype: store has 'bfloat16', expected '{store_dtype}'"):
        run_job(_config(qwen3_5_dir, corpus[0], reference[0], store_dtype=store_dtype))


def test_a_projected_job_fits_on_a_worker_and_stores_coordinates(reference, qwen3_5_dir, corpus, tmp_path):
    """`--project-rank 32 --store-dtype fp4_e2m1`: a worker runs the plan's first states
    through the target, the driver fits the directions and creates the store with them;
    the workers store fp4 coordinates of the states projected on the device, which
    readers lift back to the reference's states on the kept directions; a rerun keeps
    the store's projection, and a store made whole is not projected by a resume."""
    from extract.errors import ExtractError
    from extract.extraction.job import run_job
    from store_schema import Store
    from store_schema.projection import lift, project

    store = tmp_path / "projected"
    config = _config(qwen3_5_dir, corpus[0], store, store_dtype="fp4_e2m1", project_rank=32, project_fit_tokens=300)
    assert run_job(config)["status"] == "complete"
    verified = _verify_cli(store)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    projected, exact = Store(store), Store(reference[0])
    recorded = projected.fingerprint.projection
    assert recorded["ranks"] == {str(layer): 32 for layer in LAYERS} and recorded["fitted_tokens"] == 300
    lifts = projected.lifts()
    for name in exact.committed_shards():
        coded, want = projected.read_shard(name), exact.read_shard(name)
        for layer in LAYERS:
            assert coded.hidden[layer].shape[1] == 16  # 32 coordinates, two fp4 codes a byte
            on_subspace = lift(project(want.states(layer), lifts[layer]), lifts[layer]).float()
            error = (coded.states(layer).float() - on_subspace).norm() / on_subspace.norm()
            assert float(error) < 0.2, (name, layer, float(error))
    assert run_job(_config(qwen3_5_dir, corpus[0], store, store_dtype="fp4_e2m1"))["status"] == "nothing_to_do"
    assert Store(store).fingerprint.projection == recorded
    with pytest.raises(ExtractError, match="stores its states whole; a projection is chosen when a store is made"):
        run_job(_config(qwen3_5_dir, corpus[0], reference[0], project_rank=32))


def test_loss_masks_are_the_assistant_turns(reference, corpus, tokenizer):
    """The default scope: each assistant turn's content as the template's generation
    tags mark it, plus the end-of-turn token that follows; role headers never."""
    from store_schema import Store

    store, _ = reference
    _, good, _ = corpus
    by_id = {r["id"]: r for r in good}
    reader = Store(store)
    assert reader.fingerprint.loss_mask == "turn" and reader.fingerprint.to_json()["loss_mask"] == "turn"
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    multi = 0
    for name in reader.committed_shards():
        data = reader.read_shard(name)
        for i in range(len(data)):
            sample = data.sample(i)
            messages = by_id[sample.sample_id]["messages"]
            rendered = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, content = list(rendered["input_ids"]), list(rendered["assistant_masks"])
            assert sample.input_ids.tolist() == ids
            turn = [
                int(m or (i > 0 and content[i - 1] and not m and t == end_of_turn))
                for i, (t, m) in enumerate(zip(ids, content))
            ]
            assert sample.loss_mask.tolist() == turn
            # The masked tokens are exactly the assistant turns as served, turn by turn.
            mask = sample.loss_mask.numpy().astype(bool)
            ids = sample.input_ids.numpy()
            starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
            ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]])) + 1
            spans = [tokenizer.decode(ids[a:b]) for a, b in zip(starts, ends)]
            # (BPE may merge the template's newline with the content's leading spaces.)
            assert [s.lstrip() for s in spans] == [
                m["content"].lstrip() + "<|im_end|>" for m in messages if m["role"] == "assistant"
            ]
            assert not any("<|im_start|>" in s or "assistant" in s[:12] for s in spans)
            multi += len(spans) > 1
    assert multi == 4


# --------------------------------------------------------------------------- reruns


def test_a_complete_store_on_a_read_only_filesystem_has_nothing_to_do(reference, qwen3_5_dir, corpus, tmp_path):
    """Issue 35.10: a finished store mounted read-only (an archive, a shared copy) could
    not even say "nothing to do". Tests run as root, which chmod does not stop: a
    read-only bind mount does."""
    from extract.extraction.job import run_job

    store, _ = reference
    copy, mount = tmp_path / "copy", tmp_path / "ro"
    shutil.copytree(store, copy)
    mount.mkdir()
    try:
        bound = subprocess.run(["mount", "--bind", str(copy), str(mount)], capture_output=True, text=True)
    except OSError as error:  # no mount(8) at all
        pytest.skip(f"cannot bind-mount here: {error}")
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root or CAP_SYS_ADMIN): {bound.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True)
        with pytest.raises(OSError):
            (mount / "probe").write_text("")
        messages = []
        report = run_job(_config(qwen3_5_dir, corpus[0], mount), log=messages.append)
        assert report["status"] == "nothing_to_do" and report["workers"] == 0, report
        assert any("read-only" in m for m in messages), messages
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_rerun_reuses_the_plan_recomputes_nothing_keeps_reports_and_refuses_other_plans(
    reference, qwen3_5_dir, corpus, tmp_path
):
    """A rerun of a finished job reuses the stored plan (same corpus bytes, tokenizer and
    settings: nothing re-tokenized), computes nothing, says so, and keeps the report of
    the run that extracted (issue 16.3). Other corpus bytes or settings are refused,
    naming what differs, before anything is tokenized."""
    from extract.errors import ExtractError
    from extract.extraction.job import run_job
    from store_schema.plan import PlanSettings

    store, first = reference
    before = {p.name: p.stat().st_ino for p in (store / "shards").iterdir() if p.is_dir()}
    kept = (store / first["report"]).read_bytes()
    messages = []
    report = run_job(_config(qwen3_5_dir, corpus[0], store), log=messages.append)
    assert report["status"] == "nothing_to_do" and report["plan_reused"]
    assert any("reusing the store's plan" in m and "nothing re-tokenized" in m for m in messages), messages
    assert report["shards_written"] == 0 and report["shards_skipped"] == report["shards"] == report["shards_committed"]
    assert report["workers"] == 0  # nothing to do: no worker was even started
    assert report["plan_digest"] == first["plan_digest"] and report["padded_token_ratio"] is None
    assert {p.name: p.stat().st_ino for p in (store / "shards").iterdir() if p.is_dir()} == before
    assert (store / first["report"]).read_bytes() == kept  # the extracting run's report is not overwritten
    assert sorted(p.name for p in (store / "reports").iterdir()) == sorted(
        Path(r["report"]).name for r in (first, report)
    )

    with pytest.raises(ExtractError, match=r"different plan \(shard_tokens: 1500 -> 1000\).*--overwrite"):
        run_job(_config(qwen3_5_dir, corpus[0], store, shard_tokens=1000))
    with pytest.raises(ExtractError, match="layer_ids"):
        run_job(_config(qwen3_5_dir, corpus[0], store, layers=[1, 2]))
    content_only = PlanSettings(shard_tokens=SHARD_TOKENS, loss_mask="content")
    with pytest.raises(
        ExtractError, match=r"different plan \(mask_convention: 'assistant_turn' -> 'assistant_content'\)"
    ):
        run_job(_config(qwen3_5_dir, corpus[0], store, plan_settings=content_only))
    longer = tmp_path / "chats.jsonl"
    longer.write_bytes(corpus[0].read_bytes() + corpus[0].read_bytes().splitlines(keepends=True)[0])
    with pytest.raises(
        ExtractError,
        match=r"different plan \(corpus_hash: '[0-9a-f]{64}' -> '[0-9a-f]{64}', "
        r"corpus_records: 24 -> 25\)",
    ):  # one line more
        run_job(_config(qwen3_5_dir, longer, store))


def test_a_rerun_with_another_target_is_refused_before_any_worker_naming_the_recorded_one(
    reference, qwen3_5_dir, corpus, tmp_path
):
    """Issue 48.6: resuming with a `--model` that is another checkpoint is refused in
    the plan step, before Ray workers load anything (minutes at 27B), naming the
    target the store recorded; `--overwrite` offered last, with what it deletes."""
    import shutil

    from extract.errors import ExtractError
    from extract.extraction.job import run_job

    ref_store, _ = reference
    store = tmp_path / "store"
    shutil.copytree(ref_store, store)
    unfinished = sorted(p for p in (store / "shards").iterdir() if p.is_dir())[0]
    (unfinished / "commit.json").unlink()  # a shard left to do: the rerun would start workers
    other = tmp_path / "other-model"
    shutil.copytree(qwen3_5_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))
    messages = []
    with pytest.raises(ExtractError) as refused:
        run_job(_config(other, corpus[0], store), log=messages.append)
    committed = sum(1 for p in (store / "shards").iterdir() if (p / "commit.json").is_file())
    assert str(refused.value) == (
        f"{store} was extracted from {Path(qwen3_5_dir).resolve()}, and --model {other} is another checkpoint "
        f"(target_config_sha256 differ): rerun with --model {Path(qwen3_5_dir).resolve()} (or a copy of that "
        f"checkpoint) to resume; only to start over with this model, --overwrite deletes the {committed} "
        "committed shard(s)"
    )
    assert not any("worker" in m for m in messages), messages
    assert unfinished.is_dir()  # nothing set aside or redone


def test_a_capture_of_all_zeros_is_never_committed(ray_cluster, qwen3_5_dir, corpus, tmp_path):
    """Issue 27.3: the silent failure other pipelines hit (a hybrid target whose capture
    wrote all-zero states) is refused at commit. A real Qwen3.5 hybrid whose embedding
    table is all zeros computes exactly zero at every layer: the job stops naming the
    shard and the layer, and commits nothing."""
    from safetensors.torch import load_file, save_file

    from extract.errors import ExtractError
    from extract.extraction.job import run_job
    from store_schema import layout

    model = tmp_path / "zero-embeddings"
    shutil.copytree(qwen3_5_dir, model)
    weights = load_file(model / "model.safetensors")
    embedding = next(name for name in weights if name.endswith("embed_tokens.weight"))
    weights[embedding] = torch.zeros_like(weights[embedding])
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    store = tmp_path / "store"
    with pytest.raises(ExtractError, match=r"shard shard-\d{6}: captured layer 1 is all zeros .* not committed"):
        run_job(_config(model, corpus[0], store, workers=1))
    assert not [p for p in (store / layout.SHARDS_DIR).iterdir() if p.is_dir()]


def test_second_job_on_a_held_store_is_refused(reference, qwen3_5_dir, corpus, capsys):
    from extract.__main__ import main
    from store_schema import StoreLock, StoreLockedError

    store, _ = reference
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time; from store_schema import StoreLock; StoreLock({str(store)!r}, job='other').acquire(); "
            "print('held', flush=True); time.sleep(60)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(
            [
                "run",
                "--model",
                str(qwen3_5_dir),
                "--corpus",
                str(corpus[0]),
                "--store",
                str(store),
                "--layers",
                "1,3,5",
                "--shard-tokens",
                str(SHARD_TOKENS),
                "--no-progress",
            ]
        )
        assert code == 1
        assert "held by another live job" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    with StoreLock(store):  # the dead holder's lock went with it
        with pytest.raises(StoreLockedError):
            StoreLock(store).acquire()


def test_one_worker_with_overwrite_gives_identical_content(reference, qwen3_5_dir, corpus, tmp_path):
    from extract.extraction.job import run_job

    ref_store, ref_report = reference
    store = tmp_path / "store"
    shutil.copytree(ref_store, store)
    report = run_job(_config(qwen3_5_dir, corpus[0], store, workers=1, overwrite=True))
    assert report["workers"] == 1 and report["shards_written"] == ref_report["shards"]  # all recomputed
    assert report["shards_skipped"] == 0
    assert _content(store) == _content(ref_store)


def test_worker_killed_mid_shard(reference, qwen3_5_dir, corpus, tmp_path):
    """The first actor SIGKILLs itself after its 2nd batch (mid-group, before any write):
    the groups it held are redone on a fresh actor; nothing lost, nothing duplicated,
    byte for byte what the uninterrupted run wrote."""
    from extract.extraction.job import run_job
    from extract.jobs.settings import FaultInjection
    from store_schema.tools.verify import verify_store

    ref_store, ref_report = reference
    store = tmp_path / "store"
    report = run_job(_config(qwen3_5_dir, corpus[0], store, faults=FaultInjection(kill_after_batches=(2,))))
    assert report["worker_deaths"] == 1 and report["workers_started"] == 3
    assert 1 <= report["shards_retried"] <= report["shards"]  # what it held: up to two groups
    assert report["shards_written"] + report["shards_committed_elsewhere"] == ref_report["shards"]
    result = verify_store(store)
    assert result.ok and not result.leftovers, result.problems
    assert _content(store) == _content(ref_store)


def test_driver_killed_mid_run_then_rerun(reference, ray_cluster, qwen3_5_dir, corpus, tmp_path):
    """A driver (its own process, joined to the cluster) SIGKILLs itself after its
    2nd commit; the same command then finishes the store without recomputing them."""
    from extract.extraction.job import run_job
    from extract.jobs.settings import KILL_DRIVER_ENV

    ref_store, ref_report = reference
    store = tmp_path / "store"
    command = [
        sys.executable,
        "-m",
        "extract",
        "run",
        "--model",
        str(qwen3_5_dir),
        "--corpus",
        str(corpus[0]),
        "--store",
        str(store),
        "--layers",
        "1,3,5",
        "--shard-tokens",
        str(SHARD_TOKENS),
        "--batch-tokens",
        str(BATCH_TOKENS),
        "--workers",
        "1",
        "--address",
        ray_cluster,
        "--no-progress",
    ]
    env = dict(os.environ, **{KILL_DRIVER_ENV: "2"})
    killed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    committed = {p.name: p.stat().st_ino for p in (store / "shards").iterdir() if (p / "commit.json").exists()}
    assert 2 <= len(committed) < ref_report["shards"]

    report = run_job(_config(qwen3_5_dir, corpus[0], store, workers=1))
    assert report["shards_skipped"] == len(committed)
    assert report["shards_written"] == ref_report["shards"] - len(committed)  # nothing else recomputed
    assert {n: (store / "shards" / n).stat().st_ino for n in committed} == committed
    assert _content(store) == _content(ref_store)


# --------------------------------------------------------------------------- disk full


@pytest.mark.faults
def test_disk_full_stops_cleanly_and_rerun_completes(reference, qwen3_5_dir, corpus, tmp_path):
    from extract.errors import ExtractError
    from extract.extraction.job import run_job
    from store_schema.tools.verify import verify_store

    ref_store, ref_report = reference
    size = sum(f.stat().st_size for f in ref_store.rglob("*") if f.is_file())
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        made = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size // 2}", "tmpfs", str(mount)], capture_output=True, text=True
        )
    except OSError as error:  # no mount(8) at all
        pytest.skip(f"cannot mount a small tmpfs here: {error}")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {made.stderr.strip()}")
    try:
        store = mount / "store"
        with pytest.raises(ExtractError, match=r"need about .* its filesystem has .* free .*--skip-space-check"):
            run_job(_config(qwen3_5_dir, corpus[0], store))  # the plan's estimate does not fit: refused up front
        assert not list(store.glob("shards/*"))
        with pytest.raises(ExtractError, match="disk full .* rerun the same command"):
            run_job(_config(qwen3_5_dir, corpus[0], store, skip_space_check=True))
        result = verify_store(store)
        committed = result.shards_checked
        assert 0 < committed < ref_report["shards"]
        assert all(p["what"].startswith("planned shard missing") for p in result.problems), result.problems

        subprocess.run(["mount", "-o", f"remount,size={size * 4}", str(mount)], check=True)
        report = run_job(_config(qwen3_5_dir, corpus[0], store))
        assert report["shards_skipped"] == committed
        assert report["shards_written"] == ref_report["shards"] - committed
        assert verify_store(store).ok
        assert _content(store) == _content(ref_store)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# --------------------------------------------------------------------------- a moved tree, the command line


def test_a_copied_tree_resumes_with_its_plan(reference, qwen3_5_dir, corpus, tmp_path):
    """Issue 16.7: model, corpus and store copied elsewhere (a new machine, a moved demo
    tree), a group of shards missing: the same bytes, tokenizer and settings decide,
    not the paths -- the stored plan is reused, the workers read the corpus where it
    is now, and the finished store equals the original byte for byte."""
    from extract.extraction.job import run_job
    from extract.jobs.batching import batch_groups
    from store_schema import Store

    ref_store, ref_report = reference
    tree = tmp_path / "copied"
    shutil.copytree(ref_store, tree / "store")
    shutil.copytree(qwen3_5_dir, tree / "model")
    shutil.copy(corpus[0], tree / "chats.jsonl")
    group = batch_groups([s.name for s in Store(ref_store).plan().shards], 4)[0]
    for name in group:
        shutil.rmtree(tree / "store" / "shards" / name)

    report = run_job(_config(tree / "model", tree / "chats.jsonl", tree / "store", workers=1))
    assert report["plan_reused"] and report["plan_digest"] == ref_report["plan_digest"]
    assert report["shards_written"] == len(group) and report["shards_skipped"] == ref_report["shards"] - len(group)
    assert _content(tree / "store") == _content(ref_store)


def _progress_lines(text: str) -> list[str]:
    import re

    pattern = re.compile(r"^extract: [\d,]+/[\d,]+ samples \(\d+\.\d%\), .*ETA (unknown|\d+:\d\d:\d\d)$")
    return [line for line in text.splitlines() if pattern.match(line)]


def _session_processes(session: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def test_sigterm_stops_the_job_as_ctrl_c_does_without_rays_dump(qwen3_dir, tmp_path):
    """Issue 62.7: SIGTERM to `extract run` (what `timeout`, Slurm and Kubernetes send)
    keeps the committed shards and prints the `interrupted:` line; Ray's own SIGTERM
    handler (a `*** SIGTERM received ... PC: @` stack dump) is not the one that answers."""
    corpus = write_chat_jsonl(tmp_path / "chats.jsonl", coding_chats(160, seed=8))
    store = tmp_path / "store"
    command = [sys.executable, "-m", "extract", "run", "--model", str(qwen3_dir), "--corpus", str(corpus)]
    command += ["--store", str(store), "--layers", "1,3", "--shard-tokens", str(SHARD_TOKENS), "--batch-tokens", "150"]
    command += ["--workers", "1", "--progress-interval", "0.5"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    returncode, err, _ = ctrl_c_when(command, env, lambda line: bool(_progress_lines(line)), terminate=True)
    if returncode == 0:
        pytest.skip("the job finished before SIGTERM landed")
    assert returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"interrupted: the plan and committed shards are kept; rerun the same command to resume ({store})"
    ), err[-3000:]
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]


def test_progress_lines_without_a_terminal_ctrl_c_then_resume(ray_cluster, qwen3_5_dir, tmp_path):
    """Issues 16.4, 16.3 and Ctrl-C, through `python -m extract run` with stderr a pipe
    (as under `ray job logs`): progress lines come every --progress-interval; Ctrl-C
    (SIGINT to the whole process group, as a terminal sends it) ends the job with one
    line saying how to resume, exit 130, no traceback, and the Ray it started gone;
    the same command then finishes the store; once more, it says there was nothing to do."""
    import time

    corpus = write_chat_jsonl(tmp_path / "chats.jsonl", coding_chats(160, seed=7))
    store = tmp_path / "store"
    command = [
        sys.executable,
        "-m",
        "extract",
        "run",
        "--model",
        str(qwen3_5_dir),
        "--corpus",
        str(corpus),
        "--store",
        str(store),
        "--layers",
        "1,3,5",
        "--shard-tokens",
        str(SHARD_TOKENS),
        "--batch-tokens",
        "150",
        "--workers",
        "1",
        "--progress-interval",
        "0.5",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    returncode, err, session = ctrl_c_when(command, env, lambda line: bool(_progress_lines(line)))
    if returncode == 0:
        pytest.skip("the job finished before Ctrl-C landed")
    assert returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"interrupted: the plan and committed shards are kept; rerun the same command to resume ({store})"
    ), err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "Token authentication" not in err, err[-3000:]  # Ray's notice about its own default: silenced
    for _ in range(600):  # poll bound (a hang guard, not a timing): Ray's processes exit with the driver
        if not _session_processes(session):
            break
        time.sleep(0.1)
    assert not _session_processes(session), "processes of the job's Ray outlived it"

    kept = len(list(store.glob("shards/*/commit.json")))
    joined = command + ["--address", ray_cluster]
    finished = subprocess.run(joined, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _progress_lines(finished.stderr), finished.stderr[-3000:]
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    assert report["status"] == "complete" and report["shards_committed"] == report["shards"]
    assert report["shards_skipped"] == kept and report["shards_written"] == report["shards"] - kept

    again = subprocess.run(joined, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.strip().splitlines()[-1].startswith(f"nothing to do: all {report['shards']} shard(s) of ")
    assert json.loads(again.stdout.strip().splitlines()[-1])["status"] == "nothing_to_do"
    assert json.loads((store / report["report"]).read_text()) == report  # the extracting run's report is kept
