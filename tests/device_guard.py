"""Run a script as the GPU device would: every installed distribution outside the device
image and the wheels `benchmarks/device_wheels.py` carries (and their own dependencies)
cannot be imported. `python device_guard.py SCRIPT ARGS...`; blocked imports are listed on
stderr as `device_guard: blocked <module> (<distribution>)`."""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import re
import runpy
import sys
from importlib.machinery import PathFinder
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import device_wheels  # noqa: E402

PROJECT = "dflash_cache"  # this project's own packages (extract, train, store_schema), installed editable


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def closure(names) -> set[str]:
    """The distributions `names` and everything they require (extras left out)."""
    seen, todo = set(), [normal(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [device_wheels.name_of(r) for r in requires if "extra ==" not in r]
    return seen


ALLOWED = {PROJECT} | closure(
    [*device_wheels.DEVICE_IMAGE, *map(device_wheels.name_of, device_wheels.carried()), *device_wheels.TRANSITIVE]
)
OWNERS = {module: [normal(d) for d in dists] for module, dists in metadata.packages_distributions().items()}


class Guard(importlib.abc.MetaPathFinder):
    """The path finder, for which a blocked package is not installed: `find_spec` says
    None (as transformers' availability checks expect), an import raises ModuleNotFoundError."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        owners = OWNERS.get(top)
        if owners and not any(owner in ALLOWED for owner in owners):
            if top not in BLOCKED:
                BLOCKED.add(top)
                print(f"device_guard: blocked {top} ({', '.join(owners)})", file=sys.stderr)
            return None
        return PathFinder.find_spec(fullname, path, target)

    def find_distributions(self, *args, **kwargs):  # package metadata stays readable, as on the device
        return PathFinder.find_distributions(*args, **kwargs)


BLOCKED: set[str] = set()

if __name__ == "__main__":
    sys.meta_path[:] = [Guard() if finder is PathFinder else finder for finder in sys.meta_path]
    script, *sys.argv[1:] = sys.argv[1:]
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
