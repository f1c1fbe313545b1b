"""A task's output, shared by the leaves it produces, and the distinct pending
tasks behind a set of leaves (what every bulk wait waits on)."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import NamedTuple

import jax

from . import _core, _spec
from ._errors import WaitCycleError, shallow_copy, waiting_on

_LOG = logging.getLogger("async_array")

# A leaf's exception, the traceback it left its task with, and its notes then.
_LeafError = tuple[BaseException, TracebackType | None, list[str]]


class Call:
    """What the sources of one call's leaves share when each leaf has a
    source of its own (``load_safetensors``: one future a leaf): an
    exception retrieved from any leaf counts for the call, and an unretrieved
    one is logged once for the call, not once a leaf."""

    __slots__ = ("logged", "retrieved")

    def __init__(self) -> None:
        self.retrieved = False
        self.logged = False


class Source:
    """One task's output shared by its leaves (an ``async_wrap`` call, one
    ``aa.jit`` dispatch, ...). The task's future holds a list with one entry
    per leaf: a ``jax.Array``, or the exception that leaf alone failed with.
    If the task itself raised, every leaf raises that exception.

    Args:
      future: the ``_core.Future`` of the task.
      name: how messages name the call, e.g. ``"async_wrap(load_weights)"``.
      leaf_count: number of leaves.
      key_path: ``key_path(offset + i)`` is leaf ``i``'s key path as text;
        called only to build a message. One callable can serve the sources of
        a whole tree (one source a leaf, each with its own ``offset``).
      offset: added to a leaf's index to look up its key path.
      call: shared by the sources of one call's leaves (see :class:`Call`).
    """

    __slots__ = (
        "call",
        "future",
        "global_ids",
        "key_path",
        "leaf_count",
        "leaf_errors",
        "name",
        "offset",
        "retrieved",
    )

    def __init__(
        self,
        future: _core.Future,
        name: str,
        leaf_count: int,
        key_path: Callable[[int], str],
        offset: int = 0,
        call: Call | None = None,
    ) -> None:
        self.call = call
        self.future = future
        self.name = name
        self.leaf_count = leaf_count
        self.key_path = key_path
        self.offset = offset
        self.retrieved = False
        self.leaf_errors: dict[int, _LeafError] | None = None
        # Per leaf, its number among leaves spanning processes (-1: local);
        # None when no leaf spans processes (see _multiprocess).
        self.global_ids: list[int] | None = None

    def swap_future(self, future: _core.Future) -> _core.Future:
        """Puts ``future`` in place of the task's and returns the one it
        replaces: a leaf spanning processes is ready only when every process
        confirms its share (``_multiprocess``), so its readers wait on the
        confirmation while the local task still fills the replaced one."""
        replaced, self.future = self.future, future
        return replaced

    def where(self, index: int) -> str:
        """How messages name leaf ``index``."""
        return _spec.where(self.name, self.key_path(self.offset + index))

    def error(self, index: int) -> tuple[BaseException, TracebackType | None] | None:
        """Leaf ``index``'s exception and the traceback to raise it with, or
        None; the future must be done. Each call restores the exception's
        notes and the caller raises with that traceback, so neither grows
        with repeated uses (JAX adds a note whenever one passes through jit)."""
        fut = self.future
        if fut.cancelled():
            return (
                concurrent.futures.CancelledError(f"{self.where(index)}: cancelled before it ran"),
                None,
            )
        errors = self.leaf_errors
        found = errors.get(index) if errors is not None else None
        if found is None:
            exc = fut.exception(0)
            if exc is not None:
                # Same object for a single leaf; for a tree, a shallow copy per
                # leaf (same type, args, traceback, cause) so notes never mix.
                leaf_exc = exc if self.leaf_count == 1 else shallow_copy(exc)
                leaf_exc.add_note(f"async_array: raised in {self.where(index)}")
                tb = exc.__traceback__
            else:
                value = fut.result(0)[index]
                if not isinstance(value, BaseException):
                    return None
                leaf_exc, tb = value, value.__traceback__
            found = (leaf_exc, tb, list(getattr(leaf_exc, "__notes__", ())))
            if errors is None:
                errors = self.leaf_errors = {}
            errors[index] = found
        leaf_exc, tb, notes = found
        leaf_exc.__notes__ = list(notes)
        return leaf_exc, tb

    def value(self, index: int, timeout: float | None) -> jax.Array:
        """Waits (GIL released) and returns leaf ``index``'s ``jax.Array``."""
        fut = self.future
        values = fut.peek()
        if values is not None:
            value = values[index]
            if not isinstance(value, BaseException):
                if self.leaf_count == 1:
                    self.retrieved = True  # nothing left to report at collection
                return value
        elif not fut.done() and not self.wait(index, timeout):
            raise TimeoutError(f"{self.where(index)}: not ready after {timeout} s")
        failed = self.error(index)
        if failed is not None:
            self.mark_retrieved()
            exc, tb = failed
            raise exc.with_traceback(tb)
        return fut.result(0)[index]

    def wait(self, index: int, timeout: float | None) -> bool:
        """Waits (GIL released) for the task; True when it is done.

        Raises:
          async_array.WaitCycleError: called from a pool task that leaf ``index`` waits on
            (directly or through other tasks): the wait would never end.
        """
        try:
            return self.future.wait(timeout)
        except WaitCycleError as exc:
            raise waiting_on(exc, self.where(index)) from None

    def mark_retrieved(self) -> None:
        """A leaf's exception reached the user: nothing to log for this
        source (nor, with a :class:`Call`, for its call)."""
        self.retrieved = True
        if self.call is not None:
            self.call.retrieved = True

    def __del__(self) -> None:
        # As asyncio does: an exception nobody retrieved is logged, not lost;
        # if the task still runs, once it ends.
        try:
            call = self.call
            if not self.retrieved and not (call is not None and call.retrieved):
                if self.future.done():
                    _log_unretrieved(self.name, call, self.future)
                else:
                    self.future.add_done_callback(
                        functools.partial(_log_unretrieved, self.name, call)
                    )
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _log_unretrieved(name: str, call: Call | None, fut: _core.Future) -> None:
    """Logs the exception of a finished task whose leaves are all gone (once
    for a :class:`Call`, unless one of its leaves' exceptions was retrieved),
    unless the interpreter is exiting: a task that the exit stopped fails
    with that, and concurrent.futures logs nothing then either."""
    if _core.exiting() or (call is not None and (call.retrieved or call.logged)):
        return
    values = fut.peek()
    if values is not None:
        exc = next((v for v in values if isinstance(v, BaseException)), None)
    elif fut.cancelled():
        return
    else:
        exc = fut.exception(0)
    if exc is not None:
        if call is not None:
            call.logged = True
        _LOG.error(
            "async_array: %s failed and no leaf's exception was ever retrieved",
            name,
            exc_info=exc,
        )


class TaskGroups(NamedTuple):
    """The distinct tasks still running behind some leaves, in first-seen
    order: ``futures[k]`` produces the items at indices ``groups[k]``; the
    items at ``ready`` need no wait."""

    futures: list[_core.Future]
    groups: list[list[int]]
    ready: list[int]


def pending(sources: Iterable[Source | None]) -> TaskGroups:
    """Groups items by the task they wait on: ``sources[i]`` is item ``i``'s
    source, or None when its value is already at hand. Many leaves of one
    task (an ``async_wrap`` of a tree) give one future, so a bulk wait waits
    on each task once."""
    futures: list[_core.Future] = []
    groups: list[list[int]] = []
    ready: list[int] = []
    by_future: dict[int, int] = {}
    for i, source in enumerate(sources):
        if source is None:
            ready.append(i)
            continue
        fut = source.future
        k = by_future.get(id(fut))
        if k is None:
            if fut.done():
                ready.append(i)
                continue
            k = by_future[id(fut)] = len(futures)
            futures.append(fut)
            groups.append([])
        groups[k].append(i)
    return TaskGroups(futures, groups, ready)
