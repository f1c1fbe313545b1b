"""``async_wrap``: run a slow function on the pool, return ``AsyncArray``s at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

from . import _core
from ._array import AsyncArray
from ._convert import convert_results
from ._errors import frames_freed
from ._leaves import leaves_for
from ._runtime import jax_work, paused_gc
from ._spec import LeafSpecs, declare, qualname


def _run(f: Callable[[], Any], specs: LeafSpecs) -> list[Any]:
    with frames_freed:
        holder = [f()]
    with jax_work, specs.context, paused_gc():
        return convert_results(specs, holder)


@overload
def async_wrap(
    f: Callable[[], Any],
    *,
    shape: Sequence[int] | int,
    dtype: Any,
    like: None = None,
    sharding: Any = None,
) -> AsyncArray: ...


@overload
def async_wrap(
    f: Callable[[], Any],
    *,
    shape: None = None,
    dtype: None = None,
    like: Any,
    sharding: Any = None,
) -> Any: ...  # a pytree of AsyncArray shaped like ``like``


def async_wrap(
    f: Callable[[], Any],
    *,
    shape: Sequence[int] | int | None = None,
    dtype: Any = None,
    like: Any = None,
    sharding: Any = None,
) -> Any:
    """Runs ``f()`` once on the pool and returns its result's leaves at once.

    Args:
      f: a callable taking no arguments. It may return numpy arrays,
        ``jax.Array``s, ``HostBuffer``s, anything with ``__dlpack__`` or
        ``__array__``, Python scalars or nested lists; with ``like=``, a pytree
        of those with the structure of ``like`` (matched by key path).
      shape: the result's shape (with ``dtype``), for a single array.
      dtype: the result's dtype, canonicalized as JAX does (int64 becomes
        int32 when x64 is off, with JAX's warning).
      like: instead of shape/dtype, a pytree whose leaves have ``.shape`` and
        ``.dtype`` (``jax.ShapeDtypeStruct``, arrays, ``jax.eval_shape`` output).
      sharding: a ``jax.sharding.Sharding``, or a pytree prefix of ``like``
        with them, placing the result (committed). When None, a like leaf's
        own ``.sharding`` is used; otherwise the default device, uncommitted.

    Returns:
      An ``AsyncArray`` (shape/dtype), or a pytree of them shaped like ``like``.
      One pool task serves every leaf.

    Raises:
      TypeError: ``f`` not callable; both or neither of shape/dtype and like;
        an unknown dtype; a like leaf without shape/dtype; a bad sharding.
      ValueError: a negative dimension; a sharding that does not fit.

    Each leaf then fails, at every use, with: ``f``'s own exception (same
    type, ``f``'s frames, a note naming the leaf); ``ValueError`` for a shape
    or tree-structure mismatch; ``TypeError`` for a cast across kinds;
    ``OverflowError`` for a value that does not fit the declared dtype.

    Note:
      A ``HostBuffer`` result (``aa.empty``) reaches JAX without a copy on
      CPU: it is the zero-copy route. A numpy result is always copied once,
      never aliased (``f`` may keep it and write it later); a ``jax.Array``
      result is copied once on its device (``f`` may delete or donate it).

    Examples:
      >>> import time, numpy as np, jax, async_array as aa
      >>> def slow():
      ...     time.sleep(0.1)
      ...     return np.arange(4, dtype=np.int32)
      >>> x = aa.async_wrap(slow, shape=(4,), dtype=np.int32)
      >>> jax.jit(lambda v: v * v)(x)
      Array([0, 1, 4, 9], dtype=int32)
    """
    if not callable(f):
        raise TypeError(f"async_wrap: f must be callable, got {type(f).__name__}")
    with paused_gc():
        specs = declare(f"async_wrap({qualname(f)})", shape, dtype, like, sharding)
        return leaves_for(specs, _core.submit(_run, f, specs, label=specs.name))
