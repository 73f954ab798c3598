# `make test` sets itself up on a fresh machine: a venv, the project with its test
# extra, and torch from a range that the local CPU build (2.13) satisfies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch>=2.4,<2.14

.PHONY: venv test demo bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(PY) scripts/demo.py

bench: venv
	$(PY) benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
