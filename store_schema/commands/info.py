"""`python -m store_schema info STORE`: what a store holds (shards, samples, tokens,
layers, dtype, codec, bytes, target), what its plan left out, or (`--quarantined`) every
record it left out as JSON lines."""

from __future__ import annotations

import json
from collections import Counter

from ..codecs.encoding import CodecConfig
from ..dtypes import store_dtype
from ..layout import layer_array, raw_bytes_per_token
from ..runtime.cli import EXIT_OK
from ..runtime.units import human_bytes
from ..stores import backend


def run(args) -> int:
    store = backend(args.store).metadata()
    if args.quarantined:
        for record in quarantined_records(store.plan()):
            print(json.dumps(record))
        return EXIT_OK
    summary = info_summary(store)
    if args.json:
        print(json.dumps(summary))
        return EXIT_OK
    fp = summary["fingerprint"]
    planned = f" of {summary['planned_shards']} planned" if summary["planned_shards"] is not None else ""
    print(f"store        {summary['store']}")
    print(f"shards       {summary['shards']} committed{planned}")
    print(f"samples      {summary['samples']}")
    quarantined = summary["quarantined"]
    if quarantined:
        reasons = ", ".join(f"{reason} {count}" for reason, count in quarantined.items())
        print(f"quarantined  {sum(quarantined.values())} record(s) left out by the plan: {reasons}")
        for row in first_per_reason(quarantined_records(store.plan())):
            print(f"             record {row['record']}: {row['reason']}: {row['detail']}")
        print(f"             (all of them: python -m store_schema info {args.store} --quarantined)")
    print(f"tokens       {summary['tokens']}")
    print(f"layers       {fp['layer_ids']} ({fp['layer_id_convention']})")
    description = store_dtype(fp["dtype"]).description
    print(f"dtype        {fp['dtype']}" + (f" ({description})" if description else ""))
    for line in projection_lines(fp.get("projection") or {}, fp["hidden_size"]):
        print(line)
    print(f"codec        {CodecConfig.from_json(summary['codec']).describe()}")
    print(f"raw bytes    {human_bytes(summary['raw_bytes'])} (as bf16)")
    print(f"on disk      {human_bytes(summary['disk_bytes'])} (ratio {summary['ratio']})")
    print(
        f"target       {fp['target_model']} (hidden {fp['hidden_size']}, vocab {fp['vocab_size']}, "
        f"{fp['num_target_layers']} layers)"
    )
    print(f"kernels      {fp['kernels']}")
    print(f"responses    {summary['response_provenance']} (where the corpus's responses came from)")
    return EXIT_OK


def projection_lines(projection: dict, hidden_size: int) -> list[str]:
    """A projected store's ranks and energy kept per layer (none for a store kept whole)."""
    if not projection:
        return []
    kept = ", ".join(
        f"layer {layer}: {rank} of {hidden_size} ({projection['energy_kept'][layer]:.4f} of the energy)"
        for layer, rank in projection["ranks"].items()
    )
    return [f"projection   {kept}; fitted on {projection['fitted_tokens']:,} tokens a layer"]


def info_summary(store) -> dict:
    fp = store.fingerprint
    tokens = store.num_tokens()
    raw = tokens * raw_bytes_per_token(fp.hidden_size, len(fp.layer_ids))
    disk = store.stored_bytes()
    plan = store.plan()
    return {
        "store": str(store.path),
        "shards": len(store.committed_shards()),
        "planned_shards": None if plan is None else len(plan.shards),
        "quarantined": quarantined_by_reason(plan),
        "response_provenance": fp.response_provenance,
        "samples": store.num_samples(),
        "tokens": tokens,
        "layers": [layer_array(i) for i in fp.layer_ids],
        "raw_bytes": raw,
        "disk_bytes": disk,
        "ratio": round(disk / raw, 4) if raw else None,
        "dtype": fp.dtype,
        "codec": store.codec.to_json(),
        "fingerprint": fp.to_json(),
    }


def quarantined_records(plan) -> list[dict]:
    """Every record the plan left out: its 1-based record number in the corpus, sample id, reason and detail."""
    if plan is None:
        return []
    return [
        {"record": q.record_index + 1, "sample_id": q.sample_id, "reason": q.reason, "detail": q.detail}
        for q in plan.quarantined
    ]


def first_per_reason(records: list[dict], per_reason: int = 2) -> list[dict]:
    """The first `per_reason` of each reason, in corpus order."""
    seen: Counter = Counter()
    first = []
    for record in records:
        seen[record["reason"]] += 1
        if seen[record["reason"]] <= per_reason:
            first.append(record)
    return first


def quarantined_by_reason(plan) -> dict[str, int]:
    """Records the plan left out, counted by reason, most frequent first."""
    counts = Counter(q.reason for q in plan.quarantined) if plan is not None else Counter()
    return dict(counts.most_common())
