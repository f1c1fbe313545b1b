"""Waiting on many leaves at once: ``materialize``, ``wait``, ``as_completed``,
and ``resolve_all``, which ``jax.jit``'s dispatch calls (see ``_jax_hooks``).

Each waits on the distinct tasks behind its ``AsyncArray`` leaves in one
GIL-free wait in the Rust core, not in a Python loop of per-leaf waits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, NamedTuple

import jax

from . import _core
from ._array import AsyncArray, source_of, where_of
from ._errors import WaitCycleError, waiting_on
from ._runtime import paused_gc
from ._source import pending
from ._spec import timeout_seconds

FIRST_COMPLETED = "FIRST_COMPLETED"
FIRST_EXCEPTION = "FIRST_EXCEPTION"
ALL_COMPLETED = "ALL_COMPLETED"


def failure_of(leaf: AsyncArray) -> BaseException | None:
    """What a done leaf failed with (its exception, or ``CancelledError``),
    else None. Never waits; marks nothing retrieved."""
    source = source_of(leaf)
    if source is None or not source.future.done():
        return None
    failed = source.error(leaf._index)
    return None if failed is None else failed[0]


def not_ready(
    caller: str, leaves: Sequence[AsyncArray], timeout: float | None, tree: Any = None
) -> TimeoutError:
    """A TimeoutError naming how many of ``leaves`` are pending and the first
    (by its key path in ``tree`` too, when the wait was given one), and the
    failures already known (up to three)."""
    waiting = [leaf for leaf in leaves if not leaf.done()]
    first = where_of(waiting[0]) if waiting else "none"
    if waiting and tree is not None:
        # Paths only now, on the error path: flattening with them costs µs a leaf.
        at = next(
            (p for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if leaf is waiting[0]),
            None,
        )
        if at is not None:
            first = f"{jax.tree_util.keystr(at)} of the tree, {first}"
    count = f"{len(waiting)} leaf" if len(waiting) == 1 else f"{len(waiting)} leaves"
    text = f"{caller}: {count} not ready after {timeout} s (the first: {first})"
    failures = []
    for leaf in leaves:
        exc = failure_of(leaf)
        if exc is not None:
            failures.append(f"{where_of(leaf)}: {type(exc).__name__}: {exc}")
    if failures:
        more = f" and {len(failures) - 3} more" if len(failures) > 3 else ""
        text += f"; already failed: {'; '.join(failures[:3])}{more}"
    return TimeoutError(text)


def resolve_all(
    leaves: Sequence[Any],
    timeout: float | None = None,
    caller: str = "jax.jit dispatch",
    tree: Any = None,
) -> list[Any]:
    """The value of every leaf, after one GIL-free wait for all pending tasks
    (``tree``: what ``leaves`` were flattened from, to name a pending leaf).

    ``AsyncArray`` leaves become ``jax.Array``; others pass through.

    Raises:
      TypeError: ``timeout`` is not a number nor None.
      TimeoutError: some leaf not ready within ``timeout`` seconds; it names
        the failures already known.
      async_array.WaitCycleError: (a RuntimeError) called inside a
        pool task that a waited leaf waits for (directly or through other
        tasks), so the wait could never end but by its timeout; raised when
        the wait starts, naming the leaf and the calls in the cycle.
      Exception: a failed leaf's exception, as soon as one is known (a
        failure never waits behind slow leaves): the first failed leaf in
        leaf order among the tasks that had failed, else the first to fail.
    """
    if timeout is not None:
        timeout = timeout_seconds(timeout, caller)
    with paused_gc():
        arrays = [leaf for leaf in leaves if type(leaf) is AsyncArray]
        found = pending(map(source_of, arrays))
        if found.futures:
            for i in found.ready:  # a failure already known goes first
                if failure_of(arrays[i]) is not None:
                    arrays[i].result()
            try:
                stopped, failed = _core.wait_all_or_failure(found.futures, timeout)
            except WaitCycleError as exc:
                leaf = arrays[found.groups[exc.index][0]]
                raise waiting_on(exc, where_of(leaf)) from None
            if failed is not None:
                arrays[found.groups[failed][0]].result()  # raises its failure
            if not stopped and any(not leaf.done() for leaf in arrays):
                raise not_ready(caller, arrays, timeout, tree)
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
      TimeoutError: some leaf not ready within ``timeout`` seconds (naming
        the failures already known).
      async_array.WaitCycleError: (a RuntimeError) called inside a
        pool task that a waited leaf waits for (directly or through other
        tasks), so the wait could never end but by its timeout; raised when
        the wait starts, naming the leaf and the calls in the cycle.
      Exception: a failed leaf's exception, as soon as one is known (see
        :func:`resolve_all`); when all are done, the first in leaf order.

    Examples:
      >>> import numpy as np, async_array as aa
      >>> t = {"w": aa.async_wrap(lambda: np.ones(2, np.float32), shape=(2,), dtype=np.float32)}
      >>> aa.materialize(t)["w"]
      Array([1., 1.], dtype=float32)
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    values = resolve_all(leaves, timeout, "aa.materialize", tree)
    with paused_gc():
        return treedef.unflatten(values)  # type: ignore[attr-defined]


class TreePending(NamedTuple):
    """The tasks behind a tree's pending leaves, grouped: ``futures[k]``
    produces the leaves at ``leaves[k]`` (indices into ``paths``)."""

    paths: list[tuple[Any, AsyncArray]]
    futures: list[_core.Future]
    leaves: list[list[int]]
    ready: list[int]


def _pending(tree: Any, distinct: bool = False) -> TreePending:
    """The tree's ``AsyncArray`` leaves with their key paths, grouped by task;
    with ``distinct``, a leaf that appears twice is kept at its first path."""
    with paused_gc():
        flat = [
            (path, leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(leaf, AsyncArray)
        ]
        if distinct:
            seen: set[int] = set()
            unique = []
            for pair in flat:
                if id(pair[1]) not in seen:
                    seen.add(id(pair[1]))
                    unique.append(pair)
            flat = unique
        found = pending(source_of(leaf) for _, leaf in flat)
        return TreePending(flat, found.futures, found.groups, found.ready)


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
      async_array.WaitCycleError: (a RuntimeError) called inside a
        pool task that a waited leaf waits for (directly or through other
        tasks), so the wait could never end but by its timeout (for
        ``FIRST_COMPLETED``: every pending leaf does); raised when
        the wait starts, naming the leaf and the calls in the cycle.
    """
    if return_when not in (ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION):
        raise ValueError(
            f"aa.wait: return_when must be ALL_COMPLETED, FIRST_COMPLETED or "
            f"FIRST_EXCEPTION, got {return_when!r}"
        )
    if timeout is not None:
        timeout = timeout_seconds(timeout, "aa.wait")
    p = _pending(tree)
    with _naming_cycles(p):
        _wait(p, timeout, return_when)
    done: list[tuple[Any, AsyncArray]] = []
    not_done: list[tuple[Any, AsyncArray]] = []
    for pair in p.paths:
        (done if pair[1].done() else not_done).append(pair)
    return DoneAndNotDone(done, not_done)


@contextlib.contextmanager
def _naming_cycles(p: TreePending) -> Generator[None, None, None]:
    """Rewords a cycle the core found in a wait on ``p.futures`` to name the
    first leaf of the task that leads back."""
    try:
        yield
    except WaitCycleError as exc:
        leaf = p.paths[p.leaves[exc.index][0]][1]
        raise waiting_on(exc, where_of(leaf)) from None


def _wait(p: TreePending, timeout: float | None, return_when: str) -> None:
    if p.futures:
        if return_when == ALL_COMPLETED:
            _core.wait_all(p.futures, timeout)
        elif return_when == FIRST_COMPLETED and not p.ready:
            _core.Watcher(p.futures).next(timeout)
        elif return_when == FIRST_EXCEPTION and not any(_raised(p.paths[i][1]) for i in p.ready):
            deadline = None if timeout is None else time.monotonic() + timeout
            watcher = _core.Watcher(p.futures)
            for _ in p.futures:
                k = watcher.next(_remaining(deadline))
                if k is None or any(_raised(p.paths[i][1]) for i in p.leaves[k]):
                    break


def _raised(leaf: AsyncArray) -> bool:
    """Done by raising (``concurrent.futures.wait``'s FIRST_EXCEPTION test): a
    cancelled leaf is done, but did not raise."""
    return not leaf.cancelled() and failure_of(leaf) is not None


def as_completed(tree: Any, timeout: float | None = None) -> Iterator[tuple[Any, jax.Array]]:
    """Yields ``(key_path, jax.Array)`` for each ``AsyncArray`` leaf as it finishes.

    Leaves already done come first, in tree order; the rest in the order their
    tasks finish (leaves of one task together, in tree order). Each step is one
    GIL-free wait on whichever task finishes next. A leaf that appears more
    than once in the tree is yielded once, at its first key path. What was
    yielded is not kept: the generator holds neither the tree nor the leaves
    it has yielded (as ``concurrent.futures.as_completed``).

    Args:
      tree: any pytree; leaves that are not ``AsyncArray`` are skipped.
      timeout: seconds for the whole iteration; None waits as long as it takes.

    Raises:
      TypeError: ``timeout`` is not a number nor None (at the call).
      TimeoutError: leaves still pending after ``timeout`` seconds.
      async_array.WaitCycleError: (a RuntimeError) called inside a
        pool task that a waited leaf waits for (directly or through other
        tasks), so the wait could never end but by its timeout (checked
        at each step, over the leaves not yet yielded); raised when
        the wait starts, naming the leaf and the calls in the cycle.
      Exception: a failed leaf's exception, when that leaf is reached.
    """
    if timeout is not None:
        timeout = timeout_seconds(timeout, "aa.as_completed")
    return _as_completed(_pending(tree, distinct=True), timeout)


def _as_completed(p: TreePending, timeout: float | None) -> Iterator[tuple[Any, jax.Array]]:
    # Each pair is built by _take and yielded straight away: the generator's
    # frame never binds a yielded leaf or value, so a caller that drops them
    # frees them while the iteration goes on.
    deadline = None if timeout is None else time.monotonic() + timeout
    paths = p.paths
    for i in p.ready:
        yield _take(paths, i)
    if not p.futures:
        return
    watcher = _core.Watcher(p.futures)
    futures = p.futures
    for _ in range(len(futures)):
        try:
            k = watcher.next(_remaining(deadline))
        except WaitCycleError as exc:
            pair = paths[p.leaves[exc.index][0]]
            raise waiting_on(exc, where_of(pair[1])) from None
        if k is None:
            raise not_ready("aa.as_completed", [pair[1] for pair in paths if pair], timeout)
        futures[k] = None  # type: ignore[call-overload]
        for i in p.leaves[k]:
            yield _take(paths, i)


def _take(paths: list[tuple[Any, AsyncArray]], i: int) -> tuple[Any, jax.Array]:
    """``(key_path, value)`` of the i-th leaf, forgotten by ``paths``."""
    path, leaf = paths[i]
    paths[i] = None  # type: ignore[call-overload]
    return path, leaf.result()


def future(tree: Any) -> concurrent.futures.Future:
    """One ``concurrent.futures.Future`` of the whole tree: it completes with
    ``aa.materialize(tree)`` once every ``AsyncArray`` leaf is done, or with a
    failed leaf's exception as soon as one is known. Never waits.

    For ``asyncio``: ``await asyncio.wrap_future(aa.future(tree))``. Its
    ``cancel()`` cancels this future only; the leaves' tasks go on (cancel
    those with each leaf's ``cancel()``).
    """
    p = _pending(tree)
    out: concurrent.futures.Future = concurrent.futures.Future()
    # A leaf that failed before this call has no callback to come: settle now.
    if not p.futures or any(failure_of(p.paths[i][1]) is not None for i in p.ready):
        _settle_tree(out, tree)
        return out
    left = [len(p.futures)]
    lock = threading.Lock()

    def one_done(fut: _core.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last or fut.cancelled() or fut.exception(0) is not None:
            _settle_tree(out, tree)

    for fut in p.futures:
        fut.add_done_callback(one_done)
    return out


def _settle_tree(out: concurrent.futures.Future, tree: Any) -> None:
    if out.done():
        return
    failed: BaseException | None
    try:
        value = materialize(tree, 0)
    except BaseException as exc:  # a leaf's failure, for the future to hold
        value, failed = None, exc
    else:
        failed = None
    try:
        if failed is not None:
            out.set_exception(failed)
        else:
            out.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled, or settled by another task's callback meanwhile
