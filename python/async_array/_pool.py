"""The process-wide pool: its size, interpreter exit and ``os.fork``."""

from __future__ import annotations

import atexit
import operator
import os

from . import _core

ENV_MAX_WORKERS = "ASYNC_ARRAY_MAX_WORKERS"


def default_max_workers() -> int:
    """``$ASYNC_ARRAY_MAX_WORKERS``, else ``min(32, os.cpu_count() + 4)`` (the
    ``ThreadPoolExecutor`` default: loaders mostly wait on I/O)."""
    raw = os.environ.get(ENV_MAX_WORKERS)
    if raw is None or raw.strip() == "":
        return min(32, (os.cpu_count() or 1) + 4)
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_MAX_WORKERS} must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{ENV_MAX_WORKERS} must be a positive integer, got {raw!r}")
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
      ValueError: ``max_workers`` < 1, or a bad ``ASYNC_ARRAY_MAX_WORKERS``.
    """
    if max_workers is None:
        n = default_max_workers()
    else:
        try:
            n = operator.index(max_workers)
        except TypeError:
            raise TypeError(
                f"aa.configure: max_workers must be an integer, got {type(max_workers).__name__}"
            ) from None
        if n < 1:
            raise ValueError(f"aa.configure: max_workers must be at least 1, got {n}")
    _core.configure(n)


def max_workers() -> int:
    """The pool's current size."""
    return _core.pool_stats()["max_workers"]


configure()
# At exit, queued tasks are cancelled and running ones are not waited for.
atexit.register(_core.shutdown)
# The core holds its lock across fork() itself (pthread_atfork); in the child
# it then fails the tasks the parent's workers were running and restarts the rest.
os.register_at_fork(after_in_child=_core._after_fork_child)
