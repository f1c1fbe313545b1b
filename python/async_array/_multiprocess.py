"""Failures across the processes of a ``jax.distributed`` job.

A leaf whose sharding spans processes is one global array; every process
makes it at the same point of the same program, so the n-th such leaf made
here is the n-th everywhere: its global number. When a process's share of it
fails, the process writes that to the job's key-value store
(``async_array/failed/<n>``). An ``aa.jit`` program over several processes
first agrees with the other processes (``async_array/call/<k>/<process>``:
``ok`` or why not) and launches only when every process is ready; a
process that failed makes the others raise, naming it and the leaf, instead
of hanging in a collective until JAX's heartbeat ends the job.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import jax

from . import _core, _jax_hooks, _spec

_LOG = logging.getLogger("async_array")
PREFIX = "async_array/"
# How long one wait on the store lasts before the failures are checked again.
SLICE_MS = 200

_lock = threading.Lock()
_leaf_numbers = itertools.count()
_call_numbers = itertools.count()


def client() -> Any:
    """The store's client in a job of several processes, else None."""
    if jax.process_count() == 1:
        return None
    return _jax_hooks.distributed_client()


def number_leaves(shardings: list[Any]) -> list[int] | None:
    """Global numbers of the leaves whose sharding spans processes (-1 for
    the others), in order; None when none does or this is one process."""
    if jax.process_count() == 1:
        return None
    spans: dict[int, bool] = {}
    flags = []
    for s in shardings:
        found = spans.get(id(s))
        if found is None:
            found = spans[id(s)] = s is not None and not s.is_fully_addressable
        flags.append(found)
    if not any(flags):
        return None
    with _lock:
        return [next(_leaf_numbers) if f else -1 for f in flags]


def track(specs: Any, sources: list[Any]) -> None:
    """Numbers the leaves of ``specs`` that span processes and has each
    source publish their failures; ``sources`` holds one ``Source`` for all
    leaves, or one a leaf."""
    ids = number_leaves(specs.shardings)
    if ids is None:
        return
    if len(sources) == 1 and sources[0].leaf_count == len(ids):
        (source,) = sources
        source.global_ids = ids
        watch(source.future, source.name, source.key_path, source.offset, ids)
        return
    for i, source in enumerate(sources):
        if ids[i] >= 0:
            source.global_ids = [ids[i]]
            watch(source.future, source.name, source.key_path, source.offset, [ids[i]])


def next_call_number() -> int:
    with _lock:
        return next(_call_numbers)


def watch(
    future: _core.Future, name: str, key_path: Callable[[int], str], offset: int, ids: list[int]
) -> None:
    """Publishes the failure of any leaf in ``ids`` once ``future`` is done."""
    future.add_done_callback(lambda fut: _publish(fut, name, key_path, offset, ids))


def _publish(
    fut: _core.Future, name: str, key_path: Callable[[int], str], offset: int, ids: list[int]
) -> None:
    store = client()
    if store is None:
        return
    try:
        if fut.cancelled():
            failed: list[Any] = [concurrent_cancelled()] * len(ids)
        else:
            exc = fut.exception(0)
            values = fut.result(0) if exc is None else None
            failed = [
                exc if exc is not None else (v if isinstance(v, BaseException) else None)
                for v in (values if values is not None else [None] * len(ids))
            ]
        me = jax.process_index()
        for i, n in enumerate(ids):
            if n < 0 or failed[i] is None:
                continue
            where = _spec.where(name, key_path(offset + i))
            store.key_value_set(
                f"{PREFIX}failed/{n}", f"process {me}: {where}: {describe(failed[i])}"
            )
    except Exception:  # the store is gone (shutdown): nothing to tell
        _LOG.debug("async_array: could not publish a failure", exc_info=True)


def concurrent_cancelled() -> BaseException:
    import concurrent.futures

    return concurrent.futures.CancelledError("cancelled")


def describe(exc: BaseException) -> str:
    notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith("async_array: raised for")]
    text = f"{type(exc).__name__}: {exc}"
    return text + (f" ({notes[0][len('async_array: ') :]})" if notes else "")


class RemoteFailure(RuntimeError):
    """Another process of the job failed where this one waits for it."""


def agree(number: int, failure: str | None, leaves: list[tuple[int, str]], name: str) -> None:
    """Tells every process whether this one is ready to launch spanning call
    ``number`` (``failure`` None) or why not, and waits until every other
    process says it is ready.

    Raises:
      RemoteFailure: another process failed that call, or one of ``leaves``
        (global number, how the call names the input) failed on another
        process; the message names the process and the leaf.
    """
    store = client()
    if store is None:
        return
    me = jax.process_index()
    store.key_value_set(f"{PREFIX}call/{number}/{me}", "ok" if failure is None else failure)
    if failure is not None:
        return
    for other in range(jax.process_count()):
        if other == me:
            continue
        key = f"{PREFIX}call/{number}/{other}"
        while True:
            try:
                said = store.blocking_key_value_get(key, SLICE_MS)
                break
            except Exception:
                _raise_if_failed(store, leaves, name)
        if said != "ok":
            raise RemoteFailure(f"{name}: not run, because {said}")


def _raise_if_failed(store: Any, leaves: list[tuple[int, str]], name: str) -> None:
    if not leaves:
        return
    failed = dict(store.key_value_dir_get(f"{PREFIX}failed/"))
    for n, path in leaves:
        text = failed.get(f"{PREFIX}failed/{n}")
        if text is not None:
            raise RemoteFailure(f"{name}: not run, because input {path} failed on {text}")
