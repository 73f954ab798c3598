"""`python -m store_schema lossy STORE`: what fp8, fp4 and a projection would do to a
bf16 store's own states (`store_schema.tools.lossy_check`)."""

from __future__ import annotations

import json

from ..errors import StoreError
from ..runtime.cli import EXIT_OK
from ..stores import open_store
from ..tools.lossy_check import check_store, lines, report


def run(args) -> int:
    store = open_store(args.store)
    if store.dtype.scaled:
        raise StoreError(
            f"{args.store}: a {store.dtype.name} store holds its states already rounded; the check needs the "
            "exact ones: run it on a bf16 store (e.g. `extract run --limit 200` of your own target)"
        )
    checks = check_store(store, args.tokens)
    if args.json:
        print(json.dumps(report(checks)))
    else:
        for line in lines(checks):
            print(line)
    return EXIT_OK
