"""Zero-copy hand-off: 64 ``aa.empty`` buffers into JAX through ``async_wrap``.

Filling the buffers (the loader's work) is outside the timing; the timing is
from ``async_wrap`` to every ``jax.Array`` ready. The twin is ``jnp.asarray``
of the same bytes from numpy arrays that are not 64-byte aligned (numpy's own
alignment is 16), which JAX must copy. Run at 64 MiB and 1 GiB in all: the
async_array time per leaf should not grow with the size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import async_array as aa
from async_array import _core

LEAVES = 64
MiB = 1 << 20
SIZES = {"64 MiB": 64 * MiB, "1 GiB": 1024 * MiB}

pytestmark = pytest.mark.timeout(900)


def filled_buffers(total: int) -> list[aa.HostBuffer]:
    bufs = [aa.empty((total // LEAVES // 4,), np.float32) for _ in range(LEAVES)]
    for i, buf in enumerate(bufs):
        np.asarray(buf).fill(i)
    return bufs


def unaligned_arrays(total: int) -> list[np.ndarray]:
    n = total // LEAVES // 4
    raw = np.empty(LEAVES * (n + 16), np.float32)
    out = []
    for i in range(LEAVES):
        start = i * (n + 16) + 1  # 4 bytes past an aligned start: never 64-byte aligned
        a = raw[start : start + n]
        a.fill(i)
        assert a.ctypes.data % 64 != 0
        out.append(a)
    return out


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("way", ["async_array", "jnp.asarray"])
def test_zero_copy(benchmark, rounds, size, way):
    total = SIZES[size]
    benchmark.group = f"zero-copy {size} in {LEAVES} leaves"
    held: list = []  # the last round's buffers and arrays

    if way == "async_array":

        def setup():
            held.clear()  # free the last round's gigabyte before making the next
            bufs = filled_buffers(total)
            like = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs]
            held.append(bufs)
            return (bufs, like), {}

        def hand_off(bufs, like):
            out = jax.block_until_ready(aa.materialize(aa.async_wrap(lambda: bufs, like=like)))
            held.append(out)

        benchmark.pedantic(hand_off, setup=setup, rounds=rounds, iterations=1)
        bufs, out = held
        same = [o.unsafe_buffer_pointer() == b.address for o, b in zip(out, bufs, strict=True)]
    else:
        arrays = unaligned_arrays(total)

        def copy_in():
            held[:] = [jax.block_until_ready([jnp.asarray(a) for a in arrays])]

        benchmark.pedantic(copy_in, rounds=rounds, iterations=1)
        out = held[0]
        same = [
            o.unsafe_buffer_pointer() == a.ctypes.data for o, a in zip(out, arrays, strict=True)
        ]
    np.testing.assert_array_equal(out[-1][:4], np.full(4, LEAVES - 1, np.float32))
    benchmark.extra_info["bytes"] = total
    benchmark.extra_info["leaves"] = LEAVES
    benchmark.extra_info["leaves_sharing_memory"] = sum(same)
    if way == "async_array":
        assert all(same), "a HostBuffer leaf was copied"


# -- first touch -------------------------------------------------------------------------

FILL_BYTES = 512 * MiB
FILL_WAYS = {
    "async_array": lambda: np.asarray(aa.empty((FILL_BYTES,), np.uint8)),
    "np.empty": lambda: np.empty(FILL_BYTES, np.uint8),
}


@pytest.mark.benchmark(group="first-touch fill of 512 MiB")
@pytest.mark.parametrize("way", FILL_WAYS)
def test_first_touch_fill(benchmark, rounds, way):
    """Allocate 512 MiB and write every byte once: what a loader pays before
    its first byte of data lands (page faults; huge pages cut them 512x)."""
    make = FILL_WAYS[way]

    def fill():
        make().fill(1)

    benchmark.pedantic(fill, rounds=rounds, iterations=1, warmup_rounds=1)
    # Whether aa.empty asked for huge pages here (not on a VM that reports
    # free pages to its host): the figure means little without it.
    benchmark.extra_info["huge_pages"] = _core.huge_pages()
