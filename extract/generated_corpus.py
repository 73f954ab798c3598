"""A generated corpus: what `python -m extract generate` writes and `extract run` reads.

    CORPUS_DIR/
      manifest.json             written once, before any shard (a self-hashed record):
                                {"format", "version", "generation": who generated it and how,
                                 "shards": [NAME, ...] in record order, "plan": generate's own plan}
      shards/NAME/data.parquet  one Parquet shard: id, messages, truncated, generated_tokens
      shards/NAME/commit.json   size + crc32c of data.parquet; the shard is committed when its
                                directory is renamed into shards/ (`store_schema.commit.staging`)
      .staging/  .lock          as in a store: shards written aside; one live job

The manifest's ``generation`` block says which checkpoint wrote the responses (the
fields of `store_schema.fingerprint.target_identity`) and with which settings;
`extract run` compares its weights hash with its own target's
(`store_schema.provenance`). Another engine (vLLM, SGLang offline generation) writes
the same format with `write_manifest` and `commit_shard`; see docs/extraction.md."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from store_schema import layout
from store_schema.commit.lock import Attempt
from store_schema.commit.records import RecordError, read_record, write_record
from store_schema.commit.staging import write_and_commit

from .errors import GeneratedCorpusError

MANIFEST = "manifest.json"
FORMAT = "dflash-generated-corpus"
FORMAT_VERSION = 1
SHARD_FILE = "data.parquet"
# The columns of a shard, in order (`shard_table`).
COLUMNS = ("id", "messages", "truncated", "generated_tokens")


def is_generated_corpus(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def shard_file(corpus_dir, name: str) -> Path:
    return layout.shard_dir(Path(corpus_dir), name) / SHARD_FILE


def write_manifest(corpus_dir, generation: Mapping, shards: list[str], plan: Mapping | None = None) -> None:
    """Write the manifest (atomically) and make ``shards/``: done once, before any shard."""
    corpus_dir = Path(corpus_dir)
    (corpus_dir / layout.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "version": FORMAT_VERSION, "generation": dict(generation), "shards": list(shards)}
    if plan is not None:
        body["plan"] = dict(plan)
    write_record(corpus_dir / MANIFEST, body)


def read_manifest(corpus_dir) -> dict:
    """The manifest, checked (self-hash, format, version, shard names)."""
    path = Path(corpus_dir) / MANIFEST
    try:
        body = read_record(path)
    except RecordError as error:
        raise GeneratedCorpusError(str(error)) from None
    if body.get("format") != FORMAT or body.get("version") != FORMAT_VERSION:
        raise GeneratedCorpusError(
            f"{path}: format {body.get('format')!r} version {body.get('version')!r}, "
            f"expected {FORMAT!r} version {FORMAT_VERSION}"
        )
    shards = body.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, str) and "/" not in s for s in shards):
        raise GeneratedCorpusError(f"{path}: shards is not a list of shard names")
    if not isinstance(body.get("generation"), dict):
        raise GeneratedCorpusError(f"{path}: generation is not an object")
    return body


def generation_of(corpus_path) -> dict | None:
    """Who generated a corpus (the manifest's ``generation`` block); None for a plain corpus."""
    return read_manifest(corpus_path)["generation"] if is_generated_corpus(corpus_path) else None


def committed_shard_files(corpus_dir) -> list[Path]:
    """Every shard the manifest lists, in its order, all committed -- or a one-line
    error saying how many are missing (a generate job that has not finished)."""
    corpus_dir = Path(corpus_dir)
    names = read_manifest(corpus_dir)["shards"]
    missing = [name for name in names if not layout.is_committed(corpus_dir, name)]
    if missing:
        raise GeneratedCorpusError(
            f"{corpus_dir} is an unfinished generated corpus: {len(missing)} of {len(names)} shard(s) not committed "
            f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); rerun the same "
            "`python -m extract generate` command to finish it"
        )
    return [shard_file(corpus_dir, name) for name in names]


def shard_table(rows: list[dict]):
    """The Arrow table of one shard from rows with the `COLUMNS` (messages: role,
    content and, where there is reasoning, reasoning_content)."""
    import pyarrow as pa  # writing a shard only: `run` reads a manifest without pyarrow

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("messages", pa.list_(message)),
            ("truncated", pa.bool_()),
            ("generated_tokens", pa.int32()),
        ]
    )
    columns = {name: [row[name] for row in rows] for name in COLUMNS}
    return pa.Table.from_pydict(columns, schema=schema)


def commit_shard(
    corpus_dir, name: str, table, attempt: Attempt | None = None, extra: Mapping | None = None
) -> dict | None:
    """Write `table` as shard `name` and commit it (`store_schema.commit.staging`); its
    commit record, or None if it was committed already. With the driver's `attempt`, a revoked attempt raises
    `store_schema.commit.lock.ShardFenced` instead of committing. `extra`: more fields of
    the commit record (an engine's counts: records quarantined while generating, ...)."""
    import pyarrow.parquet as pq  # writing a shard only, as above

    corpus_dir = Path(corpus_dir)
    if layout.is_committed(corpus_dir, name):
        return None
    generated = sum(int(n or 0) for n in table.column("generated_tokens").to_pylist())
    truncated = sum(bool(flag) for flag in table.column("truncated").to_pylist())

    def record(_, files: dict) -> dict:
        return {
            "shard": name,
            "num_records": table.num_rows,
            "generated_tokens": generated,
            "truncated_records": truncated,
            **dict(extra or {}),
            "files": files,
        }

    return write_and_commit(
        corpus_dir, name, lambda staging: pq.write_table(table, staging / SHARD_FILE), record, attempt
    )


def shard_record(corpus_dir, name: str) -> dict:
    """A committed shard's commit record (records, generated tokens, files)."""
    return read_record(layout.shard_dir(Path(corpus_dir), name) / layout.COMMIT_RECORD)
