"""The only module that touches ``jax._src``.

``jax.jit`` accepts an :class:`~async_array.AsyncArray` argument and compiles
from its shape and dtype before the value exists because of three registrations,
the same ones JAX makes for its own ``EArray`` (``jax/_src/earray.py``):

* ``core.pytype_aval_mappings``: the aval of a leaf is known without waiting,
  so tracing, lowering and compiling never block;
* ``dtypes.register_canonicalize_value_handler``: the leaf is passed through
  unchanged while arguments are canonicalized;
* ``pxla.shard_arg_handlers``: at dispatch, every ``AsyncArray`` argument of one
  call is resolved in one GIL-free wait, then handed on as a ``jax.Array``.

Also here: the fast per-leaf hand-off to JAX (``pxla.batched_device_put``, about
5x cheaper than ``jax.device_put`` per leaf) and JAX's own warning for an x64
dtype requested while x64 is off. Each is checked against the JAX version at
import; where any is missing, :data:`ERROR` says so, ``jax.jit`` on an
``AsyncArray`` raises it, and the public route (``aa.jit``, ``aa.materialize``)
still works.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

#: JAX versions whose private hooks this module was checked against: [low, high).
SUPPORTED_JAX = ((0, 10, 0), (0, 11, 0))

#: Why the hooks are not installed, or None when they are.
ERROR: str | None = None

_PUBLIC_ROUTE = (
    "Use the public route instead: aa.jit(fun)(x) compiles while x loads and "
    "dispatches when it is ready, and aa.materialize(tree) waits and returns jax.Arrays."
)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


try:
    from jax._src import core as _core
    from jax._src import dtypes as _dtypes
    from jax._src.interpreters import pxla as _pxla

    _ShapedArray = _core.ShapedArray
    _batched_device_put = _pxla.batched_device_put
    _shard_args = _pxla.shard_args
    _register_canonicalize = _dtypes.register_canonicalize_value_handler
    _explicit_dtype = _dtypes._maybe_canonicalize_explicit_dtype
    _aval_mappings = _core.pytype_aval_mappings
    _shard_arg_handlers = _pxla.shard_arg_handlers
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the JAX build
    ERROR = f"this JAX ({jax.__version__}) lacks a private hook async_array needs ({exc}). "
    _ShapedArray = None

_found = _version(jax.__version__)
if ERROR is None and not (SUPPORTED_JAX[0] <= _found < SUPPORTED_JAX[1]):
    ERROR = (
        f"async_array's jax.jit integration was checked against JAX "
        f"{'.'.join(map(str, SUPPORTED_JAX[0]))} to below "
        f"{'.'.join(map(str, SUPPORTED_JAX[1]))}; this is JAX {jax.__version__}. "
    )
if ERROR is None and os.environ.get("ASYNC_ARRAY_DISABLE_JAX_HOOKS"):
    ERROR = "ASYNC_ARRAY_DISABLE_JAX_HOOKS is set, so the jax.jit integration is off. "
if ERROR is not None:
    ERROR += _PUBLIC_ROUTE


def hooks_error() -> RuntimeError:
    """The error to raise where JAX would need the missing hooks (a
    RuntimeError: JAX rewraps a TypeError raised while it reads an argument)."""
    return RuntimeError(f"jax.jit and jnp cannot take an AsyncArray directly: {ERROR}")


def install(array_type: type, resolve_all: Callable[[Sequence[Any]], list[jax.Array]]) -> None:
    """Registers ``array_type`` with JAX; ``resolve_all(leaves)`` waits once for
    all of them and returns their ``jax.Array`` values, in order."""
    if ERROR is not None:
        return

    def shard_arg(xs, shardings, layouts, copy_semantics):
        return _shard_args(shardings, layouts, copy_semantics, resolve_all(xs))

    _aval_mappings[array_type] = lambda x: x.aval
    _register_canonicalize(array_type, None)
    _shard_arg_handlers[array_type] = shard_arg


def shaped_array(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The (never weakly typed) aval of a leaf."""
    if _ShapedArray is None:  # pragma: no cover
        return jax.ShapeDtypeStruct(shape, dtype)
    return _ShapedArray(shape, dtype, weak_type=False)


def canonical_dtype(dtype: np.dtype, fun_name: str) -> np.dtype:
    """``dtype`` as JAX would make it, with JAX's own warning when x64 is off."""
    if ERROR is None:
        return np.dtype(_explicit_dtype(dtype, fun_name))
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def device_put(host: np.ndarray | jax.Array, aval: Any, sharding: Any, committed: bool):
    """Hands ``host`` to JAX as a ``jax.Array`` with ``sharding``.

    On CPU, a 64-byte-aligned C-contiguous numpy array is aliased, not copied:
    the caller passes only memory nothing else will write.
    """
    if ERROR is not None:
        return jax.device_put(host, sharding)
    if sharding.is_fully_replicated or len(sharding.device_set) == 1:
        devices = sharding._addressable_device_assignment
        shards = [host] * len(devices)
    else:
        index_map = sharding.addressable_devices_indices_map(aval.shape)
        devices = list(index_map)
        shards = [host[index] for index in index_map.values()]
    return _batched_device_put(aval, sharding, shards, devices, committed=committed)
