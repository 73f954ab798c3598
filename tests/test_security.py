"""Security properties of the data path: no pickle, no remote code by default,
loopback-only services, sample ids that can never become paths."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
from paths import REPO

from store_schema import is_safe_id

PACKAGES = ("store_schema", "extract", "train")


def _sources():
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))


def test_no_pickle_or_torch_load_on_the_data_path():
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "cloudpickle", "dill", "joblib") for n in names):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports a pickle module")
            if isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name):
                if node.value.id in ("torch", "pickle"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} calls {node.value.id}.load")
    assert not offenders, offenders
    assert list(_sources()), "the scan must see the packages"


def test_trust_remote_code_is_never_switched_on_in_code():
    offenders = []
    for path in _sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"trust_remote_code\s*=\s*True", line):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}")
    assert not offenders, offenders
    from extract.jobs.target import load_target
    from store_schema.runtime.target_model import load_target_model

    for loader in (load_target, load_target_model):
        assert inspect.signature(loader).parameters["trust_remote_code"].default is False


@pytest.mark.parametrize(
    "sample_id", ["../../x", "/etc/passwd", "a/b", "..", ".hidden", "", "x" * 129, "a\x00b", "a b", "ü"]
)
def test_unsafe_ids_are_refused(sample_id):
    assert not is_safe_id(sample_id)


@pytest.mark.parametrize("sample_id", ["sample-00001", "rec-000000012", "A.b_c-9"])
def test_safe_ids_are_accepted(sample_id):
    assert is_safe_id(sample_id)


# --------------------------------------------------------------------------- Ray services on loopback

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _ray_start_flags(command: str) -> dict:
    flags = {}
    for token in command.replace("\n", " ").split():
        if token.startswith("--"):
            name, _, value = token[2:].partition("=")
            flags[name] = value
    return flags


def test_cluster_yaml_binds_dashboard_and_set_hosts_to_loopback():
    import yaml

    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    starts = [
        c
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for c in config.get(key) or []
        if "ray start" in c
    ]
    assert len(starts) == 2
    for command in starts:
        flags = _ray_start_flags(command)
        if "head" in flags:
            # The dashboard (and its job-submission API) is on, and only on loopback.
            assert flags.get("include-dashboard") == "true" and flags.get("dashboard-host") in LOOPBACK, command
        for name, value in flags.items():  # any host/address the file sets for a service port
            if name.endswith("-host"):
                assert value in LOOPBACK, (name, value)
        assert "ray-client-server-host" not in flags and "0.0.0.0" not in command


def test_every_ray_init_in_the_packages_keeps_the_dashboard_off_or_on_loopback():
    """A `ray.init` that may start a local cluster must say include_dashboard=False or
    dashboard_host=<loopback>; one that joins a cluster (address=<variable>) starts none."""
    calls = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "ray.init":
                keywords = {k.arg: k.value for k in node.keywords if k.arg}
                address = keywords.get("address")
                starts_local = address is None or (
                    isinstance(address, ast.Constant) and address.value in ("local", None)
                )
                dashboard_off = (
                    isinstance(keywords.get("include_dashboard"), ast.Constant)
                    and keywords["include_dashboard"].value is False
                )
                host = keywords.get("dashboard_host")
                on_loopback = isinstance(host, ast.Constant) and host.value in LOOPBACK
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", starts_local, dashboard_off or on_loopback))
    assert any(starts for _, starts, _ in calls), calls  # extract/jobs/pool.py starts a local cluster
    assert all(safe for _, starts, safe in calls if starts), calls


def _listening() -> set[tuple[str, int]]:
    import socket
    import struct

    out = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            if family == socket.AF_INET:
                ip = socket.inet_ntop(family, struct.pack("<I", int(address, 16)))
            else:
                ip = socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
            out.add((ip, int(port, 16)))
    return out


@pytest.mark.slow  # fault injection
@pytest.mark.faults
def test_the_local_ray_the_job_starts_serves_no_dashboard_or_client_port(tmp_path):
    """Start Ray exactly as `extract run` does without --address (in a child process)
    and read the kernel's listening sockets: nothing new on the dashboard port (8265)
    or the Ray client port (10001), on any address."""
    import subprocess
    import sys

    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp on this system")
    script = (
        "import json, sys; from extract.extraction.config import JobConfig\n"
        "from extract.jobs.pool import start_ray; import ray\n"
        "start_ray(JobConfig(model='m', corpus='c', store='s').execution.placement())\n"
        "print('started', flush=True); sys.stdin.readline(); ray.shutdown()\n"
    )
    before = _listening()
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "started"
        opened = _listening() - before
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=120)
    assert opened, "Ray opened no listening socket at all: the check would see nothing"
    assert not {(ip, port) for ip, port in opened if port in (8265, 10001)}, sorted(opened)
