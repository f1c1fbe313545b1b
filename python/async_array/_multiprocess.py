"""Failures across the processes of a ``jax.distributed`` job.

A leaf whose sharding spans processes is one global array; every process
makes it at the same point of the same program, so the n-th such leaf made
here is the n-th everywhere: its global number. When a process's share of it
fails, the process writes that to the job's key-value store
(``async_array/failed/<n>``). Such a leaf is ready only once every process
has loaded its share of the leaf's call (``async_array/done/<call>/<process>``),
so every wait (``result``, ``aa.materialize``, a ``jax.jit`` dispatch) sees
another process's failure as a ``RemoteFailure`` naming it and the leaf. An
``aa.jit`` program over several processes also agrees with the others
(``async_array/call/<k>/<process>``: ``ok`` or why not) and launches only
when every process is ready (a compile can fail on one). Either way a
failure is not a hang in a collective until JAX's heartbeat ends the job.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import jax

from . import _core, _jax_hooks, _spec
from ._errors import RemoteFailure
from ._runtime import exit_hooks

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
    """Numbers the leaves of ``specs`` that span processes and makes their
    readiness global: such a leaf is ready once every process's share of its
    call is loaded, and fails (``RemoteFailure``, naming the process and the
    leaf) when another process's share failed. ``sources`` holds one
    ``Source`` for all leaves, or one a leaf; a spanning source's future is
    replaced by one that the :class:`_Confirmer` completes.

    One agreement a call, not a leaf: a key-value round trip costs about
    0.3 ms here, and 1,000 leaves x 3 other processes would add a second.
    """
    ids = number_leaves(specs.shardings)
    if ids is None:
        return
    if len(sources) == 1 and sources[0].leaf_count == len(ids):
        parts = [(sources[0], ids)]
    else:
        parts = [(source, [ids[i]]) for i, source in enumerate(sources) if ids[i] >= 0]
    group = _Group(next(n for n in ids if n >= 0), len(parts))
    for source, source_ids in parts:
        source.global_ids = source_ids
        group.add(source)


def next_call_number() -> int:
    with _lock:
        return next(_call_numbers)


class _Group:
    """The spanning sources of one call on this process, and their progress."""

    __slots__ = ("entries", "key", "lock", "outstanding")

    def __init__(self, key: int, sources: int) -> None:
        self.key = key  # the call's first global leaf number: the same on every process
        self.lock = threading.Lock()
        self.entries: list[tuple[Any, _core.Future, _core.Future]] = []
        # Counted in full before the first add: a future already done runs
        # its callback inside add, and the count must not reach 0 early.
        self.outstanding = sources

    def add(self, source: Any) -> None:
        confirmed = _core.Future()
        local = source.swap_future(confirmed)
        self.entries.append((source, local, confirmed))
        confirmed.add_done_callback(functools.partial(_cancel_if_cancelled, local))
        local.add_done_callback(functools.partial(self._local_done, source, confirmed))

    def _local_done(self, source: Any, confirmed: _core.Future, local: _core.Future) -> None:
        failures = _failures(local, len(source.global_ids))
        if any(f is not None for f in failures):
            # Here it fails at once; the others learn it from the store.
            _publish_failures(source, failures)
            _complete(confirmed, local, {})
        with self.lock:
            self.outstanding -= 1
            last = self.outstanding == 0
        if last:
            _confirmer().add(self)


def _cancel_if_cancelled(local: _core.Future, confirmed: _core.Future) -> None:
    if confirmed.cancelled():
        local.cancel()


def _failures(fut: _core.Future, count: int) -> list[BaseException | None]:
    """Per leaf of a done future: what it failed with, or None."""
    if fut.cancelled():
        return [concurrent_cancelled()] * count
    exc = fut.exception(0)
    if exc is not None:
        return [exc] * count
    return [v if isinstance(v, BaseException) else None for v in fut.result(0)]


def _publish_failures(source: Any, failures: list[BaseException | None]) -> None:
    store = client()
    if store is None:
        return
    me = jax.process_index()
    try:
        for i, n in enumerate(source.global_ids):
            failure = failures[i]
            if n >= 0 and failure is not None:
                where = _spec.where(source.name, source.key_path(source.offset + i))
                store.key_value_set(
                    f"{PREFIX}failed/{n}", f"process {me}: {where}: {describe(failure)}"
                )
    except Exception:  # the store is gone (shutdown): nothing to tell
        _LOG.debug("async_array: could not publish a failure", exc_info=True)


def _complete(confirmed: _core.Future, local: _core.Future, remote: dict[int, str]) -> None:
    """Completes ``confirmed`` as ``local``, with the leaves in ``remote``
    (index -> what another process said) failing with ``RemoteFailure``."""
    if confirmed.done():
        return
    if local.cancelled():
        confirmed.cancel()
        return
    exc = local.exception(0)
    if exc is not None:
        confirmed.set_exception(exc)
        return
    values = list(local.result(0))
    for i, text in remote.items():
        if not isinstance(values[i], BaseException):
            values[i] = RemoteFailure(f"failed on another process of the job: {text}")
    confirmed.set_result(values)


class _Confirmer:
    """One thread a process that, for each call whose share is loaded here,
    tells the other processes (``async_array/done/<call>/<process>``) and
    waits until each has said the same, or has published a failure of one of
    the call's leaves; then completes the call's futures. Calls are confirmed
    in the order they finish here. Ended at interpreter exit (within one
    slice of the store's wait)."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._queue: list[_Group] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="async-array-confirm", daemon=True)
        self._thread.start()

    def add(self, group: _Group) -> None:
        store = client()
        if store is not None:
            try:
                store.key_value_set(f"{PREFIX}done/{group.key}/{jax.process_index()}", "ok")
            except Exception:  # the store is gone: nothing to agree on
                store = None
        if store is None:
            _finish(group, {})
            return
        with self._changed:
            self._queue.append(group)
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stop = True
            self._changed.notify()
        self._thread.join(2 * SLICE_MS / 1000)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    queue, self._queue = self._queue, []
                    for group in queue:
                        _finish(group, {})
                    return
                group = self._queue.pop(0)
            try:
                remote = self._agree(group)
            except Exception:  # the store is gone: nothing to agree on
                _LOG.debug("async_array: could not confirm a call", exc_info=True)
                remote = {}
            _finish(group, remote)

    def _agree(self, group: _Group) -> dict[int, str]:
        """Failures by global leaf number once every other process is done
        with ``group``'s call, or one of them failed a leaf of it."""
        store = client()
        if store is None:
            return {}
        ids = {n for source, _, _ in group.entries for n in source.global_ids if n >= 0}
        failed: dict[int, str] = {}

        def give_up() -> bool:
            failed.update(_failed_among(store, ids))
            return self._stop or bool(failed)

        for other in _others():
            if _wait_for_key(store, f"{PREFIX}done/{group.key}/{other}", give_up) is None:
                return failed
        return _failed_among(store, ids)


def _others() -> list[int]:
    """The other processes of the job."""
    me = jax.process_index()
    return [p for p in range(jax.process_count()) if p != me]


def _wait_for_key(store: Any, key: str, give_up: Callable[[], bool]) -> str | None:
    """What another process set at ``key``, waited for in slices of
    ``SLICE_MS``; None as soon as ``give_up()`` is true between two slices
    (it may also raise)."""
    while True:
        try:
            return store.blocking_key_value_get(key, SLICE_MS)
        except Exception:
            if give_up():
                return None


def _failed_among(store: Any, ids: set[int]) -> dict[int, str]:
    me = f"process {jax.process_index()}:"
    found = {}
    for key, text in store.key_value_dir_get(f"{PREFIX}failed/"):
        n = int(key.rsplit("/", 1)[1])
        if n in ids and not text.startswith(me):
            found[n] = text
    return found


def _finish(group: _Group, failed: dict[int, str]) -> None:
    for source, local, confirmed in group.entries:
        remote = {i: failed[n] for i, n in enumerate(source.global_ids) if n in failed}
        _complete(confirmed, local, remote)


_confirmer_lock = threading.Lock()
_the_confirmer: _Confirmer | None = None


def _confirmer() -> _Confirmer:
    global _the_confirmer
    with _confirmer_lock:
        if _the_confirmer is None:
            _the_confirmer = _Confirmer()
            exit_hooks.append(_the_confirmer.stop)
        return _the_confirmer


def concurrent_cancelled() -> BaseException:
    import concurrent.futures

    return concurrent.futures.CancelledError("cancelled")


def describe(exc: BaseException) -> str:
    notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith("async_array: raised for")]
    text = f"{type(exc).__name__}: {exc}"
    return text + (f" ({notes[0][len('async_array: ') :]})" if notes else "")


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
    store.key_value_set(
        f"{PREFIX}call/{number}/{jax.process_index()}", "ok" if failure is None else failure
    )
    if failure is not None:
        return
    for other in _others():
        said = _wait_for_key(
            store, f"{PREFIX}call/{number}/{other}", lambda: _raise_if_failed(store, leaves, name)
        )
        if said != "ok":
            raise RemoteFailure(f"{name}: not run, because {said}")


def _raise_if_failed(store: Any, leaves: list[tuple[int, str]], name: str) -> bool:
    """Raises RemoteFailure when one of ``leaves`` failed on another process;
    else false (the wait goes on)."""
    if leaves:
        failed = _failed_among(store, {n for n, _ in leaves})
        for n, path in leaves:
            if n in failed:
                raise RemoteFailure(f"{name}: not run, because input {path} failed on {failed[n]}")
    return False
