"""Ctrl-C latency during a many-leaf load (goal: within 100 ms).

Each round sends SIGINT to this process from another thread at a random
moment while the main thread makes ``N`` leaves with ``aa.async_map`` (each a
(16,) float32 numpy result, converted to a ``jax.Array`` on the pool) and
waits for them with ``aa.materialize``; the figure is the time from
``os.kill`` to the ``KeyboardInterrupt`` handler. Its twin, from the same run:
the same signal while the main thread waits on a ``threading.Event`` (what
Python alone gives). Also printed: the longest collections of CPython's cyclic
garbage collector during the loads (``gc.callbacks``), which hold the GIL and
so delay the signal handler; a full collection over the heap of 300k leaves
cannot be interrupted.

Not part of ``make test`` or ``make bench`` (it reads clocks on purpose and
takes a few minutes). Run: .venv/bin/python benches/ctrl_c.py [--leaves N] [--rounds R]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import statistics
import threading
import time

import jax
import numpy as np

import async_array as aa

SPEC = jax.ShapeDtypeStruct((16,), np.float32)
VALUES = [np.full(16, i, np.float32) for i in range(1000)]


class Collections:
    """Durations (seconds) and generations of the collections while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seen: list[tuple[float, int]] = []
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.on:
            self.seen.append((time.perf_counter() - self._start, info["generation"]))


def interrupt_after(delay: float, sent: list[float]) -> threading.Thread:
    def send() -> None:
        time.sleep(delay)
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def one_load(leaves: int, delay: float, collections: Collections) -> float | None:
    """Milliseconds from the signal to the handler; None when the load ended first."""
    sent: list[float] = []
    sender = interrupt_after(delay, sent)
    collections.on = True
    try:
        tree = aa.async_map(lambda path, spec: VALUES[path[0].idx % 1000], [SPEC] * leaves)
        jax.block_until_ready(aa.materialize(tree))
        del tree
    except KeyboardInterrupt:
        caught = time.perf_counter()
        collections.on = False
        sender.join()
        return (caught - sent[0]) * 1e3
    finally:
        collections.on = False
    try:  # the load ended first; the signal still comes: let it land here
        sender.join()
        time.sleep(1)
    except KeyboardInterrupt:
        pass
    return None


def one_event_wait(delay: float) -> float:
    sent: list[float] = []
    sender = interrupt_after(delay, sent)
    try:
        threading.Event().wait(delay + 10)
    except KeyboardInterrupt:
        caught = time.perf_counter()
        sender.join()
        return (caught - sent[0]) * 1e3
    raise RuntimeError("the signal never came")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    collections = Collections()
    # How long one load takes, so that the signals fall anywhere in it.
    start = time.perf_counter()
    jax.block_until_ready(
        aa.materialize(aa.async_map(lambda p, s: VALUES[0], [SPEC] * args.leaves))
    )
    span = time.perf_counter() - start
    print(f"one load of {args.leaves} leaves: {span:.1f} s", flush=True)
    loads, waits = [], []
    for r in range(args.rounds):
        gc.collect()
        ms = one_load(args.leaves, rng.uniform(0.02, span), collections)
        aa._core.wait_for_running_tasks(60)  # the interrupted load's tasks, before the next
        if ms is not None:
            loads.append(ms)
        waits.append(one_event_wait(rng.uniform(0.02, 0.2)))
        shown = "ended first" if ms is None else f"{ms:.1f} ms"
        print(f"round {r + 1}: during the load {shown}; Event.wait {waits[-1]:.1f} ms", flush=True)
    longest = sorted(collections.seen, reverse=True)[:3]
    print(
        f"Ctrl-C during the load: max {max(loads):.1f} ms, median {statistics.median(loads):.1f} ms"
        f" ({len(loads)} signals); waiting on a threading.Event: max {max(waits):.1f} ms,"
        f" median {statistics.median(waits):.1f} ms"
    )
    shown = ", ".join(f"gen {g} {d * 1e3:.0f} ms" for d, g in longest) or "none ran"
    print(f"longest collections during the loads: {shown}")


if __name__ == "__main__":
    main()
