# Two commands for a fresh machine:  `make demo` (train on embedded defaults)  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev]'
	touch $@

install: $(VENV)/.installed

## Prepare the corpus and train the example run through the Prefect flow (ephemeral API, SQLite MLflow).
demo: install
	$(BIN)/convoy prepare
	$(BIN)/convoy train

## The whole test suite (what CI runs).
test: install
	$(BIN)/python -m pytest -q -ra --durations=15

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python bench/checkpoint.py

clean:
	rm -rf runs data mlflow.db mlruns metrics models plots
