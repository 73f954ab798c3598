"""How much memory vLLM's engine is given when `serve-check` runs it on CPU.

vLLM's `gpu_memory_utilization` is, on its CPU backend, a share of *host* memory
(its memory node's MemTotal): its worker asks for ``share * MemTotal`` bytes and keeps for the
KV cache what is left after its own resident size (python, torch, vLLM and the
weights). A fixed share that fits one machine fails on a smaller or busier one
("kv (-0.07/0.64 GiB)" at 0.05 on a 24 GiB machine). So the share is sized from
what the engine needs (`engine_bytes`): the target's and drafter's weights, the
KV cache of the longest reply (target and drafter layers alike), and the engine
process's own overhead, each with headroom; and it must fit in the memory actually
free (counted as vLLM counts it, and at most ``/proc/meminfo`` MemAvailable), or the
check is refused before vLLM starts."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from store_schema.runtime.target_config import read_target_config

GIB = 1024**3
# vLLM's CPU worker before its KV cache: python + torch + vLLM resident, measured
# 0.71 GiB (issue 35's log: 0.64 GiB asked, -0.07 GiB left for the KV cache); x2 headroom.
ENGINE_OVERHEAD_BYTES = int(1.5 * GIB)
# Weights are counted twice: the loaded copy, and the one being read or cast (a
# bf16 checkpoint served in float32 doubles in size).
WEIGHT_COPIES = 2
KV_BLOCK_TOKENS = 128  # vLLM CPU's KV block: the cache is counted in whole blocks, plus one
SHARE_STEP = 0.01  # shares are rounded up to this


@dataclass(frozen=True)
class HostMemory:
    total: int  # bytes vLLM's share is a share of: its memory node's MemTotal (or the cgroup's limit)
    available: int  # bytes free now (vLLM's own count, and never more than MemAvailable)


def parse_meminfo(text: str) -> dict[str, int]:
    """`/proc/meminfo` or a node's `meminfo` ("Node 0 MemTotal: 97421888 kB") as bytes by field."""
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[name.split()[-1]] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def node_available(fields: dict[str, int]) -> int:
    """Free memory as vLLM's CPU worker counts it: free, file pages and reclaimable slab."""
    return sum(fields.get(key, 0) for key in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))


def host_memory(root: Path = Path("/")) -> HostMemory:
    """The memory vLLM's CPU worker sizes itself by, read as it reads it: the memory
    node of this process's first CPU (a 2-node VM's node 0 may hold 10 of its 23 GiB),
    clamped by a cgroup v2 limit; free memory also capped by /proc/meminfo MemAvailable."""
    system = parse_meminfo((root / "proc/meminfo").read_text())
    fields = system
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    nodes = sorted((root / f"sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    node_meminfo = root / f"sys/devices/system/node/{nodes[0].name}/meminfo" if nodes else None
    if node_meminfo is not None and node_meminfo.is_file():
        fields = parse_meminfo(node_meminfo.read_text())
    total = fields["MemTotal"]
    available = min(node_available(fields), system.get("MemAvailable", system["MemTotal"]))
    limit = _read_int(root / "sys/fs/cgroup/memory.max")
    if limit is not None and limit < total:
        total = limit
        available = max(0, min(available, limit - (_read_int(root / "sys/fs/cgroup/memory.current") or 0)))
    return HostMemory(total=total, available=available)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token over `layers` attention layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def weight_bytes(model_dir: str | Path) -> int:
    """The safetensors files of a model directory, bytes (weights as stored)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def engine_bytes(*, weights: int, kv_per_token: int, max_model_len: int) -> int:
    """What vLLM's engine needs for one sequence of `max_model_len` tokens: overhead,
    `WEIGHT_COPIES` of the weights, and the KV cache in whole blocks plus one."""
    blocks = math.ceil(max_model_len / KV_BLOCK_TOKENS) + 1
    return ENGINE_OVERHEAD_BYTES + WEIGHT_COPIES * weights + blocks * KV_BLOCK_TOKENS * kv_per_token


class NotEnoughMemory(ValueError):
    """vLLM's engine would not fit in the memory free now."""


def cpu_memory_share(needed: int, memory: HostMemory) -> float:
    """The `gpu_memory_utilization` that gives vLLM's CPU engine `needed` bytes of
    host memory, rounded up to `SHARE_STEP`; NotEnoughMemory when that is more than
    is available now (vLLM would refuse it too, after a minute of start-up)."""
    share = math.ceil(needed / memory.total / SHARE_STEP) * SHARE_STEP
    if share * memory.total > memory.available:
        raise NotEnoughMemory(
            f"vLLM's engine needs ~{needed / GIB:.2f} GiB (share {share:.2f} of {memory.total / GIB:.1f} GiB) but only "
            f"{memory.available / GIB:.2f} GiB is available now (MemAvailable): free some memory, or give "
            "--gpu-memory-utilization"
        )
    return round(share, 4)


def served_engine_bytes(
    target_dir: str | Path, drafter_dir: str | Path, drafter_config, max_model_len: int, dtype_bytes: int
) -> int:
    """`engine_bytes` of serving `drafter_dir` (its DrafterConfig given) as the DFlash
    speculator of `target_dir`, sequences up to `max_model_len` tokens, KV cache at
    `dtype_bytes` per value. Every target layer is counted as attention (a hybrid
    target's linear layers hold less: an upper bound)."""
    target = read_target_config(target_dir)
    kv = kv_bytes_per_token(
        target.num_hidden_layers, target.num_key_value_heads, target.head_dim, dtype_bytes
    ) + kv_bytes_per_token(
        drafter_config.num_hidden_layers, drafter_config.num_key_value_heads, drafter_config.head_dim, dtype_bytes
    )
    return engine_bytes(
        weights=weight_bytes(target_dir) + weight_bytes(drafter_dir), kv_per_token=kv, max_model_len=max_model_len
    )
