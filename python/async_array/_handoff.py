"""The per-leaf hand-off to JAX: a numpy array, a ``HostBuffer`` or a
``jax.Array`` becomes a leaf's ``jax.Array`` on its sharding.

Uses the private functions :mod:`._jax_hooks` found at import (this module
touches no ``jax._src`` name itself), or, where one is missing, the public
``jax.device_put`` and ``jax.dlpack.from_dlpack``: a missing name costs speed,
never correctness.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _core
from . import _jax_hooks as hooks
from ._buffer import aligned_array
from ._spec import PACKED_IN_XLA, X64_DTYPES

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


def _public_put(x: Any, aval: Any, sharding: Any, committed: bool) -> jax.Array:
    """``jax.device_put`` on a pool thread, as the caller's call would place it:
    a 64-bit leaf stays 64-bit though the caller's ``jax.enable_x64`` context
    (thread-local) is not active here; uncommitted lands uncommitted, on the
    leaf's device (the caller's ``jax.default_device``, also thread-local)."""
    if committed:
        target = sharding
        place = contextlib.nullcontext()
    else:
        target = None
        place = jax.default_device(next(iter(sharding.device_set)))
    with place:
        if aval.dtype in X64_DTYPES:
            with jax.enable_x64(True):
                return jax.device_put(x, target, may_alias=True)
        return jax.device_put(x, target, may_alias=True)


def put_host(host: np.ndarray, aval: Any, sharding: Any, committed: bool, alias: bool) -> jax.Array:
    """Hands a numpy array of the leaf's dtype to JAX with ``sharding``.

    ``alias=True`` lets XLA's CPU client use the memory in place (it does when
    the array is 64-byte aligned and C-contiguous): only for memory nothing else
    will write. Otherwise JAX copies it during the call, once; always for the
    types XLA packs (int4, float4...), whose numpy layout is not XLA's.
    """
    alias = alias and aval.dtype not in PACKED_IN_XLA
    if hooks.xla_put is None:
        return _public_put(host if alias else np.array(host, copy=True), aval, sharding, committed)
    devices, indices = _placement(sharding, aval.shape)
    if indices is None:
        return put_shards([host] * len(devices), devices, aval, sharding, committed, alias)
    views: dict[tuple[Any, ...], np.ndarray] = {}
    shards = [views.setdefault(index_key(i), host[i]) for i in indices]  # one per index
    return put_shards(shards, devices, aval, sharding, committed, False)


def copier(sharding: Any) -> Callable[[np.ndarray, Any, bool], jax.Array] | None:
    """A per-leaf hand-off for many leaves on ``sharding``: ``copy(host, aval,
    committed)`` copies a C-contiguous numpy array of exactly the aval's shape
    and dtype into a ``jax.Array`` during the call (as :func:`put_host` with
    ``alias=False``), with none of :func:`put_host`'s per-leaf checks. None
    when ``sharding`` is not one device's, or without the private hand-off."""
    if hooks.xla_put is None or len(sharding.device_set) != 1:
        return None
    put, _, copy_during_call = hooks.xla_put
    devices, _ = _placement(sharding, ())

    def copy(host: np.ndarray, aval: Any, committed: bool) -> jax.Array:
        return put(aval, sharding, [host], devices, committed, False, copy_during_call)

    return copy


def index_key(index: tuple[slice, ...]) -> tuple[Any, ...]:
    """A hashable key of a shard index (slices hash only from Python 3.12)."""
    return tuple((s.start, s.stop, s.step) for s in index)


def put_shards(
    shards: list[np.ndarray],
    devices: list[Any],
    aval: Any,
    sharding: Any,
    committed: bool,
    alias: bool,
) -> jax.Array:
    """One ``jax.Array`` from host shards: ``shards[k]`` (of the leaf's dtype,
    its index's shape) goes to ``devices[k]``; the same shard may go to
    several devices (a partially replicated sharding).

    ``alias=True``: the shards are memory nothing else will write (XLA's CPU
    client may use it in place); otherwise each is copied during the call, as
    always for the types XLA packs.
    """
    alias = alias and aval.dtype not in PACKED_IN_XLA
    if hooks.xla_put is None:
        arrays = [
            jax.device_put(shard if alias else np.array(shard, copy=True), d, may_alias=True)
            for shard, d in zip(shards, devices, strict=True)
        ]
        if len(arrays) == 1 and len(sharding.device_set) == 1 and not committed:
            return _public_put(np.asarray(arrays[0]), aval, sharding, committed)
        return jax.make_array_from_single_device_arrays(aval.shape, sharding, arrays)
    put, zero_copy, copy_during_call = hooks.xla_put
    repeated = len({id(x) for x in shards}) < len(shards)
    if not alias and repeated and not sharding.is_fully_replicated:
        # jaxlib's copy-during-call put fails with "bad_function_call" when
        # two devices of a partially replicated sharding get the same index:
        # copy each distinct shard once into memory of our own, then alias it.
        copies: dict[int, np.ndarray] = {}
        shards = [copies.setdefault(id(x), _own_copy(x)) for x in shards]
        alias = True
    semantics = zero_copy if alias else copy_during_call
    return put(aval, sharding, shards, devices, committed, False, semantics)


def _own_copy(x: np.ndarray) -> np.ndarray:
    out = aligned_array(x.shape, x.dtype)
    np.copyto(out, x)
    return out


def put_dlpack(buf: Any, aval: Any, sharding: Any, committed: bool) -> jax.Array:
    """Hands a CPU DLPack producer (a ``HostBuffer``) of the leaf's dtype and
    shape to JAX without a copy, on ``sharding``'s single CPU device.

    The same path as ``jax.dlpack.from_dlpack(buf, copy=False)``, minus its
    per-call Python overhead (several times the cost of the hand-off itself).
    """
    if hooks.dlpack_import is None or hooks.ArrayImpl is None:
        if committed:
            device = next(iter(sharding.device_set))
            try:
                return jax.dlpack.from_dlpack(_HandOff(buf), device, copy=False)
            except ValueError:  # a CPU device other than the one DLPack's memory is on
                return _public_put(np.asarray(buf), aval, sharding, committed)
        # jax.dlpack.from_dlpack commits; device_put without a target does not,
        # and aliases the aligned memory (the buffer refuses writers from now on).
        return _public_put(np.asarray(buf), aval, sharding, committed)
    to_buffer, nargs = hooks.dlpack_import
    (device,) = sharding.device_set
    capsule = buf.jax_capsule()
    args = (capsule, device, None, False, _core.DLPACK_CPU)[:nargs]
    array = to_buffer(*args)
    return hooks.ArrayImpl(aval, sharding, [array], committed=committed, _skip_checks=True)


class _HandOff:
    """A ``HostBuffer`` as ``jax.dlpack.from_dlpack`` reads it for the hand-off:
    its ``jax_capsule``, which a buffer exported before still gives (JAX never
    writes), where its ``__dlpack__`` refuses a legacy consumer then."""

    __slots__ = ("_buf",)

    def __init__(self, buf: Any) -> None:
        self._buf = buf

    def __dlpack__(self, **_: Any) -> Any:
        return self._buf.jax_capsule()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._buf.__dlpack_device__()


def put_array(array: jax.Array, aval: Any, sharding: Any, committed: bool) -> jax.Array:
    """Re-labels a single-device ``jax.Array`` already on ``sharding``'s
    device with the leaf's aval and commitment (no copy)."""
    if hooks.pxla_put is None:
        if committed or not array.committed:
            return array
        # Uncommitted: JAX has no public way to drop a commitment in place.
        return _public_put(np.asarray(array), aval, sharding, committed)
    return hooks.pxla_put(aval, sharding, [array], list(sharding.device_set), committed)
