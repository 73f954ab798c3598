"""Object-storage failures are one line, `error: <what> (<where>): <the fix>` (issue
48.1), against a real moto_server: a plain-HTTP endpoint without AWS_ALLOW_HTTP, a
bucket that does not exist, no credentials, credentials the server refuses, an
endpoint nobody answers. Each through the commands a user meets them in."""

from __future__ import annotations

import socket

import builders
import pytest

from benchmarks.common import loopback_s3, new_bucket

pytestmark = pytest.mark.slow


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Debug source" not in err and "<?xml" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert len(lines[0]) < 400, lines[0]
    return lines[0]


def info(url) -> int:
    from store_schema.__main__ import main

    return main(["info", str(url)])


def fit(url, target, out) -> int:
    from train.cli import main

    return main(["fit", "--store", str(url), "--target", str(target), "--out", str(out)])


def test_a_plain_http_endpoint_without_allow_http_names_the_variable(url, qwen3_dir, tmp_path, monkeypatch, capsys):
    builders.random_store(url, num_shards=1)
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    assert info(url) == 1
    line = one_error_line(capsys)
    assert "is plain HTTP" in line and "set AWS_ALLOW_HTTP=true" in line, line
    assert fit(url, qwen3_dir, tmp_path / "run") == 1
    assert "set AWS_ALLOW_HTTP=true" in one_error_line(capsys)


def test_a_missing_bucket_is_said_as_such_by_info_fit_and_extract(s3_server, qwen3_dir, tmp_path, capsys):
    from extract.__main__ import main as extract

    missing = "s3://no-such-bucket-here/jobs/store"
    assert info(missing) == 2
    line = one_error_line(capsys)
    assert line == (
        f"error: no such bucket ({missing} at {s3_server}): create bucket no-such-bucket-here or fix the URL"
    ), line
    assert fit(missing, qwen3_dir, tmp_path / "run") == 2
    assert "no such bucket" in one_error_line(capsys)
    corpus = builders.write_chat_jsonl(tmp_path / "c.jsonl", builders.coding_chats(2))
    assert (
        extract(
            [
                "run",
                "--model",
                str(qwen3_dir),
                "--corpus",
                str(corpus),
                "--store",
                missing,
                "--layers",
                "1,3",
                "--plan-workers",
                "1",
                "--no-progress",
                "--spool-dir",
                str(tmp_path / "spool"),
            ]
        )
        == 2
    )
    assert "no such bucket" in one_error_line(capsys)


def test_no_credentials_and_an_unreachable_endpoint(url, monkeypatch, capsys):
    builders.random_store(url, num_shards=1)
    with monkeypatch.context() as env:
        env.delenv("AWS_ACCESS_KEY_ID")
        env.delenv("AWS_SECRET_ACCESS_KEY")
        env.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{closed_port()}")  # no instance role here
        assert info(url) == 1
        line = one_error_line(capsys)
        assert line.startswith(f"error: no credentials found ({url} at ") and "AWS_ACCESS_KEY_ID" in line, line
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    assert info(url) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"error: cannot reach the endpoint ({url} at http://127.0.0.1:") and (
        "check AWS_ENDPOINT_URL and the network" in line
    ), line


def test_credentials_the_server_refuses_are_access_denied(monkeypatch, capsys):
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "1")  # moto checks keys after the bucket is made
    with loopback_s3() as endpoint:
        bucket = new_bucket(endpoint)
        assert info(f"s3://{bucket}/store") == 1
    line = one_error_line(capsys)
    assert line.startswith("error: access denied (InvalidAccessKeyId) (s3://") and "AWS_SECRET_ACCESS_KEY" in line, line
