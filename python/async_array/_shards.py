"""``make_array_from_callback``: the asynchronous
``jax.make_array_from_callback``, one pool task per distinct shard index (the
per-shard engine is ``_per_shard``'s, shared with ``async_map(per_shard=True)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.experimental.layout import Format, Layout

from ._array import AsyncArray
from ._per_shard import submit_per_shard
from ._runtime import paused_gc
from ._spec import declare, qualname


def _callback_of(data_callback: Callable[[Any], Any]) -> Callable[..., Any]:
    def call(_path: Any, _spec: Any, index: tuple[slice, ...]) -> Any:
        return data_callback(index)

    return call


def make_array_from_callback(
    shape: Any,
    sharding: Any,
    data_callback: Callable[[tuple[slice, ...]], Any],
    *,
    dtype: Any,
) -> AsyncArray:
    """The asynchronous ``jax.make_array_from_callback``: returns an
    ``AsyncArray`` at once and calls ``data_callback(index)`` on the pool, once
    per distinct index among this process's devices, all concurrently.

    Under ``jax.distributed`` each process calls it with the global shape and
    sharding and reads only its own shards; the leaf is the global array.

    Args:
      shape: the global shape, a tuple of ints.
      sharding: a ``jax.sharding.Sharding`` (``NamedSharding`` sharded or
        replicated, ``SingleDeviceSharding``), a ``jax.Device``, a
        ``PartitionSpec`` under ``jax.set_mesh``, or a
        ``jax.experimental.layout.Format`` (a sharding with each shard's
        device-local layout, as a compiled function's ``input_formats``) whose
        layout is None or the default one. The result is committed to it.
      data_callback: ``data_callback(index)`` with ``index`` a tuple of
        slices into the global array (as JAX passes it) returns that shard:
        anything ``async_wrap``'s ``f`` may return, of the index's shape.
        Devices holding the same index (replication) share one call.
      dtype: the dtype of the array (canonicalized as JAX does; required,
        since nothing is read at the call).

    Returns:
      An ``AsyncArray`` of ``shape`` and ``dtype`` on ``sharding``.

    Raises:
      TypeError: ``data_callback`` not callable, an unknown dtype, or a
        sharding that is not a placement.
      ValueError: a negative dimension, or a sharding that does not fit
        ``shape`` (``jax.device_put``'s own error).

    The leaf then fails, at every use, with: the callback's own exception
    (a note names the index and its devices); ``ValueError`` for a shard
    whose shape is not its index's; ``TypeError`` for a cast across kinds;
    ``OverflowError`` for a value that does not fit ``dtype``; ``TypeError``
    for a ``Format`` whose layout is not the default one. Errors name the
    call, the index and the devices.

    Note:
      A ``HostBuffer`` shard (``aa.empty(index_shape, dtype)``) reaches its
      CPU devices without a copy; any other result is copied once.

    Examples:
      >>> import numpy as np, jax, async_array as aa
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("x",))
      >>> data = np.arange(8, dtype=np.float32)
      >>> x = aa.make_array_from_callback(
      ...     (8,), NamedSharding(mesh, P("x")), lambda index: data[index], dtype=np.float32)
      >>> print(x)
      [0. 1. 2. 3. 4. 5. 6. 7.]
    """
    if not callable(data_callback):
        raise TypeError(
            "make_array_from_callback: data_callback must be callable, got "
            f"{type(data_callback).__name__}"
        )
    name = f"make_array_from_callback({qualname(data_callback)})"
    if sharding is None:
        raise TypeError(f"{name}: needs a sharding, as jax.make_array_from_callback")
    device_layout = None
    if isinstance(sharding, Format):
        device_layout, sharding = sharding.layout, sharding.sharding
        if isinstance(device_layout, type(Layout.AUTO)):
            raise TypeError(
                f"{name}: Layout.AUTO cannot be used in place of a device-local layout, "
                "as in jax.make_array_from_callback"
            )
        if sharding is None:
            raise TypeError(f"{name}: a Format needs a sharding, as jax.make_array_from_callback")
    with paused_gc():
        specs = declare(name, shape, dtype, None, sharding)
        (leaf,) = submit_per_shard(_callback_of(data_callback), specs, [()], device_layout)
    return leaf
