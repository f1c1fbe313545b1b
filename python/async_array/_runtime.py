"""The process-wide pool: its size, interpreter exit and ``os.fork``; and
``paused_gc``, the window in which trees of leaves are made or resolved."""

from __future__ import annotations

import atexit
import contextlib
import gc
import operator
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator

import jax  # noqa: F401  (imported first: its exit hook must run after ours)

from . import _core

ENV_MAX_WORKERS = "ASYNC_ARRAY_MAX_WORKERS"

#: The largest pool size taken: more threads than a process is let start on
#: common Linux set-ups (a container's pid limit, the kernel's threads-max).
MAX_WORKERS_LIMIT = 65536


def default_max_workers() -> int:
    """``$ASYNC_ARRAY_MAX_WORKERS``, else ``min(32, usable CPUs + 4)`` (the
    ``ThreadPoolExecutor`` rule: loaders mostly wait on I/O). Usable CPUs
    count the affinity mask and cgroup quota (``_core.default_max_workers``,
    the one place this rule lives)."""
    raw = os.environ.get(ENV_MAX_WORKERS)
    if raw is None or raw.strip() == "":
        return _core.default_max_workers()
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(
            f"{ENV_MAX_WORKERS} must be from 1 to {MAX_WORKERS_LIMIT}, got {raw!r}"
        ) from None
    if not 1 <= n <= MAX_WORKERS_LIMIT:
        raise ValueError(f"{ENV_MAX_WORKERS} must be from 1 to {MAX_WORKERS_LIMIT}, got {raw!r}")
    return n


def configure(max_workers: int | None = None) -> None:
    """Sets how many tasks run at once on the shared pool.

    Args:
      max_workers: threads that may run tasks at once (at least 1); None
        restores the default (:func:`default_max_workers`). Threads start
        when work arrives. A task blocked on another leaf does not count
        against this number, so waiting inside a task never deadlocks.

    Raises:
      TypeError: ``max_workers`` is not an integer.
      ValueError: ``max_workers`` < 1 or > :data:`MAX_WORKERS_LIMIT`, or a bad
        ``ASYNC_ARRAY_MAX_WORKERS``.
    """
    if max_workers is None:
        n = default_max_workers()
    else:
        try:
            if isinstance(max_workers, bool):
                raise TypeError
            n = operator.index(max_workers)
        except TypeError:
            raise TypeError(
                f"aa.configure: max_workers must be an integer, got {type(max_workers).__name__}"
            ) from None
        if not 1 <= n <= MAX_WORKERS_LIMIT:
            raise ValueError(
                f"aa.configure: max_workers must be from 1 to {MAX_WORKERS_LIMIT}, got {n}"
            )
    _core.configure(n)


def max_workers() -> int:
    """The pool's current size."""
    return _core.pool_stats()["max_workers"]


class JaxWork:
    """Counts pool work that is inside JAX (a hand-off, a compile, a run).

    At interpreter exit, JAX's own exit hook tears down its backends; a thread
    still inside XLA then crashes the process. So exit cancels queued tasks,
    runs :data:`exit_hooks`, waits for running tasks (a task's own ``jnp``
    calls may be inside JAX), then for this count to reach zero, all within
    :func:`exit_grace` seconds, and refuses new JAX work. This count is
    waited for past the grace, with a line on stderr: the library's own JAX
    work (a hand-off, an ``aa.jit`` compile or run) cannot be stopped, ends,
    and a thread that came out of it during finalization aborted the process.

    At ``os.fork()`` the same count is drained first (at most
    :data:`FORK_GRACE` seconds) and new JAX work waits until the fork is done:
    a child forked while a worker was inside XLA (a device put) inherited
    XLA's locks held by a thread it does not have, and hung.

    Use ``with jax_work: ...`` around the JAX part of a pool task, or
    ``enter()`` and ``leave()`` where the work spans callbacks. The count is
    kept under a lock (correct without the GIL too), and :meth:`drain` sleeps
    on a condition that the last ``leave()`` wakes.
    """

    __slots__ = ("_active", "_changed", "_exiting", "_forking")

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._active = 0
        self._exiting = False
        self._forking = False

    def enter(self) -> None:
        """Counts one more piece of work; while a fork is under way, waits
        for it first.

        Raises:
          RuntimeError: the interpreter is exiting.
        """
        with self._changed:
            if self._forking:
                self._changed.wait_for(lambda: not self._forking, FORK_GRACE)
            if self._exiting:
                raise RuntimeError(
                    "async_array: the interpreter is exiting; no new work goes to JAX"
                )
            self._active += 1

    def leave(self) -> None:
        with self._changed:
            self._active -= 1
            # Only exit and fork wait for the count (notify_all costs ~0.5 µs
            # a leaf otherwise).
            if self._active <= 0 and (self._exiting or self._forking):
                self._changed.notify_all()

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def drain(self, timeout: float) -> None:
        """Refuses new work, then waits for the work inside JAX to end: up to
        ``timeout`` seconds quietly, then as long as it runs, saying so on
        stderr once."""
        with self._changed:
            self._exiting = True
            if self._changed.wait_for(lambda: self._active <= 0, timeout):
                return
            print(
                f"async_array: exit waits for {self._active} piece(s) of work inside JAX "
                "(a hand-off, an aa.jit compile or run) to end: a thread stopped inside "
                "JAX's C++ aborts the process",
                file=sys.stderr,
                flush=True,
            )
            self._changed.wait_for(lambda: self._active <= 0)

    def before_fork(self) -> None:
        """Holds off new JAX work and waits (at most :data:`FORK_GRACE`
        seconds) for the work already inside JAX to leave it."""
        with self._changed:
            self._forking = True
            self._changed.wait_for(lambda: self._active <= 0, FORK_GRACE)

    def after_fork_parent(self) -> None:
        with self._changed:
            self._forking = False
            self._changed.notify_all()

    def after_fork_child(self) -> None:
        """In a forked child: a fresh lock, since the parent's may have been
        held by a thread that does not exist here. The count stays: the core
        fails the parent's running tasks in the child, and their callbacks
        leave."""
        self._changed = threading.Condition(threading.Lock())
        self._forking = False


ENV_EXIT_GRACE = "ASYNC_ARRAY_EXIT_GRACE"


def exit_grace() -> float:
    """Seconds interpreter exit waits for running tasks, then for work inside
    JAX: ``$ASYNC_ARRAY_EXIT_GRACE``, else 30."""
    raw = os.environ.get(ENV_EXIT_GRACE, "").strip()
    try:
        grace = float(raw) if raw else 30.0
    except ValueError:
        grace = -1.0
    if not grace >= 0:  # also NaN
        raise ValueError(f"{ENV_EXIT_GRACE} must be a number of seconds >= 0, got {raw!r}")
    return grace


#: Seconds ``os.fork()`` waits for work inside JAX to leave it before forking anyway.
FORK_GRACE = 10.0

jax_work = JaxWork()

#: Called at interpreter exit, after queued tasks are cancelled and before
#: waiting for work inside JAX (``aa.jit`` drops dispatches still waiting here).
exit_hooks: list[Callable[[], None]] = []


def _at_exit() -> None:
    try:
        _wait_at_exit()
    except KeyboardInterrupt:
        # A Ctrl-C during the wait: leave now, without a traceback and without
        # JAX's own exit hook, which would crash under the tasks still inside it.
        print(
            "async_array: exit interrupted; leaving without waiting for the pool's tasks",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGINT)


def _wait_at_exit() -> None:
    grace = exit_grace()
    deadline = time.monotonic() + grace
    _core.shutdown()  # queued tasks are cancelled
    for hook in exit_hooks:
        hook()
    # Finalization ends every thread that then takes the GIL, and one ended
    # inside JAX's C++ (a task's own jnp call, say) aborts the process
    # ("FATAL: exception not rethrown"). Which task is inside C++ cannot be
    # known, so wait for running tasks, as concurrent.futures waits for its
    # workers; bounded, since a task may also sleep for an hour.
    if not _core.wait_for_running_tasks(min(1.0, grace)):
        # Said once, so that a quiet exit of up to `grace` seconds is explained.
        print(
            f"async_array: exit waits up to {grace:g} s (${ENV_EXIT_GRACE}) for the "
            "pool's tasks still running",
            file=sys.stderr,
            flush=True,
        )
        _core.wait_for_running_tasks(max(0.0, deadline - time.monotonic()))
    # A task's value freed after this is not freed at all (the core leaks what
    # nobody holds once exit began): freeing jax.Arrays enters JAX's C++ too.
    jax_work.drain(max(0.0, deadline - time.monotonic()))
    # The pool's threads end now (shutdown woke them), each deleting its Python
    # thread state while Python runs normally: what a task kept in
    # threading.local (a socket, a jax.Array) is freed on its own thread here,
    # not during finalization, where its destructor aborted the process.
    _core.wait_for_threads_to_end(max(0.5, deadline - time.monotonic()))


exit_grace()  # a bad value fails at import, not silently at exit
configure()
# Registered after `import jax`, so it runs before JAX's own exit hook (LIFO).
atexit.register(_at_exit)
# The core holds its lock across fork() itself (pthread_atfork); in the child
# it then fails the tasks the parent's workers were running and refuses what
# was queued (that runs in the parent).
os.register_at_fork(after_in_child=_core._after_fork_child)
os.register_at_fork(
    before=jax_work.before_fork,
    after_in_parent=jax_work.after_fork_parent,
    after_in_child=jax_work.after_fork_child,
)


# Threads inside a paused_gc window, and whether the collector was enabled
# when the first of them entered (the last one out restores it).
_pause_lock = threading.Lock()
_pause_depth = 0
_pause_restores = False


@contextlib.contextmanager
def paused_gc() -> Generator[None, None, None]:
    """Pauses the cyclic garbage collector while a tree's leaves are made or
    resolved in bulk: they are acyclic, and collections triggered by the
    allocation count alone cost several microseconds a leaf on large trees.

    Windows may overlap across threads: the collector resumes when the last
    one ends. When the young generation is then due a collection (more tracked
    objects than its threshold, 700 by default), its objects go to the oldest
    generation at once (``gc.freeze`` then ``gc.unfreeze``, an O(1) list
    splice) instead of being walked by that collection: on 300k leaves that one
    collection took 0.2-0.6 s with the GIL held, and a Ctrl-C waited for it (up
    to 330 ms measured; 58 ms with the splice); on 1k leaves the collections
    after the windows cost ~0.3-1.2 ms a call (a tenth of it). At most a
    threshold's worth of objects made outside the windows goes along (the
    collector would have run otherwise). Skipped when the program froze objects
    itself, whose freeze it would undo."""
    global _pause_depth, _pause_restores
    with _pause_lock:
        if _pause_depth == 0:
            _pause_restores = gc.isenabled()
            gc.disable()
        _pause_depth += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pause_depth -= 1
            if _pause_depth == 0 and _pause_restores:
                if gc.get_count()[0] > gc.get_threshold()[0] and gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()
