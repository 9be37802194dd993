# The two commands of the README: `make quickstart` and `make test`. Both set up .venv first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of PyTorch for CI and laptops; GPU users install their CUDA torch into the venv
# first (or run `make TORCH=torch`): an existing torch is kept.
TORCH ?= torch==2.13.0
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install test test-fast quickstart bench clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	@echo "== setting up $(VENV)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The import contracts (.importlinter, docs/architecture.md) first: they take a second.
# --no-cache: no .import_linter_cache directory in the checkout.
# --durations: the 15 slowest steps close every run, so the time sinks stay in sight.
DURATIONS ?= --durations=15
test: install
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -rs $(DURATIONS) tests

# The loop while you work: every test but the slow ones (trainings, end-to-end runs: the tests
# marked slow, and those on a fixture that requests `trains`; tests/conftest.py). CI runs
# `make test`. Two worker processes of one thread each (pytest-xdist), one per core: these tests
# train nothing, so no expensive fixture is built twice.
test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist load -m "not slow" $(DURATIONS) tests

quickstart: install
	bash scripts/quickstart.sh

bench: install
	multipath-bench --out results/bench

clean:
	rm -rf $(VENV) work results
