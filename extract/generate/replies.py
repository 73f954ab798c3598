"""What an `--engine openai` job sends for one turn, what it makes of the reply, and
the journal of replies that lets a rerun skip every reply it already has.

* **Request.** The turn's messages (the record's, earlier assistant turns replaced
  by the target's own replies) with the chat template's generation prompt, thinking
  mode as ``chat_template_kwargs.enable_thinking``, greedy at temperature 0 (else
  sampled with a seed fixed by ``--seed``, record and turn) and every other sampling
  knob neutral (`SAMPLING`, recorded in the manifest), stopping at the target's
  end-of-turn tokens, ``return_token_ids`` (vLLM) so the ids come back too.
* **Reply.** With the generated ids, the text is theirs decoded by the target's
  tokenizer (`turns.reply_text`, the hf engine's rule), never the server's text; only a
  server that returns no ids (``return_token_ids`` is vLLM's) gives its text (reasoning
  a server's reasoning parser split off put back in its ``<think>`` block). Then
  `turns.reply_message` parses it as the hf engine does.
* **Token check.** The conversation with the reply is rendered and tokenized as
  `extract run` will; the reply's tokens there must be the server's ids (end-of-turn
  token included), and the prompt's the ids the server saw.
* **Journal.** ``OUT/.replies/SHARD/*.jsonl``: one line per finished reply, keyed by
  record, turn and prompt hash; read back when a shard is (re)done, removed once it
  is committed. Not part of the corpus."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .client import Completion
from .turns import THINK_CLOSE, THINK_OPEN, reply_message, reply_text

JOURNAL_DIR = ".replies"
# Sampling settings sent with every request besides temperature and seed: the full
# distribution, no penalties (a server would otherwise apply the model's
# generation_config.json defaults).
SAMPLING = dict(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def request_body(messages: list[dict], settings, max_tokens: int, stop_ids: list[int], seed_key: str) -> dict:
    body = dict(
        messages=messages,
        max_tokens=int(max_tokens),
        temperature=float(settings.temperature),
        n=1,
        stop_token_ids=list(stop_ids),
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        add_generation_prompt=True,
        return_token_ids=True,
        **SAMPLING,
    )
    if settings.thinking != "keep":
        body["chat_template_kwargs"] = {"enable_thinking": settings.thinking == "on"}
    if settings.temperature > 0:
        digest = hashlib.sha256(f"{settings.seed}/{seed_key}".encode()).hexdigest()
        body["seed"] = int(digest[:8], 16) & 0x7FFFFFFF
    return body


@dataclass(frozen=True)
class Reply:
    """One finished turn, as journaled: enough to rebuild the message and its counts."""

    text: str  # the reply as the target wrote it, without the end-of-turn token
    tokens: int  # generated, the end-of-turn token included when it ended the reply
    hit_limit: bool  # stopped by --max-new-tokens / --max-length
    checked: bool  # the server returned its ids, so the token check ran
    mismatch: bool  # the reply's tokens as `extract run` will see them differ from the server's
    prompt_mismatch: bool  # the server's prompt ids differ from the target tokenizer's


def make_reply(
    completion: Completion,
    tokenizer,
    prompt_messages: list[dict],
    prompt_text: str,
    prompt_ids: list[int],
    end_of_turn: list[int],
) -> Reply:
    ids = completion.token_ids
    hit_limit = completion.finish_reason == "length"
    mismatch = False
    if ids is not None:
        ids = [int(i) for i in ids]  # the end-of-turn token included, where the server returns it
        body = ids[:-1] if ids and ids[-1] in end_of_turn else ids
        text = reply_text(tokenizer, body)  # never the server's own (incremental) text
        tokens = len(body) + (0 if hit_limit else 1)
        rendered = rendered_reply_ids(
            tokenizer, prompt_messages, prompt_ids, reply_message(prompt_text, text), len(ids)
        )
        mismatch = rendered != ids
    else:
        text = raw_text(prompt_text, completion)
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + (0 if hit_limit else 1)
    served_prompt = completion.prompt_token_ids
    prompt_mismatch = served_prompt is not None and [int(i) for i in served_prompt] != prompt_ids
    return Reply(text, tokens, hit_limit, ids is not None, mismatch, prompt_mismatch)


def raw_text(prompt_text: str, completion: Completion) -> str:
    """The reply's text as generated, where the server returned text only: reasoning its
    parser split off goes back in front of ``</think>`` (the ``<think>`` too when the
    prompt did not open it)."""
    if completion.reasoning is None:
        return completion.text
    opened = prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)
    return ("" if opened else THINK_OPEN) + completion.reasoning + THINK_CLOSE + completion.text


def rendered_reply_ids(
    tokenizer, prompt_messages: list[dict], prompt_ids: list[int], message: dict, count: int
) -> list[int] | None:
    """The `count` tokens after the prompt in the conversation with `message`, rendered
    and tokenized as `extract run` renders it; None when the rendering does not start
    with the prompt's tokens."""
    text = tokenizer.apply_chat_template(prompt_messages + [message], tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if ids[: len(prompt_ids)] != prompt_ids:
        return None
    return ids[len(prompt_ids) : len(prompt_ids) + count]


def prompt_digest(prompt_text: str) -> str:
    return hashlib.sha256(prompt_text.encode()).hexdigest()[:32]


class Journal:
    """The finished replies of one shard: read when it starts, appended as replies come
    back (a line per reply, flushed), removed when the shard is committed. Several
    attempts of a shard write files of their own; any of them may be read back, since a
    line is a reply to the prompt it names."""

    def __init__(self, out: str | Path, shard: str, attempt_token: str):
        self.dir = Path(out) / JOURNAL_DIR / shard
        self.dir.mkdir(parents=True, exist_ok=True)
        self.replies = self.read(self.dir)
        self._file = open(self.dir / f"{attempt_token}-{os.getpid()}.jsonl", "a", encoding="utf-8")

    @staticmethod
    def read(directory: Path) -> dict[tuple[str, int], tuple[str, Reply]]:
        """(record id, turn) -> (prompt digest, reply) of every journal file there."""
        replies = {}
        for path in sorted(directory.glob("*.jsonl")):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                    reply = Reply(**entry["reply"])
                except (ValueError, TypeError, KeyError):
                    continue  # a line torn by a crash: that reply is requested again
                replies[(entry["id"], entry["turn"])] = (entry["prompt"], reply)
        return replies

    def get(self, sample_id: str, turn: int, prompt_text: str) -> Reply | None:
        found = self.replies.get((sample_id, turn))
        return found[1] if found and found[0] == prompt_digest(prompt_text) else None

    def add(self, sample_id: str, turn: int, prompt_text: str, reply: Reply) -> None:
        entry = dict(id=sample_id, turn=turn, prompt=prompt_digest(prompt_text), reply=asdict(reply))
        self._file.write(json.dumps(entry, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def journaled_replies(out: str | Path, shards: list[str]) -> int:
    """How many replies of `shards` the journal holds: a rerun does not ask for them."""
    return sum(len(Journal.read(Path(out) / JOURNAL_DIR / shard)) for shard in shards)


def remove_journal(out: str | Path, shard: str | None = None) -> None:
    """A committed shard's journal (or, with no shard, the whole journal: the job is done)."""
    root = Path(out) / JOURNAL_DIR
    shutil.rmtree(root / shard if shard else root, ignore_errors=True)
