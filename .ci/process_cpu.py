"""Where a test run's CPU goes, by process: sample /proc while it runs, then report.

    python3 .ci/process_cpu.py sample OUT.json &   # every 0.5 s until SIGTERM
    make test; kill %1
    python3 .ci/process_cpu.py report OUT.json

Each process's CPU seconds (user + system, as last sampled), command line and the
`PYTEST_CURRENT_TEST` it inherited, for processes that started after the sampling did.
A process that lived under half a second may be missed; one SIGKILLed keeps its last sample."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
KINDS = [  # (pattern in the command line, kind), first match wins
    (r"default_worker\.py|^ray::", "ray worker"),
    (r"/raylet/raylet|gcs_server|dashboard|log_monitor|autoscaler|runtime_env/agent", "ray cluster"),
    (r"-m train (\S+)", "train {}"),
    (r"-m extract (\S+)", "extract {}"),
    (r"-m store_schema (\S+)", "store_schema {}"),
    (r"benchmarks/(\S+)\.py", "benchmark {}"),
    (r"vllm", "vllm"),
    (r"import sys;exec\(eval", "pytest worker"),
]


def cpu_and_start(pid: int) -> tuple[float, int] | None:
    """(CPU seconds so far, start time in clock ticks) of `pid`, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[19])


def describe(pid: int) -> dict | None:
    """`pid`'s command line and the PYTEST_CURRENT_TEST it inherited (read once, when first seen)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return None
    tests = [
        item.split(b"=", 1)[1].decode(errors="replace") for item in environ if item.startswith(b"PYTEST_CURRENT_TEST=")
    ]
    return {"command": command, "test": tests[0] if tests else ""} if command else None


def sample(out: str) -> None:
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    seen: dict[str, dict | None] = {}  # None: a process without a command line (a kernel thread, gone)
    while not stopped:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in before or int(name) == os.getpid():
                continue
            found = cpu_and_start(int(name))
            if found is None:
                continue
            key = f"{name}:{found[1]}"
            if key not in seen:
                seen[key] = describe(int(name))
            process = seen[key]
            if process is not None:
                process["cpu"] = found[0]
        time.sleep(0.5)
    with open(out, "w") as f:
        json.dump([process for process in seen.values() if process is not None], f)


def kind(command: str) -> str:
    for pattern, name in KINDS:
        match = re.search(pattern, command)
        if match:
            return name.format(*match.groups())
    return "other"


def report(path: str) -> None:
    with open(path) as f:
        processes = json.load(f)
    cpu: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for process in processes:
        cpu[kind(process["command"])] += process["cpu"]
        count[kind(process["command"])] += 1
    print(f"{sum(cpu.values()):.0f} CPU s in {len(processes)} processes")
    for name, seconds in cpu.most_common():
        print(f"{seconds:8.1f} s {count[name]:5d}  {name}")


if __name__ == "__main__":
    {"sample": sample, "report": report}[sys.argv[1]](sys.argv[2])
