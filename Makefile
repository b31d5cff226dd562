# Quick start: `make demo` and `make test`. Both set up .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The torch pin lives in pyproject.toml only; it must be installed before anything that
# depends on torch, or pip resolves a multi-GB CUDA build.
TORCH_PIN := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test test-slow test-all bench gpu-check gpu-evidence clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/allocator_models/*.cpp csrc/allocator_models/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check setuptools wheel "pybind11>=2.12"
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[dev]"
	touch $(STAMP)

demo: setup
	bash examples/cpu_quickstart.sh

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

test-all: setup
	$(PY) -m pytest -q -m "slow or not slow"

# GPU tests + a 10-iteration training per mechanism vs the estimator (docs/gpu_check.md).
# Without a GPU: one line, exit status 2.
gpu-check: setup
	@$(PY) tools/gpu_check.py

# Kernel tables, tile-composition gradients and long-sequence trainings measured on one GPU,
# written as they go to bench/results/gpu_evidence_<gpu>.{jsonl,json,md} (bench/gpu_evidence.py).
gpu-evidence: setup
	@$(PY) bench/gpu_evidence.py

clean:
	rm -rf build *.egg-info memo_ext/_C*.so runs data_cache
