"""JAX accepts AsyncArray leaves, and compiles from their avals without waiting."""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jax.sharding import SingleDeviceSharding as SingleDevice

import async_array as aa
from async_array import _core, _jax_hooks

F32 = np.float32


def gated(value, **kw):
    release = threading.Event()

    def f():
        assert release.wait(30)
        return value

    return release, aa.async_wrap(f, **kw)


@pytest.mark.needs_jax_hooks
def test_hooks_are_installed_for_this_jax():
    assert _jax_hooks.ERROR is None, _jax_hooks.ERROR
    assert aa.jax_hooks_active() and not _jax_hooks.MISSING, _jax_hooks.MISSING


@pytest.mark.needs_jax_hooks
def test_jit_compiles_before_the_value_exists():
    release, x = gated(np.arange(4, dtype=F32), shape=(4,), dtype=F32)
    traced = []

    def square(v):
        traced.append(v.shape)
        return v * v

    lowered = jax.jit(square).trace(x).lower()
    compiled = lowered.compile()  # the whole compile, with x still pending
    assert traced == [(4,)] and not x.done()
    release.set()
    np.testing.assert_array_equal(compiled(x), [0, 1, 4, 9])
    np.testing.assert_array_equal(jax.jit(square)(x), [0, 1, 4, 9])


@pytest.mark.needs_jax_hooks
def test_jit_over_a_tree_of_many_leaves_waits_once(monkeypatch, pool_size):
    # XLA's compile time grows fast with the argument count (a 3000-argument
    # function takes over a minute here, with plain jax.Arrays too): 600 leaves,
    # from 600 separate tasks, all pending when jit dispatches.
    waits = []
    real_wait_all = _core.wait_all_or_failure

    def counting_wait_all(futures, timeout=None):
        waits.append(len(futures))
        gate.set()  # the loaders finish only once dispatch is waiting for them
        return real_wait_all(futures, timeout)

    monkeypatch.setattr(_core, "wait_all_or_failure", counting_wait_all)
    gate = threading.Event()
    pool_size(8)  # more loaders blocked at the gate than workers is fine too
    like = {f"w{i}": jax.ShapeDtypeStruct((2,), F32) for i in range(600)}

    def load(path, spec):
        assert gate.wait(30)
        return np.full(2, int(path[0].key[1:]), F32)

    tree = aa.async_map(load, like)
    try:
        total = jax.jit(lambda t: jnp.stack(jax.tree_util.tree_leaves(t)).sum())(tree)
    finally:
        gate.set()  # whatever happened, no loader stays blocked after this test
    assert float(total) == 2 * sum(range(600))
    assert waits == [600]  # one GIL-free wait for all 600 tasks


@pytest.mark.needs_jax_hooks
def test_vmap_grad_eval_shape_device_put_and_jnp():
    release, x = gated(np.arange(4, dtype=F32), shape=(4,), dtype=F32)
    out = jax.eval_shape(lambda v: v[:2] * 2, x)
    assert out.shape == (2,) and out.dtype == F32
    assert not x.is_ready()  # eval_shape never waits
    release.set()
    np.testing.assert_array_equal(jax.vmap(lambda v: v + 1)(x), [1, 2, 3, 4])
    np.testing.assert_array_equal(jax.grad(lambda v: (v * v).sum())(x), [0, 2, 4, 6])
    np.testing.assert_array_equal(jax.device_put(x), [0, 1, 2, 3])
    placed = jax.device_put(x, jax.devices()[1])
    assert placed.devices() == {jax.devices()[1]}
    np.testing.assert_allclose(jnp.sin(x), np.sin(np.arange(4, dtype=F32)), rtol=1e-6)
    assert float(jnp.sum(x)) == 6.0
    np.testing.assert_array_equal(jnp.stack([x, x]).shape, (2, 4))
    np.testing.assert_array_equal(jnp.asarray(x), [0, 1, 2, 3])
    np.testing.assert_array_equal(jnp.where(x > 1, x, 0), [0, 0, 2, 3])


@pytest.mark.needs_jax_hooks
def test_device_put_of_a_leaf_commits_as_for_a_jax_array():
    dev = jax.devices()
    values = np.arange(4, dtype=F32)
    committed = aa.async_wrap(lambda: values, shape=(4,), dtype=F32, sharding=SingleDevice(dev[1]))
    uncommitted = aa.async_wrap(lambda: values, shape=(4,), dtype=F32)
    twins = {"committed": jax.device_put(values, dev[1]), "uncommitted": jnp.asarray(values)}
    for name, leaf in {"committed": committed, "uncommitted": uncommitted}.items():
        twin = twins[name]
        for target in [None, dev[2], SingleDevice(dev[3])]:
            placed, expected = jax.device_put(leaf, target), jax.device_put(twin, target)
            assert (placed.committed, placed.devices()) == (expected.committed, expected.devices())
            np.testing.assert_array_equal(placed, values)
    put = jax.device_put(committed)
    assert put.committed and put.devices() == {dev[1]}
    assert put is committed.result(), "no copy, as for a committed jax.Array"
    tree = jax.device_put({"a": committed, "b": uncommitted, "c": values})
    assert tree["a"].committed and tree["a"].devices() == {dev[1]}
    assert not tree["b"].committed and not tree["c"].committed


@pytest.mark.needs_jax_hooks
def test_device_put_of_pending_leaves_waits_once_and_raises_their_failure(monkeypatch):
    waits = []
    real_wait_all = _core.wait_all_or_failure

    def counting_wait_all(futures, timeout=None):
        waits.append(len(futures))
        release.set()
        return real_wait_all(futures, timeout)

    monkeypatch.setattr(_core, "wait_all_or_failure", counting_wait_all)
    release, x = gated(
        np.ones(2, F32), shape=(2,), dtype=F32, sharding=SingleDevice(jax.devices()[2])
    )
    y = aa.async_map(lambda path, spec: (release.wait(30), np.zeros(2, F32))[1], {"y": x})
    out = jax.device_put({"x": x, "y": y})
    assert waits == [2] and out["x"].devices() == {jax.devices()[2]}
    np.testing.assert_array_equal(out["y"]["y"], [0, 0])

    def broken():
        raise OSError("404 on the weights")

    failed = aa.async_wrap(broken, shape=(2,), dtype=F32)
    with pytest.raises(OSError, match="404 on the weights"):
        jax.device_put(failed)


@pytest.mark.needs_jax_hooks
def test_make_array_from_single_device_arrays_takes_leaves_as_shards():
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    gates = [threading.Event() for _ in devices]

    def shard(i):
        def load():
            assert gates[i].wait(30)
            return np.full((2, 3), i, F32)

        return aa.async_wrap(load, shape=(2, 3), dtype=F32, sharding=SingleDevice(devices[i]))

    leaves = [shard(i) for i in range(len(devices))]
    for gate in gates:
        gate.set()  # the shards may still be loading when the call starts: it waits
    made = jax.make_array_from_single_device_arrays((4, 3), sharding, leaves)
    twin = jax.make_array_from_single_device_arrays((4, 3), sharding, [x.result() for x in leaves])
    assert made.sharding == twin.sharding and made.committed
    np.testing.assert_array_equal(made, twin)
    np.testing.assert_array_equal(made, np.repeat([0, 1], 6).reshape(4, 3))
    # Leaves and jax.Arrays mixed, and the dtype keyword, as JAX takes them.
    mixed = jax.make_array_from_single_device_arrays(
        (4, 3), sharding, arrays=(leaves[0], twin.addressable_shards[1].data), dtype=F32
    )
    np.testing.assert_array_equal(mixed, twin)
    assert (
        jax.make_array_from_single_device_arrays.__name__ == "make_array_from_single_device_arrays"
    )

    def broken():
        raise OSError("shard 1 is gone")

    bad = aa.async_wrap(broken, shape=(2, 3), dtype=F32, sharding=SingleDevice(devices[1]))
    with pytest.raises(OSError, match="shard 1 is gone"):
        jax.make_array_from_single_device_arrays((4, 3), sharding, [leaves[0], bad])


@pytest.mark.needs_jax_hooks
def test_jit_with_many_threads_dispatching_on_one_leaf():
    calls = []
    release = threading.Event()

    def f():
        calls.append(1)
        assert release.wait(60), "the test never released the loader"
        return np.ones(3, F32)

    x = aa.async_wrap(f, shape=(3,), dtype=F32)
    step = jax.jit(lambda v, k: v * k)
    outs = [None] * 8

    def run(k):
        outs[k] = float(step(x, k).sum())

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    release.set()  # some threads are dispatching by now, others may come after
    for t in threads:
        t.join(60)
    assert outs == [3.0 * k for k in range(8)] and len(calls) == 1


@pytest.mark.needs_jax_hooks
def test_sharding_named_and_like_trees():
    devices = np.array(jax.devices()[:4])
    assert devices.size == 4  # tests/conftest.py asks XLA for 4 CPU devices
    mesh = jax.sharding.Mesh(devices, ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x"))
    value = np.arange(16, dtype=F32).reshape(8, 2)

    x = aa.async_wrap(lambda: value, shape=(8, 2), dtype=F32, sharding=rows)
    assert x.sharding == rows and x.committed
    out = x.result()
    assert out.sharding.is_equivalent_to(rows, 2) and out.committed
    assert len(out.addressable_shards) == 4
    np.testing.assert_array_equal(out, value)
    np.testing.assert_array_equal(jax.jit(lambda v: v * 2)(x), value * 2)

    replicated = NamedSharding(mesh, PartitionSpec())
    like = {
        "rows": jax.ShapeDtypeStruct((8, 2), F32, sharding=rows),
        "rep": jax.ShapeDtypeStruct((3,), F32, sharding=replicated),
        "plain": jax.ShapeDtypeStruct((2,), F32),
    }
    tree = aa.async_wrap(
        lambda: {"rows": value, "rep": np.ones(3, F32), "plain": np.zeros(2, F32)}, like=like
    )
    got = aa.materialize(tree)
    assert got["rows"].sharding.is_equivalent_to(rows, 2)
    assert got["rep"].sharding.is_equivalent_to(replicated, 1)
    assert got["plain"].devices() == {jax.devices()[0]} and not got["plain"].committed

    # A prefix: one sharding for a whole subtree.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[2])
    tree = aa.async_wrap(
        lambda: {"a": {"b": np.ones(2, F32), "c": np.ones(1, F32)}, "d": np.ones(1, F32)},
        like={"a": {"b": jax.ShapeDtypeStruct((2,), F32), "c": jax.ShapeDtypeStruct((1,), F32)},
              "d": jax.ShapeDtypeStruct((1,), F32)},
        sharding={"a": one, "d": None},
    )  # fmt: skip
    got = aa.materialize(tree)
    assert got["a"]["b"].devices() == {jax.devices()[2]} == got["a"]["c"].devices()
    assert got["d"].devices() == {jax.devices()[0]}


def test_a_sharding_that_does_not_fit_is_refused_at_the_call():
    devices = np.array(jax.devices()[:4])
    assert devices.size == 4
    rows = NamedSharding(jax.sharding.Mesh(devices, ("x",)), PartitionSpec("x"))
    with pytest.raises(ValueError) as jax_own:
        jax.device_put(np.ones(3, F32), rows)
    with pytest.raises(ValueError) as ours:
        aa.async_wrap(lambda: np.ones(3, F32), shape=(3,), dtype=F32, sharding=rows)
    # JAX's own words, after the call's name.
    assert str(ours.value).endswith(
        f"<lambda>): {str(jax_own.value).split(' This error occurs at source:')[0]}"
    )


_PUBLIC_ROUTE_SCRIPT = """
import jax, numpy as np, async_array as aa
print("ACTIVE:", aa.jax_hooks_active())
x = aa.async_wrap(lambda: np.ones(2, np.float32), shape=(2,), dtype=np.float32)
try:
    jax.jit(lambda v: v + 1)(x)
except RuntimeError as e:
    print("ERROR:", e)
y = aa.jit(lambda v: v * 3)(x)
print("AA_JIT:", np.asarray(y).tolist())
print("MATERIALIZE:", aa.materialize({"x": x})["x"].tolist())
print("READY:", jax.block_until_ready({"y": y})["y"].result().tolist())
"""


def run_public_route(disable: str) -> str:
    env = dict(os.environ, ASYNC_ARRAY_DISABLE_JAX_HOOKS=disable)
    out = subprocess.run(
        [sys.executable, "-c", _PUBLIC_ROUTE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("hook", [name for name, (_, needed) in _jax_hooks.HOOKS.items() if needed])
def test_each_missing_jit_hook_leaves_the_public_route_working(hook):
    out = run_public_route(hook)
    assert "ACTIVE: False" in out
    error = next(line for line in out.splitlines() if line.startswith("ERROR:"))
    # The error names the missing hook and both public entry points.
    assert hook in error and "aa.jit" in error and "aa.materialize" in error
    assert "AA_JIT: [3.0, 3.0]" in out
    assert "MATERIALIZE: [1.0, 1.0]" in out
    assert "READY: [3.0, 3.0]" in out


def test_all_hooks_off_still_import_and_take_the_public_route():
    out = run_public_route("1")
    assert "ACTIVE: False" in out and "MATERIALIZE: [1.0, 1.0]" in out
    assert "AA_JIT: [3.0, 3.0]" in out


def test_a_hook_is_detected_by_what_it_takes():
    def four(a, b, c, d, e=None):
        pass

    assert _jax_hooks.takes(four, 4) and _jax_hooks.takes(four, 5)
    assert not _jax_hooks.takes(four, 3) and not _jax_hooks.takes(four, 6)
    assert not _jax_hooks.takes(None, 1)

    native = _NbOnly(
        "def put(aval: object, xs: collections.abc.Sequence[object], "
        "committed: bool = \\0, semantics: dict[str, int] = \\1) -> object"
    )
    assert _jax_hooks.params_of(native) == (2, 4)
    assert _jax_hooks.takes(native, 3) and not _jax_hooks.takes(native, 5)


class _NbOnly:
    """A callable whose only signature is nanobind's text, as jaxlib's functions."""

    def __init__(self, text):
        self.__nb_signature__ = ((text, None, None),)

    def __call__(self, *args):
        pass

    @property
    def __signature__(self):
        raise ValueError("no signature found for builtin")


def test_an_unknown_hook_name_in_the_environment_is_refused():
    script = "import async_array"
    env = dict(os.environ, ASYNC_ARRAY_DISABLE_JAX_HOOKS="no.such.hook")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "ASYNC_ARRAY_DISABLE_JAX_HOOKS" in out.stderr and "no.such.hook" in out.stderr


def test_python_m_async_array_prints_versions_and_the_route():
    out = subprocess.run(
        [sys.executable, "-m", "async_array"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert f"jax {jax.__version__}" in out.stdout
    route = "JAX hooks active" if aa.jax_hooks_active() else "public only"
    assert route in out.stdout
    for name in _jax_hooks.HOOKS:
        assert f"hook {name} " in out.stdout
