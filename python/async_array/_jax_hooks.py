"""The only module that touches ``jax._src``: it finds and registers JAX's private hooks.

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

Also found here, for ``_handoff`` (the per-leaf hand-off to JAX):
``xla_client.batched_device_put``, DLPack's ``dlpack_managed_tensor_to_buffer``
and ``ArrayImpl``, about 10x cheaper per leaf than ``jax.device_put`` and
``jax.dlpack.from_dlpack``. ``_handoff`` uses what this module found and
imports nothing of ``jax._src`` itself.

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

import functools
import os
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

import jax
import numpy as np

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
    "core.update_aval_with_sharding": (
        "a leaf's aval carries its sharding (mesh, spec, axis types), as a jax.Array's does",
        False,
    ),
    "config.Config": (
        "a call's thread-local JAX settings (jax.default_device, jax.set_mesh, "
        "jax.enable_x64, ...) in force on the pool threads that do its work",
        False,
    ),
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


# Found here for _handoff, which uses them (None: missing; the public route then).
xla_put = _find("xla_client.batched_device_put", _xc_put, lambda t: takes(t[0], 7))


def _dlpack_import() -> tuple[Callable[..., Any], int]:
    fn = _module("lib")._jax.dlpack_managed_tensor_to_buffer
    # (capsule, device, stream, copy), and from JAX 0.10.2 the DLPack device type.
    for nargs in (5, 4):
        if takes(fn, nargs):
            return fn, nargs
    raise AttributeError("dlpack_managed_tensor_to_buffer takes other arguments")


dlpack_import = _find("dlpack_managed_tensor_to_buffer", _dlpack_import)
ArrayImpl = _find(
    "array.ArrayImpl",
    lambda: _module("array").ArrayImpl,
    lambda c: isinstance(c, type) and issubclass(c, jax.Array),
)
pxla_put = _find(
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


def _thread_local_settings() -> tuple[Callable[[], list[Any]], Any, Any]:
    """A function listing every thread-local JAX setting, the value a
    setting has where no context sets it, and the registry the listing reads. JAX's own list: every
    ``config_ext.Config`` object of ``jax._src.config`` (the mesh contexts
    among them) and every flag in its ``config_states`` registry."""
    config = _module("config")
    ext = config.config_ext
    kind, unset = ext.Config, ext.unset
    for method in ("get_local", "swap_local", "set_local"):
        if not callable(getattr(kind, method, None)):
            raise AttributeError(f"config_ext.Config has no {method}")
    registry = config.config_states
    if not _is_mapping(registry):
        raise AttributeError("config.config_states is not a mapping")
    own = [v for v in vars(config).values() if isinstance(v, kind)]

    def settings() -> list[Any]:
        # Flags defined after this import (by other JAX modules) join the registry.
        return list({id(v): v for v in [*own, *registry.values()] if isinstance(v, kind)}.values())

    return settings, unset, registry


_settings = _find("config.Config", _thread_local_settings)
_all_settings: list[Any] = []
_registry_size = -1


class JaxContext:
    """The thread-local JAX settings in force on one thread when it was
    captured (:func:`thread_context`); ``with context:`` puts them in force
    on another thread for the block, then restores that thread's own.
    ``key`` is hashable: calls compiled under different settings must not
    share a program."""

    __slots__ = ("key", "values")

    def __init__(self, values: tuple[tuple[Any, Any], ...]) -> None:
        self.values = values
        key = tuple(
            (setting.name if hasattr(setting, "name") else id(setting), value)
            for setting, value in values
        )
        try:
            hash(key)
        except TypeError:
            key = tuple((name, id(value)) for name, value in key)
        self.key = key

    def __enter__(self) -> None:
        if not self.values:
            return
        swapped = []
        for setting, value in self.values:
            swapped.append((setting, setting.swap_local(value)))
            hook = getattr(setting, "_update_thread_local_hook", None)
            if hook is not None:
                hook(value)
        _restore.stack = [*getattr(_restore, "stack", []), swapped]

    def __exit__(self, *exc: object) -> None:
        if not self.values:
            return
        stack = _restore.stack
        swapped = stack.pop()
        for setting, previous in reversed(swapped):
            setting.set_local(previous)
            hook = getattr(setting, "_update_thread_local_hook", None)
            if hook is not None:
                hook(None if previous is _unset else previous)


_restore = threading.local()
_unset: Any = None if _settings is None else _settings[1]
NO_CONTEXT = JaxContext(())


def thread_context() -> JaxContext:
    """The thread-local JAX settings in force on this thread (``with
    jax.default_device(...)``, ``jax.set_mesh``, ``jax.enable_x64``,
    ``jax.default_matmul_precision``, ``jax.numpy_rank_promotion``, and any
    other), for the pool threads that do this call's work. About 10 µs."""
    global _all_settings, _registry_size
    if _settings is None:
        return NO_CONTEXT
    listing, unset, registry = _settings
    size = len(registry)
    if size != _registry_size:
        _all_settings, _registry_size = listing(), size
    values = []
    for setting in _all_settings:
        value = setting.get_local()
        if value is not unset:
            values.append((setting, value))
    return JaxContext(tuple(values)) if values else NO_CONTEXT


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
    return ArrayImpl if ArrayImpl is not None else jax.Array


_update_aval = _find(
    "core.update_aval_with_sharding",
    lambda: _module("core").update_aval_with_sharding,
    lambda f: takes(f, 2),
)


def aval_with_sharding(aval: Any, sharding: Any) -> Any:
    """``aval`` as JAX types an array of ``sharding`` (JAX's
    ``update_aval_with_sharding``: a ``NamedSharding`` puts its mesh and spec
    in the type, ``float32[8@x,2]``); ``aval`` itself where the hook is missing."""
    return aval if _update_aval is None else _update_aval(aval, sharding)


def shaped_array(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The (never weakly typed) aval of a leaf."""
    return jax.core.ShapedArray(shape, dtype, weak_type=False)
