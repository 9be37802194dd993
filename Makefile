# The two commands of the README: `make quickstart` and `make test`. Both set up .venv first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The interpreter the venv is made with: `make PYTHON=python3.11 ...` picks one; by default the
# newest of SUPPORTED_PYTHONS that runs from the PATH, else python3.
SUPPORTED_PYTHONS := 3.13 3.12 3.11
PYTHON ?= $(firstword $(foreach v,$(SUPPORTED_PYTHONS),$(if $(shell python$(v) -c 'print(1)' 2>/dev/null),python$(v))) python3)
# The scripts read PYTHON as their interpreter: under make they take the venv's, first on PATH.
unexport PYTHON
# The version of the interpreter that will run pip: the venv's once it exists.
VENV_PYTHON = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
VENV_PYTHON_VERSION = $(shell $(VENV_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
# PyTorch, installed only into a venv without one: a torch already in the venv is kept (GPU users
# install their CUDA build first). On Linux, PyPI's torch is the CUDA build; the CPU build comes
# from PyTorch's own index: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
# fairseq 0.12 from its source distribution, compiled against the venv's torch (README, "Which
# fairseq"); pip keeps the built wheel in its cache, so a second venv installs it at once.
FAIRSEQ := fairseq-fixed==0.12.3.1
export PATH := $(abspath $(VENV))/bin:$(PATH)

comma := ,
# The extra the venv installs: test (make's venv), onnx (make test-onnx's).
EXTRA ?= test

.PHONY: install test test-fast test-onnx lint quickstart bench clean

install: $(VENV)/.installed

# The installed torch is pinned through every later step, so that no dependency replaces it.
# fairseq requires torchaudio, whose newest release (2.11.1) does not load against torch 2.13
# (its import raises OSError); transformers imports torchaudio whenever it is installed, so the
# last step removes a torchaudio that does not import. fairseq's translation code imports
# torchaudio only inside its speech tasks and functions, never on import (tests/test_export_hf.py).
INSTALLED_TORCH = "$$($(PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')"

$(VENV)/.installed: pyproject.toml
	$(if $(filter $(SUPPORTED_PYTHONS),$(VENV_PYTHON_VERSION)),,$(error $(VENV_PYTHON) is \
	  $(if $(VENV_PYTHON_VERSION),Python $(VENV_PYTHON_VERSION),not an interpreter found on the PATH), \
	  and multipath_nmt supports Python $(subst $() ,$(comma) ,$(sort $(SUPPORTED_PYTHONS))) only: \
	  install one (e.g. `uv python install 3.13` or `pyenv install 3.13`) and pick it with \
	  `make PYTHON=python3.13 $(or $(MAKECMDGOALS),install)`$(if $(wildcard $(PY)), after rm -r $(VENV))))
	@echo "== setting up $(VENV) with $(VENV_PYTHON) (Python $(VENV_PYTHON_VERSION))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q setuptools wheel cython "numpy>=1.24" $(INSTALLED_TORCH)
	$(PY) -m pip install -q --no-build-isolation "$(FAIRSEQ)" $(INSTALLED_TORCH)
	$(PY) -m pip install -q -e ".[$(EXTRA)]" $(INSTALLED_TORCH)
	$(PY) -c "import torchaudio" 2>/dev/null || $(PY) -m pip uninstall -q -y torchaudio
	touch $@

# The import contracts (.importlinter, docs/architecture.md) first: they take a second.
# --no-cache: no .import_linter_cache directory in the checkout.
# --durations: the 15 slowest steps close every run, so the time sinks stay in sight.
# JOBS worker processes of one thread each (pytest-xdist), one per core: the tests train and
# decode in their own process (tests/helpers/in_process.py). --dist loadscope keeps a
# module's tests on one worker, so a module's trained fixtures are built once; the session's
# are built once for all workers (built_once in tests/conftest.py).
DURATIONS ?= --durations=15
JOBS ?= 2
lint: install
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check --no-cache .

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs -n $(JOBS) --dist loadscope $(DURATIONS) tests

# The loop while you work: every test but the slow ones (trainings, end-to-end runs: the tests
# marked slow, and those on a fixture that requests `trains`; tests/conftest.py). CI runs
# `make test`. These tests train nothing, so they are spread test by test (--dist load).
test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist load -m "not slow" $(DURATIONS) tests

# ONNX Runtime through optimum needs transformers 4.57 (pyproject.toml's onnx extra), which the
# test extra's transformers 5 excludes: a venv of its own for the one ONNX test.
test-onnx:
	$(MAKE) install VENV=.venv-onnx EXTRA=onnx
	OMP_NUM_THREADS=1 .venv-onnx/bin/python -m pytest -q -p no:xdist tests/test_export_hf.py -k onnx

quickstart: install
	bash scripts/quickstart.sh

bench: install
	multipath-bench --out results/bench

clean:
	rm -rf $(VENV) .venv-onnx .venv313 work results

# `make gpu-carry`: .gpu-carry/, what a bare GPU machine (a CUDA torch, no network, no fairseq)
# needs to install fairseq and the GPU tools' dependencies offline, for the device tool's carry
# (scripts/gpu-carry.sh, scripts/gpu-carry-install.sh, docs/gpu.md). It needs an index here.
# A fairseq wheel missing from pip's cache is built with GPU_CARRY_BUILD_PYTHON_3_12 / _3_13.
# It runs pip of the venv's Python (or PYTHON's), and leaves the venv as it is.
.PHONY: gpu-carry
gpu-carry:
	PYTHON=$(VENV_PYTHON) bash scripts/gpu-carry.sh --out .gpu-carry
