# One entry point. `make demo` and `make test` work on a fresh machine: each
# creates the virtual environment when it is missing or out of date.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export PRX_DATA_ROOT ?= $(CURDIR)/data
# Model hubs are out of reach here; every model is loaded from disk or a package.
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export DAGSTER_DISABLE_TELEMETRY ?= 1
LOCK_HASH := $(shell cat requirements.lock pyproject.toml | sha256sum | cut -c1-12)
STAMP := $(VENV)/.prx-installed-$(LOCK_HASH)
UI_PORT ?= 3000
BROWSER_PORT ?= 8765

.PHONY: venv instance sysdeps demo test test-cluster ui browser pictures lint format bench fuzz lock clean-data

# The editable install points at one checkout; a venv shared by several clones (CI keeps
# one per lock outside the clone) is re-pointed at this one when it differs. It also builds
# the C extension (core/shards/_planes.c) into the checkout: rebuilt when the source changes.
EDITABLE := $(VENV)/.prx-editable-$(shell echo $(CURDIR) | sha256sum | cut -c1-12)
EXTENSIONS := prx_assets/core/shards/_planes.c

venv: $(STAMP) $(EDITABLE)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements.lock -r requirements.lock
	@rm -f $(VENV)/.prx-installed-*
	@touch $@

$(EDITABLE): $(STAMP) $(EXTENSIONS)
	@bash .ci/build-deps
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.prx-editable-*
	@touch $@

## The Dagster instance, created or migrated once under a lock ($(DAGSTER_HOME)/.init.lock)
## before any Dagster process opens it: two first starts at once can break a fresh sqlite
## home. Installs dagster.yaml atomically when the home has none (never replaces one).
instance: venv
	@$(PY) -m prx_assets.instance --config dagster.yaml

## The demo: build the landing zone from the bundled photos, materialise every stage.
demo: venv instance
	$(VENV)/bin/prx-assets demo --data-root $(PRX_DATA_ROOT)

## System packages some tests use (PostgreSQL server, chromium); a no-op when present.
sysdeps:
	@bash .ci/system-deps

## The test suite (what CI runs): on TEST_PROCESSES processes, a test module per process
## at a time (its module fixtures built once). 3 on 2 cores: the tests wait on servers and
## subprocesses often enough that a third process fills the gaps (14 m 22 s against 14-15.5 m).
TEST_PROCESSES ?= 3
test: venv sysdeps instance
	$(VENV)/bin/ruff check prx_assets prx_assets_tests benchmarks
	$(VENV)/bin/ruff format --check prx_assets prx_assets_tests benchmarks
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/dg check defs --use-active-venv
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadscope $(PYTEST_ARGS)

## The multi-node cluster test (head + worker Ray nodes, PostgreSQL, S3; ~4 min): kept out of
## the 15-minute suite, run by CI after it.
test-cluster: venv sysdeps instance
	$(PY) -m pytest -m cluster $(PYTEST_ARGS)

## The Dagster UI on 127.0.0.1 (never on a public interface by default).
ui: venv instance
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/dg dev --use-active-venv --host 127.0.0.1 --port $(UI_PORT)

## The curation browser on 127.0.0.1 (after `make demo`): search, filters, audit trail.
browser: venv
	$(PY) -m prx_assets.browser --data-root $(PRX_DATA_ROOT) --port $(BROWSER_PORT)

## The README's pictures (docs/img/), drawn from a fresh demo run in a temporary data
## root (chromium for the browser screenshot: `make sysdeps`).
pictures: venv instance sysdeps
	@rm -rf $(CURDIR)/.pictures-data
	$(VENV)/bin/prx-assets demo --data-root $(CURDIR)/.pictures-data > /dev/null
	$(PY) -m prx_assets.demo.pictures --data-root $(CURDIR)/.pictures-data --out docs/img --browser
	@rm -rf $(CURDIR)/.pictures-data

lint: venv
	$(VENV)/bin/ruff check prx_assets prx_assets_tests benchmarks

format: venv
	$(VENV)/bin/ruff format prx_assets prx_assets_tests benchmarks
	$(VENV)/bin/ruff check --fix prx_assets prx_assets_tests benchmarks

## All benchmarks, each printing a ratio against a baseline run in the same process.
bench: venv
	$(PY) -m benchmarks.run_all

## The JPEG planes extension fuzzed under AddressSanitizer and UBSan (50,000 cases; the
## tests run 4,000). Needs gcc's libasan (.ci/build-deps installs gcc).
fuzz: venv
	@bash .ci/build-deps
	$(PY) -m benchmarks.fuzz_planes --cases $(or $(FUZZ_CASES),50000)

## Re-resolve the transitive pins (only when a direct pin in pyproject.toml changes).
lock:
	rm -rf /tmp/prx-lock-venv && $(PYTHON) -m venv /tmp/prx-lock-venv
	/tmp/prx-lock-venv/bin/pip install --quiet -e '.[dev]'
	/tmp/prx-lock-venv/bin/pip freeze --exclude-editable | grep -v '^prx' > requirements.lock
	rm -rf /tmp/prx-lock-venv

clean-data:
	rm -rf $(PRX_DATA_ROOT) $(DAGSTER_HOME)
