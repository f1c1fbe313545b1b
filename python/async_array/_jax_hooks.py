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

Also here: the per-leaf hand-off to JAX (``xla_client.batched_device_put`` and
DLPack's ``dlpack_managed_tensor_to_buffer``, about 10x cheaper per leaf than
``jax.device_put`` and ``jax.dlpack.from_dlpack``), and JAX's own warning for
an x64 dtype requested while x64 is off. Each is checked against the JAX version at
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
    from jax._src import array as _array
    from jax._src import core as _core
    from jax._src import dtypes as _dtypes
    from jax._src.interpreters import pxla as _pxla
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import xla_client as _xc

    _ShapedArray = _core.ShapedArray
    _ArrayImpl = _array.ArrayImpl
    _xc_batched_device_put = _xc.batched_device_put
    _ZERO_COPY = _xc.HostBufferSemantics.ZERO_COPY
    _COPY_DURING_CALL = _xc.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
    _dlpack_to_buffer = _jaxlib.dlpack_managed_tensor_to_buffer
    _KDL_CPU = 1
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


def array_type() -> type:
    """The concrete ``jax.Array`` class (``ArrayImpl``), without starting a
    backend (making an array would, and would fix the platform at import)."""
    if ERROR is None:
        return _ArrayImpl
    return type(jax.numpy.zeros(()))  # pragma: no cover - only without the hooks


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


# Devices of shardings that give every device the whole array, by id; the
# sharding is kept too, so its id is never reused while cached.
_whole: dict[int, tuple[Any, list[Any]]] = {}


def _placement(sharding: Any, shape: tuple[int, ...]) -> tuple[list[Any], list[Any] | None]:
    """(devices, index per device), or (devices, None) when every device gets it whole."""
    found = _whole.get(id(sharding))
    if found is not None:
        return found[1], None
    if len(sharding.device_set) == 1 or sharding.is_fully_replicated:
        devices = list(sharding._addressable_device_assignment)
        if len(_whole) < 4096:
            _whole[id(sharding)] = (sharding, devices)
        return devices, None
    index_map = sharding.addressable_devices_indices_map(shape)
    return list(index_map), list(index_map.values())


def put_host(host: np.ndarray, aval: Any, sharding: Any, committed: bool, alias: bool) -> jax.Array:
    """Hands a numpy array of the leaf's dtype to JAX with ``sharding``.

    ``alias=True`` lets XLA's CPU client use the memory in place (it does when
    the array is 64-byte aligned and C-contiguous): only for memory nothing else
    will write. Otherwise JAX copies it during the call, once.
    """
    if ERROR is not None:
        # Public route: jax.device_put may alias host memory, so copy unless ours.
        host = host if alias else np.array(host, copy=True)
        return jax.device_put(host, sharding if committed else None)
    devices, indices = _placement(sharding, aval.shape)
    if indices is None:
        shards = [host] * len(devices)
    else:
        shards = [host[i] for i in indices]
        alias = False
    semantics = _ZERO_COPY if alias else _COPY_DURING_CALL
    return _xc_batched_device_put(aval, sharding, shards, devices, committed, False, semantics)


def put_dlpack(buf: Any, aval: Any, sharding: Any, committed: bool) -> jax.Array:
    """Hands a CPU DLPack producer (a ``HostBuffer``) of the leaf's dtype and
    shape to JAX without a copy, on ``sharding``'s single CPU device.

    The same path as ``jax.dlpack.from_dlpack(buf, copy=False)``, minus its
    per-call Python overhead (several times the cost of the hand-off itself).
    """
    if ERROR is not None:
        array = jax.dlpack.from_dlpack(buf, copy=False)
        return jax.device_put(array, sharding) if committed else array
    (device,) = sharding.device_set
    capsule = buf.__dlpack__(stream=None)
    array = _dlpack_to_buffer(capsule, device, None, False, _KDL_CPU)
    return _ArrayImpl(aval, sharding, [array], committed=committed, _skip_checks=True)


def put_array(array: jax.Array, aval: Any, sharding: Any, committed: bool) -> jax.Array:
    """Re-labels a single-device ``jax.Array`` already on ``sharding``'s
    device with the leaf's aval and commitment (no copy)."""
    if ERROR is not None:
        return jax.device_put(array, sharding) if committed else array
    return _batched_device_put(aval, sharding, [array], list(sharding.device_set), committed)
