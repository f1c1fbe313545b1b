"""AsyncArray: what never blocks, what waits, and the future-like API (DESIGN.md section 2)."""

import asyncio
import concurrent.futures
import copy
import pickle
import threading
import time

import jax
import numpy as np
import pytest

import async_array as aa

F32 = np.float32


class Gate:
    """A loader that returns ``value`` once released; tells when it started."""

    def __init__(self, value):
        self.value = value
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self):
        self.started.set()
        assert self.release.wait(30), "gate never released"
        return self.value


@pytest.fixture
def gated():
    gates = []

    def make(value, **kw):
        gate = Gate(value)
        gates.append(gate)
        return gate, aa.async_wrap(gate, **kw)

    yield make
    for g in gates:
        g.release.set()


def test_known_at_once_while_pending(gated):
    gate, x = gated(np.ones((2, 3), F32), shape=(2, 3), dtype=F32)
    assert gate.started.wait(5)
    assert (x.shape, x.dtype, x.ndim, x.size, x.nbytes, x.itemsize) == ((2, 3), F32, 2, 6, 24, 4)
    assert x.aval.shape == (2, 3) and x.aval.dtype == F32 and not x.aval.weak_type
    assert x.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert not x.committed and x.device == jax.devices()[0]
    assert x.devices() == {jax.devices()[0]}
    assert not x.done() and not x.is_ready() and x.running() and not x.cancelled()
    assert repr(x) == "AsyncArray(pending, shape=(2, 3), dtype=float32)"
    assert isinstance(x, jax.Array)
    assert not hasattr(x, "no_such_attribute")  # answered without waiting
    assert not x.done()
    gate.release.set()
    x.result()
    assert repr(x).startswith("AsyncArray(ready, Array([[1., 1., 1.]")


def test_result_timeout_then_value(gated):
    gate, x = gated(np.arange(3, dtype=F32), shape=(3,), dtype=F32)
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"result: not ready after 0.2 s"):
        x.result(timeout=0.2)
    assert 0.15 < time.perf_counter() - t < 2
    with pytest.raises(TimeoutError):
        x.exception(timeout=0)
    gate.release.set()
    np.testing.assert_array_equal(x.result(timeout=10), [0, 1, 2])
    assert x.exception() is None


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
    first = aa.async_wrap(blocker, shape=(1,), dtype=F32)
    assert blocker.started.wait(5)
    ran = []
    like = {"a": jax.ShapeDtypeStruct((2,), F32), "b": jax.ShapeDtypeStruct((), F32)}
    queued = aa.async_wrap(lambda: ran.append(1), like=like)
    assert queued["a"].cancel()
    assert queued["b"].cancelled() and queued["b"].done()
    for leaf in (queued["a"], queued["b"]):
        with pytest.raises(concurrent.futures.CancelledError, match=r"leaf \['[ab]'\]"):
            leaf.result()
    assert "cancel" not in repr(first)
    assert not first.cancel()  # running: too late
    blocker.release.set()
    np.testing.assert_array_equal(first.result(), [0])
    time.sleep(0.1)
    assert ran == []


def test_done_callbacks_get_the_leaf(caplog):
    gate = Gate(np.full(2, 3, F32))
    x = aa.async_wrap(gate, shape=(2,), dtype=F32)
    seen = []
    done = threading.Event()

    def cb(leaf):
        seen.append(float(leaf.result()[0]))
        done.set()

    x.add_done_callback(cb)

    def bad(_):
        raise RuntimeError("callback bug")

    x.add_done_callback(bad)
    gate.release.set()
    assert done.wait(10)
    x.result()
    late = []
    x.add_done_callback(lambda leaf: late.append(leaf is x))  # already done: runs here
    assert seen == [3.0] and late == [True]
    time.sleep(0.1)
    logged = [r for r in caplog.records if r.name == "async_array"]
    assert len(logged) == 1
    # Names the callback itself, with the traceback of where it raised.
    assert "bad" in logged[0].getMessage() and logged[0].exc_info[0] is RuntimeError
    assert logged[0].exc_info[2] is not None


def test_await_in_asyncio():
    async def main():
        x = aa.async_wrap(
            lambda: (time.sleep(0.2), np.arange(3, dtype=F32))[1], shape=(3,), dtype=F32
        )
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        value = await x
        t.cancel()
        return value, ticks

    value, ticks = asyncio.run(main())
    np.testing.assert_array_equal(value, [0, 1, 2])
    assert ticks >= 5  # the event loop kept running while x loaded


def test_two_threads_waiting_on_slow_leaves_release_the_gil():
    xs = [
        aa.async_wrap(lambda: (time.sleep(1.0), np.ones(1, F32))[1], shape=(1,), dtype=F32)
        for _ in range(2)
    ]
    t = time.perf_counter()
    threads = [threading.Thread(target=x.result) for x in xs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert time.perf_counter() - t < 1.7
    assert all(x.done() for x in xs)
