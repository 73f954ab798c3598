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


def read(pid: int) -> tuple[float, str, str, int] | None:
    """(CPU seconds, command line, PYTEST_CURRENT_TEST, start time) of `pid`, None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rfind(")") + 2 :].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
        test = ""
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"PYTEST_CURRENT_TEST="):
                    test = item.split(b"=", 1)[1].decode(errors="replace")
        return (int(fields[11]) + int(fields[12])) / TICK, command, test, int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def sample(out: str) -> None:
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    seen: dict[str, dict] = {}
    while not stopped:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in before or int(name) == os.getpid():
                continue
            found = read(int(name))
            if found is None or not found[1]:
                continue
            cpu, command, test, started = found
            seen.setdefault(f"{name}:{started}", {"command": command, "test": test})["cpu"] = cpu
        time.sleep(0.5)
    with open(out, "w") as f:
        json.dump(list(seen.values()), f)


def kind(command: str) -> str:
    for pattern, name in KINDS:
        match = re.search(pattern, command)
        if match:
            return name.format(*match.groups())
    return "other"


def report(path: str) -> None:
    processes = json.load(open(path))
    cpu, count = collections.Counter(), collections.Counter()
    for process in processes:
        cpu[kind(process["command"])] += process["cpu"]
        count[kind(process["command"])] += 1
    print(f"{sum(cpu.values()):.0f} CPU s in {len(processes)} processes")
    for name, seconds in cpu.most_common():
        print(f"{seconds:8.1f} s {count[name]:5d}  {name}")


if __name__ == "__main__":
    {"sample": sample, "report": report}[sys.argv[1]](sys.argv[2])
