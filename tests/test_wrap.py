"""async_wrap: results of every kind, casting, validation and errors."""

import concurrent.futures
import gc
import logging
import threading
import traceback
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DTYPE_IDS, DTYPES, WAIT, Gate, wait_for

import async_array as aa

F32 = np.float32


def sds(shape, dtype=F32, **kw):
    return jax.ShapeDtypeStruct(shape, dtype, **kw)


# -- the request's scenario -----------------------------------------------------


def _chain(n):
    """A function whose compile time grows with n (an unrolled chain of ops)."""

    def f(x):
        for i in range(n):
            x = jnp.sin(x) * (1.0 + i * 1e-4) + jnp.cos(x)
        return x

    return f


@pytest.mark.needs_jax_hooks
def test_seed_scenario_compiles_while_f_runs():
    # No clock: f returns only once jax.jit has been seen to finish compiling
    # the chain (JAX's own monitoring event). If async_wrap ran f at the call,
    # or jax.jit needed x's value to compile, f would wait in vain and fail
    # after WAIT s.
    fn = _chain(40)
    fn.__name__ = "chain_40"
    compiled = threading.Event()

    def listen(event, duration_secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            if kw.get("fun_name") == "jit(chain_40)":
                compiled.set()

    def slow():
        wait_for(compiled, "jax.jit to compile chain_40 while f runs")
        return np.arange(4, dtype=F32)

    chain = jax.jit(fn)  # a fresh function: nothing cached
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        x = aa.async_wrap(slow, shape=(4,), dtype=F32)
        assert not x.done()
        y = chain(x)  # compiles, then waits for x
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled.is_set() and x.done()
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(_chain(40)(np.arange(4, dtype=F32))), rtol=1e-5
    )


def test_returns_at_once_and_f_runs_on_the_pool():
    # f returns only once the test opens its gate, after async_wrap returned:
    # a call that ran f or waited for it would hang, and f give up after WAIT s.
    ran_on = []
    gate = Gate(np.ones(3, F32))

    def slow():
        ran_on.append(threading.current_thread().name)
        return gate()

    x = aa.async_wrap(slow, shape=(3,), dtype=F32)
    wait_for(gate.started, "f to start")
    assert not x.done()
    gate.open()
    np.testing.assert_array_equal(x.result(), np.ones(3, F32))
    assert ran_on[0] != threading.current_thread().name


def test_many_threads_waiting_on_one_leaf_run_f_once():
    calls = []
    gate = Gate(np.arange(5, dtype=np.int32))

    def f():
        calls.append(1)
        return gate()

    x = aa.async_wrap(f, shape=(5,), dtype=np.int32)
    # The gate opens once every thread is on its way to x.result().
    all_started = threading.Barrier(17)

    def wait_on_x(_):
        all_started.wait(WAIT)
        return x.result()

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        results = ex.map(wait_on_x, range(16))
        all_started.wait(WAIT)
        gate.open()
        outs = list(results)
    assert len(calls) == 1
    assert all(o is outs[0] for o in outs)
    np.testing.assert_array_equal(outs[0], np.arange(5))


# -- dtypes and shapes ---------------------------------------------------------

X64_ONLY = {np.int64, np.uint64, np.float64, np.complex128}
SHAPES = [(), (0,), (2, 0, 3), (3, 4)]


def _values(dtype, shape):
    size = int(np.prod(shape))
    base = np.arange(size) % 5
    if np.dtype(dtype) == np.bool_:
        return (base % 2 == 0).reshape(shape)
    return base.astype(dtype).reshape(shape)


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_dtype_and_shape(dtype, shape, x64):
    value = _values(dtype, shape)
    with jax.enable_x64(x64):
        if dtype in X64_ONLY and not x64:
            with pytest.warns(UserWarning, match="truncated"):
                x = aa.async_wrap(lambda: value, shape=shape, dtype=dtype)
            want = jax.dtypes.canonicalize_dtype(dtype)
        else:
            x = aa.async_wrap(lambda: value, shape=shape, dtype=dtype)
            want = np.dtype(dtype)
        assert x.dtype == want and x.shape == shape and not x.aval.weak_type
        out = x.result()
        assert out.dtype == want and out.shape == shape
        np.testing.assert_array_equal(np.asarray(out), value.astype(want))


# -- every accepted kind of result -----------------------------------------------


class DLPackOnly:
    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class ArrayOnly:
    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a


def _buffer_with(values):
    buf = aa.empty(values.shape, values.dtype)
    np.asarray(buf)[...] = values
    return buf


RESULT_KINDS = {
    "numpy": lambda v: v,
    "jax": lambda v: jnp.asarray(v),
    "jax_on_device_1": lambda v: jax.device_put(v, jax.devices()[-1]),
    "host_buffer": _buffer_with,
    "dlpack": lambda v: DLPackOnly(v),
    "array_protocol": lambda v: ArrayOnly(v),
    "nested_list": lambda v: v.tolist(),
}


@pytest.mark.parametrize("kind", RESULT_KINDS)
def test_every_kind_of_result(kind):
    values = np.arange(6, dtype=F32).reshape(2, 3)
    x = aa.async_wrap(lambda: RESULT_KINDS[kind](values.copy()), shape=(2, 3), dtype=F32)
    out = x.result()
    assert isinstance(out, jax.Array) and out.dtype == F32
    np.testing.assert_array_equal(np.asarray(out), values)
    # No sharding asked: the default device, uncommitted, whatever f returned.
    assert out.devices() == {jax.devices()[0]}
    assert not out.committed


@pytest.mark.needs_jax_hooks
def test_python_scalar_is_never_weakly_typed():
    traces = []

    @jax.jit
    def g(v):
        traces.append(1)
        return v * 2

    x = aa.async_wrap(lambda: 3, shape=(), dtype=F32)
    assert not x.result().weak_type
    np.testing.assert_array_equal(g(x), 6.0)
    np.testing.assert_array_equal(g(jnp.asarray(4, dtype=F32)), 8.0)
    assert len(traces) == 1


# -- results numpy or JAX users trip over ------------------------------------------

_BASE = np.arange(24, dtype=np.float64).reshape(4, 6)
AWKWARD = {
    "strided": (lambda: _BASE[::2, ::3], (2, 2)),
    "reversed": (lambda: _BASE[::-1, ::-1], (4, 6)),
    "transposed": (lambda: _BASE.T, (6, 4)),
    "readonly_frombuffer": (
        lambda: np.frombuffer(_BASE.tobytes(), np.float64).reshape(4, 6),
        (4, 6),
    ),
    "broadcast_view": (lambda: np.broadcast_to(_BASE[0], (3, 6)), (3, 6)),
    "view_of_jax_array": (lambda: np.asarray(jnp.asarray(_BASE, dtype=F32)), (4, 6)),
    "big_endian": (lambda: _BASE.astype(">f8"), (4, 6)),
    "unaligned": (
        lambda: np.frombuffer(b"\0" + _BASE.astype(F32).tobytes(), F32, offset=1).reshape(4, 6),
        (4, 6),
    ),
    "zero_size": (lambda: np.empty((0, 6), ">i4"), (0, 6)),
}


@pytest.mark.parametrize("case", AWKWARD)
def test_awkward_numpy_results_give_the_right_values(case):
    make, shape = AWKWARD[case]
    expected = np.asarray(make(), dtype=F32)
    x = aa.async_wrap(make, shape=shape, dtype=F32)
    np.testing.assert_array_equal(np.asarray(x.result()), expected)


def test_big_endian_integers_keep_their_values():
    v = np.array([1, -2, 70000], dtype=">i8")
    x = aa.async_wrap(lambda: v, shape=(3,), dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(x.result()), [1, -2, 70000])


def test_a_numpy_array_the_loader_keeps_is_copied_not_aliased():
    kept = np.zeros(1 << 16, F32)
    x = aa.async_wrap(lambda: kept, shape=kept.shape, dtype=F32)
    out = x.result()
    kept[:] = 7
    assert float(out.sum()) == 0.0


def test_a_jax_array_the_loader_keeps_and_deletes_is_copied():
    kept = [jnp.arange(4, dtype=F32) + 1]
    x = aa.async_wrap(lambda: kept[0], shape=(4,), dtype=F32)
    out = x.result()
    kept[0].delete()
    np.testing.assert_array_equal(np.asarray(out), [1, 2, 3, 4])


@pytest.mark.needs_jax_hooks
def test_f_using_jax_while_the_main_thread_dispatches():
    def f():
        acc = jnp.zeros(8, F32)
        for _ in range(50):
            acc = acc + jnp.ones(8, F32)
        return acc

    xs = [aa.async_wrap(f, shape=(8,), dtype=F32) for _ in range(4)]
    step = jax.jit(lambda a, b: a * b + 1)
    outs = []
    for x in xs:
        for _ in range(10):
            outs.append(step(jnp.ones(8, F32), jnp.ones(8, F32)))
        np.testing.assert_array_equal(np.asarray(step(x, x)), np.full(8, 2501.0))
    assert all(float(o[0]) == 2.0 for o in outs)


# -- casting ----------------------------------------------------------------


def test_same_kind_casts_are_checked_for_loss():
    ok = aa.async_wrap(lambda: np.array([1.5, -2.25]), shape=(2,), dtype=F32)
    np.testing.assert_array_equal(ok.result(), np.array([1.5, -2.25], F32))
    ints = aa.async_wrap(lambda: [1, 2, 255], shape=(3,), dtype=np.uint8)
    np.testing.assert_array_equal(ints.result(), [1, 2, 255])

    with pytest.raises(OverflowError) as e:
        aa.async_wrap(lambda: np.array([1, 2**40]), shape=(2,), dtype=np.int32).result()
    msg = str(e.value)
    assert "int32" in msg and "int64" in msg
    assert msg.startswith("async_wrap(test_same_kind_casts_are_checked_for_loss.<locals>.<lambda>)")

    with pytest.raises(OverflowError, match=r"float32.*float64|float64.*float32"):
        aa.async_wrap(lambda: np.array([1e39]), shape=(1,), dtype=F32).result()
    with pytest.raises(OverflowError, match="uint8"):
        aa.async_wrap(lambda: np.array([-1]), shape=(1,), dtype=np.uint8).result()
    with pytest.raises(OverflowError, match="float16"):
        aa.async_wrap(lambda: np.array([70000]), shape=(1,), dtype=np.float16).result()
    # inf and nan that were already there are values, not overflow.
    special = aa.async_wrap(lambda: np.array([np.inf, np.nan]), shape=(2,), dtype=F32).result()
    assert np.isinf(special[0]) and np.isnan(special[1])


@pytest.mark.parametrize(
    ("value", "dtype"),
    [(np.array([1.5]), np.int32), (np.array([1j]), F32), (np.array([3]), np.bool_)],
)
def test_casts_across_kinds_are_type_errors(value, dtype):
    with pytest.raises(TypeError) as e:
        aa.async_wrap(lambda: value, shape=(1,), dtype=dtype).result()
    assert str(np.dtype(dtype)) in str(e.value) and str(value.dtype) in str(e.value)


def test_shape_must_match_exactly():
    with pytest.raises(ValueError) as e:
        aa.async_wrap(lambda: np.ones((3,), F32), shape=(1, 3), dtype=F32).result()
    assert "(1, 3)" in str(e.value) and "(3,)" in str(e.value)
    assert ".<lambda>) result: " in str(e.value)


# -- pytrees ----------------------------------------------------------------


def test_like_tree_matches_by_key_path():
    like = {"dense": {"kernel": sds((2, 3)), "bias": sds((3,))}, "step": sds((), np.int32)}
    out = {"step": 7, "dense": {"bias": np.ones(3), "kernel": np.zeros((2, 3), F32)}}
    tree = aa.async_wrap(lambda: out, like=like)
    got = aa.materialize(tree)
    np.testing.assert_array_equal(got["dense"]["bias"], np.ones(3, F32))
    assert got["step"].dtype == np.int32 and int(got["step"]) == 7


def test_like_tree_with_a_different_key_names_the_path():
    like = {"dense": {"kernel": sds((2,)), "bias": sds((2,))}}
    tree = aa.async_wrap(lambda: {"dense": {"kernel": [1, 2], "b": [3, 4]}}, like=like)
    for leaf in jax.tree_util.tree_leaves(tree):
        with pytest.raises(ValueError) as e:
            leaf.result()
        msg = str(e.value)
        assert msg.endswith("at ['dense']: missing keys 'bias'; unexpected keys 'b'")


@pytest.mark.parametrize(
    ("out", "where"),
    [
        ({"layers": ({"w": [1.0, 2.0]},) * 3}, "at ['layers']: expected list, got tuple"),
        (np.ones(2, F32), "at the root: expected dict, got ndarray"),
        ({"layers": [{"w": [1.0, 2.0]}]}, "at ['layers']: expected 3 items, got 1"),
    ],
    ids=["list_vs_tuple", "bare_array", "length"],
)
def test_structure_errors_say_where_and_stay_short(out, where):
    like = {"layers": [{"w": sds((2,))} for _ in range(3)]}
    tree = aa.async_wrap(lambda: out, like=like)
    exc = tree["layers"][0]["w"].exception(timeout=10)
    assert isinstance(exc, ValueError)
    assert str(exc).endswith(where) and len(str(exc)) < 200, str(exc)


def test_a_bad_leaf_fails_alone_and_names_its_path():
    like = {"a": sds((2,)), "b": sds((2,))}
    tree = aa.async_wrap(lambda: {"a": [1, 2], "b": [1, 2, 3]}, like=like)
    np.testing.assert_array_equal(tree["a"].result(), [1, 2])
    with pytest.raises(ValueError, match=r"\['b'\].*\(2,\).*\(3,\)"):
        tree["b"].result()


def test_ten_thousand_leaves_from_one_task():
    calls = []
    like = {f"p{i}": sds((2,), np.int32) for i in range(10_000)}

    def f():
        calls.append(threading.current_thread().name)
        return {k: np.array([i, -i], np.int32) for i, k in enumerate(like)}

    tree = aa.async_wrap(f, like=like)
    got = aa.materialize(tree)
    assert len(calls) == 1
    for i in (0, 1, 4321, 9999):
        np.testing.assert_array_equal(got[f"p{i}"], [i, -i])


# -- bad arguments raise at the call -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(shape=(2,), dtype=F32, like=sds((2,))), TypeError, "not both"),
        (dict(), TypeError, "needs shape= and dtype="),
        (dict(shape=(2,)), TypeError, "needs shape= and dtype="),
        (dict(shape=(2, -1), dtype=F32), ValueError, "negative dimension"),
        (dict(shape=(2,), dtype="float33"), TypeError, "unknown dtype"),
        (dict(shape=(2,), dtype=object), TypeError, "not a JAX array dtype"),
        (dict(shape="ab", dtype=F32), TypeError, "shape must be a tuple of integers"),
        (dict(like={"w": 3}), TypeError, r"leaf \['w'\].*needs .shape and .dtype"),
        (dict(like={"w": sds((-1,))}), ValueError, r"leaf \['w'\].*negative"),
        (dict(shape=(2,), dtype=F32, sharding="cpu"), TypeError, "jax.sharding.Sharding"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(kwargs, error, match, pool_size):
    pool_size(1)
    ran = []
    with pytest.raises(error, match=match):
        aa.async_wrap(lambda: ran.append(1), **kwargs)
    # One worker runs the queue in order: once this is done, anything the
    # refused call had queued has run.
    assert aa.async_wrap(lambda: 1, shape=(), dtype=F32).result(WAIT) == 1
    assert ran == []


def test_f_must_be_callable():
    with pytest.raises(TypeError, match="f must be callable, got int"):
        aa.async_wrap(3, shape=(), dtype=F32)


# -- f raising -------------------------------------------------------------------------------


class LoadError(Exception):
    pass


def _failing_loader():
    raise LoadError("server said no")


def _frames(exc):
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


@pytest.mark.needs_jax_hooks
def test_f_raising_fails_every_use_of_every_leaf():
    like = {"a": sds((2,)), "b": sds((3,))}
    tree = aa.async_wrap(_failing_loader, like=like)
    uses = {
        "result": lambda x: x.result(),
        "str": str,
        "np.asarray": np.asarray,
        "jax.jit": lambda x: jax.jit(lambda v: v + 1)(x),
        "block_until_ready": jax.block_until_ready,
        "operator": lambda x: x + 1,
    }
    for path in ("a", "b"):
        for name, use in uses.items():
            with pytest.raises(LoadError) as e:
                use(tree[path])
            assert "_failing_loader" in _frames(e.value), name
            assert any(f"['{path}']" in n for n in e.value.__notes__), (name, e.value.__notes__)
            ours = [n for n in e.value.__notes__ if n.startswith("async_array")]
            assert len(ours) == 1, e.value.__notes__
    # Notes do not pile up over repeated uses (JAX adds one of its own once).
    counts = set()
    for _ in range(3):
        with pytest.raises(LoadError) as e:
            jax.jit(lambda v: v * 2)(tree["a"])
        counts.add(len(e.value.__notes__))
    assert len(counts) == 1


def test_traceback_does_not_grow_with_repeated_uses():
    x = aa.async_wrap(_failing_loader, shape=(1,), dtype=F32)
    depths = []
    for _ in range(5):
        with pytest.raises(LoadError) as e:
            x.result()
        depths.append(len(traceback.extract_tb(e.value.__traceback__)))
    assert len(set(depths)) == 1, depths


def test_f_frames_do_not_keep_its_locals_alive():
    class Big:
        pass

    refs = []

    def f():
        big = Big()
        refs.append(weakref.ref(big))
        raise LoadError("after allocating")

    x = aa.async_wrap(f, shape=(1,), dtype=F32)
    with pytest.raises(LoadError):
        x.result()
    gc.collect()
    assert refs[0]() is None


def test_unretrieved_exception_is_logged_when_leaves_are_collected(caplog):
    x = aa.async_wrap(_failing_loader, shape=(1,), dtype=F32)
    assert x.exception(timeout=5) is not None  # retrieved: not logged
    y = aa.async_wrap(_failing_loader, shape=(1,), dtype=F32)
    aa.wait(y)
    with caplog.at_level(logging.ERROR, logger="async_array"):
        del x, y
        gc.collect()
    records = [r for r in caplog.records if r.name == "async_array"]
    assert len(records) == 1
    assert "was ever retrieved" in records[0].getMessage()
    assert records[0].exc_info[0] is LoadError


def test_exception_of_leaves_dropped_while_running_is_logged_when_it_comes(async_array_log):
    gate = Gate(exc=LoadError("after the leaves were gone"))

    def f():
        return gate()  # raises once the test opens the gate

    x = aa.async_wrap(f, shape=(1,), dtype=F32)
    del x
    gc.collect()
    gate.open()
    records = async_array_log.wait_for(1, "the unretrieved exception to be logged")
    assert len(records) == 1 and records[0].exc_info[0] is LoadError
    assert "async_wrap(test_exception_of_leaves_dropped" in records[0].getMessage()


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_base_exceptions_fail_the_leaves_and_keep_the_pool(exc_type):
    def f():
        raise exc_type("from f")

    x = aa.async_wrap(f, shape=(), dtype=F32)
    with pytest.raises(exc_type):
        x.result()
    assert float(aa.async_wrap(lambda: 5.0, shape=(), dtype=F32).result()) == 5.0


@pytest.mark.parametrize(("mode", "expected"), [("allow", np.int64), ("warn", np.int32)])
def test_explicit_x64_mode_decides_a_64_bit_dtype(mode, expected):
    # The answer is cached by dtype and settings: a mode set later still counts.
    before = jax.config.jax_explicit_x64_dtypes
    jax.config.update("jax_explicit_x64_dtypes", mode)
    try:
        if mode == "warn":
            with pytest.warns(UserWarning, match="truncated to dtype int32"):
                x = aa.async_wrap(lambda: np.arange(2), shape=(2,), dtype=np.int64)
        else:
            x = aa.async_wrap(lambda: np.arange(2), shape=(2,), dtype=np.int64)
        assert x.dtype == expected
        np.testing.assert_array_equal(np.asarray(x), [0, 1])
    finally:
        jax.config.update("jax_explicit_x64_dtypes", before.name.lower())
