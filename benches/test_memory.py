"""Resident memory per pending leaf, with 100k leaves pending.

Each round runs in a fresh interpreter (this file as a script), so that memory
freed by an earlier round cannot hide the cost: it warms the way up on 100
leaves, reads the RSS, makes 100k leaves whose producers wait behind a gate,
reads the RSS again, and prints the difference per leaf. The leaves' data is
made only after the gate opens, so it is not in the difference.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

N = 100_000
WAYS = ["async_array: async_wrap", "async_array: async_map", "ThreadPoolExecutor + device_put"]


def pending_bytes_per_leaf(way: str, n: int = N) -> float:
    """In this (fresh) process: RSS bytes per pending leaf of ``way``."""
    import concurrent.futures
    import gc
    import threading

    import jax
    import numpy as np
    import psutil

    import async_array as aa

    like = [jax.ShapeDtypeStruct((16,), np.float32)] * n
    gate = threading.Event()
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=aa.max_workers())

    def leaf(*_):
        gate.wait()
        return np.zeros(16, np.float32)

    def make(count):
        if way == "async_array: async_wrap":
            return aa.async_wrap(lambda: [leaf() for _ in range(count)], like=like[:count])
        if way == "async_array: async_map":
            return aa.async_map(leaf, like[:count])
        return [ex.submit(lambda: jax.device_put(leaf())) for _ in range(count)]

    def finish(tree):
        gate.set()
        if way.startswith("async_array"):
            aa.materialize(tree)
        else:
            jax.block_until_ready([f.result() for f in tree])
        gate.clear()

    finish(make(100))  # threads, JAX's backend, caches
    gc.collect()
    before = psutil.Process().memory_info().rss
    tree = make(n)
    gc.collect()
    after = psutil.Process().memory_info().rss
    finish(tree)
    return (after - before) / n


@pytest.mark.benchmark(group="memory per pending leaf, 100k pending")
@pytest.mark.parametrize("way", WAYS)
def test_pending_memory(benchmark, rounds, way):
    per_leaf = []

    def one_round():
        run = [sys.executable, __file__, way]
        out = subprocess.run(run, capture_output=True, text=True, timeout=300, check=True)
        per_leaf.append(json.loads(out.stdout)["bytes_per_leaf"])

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    benchmark.extra_info["bytes_per_leaf"] = per_leaf


if __name__ == "__main__":
    print(json.dumps({"bytes_per_leaf": pending_bytes_per_leaf(sys.argv[1])}))
