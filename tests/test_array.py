"""AsyncArray: what never blocks, what waits, and the future-like API."""

import asyncio
import concurrent.futures
import copy
import pickle
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import WAIT, Gate, wait_for

import async_array as aa
from async_array import _core

F32 = np.float32


@pytest.fixture
def gated():
    def make(value, **kw):
        gate = Gate(value)
        return gate, gate.leaf(**kw)

    return make


def test_known_at_once_while_pending(gated):
    gate, x = gated(np.ones((2, 3), F32), shape=(2, 3), dtype=F32)
    wait_for(gate.started, "the loader to start")
    assert (x.shape, x.dtype, x.ndim, x.size, x.nbytes, x.itemsize) == ((2, 3), F32, 2, 6, 24, 4)
    assert x.aval.shape == (2, 3) and x.aval.dtype == F32 and not x.aval.weak_type
    assert x.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert not x.committed and x.device == jax.devices()[0]
    assert x.devices() == {jax.devices()[0]}
    assert not x.done() and not x.is_ready() and x.running() and not x.cancelled()
    assert repr(x) == "AsyncArray(running, shape=(2, 3), dtype=float32)"
    assert isinstance(x, jax.Array)
    assert not hasattr(x, "no_such_attribute")  # answered without waiting
    assert not x.done()
    gate.open()
    x.result()
    assert repr(x).startswith("AsyncArray(ready, Array([[1., 1., 1.]")


def test_result_timeout_then_value(gated):
    gate, x = gated(np.arange(3, dtype=F32), shape=(3,), dtype=F32)
    # The gate is closed: the only way out of result(0.2) is its timeout.
    with pytest.raises(TimeoutError, match=r"result: not ready after 0.2 s"):
        x.result(timeout=0.2)
    with pytest.raises(TimeoutError):
        x.exception(timeout=0)
    assert not x.done()
    gate.open()
    np.testing.assert_array_equal(x.result(timeout=10), [0, 1, 2])
    assert x.exception() is None


def test_sequence_protocol_and_array_copy_contract_match_jax_array():
    value = np.arange(6, dtype=F32).reshape(3, 2)
    x = aa.async_wrap(lambda: value, shape=(3, 2), dtype=F32)
    y = jnp.asarray(value)
    assert [r.tolist() for r in reversed(x)] == [r.tolist() for r in reversed(y)]
    # numpy 2's __array__(dtype, copy): copy=False raises where a copy is
    # needed, exactly when it does for the jax.Array.
    for dtype, copies in [(None, None), (None, True), (None, False), (np.int64, None),
                        (np.int64, True), (np.int64, False)]:  # fmt: skip
        try:
            want = y.__array__(dtype, copy=copies)
        except ValueError as exc:
            with pytest.raises(ValueError, match=re.escape(str(exc))):
                x.__array__(dtype, copy=copies)
        else:
            got = x.__array__(dtype, copy=copies)
            np.testing.assert_array_equal(got, want)
            assert got.dtype == want.dtype
    assert x.__array__(copy=True) is not x.__array__(copy=True)


def test_blocking_uses_return_the_value():
    x = aa.async_wrap(lambda: np.arange(6, dtype=F32).reshape(2, 3), shape=(2, 3), dtype=F32)
    assert str(x) == str(np.arange(6, dtype=F32).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(x), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(x, dtype=np.int64), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(x + 1, np.arange(1, 7).reshape(2, 3))
    np.testing.assert_array_equal(1 + x, np.arange(1, 7).reshape(2, 3))
    np.testing.assert_array_equal(np.ones((2, 3), F32) * x, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(x @ np.ones(3, F32), [3, 12])
    np.testing.assert_array_equal(-x, -np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(x == 4, np.arange(6).reshape(2, 3) == 4)
    np.testing.assert_array_equal(x[1], [3, 4, 5])
    np.testing.assert_array_equal(x[:, 1:], [[1, 2], [4, 5]])
    assert len(x) == 2
    np.testing.assert_array_equal(list(x)[1], [3, 4, 5])
    assert float(x.sum()) == 15.0
    assert x.reshape(3, 2).shape == (3, 2)
    assert x.T.shape == (3, 2)
    assert x.astype(np.int32).dtype == np.int32
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert float(x[1, 2]) == 5.0 and int(x[0, 1]) == 1 and bool(x[0, 1])
    assert f"{x[1, 1]:.2f}" == "4.00"
    assert x.at[0, 0].set(9.0)[0, 0] == 9.0
    assert x.unsafe_buffer_pointer() == x.result().unsafe_buffer_pointer()
    assert copy.deepcopy(x).tolist() == x.tolist()
    assert pickle.loads(pickle.dumps(x)).tolist() == x.tolist()
    with pytest.raises(TypeError):
        x[0, 0] = 1.0  # immutable, as jax.Array


def test_block_until_ready_returns_self_and_works_on_trees():
    x = aa.async_wrap(lambda: np.ones(2, F32), shape=(2,), dtype=F32)
    assert x.block_until_ready() is x and x.done()
    tree = {"a": aa.async_wrap(lambda: np.ones(2, F32), shape=(2,), dtype=F32), "b": 1}
    out = jax.block_until_ready(tree)
    assert out["a"].done() and out["b"] == 1


def test_cancel_a_task_that_has_not_started(pool_size):
    pool_size(1)
    blocker = Gate(np.zeros(1, F32))
    first = blocker.leaf()
    wait_for(blocker.started, "the blocker to start")
    ran = []
    like = {"a": jax.ShapeDtypeStruct((2,), F32), "b": jax.ShapeDtypeStruct((), F32)}
    queued = aa.async_wrap(lambda: ran.append(1), like=like)
    after = aa.async_wrap(lambda: np.ones(1, F32), shape=(1,), dtype=F32)  # queued behind it
    assert queued["a"].cancel()
    assert queued["b"].cancelled() and queued["b"].done()
    for leaf in (queued["a"], queued["b"]):
        with pytest.raises(concurrent.futures.CancelledError, match=r"leaf \['[ab]'\]"):
            leaf.result()
    assert "cancel" not in repr(first)
    assert not first.cancel()  # running: too late
    blocker.open()
    np.testing.assert_array_equal(first.result(), [0])
    # One worker runs the queue in order: once `after` is done, the cancelled
    # task has had its turn.
    np.testing.assert_array_equal(after.result(WAIT), [1])
    assert ran == []


def test_done_callbacks_get_the_leaf(async_array_log):
    gate = Gate(np.full(2, 3, F32))
    x = gate.leaf()
    seen = []
    done = threading.Event()

    def cb(leaf):
        seen.append(float(leaf.result()[0]))
        done.set()

    x.add_done_callback(cb)

    def bad(_):
        raise RuntimeError("callback bug")

    x.add_done_callback(bad)
    gate.open()
    wait_for(done, "the done-callback")
    x.result()
    late = []
    x.add_done_callback(lambda leaf: late.append(leaf is x))  # already done: runs here
    assert seen == [3.0] and late == [True]
    logged = async_array_log.wait_for(1, "the raising callback to be logged")
    assert len(logged) == 1
    # Names the callback itself, with the traceback of where it raised.
    assert "bad" in logged[0].getMessage() and logged[0].exc_info[0] is RuntimeError
    assert logged[0].exc_info[2] is not None


def test_await_in_asyncio():
    # The loader returns only once another task of the event loop opens its
    # gate: if `await x` blocked the loop, that task could never run.
    gate = Gate(np.arange(3, dtype=F32))
    x = gate.leaf()
    pending_when_opened = []

    async def open_gate():
        pending_when_opened.append(not x.done())
        gate.open()

    async def main():
        opener = asyncio.create_task(open_gate())  # runs once main awaits
        value = await x
        await opener
        return value

    value = asyncio.run(main())
    np.testing.assert_array_equal(value, [0, 1, 2])
    assert pending_when_opened == [True]  # the event loop ran while x was loading


def test_two_threads_waiting_on_slow_leaves_release_the_gil(pool_size):
    # The waiting threads are pool workers: a worker inside a wait stops
    # counting against max_workers, so with four workers (two loaders held at
    # their gates, two waiters) work queued behind them starts only on a
    # stand-in, one per waiter inside its wait. `second` starts once both wait
    # (`first` keeps the first stand-in until then) and opens the gates by
    # running Python, which a wait holding the GIL would forbid: the waits
    # would then give up after WAIT s and the test fail.
    pool_size(4)
    gates = [Gate(np.full(1, i, F32)) for i in range(2)]
    xs = [g.leaf() for g in gates]
    for g in gates:
        wait_for(g.started, "the loaders to start")
    waiters = [_core.submit(x.result, WAIT) for x in xs]
    both_wait = threading.Event()
    first = _core.submit(wait_for, both_wait, "a stand-in for the second waiter")

    def second():
        both_wait.set()
        for g in gates:
            g.open()

    opener = _core.submit(second)
    assert [float(w.result(WAIT)[0]) for w in waiters] == [0.0, 1.0]
    assert (first.result(WAIT), opener.result(WAIT)) == (None, None)
    assert all(x.done() for x in xs)
