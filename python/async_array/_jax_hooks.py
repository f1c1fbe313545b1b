"""The only module that touches ``jax._src``.

``jax.jit`` accepts an :class:`~async_array.AsyncArray` argument and compiles
from its shape and dtype before the value exists because of three registrations,
the same ones JAX makes for its own ``EArray`` (``jax/_src/earray.py``):

* ``core.pytype_aval_mappings``: the aval of a leaf is known without waiting,
  so tracing, lowering and compiling never block;
* ``dtypes.register_canonicalize_value_handler`` (``canonicalize_value_handlers``
  on JAX 0.10.0 and 0.10.1): the leaf passes unchanged while arguments are
  canonicalized;
* ``pxla.shard_arg_handlers`` with ``pxla.shard_args``: at dispatch, every
  ``AsyncArray`` argument of one call is resolved in one GIL-free wait, then
  handed on as a ``jax.Array``.

Two public entry points take leaves through wrappers put in place of JAX's
functions: ``jax.device_put`` (JAX's ``dispatch._batched_device_put_impl``,
which it looks up at each call) and ``jax.make_array_from_single_device_arrays``.
Each resolves the leaves of one call in one wait and calls JAX's own function
with their values; any other argument reaches JAX's function untouched.

Also here: the per-leaf hand-off to JAX (``xla_client.batched_device_put``,
DLPack's ``dlpack_managed_tensor_to_buffer`` and ``ArrayImpl``, about 10x
cheaper per leaf than ``jax.device_put`` and ``jax.dlpack.from_dlpack``).

JAX moves its private names without notice, so each one is detected once, at
import, by what it is: the name exists and takes the arguments this module
passes. No version number is consulted. A missing hand-off name costs speed
only: the public ``jax.device_put`` and ``jax.dlpack.from_dlpack`` take over.
A missing registration turns the ``jax.jit`` integration off: :data:`ERROR`
says which name is missing, ``jax.jit`` on an ``AsyncArray`` raises it, and the
public route (``aa.jit``, ``aa.materialize``, ``jax.block_until_ready``) still
works. ``ASYNC_ARRAY_DISABLE_JAX_HOOKS=1`` turns every hook off, or a
comma-separated list of the names in :data:`HOOKS` turns those off.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, MutableMapping
from typing import Any

import jax
import numpy as np

from . import _core

ENV_DISABLE = "ASYNC_ARRAY_DISABLE_JAX_HOOKS"

#: Every private name used here: what it is for, and whether ``jax.jit`` on an
#: ``AsyncArray`` needs it (the others have a public stand-in, or give up one
#: convenience: ``jax.device_put`` of a committed leaf then lands uncommitted
#: on the default device, and ``jax.make_array_from_single_device_arrays``
#: refuses leaves).
HOOKS: dict[str, tuple[str, bool]] = {
    "core.pytype_aval_mappings": ("a leaf's aval without waiting", True),
    "dtypes.canonicalize_value_handler": ("leaves pass argument canonicalization", True),
    "pxla.shard_arg_handlers": ("one wait per dispatch", True),
    "pxla.shard_args": ("handing resolved leaves to dispatch", True),
    "xla_client.batched_device_put": ("speed: the per-leaf host hand-off", False),
    "dlpack_managed_tensor_to_buffer": ("speed: the zero-copy HostBuffer hand-off", False),
    "array.ArrayImpl": ("speed: building a jax.Array from a DLPack buffer", False),
    "pxla.batched_device_put": ("speed: re-labelling a loader's jax.Array", False),
    "dispatch._batched_device_put_impl": (
        "jax.device_put of a leaf places its value (a committed leaf stays committed)",
        False,
    ),
    "array.make_array_from_single_device_arrays": (
        "AsyncArray shards for jax.make_array_from_single_device_arrays",
        False,
    ),
    "distributed.global_state": ("telling other jax.distributed processes of a failure", False),
}

#: Why each hook is not in use, by name; empty when all are.
MISSING: dict[str, str] = {}

_PUBLIC_ROUTE = (
    "Use the public route instead: aa.jit(fun)(x) compiles while x loads and "
    "dispatches when it is ready, and aa.materialize(tree) waits and returns jax.Arrays."
)


def params_of(fn: Any) -> tuple[int, int] | None:
    """(required, total) positional parameters of ``fn``, from
    ``inspect.signature`` or, for nanobind functions (jaxlib's C++), from their
    ``__nb_signature__`` text; None when neither tells."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        positional = [
            p
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
            return sum(p.default is p.empty for p in positional), 1 << 30
        return sum(p.default is p.empty for p in positional), len(positional)
    text = getattr(fn, "__nb_signature__", None)
    if not text:
        return None
    head = text[0][0]
    inner = head[head.index("(") + 1 : head.rindex(")")]
    # Split at top-level commas only (annotations hold brackets).
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    names = [p.strip() for p in parts if p.strip() and p.strip() not in ("/", "*")]
    if any(p.startswith("*") for p in names):
        names = names[: next(i for i, p in enumerate(names) if p.startswith("*"))]
    return sum("=" not in p for p in names), len(names)


def takes(fn: Any, nargs: int) -> bool:
    """Whether ``fn`` is callable with ``nargs`` positional arguments (True
    when its signature cannot be read: it is then tried as it is)."""
    if not callable(fn):
        return False
    found = params_of(fn)
    return found is None or found[0] <= nargs <= found[1]


def _disabled() -> set[str]:
    raw = os.environ.get(ENV_DISABLE, "").strip()
    if raw in ("", "0"):
        return set()
    if raw == "1":
        return set(HOOKS)
    names = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = names - set(HOOKS)
    if unknown:
        raise ValueError(
            f"{ENV_DISABLE}: unknown hook names {sorted(unknown)}; use 1 (all) or some of "
            f"{sorted(HOOKS)}"
        )
    return names


_DISABLED = _disabled()


def _find(name: str, get: Callable[[], Any], check: Callable[[Any], bool] | None = None) -> Any:
    """The hook ``name`` (``get()``), or None with the reason in :data:`MISSING`."""
    if name in _DISABLED:
        MISSING[name] = f"turned off by {ENV_DISABLE}"
        return None
    try:
        found = get()
    except (ImportError, AttributeError) as exc:
        MISSING[name] = f"not in this JAX ({exc})"
        return None
    if check is not None and not check(found):
        MISSING[name] = "changed in this JAX: it no longer takes what async_array passes"
        return None
    return found


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"jax._src.{name}")


def _is_mapping(x: Any) -> bool:
    return isinstance(x, MutableMapping)


_aval_mappings = _find(
    "core.pytype_aval_mappings", lambda: _module("core").pytype_aval_mappings, _is_mapping
)


def _canonicalize_registrar() -> Callable[[type], None]:
    dtypes = _module("dtypes")
    register = getattr(dtypes, "register_canonicalize_value_handler", None)
    if register is not None:
        if not takes(register, 2):
            raise AttributeError("register_canonicalize_value_handler takes other arguments")
        return lambda t: register(t, None)
    handlers = dtypes.canonicalize_value_handlers  # JAX 0.10.0 and 0.10.1
    if not _is_mapping(handlers):
        raise AttributeError("canonicalize_value_handlers is not a mapping")
    return lambda t: handlers.__setitem__(t, lambda x: x)


_register_canonicalize = _find("dtypes.canonicalize_value_handler", _canonicalize_registrar)
_shard_arg_handlers = _find(
    "pxla.shard_arg_handlers", lambda: _module("interpreters.pxla").shard_arg_handlers, _is_mapping
)
_shard_args = _find(
    "pxla.shard_args", lambda: _module("interpreters.pxla").shard_args, lambda f: takes(f, 4)
)


def _xc_put() -> tuple[Callable[..., Any], Any, Any]:
    xc = _module("lib").xla_client
    semantics = xc.HostBufferSemantics
    return xc.batched_device_put, semantics.ZERO_COPY, semantics.IMMUTABLE_ONLY_DURING_CALL


_xc_batched = _find("xla_client.batched_device_put", _xc_put, lambda t: takes(t[0], 7))


def _dlpack_import() -> tuple[Callable[..., Any], int]:
    fn = _module("lib")._jax.dlpack_managed_tensor_to_buffer
    # (capsule, device, stream, copy), and from JAX 0.10.2 the DLPack device type.
    for nargs in (5, 4):
        if takes(fn, nargs):
            return fn, nargs
    raise AttributeError("dlpack_managed_tensor_to_buffer takes other arguments")


_dlpack = _find("dlpack_managed_tensor_to_buffer", _dlpack_import)
_ArrayImpl = _find(
    "array.ArrayImpl",
    lambda: _module("array").ArrayImpl,
    lambda c: isinstance(c, type) and issubclass(c, jax.Array),
)
_pxla_put = _find(
    "pxla.batched_device_put",
    lambda: _module("interpreters.pxla").batched_device_put,
    lambda f: takes(f, 5),
)


def _device_put_batch() -> Callable[..., Any]:
    fn = _module("dispatch")._batched_device_put_impl
    # jax.device_put must look it up on the module at each call, or a wrapper
    # put there would never be called.
    if "_batched_device_put_impl" not in _module("api").device_put.__code__.co_names:
        raise AttributeError("jax.device_put no longer calls dispatch._batched_device_put_impl")
    return fn


_batched_put = _find("dispatch._batched_device_put_impl", _device_put_batch, lambda f: takes(f, 1))


def _single_device_arrays() -> Callable[..., Any]:
    fn = _module("array").make_array_from_single_device_arrays
    if jax.make_array_from_single_device_arrays is not fn:
        raise AttributeError(
            "jax.make_array_from_single_device_arrays is not jax._src.array's (wrapped already?)"
        )
    return fn


_single_arrays = _find(
    "array.make_array_from_single_device_arrays", _single_device_arrays, lambda f: takes(f, 3)
)

_distributed = _find(
    "distributed.global_state",
    lambda: _module("distributed").global_state,
    lambda g: hasattr(g, "client"),
)


def distributed_client() -> Any:
    """The key-value store client of ``jax.distributed`` (``key_value_set``,
    ``blocking_key_value_get``, ``key_value_dir_get``), or None when this is
    not a multi-process job or the hook is missing."""
    return None if _distributed is None else _distributed.client


#: The hooks ``jax.jit`` needs that are missing, by name.
MISSING_JIT = [name for name, (_, needed) in HOOKS.items() if needed and name in MISSING]

#: Why ``jax.jit`` cannot take an ``AsyncArray`` here, or None when it can.
ERROR: str | None = None
if MISSING_JIT:
    ERROR = (
        f"this JAX ({jax.__version__}) lacks private hooks async_array needs for it: "
        + "; ".join(f"{name} ({MISSING[name]})" for name in MISSING_JIT)
        + ". "
        + _PUBLIC_ROUTE
    )


def active() -> bool:
    """Whether ``jax.jit``, ``jnp`` and the other JAX entry points take an
    ``AsyncArray`` directly (all the registrations they need were found)."""
    return ERROR is None


def hooks_error() -> RuntimeError:
    """The error to raise where JAX would need the missing hooks (a
    RuntimeError: JAX rewraps a TypeError raised while it reads an argument)."""
    return RuntimeError(f"jax.jit and jnp cannot take an AsyncArray directly: {ERROR}")


def install(array_type: type, resolve_all: Callable[..., list[Any]]) -> None:
    """Registers ``array_type`` with JAX; ``resolve_all(leaves, timeout,
    caller)`` waits once for all of them and returns their values, in order
    (``jax.Array`` for each ``array_type`` leaf, the others as they are)."""
    _wrap_device_put(array_type, resolve_all)
    _wrap_single_device_arrays(array_type, resolve_all)
    if ERROR is not None:
        return
    shard_args = _shard_args

    def shard_arg(xs, shardings, layouts, copy_semantics):
        return shard_args(shardings, layouts, copy_semantics, resolve_all(xs))

    _aval_mappings[array_type] = lambda x: x.aval
    _register_canonicalize(array_type)
    _shard_arg_handlers[array_type] = shard_arg


def _wrap_device_put(array_type: type, resolve_all: Callable[..., list[Any]]) -> None:
    """``jax.device_put`` of a leaf places its value, as for that ``jax.Array``.

    JAX tells a committed array by its concrete class (``ArrayImpl``); any
    other ``jax.Array``, a leaf among them, lands uncommitted on the default
    device when no device is given, wherever it was committed. The wrapper
    resolves every leaf of one ``device_put`` in one wait and hands JAX their
    values; everything else passes through unchanged.
    """
    original = _batched_put
    if original is None:
        return

    def batched_device_put(*xs: Any, **kwargs: Any) -> Any:
        if any(type(x) is array_type for x in xs):
            xs = tuple(resolve_all(xs, None, "jax.device_put"))
        return original(*xs, **kwargs)

    batched_device_put.__wrapped__ = original  # type: ignore[attr-defined]
    _module("dispatch")._batched_device_put_impl = batched_device_put


def _wrap_single_device_arrays(array_type: type, resolve_all: Callable[..., list[Any]]) -> None:
    """``jax.make_array_from_single_device_arrays`` takes leaves as shards: it
    waits for them (one wait for all) and uses their values; JAX checks them
    as it checks ``jax.Array`` shards. Other arguments pass through unchanged."""
    original = _single_arrays
    if original is None:
        return

    def make_array_from_single_device_arrays(
        shape: Any, sharding: Any, arrays: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if isinstance(arrays, (list, tuple)) and any(type(a) is array_type for a in arrays):
            arrays = resolve_all(arrays, None, "jax.make_array_from_single_device_arrays")
        return original(shape, sharding, arrays, *args, **kwargs)

    functools.update_wrapper(make_array_from_single_device_arrays, original)
    _module("array").make_array_from_single_device_arrays = make_array_from_single_device_arrays
    jax.make_array_from_single_device_arrays = make_array_from_single_device_arrays


def array_type() -> type:
    """The concrete ``jax.Array`` class whose methods an ``AsyncArray``
    forwards, without starting a backend (making an array would, and would fix
    the platform at import); the abstract ``jax.Array`` where it is missing."""
    return _ArrayImpl if _ArrayImpl is not None else jax.Array


def shaped_array(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The (never weakly typed) aval of a leaf."""
    return jax.core.ShapedArray(shape, dtype, weak_type=False)


_X64_DTYPES = frozenset(map(np.dtype, ("int64", "uint64", "float64", "complex128")))


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
        if aval.dtype in _X64_DTYPES:
            with jax.enable_x64(True):
                return jax.device_put(x, target, may_alias=True)
        return jax.device_put(x, target, may_alias=True)


def put_host(host: np.ndarray, aval: Any, sharding: Any, committed: bool, alias: bool) -> jax.Array:
    """Hands a numpy array of the leaf's dtype to JAX with ``sharding``.

    ``alias=True`` lets XLA's CPU client use the memory in place (it does when
    the array is 64-byte aligned and C-contiguous): only for memory nothing else
    will write. Otherwise JAX copies it during the call, once.
    """
    if _xc_batched is None:
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
    if _xc_batched is None or len(sharding.device_set) != 1:
        return None
    put, _, copy_during_call = _xc_batched
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
    client may use it in place); otherwise each is copied during the call.
    """
    if _xc_batched is None:
        arrays = [
            jax.device_put(shard if alias else np.array(shard, copy=True), d, may_alias=True)
            for shard, d in zip(shards, devices, strict=True)
        ]
        if len(arrays) == 1 and len(sharding.device_set) == 1 and not committed:
            return _public_put(np.asarray(arrays[0]), aval, sharding, committed)
        return jax.make_array_from_single_device_arrays(aval.shape, sharding, arrays)
    put, zero_copy, copy_during_call = _xc_batched
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
    from ._buffer import aligned_array

    out = aligned_array(x.shape, x.dtype)
    np.copyto(out, x)
    return out


def put_dlpack(buf: Any, aval: Any, sharding: Any, committed: bool) -> jax.Array:
    """Hands a CPU DLPack producer (a ``HostBuffer``) of the leaf's dtype and
    shape to JAX without a copy, on ``sharding``'s single CPU device.

    The same path as ``jax.dlpack.from_dlpack(buf, copy=False)``, minus its
    per-call Python overhead (several times the cost of the hand-off itself).
    """
    if _dlpack is None or _ArrayImpl is None:
        if committed:
            device = next(iter(sharding.device_set))
            try:
                return jax.dlpack.from_dlpack(_HandOff(buf), device, copy=False)
            except ValueError:  # a CPU device other than the one DLPack's memory is on
                return _public_put(np.asarray(buf), aval, sharding, committed)
        # jax.dlpack.from_dlpack commits; device_put without a target does not,
        # and aliases the aligned memory (the buffer refuses writers from now on).
        return _public_put(np.asarray(buf), aval, sharding, committed)
    to_buffer, nargs = _dlpack
    (device,) = sharding.device_set
    capsule = buf.jax_capsule()
    args = (capsule, device, None, False, _core.DLPACK_CPU)[:nargs]
    array = to_buffer(*args)
    return _ArrayImpl(aval, sharding, [array], committed=committed, _skip_checks=True)


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
    if _pxla_put is None:
        if committed or not array.committed:
            return array
        # Uncommitted: JAX has no public way to drop a commitment in place.
        return _public_put(np.asarray(array), aval, sharding, committed)
    return _pxla_put(aval, sharding, [array], list(sharding.device_set), committed)
