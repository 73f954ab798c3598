"""Loss-mask scopes (issue 12.4): by default the whole assistant turn as the target
emits it when served (reasoning, content, tool calls, end-of-turn token), never the
role header or a template-inserted empty <think></think>; `--loss-mask content`
keeps the content-only rule. Templates built for the test behave like Qwen3.6's
(reasoning via `reasoning_content` or inline, `enable_thinking` on and off) and
like one with `{% generation %}` tags."""

from __future__ import annotations

import json

import pytest
from builders import CHAT_TEMPLATE, write_chat_jsonl

from extract.extraction.planning import build_plan
from extract.tokenization import mask_with_generation_tags, mask_with_offsets, tokenize_record
from store_schema.fingerprint import Fingerprint, TargetFacts, target_identity
from store_schema.plan import PlanSettings

# Like Qwen3's / Qwen3.6's: reasoning from `reasoning_content` or split off inline
# `<think>...</think>`; turns after the last user message get a think block (empty
# without reasoning); tool calls after the content; `enable_thinking=False` puts an
# empty think block in the generation prompt.
QWEN_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content.lstrip('\\n') }}"
    "{%- for call in message.tool_calls or [] %}{{- '\\n<tool_call>\\n' + call.name + '\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# `{% generation %}` around reasoning and content; the end-of-turn token outside the tags.
TAGGED_THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content }}{% endgeneration %}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same with the end-of-turn token inside the tags (transformers' own examples do this).
TAGGED_END_TEMPLATE = TAGGED_THINK_TEMPLATE.replace(
    "{{- message.content }}{% endgeneration %}", "{{- message.content + '<|im_end|>' }}{% endgeneration %}"
).replace(
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}",
    "{%- else %}{{- message.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}",
)
UNTAGGED_THINK_TEMPLATE = TAGGED_THINK_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

ANSWER = "def double(x):\n    return 2 * x\n"
REASONING = "The user wants a function that doubles.\nMultiply by two."
SECOND = "def triple(x):\n    return 3 * x\n"


def _tokenizer(tokenizer_dir, tmp_path_factory, name: str, template: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = template
    path = tmp_path_factory.mktemp(name)
    tokenizer.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def qwen_like(tokenizer_dir, tmp_path_factory):
    return _tokenizer(tokenizer_dir, tmp_path_factory, "qwen_like", QWEN_LIKE_TEMPLATE)


def _chat(*turns, system: bool = False) -> list[dict]:
    messages = [{"role": "system", "content": "You write Python."}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", **assistant}]
    return messages


def _scored(tokenizer, tokenized) -> str:
    return tokenizer.decode([int(t) for t, m in zip(tokenized.input_ids, tokenized.loss_mask) if m])


def _served(tokenizer, messages, enable_thinking: bool) -> tuple[list[int], list[int]]:
    """What a server does with the last turn: the prompt it renders, and the tokens the
    target then emits (the rest of the rendered chat, through the end-of-turn token)."""
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith(prompt)
    emitted = text[len(prompt) : text.index("<|im_end|>", len(prompt)) + len("<|im_end|>")]
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(prompt), encode(emitted)


def _runs(mask) -> list[tuple[int, int]]:
    mask = [int(m) for m in mask]
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    return [(s, next((j for j in range(s, len(mask)) if not mask[j]), len(mask))) for s in starts]


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_the_default_scores_exactly_what_the_target_emits_when_served(qwen_like, enable_thinking):
    """Thinking on: the record carries reasoning (`reasoning_content`), and the scored
    tokens are the target's whole reply after the served prompt `<|im_start|>assistant\\n`:
    `<think>` + reasoning + `</think>` + content + `<|im_end|>`. Thinking off: no reasoning;
    the template's empty think block is part of the served prompt, never scored."""
    reply = {"content": ANSWER, "reasoning_content": REASONING} if enable_thinking else {"content": ANSWER}
    messages = _chat(("Double a number.", reply), system=True)
    tokenized = tokenize_record({"messages": messages}, qwen_like)
    prompt, emitted = _served(qwen_like, messages, enable_thinking)
    ids, mask = tokenized.input_ids.tolist(), tokenized.loss_mask.tolist()
    assert ids[: len(prompt) + len(emitted)] == prompt + emitted
    assert mask == [0] * len(prompt) + [1] * len(emitted) + [0] * (len(ids) - len(prompt) - len(emitted))
    scored = _scored(qwen_like, tokenized)
    assert scored.endswith(ANSWER + "<|im_end|>") and "assistant" not in scored
    if enable_thinking:
        assert scored == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}<|im_end|>"
    else:
        assert "<think>" not in scored and "<think>\n\n</think>" in qwen_like.decode(ids)
    content = tokenize_record({"messages": messages}, qwen_like, loss_mask="content")
    assert _scored(qwen_like, content) == ANSWER and content.input_ids.tolist() == ids


def test_inline_reasoning_scores_like_reasoning_content(qwen_like):
    separate = _chat(("Double a number.", {"content": ANSWER, "reasoning_content": REASONING}))
    inline = _chat(("Double a number.", {"content": f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"}))
    a, b = (tokenize_record({"messages": m}, qwen_like) for m in (separate, inline))
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    assert _scored(qwen_like, b).startswith("<think>\n" + REASONING)


def test_multi_turn_and_tool_calls_role_headers_never_scored(qwen_like):
    """Every assistant turn is scored through its end-of-turn token, tool calls the
    template renders included; an earlier turn whose reasoning the template drops
    (before the last user message) is scored as rendered; no role header is scored."""
    messages = _chat(
        ("Double a number.", {"content": ANSWER, "reasoning_content": "dropped by the template"}),
        (
            "Now triple, and run it.",
            {"content": SECOND, "reasoning_content": REASONING, "tool_calls": [{"name": "run_python"}]},
        ),
        system=True,
    )
    tokenized = tokenize_record({"messages": messages}, qwen_like)
    ids, mask = tokenized.input_ids.tolist(), tokenized.loss_mask.tolist()
    spans = [qwen_like.decode(ids[a:b]) for a, b in _runs(mask)]
    assert spans == [
        ANSWER + "<|im_end|>",
        f"<think>\n{REASONING}\n</think>\n\n{SECOND}\n<tool_call>\nrun_python\n</tool_call><|im_end|>",
    ]
    header = qwen_like("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for start, _ in _runs(mask):
        assert ids[start - len(header) : start] == header and not any(mask[start - len(header) : start])
    content = tokenize_record({"messages": messages}, qwen_like, loss_mask="content")
    assert [qwen_like.decode(content.input_ids[a:b].tolist()) for a, b in _runs(content.loss_mask)] == [ANSWER, SECOND]


def test_generation_tags_templates_agree_with_the_offsets_path(tokenizer_dir, tmp_path_factory, tokenizer):
    """Tags around reasoning + content (end-of-turn token outside the tags, or inside
    them) and the same template without tags: the same ids and the same turn masks.
    The demo's ChatML template (tags around the content): content + `<|im_end|>`."""
    tagged, tagged_end, untagged = (
        _tokenizer(tokenizer_dir, tmp_path_factory, name, template)
        for name, template in (
            ("tagged", TAGGED_THINK_TEMPLATE),
            ("tagged_end", TAGGED_END_TEMPLATE),
            ("untagged", UNTAGGED_THINK_TEMPLATE),
        )
    )
    messages = _chat(
        ("Double a number.", {"content": ANSWER, "reasoning_content": REASONING}), ("Now triple.", {"content": SECOND})
    )
    results = [tokenize_record({"messages": messages}, t) for t in (tagged, tagged_end, untagged)]
    for other in results[1:]:
        assert other.input_ids.tolist() == results[0].input_ids.tolist()
        assert other.loss_mask.tolist() == results[0].loss_mask.tolist()
    ids = results[0].input_ids.tolist()
    assert [tagged.decode(ids[a:b]) for a, b in _runs(results[0].loss_mask)] == [
        f"<think>\n{REASONING}\n</think>\n\n{ANSWER}<|im_end|>",
        SECOND + "<|im_end|>",
    ]
    chatml = tokenize_record({"messages": messages}, tokenizer)  # the demo template: tags around the content
    assert [tokenizer.decode(chatml.input_ids[a:b].tolist()) for a, b in _runs(chatml.loss_mask)] == [
        ANSWER + "<|im_end|>",
        SECOND + "<|im_end|>",
    ]
    assert "{% generation %}" in CHAT_TEMPLATE


def test_content_scope_is_the_old_rule(tokenizer, qwen_like):
    """`--loss-mask content` gives what the content-only paths always gave: the
    transformers assistant mask (tags), the content spans (no tags)."""
    messages = _chat(("Double a number.", {"content": ANSWER}), ("Now triple.", {"content": SECOND}), system=True)
    tags = tokenize_record({"messages": messages}, tokenizer, loss_mask="content")
    assert (tags.input_ids.tolist(), tags.loss_mask.tolist()) == tuple(
        map(list, mask_with_generation_tags(tokenizer, messages))
    )
    plain = tokenize_record({"messages": messages}, qwen_like, loss_mask="content")
    assert (plain.input_ids.tolist(), plain.loss_mask.tolist()) == tuple(
        map(list, mask_with_offsets(qwen_like, messages))
    )


def test_the_scope_is_recorded_in_the_plan_and_the_fingerprint(tmp_path, tokenizer, tokenizer_dir):
    corpus = write_chat_jsonl(
        tmp_path / "c.jsonl",
        [{"id": f"r{i}", "messages": _chat(("Double a number.", {"content": ANSWER * (i + 2)}))} for i in range(3)],
    )
    turn = build_plan(corpus, tokenizer_dir, PlanSettings(), tokenizer=tokenizer)
    content = build_plan(corpus, tokenizer_dir, PlanSettings(loss_mask="content"), tokenizer=tokenizer)
    assert (
        turn.settings["mask_convention"] == "assistant_turn"
        and PlanSettings.from_json(turn.settings).loss_mask == "turn"
    )
    assert content.settings["mask_convention"] == "assistant_content"
    assert PlanSettings.from_json(content.settings).loss_mask == "content"
    loss_tokens = lambda plan: [s.num_loss_tokens for shard in plan.shards for s in shard.samples]  # noqa: E731
    assert [n - 1 for n in sorted(loss_tokens(turn))] == sorted(loss_tokens(content))  # + one <|im_end|> each
    with pytest.raises(ValueError, match="plan settings: loss_mask must be one of"):
        PlanSettings(loss_mask="all")

    facts = TargetFacts(num_target_layers=8, hidden_size=64, vocab_size=512)
    identity = target_identity(tokenizer_dir)
    with_turn = Fingerprint.for_extraction(identity, turn, [1, 3], facts)
    with_content = Fingerprint.for_extraction(identity, content, [1, 3], facts)
    assert with_turn.loss_mask == "turn" and with_turn.to_json()["loss_mask"] == "turn"
    # A content-scope store records what every store before scopes did: no key, the same hash.
    assert with_content.loss_mask == "content" and "loss_mask" not in with_content.to_json()
    older = Fingerprint.from_json(json.loads(json.dumps(with_content.to_json())))
    assert older.loss_mask == "content" and older.sha256() == with_content.sha256()
    assert with_turn.diff(with_content) == {"loss_mask": ("turn", "content")}
