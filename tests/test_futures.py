"""Leaves with the standard futures tools: ``AsyncArray.future()``,
``aa.future(tree)``, ``await``, and the behaviour of ``concurrent.futures``
and ``jax.Array`` where the two meet (modelled on CPython's own future tests)."""

import asyncio
import concurrent.futures as cf
import gc
import logging
import re
import traceback
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import WAIT, Gate, poll_until, wait_for

import async_array as aa

F32 = np.float32


def ready_leaf(value=1.0, n=3):
    x = aa.async_wrap(lambda: np.full(n, value, F32), shape=(n,), dtype=F32)
    x.result(timeout=WAIT)
    return x


def failing_leaf(exc):
    def load():
        raise exc

    return aa.async_wrap(load, shape=(3,), dtype=F32)


def queued_leaf(pool_size):
    """A leaf whose task cannot start: the only worker waits on a closed gate."""
    pool_size(1)
    blocker = Gate(np.zeros(1, F32))
    blocker.leaf()
    wait_for(blocker.started, "the only worker to be taken")
    x = aa.async_wrap(lambda: np.ones(3, F32), shape=(3,), dtype=F32)
    assert not x.running()
    return blocker, x


# -- AsyncArray.future() ---------------------------------------------------------


def test_future_is_one_concurrent_future_with_the_leafs_value():
    gate = Gate(np.arange(3, dtype=F32))
    x = gate.leaf()
    fut = x.future()
    assert isinstance(fut, cf.Future) and fut is x.future()
    assert not fut.done()
    gate.open()
    done, not_done = cf.wait([fut], timeout=WAIT)
    assert done == {fut} and not not_done
    value = fut.result(timeout=0)
    assert isinstance(value, jax.Array) and not isinstance(value, aa.AsyncArray)
    np.testing.assert_array_equal(value, [0, 1, 2])
    assert value is x.result()


def test_futures_work_with_wait_and_as_completed():
    a, b = Gate(np.ones(2, F32)), Gate(np.zeros(2, F32))
    xa, xb = a.leaf(), b.leaf()
    futures = [xa.future(), xb.future()]
    b.open()
    first = next(cf.as_completed(futures, timeout=WAIT))
    assert first is xb.future()
    a.open()
    done, not_done = cf.wait(futures, timeout=WAIT, return_when=cf.ALL_COMPLETED)
    assert done == set(futures) and not not_done
    assert [float(f.result()[0]) for f in futures] == [1.0, 0.0]


def test_future_of_a_failed_leaf_holds_its_exception():
    x = failing_leaf(FileNotFoundError("404: weights.bin"))
    exc = x.future().exception(timeout=WAIT)
    assert isinstance(exc, FileNotFoundError) and "404" in str(exc)
    with pytest.raises(FileNotFoundError, match="404"):
        x.future().result(timeout=0)


def test_future_of_a_ready_leaf_is_done_at_once():
    x = ready_leaf(2.0)
    assert x.future().done()
    np.testing.assert_array_equal(x.future().result(0), [2, 2, 2])


def test_future_is_cancelled_with_its_leaf_and_cancels_it(pool_size):
    blocker, x = queued_leaf(pool_size)
    fut = x.future()
    assert x.cancel()
    assert fut.cancelled() and fut.done()
    with pytest.raises(cf.CancelledError):
        fut.result(0)
    # And the other way: cancelling the future cancels a task not started.
    y = aa.async_wrap(lambda: np.ones(3, F32), shape=(3,), dtype=F32)
    assert y.future().cancel()
    assert y.cancelled()
    blocker.open()


def test_future_cancel_fails_once_the_task_runs():
    gate = Gate(np.ones(3, F32))
    x = gate.leaf()
    wait_for(gate.started, "the loader to start")
    assert not x.future().cancel()
    assert not x.future().cancelled()
    gate.open()
    np.testing.assert_array_equal(x.future().result(WAIT), [1, 1, 1])


def test_wait_and_as_completed_see_a_leaf_cancelled_while_they_wait(pool_size):
    # concurrent.futures tells its waiters of a cancellation only through
    # set_running_or_notify_cancel: without it both would wait forever.
    blocker, x = queued_leaf(pool_size)
    fut = x.future()
    waiting = cf.ThreadPoolExecutor(2)
    try:
        waited = waiting.submit(cf.wait, [fut], WAIT)
        yielded = waiting.submit(lambda: list(cf.as_completed([fut], timeout=WAIT)))
        assert x.cancel()
        done, not_done = waited.result(timeout=2 * WAIT)
        assert done == {fut} and not not_done
        assert yielded.result(timeout=2 * WAIT) == [fut]
        assert fut.cancelled()
    finally:
        waiting.shutdown(wait=True)
        blocker.open()


def test_future_cancelled_through_itself_wakes_a_waiter(pool_size):
    blocker, x = queued_leaf(pool_size)
    fut = x.future()
    with cf.ThreadPoolExecutor(1) as waiting:
        waited = waiting.submit(cf.wait, [fut], WAIT)
        assert fut.cancel()
        done, _ = waited.result(timeout=2 * WAIT)
    assert done == {fut} and x.cancelled()
    blocker.open()


def test_future_is_running_while_the_task_runs():
    gate = Gate(np.ones(3, F32))
    x = gate.leaf()
    fut = x.future()
    wait_for(gate.started, "the loader to start")
    assert x.running() and fut.running() and not fut.done()
    assert "state=running" in repr(fut)
    gate.open()
    np.testing.assert_array_equal(fut.result(WAIT), [1, 1, 1])
    assert not fut.running() and fut.done()


def test_future_of_a_queued_leaf_is_pending(pool_size):
    blocker, x = queued_leaf(pool_size)
    assert not x.future().running() and not x.future().done()
    blocker.open()
    np.testing.assert_array_equal(x.future().result(WAIT), [1, 1, 1])


def test_hashing_a_leaf_says_to_use_its_future():
    x = ready_leaf()
    with pytest.raises(TypeError, match=r"unhashable type: 'AsyncArray'.*x\.future\(\)"):
        hash(x)
    with pytest.raises(TypeError, match="unhashable"):
        hash(x.result())  # as jax.Array


def test_asyncio_gather_of_leaves_names_the_future():
    x = ready_leaf()

    async def gather():
        return await asyncio.gather(x)

    with pytest.raises(TypeError, match=r"x\.future\(\)"):
        asyncio.run(gather())


def test_asyncio_gather_over_a_models_leaves():
    params = aa.async_map(
        lambda path, spec: np.full(spec.shape, len(path[0].key), spec.dtype),
        {"embed": jax.ShapeDtypeStruct((4,), F32), "head": jax.ShapeDtypeStruct((2,), F32)},
    )

    async def load_all():
        leaves = jax.tree_util.tree_leaves(params)
        return await asyncio.gather(*(asyncio.wrap_future(leaf.future()) for leaf in leaves))

    embed, head = asyncio.run(load_all())
    np.testing.assert_array_equal(embed, [5, 5, 5, 5])
    np.testing.assert_array_equal(head, [4, 4])


def test_as_completed_keeps_nothing_it_yielded():
    tree = {f"k{i}": ready_leaf(float(i)) for i in range(3)}
    tree["late"] = Gate(np.ones(2, F32)).leaf()
    it = aa.as_completed(tree, timeout=WAIT)
    del tree
    path, value = next(it)
    gone = weakref.ref(value)
    del path, value
    gc.collect()
    assert gone() is None  # the generator, still alive, holds no reference
    it.close()


def test_as_completed_keeps_nothing_it_yielded_after_a_wait():
    gates = [Gate(np.full(2, i, F32)) for i in range(3)]
    it = aa.as_completed({f"k{i}": g.leaf() for i, g in enumerate(gates)}, timeout=WAIT)
    gates[1].open()  # the first yield comes through the GIL-free wait on the tasks
    path, value = next(it)
    assert float(value[0]) == 1.0
    gone = weakref.ref(value)
    del path, value
    gc.collect()
    assert gone() is None
    it.close()


# -- aa.future(tree) -------------------------------------------------------------


def test_tree_future_completes_with_the_materialized_tree():
    a, b = Gate(np.ones(2, F32)), Gate(np.zeros(3, F32))
    tree = {"a": a.leaf(), "b": [b.leaf(), 7]}
    fut = aa.future(tree)
    assert isinstance(fut, cf.Future) and not fut.done()
    a.open()
    assert not fut.done() or fut.result(0) is not None  # b still pending
    b.open()
    out = fut.result(timeout=WAIT)
    assert out["b"][1] == 7
    assert type(out["a"]) is not aa.AsyncArray and isinstance(out["a"], jax.Array)
    np.testing.assert_array_equal(out["b"][0], [0, 0, 0])


def test_tree_future_fails_as_soon_as_a_leaf_fails():
    slow = Gate(np.ones(2, F32))
    tree = {"slow": slow.leaf(), "bad": failing_leaf(FileNotFoundError("404"))}
    # Completes while "slow" is still loading: the failure is known.
    with pytest.raises(FileNotFoundError, match="404"):
        aa.future(tree).result(timeout=WAIT)
    assert not tree["slow"].done()
    slow.open()


def test_tree_future_of_a_leaf_failed_before_it_fails_at_once():
    # A leaf already failed when aa.future was called had no callback left to
    # come: the tree future waited for every other leaf (1 run in 8 of the
    # test above, whose failing loader can end before aa.future is called).
    bad = failing_leaf(FileNotFoundError("404"))
    assert isinstance(bad.exception(timeout=WAIT), FileNotFoundError)
    slow = Gate(np.ones(2, F32))
    tree = {"slow": slow.leaf(), "bad": bad}
    with pytest.raises(FileNotFoundError, match="404"):
        aa.future(tree).result(timeout=WAIT)
    assert not tree["slow"].done()


def test_tree_future_with_nothing_pending():
    fut = aa.future({"x": ready_leaf(3.0), "n": None})
    np.testing.assert_array_equal(fut.result(0)["x"], [3, 3, 3])


# -- await ------------------------------------------------------------------------


def test_await_a_cancelled_leaf_raises_asyncio_cancelled_error(pool_size):
    blocker, x = queued_leaf(pool_size)
    assert x.cancel()

    async def read():
        return await x

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(read())
    blocker.open()


def test_cancelling_the_awaiting_task_cancels_a_leaf_not_started(pool_size):
    blocker, x = queued_leaf(pool_size)

    async def main():
        waiting = asyncio.ensure_future(_await(x))
        await asyncio.sleep(0)  # lets the task start awaiting
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    assert x.cancelled()
    blocker.open()


async def _await(x):
    return await x


def test_a_leaf_finishing_after_its_loop_closed_logs_nothing(caplog):
    gate = Gate(np.ones(3, F32))
    x = gate.leaf()

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_await(x), 0.05)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
        gate.open()
        np.testing.assert_array_equal(x.future().result(WAIT), [1, 1, 1])
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_await_returns_the_value():
    gate = Gate(np.arange(2, dtype=F32))
    x = gate.leaf()

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_soon(gate.open)  # runs only if `await x` leaves the loop free
        return await x

    np.testing.assert_array_equal(asyncio.run(main()), [0, 1])


# -- aa.wait / aa.as_completed ----------------------------------------------------


def test_wait_first_exception_counts_a_cancelled_leaf_as_done(pool_size):
    ok = ready_leaf()
    blocker, x = queued_leaf(pool_size)
    assert x.cancel()
    done, not_done = aa.wait({"c": x, "ok": ok}, timeout=WAIT, return_when=aa.FIRST_EXCEPTION)
    assert {p[0].key for p, _ in done} == {"c", "ok"} and not not_done
    # A cancelled leaf is not an exception: the wait goes on for the others.
    slow = Gate(np.ones(2, F32))
    done, not_done = aa.wait(
        {"c": x, "slow": slow.leaf()}, timeout=0, return_when=aa.FIRST_EXCEPTION
    )
    assert [p[0].key for p, _ in not_done] == ["slow"]
    slow.open()
    blocker.open()


def test_as_completed_yields_a_repeated_leaf_once():
    x, y = ready_leaf(1.0), ready_leaf(2.0)
    got = [(jax.tree_util.keystr(p), float(v[0])) for p, v in aa.as_completed([x, y, x])]
    assert got == [("[0]", 1.0), ("[1]", 2.0)]


def test_as_completed_keeps_nothing_it_has_yielded():
    gates = [Gate(np.full(4, i, F32)) for i in range(3)]
    it = aa.as_completed([g.leaf() for g in gates], timeout=WAIT)  # the tree is not kept
    gates[0].open()
    _, first = next(it)
    alive = weakref.ref(first)
    del first
    gates[1].open()
    _, second = next(it)
    # The worker that ran the first task lets go of it once its batch loop
    # moves on (a batch used to keep it while a later task blocked): poll.
    poll_until(lambda: gc.collect() >= 0 and alive() is None, "the first value to be freed")
    assert float(second[0]) == 1.0
    gates[2].open()
    assert [float(v[0]) for _, v in it] == [2.0]


# -- a known failure is raised at once ---------------------------------------------


def test_materialize_raises_a_known_failure_without_waiting_for_slow_leaves():
    slow = Gate(np.ones(2, F32))
    bad = failing_leaf(FileNotFoundError("404: head.bin"))
    tree = {"slow": slow.leaf(), "bad": bad}
    with pytest.raises(FileNotFoundError, match="404"):
        aa.materialize(tree, timeout=WAIT)  # the gate is still closed
    assert not tree["slow"].done()
    slow.open()


@pytest.mark.needs_jax_hooks  # jax.jit takes the leaves directly
def test_jit_dispatch_raises_a_known_failure_without_waiting():
    slow = Gate(np.ones(3, F32))
    bad = failing_leaf(ConnectionError("reset"))
    bad.exception(timeout=WAIT)
    with pytest.raises(ConnectionError, match="reset"):
        jax.jit(jnp.add)(slow.leaf(), bad)
    slow.open()


def test_a_known_validation_failure_is_raised_before_a_timeout():
    slow = Gate(np.ones(3, F32))
    bad = aa.async_wrap(lambda: None, shape=(3,), dtype=F32)  # fails validation, task succeeds
    bad.exception(timeout=WAIT)
    with pytest.raises(TypeError, match="got NoneType"):
        aa.materialize({"slow": slow.leaf(), "bad": bad}, timeout=0)
    slow.open()


def test_a_timeout_message_names_the_failures_already_known():
    # A leaf that fails validation while the wait goes on is not a failed task,
    # so the wait cannot stop for it; the timeout then names it.
    slow = Gate(np.ones(3, F32))
    bad = aa.async_wrap(lambda: None, shape=(3,), dtype=F32)
    bad.exception(timeout=WAIT)
    error = aa._waits.not_ready("aa.materialize", [slow.leaf(), bad], 0.0)
    assert re.fullmatch(
        r"aa.materialize: 1 leaf not ready after 0.0 s \(the first: async_wrap\(.*Gate.*\) "
        r"result\); already failed: async_wrap\(.*<lambda>\) result: TypeError: .*got NoneType",
        str(error),
    ), str(error)
    slow.open()


# -- conversion errors say what came ----------------------------------------------


@pytest.mark.parametrize(
    ("value", "got"),
    [
        (None, "got NoneType"),
        ("hello", "got str 'hello'"),
        (b"hi", "got bytes b'hi'"),
        ({"w": 1, "b": 2}, "got dict with keys ['w', 'b']"),
        (object(), "got object"),
    ],
)
@pytest.mark.parametrize("shape", [(3,), ()])
def test_a_result_of_the_wrong_type_is_named(value, got, shape):
    x = aa.async_wrap(lambda: value, shape=shape, dtype=F32)
    with pytest.raises(TypeError, match=r"async_wrap\(.*<lambda>\) result: .*" + re.escape(got)):
        x.result(timeout=WAIT)


class _BadArray:
    def __array__(self, dtype=None, copy=None):
        raise KeyError("the producer's own")


class _BadDLPack:
    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        raise MemoryError("out of pinned memory")


@pytest.mark.parametrize(("result", "error"), [(_BadArray, KeyError), (_BadDLPack, MemoryError)])
def test_an_exception_inside_a_results_protocol_reaches_the_user_as_itself(result, error):
    x = aa.async_wrap(result, shape=(3,), dtype=F32)
    with pytest.raises(error) as info:
        x.result(timeout=WAIT)
    assert any("async_wrap(" in n and "result" in n for n in info.value.__notes__)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "__array__" in frames or "__dlpack__" in frames


# -- dtypes, as JAX reads them ------------------------------------------------------


@pytest.mark.parametrize(("dtype", "expected"), [(float, np.float32), (int, np.int32)])
def test_python_types_mean_jaxs_default_without_a_warning(dtype, expected):
    if jax.config.jax_enable_x64:
        expected = np.float64 if dtype is float else np.int64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = aa.async_wrap(lambda: np.ones(3, dtype), shape=(3,), dtype=dtype)
        assert x.dtype == jnp.zeros(3, dtype=dtype).dtype == expected
    np.testing.assert_array_equal(x.result(timeout=WAIT), [1, 1, 1])


def test_a_truncation_warning_points_at_the_callers_line():
    with pytest.warns(UserWarning, match="requested in async_map") as record:
        aa.async_map(lambda p, s: np.ones(3), {"w": jax.ShapeDtypeStruct((3,), np.float64)})
    assert record[0].filename == __file__


# -- as jax.Array and concurrent.futures do ------------------------------------------


def test_weakref_to_a_leaf():
    x = ready_leaf()
    ref = weakref.ref(x)
    assert ref() is x
    del x
    gc.collect()
    assert ref() is None


def test_format_is_the_values_once_ready():
    gate = Gate(np.ones(3, F32))
    x = gate.leaf()
    assert x.format is None  # pending: the default layout
    gate.open()
    assert x.result(timeout=WAIT).format == x.format
    assert x.format is not None


def test_repr_says_running_once_the_task_runs(pool_size):
    blocker, x = queued_leaf(pool_size)
    assert repr(x) == "AsyncArray(pending, shape=(3,), dtype=float32)"
    blocker.open()
    x.result(timeout=WAIT)
    gate = Gate(np.ones(1, F32))
    y = gate.leaf()
    wait_for(gate.started, "the loader to start")
    assert repr(y) == "AsyncArray(running, shape=(1,), dtype=float32)"
    gate.open()


def test_negative_timeouts_count_as_zero():
    x = ready_leaf()
    np.testing.assert_array_equal(x.result(timeout=-1), [1, 1, 1])
    assert aa.materialize([x], timeout=-1)[0] is x.result()
    gate = Gate(np.ones(3, F32))
    y = gate.leaf()
    with pytest.raises(TimeoutError, match=r"not ready after 0.0 s"):
        y.result(timeout=-1)
    with pytest.raises(TimeoutError, match=r"1 leaf not ready after 0.0 s \(the first: \[1\] of"):
        aa.materialize([x, y], timeout=-5)
    gate.open()


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda x: x.result(timeout="x"), "AsyncArray.result"),
        (lambda x: x.exception(timeout="x"), "AsyncArray.exception"),
        (lambda x: aa.materialize([x], timeout="x"), "aa.materialize"),
        (lambda x: aa.wait([x], timeout="x"), "aa.wait"),
        (lambda x: aa.as_completed([x], timeout="x"), "aa.as_completed"),
    ],
)
def test_a_timeout_that_is_not_a_number_names_the_call(call, name):
    gate = Gate(np.ones(3, F32))
    x = gate.leaf()
    with pytest.raises(
        TypeError, match=rf"{name}.*timeout must be a number of seconds or None, got str 'x'"
    ):
        call(x)
    gate.open()


def test_add_done_callback_needs_a_callable():
    with pytest.raises(TypeError, match="add_done_callback: fn must be callable, got int"):
        ready_leaf().add_done_callback(3)


@pytest.mark.parametrize(
    ("timeout", "error"), [("x", TypeError), (True, TypeError), (float("nan"), ValueError)]
)
def test_a_bad_timeout_is_refused_by_a_ready_leaf_too(timeout, error):
    x = ready_leaf(1.0)
    assert x.exception(timeout=1) is None and float(x.result(timeout=1)[0]) == 1.0
    with pytest.raises(error, match=r"AsyncArray.result"):
        x.result(timeout=timeout)
    with pytest.raises(error, match=r"AsyncArray.exception"):
        x.exception(timeout=timeout)
