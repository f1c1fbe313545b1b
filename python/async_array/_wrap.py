"""``async_wrap``: run a slow function on the pool, return ``AsyncArray``s at once.

Also the per-leaf conversion every producer shares: checking a result against
its declared shape and dtype, casting without loss, and handing it to JAX with
at most one copy.
"""

from __future__ import annotations

import functools
import operator
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _core, _jax_hooks
from ._array import AsyncArray, Source, default_sharding, paused_gc
from ._buffer import aligned_array
from ._core import HostBuffer
from ._pool import jax_work

_Sharding = jax.sharding.Sharding

# A value referenced only by the converting frame's local and getrefcount's argument.
_EXCLUSIVE_REFS = 2
_ALIGN = 64


def qualname(f: Any) -> str:
    """How messages name a callable."""
    if isinstance(f, functools.partial):
        return f"partial({qualname(f.func)})"
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__qualname__


# -- declared specs ------------------------------------------------------------


def _shape(shape: Any, where: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"{where}: shape must be a tuple of integers, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{where}: negative dimension in shape {dims}")
    return dims


def outside_package_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at
    the first frame outside async_array: the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("async_array"):
        frame, level = frame.f_back, level + 1
    return level


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


def _canonical(dtype: np.dtype) -> np.dtype:
    config = jax.config
    key = (dtype, config.jax_enable_x64, getattr(config, "jax_explicit_x64_dtypes", None))
    if _unchanged.get(key):
        return dtype
    out = canonical_dtype(dtype, "async_wrap")  # warns when it narrows
    _unchanged[key] = out == dtype
    return out


def _dtype(dtype: Any, where: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{where}: unknown dtype {dtype!r}") from None
    if dt.kind not in "biufcV" or (dt.kind == "V" and dt.names is not None):
        raise TypeError(f"{where}: dtype {dt} is not a JAX array dtype")
    if dt.byteorder == ">":
        dt = dt.newbyteorder("=")
    return _canonical(dt)


_avals: dict[tuple[tuple[int, ...], np.dtype], Any] = {}


def _aval(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    key = (shape, dtype)
    aval = _avals.get(key)
    if aval is None:
        aval = _avals[key] = _jax_hooks.shaped_array(shape, dtype)
    return aval


def _check_sharding(sharding: Any, shape: tuple[int, ...], where: str) -> None:
    if not isinstance(sharding, _Sharding):
        raise TypeError(
            f"{where}: sharding must be a jax.sharding.Sharding, got {type(sharding).__name__}"
        )
    try:
        sharding.shard_shape(shape)
    except Exception as exc:
        raise ValueError(f"{where}: sharding {sharding} does not fit shape {shape}: {exc}") from exc


def _broadcast_shardings(sharding: Any, like: Any, n: int, where: str) -> list[Any]:
    """``sharding`` as one entry per leaf of ``like``: a single Sharding, or a
    pytree prefix of ``like`` with Sharding (or None) leaves, as ``jax.device_put``."""
    if sharding is None or isinstance(sharding, _Sharding):
        return [sharding] * n
    is_leaf = lambda s: s is None or isinstance(s, _Sharding)  # noqa: E731
    prefix, prefix_def = jax.tree_util.tree_flatten(sharding, is_leaf=is_leaf)
    try:
        subtrees = prefix_def.flatten_up_to(like)
    except ValueError as exc:
        raise ValueError(f"{where}: sharding is not a pytree prefix of like: {exc}") from None
    out: list[Any] = []
    for s, sub in zip(prefix, subtrees, strict=True):
        out.extend([s] * jax.tree_util.tree_structure(sub).num_leaves)
    return out


class LeafSpecs:
    """What each leaf of one call must be: avals, shardings, key paths.

    Key paths are only computed to build a message (flattening with paths
    costs several microseconds a leaf).
    """

    __slots__ = ("_paths", "avals", "committed", "like", "name", "shardings", "treedef")

    def __init__(self, name: str, like: Any, treedef: Any, paths: list[Any] | None = None):
        self.name = name
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
        self.shardings = [default_sharding() if s is None else s for s in shardings]

    def key_path(self, index: int) -> str:
        if self.treedef is None:
            return ""
        if self._paths is None:
            self._paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(self.like)[0]]
        return jax.tree_util.keystr(self._paths[index])

    def where(self, index: int) -> str:
        path = self.key_path(index)
        return f"{self.name} leaf {path}" if path else f"{self.name} result"


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
        dims = _shape(shape, name)
        dt = _dtype(dtype, name)
        if sharding is not None:
            _check_sharding(sharding, dims, name)
        specs = LeafSpecs(name, None, None)
        specs.avals.append(_aval(dims, dt))
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
                aval = seen_avals[key] = _aval(_shape(leaf.shape, ""), _dtype(leaf.dtype, ""))
        except AttributeError:
            raise TypeError(
                f"{specs.where(i)}: a like leaf needs .shape and .dtype "
                f"(e.g. jax.ShapeDtypeStruct), got {type(leaf).__name__}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{specs.where(i)}{exc}") from None
        avals.append(aval)
        s = shardings[i]
        if s is None:
            own = getattr(leaf, "sharding", None)
            # A like leaf's own sharding, unless it is an uncommitted jax.Array.
            if isinstance(own, _Sharding) and getattr(leaf, "committed", True):
                s = own
        if s is not None and (id(s), aval.shape) not in fits:
            _check_sharding(s, aval.shape, specs.where(i))
            fits.add((id(s), aval.shape))
        shardings[i] = s
    specs.place_on(shardings)
    return specs


# -- converting results --------------------------------------------------------


def _check_cast(src: np.dtype, dst: np.dtype, where: str) -> None:
    if src == dst or (src.kind in "biu" and dst.kind in "iu"):
        return  # integers: any width or sign, range-checked by _copy_checked
    if not np.can_cast(src, dst, casting="same_kind"):
        raise TypeError(
            f"{where}: expected dtype {dst}, got {src}; async_array casts only within "
            "a kind (numpy same_kind: e.g. float64 to float32, int64 to int32)"
        )


def _copy_checked(value: np.ndarray, dst: np.ndarray, where: str) -> None:
    """Copies ``value`` into ``dst`` (casting, byte-swapping, de-striding in one
    pass); raises OverflowError rather than wrap an integer or turn a finite
    float into inf."""
    src, to = value.dtype, dst.dtype
    if to.kind in "iu" and src.kind in "iu" and value.size:
        info = np.iinfo(to)
        lo, hi = int(value.min()), int(value.max())
        if lo < info.min or hi > info.max:
            raise OverflowError(
                f"{where}: expected dtype {to}, got {src} values in [{lo}, {hi}], outside "
                f"{to}'s range [{info.min}, {info.max}]; async_array never wraps integers"
            )
    with np.errstate(all="ignore"):
        np.copyto(dst, value, casting="unsafe")
    if src != to and to.kind not in "biu" and value.size:
        with np.errstate(all="ignore"):
            grew = np.isinf(dst) & np.isfinite(value)
        if grew.any():
            bad = value[grew].flat[0]
            raise OverflowError(
                f"{where}: expected dtype {to}, got {src} value {bad} which is finite "
                f"but beyond {to}'s range (it would become inf)"
            )


@functools.lru_cache(maxsize=256)
def _on_one_cpu(sharding: _Sharding) -> bool:
    """Whether host memory can be aliased there: one CPU device."""
    (device, *more) = sharding.device_set
    return not more and device.platform == "cpu"


def _host_array(value: Any, where: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__") and not isinstance(value, (np.generic, HostBuffer)):
        try:
            return np.from_dlpack(value)
        except (TypeError, BufferError, RuntimeError, ValueError):
            pass  # not a CPU tensor numpy can view: try the array protocol below
    try:
        return np.asarray(value)
    except Exception as exc:
        raise TypeError(
            f"{where}: expected an array, got {type(value).__name__} that numpy cannot "
            f"convert ({exc})"
        ) from exc


def place(
    value: Any,
    exclusive: bool,
    aval: Any,
    sharding: _Sharding,
    committed: bool,
    where: str,
) -> jax.Array:
    """Turns one result into the leaf's ``jax.Array``, copying at most once.

    Args:
      value: what the function returned for this leaf.
      exclusive: nothing but the caller holds ``value``, so its memory may be
        aliased instead of copied.
      aval: the declared shape and dtype.
      sharding: where the array goes.
      committed: whether it is committed there.
      where: the call and key path, for messages.

    Raises:
      ValueError: the shape differs.
      TypeError: a cast across kinds, or not an array at all.
      OverflowError: a value that does not fit the declared dtype.
    """
    shape, dtype = aval.shape, aval.dtype
    if type(value) is np.ndarray:
        host = value
    elif isinstance(value, jax.Array):
        return _place_jax_array(value, exclusive, aval, sharding, committed, where)
    elif type(value) is HostBuffer:
        if value.shape == shape and value.dtype == dtype and _on_one_cpu(sharding):
            value.mark_exported()
            return _jax_hooks.put_dlpack(value, aval, sharding, committed)
        host, exclusive = np.asarray(value), False
    else:
        host = _host_array(value, where)
        if host is not value:
            # A new array (from a list or scalar) is ours alone; an array some
            # object hands out through __array__ is still that object's.
            del value
            exclusive = sys.getrefcount(host) <= _EXCLUSIVE_REFS
    if host.shape != shape:
        raise ValueError(f"{where}: expected shape {shape}, got {host.shape}")
    if host.dtype == dtype and host.flags.c_contiguous:
        alias = (
            exclusive
            and host.flags.owndata
            and _on_one_cpu(sharding)
            and host.__array_interface__["data"][0] % _ALIGN == 0
        )
        return _jax_hooks.put_host(host, aval, sharding, committed, alias)
    # Cast, byte-swap or gather strides in one pass into memory that is ours.
    _check_cast(host.dtype, dtype, where)
    staged = aligned_array(shape, dtype)
    _copy_checked(host, staged, where)
    return _jax_hooks.put_host(staged, aval, sharding, committed, alias=True)


def _place_jax_array(
    value: jax.Array, exclusive: bool, aval: Any, sharding: _Sharding, committed: bool, where: str
) -> jax.Array:
    if isinstance(value, AsyncArray):
        value = value.result()
    if value.shape != aval.shape:
        raise ValueError(f"{where}: expected shape {aval.shape}, got {value.shape}")
    if value.dtype != aval.dtype:
        return place(np.asarray(value), False, aval, sharding, committed, where)
    if not value.sharding.is_equivalent_to(sharding, len(aval.shape)):
        value = jax.device_put(value, sharding)  # a copy, so ours alone
    elif not exclusive:
        value = value.copy()  # the loader may delete or donate its own
    if len(sharding.device_set) > 1:
        return value
    return _jax_hooks.put_array(value, aval, sharding, committed)


def _mismatch(like: Any, out: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], str] | None:
    """The first place where ``out``'s structure leaves ``like``'s, and how;
    None when none is found (a custom pytree node, say). Anything may stand
    where ``like`` has a leaf."""
    tu = jax.tree_util
    if like is not None and tu.treedef_is_leaf(tu.tree_structure(like)):
        return None
    if type(out) is not type(like):
        return path, f"expected {type(like).__name__}, got {type(out).__name__}"
    if isinstance(like, dict):
        missing = sorted(map(repr, like.keys() - out.keys()))
        extra = sorted(map(repr, out.keys() - like.keys()))
        if missing or extra:
            parts = [f"missing keys {', '.join(missing[:5])}"] if missing else []
            parts += [f"unexpected keys {', '.join(extra[:5])}"] if extra else []
            return path, "; ".join(parts)
        children = [(tu.DictKey(k), like[k], out[k]) for k in like]
    elif isinstance(like, (list, tuple)):
        if len(like) != len(out):
            return path, f"expected {len(like)} items, got {len(out)}"
        fields = getattr(like, "_fields", None)
        children = [
            (tu.GetAttrKey(fields[i]) if fields else tu.SequenceKey(i), a, b)
            for i, (a, b) in enumerate(zip(like, out, strict=True))
        ]
    else:
        return None
    for key, a, b in children:
        found = _mismatch(a, b, (*path, key))
        if found is not None:
            return found
    return None


def structure_error(specs: LeafSpecs, out: Any, cause: Exception) -> ValueError:
    """Says where (the key path) and how the result's structure differs from ``like``."""
    found = _mismatch(specs.like, out, ())
    if found is None:
        text = str(cause)
        detail = text if len(text) <= 300 else text[:300] + " ..."
    else:
        path, how = found
        detail = f"at {jax.tree_util.keystr(path) or 'the root'}: {how}"
    return ValueError(
        f"{specs.name}: the result's tree structure differs from like "
        f"(matched by key path) {detail}"
    )


def convert_one(specs: LeafSpecs, i: int, holder: list[Any]) -> Any:
    """Leaf ``i``'s entry in a ``Source`` list: its ``jax.Array``, or the
    exception it alone failed with.

    ``holder`` is a one-item list with the leaf's value, taken out here so that
    this frame holds the only reference and can tell whether it may alias it.
    """
    value = holder.pop()
    exclusive = sys.getrefcount(value) <= _EXCLUSIVE_REFS
    try:
        return place(value, exclusive, specs.avals[i], specs.shardings[i], specs.committed[i], "")
    except (ValueError, TypeError, OverflowError) as exc:
        return type(exc)(f"{specs.where(i)}{exc}")
    except Exception as exc:
        exc.add_note(f"async_array: while converting {specs.where(i)}")
        return exc


def convert_results(specs: LeafSpecs, holder: list[Any]) -> list[Any]:
    """The per-leaf list a ``Source`` future holds (see :func:`convert_one`),
    from a one-item ``holder`` with the whole result."""
    out = holder.pop()
    if specs.treedef is None:
        values = [out]
    else:
        try:
            values = specs.treedef.flatten_up_to(out)
        except (ValueError, TypeError) as exc:
            raise structure_error(specs, out, exc) from None
    del out
    results: list[Any] = [None] * len(values)
    for i in range(len(values)):
        one = [values[i]]
        values[i] = None
        results[i] = convert_one(specs, i, one)
    return results


def _run(f: Callable[[], Any], specs: LeafSpecs) -> list[Any]:
    try:
        holder = [f()]
    except BaseException as exc:
        # Keep f's frames for the traceback but free their locals (a loader's
        # half-filled buffers, say).
        traceback.clear_frames(exc.__traceback__)
        raise
    with jax_work, paused_gc():
        return convert_results(specs, holder)


def leaves_for(specs: LeafSpecs, future: _core.Future) -> Any:
    """The ``AsyncArray`` leaves of one call, in the shape of ``like``."""
    source = Source(future, specs.name, len(specs.avals), specs.key_path)
    leaves = [
        AsyncArray(source, i, aval, sharding if committed else None)
        for i, (aval, sharding, committed) in enumerate(
            zip(specs.avals, specs.shardings, specs.committed, strict=True)
        )
    ]
    return leaves[0] if specs.treedef is None else specs.treedef.unflatten(leaves)


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
      A ``HostBuffer`` result, and on CPU a numpy result that is 64-byte
      aligned, C-contiguous, owns its data and is held by nothing else, reach
      JAX without a copy. Anything else is copied once.

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
        return leaves_for(specs, _core.submit(_run, f, specs))
