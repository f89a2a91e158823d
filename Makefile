# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and pinned: on these CPU machines 2.13.0 is a local CPU wheel; letting pip choose pulls CUDA.
TORCH ?= torch==2.13.0

.PHONY: run test test-fast install install-test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/dsv4batch score dsv4batch/data/sample.parquet out/ --overwrite

test: install
	$(BIN)/python -m pytest -q -x --durations=15

# the unit tier, for the inner loop: no Ray cluster, no CLI in a subprocess (tests/conftest.py
# marks the tests that use either `slow`)
test-fast: install
	$(BIN)/python -m pytest -q -x -m "not slow" --durations=10

clean:
	rm -rf $(VENV) out .pytest_cache
