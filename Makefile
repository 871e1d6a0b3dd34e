# trainguard — developer entry points. `make test` and `make demo` work on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEB_PACKAGES := prometheus systemd

.PHONY: test demo venv deps lint typecheck unit integration e2e bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the local CPU build of torch first, so the `trainer` extra is already satisfied
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	touch $(STAMP)

deps:
	@if [ "$$(id -u)" = "0" ]; then \
	  missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  fi; \
	else echo "not root: skipping Debian packages ($(DEB_PACKAGES))"; fi

lint: venv
	$(BIN)/ruff check agent controller tests bench examples
	$(BIN)/ruff format --check agent controller tests bench examples

typecheck: venv
	$(BIN)/mypy

test: venv deps lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

demo: venv
	$(BIN)/python examples/demo.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache demo-run demo-report.json demo-loss.png
