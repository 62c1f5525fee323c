# Every target sets up .venv itself, so each works on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench venv lint docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Stamp files re-run the install only when pyproject.toml changes.
$(VENV)/.installed-all: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[all]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[all,test,dev,docs]'
	touch $@ $(VENV)/.installed-all $(VENV)/.installed-docs

demo: $(VENV)/.installed-all
	$(BIN)/lightning-sdp demo

# The suite runs the linters first (a few seconds), so CI (`.ci/run` = `make test`) keeps the tree lint-clean.
# Two workers on the two cores; each test file stays on one worker (module fixtures such as the docs' fork server).
XDIST ?= -n 2 --dist loadfile

test: lint docs
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The edit loop: lint, then the suite without the slow, benchmark and GPU tests.
test-fast: lint
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow and not bench and not gpu and not cuda" $(PYTEST_ARGS)

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[all,bench]'
	touch $@

bench: $(VENV)/.installed-bench
	@set -e; for script in benchmarks/*.py; do \
	  name=$$(basename $$script .py); case $$name in _*|__init__) continue;; esac; \
	  echo "== $$name"; $(BIN)/python -m benchmarks.$$name; done

$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

# The site (guides + API reference from the docstrings) into site/; --strict fails on a broken link or API entry.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

lint: $(VENV)/.installed-test
	$(BIN)/ruff check lightning_sdp tests benchmarks examples docs/hooks
	$(BIN)/ruff format --check lightning_sdp tests benchmarks examples README.md docs
	$(BIN)/mypy

clean:
	rm -rf $(VENV) demo_report .pytest_cache site
