"""The request's scenario: a slow load, a slow compile, a short run.

``load`` sleeps 2 s (releasing the GIL, as a network read does) and returns a
(64, 64) float32 array; the program is a chain of matmuls whose XLA compile
takes about 1 s here (measured in every sequential round). The twin is the
sequential way: load, then compile, then run, timed apart so that the
benchmark can report ``max(load, compile) + run``, the wall time of a perfect
overlap, and the overlap efficiency ``(sequential - async) / min(load, compile)``.

Every round clears JAX's caches and builds a fresh function, so every way
compiles from scratch.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import async_array as aa

LOAD_S = 2.0
SHAPE = (64, 64)
SPEC = jax.ShapeDtypeStruct(SHAPE, np.float32)
STEPS = 36  # matmul steps of the 1-stage program: 0.8 to 1.5 s of XLA compile here
STAGES = 3  # the pipeline: 3 programs of STEPS // 3 steps each

pytestmark = pytest.mark.timeout(900)


def load() -> np.ndarray:
    time.sleep(LOAD_S)
    return np.full(SHAPE, 0.01, np.float32)


def program(steps: int, reduce: bool):
    """A fresh function (so nothing is cached): ``steps`` matmuls and friends."""

    def f(x):
        for i in range(steps):
            x = jnp.tanh(x @ x.T) * (1 + i / steps) + jnp.roll(x, i % 7, axis=1)
        return x.sum() if reduce else x

    return f


def programs(stages: int) -> list:
    return [program(STEPS // stages, reduce=i == stages - 1) for i in range(stages)]


def sequential(fs: list, times: dict) -> jax.Array:
    """Load, then compile every stage, then run them; each phase timed."""
    t0 = time.perf_counter()
    x = load()
    t1 = time.perf_counter()
    compiled = [jax.jit(f).trace(SPEC).lower().compile() for f in fs]
    t2 = time.perf_counter()
    for c in compiled:
        x = c(x)
    x.block_until_ready()
    t3 = time.perf_counter()
    for name, value in (("load_s", t1 - t0), ("compile_s", t2 - t1), ("run_s", t3 - t2)):
        times.setdefault(name, []).append(value)
    return x


def with_jax_jit(fs: list, times: dict) -> jax.Array:
    """async_wrap + jax.jit: each stage compiles at its call, dispatch waits."""
    x = aa.async_wrap(load, shape=SHAPE, dtype=np.float32)
    for f in fs:
        x = jax.jit(f)(x)
    return x.block_until_ready()


def with_aa_jit(fs: list, times: dict) -> jax.Array:
    """async_wrap + aa.jit: every stage returns at once, all compile meanwhile."""
    x = aa.async_wrap(load, shape=SHAPE, dtype=np.float32)
    for f in fs:
        x = aa.jit(f)(x)
    return x.block_until_ready()


EXPECTED: dict[int, float] = {}  # stages -> the program's value

WAYS = {
    "sequential": sequential,
    "async_wrap + jax.jit": with_jax_jit,
    "async_wrap + aa.jit": with_aa_jit,
}


def run_scenario(benchmark, rounds: int, stages: int, way: str) -> None:
    times: dict[str, list[float]] = {}
    results = []

    def setup():
        jax.clear_caches()
        return (programs(stages), times), {}

    def one_round(fs, times):
        results.append(float(WAYS[way](fs, times)))

    benchmark.pedantic(one_round, setup=setup, rounds=rounds, iterations=1)
    benchmark.extra_info.update(times)
    expected = EXPECTED.setdefault(stages, results[0])  # the sequential way runs first
    np.testing.assert_allclose(results, expected, rtol=1e-5)


@pytest.mark.benchmark(group="scenario: load 2 s + compile 1 s + run")
@pytest.mark.parametrize("way", list(WAYS))
def test_scenario(benchmark, rounds, way):
    run_scenario(benchmark, rounds, 1, way)


@pytest.mark.benchmark(group="scenario: load 2 s + 3-stage pipeline")
@pytest.mark.parametrize("way", list(WAYS))
def test_pipeline(benchmark, rounds, way):
    run_scenario(benchmark, rounds, STAGES, way)


# -- what program order costs ------------------------------------------------------------
# Two calls of one program: the first's input loads for ORDER_LOAD_S, the
# second's is ready. aa.jit launches calls in program order only where order
# matters (a donating program, or one spanning processes); otherwise the
# second runs at once. The figure is the time to the second call's result.
ORDER_LOAD_S = 1.0


def slow_input() -> np.ndarray:
    time.sleep(ORDER_LOAD_S)
    return np.full(SHAPE, 0.5, np.float32)


def _step(x):
    return jnp.tanh(x @ x.T) + 1.0


def second_of_two_aa_jit(donate: bool) -> float:
    f = aa.jit(_step, donate_argnums=0 if donate else ())
    aa.materialize(f(aa.async_wrap(lambda: np.zeros(SHAPE, np.float32), like=SPEC)))  # compiled
    slow = aa.async_wrap(slow_input, like=SPEC)
    ready = aa.async_wrap(lambda: np.ones(SHAPE, np.float32), like=SPEC)
    f(slow)
    return float(f(ready).block_until_ready().sum())


def second_of_two_jax_jit() -> float:
    f = jax.jit(_step)
    f(np.zeros(SHAPE, np.float32)).block_until_ready()  # compiled
    slow = aa.async_wrap(slow_input, like=SPEC)
    ready = aa.async_wrap(lambda: np.ones(SHAPE, np.float32), like=SPEC)
    f(slow)  # its dispatch waits for the input: program order by blocking the caller
    return float(f(ready).block_until_ready().sum())


ORDER_WAYS = {
    "aa.jit, donating (program order)": lambda: second_of_two_aa_jit(True),
    "aa.jit, not donating (no order needed)": lambda: second_of_two_aa_jit(False),
    "jax.jit (the caller waits at each dispatch)": second_of_two_jax_jit,
}


@pytest.mark.benchmark(group="program order: second of two calls, first input loads 1 s")
@pytest.mark.parametrize("way", list(ORDER_WAYS))
def test_program_order(benchmark, rounds, way):
    results = []
    benchmark.pedantic(lambda: results.append(ORDER_WAYS[way]()), rounds=rounds, iterations=1)
    want = float((np.tanh(np.ones(SHAPE, np.float32) @ np.ones(SHAPE, np.float32).T) + 1).sum())
    np.testing.assert_allclose(results, want, rtol=1e-5)
