# Two commands for a fresh machine:  `make demo` (train on embedded defaults)  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo check test test-fast lint format bench clean

# Third-party stream libraries (training/datapipe/stream_adapters/), without their own pins (they would pull
# another torch); the few packages they import are the `streams` extra.
STREAM_LIBS := litdata==0.2.76 mosaicml-streaming==0.13.0

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev,hf,streams]'
	$(BIN)/python -m pip install -q --no-deps -c requirements.lock $(STREAM_LIBS)
	touch $@

install: $(VENV)/.installed

## Prepare the corpus and train the example run through the Prefect flow (ephemeral API, SQLite MLflow).
demo: install
	$(BIN)/convoy prepare
	$(BIN)/convoy train

## Lint and format check (run by `make test` before the tests, so CI enforces both).
check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## The whole test suite (what CI runs): the checks, then every test, one test module per worker
## process (TEST_WORKERS of them): most end-to-end time is waiting on subprocesses and servers.
TEST_WORKERS ?= 2
test: check
	$(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile

## The quick tests only (no end-to-end runs marked slow): a few minutes.
test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not slow" -n $(TEST_WORKERS) --dist loadfile

lint: check

## Apply the formatter and the safe lint fixes.
format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python bench/checkpoint.py

clean:
	rm -rf runs data mlflow.db mlruns metrics models plots
