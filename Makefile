# The two commands of the README: `make up` (local control plane with simulated GPU nodes) and
# `make test` (linters, type checker and the whole test suite, what CI runs). `make check` is the
# fast tier for the edit loop: linters, types (tests included) and the tests that need no control
# plane and start no engine process. Every target installs what is missing first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up down status build test lint check chaos

$(STAMP): pyproject.toml
	@echo "[megafleet] installing the project and its dependencies into $(VENV) (torch is ~3 GB on a cold pip cache)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar off -e '.[engine,dev,ray]'
	touch $@

build: $(STAMP)
	$(BIN)/megafleet dev build

up: build
	$(BIN)/megafleet dev up

down: $(STAMP)
	$(BIN)/megafleet dev down

status: $(STAMP)
	$(BIN)/megafleet dev status

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

check: lint
	$(BIN)/pytest -q -m "not e2e and not slow" tests/unit tests/engine

test: build lint
	$(BIN)/pytest

# The operator chaos drill at full strength (issue 16): CHAOS_KILLS SIGKILLs of the operator at
# seeded random points (CHAOS_SEED); `make test` runs the same drill with 5.
CHAOS_KILLS ?= 20
CHAOS_SEED ?= 16
chaos: build
	MEGAFLEET_CHAOS_KILLS=$(CHAOS_KILLS) MEGAFLEET_CHAOS_SEED=$(CHAOS_SEED) $(BIN)/pytest -m chaos -s tests/chaos
