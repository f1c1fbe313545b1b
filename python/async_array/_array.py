"""``AsyncArray``: a ``jax.Array`` whose value arrives later."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import operator
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

import jax
import numpy as np

from . import _jax_hooks
from ._source import Source
from ._spec import default_sharding, timeout_seconds

_LOG = logging.getLogger("async_array")


def _check_timeout(timeout: Any, caller: str) -> None:
    """A ready leaf's wait still refuses a bad ``timeout`` (a typo must not
    pass only while data loads fast); a plain int or float costs one test."""
    if type(timeout) not in (int, float) or timeout != timeout:
        timeout_seconds(timeout, caller)


class AsyncArray(jax.Array):
    """A ``jax.Array`` whose value is produced by a task that may still run.

    Shape, dtype and sharding are known at once, so ``jax.jit`` traces and
    compiles a function of an ``AsyncArray`` while the value loads; only
    reading the value waits.

    Never blocks: ``shape``, ``dtype``, ``ndim``, ``size``, ``nbytes``,
    ``itemsize``, ``aval``, ``sharding``, ``committed``, ``done()``,
    ``is_ready()``, ``running()``, ``cancelled()``, ``cancel()``,
    ``add_done_callback()``, ``future()`` and ``repr()``.

    Blocks until the value exists (the GIL is released; Ctrl-C interrupts):
    ``result()``, ``exception()``, ``block_until_ready()``, ``str()``,
    ``np.asarray(x)``, ``__jax_array__``, ``__dlpack__``, every operator,
    ``await x`` (suspends the coroutine only, as ``asyncio.wrap_future``),
    indexing, iteration and every other ``jax.Array`` method, which are
    forwarded to the result.

    Not constructed directly: ``async_wrap``, ``async_map``, ``async_stream``,
    ``make_array_from_callback`` and ``aa.jit`` make them.
    """

    __slots__ = (
        "__weakref__",
        "_aval",
        "_committed",
        "_future",
        "_index",
        "_sharding",
        "_source",
        "_value",
    )
    __array_priority__ = 100

    def __init__(
        self,
        source: Source,
        index: int,
        aval: Any,
        sharding: jax.sharding.Sharding | None,
        committed: bool | None = None,
    ) -> None:
        # sharding None: the default device's, read when asked (an aa.jit
        # output placed where its program puts it). committed None: whether
        # a sharding is given.
        self._source: Source | None = source
        self._index = index
        self._aval = aval
        self._sharding = sharding
        self._committed = sharding is not None if committed is None else committed
        self._value: jax.Array | None = None
        self._future: LeafFuture | None = None

    # -- known at once -------------------------------------------------------
    @property
    def aval(self) -> Any:
        """The abstract value (``ShapedArray``): shape, dtype, weak type."""
        return self._aval

    @property
    def shape(self) -> tuple[int, ...]:
        return self._aval.shape

    @property
    def dtype(self) -> np.dtype:
        return self._aval.dtype

    @property
    def ndim(self) -> int:
        return len(self._aval.shape)

    @property
    def size(self) -> int:
        return math.prod(self._aval.shape)

    @property
    def itemsize(self) -> int:
        return self._aval.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Size of the value in bytes."""
        return self.size * self._aval.dtype.itemsize

    @property
    def weak_type(self) -> bool:
        """False for ``async_wrap`` leaves; an ``aa.jit`` output is weakly
        typed exactly where ``jax.jit``'s would be."""
        return getattr(self._aval, "weak_type", False)

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """The requested sharding; when none was asked, the default device's
        at the call that made the leaf (``jax.default_device`` honoured)."""
        return self._sharding if self._sharding is not None else default_sharding()

    @property
    def committed(self) -> bool:
        """True when a sharding was requested (the value is committed to it)."""
        return self._committed

    @property
    def format(self) -> Any:
        """The value's layout once it exists (``jax.Array.format``); None while
        pending or failed: the default layout, what ``jax.jit`` assumes then.
        Never waits."""
        if self._value is None and not self._succeeded():
            return None
        value: Any = self.result()  # .format: not in JAX's stubs of jax.Array
        return value.format

    def _succeeded(self) -> bool:
        source = self._source
        if source is None:
            return True
        return source.future.done() and source.error(self._index) is None

    @property
    def is_fully_addressable(self) -> bool:
        return self.sharding.is_fully_addressable

    @property
    def is_fully_replicated(self) -> bool:
        return self.sharding.is_fully_replicated

    @property
    def device(self) -> Any:
        sharding = self.sharding
        devices = sharding.device_set
        return next(iter(devices)) if len(devices) == 1 else sharding

    def devices(self) -> set[Any]:
        return set(self.sharding.device_set)

    # -- future-like ---------------------------------------------------------
    def done(self) -> bool:
        """True once the value exists or its task failed or was cancelled."""
        source = self._source
        return source is None or source.future.done()

    def is_ready(self) -> bool:
        """Same as :meth:`done` (``jax.Array.is_ready`` spelling)."""
        return self.done()

    def running(self) -> bool:
        source = self._source
        return source is not None and source.future.running()

    def cancelled(self) -> bool:
        source = self._source
        return source is not None and source.future.cancelled()

    def cancel(self) -> bool:
        """Cancels the task if it has not started (every leaf of that task).

        Returns:
          True if the task is cancelled; then every use raises
          ``concurrent.futures.CancelledError``.
        """
        source = self._source
        return source is not None and source.future.cancel()

    def result(self, timeout: float | None = None) -> jax.Array:
        """Waits for the value and returns it as a ``jax.Array``.

        Args:
          timeout: seconds to wait; None waits as long as it takes (a negative
            number counts as zero, as in ``concurrent.futures``).

        Raises:
          TypeError: ``timeout`` is not a number nor None.
          TimeoutError: not ready within ``timeout`` seconds.
          concurrent.futures.CancelledError: the task was cancelled.
          async_array.WaitCycleError: (a RuntimeError) called inside a
            pool task (an ``async_wrap`` function, say) whose own work this
            leaf waits for, directly or through other tasks: the wait would
            never end. Raised when the wait starts (not for ``timeout=0``),
            naming the calls in the cycle.
          Exception: whatever the task raised, with a note naming this leaf, or
            the validation error of this leaf (shape, dtype, overflow).
        """
        value = self._value
        if value is not None:
            if timeout is not None:
                _check_timeout(timeout, "AsyncArray.result")
            return value
        source = self._source
        if source is None:  # another thread resolved it meanwhile
            return self._value  # type: ignore[return-value]
        if timeout is not None:
            timeout = timeout_seconds(timeout, f"AsyncArray.result ({source.where(self._index)})")
        value = source.value(self._index, timeout)
        self._value = value
        self._source = None
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits, then returns what this leaf failed with, or None.

        Raises:
          TypeError: ``timeout`` is not a number nor None.
          TimeoutError: not done within ``timeout`` seconds.
          concurrent.futures.CancelledError: the task was cancelled.
          async_array.WaitCycleError: (a RuntimeError) the wait would never end, as in
            :meth:`result`.
        """
        source = self._source
        if source is None:
            if timeout is not None:
                _check_timeout(timeout, "AsyncArray.exception")
            return None
        if timeout is not None:
            timeout = timeout_seconds(
                timeout, f"AsyncArray.exception ({source.where(self._index)})"
            )
        fut = source.future
        if not fut.done() and not source.wait(self._index, timeout):
            raise TimeoutError(f"{source.where(self._index)}: not done after {timeout} s")
        failed = source.error(self._index)
        if failed is None:
            return None
        exc, tb = failed
        if isinstance(exc, concurrent.futures.CancelledError):
            raise exc
        source.mark_retrieved()
        return exc.with_traceback(tb)

    def add_done_callback(self, fn: Callable[[AsyncArray], Any]) -> None:
        """Calls ``fn(self)`` once done, on the thread that finished the task
        (at once, here, if done). Exceptions from ``fn`` are logged to the
        ``async_array`` logger.

        Raises:
          TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(
                f"AsyncArray.add_done_callback: fn must be callable, got {type(fn).__name__}"
            )
        source = self._source
        if source is None:
            _call_back(fn, self)
        else:
            source.future.add_done_callback(functools.partial(_call_back, fn, self))

    def block_until_ready(self) -> AsyncArray:
        """Waits for the value (and for JAX to finish computing it); returns self."""
        self.result().block_until_ready()
        return self

    def future(self) -> concurrent.futures.Future:
        """This leaf as a ``concurrent.futures.Future`` (the same object on
        every call), for the tools that collect futures:
        ``concurrent.futures.wait``/``as_completed``, ``asyncio.wrap_future``,
        ``asyncio.gather``. (An ``AsyncArray`` is an array, so unhashable, and
        those tools need hashable futures.)

        It completes with the leaf's ``jax.Array`` or its exception, is
        cancelled with the leaf, and its ``cancel()`` cancels the leaf's task
        if it has not started (every leaf of that task). Never waits.
        """
        fut = self._future
        if fut is None:
            with _FUTURE_LOCK:
                fut = self._future
                if fut is None:
                    fut = self._future = _leaf_future(self)
        return fut

    def __await__(self) -> Generator[Any, None, jax.Array]:
        """``await x``: as ``await asyncio.wrap_future(x.future())``. A
        cancelled leaf raises ``asyncio.CancelledError``; cancelling the
        awaiting task cancels the leaf if its task has not started."""
        return asyncio.wrap_future(self.future()).__await__()

    def __repr__(self) -> str:
        spec = f"shape={self.shape}, dtype={self.dtype.name}"
        if not self.done():
            state = "running" if self.running() else "pending"
            return f"AsyncArray({state}, {spec})"
        source = self._source
        failed = source.error(self._index) if source is not None else None
        if failed is not None:
            exc = failed[0]
            return f"AsyncArray(failed: {type(exc).__name__}: {exc}, {spec})"
        return f"AsyncArray(ready, {self.result()!r})"

    def __str__(self) -> str:
        return str(self.result())

    def __format__(self, spec: str) -> str:
        return format(self.result(), spec)

    @property
    def __jax_array__(self) -> Callable[[], jax.Array]:
        # A property, so that without the hooks JAX's own probe for this
        # attribute raises the error that names the public route.
        if _jax_hooks.ERROR is not None:
            raise _jax_hooks.hooks_error()
        return self.result

    def __array__(
        self, dtype: Any = None, context: None = None, copy: bool | None = None
    ) -> np.ndarray:
        # jax.Array's own contract: copy=False raises where a copy is needed.
        return self.result().__array__(dtype, copy=copy)

    def __reversed__(self) -> Iterator[jax.Array]:
        # jax.Array has no __reversed__: reversed() falls back to len and indexing.
        return reversed(self.result())

    def __hash__(self) -> int:
        raise TypeError(
            "unhashable type: 'AsyncArray' (a leaf is a jax.Array, and jax.Array is "
            "unhashable); asyncio.gather, asyncio.wait and concurrent.futures.wait "
            "take its concurrent.futures.Future: x.future()"
        )

    def __reduce__(self) -> Any:
        return self.result().__reduce__()


def _call_back(fn: Callable[[AsyncArray], Any], leaf: AsyncArray, *_: Any) -> None:
    """Runs a done-callback; what it raises is logged with its traceback,
    naming the callback (as ``concurrent.futures`` does)."""
    try:
        fn(leaf)
    except Exception:
        _LOG.exception("async_array: exception in done-callback %r of %r", fn, leaf)


_FUTURE_LOCK = threading.Lock()


_PENDING = concurrent.futures._base.PENDING
_RUNNING = concurrent.futures._base.RUNNING
_CANCELLED = concurrent.futures._base.CANCELLED


class LeafFuture(concurrent.futures.Future):
    """The ``concurrent.futures.Future`` of one leaf (``AsyncArray.future()``).

    Every question asked of it (``done``, ``running``, ``result``, ``repr``,
    ...) first brings it to its leaf's state: the pool gives no start
    callback, and a task's end reaches the future through a callback that
    the finishing thread runs only after it has woken the leaf's readers.
    ``cancel()`` cancels the leaf's task first, so both agree.
    """

    def __init__(self, source: Source | None, index: int) -> None:
        super().__init__()
        # The task's output, not the leaf: a leaf it kept alive would keep
        # its own future alive. None: the leaf was ready when asked.
        self._leaf_source = source
        self._leaf_index = index

    def _sync(self) -> None:
        """Brings the state to the task's: RUNNING once it runs, and the
        outcome once it ended (the first thread to get there sets it)."""
        source = self._leaf_source
        if source is None or self._state not in (_PENDING, _RUNNING):
            return
        task = source.future
        if task.done():
            _settle(self, source, self._leaf_index)
        elif self._state == _PENDING and task.running():
            with self._condition:
                if self._state == _PENDING:
                    self._state = _RUNNING

    def cancel(self) -> bool:
        self._sync()
        source = self._leaf_source
        if self._state in (_PENDING, _RUNNING) and source is not None:
            if not source.future.cancel():
                return False
            _settle(self, source, self._leaf_index)
        return self.cancelled()

    def cancelled(self) -> bool:
        self._sync()
        return super().cancelled()

    def running(self) -> bool:
        self._sync()
        return super().running()

    def done(self) -> bool:
        self._sync()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        self._sync()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._sync()
        return super().exception(timeout)

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future], object]) -> None:
        self._sync()
        super().add_done_callback(fn)

    def __repr__(self) -> str:
        self._sync()
        return super().__repr__()

    # Only the leaf sets its future: set by anyone else, the two would
    # disagree for good. Refused in every state, as CPython refuses a second
    # set_result.
    def set_result(self, result: Any) -> None:
        raise concurrent.futures.InvalidStateError(_SET_BY_LEAF.format(self, "set_result"))

    def set_exception(self, exception: BaseException | None) -> None:
        raise concurrent.futures.InvalidStateError(_SET_BY_LEAF.format(self, "set_exception"))


_SET_BY_LEAF = "{!r} is set by its leaf alone (AsyncArray.future()); {} is not for its users"
_set_result = concurrent.futures.Future.set_result
_set_exception = concurrent.futures.Future.set_exception


def _leaf_future(leaf: AsyncArray) -> LeafFuture:
    source = leaf._source
    if source is None:
        fut = LeafFuture(None, leaf._index)
        _set_result(fut, leaf._value)
        return fut
    fut = LeafFuture(source, leaf._index)
    # Before the task's other callbacks: none of them may see the leaf done
    # and its future not (a wait on the future there would never end).
    settle = functools.partial(_settle, fut, source, leaf._index)
    source.future.add_done_callback(settle, first=True)
    return fut


def _settle(fut: LeafFuture, source: Source, index: int, _: Any = None) -> None:
    """Completes a leaf's future as its task ended, once: on the finishing
    thread, or on the first thread that asks the future before that one."""
    if fut._state not in (_PENDING, _RUNNING):
        return
    if source.future.cancelled():
        with fut._condition:
            if fut._state not in (_PENDING, _RUNNING):
                return
            fut._state = _CANCELLED
            # What an executor's worker does for a cancelled item: only this
            # step tells concurrent.futures.wait/as_completed's waiters.
            fut.set_running_or_notify_cancel()
            fut._condition.notify_all()
        fut._invoke_callbacks()  # type: ignore[attr-defined]
        return
    try:
        value = source.value(index, 0)
    except BaseException as exc:  # the leaf's own failure, for the future to hold
        outcome = functools.partial(_set_exception, fut, exc)
    else:
        outcome = functools.partial(_set_result, fut, value)
    try:
        outcome()
    except concurrent.futures.InvalidStateError:
        pass  # another thread settled it meanwhile


def _forward(name: str) -> Callable[..., Any]:
    def method(self: AsyncArray, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.result(), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Waits for the value, then returns ``result().{name}(...)``."
    return method


def _forward_property(name: str) -> property:
    return property(
        lambda self: getattr(self.result(), name),
        doc=f"Waits for the value, then returns ``result().{name}``.",
    )


_ArrayImpl = _jax_hooks.array_type()

# Dunders Python looks up on the type: each waits and defers to the result.
_OPERATORS = [
    f"__{op}__"
    for base in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "divmod", "pow", "matmul",
        "and", "or", "xor", "lshift", "rshift",
    )
    for op in (base, "r" + base)
] + [
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
    "__neg__", "__pos__", "__abs__", "__invert__", "__round__",
    "__bool__", "__int__", "__float__", "__complex__", "__index__",
    "__len__", "__iter__", "__contains__", "__getitem__", "__setitem__",
    "__copy__", "__deepcopy__", "__dlpack__", "__dlpack_device__", "__array_namespace__",
]  # fmt: skip
for _name in _OPERATORS:
    setattr(AsyncArray, _name, _forward(_name))

# Public names of the concrete class that the abstract jax.Array lacks: forwarded
# by name too, in case the concrete class cannot be found (see _jax_hooks).
_CONCRETE_ONLY = (
    "clone", "delete", "is_deleted", "on_device_size_in_bytes", "platform", "tobytes",
    "tolist", "traceback", "unsafe_buffer_pointer",
)  # fmt: skip

# Every other public name of the concrete jax.Array (methods such as sum or
# reshape, properties such as T or at) waits and defers to the result. Names
# jax.Array lacks stay missing, so hasattr(x, "foo") answers without waiting.
for _name in sorted(set(dir(_ArrayImpl)) | set(_CONCRETE_ONLY)):
    if _name.startswith("_") or _name in AsyncArray.__dict__:
        continue
    _static = inspect.getattr_static(_ArrayImpl, _name, None)
    if _static is None and _name == "traceback":  # a property; the rest are methods
        setattr(AsyncArray, _name, _forward_property(_name))
    elif _static is None or (callable(_static) and not isinstance(_static, property)):
        setattr(AsyncArray, _name, _forward(_name))
    else:
        setattr(AsyncArray, _name, _forward_property(_name))


#: The shared output a leaf still reads its value from (``source_of(leaf)``),
#: or None once the value is cached on the leaf. A C-level getter: bulk waits
#: call it once a leaf.
source_of: Callable[[AsyncArray], Source | None] = operator.attrgetter("_source")


def where_of(leaf: AsyncArray) -> str:
    """How messages name a pending leaf: its call and key path."""
    source = leaf._source
    return "a ready leaf" if source is None else source.where(leaf._index)
