"""Waiting on many leaves at once: ``materialize``, ``wait``, ``as_completed``,
and ``resolve_all``, which ``jax.jit``'s dispatch calls (see ``_jax_hooks``).

Each waits on the distinct tasks behind its ``AsyncArray`` leaves in one
GIL-free wait in the Rust core, not in a Python loop of per-leaf waits.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, NamedTuple

import jax

from . import _core
from ._array import AsyncArray, source_of, where_of
from ._source import pending

FIRST_COMPLETED = "FIRST_COMPLETED"
FIRST_EXCEPTION = "FIRST_EXCEPTION"
ALL_COMPLETED = "ALL_COMPLETED"


@contextlib.contextmanager
def paused_gc() -> Generator[None, None, None]:
    """Pauses the cyclic garbage collector while a tree's leaves are made or
    resolved in bulk: they are acyclic, and collections triggered by the
    allocation count alone cost several microseconds a leaf on large trees."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def not_ready(caller: str, leaves: Sequence[AsyncArray], timeout: float | None) -> TimeoutError:
    """A TimeoutError naming how many of ``leaves`` are pending, and the first."""
    waiting = [leaf for leaf in leaves if not leaf.done()]
    first = where_of(waiting[0]) if waiting else "none"
    count = f"{len(waiting)} leaf" if len(waiting) == 1 else f"{len(waiting)} leaves"
    return TimeoutError(f"{caller}: {count} not ready after {timeout} s (the first: {first})")


def resolve_all(
    leaves: Sequence[Any], timeout: float | None = None, caller: str = "jax.jit dispatch"
) -> list[Any]:
    """The value of every leaf, after one GIL-free wait for all pending tasks.

    ``AsyncArray`` leaves become ``jax.Array``; others pass through.

    Raises:
      TimeoutError: some leaf not ready within ``timeout`` seconds.
      Exception: the first failed leaf's exception.
    """
    with paused_gc():
        arrays = [leaf for leaf in leaves if type(leaf) is AsyncArray]
        futures = pending(map(source_of, arrays)).futures
        if futures and not _core.wait_all(futures, timeout):
            raise not_ready(caller, arrays, timeout)
        return [leaf.result() if type(leaf) is AsyncArray else leaf for leaf in leaves]


def materialize(tree: Any, timeout: float | None = None) -> Any:
    """Waits for every ``AsyncArray`` leaf and returns the tree with their values.

    Args:
      tree: any pytree; leaves that are not ``AsyncArray`` pass through.
      timeout: seconds to wait in all; None waits as long as it takes.

    Returns:
      The same structure with ``jax.Array`` leaves, so later calls take JAX's
      own fast path.

    Raises:
      TimeoutError: some leaf not ready within ``timeout`` seconds.
      Exception: the first failed leaf's exception (in leaf order).

    Examples:
      >>> import numpy as np, async_array as aa
      >>> t = {"w": aa.async_wrap(lambda: np.ones(2, np.float32), shape=(2,), dtype=np.float32)}
      >>> aa.materialize(t)["w"]
      Array([1., 1.], dtype=float32)
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    values = resolve_all(leaves, timeout, "aa.materialize")
    with paused_gc():
        return treedef.unflatten(values)


class Pending(NamedTuple):
    """The tasks behind a tree's pending leaves, grouped: ``futures[k]``
    produces the leaves at ``leaves[k]`` (indices into ``paths``)."""

    paths: list[tuple[Any, AsyncArray]]
    futures: list[_core.Future]
    leaves: list[list[int]]
    ready: list[int]


def _pending(tree: Any) -> Pending:
    with paused_gc():
        flat = [
            (path, leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(leaf, AsyncArray)
        ]
        found = pending(source_of(leaf) for _, leaf in flat)
        return Pending(flat, found.futures, found.groups, found.ready)


class DoneAndNotDone(NamedTuple):
    """What ``aa.wait`` returns: ``(key_path, AsyncArray)`` pairs, in tree order."""

    done: list[tuple[Any, AsyncArray]]
    not_done: list[tuple[Any, AsyncArray]]


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def wait(
    tree: Any, timeout: float | None = None, return_when: str = ALL_COMPLETED
) -> DoneAndNotDone:
    """Waits for the ``AsyncArray`` leaves of ``tree``, as ``concurrent.futures.wait``.

    Args:
      tree: any pytree; only ``AsyncArray`` leaves are waited for.
      timeout: seconds to wait at most; None waits as long as it takes. Unlike
        ``result()``, running out of time is not an error: see ``not_done``.
      return_when: ``ALL_COMPLETED``, ``FIRST_COMPLETED`` or ``FIRST_EXCEPTION``
        (returns when any leaf fails, else when all are done).

    Returns:
      ``DoneAndNotDone(done, not_done)``: lists of ``(key_path, leaf)``.

    Raises:
      ValueError: an unknown ``return_when``.
    """
    if return_when not in (ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION):
        raise ValueError(
            f"aa.wait: return_when must be ALL_COMPLETED, FIRST_COMPLETED or "
            f"FIRST_EXCEPTION, got {return_when!r}"
        )
    p = _pending(tree)
    if p.futures:
        if return_when == ALL_COMPLETED:
            _core.wait_all(p.futures, timeout)
        elif return_when == FIRST_COMPLETED and not p.ready:
            _core.Watcher(p.futures).next(timeout)
        elif return_when == FIRST_EXCEPTION and not any(
            p.paths[i][1].exception() is not None for i in p.ready
        ):
            deadline = None if timeout is None else time.monotonic() + timeout
            watcher = _core.Watcher(p.futures)
            for _ in p.futures:
                k = watcher.next(_remaining(deadline))
                if k is None or any(p.paths[i][1].exception() is not None for i in p.leaves[k]):
                    break
    done, not_done = [], []
    for pair in p.paths:
        (done if pair[1].done() else not_done).append(pair)
    return DoneAndNotDone(done, not_done)


def as_completed(tree: Any, timeout: float | None = None) -> Iterator[tuple[Any, jax.Array]]:
    """Yields ``(key_path, jax.Array)`` for each ``AsyncArray`` leaf as it finishes.

    Leaves already done come first, in tree order; the rest in the order their
    tasks finish (leaves of one task together, in tree order). Each step is one
    GIL-free wait on whichever task finishes next.

    Args:
      tree: any pytree; leaves that are not ``AsyncArray`` are skipped.
      timeout: seconds for the whole iteration; None waits as long as it takes.

    Raises:
      TimeoutError: leaves still pending after ``timeout`` seconds.
      Exception: a failed leaf's exception, when that leaf is reached.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    p = _pending(tree)
    for i in p.ready:
        path, leaf = p.paths[i]
        yield path, leaf.result()
    if not p.futures:
        return
    watcher = _core.Watcher(p.futures)
    for _ in p.futures:
        k = watcher.next(_remaining(deadline))
        if k is None:
            raise not_ready("aa.as_completed", [leaf for _, leaf in p.paths], timeout)
        for i in p.leaves[k]:
            path, leaf = p.paths[i]
            yield path, leaf.result()
