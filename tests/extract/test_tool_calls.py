"""Agentic records (issue 27.0): OpenAI-format assistant `tool_calls` and `tool`
replies are accepted, rendered by a Qwen3-style template and scored by the turn
rule (the tool-call turn is the assistant's: scored; a tool's reply: never); string
and object `arguments` are the same record; per-tokenizer facts are read once."""

from __future__ import annotations

import json

import builders
import pytest
from builders import QWEN_TOOL_TEMPLATE

from extract.errors import QuarantineError
from extract.generate.turns import conversation
from extract.messages import clean_messages
from extract.tokenization import tokenize_record
from extract.tokenizer_facts import tokenizer_facts

ARGUMENTS = {"path": "json/__init__.py", "lines": [1, 40]}
REASONING = "I should read the file first."
ANSWER = "def dumps(obj):\n    return JSONEncoder().encode(obj)\n"
TOOL_REPLY = "def dumps(obj, *, skipkeys=False): ..."


@pytest.fixture(scope="module")
def qwen_tools(tokenizer_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    path = tmp_path_factory.mktemp("qwen_tools")
    tokenizer.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def agentic(arguments, content=None) -> dict:
    call = {"id": "call_0", "type": "function", "function": {"name": "read_file", "arguments": arguments}}
    return {
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write `dumps` from `json`."},
            {"role": "assistant", "content": content, "reasoning_content": REASONING, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": TOOL_REPLY},
            {"role": "assistant", "content": ANSWER},
        ]
    }


def _scored_runs(tokenizer, tokenized) -> list[str]:
    return builders.scored_text(tokenizer, tokenized.input_ids.tolist(), tokenized.loss_mask.tolist())


def test_the_tool_call_turn_is_scored_and_the_tool_reply_is_not(qwen_tools):
    tokenized = tokenize_record(agentic(json.dumps(ARGUMENTS)), qwen_tools)
    call = '<tool_call>\n{"name": "read_file", "arguments": ' + json.dumps(ARGUMENTS) + "}\n</tool_call>"
    assert _scored_runs(qwen_tools, tokenized) == [
        f"<think>\n{REASONING}\n</think>\n\n{call}<|im_end|>",
        ANSWER + "<|im_end|>",  # the template's empty think block before it stays unscored
    ]
    text = qwen_tools.decode(tokenized.input_ids.tolist())
    assert f"<|im_start|>user\n<tool_response>\n{TOOL_REPLY}\n</tool_response><|im_end|>" in text
    content = tokenize_record(agentic(json.dumps(ARGUMENTS)), qwen_tools, loss_mask="content")
    assert _scored_runs(qwen_tools, content) == [ANSWER]  # the content scope: content only, as before


@pytest.mark.parametrize("content", [None, ""])
def test_string_and_object_arguments_and_null_content_are_one_record(qwen_tools, content):
    as_object = tokenize_record(agentic(ARGUMENTS), qwen_tools)
    as_string = tokenize_record(agentic(json.dumps(ARGUMENTS), content=content), qwen_tools)
    assert as_string.input_ids.tolist() == as_object.input_ids.tolist()
    assert as_string.loss_mask.tolist() == as_object.loss_mask.tolist()


def test_a_turn_that_only_calls_a_tool_is_a_reply():
    messages = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "ls", "arguments": ""}]},
    ]
    assert clean_messages(messages)[1]["tool_calls"] == [{"name": "ls", "arguments": {}}]  # the flat form


@pytest.mark.parametrize(
    "call, reason, detail",
    [
        ({"function": {"name": "ls", "arguments": "{not json"}}, "bad_tool_call", "tool_calls[0].function.arguments"),
        ({"function": {"name": "ls", "arguments": "[1, 2]"}}, "bad_tool_call", "a list, not an object"),
        ({"function": {"arguments": {}}}, "bad_tool_call", "tool_calls[0].function has no name"),
        ("ls", "wrong_type", "tool_calls[0] is a str"),
    ],
)
def test_bad_tool_calls_are_quarantined_naming_the_call(qwen_tools, call, reason, detail):
    record = {
        "messages": [
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
    }
    with pytest.raises(QuarantineError) as error:
        tokenize_record(record, qwen_tools)
    assert error.value.reason == reason and detail in error.value.detail and "messages[1]" in error.value.detail


def test_generate_answers_after_a_tool_reply_and_keeps_it():
    record = agentic(ARGUMENTS)
    record["messages"] = record["messages"][:4]  # ends with the tool's reply
    conv = conversation(record)
    assert conv.turns == (2, 4)  # the tool-call turn and a new answer; never the tool message
    replies = [{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "assistant", "content": "ok"}]
    assert conv.prompt(1, replies)[3] == {"role": "tool", "tool_call_id": "call_0", "content": TOOL_REPLY}


def test_tokenizer_facts_are_read_once_and_follow_edits(qwen_tools):
    facts = tokenizer_facts(qwen_tools)
    assert tokenizer_facts(qwen_tools) is facts and facts.vocab_size == len(qwen_tools)
    assert facts.end_of_turn_strings == ("<|im_end|>",) and facts.generation_tags is False
    assert qwen_tools.convert_tokens_to_ids("<|im_end|>") in facts.end_of_turn_ids
    assert facts.end_of_turn_ids[0] in facts.special_ids
    template = qwen_tools.chat_template
    try:
        qwen_tools.chat_template = (
            "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
        )
        assert tokenizer_facts(qwen_tools).generation_tags is True
    finally:
        qwen_tools.chat_template = template
