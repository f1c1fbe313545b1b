"""Per-leaf cost: one leaf; N leaves from one function; N leaves one task each;
at N = 1k, 10k and 100k (and 1M without ``--quick``: one timed round after an
untimed one; 3 to 7 GiB of RAM a way, and this process keeps about 14 GiB after
the five 1M-leaf timings).

Each group: the ``async_array`` way and what a user would write without it,
on the same ready numpy arrays, every way ending in ready ``jax.Array``s.
Time per leaf comes from pytest-benchmark in this process; resident memory per
leaf from a fresh interpreter per way and N (this file as a script): the RSS
growth while the N ready ``jax.Array``s are held, and the peak's growth.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from encoder import peak_rss  # benches/: the encoder benchmark's own

import async_array as aa

COUNTS = {"1k": 1_000, "10k": 10_000, "100k": 100_000, "1M": 1_000_000}
QUICK = ("1k", "10k", "100k")  # --quick (make bench) leaves out 1M
SPEC = jax.ShapeDtypeStruct((16,), np.float32)
TPE = "ThreadPoolExecutor + device_put"

pytestmark = pytest.mark.timeout(1800)


@functools.cache
def data(n: int) -> list[np.ndarray]:
    return [np.full(16, i, np.float32) for i in range(n)]


ONE = np.full(16, 0, np.float32)


@pytest.fixture(scope="module")
def executor():
    # The twin's pool, made once and the same size as async_array's default.
    with concurrent.futures.ThreadPoolExecutor(max_workers=aa.max_workers()) as ex:
        yield ex


def count(request: pytest.FixtureRequest, label: str) -> int:
    if label not in QUICK and request.config.getoption("--quick"):
        pytest.skip(f"{label} leaves: only without --quick")
    return COUNTS[label]


def rounds_for(n: int, rounds: int) -> int:
    if n >= 1_000_000:
        return 1  # minutes a round for the twins
    # A 1k-leaf round takes ~10 ms, where one thread switch or collection
    # moves a median of a few rounds by half: more rounds for small N.
    return max(rounds, 100_000 // n)


def warmup_rounds_for(n: int) -> int:
    """Untimed rounds before the timed ones, for every way alike. At 1M leaves
    the first round grows the heap by ~3 GiB, and on a VM whose balloon took
    that memory back each new page costs ~10 us to touch (perf: clear_page_erms
    under do_anonymous_page): +7-8 us a leaf for JAX's ways and ours alike, paid
    by whichever way runs first in this process. Smaller N: pool threads,
    caches and allocator arenas."""
    return 1 if n >= 1_000_000 else max(1, rounds_for(n, 1) // 10)


def load_one():
    return ONE


@pytest.mark.benchmark(group="single leaf (16,) float32")
@pytest.mark.parametrize("way", ["async_array", TPE])
def test_single_leaf(benchmark, executor, way):
    if way == "async_array":
        run = lambda: aa.async_wrap(load_one, shape=(16,), dtype=np.float32).result()  # noqa: E731
    else:
        run = lambda: jax.device_put(executor.submit(load_one).result())  # noqa: E731
    out = benchmark(lambda: run().block_until_ready())
    np.testing.assert_array_equal(out, ONE)


# -- the ways, for N leaves --------------------------------------------------------


def tree_async_wrap(arrays, executor=None):
    like = [SPEC] * len(arrays)
    return aa.materialize(aa.async_wrap(lambda: arrays, like=like))


def tree_device_put(arrays, executor=None):
    return jax.device_put(arrays)


def tree_from_callback(arrays, executor=None):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return [jax.make_array_from_callback((16,), sharding, lambda _, a=a: a) for a in arrays]


def map_async_map(arrays, executor=None):
    return aa.materialize(
        aa.async_map(lambda path, spec: arrays[path[0].idx], [SPEC] * len(arrays))
    )


def map_executor(arrays, executor):
    futures = [executor.submit(lambda i: jax.device_put(arrays[i]), i) for i in range(len(arrays))]
    return [f.result() for f in futures]


TREE_WAYS = {
    "async_array": tree_async_wrap,
    "jax.device_put(list)": tree_device_put,
    "make_array_from_callback": tree_from_callback,
}
MAP_WAYS = {"async_array": map_async_map, TPE: map_executor}
# For the memory runs: one name each.
ALL_WAYS = {
    "async_wrap": tree_async_wrap,
    "jax.device_put(list)": tree_device_put,
    "make_array_from_callback": tree_from_callback,
    "async_map": map_async_map,
    TPE: map_executor,
}


def run_ways(benchmark, executor, rounds, n, fn):
    arrays = data(n)
    out = benchmark.pedantic(
        lambda: jax.block_until_ready(fn(arrays, executor)),
        rounds=rounds_for(n, rounds),
        warmup_rounds=warmup_rounds_for(n),
        iterations=1,
    )
    assert len(out) == n
    np.testing.assert_array_equal(out[-1], arrays[-1])
    benchmark.extra_info["leaves"] = n


# -- resident memory per leaf, a fresh process each ----------------------------------
# Before the timing tests, so that this process holds little while the 1M-leaf
# processes run: after the five 1M-leaf timings it keeps about 14 GiB resident.


def rss_per_leaf(way: str, n: int) -> dict[str, float]:
    """In this (fresh) process: warm ``way`` up on 100 leaves, then make n
    ready leaves from ready numpy arrays and hold them; bytes per leaf of the
    RSS growth and of the peak's growth, and the seconds it took."""
    import gc
    import time

    import psutil

    arrays = data(n)
    fn = ALL_WAYS[way]
    with concurrent.futures.ThreadPoolExecutor(max_workers=aa.max_workers()) as ex:
        jax.block_until_ready(fn(arrays[:100], ex))  # threads, JAX's backend, caches
        gc.collect()
        before = psutil.Process().memory_info().rss
        t0 = time.perf_counter()
        held = jax.block_until_ready(fn(arrays, ex))
        seconds = time.perf_counter() - t0
        gc.collect()
        after = psutil.Process().memory_info().rss
        peak = peak_rss()
        assert len(held) == n
        del held
        gc.collect()
        released = psutil.Process().memory_info().rss
    return {
        "rss_per_leaf": (after - before) / n,
        "peak_per_leaf": (peak - before) / n,
        # What stays resident once the leaves are dropped: the allocator's
        # high-water mark, or a leak (read it beside JAX's own ways).
        "kept_per_leaf": (released - before) / n,
        "seconds": seconds,
    }


@pytest.mark.parametrize("label", list(COUNTS))
@pytest.mark.parametrize("way", list(ALL_WAYS))
def test_rss_per_leaf(benchmark, request, label, way):
    n = count(request, label)
    benchmark.group = f"RSS per ready leaf, {label} leaves"
    runs: list[dict[str, float]] = []

    def one_round():
        cmd = [sys.executable, __file__, way, str(n)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
        runs.append(json.loads(out.stdout.splitlines()[-1]))

    benchmark.pedantic(one_round, rounds=1, iterations=1)
    for key in ("rss_per_leaf", "peak_per_leaf", "kept_per_leaf", "seconds"):
        benchmark.extra_info[key] = [r[key] for r in runs]
    benchmark.extra_info["leaves"] = n
    benchmark.extra_info["way"] = way


@pytest.mark.parametrize("label", list(COUNTS))
@pytest.mark.parametrize("way", list(TREE_WAYS))
def test_tree(benchmark, executor, rounds, request, label, way):
    benchmark.group = f"{label} leaves, one function"
    run_ways(benchmark, executor, rounds, count(request, label), TREE_WAYS[way])


@pytest.mark.parametrize("label", list(COUNTS))
@pytest.mark.parametrize("way", list(MAP_WAYS))
def test_map(benchmark, executor, rounds, request, label, way):
    benchmark.group = f"{label} leaves, one task each"
    run_ways(benchmark, executor, rounds, count(request, label), MAP_WAYS[way])


if __name__ == "__main__":
    print(json.dumps(rss_per_leaf(sys.argv[1], int(sys.argv[2]))))
