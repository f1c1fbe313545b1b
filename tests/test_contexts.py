"""A call's thread-local JAX settings (``jax.default_device``,
``jax.set_mesh``, ``jax.enable_x64``, ``jax.default_matmul_precision``,
``jax.numpy_rank_promotion``...) apply
to the work the pool does for it, so every producer gives what plain JAX gives
under the same settings. They are read through a private hook
(``config.Config``), which the hooks-off run turns off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import WAIT, Gate
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import async_array as aa

pytestmark = pytest.mark.needs_jax_hooks

F32 = np.float32


def double(a):
    return a * 2


@pytest.fixture
def second_device():
    devices = jax.devices()
    assert len(devices) >= 2, "the tests run with 4 CPU devices (conftest's XLA_FLAGS)"
    return devices[1]


def test_aa_jit_runs_on_the_default_device_of_its_call(second_device):
    x = np.arange(4, dtype=F32)
    f = aa.jit(double)
    with jax.default_device(second_device):
        want = jax.jit(double)(x)
        got = f(x)
    # The same program under the default device again: not the first's compile.
    elsewhere = f(x)
    assert got.result(timeout=WAIT).devices() == want.devices() == {second_device}
    assert elsewhere.result(timeout=WAIT).devices() == jax.jit(double)(x).devices()
    np.testing.assert_array_equal(got.result(timeout=WAIT), want)


def test_aa_jit_on_a_loading_input_keeps_the_calls_default_device(second_device):
    gate = Gate(np.ones(3, F32))
    x = gate.leaf()
    with jax.default_device(second_device):
        y = aa.jit(double)(x)
    gate.open()  # the compile and the run happen after the context has ended
    assert y.result(timeout=WAIT).devices() == {second_device}
    np.testing.assert_array_equal(y.result(timeout=WAIT), [2, 2, 2])


def test_every_producer_places_on_the_calls_default_device(second_device, tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones(3, F32)}, str(path))
    spec = jax.ShapeDtypeStruct((3,), F32)
    with jax.default_device(second_device):
        leaves = {
            "async_wrap": aa.async_wrap(lambda: np.ones(3, F32), like=spec),
            "async_map": aa.async_map(lambda p, s: np.ones(3, F32), {"w": spec})["w"],
            "load_safetensors": aa.load_safetensors(path)["w"],
        }
        want = jnp.ones(3, F32).devices()
    for name, leaf in leaves.items():
        assert leaf.result(timeout=WAIT).devices() == want == {second_device}, name


def test_enable_x64_applies_to_a_compile_on_the_pool():
    x = np.arange(3, dtype=np.int32)

    def widen(a):
        return a.astype(jnp.int64) + 2**40

    with jax.enable_x64(True):
        want = jax.jit(widen)(x)
        got = aa.jit(widen)(x).result(timeout=WAIT)
    assert got.dtype == want.dtype == np.int64
    np.testing.assert_array_equal(got, want)


def test_a_mesh_in_context_shards_as_jax_jit_does():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    x = np.arange(8, dtype=F32)

    def resharded(a):
        return jax.sharding.reshard(a * 2, P("x"))

    with jax.set_mesh(mesh):
        want = jax.jit(resharded)(x)
        got = aa.jit(resharded)(x).result(timeout=WAIT)
    assert got.sharding.is_equivalent_to(want.sharding, 1)
    np.testing.assert_array_equal(got, want)


# A primitive whose lowering records the matmul precision in force: lowering,
# where JAX applies that setting, runs on the pool thread that compiles.
_probe = Primitive("async_array_precision_probe")
_probe.def_abstract_eval(lambda aval: aval)
_lowered_under = []


def _lower_probe(ctx, operand):
    _lowered_under.append(jax.config.jax_default_matmul_precision)
    return [operand]


mlir.register_lowering(_probe, _lower_probe)


def test_default_matmul_precision_applies_to_a_compile_after_the_context_ended():
    gate = Gate(np.ones((2, 2), F32))
    x = gate.leaf()

    def square():  # a new function each time: no compile is shared through JAX's caches
        return lambda a: _probe.bind(a @ a)

    _lowered_under.clear()
    with jax.default_matmul_precision("highest"):
        want = jax.jit(square())(np.ones((2, 2), F32))
        y = aa.jit(square())(x)
    gate.open()  # the compile runs now, on the pool, after the with block
    np.testing.assert_array_equal(y.result(timeout=WAIT), want)
    assert _lowered_under == ["highest", "highest"]
    _lowered_under.clear()
    aa.jit(square())(np.ones((2, 2), F32)).result(timeout=WAIT)
    assert _lowered_under == [jax.config.jax_default_matmul_precision] != ["highest"]


@pytest.mark.parametrize(
    "setting",
    [
        lambda: jax.numpy_rank_promotion("raise"),
        lambda: jax.numpy_dtype_promotion("strict"),
    ],
    ids=["numpy_rank_promotion", "numpy_dtype_promotion"],
)
def test_promotion_settings_raise_as_jax_jit_does(setting):
    a, b = np.ones(3, F32), np.ones((2, 3), np.float16)

    def add(u, v):
        return u + v

    with setting():
        with pytest.raises(Exception) as theirs:
            jax.jit(add)(a, b)
        with pytest.raises(type(theirs.value)):
            aa.jit(add)(a, b)


def test_no_setting_leaks_into_the_pool_threads_afterwards(second_device):
    with jax.default_device(second_device):
        aa.jit(double)(np.ones(2, F32)).result(timeout=WAIT)
    # The same pool threads, now for a call made outside the context.
    for _ in range(8):
        leaf = aa.async_wrap(lambda: np.ones(2, F32), shape=(2,), dtype=F32)
        assert leaf.result(timeout=WAIT).devices() == {jax.devices()[0]}
