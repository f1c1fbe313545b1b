"""Placement: every placement ``jax.device_put`` accepts, for every
kind of result, and the default device as ``jnp.asarray`` picks it.

Runs on the four CPU devices ``conftest.py`` asks for.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import async_array as aa

F32 = np.float32
VALUE = np.arange(32, dtype=F32).reshape(8, 4)

# tests/conftest.py asks XLA for 4 CPU devices; fewer is a broken set-up, not a skip.


def _mesh():
    return jax.make_mesh((2, 2), ("data", "model"))


def _placements():
    mesh = _mesh()
    return {
        "sharded": NamedSharding(mesh, PartitionSpec("data", "model")),
        "rows_replicated_over_model": NamedSharding(mesh, PartitionSpec("data", None)),
        "cols_replicated_over_data": NamedSharding(mesh, PartitionSpec(None, "model")),
        "replicated": NamedSharding(mesh, PartitionSpec()),
        "single_device": SingleDeviceSharding(jax.devices()[1]),
        "device": jax.devices()[2],
    }


def _results():
    def host_buffer():
        buf = aa.empty(VALUE.shape, F32)
        np.asarray(buf)[...] = VALUE
        return buf

    return {
        "numpy": lambda: VALUE.copy(),
        "host_buffer": host_buffer,
        "fortran": lambda: np.asfortranarray(VALUE),
        "float64": lambda: VALUE.astype(np.float64),
        "list": lambda: VALUE.tolist(),
        "jax_array": lambda: jnp.asarray(VALUE),
    }


@pytest.mark.parametrize("result", list(_results()))
@pytest.mark.parametrize("where", list(_placements()))
def test_every_placement_jax_device_put_accepts(where, result):
    placement = _placements()[where]
    make = _results()[result]
    expected = jax.device_put(VALUE, placement)
    x = aa.async_wrap(make, shape=VALUE.shape, dtype=F32, sharding=placement)
    assert x.committed
    assert x.sharding.is_equivalent_to(expected.sharding, 2)
    got = x.result()
    assert got.committed
    assert got.sharding.is_equivalent_to(expected.sharding, 2)
    np.testing.assert_array_equal(got, VALUE)
    # Each device holds exactly its index's values, as jax.device_put puts them.
    want = {s.device: np.asarray(s.data) for s in expected.addressable_shards}
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.device])


@pytest.mark.parametrize("where", list(_placements()))
def test_placements_in_a_pytree_prefix(where):
    placement = _placements()[where]
    like = {"a": jax.ShapeDtypeStruct(VALUE.shape, F32), "b": jax.ShapeDtypeStruct((4,), F32)}
    tree = aa.async_map(
        lambda path, spec: np.ones(spec.shape, spec.dtype),
        like,
        sharding={"a": placement, "b": None},
    )
    got = aa.materialize(tree)
    want = jax.device_put(VALUE, placement).sharding
    assert got["a"].sharding.is_equivalent_to(want, 2) and got["a"].committed
    assert not got["b"].committed


def test_a_partition_spec_under_set_mesh():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        want = jax.device_put(VALUE, PartitionSpec("data")).sharding
        x = aa.async_wrap(
            lambda: VALUE.copy(), shape=VALUE.shape, dtype=F32, sharding=PartitionSpec("data")
        )
        tree = aa.async_wrap(
            lambda: {"w": VALUE.copy()},
            like={"w": jax.ShapeDtypeStruct(VALUE.shape, F32)},
            sharding={"w": PartitionSpec(None, "model")},
        )
    got = x.result()
    assert got.sharding.is_equivalent_to(want, 2) and x.sharding == want
    np.testing.assert_array_equal(got, VALUE)
    cols = aa.materialize(tree)["w"]
    assert cols.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "model")), 2)


def test_a_partition_spec_without_a_mesh_is_refused_at_the_call():
    with pytest.raises(ValueError, match=r"async_wrap\(.*<lambda>\): .*jax.set_mesh"):
        aa.async_wrap(lambda: VALUE, shape=VALUE.shape, dtype=F32, sharding=PartitionSpec("x"))


def test_not_a_placement_is_refused_at_the_call():
    with pytest.raises(TypeError, match=r"sharding must be .* got str"):
        aa.async_wrap(lambda: VALUE, shape=VALUE.shape, dtype=F32, sharding="cpu:0")


@pytest.mark.parametrize("spec", [PartitionSpec("data"), PartitionSpec(None, "model", None)])
def test_a_sharding_that_does_not_fit_gets_jax_own_error(spec):
    sharding = NamedSharding(_mesh(), spec)
    value = np.ones((3, 3), F32)
    with pytest.raises(ValueError) as jax_own:
        jax.device_put(value, sharding)
    with pytest.raises(type(jax_own.value)) as ours:
        aa.async_map(
            lambda p, s: value, {"w": jax.ShapeDtypeStruct((3, 3), F32)}, sharding=sharding
        )
    text = str(ours.value)
    assert text.startswith("async_map(") and text.endswith(
        f"<lambda>) leaf ['w']: {str(jax_own.value).split(' This error occurs at source:')[0]}"
    )


def test_default_placement_follows_jax_default_device_context():
    device = jax.devices()[2]
    with jax.default_device(device):
        x = aa.async_wrap(lambda: VALUE.copy(), shape=VALUE.shape, dtype=F32)
        tree = aa.async_map(lambda p, s: VALUE.copy(), {"w": jax.ShapeDtypeStruct((8, 4), F32)})
        reference = jnp.asarray(VALUE)
    # Where the leaf lands is decided at the call, not when the loader runs.
    assert x.sharding == SingleDeviceSharding(device) and not x.committed
    for got in (x.result(), aa.materialize(tree)["w"]):
        assert got.devices() == reference.devices() == {device}
        assert got.committed == reference.committed is False
        np.testing.assert_array_equal(got, VALUE)
    # Outside the context: back to the first local device.
    y = aa.async_wrap(lambda: VALUE.copy(), shape=VALUE.shape, dtype=F32)
    assert y.result().devices() == {jax.local_devices()[0]}


def test_default_placement_follows_jax_default_device_config():
    device = jax.devices()[3]
    before = jax.config.jax_default_device
    jax.config.update("jax_default_device", device)
    try:
        x = aa.async_wrap(lambda: VALUE.copy(), shape=VALUE.shape, dtype=F32)
        reference = jnp.asarray(VALUE)
    finally:
        jax.config.update("jax_default_device", before)
    assert x.result().devices() == reference.devices() == {device}
    assert not x.committed
