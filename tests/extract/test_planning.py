"""Tokenization (assistant-content loss masks), the planning pass, and `plan --dry-run`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import CHAT_TEMPLATE, coding_chats, write_chat_jsonl
from paths import REPO

from extract.errors import PlanError, QuarantineError, SampleMismatchError
from extract.extraction.planning import (
    assign_shards,
    build_plan,
    check_tokenizer,
    estimate_store_bytes,
    load_samples,
    summarize,
)
from extract.tokenization import (
    has_generation_tags,
    mask_with_generation_tags,
    mask_with_offsets,
    tokenize_record,
)
from store_schema.plan import PlannedSample, PlanSettings, sample_digest

NO_TAGS_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Like Qwen3's: strips the content and puts an empty think block before the last answer.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'].strip() }}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _variant(tokenizer_dir, tmp_path_factory, name, template):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = template
    path = tmp_path_factory.mktemp(name)
    tokenizer.save_pretrained(str(path))
    return path, AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def no_tags(tokenizer_dir, tmp_path_factory):
    return _variant(tokenizer_dir, tmp_path_factory, "no_tags", NO_TAGS_TEMPLATE)


@pytest.fixture(scope="module")
def think(tokenizer_dir, tmp_path_factory):
    return _variant(tokenizer_dir, tmp_path_factory, "think", THINK_TEMPLATE)


def long_chats(count: int, seed: int = 0) -> list[dict]:
    """Chats whose answers pass the 2 x block_size loss-token floor and fit in 512 tokens."""
    chats = [r for r in coding_chats(count * 4, seed) if 300 <= len(r["messages"][1]["content"]) <= 700][:count]
    assert len(chats) == count
    return chats


def multi_turn(records: list[dict]) -> list[dict]:
    a, b = records[0]["messages"][1]["content"], records[1]["messages"][1]["content"]
    return [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "First function, please."},
        {"role": "assistant", "content": a},
        {"role": "user", "content": "And another one."},
        {"role": "assistant", "content": b},
    ]


def masked_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([int(t) for t, m in zip(ids, mask) if m])


def runs(mask) -> int:
    mask = [0, *[int(m) for m in mask], 0]
    return sum(1 for i in range(1, len(mask)) if mask[i] and not mask[i - 1])


# --------------------------------------------------------------------------- loss masks


def test_both_template_paths_give_the_assistant_content_mask(tokenizer, no_tags):
    _, plain = no_tags
    assert has_generation_tags(tokenizer) and not has_generation_tags(plain)
    chats = long_chats(6)
    conversations = [r["messages"] for r in chats] + [multi_turn(chats)]
    special = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    for messages in conversations:
        ids_a, mask_a = mask_with_generation_tags(tokenizer, messages)
        ids_b, mask_b = mask_with_offsets(plain, messages)
        assert ids_a == ids_b
        assert mask_a == mask_b
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert masked_text(tokenizer, ids_b, mask_b) == "".join(answers)
        assert runs(mask_b) == len(answers)  # one run per assistant turn, nothing in between
        assert not any(m and t in special for t, m in zip(ids_b, mask_b))
        # The role marker right before each answer is never scored.
        assistant_marker = tokenizer.encode("assistant", add_special_tokens=False)
        first = mask_b.index(1)
        assert ids_b[first - len(assistant_marker) - 1 : first - 1] == assistant_marker
        assert not any(mask_b[:first])
    # An answer starting with spaces: the byte-level BPE merges the template's "\n" with them into
    # one token; both paths score such a boundary token (it holds answer text).
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "    x = 1\n" + answers[0]}]
    ids_a, mask_a = mask_with_generation_tags(tokenizer, messages)
    ids_b, mask_b = mask_with_offsets(plain, messages)
    assert (ids_a, mask_a) == (ids_b, mask_b)
    first = mask_b.index(1)
    assert tokenizer.decode(ids_b[first : first + 1]).startswith("\n ")


def test_offsets_path_skips_what_the_template_inserts(think):
    _, tokenizer = think
    chats = long_chats(2)
    messages = multi_turn(chats)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<think>\n\n</think>\n\n" in text
    answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    content = tokenize_record({"messages": messages}, tokenizer, loss_mask="content")
    got = masked_text(tokenizer, content.input_ids, content.loss_mask)
    assert got == "".join(answers) and "think>" not in got
    assert runs(content.loss_mask) == 2
    turn = tokenize_record({"messages": messages}, tokenizer)  # the default scope adds each end-of-turn token
    assert masked_text(tokenizer, turn.input_ids, turn.loss_mask) == "".join(a + "<|im_end|>" for a in answers)
    assert runs(turn.loss_mask) == 2


def test_answer_repeating_the_prompt_is_found_in_the_answer(no_tags):
    _, tokenizer = no_tags
    text = "def f(x):\n    return x + 1\n" * 3
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
    tokenized = tokenize_record({"messages": messages}, tokenizer)
    first = int(np.argmax(tokenized.loss_mask))
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert first == prompt_tokens  # not the copy inside the user turn
    assert masked_text(tokenizer, tokenized.input_ids, tokenized.loss_mask) == text + "<|im_end|>"


def test_pretokenized_records_and_truncation(tokenizer):
    ids = list(range(10, 110))
    mask = [0] * 40 + [1] * 60
    full = tokenize_record({"input_ids": ids, "loss_mask": mask}, tokenizer)
    assert full.input_ids.dtype == np.int32 and full.loss_mask.dtype == np.uint8
    assert full.input_ids.tolist() == ids and full.loss_mask.tolist() == mask
    cut = tokenize_record({"input_ids": ids, "loss_mask": mask}, tokenizer, max_length=50)
    assert cut.input_ids.tolist() == ids[:50] and cut.loss_mask.tolist() == mask[:50] and cut.original_length == 100
    with pytest.raises(QuarantineError) as error:
        tokenize_record({"input_ids": ids, "loss_mask": mask}, tokenizer, max_length=50, drop_long=True)
    assert error.value.reason == "too_long"
    chat = long_chats(1)[0]
    whole = tokenize_record(chat, tokenizer)
    short = tokenize_record(chat, tokenizer, max_length=30)
    assert short.input_ids.tolist() == whole.input_ids[:30].tolist()
    assert short.loss_mask.tolist() == whole.loss_mask[:30].tolist()


# --------------------------------------------------------------------------- a corpus with every kind of bad record


def bad_corpus(path: Path, tokenizer, extra_good: int = 0) -> tuple[dict[int, str], dict[int, str]]:
    """Write a JSONL corpus mixing good records with each kind of bad one.
    Returns ({record_index: expected sample id}, {record_index: expected reason})."""
    chats = long_chats(6 + extra_good)
    answer = chats[0]["messages"][1]["content"]
    pre_ids = tokenizer.encode("x = 1\n" + answer, add_special_tokens=False)
    lines, good, bad = [], {}, {}

    def add(record=None, *, raw: bytes | None = None, good_id=None, reason=None):
        index = len(lines)
        lines.append(raw if raw is not None else json.dumps(record).encode())
        if reason:
            bad[index] = reason
        else:
            good[index] = good_id if good_id is not None else record.get("id", f"rec-{index:09d}")

    add(chats[0])
    add(raw=b'{"id": "cut", "messages": [{"role": "user", "content": "hi"}, {"role": "assis', reason="malformed_json")
    add({"id": "pre", "input_ids": pre_ids, "loss_mask": [0, 0, 0, 0] + [1] * (len(pre_ids) - 4)})
    add({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 42}]}, reason="wrong_type")
    add({"messages": "user: hi\nassistant: hello"}, reason="wrong_type")
    add(
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}, reason="no_assistant_turn"
    )
    add({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, reason="empty_response")
    add(raw=json.dumps(chats[1]).encode().replace(b"Write", b"Wr\xc3\x28te"), reason="invalid_utf8")
    huge = {"messages": [{"role": "user", "content": "all"}, {"role": "assistant", "content": answer * 30}]}
    add(huge, reason="too_long")
    add(dict(chats[2], id="../../x"), reason="unsafe_id")
    add(dict(chats[3], id=chats[0]["id"]), reason="duplicate_id")
    add({"id": "nothing"}, reason="missing_field")
    add(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]},
        reason="too_few_loss_tokens",
    )
    add({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, reason="length_mismatch")
    add({"input_ids": [1, 99999] * 20, "loss_mask": [1] * 40}, reason="token_out_of_range")
    add({"messages": chats[4]["messages"]})  # no id: rec-000000015
    add(
        {"messages": [{"role": "robot", "content": "{}"}, {"role": "assistant", "content": answer}]},
        reason="unknown_role",
    )
    add({"id": "multi", "messages": multi_turn(chats[4:6])})
    for chat in chats[6:]:
        add(chat)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return good, bad


def test_quarantine_names_each_bad_record_and_keeps_every_good_one(tmp_path, tokenizer, tokenizer_dir):
    corpus = tmp_path / "mixed.jsonl"
    good, bad = bad_corpus(corpus, tokenizer)
    settings = PlanSettings(max_length=512, drop_long=True, min_loss_tokens=32)
    plan = build_plan(corpus, tokenizer_dir, settings, tokenizer=tokenizer)
    assert {q.record_index: q.reason for q in plan.quarantined} == bad
    kept = {s.record_index: s.sample_id for shard in plan.shards for s in shard.samples}
    assert kept == good
    unsafe = next(q for q in plan.quarantined if q.reason == "unsafe_id")
    assert unsafe.sample_id is None  # an unsafe id never travels on as a name
    assert summarize(plan).quarantined_by_reason["wrong_type"] == 2
    # Without drop_long the huge record is truncated and kept.
    truncated = build_plan(corpus, tokenizer_dir, PlanSettings(max_length=512), tokenizer=tokenizer)
    huge = next(s for shard in truncated.shards for s in shard.samples if s.record_index == 8)
    assert huge.num_tokens == 512
    # By default a short reply is kept: some drafter trains on it (each family's filter decides at fit).
    short = next(index for index, reason in bad.items() if reason == "too_few_loss_tokens")
    assert short not in {q.record_index for q in truncated.quarantined}


def test_strict_mode_raises_naming_the_record(tmp_path, tokenizer, tokenizer_dir):
    corpus = tmp_path / "mixed.jsonl"
    bad_corpus(corpus, tokenizer)
    with pytest.raises(PlanError, match=r"^mixed.jsonl line 2: malformed_json") as error:
        build_plan(corpus, tokenizer_dir, tokenizer=tokenizer, strict=True)
    assert error.value.record_index == 1 and error.value.reason == "malformed_json"


def test_plan_is_the_same_for_any_worker_count(tmp_path, tokenizer, tokenizer_dir):
    corpus = tmp_path / "mixed.jsonl"
    _, bad = bad_corpus(corpus, tokenizer, extra_good=30)
    settings = PlanSettings(max_length=512, drop_long=True, shard_tokens=2048, seed=3, min_loss_tokens=32)
    serial = build_plan(corpus, tokenizer_dir, settings, tokenizer=tokenizer)
    parallel = build_plan(corpus, tokenizer_dir, settings, workers=2, chunk_records=5)
    assert len(serial.shards) > 3 and len(serial.quarantined) == len(bad)
    assert parallel.to_json() == serial.to_json()
    assert parallel.digest() == serial.digest()


def test_jsonl_parquet_and_datasets_give_the_same_plan(tmp_path, tokenizer, tokenizer_dir):
    import datasets

    records = long_chats(20)
    records.insert(5, {"id": "no-answer", "messages": [{"role": "user", "content": "q"}]})
    records.insert(9, {"id": "pre", "input_ids": list(range(5, 80)), "loss_mask": [0] * 10 + [1] * 65})
    jsonl = write_chat_jsonl(tmp_path / "c.jsonl", records)
    parquet = tmp_path / "c.parquet"
    table = pa.Table.from_struct_array(pa.array(records))  # columns from every record, not just the first
    assert "input_ids" in table.column_names
    pq.write_table(table, parquet, row_group_size=4)
    ds_dir = tmp_path / "c_ds"
    datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(ds_dir))
    plans = [
        build_plan(p, tokenizer_dir, PlanSettings(shard_tokens=1500), tokenizer=tokenizer)
        for p in (jsonl, parquet, ds_dir)
    ]
    assert [q.reason for q in plans[0].quarantined] == ["no_assistant_turn"]
    assert plans[0].num_samples == 21
    for other in plans[1:]:
        assert other.shards == plans[0].shards
        assert other.quarantined == plans[0].quarantined
    assert [p.settings["corpus_format"] for p in plans] == ["jsonl", "parquet", "datasets"]


def test_settings_are_recorded(tmp_path, tokenizer, tokenizer_dir, no_tags):
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", long_chats(4))
    settings = PlanSettings(max_length=700, shard_tokens=999, block_size=8, seed=5)
    plan = build_plan(corpus, tokenizer_dir, settings, tokenizer=tokenizer)
    s = plan.settings
    assert (s["max_length"], s["shard_tokens"], s["block_size"], s["seed"]) == (700, 999, 8, 5)
    assert s["corpus_path"] == str(corpus.resolve()) and s["corpus_records"] == 4
    assert len(s["corpus_hash"]) == 64 and s["generation_tags"] is True
    assert PlanSettings.from_json(s) == settings  # the planner's input, read back from the plan
    other = build_plan(corpus, no_tags[0], settings)
    assert other.settings["chat_template_hash"] != s["chat_template_hash"]
    assert other.settings["tokenizer_hash"] != s["tokenizer_hash"]
    assert other.shards == plan.shards  # same ids and masks through the other template path
    json.dumps(s)  # settings travel as JSON


# The settings a plan records, as every store written so far holds them. A store's
# `verify` and a resumed job compare `Plan.digest()` of the plan they would make with
# the store's: any change to these keys or values orphans every existing store.
RECORDED_KEYS = {
    "planner_version",
    "corpus_path",
    "corpus_format",
    "corpus_hash",
    "corpus_records",
    "limit",
    "max_length",
    "drop_long",
    "shard_tokens",
    "block_size",
    "min_loss_tokens",
    "seed",
    "tokenizer_path",
    "tokenizer_hash",
    "chat_template_hash",
    "generation_tags",
    "mask_convention",
    "truncation",
}


TURN_PLAN_DIGEST = "a6f01beaba52e0b8708338c976730e7a5ed367ed31965411c5c0be9d15788566"


def test_plan_digest_is_pinned():
    """A plan made before `PlanSettings` existed (a flat settings dict) keeps its digest."""
    from store_schema.plan import Plan, PlannedShard, QuarantinedRecord

    settings = dict(
        planner_version=1,
        corpus_path="/data/corpus.jsonl",
        corpus_format="jsonl",
        corpus_hash="c" * 64,
        corpus_records=3,
        limit=None,
        max_length=3072,
        drop_long=False,
        shard_tokens=32768,
        block_size=16,
        min_loss_tokens=32,
        seed=0,
        tokenizer_path="/models/target",
        tokenizer_hash="t" * 64,
        chat_template_hash="h" * 64,
        generation_tags=True,
        mask_convention="assistant_content",
        truncation="keep_first_max_length_tokens",
    )
    assert set(settings) == RECORDED_KEYS
    plan = Plan(
        (
            PlannedShard(
                "shard-000000",
                (PlannedSample("a", 0, 120, 80, "1" * 64), PlannedSample("rec-000000002", 2, 90, 40, "2" * 64)),
            ),
        ),
        (QuarantinedRecord(1, None, "malformed_json", "line 2"),),
        settings,
    )
    assert plan.digest() == "af597751763a6e375332ebe0ecced524832a390d35c17221bde3abec0acb53ff"
    # Stores made before loss-mask scopes scored the content: `--loss-mask content` resumes them.
    assert PlanSettings.from_json(settings) == PlanSettings(loss_mask="content", block_size=16)
    assert PlanSettings(loss_mask="content", block_size=16).to_json().items() <= settings.items()
    # The default scope scores whole turns: a new convention, so a new digest (pinned too).
    turn = dict(settings, **PlanSettings(block_size=16).to_json())
    assert turn == dict(settings, mask_convention="assistant_turn")
    assert PlanSettings.from_json(turn) == PlanSettings(block_size=16)
    assert Plan(plan.shards, plan.quarantined, turn).digest() == TURN_PLAN_DIGEST
    # Plans made since the store serves every family record no block, one loss token at least.
    assert set(PlanSettings().to_json()) == set(PlanSettings(block_size=16).to_json()) - {"block_size"}
    assert "block_size" not in PlanSettings().to_json() and PlanSettings().min_loss_tokens == 1


def test_plan_settings_are_the_planners_input_and_its_record(tmp_path, tokenizer, tokenizer_dir):
    """build_plan records exactly the flat settings the planner always recorded (so a
    plan built now has the digest an older build gave the same corpus), and the
    store gives back the same plan, digest and `PlanSettings`."""
    from extract.corpus import open_corpus
    from extract.tokenization import chat_template_hash, tokenizer_hash
    from store_schema.plan_io import read_plan, write_plan_group

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", long_chats(6))
    settings = PlanSettings(max_length=300, shard_tokens=999, block_size=8, seed=5, drop_long=True, limit=5)
    plan = build_plan(corpus, tokenizer_dir, settings, tokenizer=tokenizer)
    assert plan.settings == dict(
        planner_version=1,
        corpus_path=str(corpus.resolve()),
        corpus_format="jsonl",
        corpus_hash=open_corpus(corpus).content_hash(),
        corpus_records=6,
        limit=5,
        max_length=300,
        drop_long=True,
        shard_tokens=999,
        block_size=8,
        min_loss_tokens=16,
        seed=5,
        tokenizer_path=str(tokenizer_dir.resolve()),
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=chat_template_hash(tokenizer),
        generation_tags=True,
        mask_convention="assistant_turn",
        truncation="keep_first_max_length_tokens",
    )
    assert set(plan.settings) == RECORDED_KEYS
    assert plan.num_samples + len(plan.quarantined) == 5  # limit: record 5 never planned
    assert PlanSettings.from_json(plan.settings) == settings

    (tmp_path / "store").mkdir()
    write_plan_group(tmp_path / "store" / "plan", plan)
    back = read_plan(tmp_path / "store")
    assert back == plan and back.digest() == plan.digest()
    assert PlanSettings.from_json(back.settings) == settings


@pytest.mark.parametrize(
    "field, value",
    [("max_length", 0), ("shard_tokens", -1), ("block_size", 0), ("max_length", 1.5), ("seed", "0"), ("limit", "all")],
)
def test_plan_settings_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"plan settings: {field} must be"):
        PlanSettings(**{field: value})


# --------------------------------------------------------------------------- re-reading a shard


def test_load_samples_reproduces_the_plan_and_catches_a_changed_corpus(tmp_path, tokenizer, tokenizer_dir):
    corpus = tmp_path / "mixed.jsonl"
    bad_corpus(corpus, tokenizer)
    plan = build_plan(corpus, tokenizer_dir, PlanSettings(max_length=512, shard_tokens=1024), tokenizer=tokenizer)
    check_tokenizer(tokenizer, plan.settings)
    for shard in plan.shards:
        loaded = load_samples(corpus, tokenizer, shard.samples, plan.settings)
        assert [sample_id for sample_id, _, _ in loaded] == [s.sample_id for s in shard.samples]
        for planned, (_, ids, mask) in zip(shard.samples, loaded):
            assert ids.dtype == np.int32 and mask.dtype == np.uint8
            assert sample_digest(ids.tobytes(), mask.tobytes()) == planned.digest
            assert (len(ids), int(mask.sum())) == (planned.num_tokens, planned.num_loss_tokens)

    lines = corpus.read_bytes().split(b"\n")
    record = json.loads(lines[0])
    record["messages"][1]["content"] = record["messages"][1]["content"].replace("return", "yield")
    lines[0] = json.dumps(record).encode()
    corpus.write_bytes(b"\n".join(lines))
    shard = next(s for s in plan.shards if any(p.record_index == 0 for p in s.samples))
    with pytest.raises(SampleMismatchError, match=record["id"]):
        load_samples(corpus, tokenizer, shard.samples, plan.settings)


def test_check_tokenizer_refuses_another_tokenizer(tmp_path, tokenizer, tokenizer_dir, no_tags):
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", long_chats(2))
    plan = build_plan(corpus, tokenizer_dir, tokenizer=tokenizer)
    with pytest.raises(SampleMismatchError, match="tokenizer"):
        check_tokenizer(no_tags[1], plan.settings)


# --------------------------------------------------------------------------- shards


def fake_samples(lengths: list[int]) -> list[PlannedSample]:
    return [PlannedSample(f"s{i}", i, n, n // 2, f"{i:064x}") for i, n in enumerate(lengths)]


def test_shards_fill_to_budget_in_random_subsets():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(50, 900, 200)] + [5000, 3000]
    samples = fake_samples(lengths)
    shards = assign_shards(samples, 2000, seed=1)
    assert [s.name for s in shards] == [f"shard-{i:06d}" for i in range(len(shards))]
    placed = [p for shard in shards for p in shard.samples]
    assert sorted(placed, key=lambda p: p.record_index) == samples  # every sample exactly once
    for shard in shards:
        assert shard.num_tokens <= 2000 or len(shard.samples) == 1
        assert [p.num_tokens for p in shard.samples] == sorted((p.num_tokens for p in shard.samples), reverse=True)
    alone = [shard.samples[0].record_index for shard in shards if shard.num_tokens > 2000]
    assert sorted(alone) == [200, 201]
    # Greedy: a shard closes only when the next sample would not fit.
    assert sum(shard.num_tokens for shard in shards) / len(shards) > 1500
    # A shuffle, not file order, and fixed by the seed.
    assert [p.record_index for p in shards[0].samples] != sorted(p.record_index for p in shards[0].samples) or max(
        p.record_index for p in shards[0].samples
    ) > len(shards[0].samples)
    assert assign_shards(list(reversed(samples)), 2000, seed=1) == shards
    assert assign_shards(samples, 2000, seed=2) != shards


def test_ties_in_length_are_ordered_by_record_index():
    shards = assign_shards(fake_samples([100] * 6), 10_000, seed=0)
    assert [p.record_index for p in shards[0].samples] == list(range(6))


def test_store_size_estimate(tmp_path, tokenizer, tokenizer_dir):
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", long_chats(3))
    plan = build_plan(corpus, tokenizer_dir, tokenizer=tokenizer)
    estimate = estimate_store_bytes(plan, num_context_layers=5, hidden_size=5120)
    assert estimate.raw_bytes == plan.num_tokens * (5 * 5120 * 2 + 4 + 1)
    assert estimate.compressed_bytes == round(estimate.raw_bytes * 0.614)
    assert estimate.fp8_bytes == round(estimate.raw_bytes * 0.351)
    # The design's headline: 2.6B tokens x 5 layers x 5120 x bf16 is ~130 TB raw.
    from store_schema.plan import Plan, PlannedShard

    big = Plan((PlannedShard("shard-000000", (PlannedSample("a", 0, 2_600_000_000, 1, "0" * 64),)),))
    assert 130e12 < estimate_store_bytes(big, 5, 5120).raw_bytes < 135e12


# --------------------------------------------------------------------------- CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "extract", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # child processes
def test_plan_dry_run_prints_counts_and_writes_nothing(tmp_path, tokenizer, qwen3_dir, capsys):
    from extract.__main__ import main

    work = tmp_path / "job"
    work.mkdir()
    corpus = work / "mixed.jsonl"
    good, bad = bad_corpus(corpus, tokenizer)
    store = work / "store.zarr"
    before = sorted(p.name for p in work.iterdir())
    common = ["plan", "--model", str(qwen3_dir), "--corpus", str(corpus), "--store", str(store)]
    common += ["--max-length", "512", "--drop-long", "--min-loss-tokens", "32", "--layers", "1,3"]

    text = run_cli(*common, "--dry-run")  # the real entry point, in its own process
    assert text.returncode == 0, text.stderr
    assert f"samples     {len(good)} in " in text.stdout
    assert f"quarantined {len(bad)}" in text.stdout
    assert "  duplicate_id          1" in text.stdout and "  wrong_type            2" in text.stdout
    assert "raw," in text.stdout and "compressed" in text.stdout and "nothing written" in text.stdout

    capsys.readouterr()
    assert main([*common, "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip())
    assert report["samples"] == len(good) and report["quarantined"] == len(bad)
    assert sum(report["quarantined_by_reason"].values()) == len(bad)
    assert report["layer_ids"] == [1, 3] and report["hidden_size"] == 64
    assert report["estimated_raw_bytes"] == report["tokens"] * (2 * 64 * 2 + 5)

    assert main(common) == 2  # writing a plan is `run`'s job
    assert "run" in capsys.readouterr().err
    assert main([*common[:-2], "--layers", "1,5", "--dry-run"]) == 1
    assert "final layer 5" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == before and not store.exists()


def test_sharegpt_records_read_as_the_chats_they_are(tokenizer):
    """Issue 62.5: `conversations` of {"from", "value"} (SpecForge's, EAGLE's, Vicuna's
    corpora) tokenize and score exactly as the same chat in `messages`; a speaker the
    reader does not know is quarantined by name."""
    from extract.errors import QuarantineError
    from extract.tokenization import tokenize_record

    chat = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Reverse a list."},
        {"role": "assistant", "content": "Use xs[::-1]."},
    ]
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in chat]}
    as_chat, as_sharegpt = tokenize_record({"messages": chat}, tokenizer), tokenize_record(sharegpt, tokenizer)
    assert as_chat.input_ids.tolist() == as_sharegpt.input_ids.tolist() and as_chat.loss_mask.sum() > 0
    assert as_chat.loss_mask.tolist() == as_sharegpt.loss_mask.tolist()
    with pytest.raises(QuarantineError, match=r"conversations\[1\] is from 'narrator'") as caught:
        tokenize_record(
            {"conversations": [sharegpt["conversations"][0], {"from": "narrator", "value": "x"}]}, tokenizer
        )
    assert caught.value.reason == "unknown_role"


def test_a_corpus_of_nothing_usable_names_its_first_lines_fields_and_the_formats(tmp_path, qwen3_dir, capsys):
    """Issue 62.5: every record rejected -> the error names the first records of each reason
    (file:line, the fields they have) and the formats a record is read in."""
    from extract.__main__ import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"r{i}", "dialog": ["hi", "hello"]}) + "\n" for i in range(3)))
    argv = ["plan", "--model", str(qwen3_dir), "--corpus", str(corpus), "--layers", "1,3", "--dry-run"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "c.jsonl line 1: missing_field: record has neither messages nor input_ids (its fields: dialog, id)" in err
    assert "c.jsonl line 2:" in err and "c.jsonl line 3:" not in err  # the first two of the reason
    assert '"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value"}' in err
