"""Per-shard loading: ``aa.make_array_from_callback`` and
``aa.async_map(..., per_shard=True)`` on the four CPU devices of ``conftest.py``."""

import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import WAIT, Gate
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import async_array as aa

F32 = np.float32
DATA = np.arange(32, dtype=F32).reshape(8, 4)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")


def _mesh():
    return jax.make_mesh((2, 2), ("data", "model"))


SPECS = {
    "sharded": PartitionSpec("data", "model"),
    "rows": PartitionSpec("data", None),
    "cols": PartitionSpec(None, "model"),
    "replicated": PartitionSpec(),
}


class Recorder:
    """A data callback that records the indices it is called with."""

    def __init__(self, data=DATA):
        self.data = data
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, index):
        with self.lock:
            self.calls.append(index)
        return self.data[index]


def _index_keys(indices):
    return sorted(tuple((s.start, s.stop, s.step) for s in i) for i in indices)


@pytest.mark.parametrize("spec", list(SPECS))
def test_make_array_from_callback_equals_jax_own(spec):
    sharding = NamedSharding(_mesh(), SPECS[spec])
    ours, theirs = Recorder(), Recorder()
    x = aa.make_array_from_callback(DATA.shape, sharding, ours, dtype=F32)
    reference = jax.make_array_from_callback(DATA.shape, sharding, theirs)
    assert x.committed and x.sharding == sharding and x.shape == DATA.shape
    got = x.result()
    assert got.sharding == reference.sharding and got.committed
    np.testing.assert_array_equal(got, reference)
    for a, b in zip(got.addressable_shards, reference.addressable_shards, strict=True):
        assert a.device == b.device and a.index == b.index
        np.testing.assert_array_equal(a.data, b.data)
    # Once per distinct index: a replicated shard is read once, not per device.
    assert _index_keys(ours.calls) == sorted(set(_index_keys(theirs.calls)))


@pytest.mark.parametrize(
    "placement",
    [SingleDeviceSharding(jax.devices()[1]), jax.devices()[2]],
    ids=["single_device", "device"],
)
def test_make_array_from_callback_on_one_device(placement):
    calls = Recorder()
    got = aa.make_array_from_callback(DATA.shape, placement, calls, dtype=F32).result()
    device = placement if isinstance(placement, jax.Device) else jax.devices()[1]
    assert got.devices() == {device} and got.committed
    np.testing.assert_array_equal(got, DATA)
    assert calls.calls == [(slice(None), slice(None))]


def test_a_partition_spec_under_set_mesh():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        x = aa.make_array_from_callback(DATA.shape, PartitionSpec("data"), Recorder(), dtype=F32)
    assert x.result().sharding == NamedSharding(mesh, PartitionSpec("data"))


def test_callbacks_run_concurrently(pool_size):
    """Four shards, four callbacks that each wait for all four to have
    started: serial calls would never get past the first."""
    pool_size(8)
    all_started = threading.Barrier(4, timeout=WAIT)

    def callback(index):
        all_started.wait()
        return DATA[index]

    sharding = NamedSharding(_mesh(), SPECS["sharded"])
    got = aa.make_array_from_callback(DATA.shape, sharding, callback, dtype=F32).result(WAIT)
    np.testing.assert_array_equal(got, DATA)


def test_returns_at_once_and_is_pending_until_every_shard_is_in(pool_size):
    pool_size(8)
    gate = Gate()
    sharding = NamedSharding(_mesh(), SPECS["rows"])
    first_row = (slice(0, 4), slice(None))

    def callback(index):
        if index == first_row:
            gate()
        return DATA[index]

    x = aa.make_array_from_callback(DATA.shape, sharding, callback, dtype=F32)
    assert gate.started.wait(WAIT)
    assert not x.done()
    gate.open()
    np.testing.assert_array_equal(x.result(WAIT), DATA)


def test_host_buffer_shards_are_not_copied():
    buffers = {}
    lock = threading.Lock()

    def callback(index):
        buf = aa.empty(DATA[index].shape, F32)
        np.asarray(buf)[...] = DATA[index]
        with lock:
            buffers[str(index)] = buf
        return buf

    sharding = NamedSharding(_mesh(), SPECS["sharded"])
    got = aa.make_array_from_callback(DATA.shape, sharding, callback, dtype=F32).result()
    np.testing.assert_array_equal(got, DATA)
    addresses = {buf.address for buf in buffers.values()}
    assert len(addresses) == 4
    assert {s.data.unsafe_buffer_pointer() for s in got.addressable_shards} == addresses
    assert all(buf.exported for buf in buffers.values())


@pytest.mark.parametrize(
    ("result", "error", "message"),
    [
        (np.zeros((1, 1), F32), ValueError, r"expected shape \(4, 4\), got \(1, 1\)"),
        (np.array([["a"] * 4] * 4), TypeError, r"expected an array or a number"),
        (np.full((4, 4), 2**40), OverflowError, r"expected dtype int32"),
        (np.zeros((4, 4), np.complex64), TypeError, r"expected dtype int32, got complex64"),
    ],
    ids=["shape", "str", "overflow", "complex"],
)
def test_a_bad_shard_names_the_call_the_index_and_the_devices(result, error, message):
    sharding = NamedSharding(_mesh(), SPECS["rows"])

    def load_rows(index):
        return result

    x = aa.make_array_from_callback((8, 4), sharding, load_rows, dtype=np.int32)
    with pytest.raises(error, match=message) as info:
        x.result(WAIT)
    text = str(info.value)
    assert "make_array_from_callback(" in text and "load_rows)" in text
    assert "shard [0:4, :]" in text or "shard [4:8, :]" in text
    assert "devices " in text
    assert str(jax.devices()[0]) in text or str(jax.devices()[2]) in text


def test_a_callback_exception_is_raised_with_its_shard_named():
    sharding = NamedSharding(_mesh(), SPECS["rows"])

    def load_rows(index):
        if index[0].start == 4:
            raise KeyError("no such shard")
        return DATA[index]

    x = aa.make_array_from_callback(DATA.shape, sharding, load_rows, dtype=F32)
    with pytest.raises(KeyError, match="no such shard") as info:
        x.result(WAIT)
    notes = "\n".join(info.value.__notes__)
    assert "load_rows) result shard [4:8, :]" in notes
    assert any(frame.name == "load_rows" for frame in info.traceback)


def test_bad_arguments_are_refused_at_the_call():
    sharding = NamedSharding(_mesh(), SPECS["rows"])
    with pytest.raises(TypeError, match="data_callback must be callable"):
        aa.make_array_from_callback((8, 4), sharding, None, dtype=F32)
    with pytest.raises(TypeError, match="needs a sharding"):
        aa.make_array_from_callback((8, 4), None, Recorder(), dtype=F32)
    with pytest.raises(ValueError, match="partitioned 2 times"):
        aa.make_array_from_callback((3, 4), sharding, Recorder(), dtype=F32)
    with pytest.raises(TypeError, match="unknown dtype"):
        aa.make_array_from_callback((8, 4), sharding, Recorder(), dtype="nope")


def test_async_map_per_shard(monkeypatch):
    mesh = _mesh()
    rows = NamedSharding(mesh, SPECS["rows"])
    like = {
        "w": jax.ShapeDtypeStruct((8, 4), F32),
        "b": jax.ShapeDtypeStruct((4,), np.int32),
        "r": jax.ShapeDtypeStruct((2, 4), F32, sharding=NamedSharding(mesh, PartitionSpec())),
    }
    full = {"w": DATA, "b": np.arange(4, dtype=np.int32), "r": DATA[:2]}
    seen = []
    lock = threading.Lock()

    def fn(key_path, spec, index):
        name = key_path[0].key
        with lock:
            seen.append((name, spec, index))
        return full[name][index]

    submissions = []
    real = aa._core.submit_many
    monkeypatch.setattr(aa._core, "submit_many", lambda *a: submissions.append(1) or real(*a))
    tree = aa.async_map(fn, like, sharding={"w": rows, "b": None, "r": None}, per_shard=True)
    got = aa.materialize(tree, timeout=WAIT)
    assert len(submissions) == 1, "one submission for the whole tree"
    for name in full:
        np.testing.assert_array_equal(got[name], full[name])
    assert got["w"].sharding == rows and got["w"].committed
    assert not got["b"].committed
    assert got["r"].sharding == like["r"].sharding
    by_leaf = {}
    for name, spec, index in seen:
        by_leaf.setdefault(name, []).append(index)
        assert spec.shape == full[name].shape and spec.dtype == full[name].dtype
        assert spec.sharding == got[name].sharding
    assert _index_keys(by_leaf["w"]) == _index_keys(
        [(slice(0, 4), slice(None)), (slice(4, 8), slice(None))]
    )
    assert len(by_leaf["b"]) == 1 and len(by_leaf["r"]) == 1


def test_async_map_per_shard_needs_three_arguments():
    like = {"w": jax.ShapeDtypeStruct((2,), F32)}
    with pytest.raises(TypeError, match=r"fn must take \(key_path, spec, index\)"):
        aa.async_map(lambda path, spec: None, like, per_shard=True)


def test_async_map_per_shard_failure_fails_only_its_leaf():
    like = {"good": jax.ShapeDtypeStruct((8, 4), F32), "bad": jax.ShapeDtypeStruct((8, 4), F32)}
    rows = NamedSharding(_mesh(), SPECS["rows"])

    def fn(key_path, spec, index):
        if key_path[0].key == "bad":
            return np.zeros((3,), F32)
        return DATA[index]

    tree = aa.async_map(fn, like, sharding=rows, per_shard=True)
    np.testing.assert_array_equal(tree["good"].result(WAIT), DATA)
    with pytest.raises(ValueError, match=r"leaf \['bad'\] shard \[\d:\d, :\] \(devices .*\): "):
        tree["bad"].result(WAIT)


# -- a call spanning processes: its readiness is agreed once, after every leaf ---------


class _FakeSource:
    def __init__(self, future, number):
        self.future = future
        self.global_ids = [number]

    def swap_future(self, future):  # as Source.swap_future
        replaced, self.future = self.future, future
        return replaced


def test_a_spanning_call_is_confirmed_once_after_its_last_leaf(monkeypatch):
    # Leaves already done when the call sets up its group run their callback
    # inside add(); the group must still count every leaf before it agrees.
    from async_array import _core, _multiprocess

    agreed = []
    monkeypatch.setattr(_multiprocess, "_confirmer", lambda: SimpleNamespace(add=agreed.append))
    done = []
    for k in range(3):
        f = _core.Future()
        f.set_result([np.float32(k)])
        done.append(f)
    pending = _core.Future()
    group = _multiprocess._Group(7, 4)
    sources = [_FakeSource(f, 7 + k) for k, f in enumerate([*done, pending])]
    for source in sources:
        group.add(source)
    assert agreed == []  # three of four leaves done: nothing to agree on yet
    pending.set_result([np.float32(3)])
    assert agreed == [group]
    _multiprocess._finish(group, {10: "process 1: async_map(f) [3]: KeyError: 'lost'"})
    values = [s.future.result(0)[0] for s in sources]
    assert values[:3] == [0.0, 1.0, 2.0]  # agreed: their own values
    assert type(values[3]).__name__ == "RemoteFailure"
    assert "process 1: async_map(f) [3]: KeyError: 'lost'" in str(values[3])


ONE_BYTE_TYPES = [
    n
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "int4", "uint4", "float4_e2m1fn")
    if hasattr(jax.numpy, n)
]


@pytest.mark.parametrize("name", ONE_BYTE_TYPES)
@pytest.mark.parametrize("cast", [False, True], ids=["own_dtype", "cast"])
def test_make_array_from_callback_builds_one_byte_types_as_jax_does(name, cast):
    dt = np.dtype(getattr(jax.numpy, name))
    integer = dt.name.lstrip("u").startswith("int")
    values = np.resize(np.array([1, 0, 1, 0] if integer else [0.5, 1, 2, 4]), (8, 4))
    wide = values.astype(np.int32 if integer else F32)
    sharding = NamedSharding(_mesh(), SPECS["sharded"])
    # cast: the callback returns int32/float32 and the leaf casts (same_kind) as jnp.asarray.
    x = aa.make_array_from_callback(
        (8, 4), sharding, lambda i: wide[i] if cast else wide[i].astype(dt), dtype=dt
    )
    reference = jax.make_array_from_callback((8, 4), sharding, lambda i: wide[i].astype(dt))
    got = x.result(timeout=WAIT)
    assert jax.typeof(got) == jax.typeof(reference) and got.sharding == reference.sharding
    assert np.asarray(got).tobytes() == np.asarray(reference).tobytes()
