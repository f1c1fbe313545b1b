"""Zero-copy hand-off: ``aa.empty`` / ``HostBuffer``, DLPack into JAX,
pointer identity through ``async_wrap``, and the live-buffer count.
"""

from __future__ import annotations

import ctypes
import gc
import socket
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DTYPE_IDS, DTYPES, WAIT

import async_array as aa
from async_array import _core
from async_array._core import _testing

SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 5)]
# numpy (PEP 3118) has no format code for bfloat16.
NO_PEP3118 = {np.dtype(jnp.bfloat16)}

PyBUF_WRITABLE = 0x0001


def pattern(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Distinct, exactly representable values of ``dtype``."""
    n = int(np.prod(shape, dtype=np.int64))
    base = np.arange(1, n + 1) % 97
    dt = np.dtype(dtype)
    if dt.kind == "b":
        values = base % 2 == 0
    elif dt.kind == "c":
        values = base + 1j * (base % 5)
    else:
        values = base
    return values.astype(dt).reshape(shape)


WIDE = {np.dtype(d) for d in (np.int64, np.uint64, np.float64, np.complex128)}


def x64_for(dtype):
    """64-bit dtypes reach JAX as themselves only with x64 on."""
    return jax.enable_x64(np.dtype(dtype) in WIDE)


def aligned_owned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A numpy array that owns 64-byte-aligned memory (numpy guarantees only 16)."""
    misses = []  # kept alive so that the allocator hands out other addresses
    for _ in range(500):
        a = np.empty(shape, dtype)
        if a.ctypes.data % 64 == 0:
            assert a.flags.owndata and a.flags.c_contiguous
            return a
        misses.append(a)
    raise AssertionError("numpy never returned 64-byte-aligned memory")


def unaligned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A C-contiguous numpy view whose data is not 64-byte aligned."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    raw = np.empty(n + 64 + dt.itemsize, np.uint8)
    off = (-raw.ctypes.data) % 64 + dt.itemsize  # aligned + one item
    return raw[off : off + n].view(dt).reshape(shape)


def writable_buffer_request(obj) -> None:
    """Asks ``obj`` for a writable buffer the way C code does (PEP 3118);
    raises what its ``bf_getbuffer`` raises."""
    view = ctypes.create_string_buffer(256)  # room for a Py_buffer
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int]
    get.restype = ctypes.c_int
    assert get(obj, ctypes.addressof(view), PyBUF_WRITABLE) == 0
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.c_void_p]
    release(ctypes.addressof(view))


class LiveBuffers:
    """Aligned allocations alive now, counted from the start of a test."""

    def __init__(self) -> None:
        gc.collect()  # garbage of earlier tests must not be freed inside this one
        self.start = _testing.live_host_buffers()

    def __call__(self, expected: int) -> int:
        """The count once it reaches ``expected``, or as it is after about 30 s.
        JAX may drop the last reference to memory it aliased from one of its
        own threads, a moment after the array is deleted, and nothing tells
        when: so this polls, a bounded number of times, reading no clock."""
        pause = threading.Event()  # never set: wait(0.01) only pauses
        for _ in range(3000):
            gc.collect()
            now = _testing.live_host_buffers() - self.start
            if now == expected:
                break
            pause.wait(0.01)
        return now


@pytest.fixture
def live():
    """Checks that every aligned allocation a test makes is freed by its end."""
    counter = LiveBuffers()
    yield counter
    assert counter(0) == 0, "a HostBuffer allocation outlived the test"


# -- aa.empty ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty_is_aligned_and_numpy_views_it_without_copy(dtype, shape, live):
    dt = np.dtype(dtype)
    buf = aa.empty(shape, dtype)
    assert buf.address % 64 == 0
    assert (buf.shape, buf.dtype, buf.ndim) == (shape, dt, len(shape))
    size = int(np.prod(shape, dtype=np.int64))
    assert (buf.size, buf.itemsize, buf.nbytes) == (size, dt.itemsize, size * dt.itemsize)
    assert buf.exported is False

    view = np.asarray(buf)
    assert (view.dtype, view.shape) == (dt, shape)
    assert view.dtype.type is dt.type
    assert view.flags.writeable and view.flags.c_contiguous
    assert view.ctypes.data == buf.address, "np.asarray(buf) is a view, not a copy"
    # Written through one view, read through another: same memory.
    expected = pattern(shape, dt)
    view[...] = expected
    np.testing.assert_array_equal(np.asarray(buf), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_memoryview_where_numpy_has_a_format(dtype, live):
    dt = np.dtype(dtype)
    buf = aa.empty((2, 3), dtype)
    if dt in NO_PEP3118:
        with pytest.raises(BufferError, match="no PEP 3118 format"):
            memoryview(buf)
        return
    mv = memoryview(buf)
    reference = memoryview(np.empty((2, 3), dt))
    assert (mv.format, mv.itemsize, mv.shape, mv.strides) == (
        reference.format,
        reference.itemsize,
        reference.shape,
        reference.strides,
    )
    assert (mv.nbytes, mv.readonly, mv.c_contiguous) == (buf.nbytes, False, True)
    # Bytes written through the memoryview show in numpy's view.
    expected = pattern((2, 3), dt)
    mv.cast("B")[:] = expected.tobytes()
    np.testing.assert_array_equal(np.asarray(buf), expected)
    assert bytes(mv) == expected.tobytes()
    mv.release()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_readinto_fills_it_from_a_real_file(dtype, tmp_path, live):
    dt = np.dtype(dtype)
    expected = pattern((16, 9), dt)
    path = tmp_path / "tensor.bin"
    path.write_bytes(expected.tobytes())
    buf = aa.empty((16, 9), dtype)
    with open(path, "rb", buffering=0) as f:
        assert f.readinto(buf) == expected.nbytes
    np.testing.assert_array_equal(np.asarray(buf), expected)
    # Through Python's buffered reader too, and into a zero-size buffer.
    again = aa.empty((16, 9), dtype)
    with open(path, "rb") as f:
        assert f.readinto(again) == expected.nbytes
        assert f.readinto(aa.empty((0,), dtype)) == 0
    np.testing.assert_array_equal(np.asarray(again), expected)


def test_recv_into_fills_it_from_a_socket(live):
    expected = pattern((64, 32), np.float32)
    payload = expected.tobytes()
    buf = aa.empty((64, 32), np.float32)
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=a.sendall, args=(payload,))
        sender.start()
        view = memoryview(buf).cast("B")
        got = 0
        while got < len(payload):
            got += b.recv_into(view[got:])
        sender.join(WAIT)
        view.release()
    np.testing.assert_array_equal(np.asarray(buf), expected)


def test_large_buffer_is_not_zeroed_eagerly_and_is_writable_everywhere(live):
    n = 64 << 20  # 64 MiB: untouched pages cost nothing until written
    buf = aa.empty((n,), np.uint8)
    view = np.asarray(buf)
    view[:: 1 << 12] = 7  # one byte on every page
    view[-1] = 9
    assert int(view[:: 1 << 12].sum()) == 7 * (n >> 12)
    assert view[-1] == 9


# -- DLPack ----------------------------------------------------------------------------------


def test_dlpack_protocol_answers():
    buf = aa.empty((3,), np.float32)
    assert buf.__dlpack_device__() == (1, 0)  # kDLCPU, device 0
    capsule = buf.__dlpack__()
    assert 'capsule object "dltensor"' in repr(capsule)
    assert buf.exported is True
    assert "exported" in repr(buf)
    versioned = aa.empty((3,), np.float32).__dlpack__(max_version=(1, 0))
    assert 'capsule object "dltensor_versioned"' in repr(versioned)
    legacy = aa.empty((3,), np.float32).__dlpack__(max_version=(0, 8))
    assert 'capsule object "dltensor"' in repr(legacy)
    # Accepted no-ops: the CPU device, no stream, no copy.
    ok = aa.empty((3,), np.float32).__dlpack__(stream=None, dl_device=(1, 0), copy=False)
    assert 'capsule object "dltensor"' in repr(ok)


@pytest.mark.parametrize("shape", [(), (0,), (4, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_jax_from_dlpack_aliases_the_buffer(dtype, shape, live):
    buf = aa.empty(shape, dtype)
    expected = pattern(shape, dtype)
    np.asarray(buf)[...] = expected
    with x64_for(dtype):
        x = jax.dlpack.from_dlpack(buf, copy=False)
        assert (x.shape, x.dtype) == (shape, np.dtype(dtype))
        if x.size:
            assert x.unsafe_buffer_pointer() == buf.address, "JAX copied the buffer"
        np.testing.assert_array_equal(np.asarray(x), expected)
    assert buf.exported is True


def test_after_export_only_read_only_views(live):
    buf = aa.empty((4, 4), np.float32)
    np.asarray(buf)[...] = pattern((4, 4), np.float32)
    x = jax.dlpack.from_dlpack(buf, copy=False)
    assert x.unsafe_buffer_pointer() == buf.address

    with pytest.raises(BufferError, match="handed to JAX"):
        writable_buffer_request(buf)
    with pytest.raises(TypeError, match="not writable"):  # ctypes' wording of the same
        ctypes.c_char.from_buffer(buf)
    with open(__file__, "rb", buffering=0) as f, pytest.raises(TypeError, match="read-write"):
        f.readinto(buf)
    view = np.asarray(buf)
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 99.0
    mv = memoryview(buf)
    assert mv.readonly
    with pytest.raises(TypeError):
        mv.cast("B")[0] = 1
    mv.release()
    # Reading still works and sees JAX's values.
    np.testing.assert_array_equal(np.asarray(buf), np.asarray(x))
    np.testing.assert_array_equal(np.frombuffer(buf, np.float32).reshape(4, 4), np.asarray(x))


def test_after_export_bfloat16_views_are_read_only(live):
    buf = aa.empty((3,), jnp.bfloat16)
    np.asarray(buf)[...] = [1, 2, 3]
    x = jax.dlpack.from_dlpack(buf, copy=False)
    view = np.asarray(buf)
    assert view.dtype == jnp.bfloat16 and not view.flags.writeable
    assert view.ctypes.data == buf.address == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(view.astype(np.float32), [1, 2, 3])


def dlpack_flags(capsule) -> int:
    """The ``flags`` of the ``DLManagedTensorVersioned`` in an unconsumed
    ``dltensor_versioned`` capsule (after version, manager_ctx and deleter)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    get.restype = ctypes.c_void_p
    address = get(capsule, b"dltensor_versioned")
    return ctypes.c_uint64.from_address(address + 8 + 2 * ctypes.sizeof(ctypes.c_void_p)).value


READ_ONLY, IS_COPIED = 1, 2  # DLPACK_FLAG_BITMASK_READ_ONLY, _IS_COPIED


def handed_off(shape=(4, 4), dtype=np.float32):
    """A HostBuffer that a loader returned (JAX holds its memory now), and the leaf's value."""
    kept = []

    def load():
        buf = aa.empty(shape, dtype)
        np.asarray(buf)[...] = pattern(shape, dtype)
        kept.append(buf)
        return buf

    x = aa.async_wrap(load, shape=shape, dtype=dtype).result(WAIT)
    assert x.unsafe_buffer_pointer() == kept[0].address
    return kept[0], x


def test_np_from_dlpack_after_hand_off_is_a_read_only_view(live):
    buf, x = handed_off()
    view = np.from_dlpack(buf)
    assert view.ctypes.data == buf.address, "zero-copy: a view, not a copy"
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 99.0
    np.testing.assert_array_equal(view, pattern((4, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(x), pattern((4, 4), np.float32))


def test_np_from_dlpack_after_jax_from_dlpack_is_read_only(live):
    buf = aa.empty((5,), np.int32)
    np.asarray(buf)[...] = np.arange(5)
    x = jax.dlpack.from_dlpack(buf, copy=False)
    view = np.from_dlpack(buf)
    assert not view.flags.writeable and view.ctypes.data == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(view, np.arange(5))


def test_versioned_export_after_hand_off_carries_the_read_only_flag(live):
    buf, _ = handed_off()
    for version in [(1, 0), (1, 1), (2, 0)]:
        capsule = buf.__dlpack__(max_version=version)
        assert 'capsule object "dltensor_versioned"' in repr(capsule)
        assert dlpack_flags(capsule) == READ_ONLY
    # Before the hand-off, the first export hands the memory over: not read-only.
    fresh = aa.empty((3,), np.float32)
    assert dlpack_flags(fresh.__dlpack__(max_version=(1, 0))) == 0
    assert fresh.exported
    assert dlpack_flags(fresh.__dlpack__(max_version=(1, 0))) == READ_ONLY


def test_legacy_export_after_hand_off_is_refused_with_what_to_do(live):
    buf, x = handed_off()
    for kwargs in [{}, {"max_version": (0, 8)}, {"copy": False}, {"stream": None}]:
        with pytest.raises(BufferError, match=r"read-only.*max_version=\(1, 0\).*copy=True"):
            buf.__dlpack__(**kwargs)
    if jax_passes_max_version():  # JAX 0.12: a read-only export, which JAX never writes
        again = jax.dlpack.from_dlpack(buf)
        assert again.unsafe_buffer_pointer() == buf.address
    else:  # JAX 0.10: a legacy consumer
        with pytest.raises(BufferError, match="handed to JAX"):
            jax.dlpack.from_dlpack(buf)
    np.testing.assert_array_equal(np.asarray(x), pattern((4, 4), np.float32))


def jax_passes_max_version() -> bool:
    """Whether ``jax.dlpack.from_dlpack`` asks producers for DLPack >= 1.0."""
    asked = {}

    class Probe:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kwargs):
            asked.update(kwargs)
            raise BufferError("probe")

    with pytest.raises(BufferError, match="probe"):
        jax.dlpack.from_dlpack(Probe())
    return asked.get("max_version", (0, 0)) >= (1, 0)


@pytest.mark.parametrize("exported", [False, True], ids=["fresh", "handed-off"])
def test_dlpack_copy_true_is_a_writable_copy_the_consumer_owns(exported, live):
    if exported:
        buf, x = handed_off((3, 2), np.int16)
    else:
        buf = aa.empty((3, 2), np.int16)
        np.asarray(buf)[...] = pattern((3, 2), np.int16)
    copied = np.from_dlpack(buf, copy=True)
    assert copied.ctypes.data != buf.address
    assert copied.flags.writeable
    np.testing.assert_array_equal(copied, pattern((3, 2), np.int16))
    copied[...] = -1
    np.testing.assert_array_equal(np.asarray(buf), pattern((3, 2), np.int16))
    assert buf.exported is exported, "a copy hands nothing over"
    assert dlpack_flags(buf.__dlpack__(max_version=(1, 0), copy=True)) == IS_COPIED
    legacy = buf.__dlpack__(copy=True)  # a legacy consumer may ask for a copy too
    assert 'capsule object "dltensor"' in repr(legacy)
    if exported:
        np.testing.assert_array_equal(np.asarray(x), pattern((3, 2), np.int16))
    del copied, legacy


def test_a_buffer_returned_for_two_leaves_is_handed_to_jax_twice_without_a_copy(live):
    def load():
        buf = aa.empty((6,), np.float32)
        np.asarray(buf)[...] = np.arange(6)
        return {"a": buf, "b": buf}

    like = {"a": jax.ShapeDtypeStruct((6,), np.float32)}
    like["b"] = like["a"]
    tree = aa.materialize(aa.async_wrap(load, like=like), timeout=WAIT)
    assert tree["a"].unsafe_buffer_pointer() == tree["b"].unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(tree["b"]), np.arange(6))


def test_array_protocol_copy_contract(live):
    buf = aa.empty((3,), jnp.bfloat16)  # served by __array__, not the buffer protocol
    np.asarray(buf)[...] = [1.5, 2.5, -3]
    same = np.asarray(buf, dtype=jnp.bfloat16)
    assert same.ctypes.data == buf.address
    converted = np.asarray(buf, dtype=np.float32)
    assert converted.dtype == np.float32 and converted.ctypes.data != buf.address
    np.testing.assert_array_equal(converted, [1.5, 2.5, -3])
    with pytest.raises(ValueError, match="copy=False"):
        np.asarray(buf, dtype=np.float32, copy=False)
    copied = np.array(buf, copy=True)
    assert copied.ctypes.data != buf.address
    np.testing.assert_array_equal(copied.astype(np.float32), [1.5, 2.5, -3])


# -- through async_wrap -------------------------------------------------------------------


def test_host_buffer_result_reaches_jax_without_a_copy(live):
    addresses = []

    def load():
        buf = aa.empty((128, 64), np.float32)
        np.asarray(buf)[...] = pattern((128, 64), np.float32)
        addresses.append(buf.address)
        return buf

    x = aa.async_wrap(load, shape=(128, 64), dtype=np.float32)
    result = x.result(WAIT)
    assert result.unsafe_buffer_pointer() == addresses[0]
    np.testing.assert_array_equal(np.asarray(result), pattern((128, 64), np.float32))
    assert live(1) == 1
    del x, result
    assert live(0) == 0


def test_aligned_numpy_result_is_copied_once(live):
    # Even memory JAX could alias (64-byte aligned, C-contiguous, owned) is
    # copied: the loader may still hold and write it, and nothing the library
    # can test says it does not (HostBuffers are the zero-copy route).
    made = []

    def load():
        a = aligned_owned((64, 64), np.float32)
        a[...] = pattern((64, 64), np.float32)
        made.append(a)
        return a

    x = aa.async_wrap(load, shape=(64, 64), dtype=np.float32)
    result = x.result(WAIT)
    assert result.unsafe_buffer_pointer() != made[0].ctypes.data
    np.testing.assert_array_equal(np.asarray(result), pattern((64, 64), np.float32))
    made[0][...] = -1.0  # the loader writes its array after the hand-off
    np.testing.assert_array_equal(np.asarray(result), pattern((64, 64), np.float32))


def test_numpy_result_kept_only_in_a_weak_cache_is_copied(live):
    # A reference count says nothing else holds the array (a weak reference
    # does not count), yet the loader can reach it through its cache and
    # write it: aliased, that write would change the jax.Array.
    cache = weakref.WeakValueDictionary()
    address = []

    def load():
        a = aligned_owned((64, 64), np.float32)
        a[...] = 1.0
        cache["w"] = a
        address.append(a.ctypes.data)
        return a

    x = aa.async_wrap(load, shape=(64, 64), dtype=np.float32)
    result = x.result(WAIT)
    assert result.unsafe_buffer_pointer() != address[0]
    cached = cache.get("w")  # gone once copied, unless something still holds it
    if cached is not None:
        cached[...] = 5.0
    np.testing.assert_array_equal(np.asarray(result), np.ones((64, 64), np.float32))


def test_pytree_of_host_buffers_is_aliased_and_its_numpy_leaf_copied(live):
    like = {
        "dense": {
            "kernel": jax.ShapeDtypeStruct((32, 16), jnp.bfloat16),
            "bias": jax.ShapeDtypeStruct((16,), np.float32),
        },
        "embed": jax.ShapeDtypeStruct((100, 8), np.int32),
    }
    addresses = {}

    def load():
        kernel = aa.empty((32, 16), jnp.bfloat16)
        np.asarray(kernel)[...] = pattern((32, 16), jnp.bfloat16)
        bias = aligned_owned((16,), np.float32)
        bias[...] = pattern((16,), np.float32)
        embed = aa.empty((100, 8), np.int32)
        np.asarray(embed)[...] = pattern((100, 8), np.int32)
        addresses.update(kernel=kernel.address, bias=bias.ctypes.data, embed=embed.address)
        return {"embed": embed, "dense": {"bias": bias, "kernel": kernel}}

    tree = aa.async_wrap(load, like=like)
    kernel = tree["dense"]["kernel"].result(WAIT)
    bias = tree["dense"]["bias"].result(WAIT)
    embed = tree["embed"].result(WAIT)
    assert kernel.unsafe_buffer_pointer() == addresses["kernel"]
    assert bias.unsafe_buffer_pointer() != addresses["bias"]
    assert embed.unsafe_buffer_pointer() == addresses["embed"]
    np.testing.assert_array_equal(np.asarray(kernel), pattern((32, 16), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(bias), pattern((16,), np.float32))
    np.testing.assert_array_equal(np.asarray(embed), pattern((100, 8), np.int32))


def test_numpy_result_the_loader_keeps_is_copied(live):
    kept = []

    def load():
        a = aligned_owned((64, 64), np.float32)
        a[...] = 1.0
        kept.append(a)  # the loader will reuse it
        return a

    x = aa.async_wrap(load, shape=(64, 64), dtype=np.float32)
    result = x.result(WAIT)
    assert result.unsafe_buffer_pointer() != kept[0].ctypes.data
    kept[0][...] = 5.0
    np.testing.assert_array_equal(np.asarray(result), np.ones((64, 64), np.float32))


def test_numpy_leaves_in_a_pytree_are_copied_kept_or_not(live):
    like = {
        "kept": jax.ShapeDtypeStruct((8, 8), np.float32),
        "given": jax.ShapeDtypeStruct((8, 8), np.float32),
    }
    kept = []
    given_address = []

    def load():
        a = aligned_owned((8, 8), np.float32)
        a[...] = 2.0
        kept.append(a)
        b = aligned_owned((8, 8), np.float32)
        b[...] = 3.0
        given_address.append(b.ctypes.data)
        return {"kept": a, "given": b}

    tree = aa.async_wrap(load, like=like)
    kept_leaf = tree["kept"].result(WAIT)
    given_leaf = tree["given"].result(WAIT)
    assert kept_leaf.unsafe_buffer_pointer() != kept[0].ctypes.data
    assert given_leaf.unsafe_buffer_pointer() != given_address[0]
    kept[0][...] = -1.0
    np.testing.assert_array_equal(np.asarray(kept_leaf), np.full((8, 8), 2.0, np.float32))
    np.testing.assert_array_equal(np.asarray(given_leaf), np.full((8, 8), 3.0, np.float32))


def test_unaligned_numpy_result_is_copied_once_with_the_right_values(live):
    source = unaligned((33, 7), np.float32)
    source[...] = pattern((33, 7), np.float32)
    assert source.ctypes.data % 64 != 0

    x = aa.async_wrap(lambda: source, shape=(33, 7), dtype=np.float32)
    result = x.result(WAIT)
    assert result.unsafe_buffer_pointer() != source.ctypes.data
    assert result.unsafe_buffer_pointer() % 64 == 0
    np.testing.assert_array_equal(np.asarray(result), pattern((33, 7), np.float32))
    source[...] = 0
    np.testing.assert_array_equal(np.asarray(result), pattern((33, 7), np.float32))
    del x, result


def test_returned_host_buffer_refuses_new_writable_views(live):
    kept = []

    def load():
        buf = aa.empty((8,), np.int32)
        np.asarray(buf)[...] = np.arange(8)
        kept.append(buf)
        return buf

    x = aa.async_wrap(load, shape=(8,), dtype=np.int32)
    result = x.result(WAIT)
    buf = kept[0]
    assert buf.exported and result.unsafe_buffer_pointer() == buf.address
    with pytest.raises(BufferError):
        writable_buffer_request(buf)
    assert not np.asarray(buf).flags.writeable
    np.testing.assert_array_equal(np.asarray(result), np.arange(8))


# -- the live-buffer count ------------------------------------------------------------------


def test_live_count_returns_when_buffer_views_and_jax_are_deleted(live):
    buf = aa.empty((256,), np.float32)
    view = np.asarray(buf)
    mv = memoryview(buf)
    view[...] = 1.0
    x = jax.dlpack.from_dlpack(buf, copy=False)
    assert x.unsafe_buffer_pointer() == buf.address
    assert live(1) == 1
    del buf
    assert live(1) == 1, "the views still own the memory"
    del view
    mv.release()
    del mv
    assert live(1) == 1, "JAX still owns the memory"
    assert float(x.sum()) == 256.0
    del x  # JAX lets go last
    assert live(0) == 0


def test_live_count_returns_when_jax_lets_go_on_another_thread(live):
    buf = aa.empty((1024,), np.float32)
    np.asarray(buf)[...] = 2.0
    holder = [jax.dlpack.from_dlpack(buf, copy=False)]
    del buf
    assert live(1) == 1

    def drop():
        holder.clear()
        gc.collect()

    t = threading.Thread(target=drop)
    t.start()
    t.join(WAIT)
    assert live(0) == 0


def test_live_count_returns_for_unconsumed_capsules(live):
    buf = aa.empty((16,), np.float32)
    capsules = [buf.__dlpack__(), buf.__dlpack__(max_version=(1, 1))]
    del buf
    assert live(1) == 1
    del capsules
    assert live(0) == 0


def test_live_count_returns_after_async_wrap_results_are_dropped(live):
    def load():
        return {"a": aa.empty((10,), np.float32), "b": aa.empty((3, 3), np.int8)}

    like = {
        "a": jax.ShapeDtypeStruct((10,), np.float32),
        "b": jax.ShapeDtypeStruct((3, 3), np.int8),
    }
    tree = aa.async_wrap(load, like=like)
    a = tree["a"].result(WAIT)
    assert tree["b"].result(WAIT).shape == (3, 3)
    assert live(2) == 2
    del tree
    assert live(1) == 1, "the jax.Array of leaf 'a' still holds its buffer"
    del a
    assert live(0) == 0


def test_live_count_returns_when_the_loader_raised_after_allocating(live):
    def load():
        buf = aa.empty((1 << 16,), np.float32)
        view = np.asarray(buf)  # a local view, too
        view[0] = 1.0
        raise OSError("connection reset while reading the weights")

    x = aa.async_wrap(load, shape=(1 << 16,), dtype=np.float32)
    with pytest.raises(OSError, match="connection reset") as info:
        x.result(WAIT)
    assert "load" in [f.name for f in info.traceback]
    assert live(0) == 0, "the loader's frames keep no buffer alive"
    del info, x
    assert live(0) == 0


# -- misuse -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [np.longdouble, np.clongdouble, np.dtype(">f4"), object, "U3", "V4", "datetime64[s]"],
    ids=str,
)
def test_unsupported_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match=r"aa\.empty: dtype .* is not supported") as info:
        aa.empty((2,), dtype)
    assert "bfloat16" in str(info.value), "the message lists what is supported"
    with pytest.raises(TypeError, match="is not supported"):
        aa.HostBuffer((2,), dtype)


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        ((-1,), ValueError, r"aa\.empty: negative dimension in shape \(-1,\)"),
        ((2, -3), ValueError, r"aa\.empty: negative dimension in shape \(2, -3\)"),
        (-4, ValueError, r"aa\.empty: negative dimension"),
        ("ab", TypeError, r"aa\.empty: shape must be a tuple of integers"),
        (2.5, TypeError, r"aa\.empty: shape must be an integer or a tuple"),
        ((1 << 62, 1 << 62), ValueError, "more elements than an int64 counts"),
        ((1 << 62,), ValueError, "overflows the address space"),  # 2**64 bytes of float32
    ],
    ids=str,
)
def test_bad_shapes_are_refused(shape, error, message):
    with pytest.raises(error, match=message):
        aa.empty(shape, np.float32)


def test_allocation_beyond_the_address_space_is_a_memory_error(live):
    # 256 TiB: more than x86-64 user space, whatever the overcommit policy.
    with pytest.raises(MemoryError, match=f"could not allocate {1 << 48} bytes"):
        aa.empty((1 << 46,), np.float32)
    assert np.asarray(aa.empty((4,), np.float32)).shape == (4,), "the core still allocates"


def test_unknown_dtype_is_refused():
    with pytest.raises(TypeError, match=r"aa\.empty: unknown dtype 'nonsense'"):
        aa.empty((2,), "nonsense")


def test_host_buffer_constructor_checks_its_arguments(live):
    with pytest.raises(ValueError, match=r"HostBuffer: negative dimension in shape \[-1\]"):
        aa.HostBuffer((-1,), np.float32)
    buf = aa.HostBuffer([2, 3], "float32")
    assert (buf.shape, buf.dtype, buf.nbytes, buf.address % 64) == ((2, 3), np.float32, 24, 0)
    with pytest.raises(TypeError, match="0-d"):
        len(aa.empty((), np.float32))
    assert len(aa.empty((5, 2), np.float32)) == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dl_device": (2, 0)}, r"memory is on the CPU.*dl_device=\(2, 0\)"),
        ({"dl_device": (1, 1)}, r"dl_device=\(1, 1\)"),
        ({"stream": 1}, "host memory takes no stream"),
    ],
    ids=str,
)
def test_dlpack_requests_that_cannot_be_honoured(kwargs, message, live):
    buf = aa.empty((2,), np.float32)
    with pytest.raises(BufferError, match=message):
        buf.__dlpack__(**kwargs)
    assert buf.exported is False, "a refused export leaves the buffer writable"
    np.asarray(buf)[...] = 1.0


def test_a_bad_huge_pages_setting_fails_at_import():
    import os
    import subprocess
    import sys

    env = {**os.environ, "ASYNC_ARRAY_HUGE_PAGES": "yes"}
    out = subprocess.run(
        [sys.executable, "-c", "import async_array"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "ValueError: ASYNC_ARRAY_HUGE_PAGES must be 1" in out.stderr
    assert "got 'yes'" in out.stderr


@pytest.mark.parametrize("setting", ["0", "1"])
def test_huge_pages_follow_the_environment_when_it_says(setting):
    # Decided once a process: a fresh interpreter each.
    import os
    import subprocess
    import sys

    env = {**os.environ, "ASYNC_ARRAY_HUGE_PAGES": setting}
    code = "import async_array._core as c; print(c.huge_pages())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("True" if setting == "1" else "False")
    # Either way the memory is aligned and usable.
    buf = np.asarray(aa.empty((8 << 20,), np.uint8))
    buf[:] = 7
    assert buf.ctypes.data % _core.ALIGNMENT == 0 and int(buf[-1]) == 7


# -- the one-byte types of ml_dtypes -----------------------------------------------------

# Every float8 kind JAX has: DLPack 1.1 codes them, and JAX takes them in place.
FLOAT8 = [
    n
    for n in (
        "float8_e3m4",
        "float8_e4m3",
        "float8_e4m3b11fnuz",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(jnp, n)
]
# XLA packs these two or more to a byte; numpy (ml_dtypes) keeps one a byte.
PACKED = [n for n in ("int2", "uint2", "int4", "uint4", "float4_e2m1fn") if hasattr(jnp, n)]


def is_integer(dtype: np.dtype) -> bool:
    return dtype.name.lstrip("u").startswith("int")


def small_values(dtype: np.dtype, n: int) -> np.ndarray:
    """``n`` values every one-byte type holds exactly (e8m0 has only powers of two)."""
    base = np.array([1, 0, 1, 0] if is_integer(dtype) else [0.5, 1, 2, 4])
    return np.resize(base, n).astype(dtype)


@pytest.mark.parametrize("name", FLOAT8)
def test_a_float8_buffer_reaches_jax_without_a_copy(name, live):
    dt = np.dtype(getattr(jnp, name))
    buf = aa.empty((4, 3), dt)
    assert (buf.nbytes, buf.itemsize, np.asarray(buf).dtype) == (12, 1, dt)
    want = small_values(dt, 12).reshape(4, 3)
    np.asarray(buf)[...] = want
    x = aa.async_wrap(lambda: buf, like=jax.ShapeDtypeStruct((4, 3), dt)).result(timeout=WAIT)
    assert x.unsafe_buffer_pointer() == buf.address, "JAX copied the buffer"
    assert jax.typeof(x) == jax.typeof(jnp.asarray(want))
    assert np.asarray(x).tobytes() == want.tobytes()
    assert buf.exported


@pytest.mark.parametrize("name", PACKED)
def test_a_packed_type_is_held_by_its_bytes_and_copied_once_into_jax(name, live):
    dt = np.dtype(getattr(jnp, name))
    buf = aa.empty((5,), dt)
    assert (buf.nbytes, buf.itemsize, np.asarray(buf).dtype) == (5, 1, dt)
    want = small_values(dt, 5)
    np.asarray(buf)[...] = want
    with pytest.raises(BufferError, match=f"dtype {name} has no DLPack type that JAX takes"):
        buf.__dlpack__(max_version=(1, 0))
    assert not buf.exported, "a refused export hands nothing over"
    x = aa.async_wrap(lambda: buf, like=jax.ShapeDtypeStruct((5,), dt)).result(timeout=WAIT)
    assert jax.typeof(x) == jax.typeof(jnp.asarray(want))
    np.testing.assert_array_equal(np.asarray(x), want)
    np.asarray(buf)[...] = small_values(dt, 6)[1:]  # ours again: JAX has its own copy
    np.testing.assert_array_equal(np.asarray(x), want)


@pytest.mark.parametrize("name", [*FLOAT8, *PACKED, "bfloat16"])
def test_a_narrow_leaf_takes_a_wide_result_as_jnp_asarray_casts_it(name):
    dt = np.dtype(getattr(jnp, name))
    src = small_values(dt, 4).astype(np.int32 if is_integer(dt) else np.float32)
    want = jnp.asarray(src, dtype=dt)
    got = aa.async_wrap(lambda: src, shape=(4,), dtype=dt).result(timeout=WAIT)
    assert jax.typeof(got) == jax.typeof(want)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("int4", np.int32(8), r"int32 values in \[8, 8\], outside int4's range \[-8, 7\]"),
        ("uint4", np.int32(-1), r"outside uint4's range \[0, 15\]"),
        ("float8_e4m3fn", np.float32(1e6), r"beyond float8_e4m3fn's range \(it would become nan\)"),
        ("float8_e5m2", np.float32(1e6), r"beyond float8_e5m2's range \(it would become inf\)"),
    ],
)
def test_a_narrow_leaf_refuses_a_value_it_cannot_hold(name, value, message):
    # jnp.asarray would wrap 8 to -8 and turn 1e6 into nan: async_array refuses.
    dt = np.dtype(getattr(jnp, name))
    leaf = aa.async_wrap(lambda: np.full(2, value), shape=(2,), dtype=dt)
    with pytest.raises(OverflowError, match=message):
        leaf.result(timeout=WAIT)
