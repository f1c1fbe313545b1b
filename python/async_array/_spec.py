"""What a producer promises before anything runs: each leaf's shape, dtype and
sharding, validated at the call.

The one shape validator (``async_wrap``'s ``shape=``, ``like`` leaves,
``aa.empty``), JAX's dtype canonicalization, shardings, and how messages name
a call and a leaf.
"""

from __future__ import annotations

import functools
import math
import operator
import sys
import warnings
from types import FrameType
from typing import Any

import jax
import ml_dtypes
import numpy as np

from . import _core, _jax_hooks
from ._errors import reworded

Sharding = jax.sharding.Sharding


def qualname(f: Any) -> str:
    """How messages name a callable."""
    if isinstance(f, functools.partial):
        return f"partial({qualname(f.func)})"
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__qualname__


def where(name: str, key_path: str) -> str:
    """How a message names a leaf: ``async_wrap(load) leaf ['w']``, or
    ``async_wrap(load) result`` for a call with a single leaf (no key path)."""
    return f"{name} leaf {key_path}" if key_path else f"{name} result"


_INT64_MAX = 2**63 - 1


def shape_tuple(shape: Any, where: str) -> tuple[int, ...]:
    """``shape`` (an integer, or an iterable of them) as a tuple of ints.

    Raises:
      TypeError: not an integer nor an iterable of integers.
      ValueError: a negative dimension, or more elements than an int64
        counts (XLA's limit).
    """
    try:
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    except TypeError:
        raise TypeError(
            f"{where}: shape must be an integer or a tuple of integers, got {shape!r}"
        ) from None
    try:
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(f"{where}: shape must be a tuple of integers, got {shape!r}") from None
    if any(d < 0 for d in out):
        raise ValueError(f"{where}: negative dimension in shape {out}")
    if math.prod(out) > _INT64_MAX or any(d > _INT64_MAX for d in out):
        raise ValueError(
            f"{where}: shape {out} has more elements than an int64 counts (XLA's limit)"
        )
    return out


def timeout_seconds(timeout: Any, caller: str, *, positive: bool = False) -> float | None:
    """``timeout`` as seconds (a float), or None (no limit): the one parser of
    a timeout argument in the package.

    For a wait (``positive=False``) a negative number counts as zero, as in
    ``concurrent.futures``. For a request (``positive=True``, as the core's
    readers take it) the number must be above zero.

    Raises:
      TypeError: not a real number nor None (naming ``caller``).
      ValueError: NaN; with ``positive``, a number not above zero.
    """
    if timeout is None:
        return None
    what = "a positive number" if positive else "a number"
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{caller}: timeout must be {what} of seconds or None, got "
            f"{type(timeout).__name__} {timeout!r:.40}"
        )
    t = float(timeout)
    if positive:
        if not t > 0:  # NaN too
            raise ValueError(
                f"{caller}: timeout must be {what} of seconds or None, got {timeout!r}"
            )
        return t
    if t != t:
        raise ValueError(f"{caller}: timeout must be {what} of seconds or None, got nan")
    return max(t, 0.0)


def outside_package_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at
    the first frame outside async_array: the user's line."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("async_array"):
        frame, level = frame.f_back, level + 1
    return level


#: The 64-bit dtypes, which JAX narrows to 32 bits while x64 is off.
X64_DTYPES = frozenset(map(np.dtype, ("int64", "uint64", "float64", "complex128")))


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name as numpy or ml_dtypes spell it
    (``float32``; ``bfloat16`` and the float8 kinds from ml_dtypes, as in JAX).

    Raises:
      TypeError: not a dtype name.
    """
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


#: The one-byte ml_dtypes types JAX takes only by a copy (XLA packs them, two
#: or more to a byte): a ``HostBuffer`` holds them, but neither DLPack nor an
#: aliased numpy array carries them to JAX.
PACKED_IN_XLA = frozenset(map(numpy_dtype, _core.BYTE_TYPES_WITHOUT_DLPACK))


def numeric_kind(dtype: np.dtype) -> str:
    """numpy's kind letter (``b``, ``i``, ``u``, ``f``, ``c``), also for the
    ml_dtypes types, which numpy calls ``V`` (most) or ``f``: ``f`` for
    bfloat16 and the float8/float6/float4 kinds, ``i`` for int2 and int4,
    ``u`` for uint2 and uint4."""
    if dtype.kind != "V":
        return dtype.kind
    if dtype.name.startswith("int"):
        return "i"
    return "u" if dtype.name.startswith("uint") else "f"


def canonical_dtype(dtype: np.dtype, fun_name: str) -> np.dtype:
    """``dtype`` as JAX makes an explicitly requested one: with x64 off, a
    64-bit dtype narrows to its 32-bit kind, with JAX's own warning pointing at
    the user's line (or JAX's error, or no change, as
    ``jax_explicit_x64_dtypes`` says).

    Raises:
      ValueError: the dtype is not available and ``jax_explicit_x64_dtypes``
        is ``error``.
    """
    out = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if out == dtype:
        return out
    mode = getattr(jax.config, "jax_explicit_x64_dtypes", "warn")
    mode = str(getattr(mode, "name", mode)).lower()  # an IntEnum: str() gives its number
    if "allow" in mode:
        return dtype
    if "error" in mode:
        raise ValueError(
            f"Explicitly requested dtype {dtype} requested in {fun_name} is not available. "
            "To enable more dtypes, set the jax_enable_x64 or allow_explicit_x64_dtypes "
            "configuration options.See https://github.com/jax-ml/jax#current-gotchas for more."
        )
    warnings.warn(
        f"Explicitly requested dtype {dtype} requested in {fun_name} is not available, and "
        f"will be truncated to dtype {out.name}. To enable more dtypes, set the "
        "jax_enable_x64 configuration option or the JAX_ENABLE_X64 shell environment "
        "variable. See https://github.com/jax-ml/jax#current-gotchas for more.",
        UserWarning,
        stacklevel=outside_package_stacklevel(),
    )
    return out


# Dtypes JAX keeps as they are, by the settings that decide it (jax_enable_x64
# and jax_explicit_x64_dtypes).
_unchanged: dict[tuple[np.dtype, Any, Any], bool] = {}


def _canonical(dtype: np.dtype, fun_name: str) -> np.dtype:
    config: Any = jax.config  # its options are attributes JAX's stubs do not list
    key = (dtype, config.jax_enable_x64, getattr(config, "jax_explicit_x64_dtypes", None))
    if _unchanged.get(key):
        return dtype
    out = canonical_dtype(dtype, fun_name)  # warns when it narrows
    _unchanged[key] = out == dtype
    return out


def _dtype(dtype: Any, where: str, fun_name: str) -> np.dtype:
    if isinstance(dtype, type) and dtype in (bool, int, float, complex):
        # Python's own types mean JAX's default of that kind (float32 unless
        # x64 is on), without a warning: as jnp.zeros(3, dtype=float).
        return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if is_extended(dtype):
        return dtype  # a PRNG key type (key<fry>): JAX's own, taken as it is
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{where}: unknown dtype {dtype!r}") from None
    # Kind V holds ml_dtypes' types (bfloat16, float8_*, int4) and raw bytes
    # (V8, structs): only the former are JAX array dtypes.
    if dt.kind not in "biufcV" or (dt.kind == "V" and (dt.names is not None or dt.type is np.void)):
        raise TypeError(
            f"{where}: dtype {dt} is not a JAX array dtype (expected bool, an integer, "
            "float or complex type, or one of ml_dtypes' such as bfloat16 or float8_e4m3fn)"
        )
    if dt.byteorder == ">":
        dt = dt.newbyteorder("=")
    return _canonical(dt, fun_name)


def is_extended(dtype: Any) -> bool:
    """Whether ``dtype`` is one of JAX's extended dtypes (a PRNG key type,
    ``jax.random.key(0).dtype``): a leaf of it takes only a ``jax.Array`` of
    that dtype, as ``jax.make_array_from_callback`` does."""
    if isinstance(dtype, np.dtype):  # every numpy dtype: the per-leaf case, at no cost
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:
        return False


# Bounded: a process that sees many distinct shapes (200k kept 170 MiB) keeps
# only the recent ones; a miss costs one ShapedArray.
@functools.lru_cache(maxsize=4096)
def _aval(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    return _jax_hooks.shaped_array(shape, dtype)


# One SingleDeviceSharding per device: leaves placed alike share it (and the
# hand-off caches keyed by sharding hit).
_single: dict[Any, Sharding] = {}


def single_device(device: Any) -> Sharding:
    """``SingleDeviceSharding(device)``, one object per device."""
    found = _single.get(device)
    if found is None:
        found = _single[device] = jax.sharding.SingleDeviceSharding(device)
    return found


def default_device() -> Any:
    """The device ``jnp.asarray`` would place a host array on now: the
    ``jax.default_device`` in effect (its context manager on this thread, or
    the ``jax_default_device`` config; a platform name means that platform's
    first local device), else this process's first local device.

    Raises:
      ValueError: the configured default device belongs to another process.
    """
    config: Any = jax.config  # its options are attributes JAX's stubs do not list
    configured = config.jax_default_device
    if configured is None:
        return jax.local_devices()[0]
    if isinstance(configured, str):
        return jax.local_devices(backend=configured)[0]
    if configured.process_index != jax.process_index():
        raise ValueError(
            f"jax.default_device is {configured}, a device of process "
            f"{configured.process_index}; this is process {jax.process_index()}"
        )
    return configured


def default_sharding() -> Sharding:
    """Where a leaf lands when no sharding is given: the default device
    (:func:`default_device`), uncommitted, as ``jnp.asarray`` of a numpy array."""
    return single_device(default_device())


def _is_placement(s: Any) -> bool:
    return s is None or isinstance(s, (Sharding, jax.Device, jax.sharding.PartitionSpec))


def placement(s: Any, where: str) -> Sharding | None:
    """``s`` as a ``Sharding`` (None stays None), accepting what
    ``jax.device_put`` accepts: a ``Sharding``, a ``jax.Device``, or a
    ``PartitionSpec`` on the mesh of ``jax.set_mesh`` (or ``use_mesh``).

    Raises:
      TypeError: anything else.
      ValueError: a ``PartitionSpec`` with no mesh set.
    """
    if s is None or isinstance(s, Sharding):
        return s
    if isinstance(s, jax.Device):
        return single_device(s)
    if isinstance(s, jax.sharding.PartitionSpec):
        get_mesh = getattr(jax.sharding, "get_mesh", None)
        mesh = get_mesh() if get_mesh is not None else None
        if mesh is None or mesh.empty:
            raise ValueError(
                f"{where}: a PartitionSpec ({s}) needs a mesh: set one with jax.set_mesh, "
                "or pass a jax.sharding.NamedSharding"
            )
        return jax.sharding.NamedSharding(mesh, s)
    raise TypeError(
        f"{where}: sharding must be a jax.sharding.Sharding, a jax.Device or a "
        f"PartitionSpec (under jax.set_mesh), got {type(s).__name__}"
    )


def _check_sharding(sharding: Sharding, aval: Any, where: str) -> None:
    """Raises ``jax.device_put``'s own error, after the call and leaf, when
    ``sharding`` cannot place ``aval`` (an axis it does not divide, a spec
    longer than the rank)."""
    try:
        sharding.shard_shape(aval.shape)
        return
    except Exception as exc:
        cheap = exc
    # Only on failure: what jax.device_put says, by tracing it abstractly.
    try:
        jax.eval_shape(
            lambda x: jax.device_put(x, sharding), jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        )
    except (ValueError, TypeError) as exc:
        # Newer JAX ends with the source line of the call: ours, so dropped.
        text = str(exc).split(" This error occurs at source:")[0]
        raise reworded(exc, f"{where}: ", text) from None
    except Exception as exc:
        cheap = exc
    raise ValueError(f"{where}: sharding {sharding} does not fit shape {aval.shape}") from cheap


def _broadcast_shardings(sharding: Any, like: Any, n: int, where: str) -> list[Any]:
    """``sharding`` as one ``Sharding`` (or None) per leaf of ``like``: a
    single placement, or a pytree prefix of ``like`` with placement (or None)
    leaves, as ``jax.device_put``."""
    if _is_placement(sharding):
        return [placement(sharding, where)] * n
    prefix, prefix_def = jax.tree_util.tree_flatten(sharding, is_leaf=_is_placement)
    structure: Any = prefix_def  # a PyTreeDef, which JAX's stubs leave untyped
    try:
        subtrees = structure.flatten_up_to(like)
    except ValueError as exc:
        if isinstance(sharding, dict) and isinstance(like, dict):
            # JAX's own message reads backwards here; name the keys instead.
            missing = [k for k in like if k not in sharding]
            extra = [k for k in sharding if k not in like]
            said = []
            if missing:
                said.append(f"no entry for {_some(missing)} (None places one by default)")
            if extra:
                said.append(f"entries for {_some(extra)}, which no leaf has")
            if said:
                raise ValueError(f"{where}: sharding has {'; and '.join(said)}") from None
        raise ValueError(f"{where}: sharding is not a pytree prefix of like: {exc}") from None
    out: list[Any] = []
    for s, sub in zip(prefix, subtrees, strict=True):
        count: int = jax.tree_util.tree_structure(sub).num_leaves  # type: ignore[attr-defined]
        out.extend([placement(s, where)] * count)
    return out


def _some(keys: list[Any]) -> str:
    """Up to five keys, repr'd, and how many more."""
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


class LeafSpecs:
    """What each leaf of one call must be: avals, shardings, key paths.

    Key paths are only computed to build a message (flattening with paths
    costs several microseconds a leaf).
    """

    __slots__ = ("_paths", "avals", "committed", "context", "like", "name", "shardings", "treedef")

    def __init__(self, name: str, like: Any, treedef: Any, paths: list[Any] | None = None):
        self.name = name
        # The caller's thread-local JAX settings, for the pool threads that
        # hand this call's leaves to JAX (``with jax_work, specs.context:``).
        self.context = _jax_hooks.thread_context()
        self.like = like
        self.treedef = treedef  # None: a single leaf given by shape= and dtype=
        self._paths = paths  # JAX key paths, when the caller already has them
        self.avals: list[Any] = []
        self.committed: list[bool] = []
        self.shardings: list[Any] = []

    def place_on(self, shardings: list[Any]) -> None:
        """Sets each leaf's sharding: a requested one (committed), or the
        default device's (uncommitted) for None."""
        self.committed = [s is not None for s in shardings]
        if not all(self.committed):
            default = default_sharding()  # read once, at the call
            shardings = [default if s is None else s for s in shardings]
        self.shardings = shardings
        # A NamedSharding is part of the type, as JAX puts it in a jax.Array's
        # aval: jax.typeof(leaf) is then float32[8@x,2], and tracing sees the mesh.
        avals = self.avals
        typed: dict[tuple[Any, int], Any] = {}
        for i, s in enumerate(shardings):
            if type(s) is jax.sharding.NamedSharding:
                key = (avals[i], id(s))
                aval = typed.get(key)
                if aval is None:
                    aval = typed[key] = _jax_hooks.aval_with_sharding(avals[i], s)
                avals[i] = aval

    def key_path(self, index: int) -> str:
        if self.treedef is None:
            return ""
        if self._paths is None:
            self._paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(self.like)[0]]
        return jax.tree_util.keystr(self._paths[index])

    def where(self, index: int) -> str:
        return where(self.name, self.key_path(index))


def declare(
    name: str,
    shape: Any,
    dtype: Any,
    like: Any,
    sharding: Any,
) -> LeafSpecs:
    """Validates the arguments of ``async_wrap``-like calls into ``LeafSpecs``."""
    if like is not None and (shape is not None or dtype is not None):
        raise TypeError(f"{name}: pass either shape= and dtype=, or like=, not both")
    if like is None:
        if shape is None or dtype is None:
            raise TypeError(f"{name}: needs shape= and dtype=, or like= (a pytree of specs)")
        dims = shape_tuple(shape, name)
        dt = _dtype(dtype, name, name.partition("(")[0])
        aval = _aval(dims, dt)
        sharding = placement(sharding, name)
        if sharding is not None:
            _check_sharding(sharding, aval, name)
        specs = LeafSpecs(name, None, None)
        specs.avals.append(aval)
        specs.place_on([sharding])
        return specs
    leaves, treedef = jax.tree_util.tree_flatten(like)
    return declare_tree(LeafSpecs(name, like, treedef), leaves, sharding)


def declare_tree(specs: LeafSpecs, leaves: list[Any], sharding: Any) -> LeafSpecs:
    """Fills ``specs`` from the leaves of its ``like`` tree (already flattened)."""
    shardings = _broadcast_shardings(sharding, specs.like, len(leaves), specs.name)
    avals = specs.avals
    # Big trees repeat a few shapes and shardings: validate each pair once.
    seen_avals: dict[tuple[Any, Any], Any] = {}
    fits: set[tuple[int, tuple[int, ...]]] = set()
    for i, leaf in enumerate(leaves):
        try:
            key = (leaf.shape, leaf.dtype)
            aval = seen_avals.get(key)
            if aval is None:
                dt = _dtype(leaf.dtype, "", specs.name.partition("(")[0])
                aval = seen_avals[key] = _aval(shape_tuple(leaf.shape, ""), dt)
        except AttributeError:
            raise TypeError(
                f"{specs.where(i)}: a like leaf needs .shape and .dtype "
                f"(e.g. jax.ShapeDtypeStruct), got {type(leaf).__name__}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise reworded(exc, specs.where(i)) from None
        avals.append(aval)
        s = shardings[i]
        if s is None:
            own = getattr(leaf, "sharding", None)
            # A like leaf's own sharding, unless it is an uncommitted jax.Array.
            if isinstance(own, Sharding) and getattr(leaf, "committed", True):
                s = own
        if s is not None and (id(s), aval.shape) not in fits:
            _check_sharding(s, aval, specs.where(i))
            fits.add((id(s), aval.shape))
        shardings[i] = s
    specs.place_on(shardings)
    return specs
