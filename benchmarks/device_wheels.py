"""What `benchmarks/gpu_check.sh` carries to the device, from one source: pyproject.toml's
dependencies (and its `gpu` extra), less what the device image brings and what the
device does not use.

    python benchmarks/device_wheels.py              # the requirement list, one per line
    python benchmarks/device_wheels.py --download .whl   # their wheels, for the device's Python

The device image has torch (with triton) and transformers with their own dependencies;
Ray is not there (gpu_check runs the extraction worker in-process), nor the commands'
dataset, plotting, HTTP and object-storage packages. tests/extract/test_gpu_check.py runs
`gpu_check.py --smoke` with every other package blocked, so a new import the device
lacks fails in CI, not on the device."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICE_IMAGE = ("torch", "transformers", "safetensors", "ml_dtypes", "tokenizers", "numpy", "pyyaml", "tqdm", "jinja2")
NOT_ON_DEVICE = {
    "ray": "gpu_check runs the extraction worker in-process",
    "datasets": "corpora from the datasets format are read by `extract` on the host",
    "pyarrow": "Parquet corpora and generated corpora are read on the host",
    "matplotlib": "diagnose plots are drawn on the host",
    "aiohttp": "generate --engine openai's client runs on the host",
    "obstore": "stores on object storage are not used by gpu_check",
}
NO_WHEEL = {"causal_conv1d": "no binary wheel on PyPI: transformers' PyTorch fallback runs, and the JSON says so"}
# Their own dependencies the image lacks: downloaded with --no-deps, so pip never resolves
# torch again (flash-linear-attention requires it: a CUDA build of several GB).
TRANSITIVE = ("donfig", "typing_extensions", "packaging", "fla-core", "einops")
PLATFORM = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"]
PLATFORM += ["--platform", "manylinux2014_x86_64"]


def name_of(requirement: str) -> str:
    """The distribution name of a requirement string, normalised ("ray[default]>=2" -> "ray")."""
    return re.split(r"[\[<>=!~; ]", requirement.strip(), maxsplit=1)[0].lower().replace("-", "_")


def declared() -> list[str]:
    """pyproject.toml's dependencies and its `gpu` extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"]["gpu"])


def carried() -> list[str]:
    """The requirements whose wheels travel to the device."""
    skip = {name_of(n) for n in (*DEVICE_IMAGE, *NOT_ON_DEVICE, *NO_WHEEL)}
    return [r for r in declared() if name_of(r) not in skip]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--download", metavar="DIR", help="download the wheels (and theirs) into DIR")
    parser.add_argument("--python-version", default="3.12", help="the device's Python (default 3.12)")
    args = parser.parse_args()
    requirements = [*carried(), *TRANSITIVE]
    if not args.download:
        print("\n".join(requirements))
        return 0
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", args.python_version, "--implementation", "cp", *PLATFORM]
    return subprocess.call([*command, "-d", args.download, *requirements])


if __name__ == "__main__":
    sys.exit(main())
