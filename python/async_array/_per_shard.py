"""The per-shard engine that ``aa.make_array_from_callback``,
``aa.async_map(..., per_shard=True)`` and ``load_safetensors`` share: shard
layouts, shard checks, and :func:`submit_per_shard`.

Each leaf's sharding is split into the distinct indices this process's
devices hold (a replicated shard is read once); one pool task runs per leaf and
index, all submitted at once; the task that finishes a leaf's last shard puts
every shard on every local device holding its index, in one hand-off.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _core, _handoff
from ._array import AsyncArray
from ._buffer import aligned_array
from ._convert import check_cast, copy_checked, host_array
from ._core import HostBuffer
from ._errors import frames_freed, free_frames, invalid, is_invalid, reworded
from ._leaves import one_source_a_leaf
from ._runtime import jax_work
from ._spec import LeafSpecs, Sharding, is_extended

_index_key = _handoff.index_key


class Layout(NamedTuple):
    """Where one sharding puts an array of one shape, on this process.

    ``indices[k]`` is a distinct index (a tuple of slices, as
    ``jax.make_array_from_callback`` passes it), ``shapes[k]`` its shard's
    shape, ``holders[k]`` the local devices holding it; ``devices`` and
    ``slots`` list every local device and the index it holds.
    """

    indices: list[tuple[slice, ...]]
    shapes: list[tuple[int, ...]]
    holders: list[list[Any]]
    devices: list[Any]
    slots: list[int]


# By (sharding, shape); the sharding is kept in the value so its id is not reused.
_layouts: dict[tuple[int, tuple[int, ...]], tuple[Sharding, Layout]] = {}


def layout(sharding: Sharding, shape: tuple[int, ...]) -> Layout:
    """The distinct addressable indices of ``sharding`` for ``shape``."""
    key = (id(sharding), shape)
    found = _layouts.get(key)
    if found is not None:
        return found[1]
    by_key: dict[tuple[Any, ...], int] = {}
    indices: list[tuple[slice, ...]] = []
    holders: list[list[Any]] = []
    devices: list[Any] = []
    slots: list[int] = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        index = tuple(index)  # type: ignore[arg-type]  # never None for an addressable device
        k = by_key.get(_index_key(index))
        if k is None:
            k = by_key[_index_key(index)] = len(indices)
            indices.append(index)
            holders.append([])
        holders[k].append(device)
        devices.append(device)
        slots.append(k)
    shapes = [
        tuple(len(range(*s.indices(dim))) for s, dim in zip(index, shape, strict=True))
        for index in indices
    ]
    out = Layout(indices, shapes, holders, devices, slots)
    if len(_layouts) < 4096:
        _layouts[key] = (sharding, out)
    return out


def index_text(index: tuple[slice, ...]) -> str:
    """An index as numpy writes it: ``[0:4, :]``."""

    def one(s: slice) -> str:
        if s.start is None and s.stop is None and s.step is None:
            return ":"
        text = f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"
        return text if s.step is None else f"{text}:{s.step}"

    return f"[{', '.join(one(s) for s in index)}]"


def _shard_where(state: _LeafShards, k: int) -> str:
    lay = state.layout
    devices = ", ".join(str(d) for d in lay.holders[k])
    return f"{state.specs.where(state.leaf)} shard {index_text(lay.indices[k])} (devices {devices})"


def shard_host(value: Any, shape: tuple[int, ...], dtype: np.dtype, where: str) -> np.ndarray:
    """One shard's result as host memory that nothing else writes: a
    ``HostBuffer``'s own memory (no copy; it refuses new writable views from
    now on), else one checked copy into aligned memory.

    Raises:
      ValueError: the shape is not the index's.
      TypeError: a cast across kinds, or not an array at all.
      OverflowError: a value that does not fit ``dtype``.
    """
    if is_extended(dtype):
        # A PRNG key shard: a jax.Array of that dtype, placed as it is.
        if isinstance(value, AsyncArray):
            value = value.result()
        if not isinstance(value, jax.Array) or value.dtype != dtype:
            got = f"dtype {value.dtype}" if isinstance(value, jax.Array) else type(value).__name__
            raise invalid(TypeError, f"{where}: expected a jax.Array of dtype {dtype}, got {got}")
        if value.shape != shape:
            raise invalid(ValueError, f"{where}: expected shape {shape}, got {value.shape}")
        return value  # type: ignore[return-value]
    if type(value) is HostBuffer and value.shape == shape and value.dtype == dtype:
        host = np.asarray(value)
        value.mark_exported()
        return host
    if isinstance(value, AsyncArray):
        value = value.result()
    if isinstance(value, jax.Array):
        value = np.asarray(value)
    host = host_array(value, where)
    if host.shape != shape:
        raise invalid(ValueError, f"{where}: expected shape {shape}, got {host.shape}")
    check_cast(host.dtype, dtype, where)
    staged = aligned_array(shape, dtype)
    copy_checked(host, staged, where)
    return staged


class _LeafShards:
    """One leaf's shards as they arrive; the task that brings the last one
    makes the leaf's ``jax.Array``."""

    __slots__ = (
        "device_layout",
        "future",
        "layout",
        "leaf",
        "lock",
        "path",
        "remaining",
        "shards",
        "spec",
        "specs",
    )

    def __init__(
        self, specs: LeafSpecs, leaf: int, path: Any, lay: Layout, device_layout: Any = None
    ) -> None:
        self.specs = specs
        self.device_layout = device_layout
        self.leaf = leaf
        self.path = path
        self.layout = lay
        aval, sharding = specs.avals[leaf], specs.shardings[leaf]
        self.spec = jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
        self.future = _core.Future()
        self.shards: list[np.ndarray | None] = [None] * len(lay.indices)
        self.remaining = len(lay.indices)
        self.lock = threading.Lock()

    def assemble(self) -> jax.Array:
        specs, i, lay = self.specs, self.leaf, self.layout
        shards: list[np.ndarray] = []
        for k in lay.slots:
            shard = self.shards[k]
            assert shard is not None  # assembled after its last shard
            shards.append(shard)
        self.shards = []
        aval = specs.avals[i]
        if is_extended(aval.dtype):  # jax.Array shards (PRNG keys): JAX's own assembly
            arrays = [jax.device_put(s, d) for s, d in zip(shards, lay.devices, strict=True)]
            return jax.make_array_from_single_device_arrays(aval.shape, specs.shardings[i], arrays)
        array: Any = _handoff.put_shards(  # Any: .format is not in JAX's stubs of jax.Array
            shards, lay.devices, aval, specs.shardings[i], specs.committed[i], True
        )
        wanted = self.device_layout
        if wanted is not None and lay.indices and array.format.layout != wanted:
            # A pending leaf declares no layout, so jax.jit compiles for the
            # default one: a leaf of another layout would reach it unchanged.
            raise TypeError(
                f"{specs.where(i)}: a device-local layout other than the default one "
                f"is not supported yet: asked for {wanted}, the default is "
                f"{array.format.layout}"
            )
        return array


def _fail(state: _LeafShards, k: int, exc: BaseException) -> None:
    if is_invalid(exc):
        # Raised by validation, worded ": ...": name the shard in front.
        exc = reworded(exc, f"{_shard_where(state, k)}: ", str(exc).removeprefix(": "))
    else:
        exc.add_note(f"async_array: raised for {_shard_where(state, k)}")
        free_frames(exc)
    state.shards = []  # the leaf failed: free what its other shards brought
    state.future.set_exception(exc)


def _run_shard(fn: Callable[..., Any], state: _LeafShards, k: int) -> None:
    fut = state.future
    if fut.done():  # another shard failed, or the leaf was cancelled
        return
    index = state.layout.indices[k]
    try:
        with frames_freed:
            value = fn(state.path, state.spec, index)
    except BaseException as exc:
        _fail(state, k, exc)
        return
    try:
        with jax_work, state.specs.context:
            aval = state.specs.avals[state.leaf]
            host = shard_host(value, state.layout.shapes[k], aval.dtype, "")
    except Exception as exc:
        _fail(state, k, exc)
        return
    del value
    with state.lock:
        if fut.done():
            return
        state.shards[k] = host
        state.remaining -= 1
        last = state.remaining == 0
    del host
    if not last:
        return
    try:
        with jax_work, state.specs.context:
            array = state.assemble()
    except BaseException as exc:
        exc.add_note(f"async_array: while placing {state.specs.where(state.leaf)}")
        fut.set_exception(free_frames(exc))
        return
    fut.set_result([array])


def _cancel_leaf_if_cancelled(state: _LeafShards, task: _core.Future) -> None:
    # A shard task cancelled (at interpreter exit): its leaf must not wait forever.
    if task.cancelled():
        state.future.cancel()


def submit_per_shard(
    fn: Callable[..., Any], specs: LeafSpecs, paths: list[Any], device_layout: Any = None
) -> list[AsyncArray]:
    """Submits ``fn(path, spec, index)`` for every leaf of ``specs`` and every
    distinct index its sharding gives this process, in one submission; returns
    the leaves in order. ``device_layout``: the ``jax.experimental.layout.Layout``
    asked of every shard on its device (None: the default); a leaf placed with
    another fails (only the default one is supported)."""
    states = []
    args: list[tuple[Any, ...]] = []
    for i, path in enumerate(paths):
        lay = layout(specs.shardings[i], specs.avals[i].shape)
        state = _LeafShards(specs, i, path, lay, device_layout)
        states.append(state)
        args.extend((fn, state, k) for k in range(len(lay.indices)))
    for state in states:
        if not state.layout.indices:  # no device of this process holds any of it
            try:
                state.future.set_result([state.assemble()])
            except Exception as exc:
                state.future.set_exception(exc)
    tasks = _core.submit_many(_run_shard, args)
    for (_, state, _), task in zip(args, tasks, strict=True):
        task.add_done_callback(functools.partial(_cancel_leaf_if_cancelled, state))
    return one_source_a_leaf(specs, [state.future for state in states])
