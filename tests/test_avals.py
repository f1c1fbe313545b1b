"""A leaf's type is the type JAX gives the same array: the sharding (mesh,
spec, Explicit or Auto axes) is part of the aval, for every producer and for
the materialized value, so ``jax.jit`` traces the same program and raises the
same errors on a leaf as on JAX's own array."""

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import WAIT
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import async_array as aa

pytestmark = pytest.mark.needs_jax_hooks

F32 = np.float32
VALUE = np.arange(16, dtype=F32).reshape(8, 2)


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def sharding(request):
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(request.param,) * 2)
    return NamedSharding(mesh, P("x", "y"))


def producers(sharding, tmp_path):
    """One leaf of VALUE, placed by ``sharding``, from each producer."""
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": VALUE}, str(path))
    spec = jax.ShapeDtypeStruct(VALUE.shape, F32, sharding=sharding)
    return {
        "async_wrap": aa.async_wrap(lambda: VALUE, like=spec),
        "async_map": aa.async_map(lambda p, s: VALUE, {"w": spec})["w"],
        "async_map per_shard": aa.async_map(
            lambda p, s, index: VALUE[index], {"w": spec}, per_shard=True
        )["w"],
        "make_array_from_callback": aa.make_array_from_callback(
            VALUE.shape, sharding, lambda index: VALUE[index], dtype=F32
        ),
        "load_safetensors": aa.load_safetensors(path, sharding={"w": sharding})["w"],
        "aa.jit": aa.jit(lambda a: a + 0, out_shardings=sharding)(VALUE),
    }


def test_every_producers_leaf_has_jaxs_type(sharding, tmp_path):
    want = jax.typeof(jax.device_put(VALUE, sharding))
    assert want.sharding.mesh.axis_names == ("x", "y")  # the type JAX gives holds the mesh
    for name, leaf in producers(sharding, tmp_path).items():
        assert jax.typeof(leaf) == want, name
        assert leaf.aval == want, name
        value = leaf.result(timeout=WAIT)
        assert value.aval == want, name
        np.testing.assert_array_equal(value, VALUE)


def test_jit_on_a_leaf_traces_as_on_jaxs_array(sharding):
    x = jax.device_put(VALUE, sharding)
    leaf = aa.async_wrap(
        lambda: VALUE, like=jax.ShapeDtypeStruct(VALUE.shape, F32, sharding=sharding)
    )

    def f(a):
        return a * 2

    assert str(jax.make_jaxpr(f)(leaf)) == str(jax.make_jaxpr(f)(x))


def test_a_contraction_jax_refuses_on_an_explicit_mesh_is_refused_on_a_leaf():
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    s = NamedSharding(mesh, P("x", "y"))
    x = jax.device_put(VALUE, s)
    leaf = aa.async_wrap(lambda: VALUE, like=jax.ShapeDtypeStruct(VALUE.shape, F32, sharding=s))

    def gram(a):
        return a @ a.T

    with jax.set_mesh(mesh):
        with pytest.raises(Exception) as theirs:
            jax.jit(gram)(x)
        with pytest.raises(type(theirs.value)):
            jax.jit(gram)(leaf)
