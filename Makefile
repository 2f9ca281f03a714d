# The two commands of the README: `make up` (local control plane with simulated GPU nodes) and
# `make test` (linters, type checker and the whole test suite). Both install what is missing first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up down status build test lint

$(STAMP): pyproject.toml
	@echo "[megafleet] installing the project and its dependencies into $(VENV) (torch is ~3 GB on a cold pip cache)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar off -e '.[engine,dev]'
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

test: build lint
	$(BIN)/pytest
