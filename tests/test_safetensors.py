"""aa.load_safetensors from local files: every dtype bit-exact against the
safetensors package, like= checks, malformed headers, the byte budget,
progress."""

import errno
import gc
import json
import os
import pathlib
import re
import struct
import sys
import threading
import weakref

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from conftest import WAIT, Gate, wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import _safetensors_rust as st_rust

import async_array as aa
from async_array import _core, _safetensors
from async_array._core import _testing

# safetensors dtype name -> numpy dtype (as JAX has them).
ST_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "C64": np.dtype(np.complex64),
}


@pytest.fixture
def x64():
    """64-bit types kept as they are for this test."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def random_bits(dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Arbitrary bit patterns of ``dtype`` (NaNs, infs, subnormals included),
    but valid booleans."""
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def write_with_safetensors(path, arrays: dict[str, tuple[str, np.ndarray]]) -> None:
    """Writes a file with the safetensors package's own serializer."""
    alive = {name: np.array(a, order="C") for name, (_, a) in arrays.items()}
    tensors = {
        name: st_rust.TensorSpec(
            dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for name, a in alive.items()
    }
    st_rust.serialize_file(tensors, str(path))
    with open(path, "rb") as f:  # the package wrote the dtype we meant
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert {k: header[k]["dtype"] for k in arrays} == {k: st for k, (st, _) in arrays.items()}


def write_raw(path, header: object, data: bytes = b"", length: int | None = None) -> None:
    """Writes a file with any header (malformed ones included)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)


@pytest.mark.parametrize("st_name", list(ST_DTYPES))
def test_every_dtype_loads_bit_exact(tmp_path, x64, st_name):
    dtype = ST_DTYPES[st_name]
    rng = np.random.default_rng(len(st_name))
    arrays = {
        "w": (st_name, random_bits(dtype, (3, 5, 7), rng)),
        "scalar": (st_name, random_bits(dtype, (), rng)),
        "empty": (st_name, random_bits(dtype, (0, 4), rng)),
    }
    path = tmp_path / "m.safetensors"
    write_with_safetensors(path, arrays)
    tree = aa.load_safetensors(path)
    assert list(tree) == ["empty", "scalar", "w"] or set(tree) == set(arrays)
    got = aa.materialize(tree, timeout=30)
    reference = None
    if st_name in safetensors.numpy._TYPES:
        reference = safetensors.numpy.load_file(str(path))
    for name, (_, want) in arrays.items():
        out = np.asarray(got[name])
        assert got[name].dtype == dtype, name
        assert out.shape == want.shape
        assert out.tobytes() == want.tobytes(), name
        if reference is not None:
            assert out.tobytes() == reference[name].tobytes(), name
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(got)


@pytest.mark.parametrize("st_name", ["I64", "U64", "F64"])
def test_64_bit_tensors_come_as_32_bit_without_x64(tmp_path, st_name):
    assert not jax.config.jax_enable_x64
    want = np.arange(12, dtype=ST_DTYPES[st_name]).reshape(3, 4)
    path = tmp_path / "m.safetensors"
    write_with_safetensors(path, {"t": (st_name, want)})
    got = aa.materialize(aa.load_safetensors(path), timeout=30)["t"]
    assert got.dtype == jax.dtypes.canonicalize_dtype(want.dtype)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_file_url_and_zero_copy(tmp_path, monkeypatch):
    want = np.arange(4096, dtype=np.float32).reshape(64, 64)
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"a": want, "b": want[:3]}, str(path))
    addresses = {}
    convert = _safetensors._read.convert_one

    def recording(specs, i, value):
        if isinstance(value, aa.HostBuffer):
            addresses[i] = value.address
        return convert(specs, i, value)

    monkeypatch.setattr(_safetensors._read, "convert_one", recording)
    tree = aa.load_safetensors(f"file://{path}")
    arrays = aa.materialize(tree, timeout=30)
    np.testing.assert_array_equal(np.asarray(arrays["a"]), want)
    np.testing.assert_array_equal(np.asarray(arrays["b"]), want[:3])
    assert sorted(addresses.values()) == sorted(a.unsafe_buffer_pointer() for a in arrays.values())


def test_like_flat_and_nested_return_at_once_and_read_only_those(tmp_path):
    rng = np.random.default_rng(0)
    data = {
        "enc.layer.0.w": rng.standard_normal((4, 3)).astype(np.float32),
        "enc.layer.0.b": rng.standard_normal((3,)).astype(np.float32),
        "head": rng.standard_normal((2,)).astype(np.float16),
    }
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(data, str(path))
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    flat = {k: spec(v) for k, v in data.items() if k != "head"}
    got = aa.materialize(aa.load_safetensors(path, like=flat), timeout=30)
    assert set(got) == set(flat)
    for k in flat:
        np.testing.assert_array_equal(np.asarray(got[k]), data[k])
    nested = {
        "enc": {"layer": {"0": {"w": spec(data["enc.layer.0.w"])}}},
        "head": spec(data["head"]),
    }
    got = aa.materialize(aa.load_safetensors(path, like=nested), timeout=30)
    np.testing.assert_array_equal(np.asarray(got["enc"]["layer"]["0"]["w"]), data["enc.layer.0.w"])
    np.testing.assert_array_equal(np.asarray(got["head"]), data["head"])


def test_like_mismatches_fail_their_own_leaves_naming_expected_and_found(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(
        {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32), "c": np.ones(2, np.int8)},
        str(path),
    )
    like = {
        "a": jax.ShapeDtypeStruct((3, 2), np.float32),
        "b": jax.ShapeDtypeStruct((4,), np.int32),  # float to int: no same_kind cast
        "c": jax.ShapeDtypeStruct((2,), np.int8),
        "missing": jax.ShapeDtypeStruct((1,), np.float32),
    }
    tree = aa.load_safetensors(path, like=like)
    np.testing.assert_array_equal(np.asarray(tree["c"].result(timeout=30)), [1, 1])
    with pytest.raises(
        ValueError, match=r"tensor 'a'.*expected shape \(3, 2\).*found shape \(2, 3\)"
    ):
        tree["a"].result(timeout=30)
    with pytest.raises(
        ValueError,
        match=r"tensor 'b'.*dtype int32.*found.*dtype float32 \(F32\); float32 does not cast",
    ):
        tree["b"].result(timeout=30)
    with pytest.raises(KeyError, match="tensor 'missing' is not in"):
        tree["missing"].result(timeout=30)


def test_like_with_a_missing_file_fails_every_leaf(tmp_path):
    like = {"a": jax.ShapeDtypeStruct((1,), np.float32)}
    tree = aa.load_safetensors(tmp_path / "nope.safetensors", like=like)
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors"):
        tree["a"].result(timeout=30)


def test_missing_file_raises_at_the_call(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"load_safetensors: no such file: .*nope\.safet"):
        aa.load_safetensors(tmp_path / "nope.safetensors")
    # As open() raises it: code that reads errno and filename finds them.
    with pytest.raises(FileNotFoundError) as info:
        aa.load_safetensors(str(tmp_path / "nope.safetensors"))
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(tmp_path / "nope.safetensors")


def test_a_directory_is_is_a_directory_error_with_its_errno_at_the_call(tmp_path):
    # As open() raises it: errno, and the path as filename.
    with pytest.raises(IsADirectoryError) as info:
        aa.load_safetensors(tmp_path)
    assert info.value.errno == errno.EISDIR
    assert info.value.strerror == "load_safetensors: is a directory, not a file"
    assert info.value.filename == str(tmp_path)


def entry(dtype="F32", shape=(2,), offsets=(0, 8), **drop):
    e = {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}
    return {k: v for k, v in e.items() if k not in drop}


GOOD = {"t": entry()}
D8 = b"\0" * 8
FILE_BYTES = r"\(file bytes \[\d+, \d+\)\)"

MALFORMED = [
    # (header, data bytes, header length or None, what the message says)
    (GOOD, D8, 3_000_000_000, r"header length 3000000000 \(bytes \[0, 8\)\) exceeds"),
    (GOOD, D8, 2**62, r"header length 4611686018427387904 \(bytes \[0, 8\)\) exceeds"),
    (GOOD, D8, 5000, r"header length 5000 \(bytes \[0, 8\)\) goes beyond the file"),
    ([1, 2], b"", None, r"header \(bytes \[8, 14\)\) is not a JSON object: it is a list"),
    (b"{nope", b"", None, r"header \(bytes \[8, 13\)\) is not valid JSON"),
    ({"t": entry(dtype=None)}, D8, None, 'tensor "t": dtype must be a string'),
    ({"t": {"shape": [2], "data_offsets": [0, 8]}}, D8, None, 'tensor "t": .* has no dtype'),
    ({"t": entry("F4", offsets=(0, 1))}, b"\0", None,
     'tensor "t": dtype "F4" cannot be loaded: 4-bit floats packed'),
    ({"t": entry(shape=(4,), offsets=(0, 16))}, D8, None,
     rf'tensor "t": data_offsets \[0, 16\) {FILE_BYTES} out of bounds'),
    ({"t": entry(shape=(3,))}, D8, None,
     r'tensor "t": data_offsets \[0, 8\).*hold 8 bytes, but shape \[3\] of F32 needs 12'),
    ({"t": entry(), "u": entry(shape=(1,), offsets=(4, 8))}, D8, None,
     rf'tensors "t" {FILE_BYTES} and "u" {FILE_BYTES} overlap'),
]  # fmt: skip


@pytest.mark.parametrize("header,data,length,message", MALFORMED)
def test_malformed_headers_raise_naming_file_tensor_and_bytes(
    tmp_path, header, data, length, message
):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data, length)
    with pytest.raises(ValueError, match=message) as info:
        aa.load_safetensors(path)
    assert str(info.value).startswith(f"load_safetensors: {path}")
    # With like=, the same error fails the leaves.
    tree = aa.load_safetensors(path, like={"t": jax.ShapeDtypeStruct((2,), np.float32)})
    with pytest.raises(ValueError, match=message):
        tree["t"].result(timeout=30)


def test_a_file_shorter_than_8_bytes(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="3 bytes, shorter than the 8-byte header length"):
        aa.load_safetensors(path)


def after_each_pump(monkeypatch, field: str) -> list[int]:
    """Patches the load's ``pump`` to append ``field`` of the load (read
    under its lock) after each call; returns that list."""
    seen: list[int] = []
    pump = _safetensors._plan.Load.pump

    def watched(self):
        pump(self)
        with self.lock:
            seen.append(getattr(self, field))

    monkeypatch.setattr(_safetensors._plan.Load, "pump", watched)
    return seen


def test_max_bytes_in_flight_bounds_what_is_allocated(tmp_path, monkeypatch):
    arrays = {f"t{i:02d}": np.full((256,), i, np.float32) for i in range(20)}  # 1 KiB each
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    peaks = after_each_pump(monkeypatch, "in_flight")
    aa.configure(max_workers=4)
    try:
        tree = aa.load_safetensors(path, max_bytes_in_flight=2500)
        got = aa.materialize(tree, timeout=30)
    finally:
        aa.configure(max_workers=None)
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v)
    assert peaks and max(peaks) <= 2048


def test_reads_of_a_local_file_run_on_one_core_fewer_than_there_are(tmp_path, monkeypatch):
    # 128 KiB tensors: one job each. Without the bound every job starts at once.
    arrays = {f"t{i:02d}": np.full((32768,), i, np.float32) for i in range(12)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    peaks = after_each_pump(monkeypatch, "local_jobs")
    monkeypatch.setattr(_safetensors._plan, "local_readers", lambda: 2)
    aa.configure(max_workers=6)
    try:
        got = aa.materialize(aa.load_safetensors(path), timeout=30)
    finally:
        aa.configure(max_workers=None)
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v)
    assert peaks and max(peaks) == 2


def test_local_readers_leave_a_core_but_never_go_below_one(monkeypatch):
    monkeypatch.setattr(_safetensors._plan.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert _safetensors._plan.local_readers() == 3
    monkeypatch.setattr(_safetensors._plan.os, "sched_getaffinity", lambda pid: {0})
    assert _safetensors._plan.local_readers() == 1


def test_a_tensor_larger_than_the_budget_still_loads_alone(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"big": np.ones(1000, np.float32)}, str(path))
    got = aa.materialize(aa.load_safetensors(path, max_bytes_in_flight=10), timeout=30)
    np.testing.assert_array_equal(np.asarray(got["big"]), np.ones(1000, np.float32))


def test_progress_callable_gets_bytes_done_and_total(tmp_path):
    arrays = {f"t{i}": np.zeros(100 * (i + 1), np.uint8) for i in range(5)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    calls = []
    lock = threading.Lock()

    def progress(done, total):
        with lock:
            calls.append((done, total))

    aa.materialize(aa.load_safetensors(path, progress=progress), timeout=30)
    with lock:
        assert calls[0] == (0, 1500)  # before any read ends: a bar shows at once
        assert calls[-1] == (1500, 1500)
        done = [d for d, _ in calls]
        assert done == sorted(set(done))  # forward only, each read counted once
        assert {t for _, t in calls} == {1500}


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"max_bytes_in_flight": 0}, ValueError, "max_bytes_in_flight must be a positive int"),
        ({"max_bytes_in_flight": -5}, ValueError, "max_bytes_in_flight .* got -5"),
        ({"max_bytes_in_flight": 1.5}, TypeError, "max_bytes_in_flight .* got float 1.5"),
        ({"retries": -1}, ValueError, r"retries must be an int from 0 to \d+, got -1"),
        ({"retries": 2**32}, ValueError, r"retries must be an int from 0 to \d+, got 4294967296"),
        ({"retries": 1.0}, TypeError, "retries must be an int .* got float 1.0"),
        ({"timeout": "soon"}, TypeError, "timeout must be a positive number .* got str 'soon'"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds or None, got 0"),
        ({"timeout": -1.0}, ValueError, "timeout must be a positive number .* got -1.0"),
        ({"timeout": float("nan")}, ValueError, "timeout must be a positive number .* got nan"),
        ({"progress": 3}, TypeError, "progress must be"),
    ],
)
def test_bad_arguments_raise_at_the_call(tmp_path, kwargs, error, message):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"a": np.zeros(1, np.float32)}, str(path))
    with pytest.raises(error, match=f"^load_safetensors: {message}"):
        aa.load_safetensors(path, **kwargs)
    with pytest.raises(error, match=f"^load_safetensors: {message}"):
        aa.load_safetensors(path, like={"a": jax.ShapeDtypeStruct((1,), np.float32)}, **kwargs)
    with pytest.raises(TypeError, match="source must be a path"):
        aa.load_safetensors(3)


def test_a_header_failure_seen_once_is_not_logged_for_the_other_leaves(tmp_path, async_array_log):
    """With like=, a missing file fails every leaf; the user who got that
    exception from one leaf retrieved it: nothing is logged when the leaves go."""
    import gc

    like = {k: jax.ShapeDtypeStruct((1,), np.float32) for k in "abc"}
    tree = aa.load_safetensors(tmp_path / "nope.safetensors", like=like)
    with pytest.raises(FileNotFoundError):
        aa.materialize(tree, timeout=30)
    del tree
    gc.collect()
    # Nobody retrieves the second load's: one record for the call, not three.
    tree = aa.load_safetensors(tmp_path / "nope.safetensors", like=like)
    aa.wait(tree, timeout=30)
    del tree
    gc.collect()
    records = async_array_log.wait_for(1, "the unretrieved failure to be logged")
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "failed and no leaf's exception was ever retrieved" in records[0].getMessage()


def test_a_raising_progress_callback_is_logged_and_the_load_goes_on(tmp_path, caplog):
    arrays = {f"t{i}": np.full(10, i, np.int32) for i in range(4)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))

    def progress(done, total):
        raise RuntimeError("bar broke")

    aa.configure(max_workers=1)
    try:
        got = aa.materialize(
            aa.load_safetensors(path, progress=progress, max_bytes_in_flight=40), timeout=30
        )
    finally:
        aa.configure(max_workers=None)
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v)
    assert "the progress callback raised" in caplog.text


def test_progress_true_shows_one_tqdm_bar_on_stderr(tmp_path, capsys):
    import tqdm  # noqa: F401  (in the test extra: missing is a broken set-up)

    arrays = {f"t{i}": np.zeros(1000, np.uint8) for i in range(3)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    aa.materialize(aa.load_safetensors(path, progress=True), timeout=30)
    err = capsys.readouterr().err
    assert "load_safetensors" in err
    assert "3.00k/3.00k" in err


def test_header_tensors_are_named_frozen_records(tmp_path):
    path = tmp_path / "m.safetensors"
    header = {
        "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "a": {"dtype": "F32", "shape": [], "data_offsets": [12, 16]},
    }
    write_raw(path, header, bytes(16))
    base = 8 + len(json.dumps(header).encode())
    b, a = aa._core.SafetensorsFile(str(path)).tensors  # file order
    got = [(t.name, t.dtype, t.numpy_dtype, t.shape, t.start, t.end) for t in (b, a)]
    assert got == [
        ("b", "BF16", "bfloat16", (2, 3), base, base + 12),
        ("a", "F32", "float32", (), base + 12, base + 16),
    ]
    assert repr(b) == (
        f"TensorInfo(name='b', dtype='BF16', numpy_dtype='bfloat16', shape=(2, 3), "
        f"start={base}, end={base + 12})"
    )
    with pytest.raises(AttributeError):
        b.start = 0


# -- a file that changes during a load, and files that are not regular ----------------


def reads_queued(pool_size, path):
    """Loads ``path`` with its header read and every tensor read queued behind
    a worker held by a gate; returns the leaves and the gate."""
    pool_size(1)
    blocker = Gate(np.zeros(1, np.float32))
    blocker.leaf()
    wait_for(blocker.started, "the only worker to be taken")
    return aa.load_safetensors(path), blocker


def test_a_file_grown_after_its_header_was_read_fails_its_leaves(tmp_path, pool_size):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, str(path))
    tree, blocker = reads_queued(pool_size, path)
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    blocker.open()
    exc = tree["w"].exception(timeout=WAIT)
    assert isinstance(exc, OSError)
    assert re.search(
        r'tensor "w" .*the file changed since its header was read \(its size was \d+ bytes',
        str(exc),
    ), str(exc)


def test_a_file_rewritten_in_place_fails_its_leaves(tmp_path, pool_size):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, str(path))
    before = os.stat(path).st_mtime_ns
    tree, blocker = reads_queued(pool_size, path)
    os.utime(path, ns=(before, before + 1_000_000_000))  # as a write in place leaves it
    blocker.open()
    with pytest.raises(OSError, match=r"changed since its header was read \(it was modified\)"):
        tree["w"].result(timeout=WAIT)


def test_a_file_replaced_by_a_rename_reads_the_file_its_header_came_from(tmp_path, pool_size):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, str(path))
    tree, blocker = reads_queued(pool_size, path)
    safetensors.numpy.save_file({"w": np.zeros((8,), np.float16)}, str(tmp_path / "new"))
    os.replace(tmp_path / "new", path)
    blocker.open()
    np.testing.assert_array_equal(tree["w"].result(timeout=WAIT), np.ones((4, 4), np.float32))


def test_a_fifo_is_refused_at_the_call(tmp_path):
    fifo = tmp_path / "m.safetensors"
    os.mkfifo(fifo)
    like = {"w": jax.ShapeDtypeStruct((2,), np.float32)}
    for kwargs in ({}, {"like": like}):
        with pytest.raises(ValueError, match=r"load_safetensors: .*m.safetensors: is a FIFO"):
            aa.load_safetensors(fifo, **kwargs)


def test_a_fifo_named_by_an_index_fails_its_leaves_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "part.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "part.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"part.safetensors: is a FIFO \(named pipe\)"):
        aa.materialize(aa.load_safetensors(tmp_path / "model.safetensors.index.json"), WAIT)


# -- what a source may be ------------------------------------------------------------


def test_any_path_python_takes_loads_utf8_or_not(tmp_path):
    folder = os.fsencode(tmp_path)
    path = os.path.join(folder, b"caf\xe9.safetensors")  # Latin-1: not UTF-8
    w = np.arange(3, dtype=np.float32)
    safetensors.numpy.save_file({"w": w}, os.fsdecode(path))
    for source in (path, os.fsdecode(path), pathlib.Path(os.fsdecode(path))):
        got = aa.materialize(aa.load_safetensors(source), WAIT)
        np.testing.assert_array_equal(got["w"], w)


def test_a_files_contents_passed_as_its_source_is_a_short_type_error(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.zeros(100_000, np.float32)}, str(path))
    with pytest.raises(TypeError) as info:
        aa.load_safetensors(path.read_bytes())
    assert len(str(info.value)) < 200
    assert "got bytes of length 400" in str(info.value) and "a file's contents?" in str(info.value)


# -- a progress callback that waits on the load's own leaves ---------------------------


def test_a_progress_callback_may_wait_on_later_leaves_of_its_load(tmp_path, pool_size):
    # One read job a tensor (local tensors over 64 KiB are not grouped), and
    # one worker: the callback's wait must not hold up the reads it waits for.
    pool_size(1)
    arrays = {f"t{i}": np.full(40_000, i, np.float32) for i in range(4)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    seen = []
    tree = {}
    returned = threading.Event()

    def progress(done, total):
        if done and not seen:
            wait_for(returned, "load_safetensors to return")
            seen.append(float(tree["t3"].result(timeout=WAIT)[0]))

    tree.update(aa.load_safetensors(path, progress=progress, max_bytes_in_flight=200_000))
    returned.set()
    got = aa.materialize(tree, WAIT)
    assert seen == [3.0]
    np.testing.assert_array_equal(got["t2"], arrays["t2"])


def test_a_progress_callback_waiting_on_a_leaf_its_own_read_makes_gets_a_cycle_error(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones(4, np.float32)}, str(path))
    errors = []
    tree = {}
    returned = threading.Event()

    def progress(done, total):
        if done:
            wait_for(returned, "load_safetensors to return")
            try:
                tree["w"].result(timeout=WAIT)
            except aa.WaitCycleError as exc:
                errors.append(str(exc))

    tree.update(aa.load_safetensors(path, progress=progress))
    returned.set()
    np.testing.assert_array_equal(tree["w"].result(timeout=WAIT), np.ones(4, np.float32))
    assert len(errors) == 1 and "load_safetensors" in errors[0], errors


def test_the_load_keeps_no_value_of_a_leaf_it_handed_out(tmp_path):
    arrays = {"a": np.ones(40_000, np.float32), "b": np.zeros(40_000, np.float32)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    release = threading.Event()

    def progress(done, total):
        if done == total:  # the last read's report: the load is still running
            wait_for(release, "the test to let the load end")

    tree = aa.load_safetensors(path, progress=progress, max_bytes_in_flight=160_000)
    try:
        value = tree.pop("a").result(timeout=WAIT)
        gone = weakref.ref(value)
        del value
        gc.collect()
        assert gone() is None  # a streaming consumer's peak is what it holds itself
    finally:
        release.set()
    np.testing.assert_array_equal(tree["b"].result(timeout=WAIT), arrays["b"])


# -- what a first-time user reaches for ------------------------------------------------


def test_the_result_is_in_the_files_order(tmp_path):
    path = tmp_path / "m.safetensors"
    write_raw(path, {"z": entry(offsets=(0, 8)), "a": entry(offsets=(8, 16))}, D8 + D8)
    assert list(aa.load_safetensors(path)) == ["z", "a"]  # by offset, not sorted by name


def test_sharding_as_a_rule_shards_axis_0_where_it_divides(tmp_path):
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    arrays = {"even": np.arange(8, dtype=np.float32).reshape(4, 2), "odd": np.ones(3, np.int32)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    calls = []

    def rule(name, shape, dtype):
        calls.append((name, shape, dtype))
        return NamedSharding(mesh, P("x")) if shape[0] % 2 == 0 else None

    tree = aa.load_safetensors(path, sharding=rule)
    assert sorted(calls) == [
        ("even", (4, 2), np.dtype(np.float32)),
        ("odd", (3,), np.dtype(np.int32)),
    ]
    got = aa.materialize(tree, WAIT)
    assert got["even"].sharding == NamedSharding(mesh, P("x"))
    assert not tree["odd"].committed  # None: the default placement
    for name, value in arrays.items():
        np.testing.assert_array_equal(got[name], value)


def test_a_rule_that_raises_names_the_tensor(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, str(path))

    def rule(name, shape, dtype):
        raise RuntimeError("no mesh for this one")

    with pytest.raises(RuntimeError, match="no mesh") as info:
        aa.load_safetensors(path, sharding=rule)
    assert "load_safetensors: raised by sharding('w', (2,), float32)" in info.value.__notes__


def test_a_sharding_dict_missing_tensors_names_them(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({k: np.ones(2, np.float32) for k in "abc"}, str(path))
    with pytest.raises(ValueError, match=r"sharding has no entry for 'b', 'c' \(None places"):
        aa.load_safetensors(path, sharding={"a": jax.devices()[0]})


def test_progress_true_without_tqdm_prints_a_plain_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm then raises ImportError
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.zeros(2_000_000, np.uint8)}, str(path))
    aa.materialize(aa.load_safetensors(path, progress=True), timeout=WAIT)
    err = capsys.readouterr().err
    assert err.endswith("\rload_safetensors: 100% of 2.0 MB\n"), repr(err)


def test_index_and_url_errors_start_with_the_call(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    cases = {
        "{nope": "the index is not valid JSON",
        '{"weight_map": 3}': 'an index needs a "weight_map" object',
        '{"weight_map": {"w": "../x.safetensors"}}': "is not a file name",
    }
    for text, message in cases.items():
        index.write_text(text)
        with pytest.raises(ValueError) as info:
            aa.load_safetensors(index)
        assert str(info.value).startswith(f"load_safetensors: {index}: "), str(info.value)
        assert message in str(info.value)
    with pytest.raises(FileNotFoundError) as missing:
        aa.load_safetensors(tmp_path / "gone.index.json")
    assert str(missing.value.strerror).startswith("load_safetensors: ")
    assert missing.value.errno == errno.ENOENT
    bad_url = r"^load_safetensors: http://\[::1/model.safetensors: not a valid URL \(Invalid IPv6"
    with pytest.raises(ValueError, match=bad_url):
        aa.load_safetensors("http://[::1/model.safetensors")


def test_safetensors_header_reads_specs_and_metadata_without_a_tensor(tmp_path):
    arrays = {"b": np.ones((2, 3), np.float32), "a": np.arange(4, dtype=np.int64)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "pt", "k": "v"})
    before = _testing.tensor_bytes_read()
    header = aa.safetensors_header(path)
    assert _testing.tensor_bytes_read() == before  # headers only
    assert isinstance(header, aa.SafetensorsHeader)
    names = [t.name for t in safetensors_rust_order(path)]
    assert list(header.specs) == names  # the file's order
    assert header.specs["b"] == jax.ShapeDtypeStruct((2, 3), np.float32)
    assert header.specs["a"].dtype == jax.dtypes.canonicalize_dtype(np.int64)
    assert header.metadata == {"format": "pt", "k": "v"}
    # What it gives is a like tree as it is.
    got = aa.materialize(aa.load_safetensors(path, like=header.specs), WAIT)
    np.testing.assert_array_equal(got["b"], arrays["b"])


def safetensors_rust_order(path):
    """The tensors of ``path`` by offset, as the core reads them."""
    return _core.SafetensorsFile(str(path)).tensors


def test_safetensors_header_follows_an_index_and_refuses_what_the_load_refuses(tmp_path):
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, str(tmp_path / "p1.safetensors"))
    safetensors.numpy.save_file(
        {"y": np.ones(3, np.float16)}, str(tmp_path / "p2.safetensors"), metadata={"f": "2"}
    )
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "p1.safetensors", "y": "p2.safetensors"}}))
    header = aa.safetensors_header(index)
    assert header.specs == {
        "x": jax.ShapeDtypeStruct((2,), np.float32),
        "y": jax.ShapeDtypeStruct((3,), np.float16),
    }
    assert header.metadata == {"f": "2"}
    bad = tmp_path / "bad.safetensors"
    write_raw(bad, {"t": entry(shape=(1,), offsets=(4, 8))}, D8)
    with pytest.raises(ValueError, match=r"^safetensors_header: .*belong to no tensor"):
        aa.safetensors_header(bad)
    with pytest.raises(TypeError, match=r"^safetensors_header: timeout must be a positive number"):
        aa.safetensors_header(index, timeout="soon")
    with pytest.raises(FileNotFoundError, match=r"^\[Errno 2\] safetensors_header: ") as info:
        aa.safetensors_header(tmp_path / "missing.safetensors")
    assert info.value.errno == errno.ENOENT and info.value.filename == str(
        tmp_path / "missing.safetensors"
    )
    with pytest.raises(TypeError, match=r"^safetensors_header: source must be"):
        aa.safetensors_header(3)
