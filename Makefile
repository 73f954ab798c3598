# `make test` sets itself up on a fresh machine: a venv, the project with its test
# extra, torch from pyproject.toml's range (up to 2.13, the newest release the suite
# has run on), and the reference `dflash` package the tests compare against.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch>=2.4,<2.14

.PHONY: venv test test-fast demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# z-lab's reference DFlash code, the tests' oracle. Without its dependencies: its
	# wheel pins tqdm/datasets/requests exactly and would downgrade this project's;
	# the model code needs only torch + transformers (runs beside transformers 5.24).
	$(PY) -m pip install -q --no-deps "dflash==0.1.0"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

# For iteration: no Ray, no child processes, no pretraining (tests/conftest.py says what is slow).
test-fast: venv
	$(PY) -m pytest -q -m "not slow" tests

demo: venv
	$(PY) scripts/demo.py

bench: venv
	$(PY) benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
