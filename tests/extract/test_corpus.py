"""Corpus readers: numbering, fetching by index, and bad lines as records, not crashes."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from builders import coding_chats, write_chat_jsonl

from extract.corpus import BadRecord, open_corpus


def write_all_formats(tmp_path, records):
    """The same records as JSONL, Parquet (several row groups) and a datasets dir."""
    import datasets

    jsonl = write_chat_jsonl(tmp_path / "corpus.jsonl", records)
    parquet = tmp_path / "corpus.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet, row_group_size=7)
    ds_dir = tmp_path / "corpus_ds"
    datasets.Dataset.from_list(records).save_to_disk(str(ds_dir))
    return jsonl, parquet, ds_dir


def test_formats_read_the_same_records_in_order(tmp_path):
    records = coding_chats(30)
    for path in write_all_formats(tmp_path, records):
        corpus = open_corpus(path)
        assert len(corpus) == 30
        assert [i for i, _ in corpus.iter_records()] == list(range(30))
        assert [r for _, r in corpus.iter_records()] == records, corpus.format
        assert [r for _, r in corpus.iter_records(11, 23)] == records[11:23]
        wanted = [29, 3, 3, 17, 0, 8]  # any order, duplicates, across row groups
        assert corpus.read(wanted) == [records[i] for i in wanted]
        with pytest.raises(IndexError):
            corpus.read([30])


def test_bad_jsonl_lines_become_bad_records(tmp_path):
    good = coding_chats(3)
    path = tmp_path / "mixed.jsonl"
    lines = [
        b"\xef\xbb\xbf" + json.dumps(good[0]).encode(),  # a byte-order mark is not an error
        b'{"id": "cut", "messages": [{"role": "user", "content": "hi',  # truncated inside a string
        b"",  # blank lines are not records
        json.dumps(good[1]).encode().replace(b"Write", b"Wr\xff\xfete"),  # invalid UTF-8
        b"[1, 2, 3]",  # valid JSON, not an object
        b"   ",
        json.dumps(good[2]).encode(),  # last line without a newline
    ]
    path.write_bytes(b"\n".join(lines))
    corpus = open_corpus(path)
    got = list(corpus.iter_records())
    assert [i for i, _ in got] == [0, 1, 2, 3, 4]
    assert got[0][1] == good[0] and got[4][1] == good[2]
    assert got[1][1].reason == "malformed_json"
    assert got[1][1].detail == "Unterminated string starting at (column 56)"  # not "... at at column 56"
    assert got[2][1].reason == "invalid_utf8"
    assert got[3][1] == BadRecord("wrong_type", "record is a JSON list, not an object")
    assert corpus.read([4, 1, 0]) == [good[2], got[1][1], good[0]]


def test_directory_of_files_reads_in_name_order(tmp_path):
    records = coding_chats(10)
    folder = tmp_path / "parts"
    folder.mkdir()
    write_chat_jsonl(folder / "b.jsonl", records[4:])
    write_chat_jsonl(folder / "a.jsonl", records[:4])
    corpus = open_corpus(folder)
    assert [r for _, r in corpus.iter_records()] == records
    assert corpus.read([5, 3]) == [records[5], records[3]]
    assert [r for _, r in corpus.iter_records(2, 7)] == records[2:7]  # a range across files


def test_datasets_dict_with_one_split(tmp_path):
    import datasets

    records = coding_chats(5)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "dd"))
    assert open_corpus(tmp_path / "dd").read([4]) == [records[4]]


def test_content_hash_follows_the_bytes(tmp_path):
    records = coding_chats(5)
    path = write_chat_jsonl(tmp_path / "c.jsonl", records)
    before = open_corpus(path).content_hash()
    assert open_corpus(path).content_hash() == before
    records[2]["messages"][1]["content"] += " "
    write_chat_jsonl(path, records)
    assert open_corpus(path).content_hash() != before


def test_unknown_corpus_is_refused(tmp_path):
    (tmp_path / "c.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="neither JSONL"):
        open_corpus(tmp_path / "c.csv")
    with pytest.raises(FileNotFoundError):
        open_corpus(tmp_path / "missing.jsonl")


def test_parquet_reads_rows_without_turning_a_big_row_group_into_python(tmp_path):
    """Issue 15.6: a Parquet corpus written as one big row group. Reading a shard's few
    records (and ranges that cross record batches) gives the right rows, and the
    Python objects made along the way stay a small fraction of converting the whole
    row group (what every read did before: 8.1 s on a 604 MB file) -- from the row
    group decoded once and kept, and streamed when it is over the memory budget."""
    import tracemalloc

    base = coding_chats(50)
    records = [dict(id=f"r{i:05d}", messages=base[i % len(base)]["messages"]) for i in range(5000)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=len(records))
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    corpus = open_corpus(path)
    assert corpus.BATCH_ROWS < len(records)  # several record batches in the one group

    wanted = [4321, 17, 2500, 1023, 1024, 4999, 17]
    tracemalloc.start()
    got = corpus.read(wanted)
    read_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == [records[i] for i in wanted]
    assert [r for _, r in corpus.iter_records(1020, 1030)] == records[1020:1030]
    assert [i for i, _ in corpus.iter_records(4990)] == list(range(4990, 5000))

    tracemalloc.start()
    pq.ParquetFile(path).read_row_group(0).to_pylist()
    whole_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert read_peak * 10 < whole_peak, (read_peak, whole_peak)

    streamed = open_corpus(path)
    streamed.DECODED_BYTES = 0  # the row group is over the budget: streamed in record batches
    tracemalloc.start()
    assert streamed.read(wanted) == [records[i] for i in wanted]
    assert tracemalloc.get_traced_memory()[1] * 10 < whole_peak
    tracemalloc.stop()


def test_where_names_the_file_and_its_1_based_line_or_row(tmp_path):
    """Issue 35.10: a quarantined record is named where an editor finds it, not by the
    plan's 0-based index over non-blank lines."""
    (tmp_path / "a.jsonl").write_text('{"id": 1}\n\n{"id": 2}\n')
    (tmp_path / "b.jsonl").write_text('\n{"id": 3}\n')
    corpus = open_corpus(tmp_path)
    assert [corpus.where(i) for i in range(len(corpus))] == ["a.jsonl line 1", "a.jsonl line 3", "b.jsonl line 2"]
    parquet = tmp_path / "pq"
    parquet.mkdir()
    for name, ids in (("a.parquet", range(10)), ("b.parquet", range(10, 13))):
        pq.write_table(pa.Table.from_pylist([{"id": i} for i in ids]), parquet / name, row_group_size=4)
    corpus = open_corpus(parquet)
    assert [corpus.where(i) for i in (0, 9, 10, 12)] == [
        "a.parquet row 1",
        "a.parquet row 10",
        "b.parquet row 1",
        "b.parquet row 3",
    ]
