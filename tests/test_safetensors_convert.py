"""Dtype conversion while loading: ``like`` leaves of another dtype than the
file's, and ``dtype=``. Float16, bfloat16, float32 and float64 convert in
the core as each tensor is read (from a file a stage at a time, over HTTP as
the bytes arrive, elements cut across chunks included); every other
same_kind cast (to a float8 kind, between integers) converts after the read.
Values are compared bit for bit with numpy's (ml_dtypes') casts, which round
to nearest even."""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from conftest import WAIT
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import async_array as aa

FLOATS = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def values(shape, rng) -> np.ndarray:
    """Values of every float type's range, most of them not exact in the narrower ones."""
    return (rng.standard_normal(shape) * 100).astype(np.float32)


def expected(stored: np.ndarray, dtype: np.dtype) -> bytes:
    return stored.astype(dtype).tobytes()


@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(FLOATS, 2)))
@pytest.mark.parametrize("over", ["file", "http"])
def test_each_float_pair_converts_bit_exact_as_numpy_rounds(tmp_path, server, x64, src, dst, over):
    rng = np.random.default_rng(7)
    stored = {"w": values((33, 17), rng).astype(FLOATS[src]), "s": np.asarray(1.5, FLOATS[src])}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(stored, str(path))
    if over == "http":
        server.slow = 0.0  # a byte a write: elements cut across chunks
        source = server.url("m.safetensors")
    else:
        source = path
    like = {k: jax.ShapeDtypeStruct(v.shape, FLOATS[dst]) for k, v in stored.items()}
    got = aa.materialize(aa.load_safetensors(source, like=like), WAIT)
    for k, v in stored.items():
        assert got[k].dtype == FLOATS[dst], k
        assert np.asarray(got[k]).tobytes() == expected(v, FLOATS[dst]), k


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x"), P()], ids=str)
def test_shards_convert_as_the_whole_tensor(tmp_path, spec):
    rng = np.random.default_rng(1)
    stored = values((8, 12), rng)
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": stored}, str(path))
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, spec)
    got = aa.load_safetensors(path, dtype=jnp.bfloat16, sharding=sharding)["w"]
    out = got.result(timeout=WAIT)
    assert out.sharding == sharding and out.dtype == jnp.bfloat16
    assert np.asarray(out).tobytes() == expected(stored, np.dtype(jnp.bfloat16))


def test_dtype_converts_every_float_tensor_and_leaves_the_others(tmp_path):
    rng = np.random.default_rng(2)
    stored = {
        "w": values((5, 3), rng),
        "h": values((4,), rng).astype(np.float16),
        "ids": np.arange(6, dtype=np.int32),
        "mask": np.array([True, False]),
    }
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(stored, str(path))
    tree = aa.load_safetensors(path, dtype=jnp.bfloat16)
    assert {k: v.dtype for k, v in tree.items()} == {
        "w": jnp.bfloat16,
        "h": jnp.bfloat16,
        "ids": np.int32,
        "mask": np.bool_,
    }
    got = aa.materialize(tree, WAIT)
    assert np.asarray(got["h"]).tobytes() == expected(stored["h"], np.dtype(jnp.bfloat16))
    np.testing.assert_array_equal(got["ids"], stored["ids"])
    assert aa.safetensors_header(path).specs["w"].dtype == np.float32  # the file's own


def test_other_same_kind_casts_convert_after_the_read(tmp_path):
    stored = {"w": np.array([0.5, -2.0, 448.0], np.float32), "i": np.array([-8, 0, 7], np.int64)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(stored, str(path))
    like = {
        "w": jax.ShapeDtypeStruct((3,), jnp.float8_e4m3fn),
        "i": jax.ShapeDtypeStruct((3,), jnp.int4),
    }
    got = aa.materialize(aa.load_safetensors(path, like=like), WAIT)
    assert np.asarray(got["w"]).tobytes() == expected(stored["w"], np.dtype(jnp.float8_e4m3fn))
    np.testing.assert_array_equal(np.asarray(got["i"]).astype(np.int64), stored["i"])


@pytest.mark.parametrize("over", ["file", "http"])
def test_a_value_the_target_cannot_hold_fails_its_leaf_alone(tmp_path, server, over):
    stored = {"big": np.array([1.0, 1e5, 2.0], np.float32), "ok": np.ones(2, np.float32)}
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(stored, str(path))
    source = server.url("m.safetensors") if over == "http" else path
    tree = aa.load_safetensors(source, dtype=np.float16)
    with pytest.raises(
        OverflowError,
        match=r'tensor "big" .*float32 value 100000 \(element 1 .*beyond float16\'s range',
    ):
        tree["big"].result(timeout=WAIT)
    np.testing.assert_array_equal(tree["ok"].result(timeout=WAIT), [1, 1])


def test_integers_narrowed_out_of_range_fail_their_leaf(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"i": np.array([1, 300], np.int32)}, str(path))
    tree = aa.load_safetensors(path, like={"i": jax.ShapeDtypeStruct((2,), np.int8)})
    with pytest.raises(OverflowError, match=r"outside int8's range \[-128, 127\]"):
        tree["i"].result(timeout=WAIT)


def test_bad_dtype_arguments_are_refused_at_the_call(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, str(path))
    with pytest.raises(
        TypeError, match=r"^load_safetensors: dtype must be a floating-point .*int32"
    ):
        aa.load_safetensors(path, dtype=np.int32)
    with pytest.raises(TypeError, match=r"^load_safetensors: dtype must be .*got 'nope'"):
        aa.load_safetensors(path, dtype="nope")
    like = {"w": jax.ShapeDtypeStruct((2,), np.float32)}
    with pytest.raises(ValueError, match=r"^load_safetensors: pass dtype= or like=, not both"):
        aa.load_safetensors(path, like=like, dtype=jnp.bfloat16)


def test_float64_with_x64_off_warns_as_jax_does(tmp_path):
    # Found by a first-time user: dtype=np.float64 was narrowed to float32 silently.
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, np.float16)}, str(path))
    with pytest.warns(UserWarning, match="float64 requested in load_safetensors is not available"):
        tree = aa.load_safetensors(path, dtype=np.float64)
    assert tree["w"].dtype == np.float32


@pytest.mark.parametrize("value", [7.0, 100.0, float("nan"), float("inf")])
def test_a_float4_leaf_refuses_what_it_would_clamp(tmp_path, value):
    # Found by a first-time user: float4_e2m1fn (no inf, no nan) clamped 100 to 6
    # and turned nan into -0 without a word.
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": np.array([1.0, value], np.float32)}, str(path))
    tree = aa.load_safetensors(path, dtype=jnp.float4_e2m1fn)
    with pytest.raises(OverflowError, match=r"float4_e2m1fn"):
        tree["w"].result(timeout=WAIT)
    if value == 7.0:  # 6.5 would round to 6; 7 is where rounding leaves the type
        safetensors.numpy.save_file({"w": np.array([1.0, 6.5], np.float32)}, str(path))
        ok = aa.load_safetensors(path, dtype=jnp.float4_e2m1fn)
        assert np.asarray(ok["w"].result(timeout=WAIT)).astype(np.float32).tolist() == [1, 6]
