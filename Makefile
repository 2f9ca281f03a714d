# The two commands of the README: `make up` (local control plane with simulated GPU nodes) and
# `make test` (linters, type checker and the whole test suite but the GitOps tier, `make gitops`:
# what CI runs). `make check` is the fast tier for the edit loop: linters, types (tests included)
# and the unit, engine, refit and SDK tests that need no control plane and start no engine, process
# group or subprocess (marker `slow`).
# Every target installs what is missing first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up up-prerequisites go-lane down status build test lint check chaos soak gitops

$(STAMP): pyproject.toml
	@echo "[megafleet] installing the project and its dependencies into $(VENV) (torch is ~3 GB on a cold pip cache)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar off -e '.[engine,dev,ray]'
	touch $@

build: $(STAMP)
	$(BIN)/megafleet dev build

# A first `make up` installs the Python environment and compiles the control plane at the same time
# (two jobs: pip's download and install, and the Go lane, `megafleet_dev.go_lane`, which needs only
# the machine's python3); each prints what it is doing, and `dev up` starts once both are done.
up: up-prerequisites
	$(BIN)/megafleet dev up

up-prerequisites:
	@$(MAKE) --no-print-directory -j2 $(STAMP) go-lane

go-lane:
	@PYTHONPATH=dev $(PYTHON) -m megafleet_dev.go_lane

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
	$(BIN)/pytest -q -m "not e2e and not slow" tests/unit tests/engine tests/refit tests/sdk

# Everything the tiers use is built first, with its progress shown and outside pytest's per-test
# timeouts (a cold KEDA build alone takes longer than the autoscale tier's): the control plane, the
# real node's programs and images, Prometheus and KEDA, Kueue, in one command so that the image builds
# (downloads, layer writes) run beside the CPU-bound Go builds. Cached: seconds when nothing changed.
test: lint
	$(BIN)/megafleet dev build --real-node --autoscale --kueue
	$(BIN)/pytest -m "not gitops"

# The GitOps tier: Flux's source-controller and kustomize-controller (built first, cached) sync a
# fleet from a git repository served over loopback (docs/gitops.md). Kept out of `make test`: its two
# cold builds would take CI past its budget (docs/development.md, "Measured start-up"). The build step
# builds the control plane and Flux only (progress lines per component), nothing of the other tiers.
gitops: $(STAMP)
	$(BIN)/megafleet dev build --gitops
	$(BIN)/pytest -m gitops tests/e2e/test_gitops.py

# The chaos drills at full strength: CHAOS_KILLS SIGKILLs of the operator at seeded random
# points (CHAOS_SEED) and CHAOS_CP_FAULTS restarts of the API server and etcd; the node-loss, agent-cut
# drills and a short soak run as they do in `make test` (which runs 5 kills and 4 restarts).
CHAOS_KILLS ?= 20
CHAOS_CP_FAULTS ?= 12
CHAOS_SEED ?= 16
chaos: build
	MEGAFLEET_CHAOS_KILLS=$(CHAOS_KILLS) MEGAFLEET_CHAOS_CP_FAULTS=$(CHAOS_CP_FAULTS) MEGAFLEET_CHAOS_SEED=$(CHAOS_SEED) \
		$(BIN)/pytest -m chaos -s tests/chaos

# The soak: SOAK_MINUTES of client load, a Refit every 10 s and a scale change
# every 2 minutes on a 3-shard fleet; its figures go to bench/results/ (`make test` runs 1 minute).
SOAK_MINUTES ?= 30
soak: build
	MEGAFLEET_SOAK_MINUTES=$(SOAK_MINUTES) MEGAFLEET_SOAK_RESULTS=bench/results/soak-cpu$$(nproc)-$$(date -u +%F).json \
		$(BIN)/pytest -s tests/chaos/test_soak.py -k soak_refits
