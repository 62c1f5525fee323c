# Every target sets up .venv itself, so each works on a fresh clone.
PYTHON ?= python3
# Packages are installed without byte-compiling every file (uv's default, pip --no-compile: torch alone is most of a
# minute on two cores); Python writes the bytecode of the modules actually imported on first use, which needs this unset.
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench venv lint docs warm clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Stamp files re-run the install only when pyproject.toml changes. uv unpacks the wheels (torch's alone are gigabytes)
# on every core where pip uses one (25 s instead of 55 s on two cores), from the sources and within the constraints
# pip is configured with (.ci/uv_args.py); pip stays the fallback where uv cannot be had.
TEST_EXTRAS := all,test,dev,docs
BENCH_EXTRAS := all,bench
INSTALL = $(BIN)/python -m pip install -q uv && args="$$($(BIN)/python .ci/uv_args.py)" \
	&& $(BIN)/uv pip install -q --python $(BIN)/python $$args -e '.[$(1)]' \
	|| $(BIN)/python -m pip install -q --no-compile -e '.[$(1)]'

$(VENV)/.installed-all: pyproject.toml | $(BIN)/python
	$(call INSTALL,all)
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(call INSTALL,$(TEST_EXTRAS))
	touch $@ $(VENV)/.installed-all $(VENV)/.installed-docs

demo: $(VENV)/.installed-all
	$(BIN)/lightning-sdp demo

# The suite runs the linters first, so CI (`.ci/run` = `make test`) keeps the tree lint-clean. `warm` (bytecode of the
# heavy imports, numba's kernel cache: the longest of the three) starts first; the linters, then the site build, use
# the other core meanwhile.
# Two workers on the two cores; each test file stays on one worker (module fixtures such as the docs' fork server).
XDIST ?= -n 2 --dist loadfile

test: $(VENV)/.installed-test
	$(MAKE) --no-print-directory -j2 --output-sync=target warm lint docs
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# Imports the heavy libraries once (so their bytecode is written) and compiles HEAT's numba kernels into their cache.
warm: $(VENV)/.installed-test
	$(BIN)/python tests/warm_up.py

# The edit loop: lint, then the suite without the slow, benchmark and GPU tests.
test-fast: lint
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow and not bench and not gpu and not cuda" $(PYTEST_ARGS)

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(call INSTALL,$(BENCH_EXTRAS))
	touch $@

# The smoke run of every benchmark this machine can run (the rest are listed as skipped, with what they need).
bench: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks --all --quick

$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(call INSTALL,docs)
	touch $@

# The site (guides + API reference from the docstrings) into site/; --strict fails on a broken link or API entry.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

lint: $(VENV)/.installed-test
	$(BIN)/ruff check lightning_sdp tests benchmarks examples docs/hooks .ci
	$(BIN)/ruff format --check lightning_sdp tests benchmarks examples README.md docs .ci
	$(BIN)/mypy

clean:
	rm -rf $(VENV) demo_report .pytest_cache site
