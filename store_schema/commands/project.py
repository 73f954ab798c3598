"""`python -m store_schema project SRC --out DST`: `store_schema.tools.transcode`."""

from __future__ import annotations

import json
import sys

from ..runtime.cli import EXIT_OK
from ..tools.transcode import project_store


def run(args) -> int:
    summary = project_store(
        args.store,
        args.out,
        energy=args.energy,
        rank=args.rank,
        dtype=args.store_dtype,
        fit_tokens=args.fit_tokens,
        log=lambda line: print(line, file=sys.stderr),
    )
    print(json.dumps(summary) if args.json else f"projected store: {args.out} ({summary['shards']} shards)")
    return EXIT_OK
