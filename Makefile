# The two commands of the README: `make quickstart` and `make test`. Both set up .venv first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The interpreter the venv is made with: `make PYTHON=python3.11 ...` picks one; by default the
# newest of SUPPORTED_PYTHONS that runs from the PATH, else python3. ve-fairseq 0.12.3, the
# fairseq this installs, has wheels for these versions only.
SUPPORTED_PYTHONS := 3.12 3.11
PYTHON ?= $(firstword $(foreach v,$(SUPPORTED_PYTHONS),$(if $(shell python$(v) -c 'print(1)' 2>/dev/null),python$(v))) python3)
# The scripts read PYTHON as their interpreter: under make they take the venv's, first on PATH.
unexport PYTHON
# The version of the interpreter that will run pip: the venv's once it exists.
VENV_PYTHON = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
VENV_PYTHON_VERSION = $(shell $(VENV_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
# CPU build of PyTorch for CI and laptops; GPU users install their CUDA torch into the venv
# first (or run `make TORCH=torch`): an existing torch is kept.
TORCH ?= torch==2.13.0
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install test test-fast quickstart bench clean

install: $(VENV)/.installed

# The installed torch is pinned through the second step, so that no dependency replaces it.
# fairseq requires torchaudio, whose newest release (2.11.1) does not load against torch 2.13
# (its import raises OSError); transformers imports torchaudio whenever it is installed, so the
# third step removes a torchaudio that does not import. fairseq's translation code imports
# torchaudio only inside its speech tasks and functions, never on import (tests/test_export_hf.py).

$(VENV)/.installed: setup.py
	$(if $(filter $(SUPPORTED_PYTHONS),$(VENV_PYTHON_VERSION)),,$(error $(VENV_PYTHON) is \
	  $(if $(VENV_PYTHON_VERSION),Python $(VENV_PYTHON_VERSION),not an interpreter found on the PATH), \
	  and fairseq (ve-fairseq 0.12.3) installs on Python 3.11 and 3.12 only: install one and \
	  pick it with `make PYTHON=python3.11 $(or $(MAKECMDGOALS),install)`$(if $(wildcard $(PY)), after rm -r $(VENV))))
	@echo "== setting up $(VENV) with $(VENV_PYTHON) (Python $(VENV_PYTHON_VERSION))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]" "$$($(PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')"
	$(PY) -c "import torchaudio" 2>/dev/null || $(PY) -m pip uninstall -q -y torchaudio
	touch $@

# The import contracts (.importlinter, docs/architecture.md) first: they take a second.
# --no-cache: no .import_linter_cache directory in the checkout.
# --durations: the 15 slowest steps close every run, so the time sinks stay in sight.
# JOBS worker processes of one thread each (pytest-xdist): most tests wait on single-threaded
# fairseq processes, so one worker per core keeps both cores busy. --dist loadscope keeps a
# module's tests on one worker, so a module's trained fixtures are built once; the session's
# are built once for all workers (built_once in tests/conftest.py).
DURATIONS ?= --durations=15
JOBS ?= 2
test: install
	$(VENV)/bin/lint-imports --no-cache
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs -n $(JOBS) --dist loadscope $(DURATIONS) tests

# The loop while you work: every test but the slow ones (trainings, end-to-end runs: the tests
# marked slow, and those on a fixture that requests `trains`; tests/conftest.py). CI runs
# `make test`. These tests train nothing, so they are spread test by test (--dist load).
test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist load -m "not slow" $(DURATIONS) tests

quickstart: install
	bash scripts/quickstart.sh

bench: install
	multipath-bench --out results/bench

clean:
	rm -rf $(VENV) work results
