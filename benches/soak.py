"""Soak: random waits, cancels, timeouts, callbacks, failures and forks over
8 threads, for ``--minutes`` (default 10). Not part of ``make test``.

Every minute it pauses the threads between rounds, lets the pool finish what
they left running, and prints the live objects (``AsyncArray`` leaves, core
futures, ``HostBuffer``s, pool threads) and the RSS: what is left then is
kept, not in flight. After the first minute (imports, JAX's caches and the
pool's threads warm up) each must stay flat: no more than 10% and a small
slack above minute 1. Exits 1 when one grows, 0 otherwise.

Run: .venv/bin/python benches/soak.py [--minutes 10] [--threads 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import logging
import os
import random
import signal
import sys
import threading
import time
import warnings

import jax
import numpy as np

import async_array as aa
from async_array import _core
from async_array._core import _testing

F32 = np.float32
SPEC = jax.ShapeDtypeStruct((64,), F32)
# Growth allowed after minute 1, besides the 10%: objects, and MiB of RSS.
SLACK = {"leaves": 200, "futures": 200, "host_buffers": 20, "threads": 8, "rss_mib": 64}


class Failure(Exception):
    """What a failing loader raises."""


def loader(rng: random.Random, gate: threading.Event | None) -> np.ndarray:
    if gate is not None:
        gate.wait(rng.random() * 0.05)
    if rng.random() < 0.2:
        raise Failure("404")
    if rng.random() < 0.3:
        buf = aa.empty((64,), F32)
        np.asarray(buf)[:] = 1.0
        return buf
    return np.ones(64, F32)


def one_round(rng: random.Random, counts: dict[str, int]) -> None:
    """Makes a few leaves in one of three ways, then uses them at random."""
    gate = threading.Event() if rng.random() < 0.5 else None
    kind = rng.choice(["wrap", "map", "stream"])
    if kind == "wrap":
        leaves = [
            aa.async_wrap(lambda: loader(rng, gate), shape=(64,), dtype=F32) for _ in range(4)
        ]
    elif kind == "map":
        leaves = list(aa.async_map(lambda path, spec: loader(rng, gate), [SPEC] * 4))
    else:
        leaves = aa.async_stream(
            lambda: ((f"[{i}]", loader(rng, gate)) for i in range(4)), [SPEC] * 4
        )
    for leaf in leaves:
        action = rng.random()
        if action < 0.15:
            leaf.cancel()
            counts["cancels"] += 1
        elif action < 0.3:
            leaf.add_done_callback(
                lambda x: counts.__setitem__("callbacks", counts["callbacks"] + 1)
            )
        elif action < 0.45:
            try:
                leaf.result(timeout=rng.random() * 0.01)
            except (TimeoutError, Failure, concurrent.futures.CancelledError):
                counts["timeouts_or_failures"] += 1
    if gate is not None:
        gate.set()
    try:
        if rng.random() < 0.5:
            aa.materialize(leaves, timeout=30)
        else:
            for _ in aa.as_completed(leaves, timeout=30):
                pass
    except (Failure, concurrent.futures.CancelledError):
        counts["timeouts_or_failures"] += 1
    for leaf in leaves:
        if rng.random() < 0.3:
            try:
                aa.future(leaf).result(timeout=30)
            except (Failure, concurrent.futures.CancelledError):
                pass
    counts["rounds"] += 1


def fork_once() -> int:
    """Forks a child that reads a ready leaf; the child's exit code."""
    ready = aa.async_wrap(lambda: np.arange(4, dtype=F32), shape=(4,), dtype=F32)
    ready.result(timeout=30)
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a hung child dies instead of outliving the soak
        os._exit(0 if ready.result(10).shape == (4,) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def live() -> dict[str, float]:
    gc.collect()
    objs = gc.get_objects()
    rss_kb = next(
        int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")
    )
    return {
        "leaves": sum(isinstance(o, aa.AsyncArray) for o in objs),
        "futures": sum(isinstance(o, _core.Future) for o in objs),
        "host_buffers": _testing.live_host_buffers(),
        "threads": _core.pool_stats()["threads"],
        "rss_mib": rss_kb / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*fork.*")
    logging_off()
    stop = threading.Event()
    counts = dict.fromkeys(["rounds", "cancels", "callbacks", "timeouts_or_failures", "forks"], 0)
    errors: list[BaseException] = []

    pausing = threading.Event()  # set: threads park between rounds
    resumed = threading.Event()
    parked = threading.Semaphore(0)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                if pausing.is_set():
                    parked.release()
                    resumed.wait()
                one_round(rng, counts)
        except BaseException as exc:  # a soak failure: report it, stop all
            errors.append(exc)
            stop.set()

    threads = [
        threading.Thread(target=worker, args=(args.seed * 1000 + i,)) for i in range(args.threads)
    ]
    for t in threads:
        t.start()
    rows = []
    start = time.monotonic()
    minute = 0
    while not stop.is_set() and minute < args.minutes:
        next_mark = start + 60 * (minute + 1)
        while time.monotonic() < min(next_mark, start + 60 * args.minutes) and not stop.is_set():
            if fork_once() != 0:
                errors.append(RuntimeError("a forked child failed"))
                stop.set()
            counts["forks"] += 1
            stop.wait(5.0)
        minute += 1
        resumed.clear()
        pausing.set()
        for _ in threads:  # bounded: a round ends within seconds
            if not parked.acquire(timeout=120):
                errors.append(RuntimeError("a soak thread did not finish its round"))
                stop.set()
                break
        # What the rounds left running (timed-out or unwaited tasks) ends.
        while _core.pool_stats()["queued"] and not stop.is_set():
            _core.wait_for_running_tasks(1.0)
        _core.wait_for_running_tasks(60)
        row = live()
        rows.append(row)
        pausing.clear()
        resumed.set()
        print(
            f"minute {minute}: "
            + ", ".join(f"{k} {v:.0f}" for k, v in row.items())
            + " | "
            + ", ".join(f"{k} {v}" for k, v in counts.items()),
            flush=True,
        )
    stop.set()
    resumed.set()
    for t in threads:
        t.join(60)
    if errors:
        print(f"FAILED: {errors[0]!r}", file=sys.stderr)
        return 1
    grew = [
        f"{key} {rows[0][key]:.0f} -> {row[key]:.0f} (minute {i + 1})"
        for i, row in enumerate(rows[1:], start=1)
        for key in SLACK
        if row[key] > rows[0][key] * 1.1 + SLACK[key]
    ]
    if grew:
        print("GREW: " + "; ".join(grew), file=sys.stderr)
        return 1
    print("flat after minute 1", flush=True)
    return 0


def logging_off() -> None:
    # Failed leaves nobody retrieved are logged by design; thousands of them
    # would drown the per-minute table.
    logging.getLogger("async_array").setLevel(logging.CRITICAL)


if __name__ == "__main__":
    sys.exit(main())
