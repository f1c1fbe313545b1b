"""PRNG key arrays (JAX's extended dtypes, ``jax.random.key``) as leaves, as
JAX takes them: ``aa.make_array_from_callback`` from key shards,
``async_wrap``/``async_map`` from key arrays; the leaf's type is the key
type, and ``jax.random`` draws from it."""

import jax
import numpy as np
import pytest
from conftest import WAIT
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import async_array as aa

KEYS = jax.random.split(jax.random.key(0), 8)


def same_keys(a, b):
    return a.dtype == b.dtype and bool((jax.random.key_data(a) == jax.random.key_data(b)).all())


def test_make_array_from_callback_takes_key_shards_as_jax_does():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, P("x"))
    want = jax.make_array_from_callback((8,), sharding, lambda i: KEYS[i], dtype=KEYS.dtype)
    leaf = aa.make_array_from_callback((8,), sharding, lambda i: KEYS[i], dtype=KEYS.dtype)
    assert jax.typeof(leaf) == jax.typeof(want)
    got = leaf.result(timeout=WAIT)
    assert got.sharding == want.sharding and same_keys(got, want)


@pytest.mark.parametrize("producer", ["async_wrap", "async_map"])
def test_a_key_array_result_is_a_key_leaf(producer):
    spec = jax.ShapeDtypeStruct((8,), KEYS.dtype)
    if producer == "async_wrap":
        leaf = aa.async_wrap(lambda: KEYS, like=spec)
    else:
        leaf = aa.async_map(lambda path, s: KEYS, {"k": spec})["k"]
    assert leaf.dtype == KEYS.dtype
    got = leaf.result(timeout=WAIT)
    assert same_keys(got, KEYS)
    assert float(jax.random.uniform(got[3])) == float(jax.random.uniform(KEYS[3]))


def test_key_data_for_a_key_leaf_is_refused_naming_both_types():
    leaf = aa.async_wrap(
        lambda: np.zeros((8, 2), np.uint32), like=jax.ShapeDtypeStruct((8,), KEYS.dtype)
    )
    with pytest.raises(TypeError, match=r"expected a jax.Array of dtype key<fry>, got numpy"):
        leaf.result(timeout=WAIT)


def test_aa_jit_takes_key_arrays_and_key_leaves_as_jax_jit_does():
    def draw(k):
        return jax.random.uniform(k[0])

    want = float(jax.jit(draw)(KEYS))
    assert float(aa.jit(draw)(KEYS).result(timeout=WAIT)) == want  # JAX's own key array
    leaf = aa.async_wrap(lambda: KEYS, like=jax.ShapeDtypeStruct((8,), KEYS.dtype))
    assert float(aa.jit(draw)(leaf).result(timeout=WAIT)) == want


def test_a_trace_error_on_a_key_leaf_is_jaxs_own():
    leaf = aa.async_wrap(lambda: KEYS[0], like=jax.ShapeDtypeStruct((), KEYS.dtype))

    def add_one(k):
        return k + 1

    with pytest.raises(Exception) as theirs:
        jax.jit(add_one)(KEYS[0])
    with pytest.raises(type(theirs.value)) as ours:
        aa.jit(add_one)(leaf)
    assert "key<fry>[]" in "\n".join(getattr(ours.value, "__notes__", []))
