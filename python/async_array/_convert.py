"""Results to ``jax.Array``s: the conversion every producer shares.

Checks a result against its leaf's declared shape and dtype, casts without
loss, and hands it to JAX copying at most once. Memory something else may
still write is never aliased: a returned ``HostBuffer`` passes its memory to
JAX (zero-copy); every other result is copied once (see :func:`place`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import ml_dtypes
import numpy as np

from . import _core, _handoff
from ._array import AsyncArray
from ._buffer import aligned_array
from ._core import HostBuffer
from ._errors import free_frames, invalid, is_invalid, reworded
from ._spec import PACKED_IN_XLA, LeafSpecs, Sharding, is_extended, numeric_kind

# Results numpy must build a new array from: that array is ours alone.
_BUILT = (list, tuple, bool, int, float, complex)


def castable(src: np.dtype, dst: np.dtype) -> bool:
    """Whether values of ``src`` convert to ``dst`` (``copy_checked`` then
    range-checks them): numpy's same_kind casting, and integers of any width
    or sign (int4 too)."""
    if src == dst or (numeric_kind(src) in "biu" and numeric_kind(dst) in "iu"):
        return True
    return bool(np.can_cast(src, dst, casting="same_kind"))


def check_cast(src: np.dtype, dst: np.dtype, where: str) -> None:
    if not castable(src, dst):
        raise invalid(
            TypeError,
            f"{where}: expected dtype {dst}, got {src}; async_array casts only where "
            "numpy's same_kind does: within a kind (float64 to float32, int64 to int32) "
            "or up a kind (bool to int, int to float, float to complex)",
        )


def copy_checked(value: np.ndarray, dst: np.ndarray, where: str) -> None:
    """Copies ``value`` into ``dst`` (casting, byte-swapping, de-striding in one
    pass); raises OverflowError rather than wrap an integer or turn a finite
    float into inf."""
    src, to = value.dtype, dst.dtype
    if numeric_kind(to) in "iu" and numeric_kind(src) in "iu" and value.size:
        info = ml_dtypes.iinfo(to)  # numpy's, and int4's, uint2's...
        lo, hi = int(value.min()), int(value.max())
        if lo < info.min or hi > info.max:
            raise invalid(
                OverflowError,
                f"{where}: expected dtype {to}, got {src} values in [{lo}, {hi}], outside "
                f"{to}'s range [{info.min}, {info.max}]; async_array never wraps integers",
            )
    with np.errstate(all="ignore"):
        np.copyto(dst, value, casting="unsafe")
    if src != to and numeric_kind(to) not in "biu" and value.size:
        with np.errstate(all="ignore"):
            # A type without inf (float8_e4m3fn) turns what it cannot hold into nan.
            checks = [(~np.isfinite(dst) & np.isfinite(value), f"beyond {to}'s range")]
            limit = _saturation_limit(to)
            if limit is not None:  # one without inf nor nan (float4) clamps it instead
                checks[0] = (checks[0][0] | (np.abs(value) >= limit), checks[0][1])
                checks.append((~np.isfinite(value), f"not a value {to} can hold"))
        for bad, why in checks:
            if bad.any():
                raise invalid(
                    OverflowError,
                    f"{where}: expected dtype {to}, got {src} value {value[bad].flat[0]}, "
                    f"{why} (it would become {dst[bad].flat[0]})",
                )


@functools.cache
def _saturation_limit(dtype: np.dtype) -> float | None:
    """For a one-byte float type without inf (float4_e2m1fn, the float6 kinds:
    a cast clamps to the largest value instead), the magnitude from which a
    value no longer rounds to a finite one of the type (its largest plus half
    a step, as rounding to nearest decides it); None for the others."""
    if numeric_kind(dtype) != "f" or dtype.itemsize != 1:
        return None
    with np.errstate(all="ignore"):
        if not np.isfinite(np.array(np.inf, np.float32).astype(dtype)):
            return None  # inf (or nan) says so itself
    largest = np.array(ml_dtypes.finfo(dtype).max, dtype)
    below = (largest.view(np.uint8) - 1).view(dtype)  # the next value down
    top, step = float(largest), float(largest) - float(below)
    return top + step / 2


@functools.lru_cache(maxsize=256)
def _on_one_cpu(sharding: Sharding) -> bool:
    """Whether host memory can be aliased there: one CPU device."""
    device: Any
    (device, *more) = sharding.device_set
    return not more and device.platform == "cpu"


def describe(value: Any) -> str:
    """How a message names a result that is not an array: its type, and for
    text its start, for a dict its first keys."""
    kind = type(value).__name__
    if isinstance(value, (str, bytes)):
        text = repr(value)
        return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"
    if isinstance(value, dict):
        keys = [repr(k) for k in list(value)[:5]]
        more = ", ..." if len(value) > 5 else ""
        return f"dict with keys [{', '.join(keys)}{more}]"
    if isinstance(value, np.ndarray):
        return f"numpy array of dtype {value.dtype}"
    return kind


# Results that are never arrays, however numpy would wrap them.
_NOT_ARRAYS = (type(None), str, bytes, dict, set, frozenset)


def _cpu_dlpack(value: Any) -> bool:
    """Whether ``value`` exports host memory through DLPack. Exceptions from
    its own ``__dlpack_device__`` are its maker's and propagate."""
    device = getattr(value, "__dlpack_device__", None)
    if device is None or not hasattr(value, "__dlpack__"):
        return False
    return device()[0] == _core.DLPACK_CPU


def host_array(value: Any, where: str) -> np.ndarray:
    """``value`` as a numpy array (a view where numpy can make one).

    Exceptions raised by the value's own ``__array__``, ``__dlpack__`` or
    ``__dlpack_device__`` propagate as they are."""
    if isinstance(value, np.ndarray):
        host = value
    elif isinstance(value, _NOT_ARRAYS):
        host = None
    elif not isinstance(value, (np.generic, HostBuffer)) and _cpu_dlpack(value):
        return np.from_dlpack(value)
    elif isinstance(value, (list, tuple)):
        try:
            host = np.asarray(value)
        except ValueError as exc:  # ragged: numpy's words about the user's lists
            raise invalid(
                TypeError, f"{where}: expected an array, got a ragged {describe(value)} ({exc})"
            ) from None
    else:
        host = np.asarray(value)
    if host is None or host.dtype.kind in "OUS":
        raise invalid(TypeError, f"{where}: expected an array or a number, got {describe(value)}")
    return host


def place(value: Any, aval: Any, sharding: Sharding, committed: bool, where: str) -> jax.Array:
    """Turns one result into the leaf's ``jax.Array``, copying at most once.

    Args:
      value: what the function returned for this leaf.
      aval: the declared shape and dtype.
      sharding: where the array goes.
      committed: whether it is committed there.
      where: the call and key path, for messages.

    Raises:
      ValueError: the shape differs.
      TypeError: a cast across kinds, or not an array at all.
      OverflowError: a value that does not fit the declared dtype.

    Note:
      Only memory nobody else can reach is aliased: a ``HostBuffer`` (from
      then on it refuses new writable views), and the array numpy builds from
      a list or a scalar. A numpy array, or anything viewed through
      ``__dlpack__`` or ``__array__``, is copied once: whoever made it may
      keep it (in a cache of weak references, say) and write it later, and
      no test the library could make (a reference count) says otherwise on
      every CPython. A ``jax.Array`` is copied once on its device, so its
      maker may delete or donate it.
    """
    shape, dtype = aval.shape, aval.dtype
    if type(value) is np.ndarray and not is_extended(dtype):
        host, ours = value, False
    elif isinstance(value, jax.Array):
        return _place_jax_array(value, aval, sharding, committed, where)
    elif is_extended(dtype):
        raise invalid(
            TypeError, f"{where}: expected a jax.Array of dtype {dtype}, got {describe(value)}"
        )
    elif type(value) is HostBuffer:
        if (
            value.shape == shape
            and value.dtype == dtype
            and dtype not in PACKED_IN_XLA
            and _on_one_cpu(sharding)
        ):
            value.mark_exported()
            return _handoff.put_dlpack(value, aval, sharding, committed)
        host, ours = np.asarray(value), False
    else:
        host, ours = host_array(value, where), type(value) in _BUILT
    if host.shape != shape:
        raise invalid(ValueError, f"{where}: expected shape {shape}, got {host.shape}")
    if host.dtype == dtype and host.flags.c_contiguous:
        alias = (
            ours
            and _on_one_cpu(sharding)
            and host.__array_interface__["data"][0] % _core.ALIGNMENT == 0
        )
        return _handoff.put_host(host, aval, sharding, committed, alias)
    # Cast, byte-swap or gather strides in one pass into memory that is ours.
    check_cast(host.dtype, dtype, where)
    staged = aligned_array(shape, dtype)
    copy_checked(host, staged, where)
    return _handoff.put_host(staged, aval, sharding, committed, alias=True)


def _place_jax_array(
    value: jax.Array, aval: Any, sharding: Sharding, committed: bool, where: str
) -> jax.Array:
    if isinstance(value, AsyncArray):
        value = value.result()
    if value.shape != aval.shape:
        raise invalid(ValueError, f"{where}: expected shape {aval.shape}, got {value.shape}")
    if value.dtype != aval.dtype:
        if is_extended(aval.dtype) or is_extended(value.dtype):
            raise invalid(
                TypeError, f"{where}: expected a jax.Array of dtype {aval.dtype}, got {value.dtype}"
            )
        return place(np.asarray(value), aval, sharding, committed, where)
    if not value.sharding.is_equivalent_to(sharding, len(aval.shape)):
        value = jax.device_put(value, sharding)  # a copy, so ours alone
    else:
        value = value.copy()  # its maker may delete or donate its own
    if len(sharding.device_set) > 1 or is_extended(aval.dtype):
        return value
    return _handoff.put_array(value, aval, sharding, committed)


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


# Per sharding (by id; the sharding is kept so its id is never reused): the
# hand-off of :func:`_handoff.copier`, or None.
_copiers: dict[int, tuple[Sharding, Any]] = {}


def _copier(sharding: Sharding) -> Any:
    found = _copiers.get(id(sharding))
    if found is None:
        found = (sharding, _handoff.copier(sharding))
        if len(_copiers) < 4096:
            _copiers[id(sharding)] = found
    return found[1]


def convert_one(specs: LeafSpecs, i: int, value: Any) -> Any:
    """Leaf ``i``'s entry in a ``Source`` list: its ``jax.Array``, or the
    exception it alone failed with."""
    # The common case first (a numpy array already of the leaf's shape and
    # dtype, for one device): ~3 µs a leaf less than through place().
    aval = specs.avals[i]
    if (
        type(value) is np.ndarray
        and value.shape == aval.shape
        and value.dtype == aval.dtype
        and value.flags.c_contiguous
    ):
        copy = _copier(specs.shardings[i])
        if copy is not None:
            try:
                return copy(value, aval, specs.committed[i])
            except Exception:
                pass  # place() below raises it again, named
    try:
        return place(value, aval, specs.shardings[i], specs.committed[i], "")
    except Exception as exc:
        if is_invalid(exc):
            return reworded(exc, specs.where(i))
        # The producer's own (from its __array__, say): itself, with its frames.
        exc.add_note(f"async_array: while converting {specs.where(i)}")
        return free_frames(exc)


def convert_results(specs: LeafSpecs, holder: list[Any]) -> list[Any]:
    """The per-leaf list a ``Source`` future holds (see :func:`convert_one`),
    from a one-item ``holder`` with the whole result.

    The result comes in a list emptied here, and each leaf's value is dropped
    as soon as it is converted: the loader's arrays are freed one by one as
    they are copied, not all at the end.
    """
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
        value, values[i] = values[i], None
        results[i] = convert_one(specs, i, value)
        del value
    return results
