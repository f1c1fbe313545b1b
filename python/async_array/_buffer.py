"""``aa.empty``: aligned host memory owned by the Rust core."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._core import HUGE_PAGES_ENV, HostBuffer
from ._errors import reworded
from ._spec import shape_tuple


def empty(shape: int | tuple[int, ...], dtype: Any) -> HostBuffer:
    """Allocates an uninitialised, writable, 64-byte-aligned host buffer.

    Fill it, e.g. with ``file.readinto(buf)`` or ``sock.recv_into(buf)``, or
    through ``np.asarray(buf)`` (a zero-copy view), and return it from the
    function given to ``async_wrap``: the hand-off to JAX on CPU is then
    zero-copy (through DLPack), whatever the size.

    Args:
      shape: dimensions, in elements.
      dtype: bool, int8-int64, uint8-uint64, float16, bfloat16, float32,
        float64, complex64 or complex128 (native byte order); or one of
        ml_dtypes' one-byte types, held by their bytes as numpy holds them:
        every float8 kind (handed to JAX without a copy, as DLPack 1.1 codes
        them), and int2, uint2, int4, uint4, float4_e2m1fn, float6_e2m3fn,
        float6_e3m2fn (XLA packs these, so JAX takes them with one copy).

    Returns:
      A ``HostBuffer`` of ``prod(shape) * dtype.itemsize`` bytes. Its contents
      are undefined until written, as ``np.empty``'s are (never zeroed: the
      loader overwrites them). From 4 MiB on it starts on a 2 MiB boundary
      and asks the kernel for transparent huge pages (``MADV_HUGEPAGE``), as
      numpy does for large arrays, except in a VM whose balloon device reports
      free pages to the host (``VIRTIO_BALLOON_F_REPORTING``), where a fresh
      huge page is slow to touch (figures in ``docs/performance.md``).
      ``ASYNC_ARRAY_HUGE_PAGES=1`` (or ``0``) asks always (or never).

    Raises:
      TypeError: unsupported dtype, or a shape that is not integers.
      ValueError: a negative dimension, or more elements than an int64 counts.
      MemoryError: the allocation failed.

    Note:
      Ownership: once JAX has the memory (the buffer was returned from a
      loader, or ``__dlpack__`` was called), new writable views are refused;
      views made earlier must not be written, or the ``jax.Array`` changes.
      DLPack then: ``np.from_dlpack(buf)`` is a read-only view (DLPack >= 1.0
      read-only flag); a consumer that passes no ``max_version`` gets a
      ``BufferError``; ``__dlpack__(copy=True)`` is a writable copy, always.

    Examples:
      >>> import numpy as np, async_array as aa
      >>> buf = aa.empty((2, 3), np.float32)
      >>> np.asarray(buf)[:] = 1.5
      >>> float(np.asarray(buf).sum())
      9.0
    """
    dims = shape_tuple(shape, "aa.empty")
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"aa.empty: unknown dtype {dtype!r}") from exc
    try:
        return HostBuffer(dims, dt)
    except (TypeError, ValueError) as exc:
        raise reworded(exc, "aa.empty: ") from None


def aligned_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array over fresh 64-byte-aligned memory (for a one-copy hand-off)."""
    return np.asarray(empty(shape, dtype))


ENV_HUGE_PAGES = HUGE_PAGES_ENV


def _check_huge_pages_setting() -> None:
    """A bad ``$ASYNC_ARRAY_HUGE_PAGES`` fails at import: the core reads only
    ``1`` and ``0`` and would take anything else for unset, silently."""
    raw = os.environ.get(ENV_HUGE_PAGES)
    if raw not in (None, "", "0", "1"):
        raise ValueError(
            f"{ENV_HUGE_PAGES} must be 1 (always ask for huge pages), 0 (never) or unset "
            f"(ask unless this VM hands free pages back to its host), got {raw!r}"
        )


_check_huge_pages_setting()
