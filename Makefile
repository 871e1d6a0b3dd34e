# trainguard — developer entry points. `make test` and `make demo` work on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SRC := agent controller contract trainer devkit rules tests bench examples
# strict editable install: a link per file, so a new module needs a reinstall
PKG_FILES := $(shell find agent controller contract trainer devkit rules -name "*.py" -o -name "*.yaml" -o -name py.typed 2>/dev/null)
DEB_PACKAGES := prometheus prometheus-alertmanager systemd slurmctld slurmd slurm-client munge postgresql-15

.PHONY: test demo demo-slurm venv deps lint typecheck unit integration e2e bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(PKG_FILES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the local CPU build of torch first, so the `trainer` extra is already satisfied
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all,dev]' --config-settings editable_mode=strict
	touch $(STAMP)

deps:
	@if [ "$$(id -u)" = "0" ]; then \
	  missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  fi; \
	else echo "not root: skipping Debian packages ($(DEB_PACKAGES))"; fi

lint: venv
	$(BIN)/ruff check $(SRC)
	$(BIN)/ruff format --check $(SRC)

typecheck: venv
	$(BIN)/mypy

# unit, red-team and integration tests in TEST_WORKERS processes (a module's tests stay on one,
# with its shared server); then the end-to-end scenarios, E2E_WORKERS modules at a time (each
# module on its own ports and dirs; a module mostly waits, ~0.4 of a core; their jobs' steps
# are padded so a remediation beside another module's still finds steps left to train).
# E2E_WORKERS=1 runs them one at a time.
TEST_WORKERS ?= 2
E2E_WORKERS ?= 2
E2E_DIST := $(if $(filter 1,$(E2E_WORKERS)),,-n $(E2E_WORKERS) --dist loadfile)

test: venv deps lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests/unit tests/redteam tests/integration
	$(BIN)/python -m pytest -q -p no:cacheprovider $(E2E_DIST) tests/e2e

demo: venv
	$(BIN)/python examples/demo.py

# the same scenario under real Slurm on this machine (root; installs the Slurm packages)
demo-slurm: venv
	$(BIN)/python examples/demo_slurm.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache demo-run demo-report.json demo-loss.png demo-slurm-run demo-slurm-report.json
