"""Per-leaf cost: one leaf, 100k leaves from one function, 100k leaves one task each.

Each group: the ``async_array`` way and what a user would write without it,
on the same ready numpy arrays, every way ending in ready ``jax.Array``s.
"""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np
import pytest

import async_array as aa

N = 100_000
SPEC = jax.ShapeDtypeStruct((16,), np.float32)
LIKE = [SPEC] * N
DATA = [np.full(16, i, np.float32) for i in range(N)]
ONE = DATA[0]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def executor():
    # The twin's pool, made once and the same size as async_array's default.
    with concurrent.futures.ThreadPoolExecutor(max_workers=aa.max_workers()) as ex:
        yield ex


def load_one():
    return ONE


@pytest.mark.benchmark(group="single leaf (16,) float32")
@pytest.mark.parametrize("way", ["async_array", "ThreadPoolExecutor + device_put"])
def test_single_leaf(benchmark, executor, way):
    if way == "async_array":
        run = lambda: aa.async_wrap(load_one, shape=(16,), dtype=np.float32).result()  # noqa: E731
    else:
        run = lambda: jax.device_put(executor.submit(load_one).result())  # noqa: E731
    out = benchmark(lambda: run().block_until_ready())
    np.testing.assert_array_equal(out, ONE)


def tree_async_wrap():
    return aa.materialize(aa.async_wrap(lambda: DATA, like=LIKE))


def tree_device_put():
    return jax.device_put(DATA)


def tree_from_callback():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return [jax.make_array_from_callback((16,), sharding, lambda _, a=a: a) for a in DATA]


TREE_WAYS = {
    "async_array": tree_async_wrap,
    "jax.device_put(list)": tree_device_put,
    "make_array_from_callback": tree_from_callback,
}


@pytest.mark.benchmark(group="100k leaves, one function")
@pytest.mark.parametrize("way", list(TREE_WAYS))
def test_tree_100k(benchmark, rounds, way):
    fn = TREE_WAYS[way]
    out = benchmark.pedantic(lambda: jax.block_until_ready(fn()), rounds=rounds, iterations=1)
    assert len(out) == N
    np.testing.assert_array_equal(out[-1], DATA[-1])


def map_async_map():
    return aa.materialize(aa.async_map(lambda path, spec: DATA[path[0].idx], LIKE))


def map_executor(executor):
    futures = [executor.submit(lambda i: jax.device_put(DATA[i]), i) for i in range(N)]
    return [f.result() for f in futures]


@pytest.mark.benchmark(group="100k leaves, one task each")
@pytest.mark.parametrize("way", ["async_array", "ThreadPoolExecutor + device_put"])
def test_map_100k(benchmark, executor, rounds, way):
    if way == "async_array":
        fn = map_async_map
    else:
        fn = lambda: map_executor(executor)  # noqa: E731
    out = benchmark.pedantic(lambda: jax.block_until_ready(fn()), rounds=rounds, iterations=1)
    assert len(out) == N
    np.testing.assert_array_equal(out[-1], DATA[-1])
