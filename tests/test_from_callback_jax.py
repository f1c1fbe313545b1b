"""``aa.make_array_from_callback`` against ``jax.make_array_from_callback``,
case by case from JAX's own tests.

Each test calls both with the same arguments and checks that the leaf, once
materialized, is what JAX returned: value, shape, dtype, sharding,
``jax.typeof``, committed, and every addressable shard's index, replica,
device and data. Meshes are built as JAX's test utilities build them (the
first devices by id, Auto axes unless a case says Explicit). The suite runs on
the four CPU devices of ``conftest.py``; the cases of JAX's 4x2 and 2x3 meshes
(ids with ``8dev``) need eight, and one test runs them in a fresh
interpreter with eight.

JAX's tests (``tests/array_test.py`` unless named) and their twins here:

=====================================================  ==========================================
JAX test                                               here
=====================================================  ==========================================
test_jax_array_value                                   test_value_and_shards_equal_jax_own
test_array_2d_shard                                    test_value_and_shards_equal_jax_own (the
                                                       8dev cases: JAX's 4x2 mesh and indices)
test_addressable_data                                  test_value_and_shards_equal_jax_own[P(None)]
test_array_delete                                      test_delete_of_the_result_equals_jax_own
test_array_device_get                                  test_methods_of_the_result_equal_jax_own
test_repr                                              test_methods_of_the_result_equal_jax_own
test_array_sharded_astype                              test_methods_of_the_result_equal_jax_own
test_sharded_add                                       test_methods_of_the_result_equal_jax_own
test_sharded_zeros_like                                test_methods_of_the_result_equal_jax_own
test_shard_shape_mismatch_with_buffer_shape            test_a_shard_of_the_wrong_shape_fails
test_array_iter_mesh_pspec_sharding_multi_device       test_methods_of_the_result_equal_jax_own
test_array_iter_replicated_multi_device                test_methods_of_the_result_equal_jax_own
test_array_getitem_mesh_pspec_sharding_multi_device    test_methods_of_the_result_equal_jax_own
test_array_getitem_compile_multi_device_sharding       test_indexing_a_3d_result_equals_jax_own
test_array_getitem_replicated_multi_device             test_methods_of_the_result_equal_jax_own
test_array_iter_mesh_pspec_sharding_single_device      test_value_and_shards_equal_jax_own
                                                       [one-device mesh] and the methods test
test_array_jnp_array_copy_multi_device                 test_methods_of_the_result_equal_jax_own
test_array_addressable_shards                          test_value_and_shards_equal_jax_own
test_defragment                                        not applicable: checks the backend's
                                                       defragment(), not the array
test_on_device_size_in_bytes                           test_methods_of_the_result_equal_jax_own
test_array_fully_replicated_shard                      test_methods_of_the_result_equal_jax_own
test_make_array_from_callback_global_array             test_a_callback_returning_a_global_jax_array
test_make_array_from_callback_error                    test_a_traced_callback_value_is_refused
test_random_bits_is_pure_map_1d                        test_random_bits_of_the_result_stay_local
test_random_bits_is_pure_map_2d                        test_random_bits_of_the_result_stay_local
                                                       (the 3x2, 4x2, 2x3 meshes: 8dev)
random_test: test_make_array_from_callback             test_a_callback_returning_prng_keys
layout_test: test_make_array_from_callback             test_a_format_sharding_equals_jax_own,
                                                       test_a_format_jax_refuses_is_refused
                                                       (another layout than the default one:
                                                       strict xfail, test_a_format_of_another_
                                                       layout_equals_jax_own)
api_test: test_internal_device_put_assembled           test_callback_value_kinds_equal_jax_own
                                                       [uncommitted jax arrays] (JAX's count of
                                                       its own internal device_puts does not
                                                       apply)
checkify_test, pjit_test, multiprocess tests           not applicable: make_array_from_callback
                                                       only builds their inputs
=====================================================  ==========================================

29 rows (the last one a group of files): 27 apply and have a twin here,
all passing; 2 do not apply.
Beyond the table: the shardings, dtypes and callback values of the
parametrized tests (int4, uint4, int2, uint2, the float8 kinds and
float4_e2m1fn included; a Format of another layout than the default one is
a strict xfail); ``PositionalSharding`` where
the installed JAX has it (0.10 has not). Two known differences by design:
JAX infers the dtype from the first shard when none is given, while ``aa``
reads nothing at the call, so its ``dtype`` is required
(``test_the_dtype_is_required``); and ``aa`` casts a shard of another dtype
(same_kind, range-checked, as every producer) where JAX refuses it
(``test_a_shard_of_another_dtype_is_cast_where_jax_refuses``).
"""

import math
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import DTYPE_IDS, DTYPES, WAIT
from jax.experimental.layout import Format, Layout
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import async_array as aa

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")

EIGHT = "--xla_force_host_platform_device_count=8"


def mesh(shape, names, axis_types=AxisType.Auto):
    """As JAX's ``jtu.create_mesh(..., iota_order=True)``: the first devices by id."""
    n = math.prod(shape)
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (the 8dev cases run with eight)")
    devices = sorted(jax.devices(), key=lambda d: d.id)[:n]
    return Mesh(np.array(devices).reshape(shape), names, axis_types=(axis_types,) * len(shape))


def data_of(shape, dtype=np.int32):
    return np.arange(math.prod(shape)).reshape(shape).astype(dtype)


def values(a):
    """The array's values as numpy (a key array's key data)."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def assert_same(ours, theirs):
    """``ours`` (a materialized leaf) is what JAX returned, shard by shard."""
    assert type(ours) is type(theirs)
    assert (ours.shape, ours.dtype, ours.sharding) == (theirs.shape, theirs.dtype, theirs.sharding)
    assert jax.typeof(ours) == jax.typeof(theirs)
    assert ours.committed == theirs.committed
    assert getattr(ours, "weak_type", None) == getattr(theirs, "weak_type", None)
    assert ours.is_fully_replicated == theirs.is_fully_replicated
    assert getattr(ours, "format", None) == getattr(theirs, "format", None)
    np.testing.assert_array_equal(values(ours), values(theirs), strict=True)
    for kind in ("addressable_shards", "global_shards"):
        a_shards, b_shards = getattr(ours, kind), getattr(theirs, kind)
        assert len(a_shards) == len(b_shards)
        for a, b in zip(a_shards, b_shards, strict=True):
            assert (a.device, a.index, a.replica_id) == (b.device, b.index, b.replica_id)
            assert jax.typeof(a.data) == jax.typeof(b.data)
            assert a.data.sharding == b.data.sharding
            np.testing.assert_array_equal(values(a.data), values(b.data), strict=True)
    for i in range(len(theirs.addressable_shards)):
        np.testing.assert_array_equal(
            values(ours.addressable_data(i)), values(theirs.addressable_data(i)), strict=True
        )


def both(shape, sharding, callback, dtype, jax_dtype="same"):
    """The leaf (checked before it is materialized) and JAX's array for the
    same arguments; ``jax_dtype`` None lets JAX infer the dtype."""
    theirs = jax.make_array_from_callback(
        shape, sharding, callback, dtype=dtype if jax_dtype == "same" else jax_dtype
    )
    leaf = aa.make_array_from_callback(shape, sharding, callback, dtype=dtype)
    # What the leaf declares before any shard exists is JAX's already.
    assert (leaf.shape, leaf.dtype, leaf.sharding) == (theirs.shape, theirs.dtype, theirs.sharding)
    assert jax.typeof(leaf) == jax.typeof(theirs) and leaf.committed
    ours = leaf.result(timeout=WAIT)
    assert_same(ours, theirs)
    return leaf, ours, theirs


# -- value, shape, dtype, sharding, shards -------------------------------------------------

# (id, mesh shape, axis names, PartitionSpec, global shape)
NAMED = [
    ("x_y", (2, 2), ("x", "y"), P("x", "y"), (8, 2)),
    ("x", (2, 2), ("x", "y"), P("x"), (8, 2)),
    ("y", (2, 2), ("x", "y"), P("y"), (8, 2)),
    ("none_y", (2, 2), ("x", "y"), P(None, "y"), (8, 2)),
    ("xy", (2, 2), ("x", "y"), P(("x", "y")), (8, 2)),
    ("replicated", (2, 2), ("x", "y"), P(), (8, 2)),
    ("P(None)", (2, 2), ("x", "y"), P(None), (8, 2)),
    ("1d_x", (4,), ("x",), P("x"), (8, 2)),
    ("1d_x_cols", (4,), ("x",), P(None, "x"), (2, 8)),
    ("3_devices", (3,), ("x",), P("x"), (6, 2)),
    ("one-device mesh", (1,), ("x",), P("x"), (8, 2)),
    ("scalar", (2, 2), ("x", "y"), P(), ()),
    ("3d", (2, 2), ("x", "y"), P("x", None, "y"), (4, 3, 2)),
    ("empty", (2, 2), ("x", "y"), P("x"), (0, 2)),
    # JAX's own 4x2 mesh of test_jax_array_value and test_array_2d_shard.
    *[
        (f"8dev_{name}", (4, 2), ("x", "y"), spec, (8, 2))
        for name, spec in [
            ("x_y", P("x", "y")),
            ("x", P("x")),
            ("y", P("y")),
            ("none_y", P(None, "y")),
            ("xy", P(("x", "y"))),
            ("replicated", P()),
        ]
    ],
]


@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize(
    ("mesh_shape", "names", "spec", "shape"), [c[1:] for c in NAMED], ids=[c[0] for c in NAMED]
)
def test_value_and_shards_equal_jax_own(mesh_shape, names, spec, shape, axis_types):
    sharding = NamedSharding(mesh(mesh_shape, names, axis_types), spec)
    data = data_of(shape)
    both(shape, sharding, lambda index: data[index], np.int32, jax_dtype=None)


@pytest.mark.parametrize("device", [0, 3])
def test_single_device_sharding_equals_jax_own(device):
    sharding = SingleDeviceSharding(jax.devices()[device])
    data = data_of((4, 3))
    both((4, 3), sharding, lambda index: data[index], np.int32, jax_dtype=None)


def test_a_replica_is_asked_for_once_as_jax_asks():
    # JAX calls a fully replicated sharding's callback once, with the whole
    # index; aa, once per distinct index: the same single call.
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), P())
    data = data_of((8, 2))
    asked = {"aa": [], "jax": []}

    def callback(who):
        return lambda index: asked[who].append(index) or data[index]

    jax.make_array_from_callback(data.shape, sharding, callback("jax"))
    aa.make_array_from_callback(data.shape, sharding, callback("aa"), dtype=np.int32).result(WAIT)
    assert asked["aa"] == asked["jax"] == [(slice(None), slice(None))]


# -- dtypes ---------------------------------------------------------------------------------

# JAX's sub-byte and 8-bit float dtypes.
NARROW = (
    "int4", "uint4", "int2", "uint2", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
    "float4_e2m1fn",
)  # fmt: skip
NARROW_DTYPES = [
    pytest.param(getattr(ml_dtypes, name), id=name)
    for name in NARROW
    if hasattr(ml_dtypes, name) and hasattr(jnp, name)
]
# Without jax_enable_x64, JAX narrows 64-bit dtypes (and warns); so does aa.
X64 = {np.int64, np.uint64, np.float64, np.complex128}


@pytest.mark.parametrize(
    "dtype", [pytest.param(d, id=i) for d, i in zip(DTYPES, DTYPE_IDS, strict=True)] + NARROW_DTYPES
)
@pytest.mark.parametrize("spec", [P("x", "y"), P()], ids=["sharded", "replicated"])
def test_every_dtype_equals_jax_own(dtype, spec):
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), spec)
    data = data_of((4, 2), dtype)
    with warnings.catch_warnings():
        if dtype in X64 and not jax.config.jax_enable_x64:
            warnings.filterwarnings("ignore", "Explicitly requested dtype", UserWarning)
        both(data.shape, sharding, lambda index: data[index], dtype)


def test_the_dtype_is_required():
    # JAX infers it from the first shard; aa reads no shard at the call.
    sharding = SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(TypeError, match="dtype"):
        aa.make_array_from_callback((2,), sharding, lambda index: np.zeros(2, np.int32))


# -- what the callback returns ---------------------------------------------------------------

SCALARS = [
    ("int", 3, np.int32),
    ("float", 2.5, np.float32),
    ("bool", True, np.bool_),
    ("complex", 1 + 2j, np.complex64),
    ("numpy float32", np.float32(1.5), np.float32),
    ("numpy int8", np.int8(-4), np.int8),
    ("0-d numpy", np.array(7, np.uint16), np.uint16),
    ("0-d jax", jnp.int32(7), np.int32),
    ("0-d bfloat16", jnp.bfloat16(0.5), jnp.bfloat16),
]


@pytest.mark.parametrize(("value", "dtype"), [s[1:] for s in SCALARS], ids=[s[0] for s in SCALARS])
@pytest.mark.parametrize(
    "placement", ["one device", "replicated"], ids=["single_device", "replicated"]
)
def test_a_scalar_callback_equals_jax_own(value, dtype, placement):
    if placement == "one device":
        sharding = SingleDeviceSharding(jax.devices()[1])
    else:
        sharding = NamedSharding(mesh((2, 2), ("x", "y")), P())
    both((), sharding, lambda index: value, dtype, jax_dtype=None)


KINDS = {
    "numpy": lambda data, index: data[index],
    "numpy, non-contiguous": lambda data, index: np.asfortranarray(data[index]),
    "jax, uncommitted": lambda data, index: jnp.array(data[index]),
    "jax, on another device": lambda data, index: jax.device_put(data[index], jax.devices()[3]),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("spec", [P("x", "y"), P("x"), P()], ids=["x_y", "x", "replicated"])
def test_callback_value_kinds_equal_jax_own(kind, spec):
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), spec)
    data = data_of((8, 4))
    both(data.shape, sharding, lambda index: KINDS[kind](data, index), np.int32)


@pytest.mark.parametrize("spec", [P(), P("x", "y")], ids=["replicated", "x_y"])
def test_a_callback_returning_a_global_jax_array(spec):
    # JAX's test_make_array_from_callback_global_array: the callback slices a
    # committed array already placed on the same sharding.
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), spec)
    arr = jax.device_put(data_of((8, 2)), sharding)
    _, ours, _ = both(arr.shape, sharding, lambda index: arr[index], np.int32)
    np.testing.assert_array_equal(ours, arr)


def test_a_callback_returning_prng_keys():
    # random_test.py's test_make_array_from_callback, on the four devices.
    n = 4
    sharding = NamedSharding(mesh((n,), ("x",)), P("x"))

    def callback(index):
        return jax.vmap(jax.random.key)(jnp.arange(n)[index[0]])

    key_dtype = jax.random.key(0).dtype
    _, ours, _ = both((n,), sharding, callback, key_dtype, jax_dtype=None)
    expected = jax.vmap(jax.random.key)(jnp.arange(n))
    np.testing.assert_array_equal(jax.random.key_data(ours), jax.random.key_data(expected))


# -- errors ----------------------------------------------------------------------------------

SHARD_SHAPES = [
    ("x_y", P("x", "y")),
    ("x", P("x")),
    ("y", P("y")),
    ("none_y", P(None, "y")),
    ("none_x", P(None, "x")),
    ("xy", P(("x", "y"))),
    ("replicated", P(())),
]


@pytest.mark.parametrize("spec", [s[1] for s in SHARD_SHAPES], ids=[s[0] for s in SHARD_SHAPES])
def test_a_shard_of_the_wrong_shape_fails(spec):
    # JAX raises at the call; aa's leaf fails, at its first use, with the same
    # kind of error naming the shard shape expected.
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), spec)
    shape = (8, 4)
    expected = sharding.shard_shape(shape)
    wrong = np.arange(5, dtype=np.int32)
    with pytest.raises(ValueError, match=rf"Expected shard shape {re.escape(str(expected))}"):
        jax.make_array_from_callback(shape, sharding, lambda index: wrong)
    leaf = aa.make_array_from_callback(shape, sharding, lambda index: wrong, dtype=wrong.dtype)
    with pytest.raises(ValueError, match=rf"expected shape {re.escape(str(expected))}, got \(5,\)"):
        leaf.result(timeout=WAIT)


def test_a_traced_callback_value_is_refused():
    # JAX's test_make_array_from_callback_error: a value of the trace reaches
    # the callback; outside jit the same function works.
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), P("x", "y"))
    global_x = jnp.arange(16).astype("uint32").reshape(4, 4)

    def f(arr):
        return aa.make_array_from_callback(arr.shape, sharding, lambda i: arr[i], dtype=arr.dtype)

    def g(arr):
        return jax.make_array_from_callback(arr.shape, sharding, lambda i: arr[i])

    assert_same(f(global_x).result(timeout=WAIT), g(global_x))
    for fn in (f, g):
        with pytest.raises(jax.errors.UnexpectedTracerError):
            jax.jit(fn)(global_x)


def test_a_format_sharding_equals_jax_own():
    # layout_test.py's test_make_array_from_callback: a compiled function's
    # output format (its sharding and each shard's device-local layout).
    sharding = NamedSharding(mesh((2, 1), ("x", "y")), P("x", "y"))
    data = data_of((8, 2))
    sds = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    fmt = jax.jit(lambda v: v * 2).lower(sds).compile().output_formats
    _, ours, theirs = both(data.shape, fmt, lambda index: data[index], np.int32, jax_dtype=None)
    assert ours.format == theirs.format == fmt


@pytest.mark.xfail(
    strict=True,
    raises=TypeError,
    reason="open item: a Format of a layout other than the default one fails the leaf (a "
    "pending leaf declares no layout, so jax.jit would compile it for the default one)",
)
def test_a_format_of_another_layout_equals_jax_own():
    sharding = NamedSharding(mesh((2, 1), ("x", "y")), P("x", "y"))
    data = data_of((8, 2))
    fmt = Format(Layout(major_to_minor=(1, 0)), sharding)  # the transposed one
    _, ours, theirs = both(data.shape, fmt, lambda index: data[index], np.int32, jax_dtype=None)
    assert ours.format == theirs.format


@pytest.mark.parametrize(
    ("fmt", "error"),
    [
        (Format(Layout.AUTO, SingleDeviceSharding(jax.devices()[0])), "Layout.AUTO cannot be used"),
        (Format(None, None), "sharding"),
    ],
    ids=["auto layout", "no sharding"],
)
def test_a_format_jax_refuses_is_refused(fmt, error):
    def callback(index):
        return np.zeros(4, np.int32)[index]

    with pytest.raises(TypeError):
        jax.make_array_from_callback((4,), fmt, callback)
    with pytest.raises(TypeError, match=error):
        aa.make_array_from_callback((4,), fmt, callback, dtype=np.int32)


def test_a_shard_of_another_dtype_is_cast_where_jax_refuses():
    # A documented difference (docs/guide.md, Casting): aa converts every
    # producer's value to the declared dtype with numpy's same_kind casting,
    # range-checked; JAX's make_array_from_callback refuses a shard whose
    # dtype is not the one given.
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), P("x", "y"))
    data = data_of((8, 4))
    narrow = data.astype(np.int16)
    with pytest.raises(ValueError, match="must match the dtype of the addressable shards"):
        jax.make_array_from_callback(data.shape, sharding, lambda i: narrow[i], dtype=np.int32)
    leaf = aa.make_array_from_callback(data.shape, sharding, lambda i: narrow[i], dtype=np.int32)
    assert_same(leaf.result(timeout=WAIT), jax.device_put(data, sharding))


@pytest.mark.skipif(
    not hasattr(jax.sharding, "PositionalSharding"), reason="this JAX has no PositionalSharding"
)
def test_positional_sharding_equals_jax_own():
    sharding = jax.sharding.PositionalSharding(jax.devices()[:4]).reshape(2, 2)
    data = data_of((8, 2))
    both(data.shape, sharding, lambda index: data[index], np.int32, jax_dtype=None)


# -- the result in use -----------------------------------------------------------------------

OPERATIONS = {
    "device_get": lambda a, b: jax.device_get(a),
    "repr": lambda a, b: repr(jnp.asarray(a)),
    "astype": lambda a, b: a.astype(jnp.float32),
    "add": lambda a, b: a + b,
    "zeros_like": lambda a, b: jnp.zeros_like(a),
    "iter": lambda a, b: list(iter(a)),
    "getitem rows": lambda a, b: a[:2],
    "getitem block": lambda a, b: a[2:4, 0:1],
    "jnp.array copy": lambda a, b: jnp.array(a, copy=True),
    "addressable_data": lambda a, b: [
        a.addressable_data(i) for i in range(len(a.addressable_shards))
    ],
    "on_device_size_in_bytes": lambda a, b: a.on_device_size_in_bytes(),
    "fully_replicated_shard": lambda a, b: jnp.asarray(a).addressable_data(0),
}


def same_result(ours, theirs):
    if isinstance(theirs, list):
        assert len(ours) == len(theirs)
        for o, t in zip(ours, theirs, strict=True):
            same_result(o, t)
    elif isinstance(theirs, jax.Array):
        assert_same(ours, theirs)
    elif isinstance(theirs, np.ndarray):
        np.testing.assert_array_equal(ours, theirs, strict=True)
    else:
        assert ours == theirs


@pytest.mark.parametrize("op", list(OPERATIONS))
@pytest.mark.parametrize(
    ("mesh_shape", "spec"),
    [((2, 2), P("x", "y")), ((2, 2), P(None)), ((1,), P("x"))],
    ids=["x_y", "replicated", "one-device mesh"],
)
def test_methods_of_the_result_equal_jax_own(op, mesh_shape, spec):
    names = ("x", "y")[: len(mesh_shape)]
    sharding = NamedSharding(mesh(mesh_shape, names), spec)
    other = NamedSharding(sharding.mesh, P(names[0]))
    data = data_of((8, 2))
    leaf = aa.make_array_from_callback(data.shape, sharding, lambda i: data[i], dtype=np.int32)
    leaf2 = aa.make_array_from_callback(data.shape, other, lambda i: data[i], dtype=np.int32)
    theirs = jax.make_array_from_callback(data.shape, sharding, lambda i: data[i])
    theirs2 = jax.make_array_from_callback(data.shape, other, lambda i: data[i])
    fn = OPERATIONS[op]
    # On the leaf itself, pending or not: each waits for the value.
    same_result(fn(leaf, leaf2), fn(theirs, theirs2))


def test_delete_of_the_result_equals_jax_own():
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), P("x", "y"))
    data = data_of((8, 2))
    leaf = aa.make_array_from_callback(data.shape, sharding, lambda i: data[i], dtype=np.int32)
    theirs = jax.make_array_from_callback(data.shape, sharding, lambda i: data[i])
    for a in (leaf, theirs):
        a.delete()
        assert a.is_deleted()
        with pytest.raises(RuntimeError, match="Array has been deleted"):
            _ = a + 1


INDEXES = {
    "[:, -1, :]": (slice(None), -1, slice(None)),
    "[0, 0, 0]": (0, 0, 0),
    "[-1, -1, :]": (-1, -1, slice(None)),
    "[:, 1, 0]": (slice(None), 1, 0),
    "[:, :, :]": (slice(None),) * 3,
    "[3, :, :]": (3, slice(None), slice(None)),
    "[2, 3, 1]": (2, 3, 1),
    "[-1]": -1,
    "[np.array(0)]": (np.array(0), slice(None), slice(None)),
    "[jnp.array(0)]": (jnp.array(0), slice(None), slice(None)),
    "[0, :2, 1]": (0, slice(None, 2), 1),
    "[:, 1::2]": (slice(None), slice(1, None, 2)),
    "[::-1]": slice(None, None, -1),
}


@pytest.mark.parametrize("index", list(INDEXES))
def test_indexing_a_3d_result_equals_jax_own(index):
    # test_array_getitem_compile_multi_device_sharding, on a 2x2 mesh.
    sharding = NamedSharding(mesh((2, 2), ("x", "y")), P("x", "y", None))
    data = data_of((4, 4, 2))
    leaf = aa.make_array_from_callback(data.shape, sharding, lambda i: data[i], dtype=np.int32)
    theirs = jax.make_array_from_callback(data.shape, sharding, lambda i: data[i])
    at = INDEXES[index]
    ours = leaf[at]
    assert_same(ours, theirs[at])
    np.testing.assert_array_equal(ours, data[at])


RANDOM_BITS = [
    ("1d_3", (3,), P("x")),
    ("1d_4", (4,), P("x")),
    ("8dev_1d_5", (5,), P("x")),
    ("2x2_x_none", (2, 2), P("x", None)),
    ("2x2_x_y", (2, 2), P("x", "y")),
    *[
        (f"8dev_{'x'.join(map(str, m))}_{n}", m, spec)
        for m in [(3, 2), (4, 2), (2, 3)]
        for n, spec in [("x_none", P("x", None)), ("none_y", P(None, "y")), ("x_y", P("x", "y"))]
    ],
]


@pytest.mark.parametrize(
    ("mesh_shape", "spec"), [c[1:] for c in RANDOM_BITS], ids=[c[0] for c in RANDOM_BITS]
)
def test_random_bits_of_the_result_stay_local(mesh_shape, spec):
    # JAX's test_random_bits_is_pure_map_*: jit of the result lowers and
    # compiles to the very program JAX's own array gives, with no collective.
    names = ("x", "y")[: len(mesh_shape)]
    sharding = NamedSharding(mesh(mesh_shape, names), spec)
    shape = tuple(np.square(mesh_shape))
    global_x = data_of(shape, np.uint32)

    @jax.jit
    def f(x):
        key = jax.random.key(0, impl="threefry2x32")
        return jax.random.bits(key, x.shape, jnp.uint32) + x

    leaf = aa.make_array_from_callback(shape, sharding, lambda i: global_x[i], dtype=np.uint32)
    theirs = jax.make_array_from_callback(shape, sharding, lambda i: global_x[i])
    with jax.threefry_partitionable(True):
        ours_text = f.lower(leaf).compile().as_text()
        assert ours_text == f.lower(theirs).compile().as_text()
        assert "all-reduce" not in ours_text and "collective-permute" not in ours_text
        assert_same(f(leaf), f(theirs))


# -- eight devices ---------------------------------------------------------------------------


@pytest.mark.skipif(EIGHT in os.environ.get("XLA_FLAGS", ""), reason="this run has eight")
def test_the_eight_device_cases_in_a_fresh_interpreter():
    env = dict(os.environ, XLA_FLAGS=EIGHT)
    env.pop("PYTEST_XDIST_WORKER", None)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    proc = subprocess.run(
        [*args, __file__, "-k", "8dev", "-W", "error"],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        cwd=os.path.dirname(__file__),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
