"""``x.future()`` against the behaviour CPython's own tests ask of a
``concurrent.futures.Future``.

CPython tests its futures in ``Lib/test/test_concurrent_futures``
(``test_future.py``'s ``FutureTests``, ``test_wait.py``'s ``WaitTests`` and
``ThreadPoolWaitTests``, ``test_as_completed.py``'s ``AsCompletedTests``).
There a test sets a future's state by hand; here the leaf drives its future:
a gated loader holds it running, a task queued behind the pool's one busy
worker holds it pending, opening the gate finishes it, a raising loader fails
it, ``x.cancel()`` cancels it. Each CPython test that applies has its twin
below, checked through ``x.future()``:

=============================================  ==============================================
CPython test                                   here
=============================================  ==============================================
test_done_callback_with_result                 test_callback_added_while_pending_gets_the_value
test_done_callback_with_exception              test_callback_added_while_pending_gets_the_error
test_done_callback_with_cancel                 test_callback_added_while_pending_sees_the_cancel
test_done_callback_raises                      test_a_raising_callback_is_logged_and_the_next_runs
test_done_callback_already_successful          test_callback_added_once_finished_runs_at_once
test_done_callback_already_failed              test_callback_added_once_failed_runs_at_once
test_done_callback_already_cancelled           test_callback_added_once_cancelled_runs_at_once
test_done_callback_raises_already_succeeded    test_a_raising_callback_added_once_done_is_logged
test_repr                                      test_repr_names_each_state
test_class_str                                 not applicable: str() of the module's classes,
                                               no future involved
test_cancel                                    test_cancel_in_each_state
test_cancelled                                 test_cancelled_in_each_state
test_done                                      test_done_in_each_state
test_running                                   test_running_in_each_state
test_result_with_timeout                       test_result_with_no_time_left_in_each_state
test_result_with_success                       test_result_waits_for_the_leaf
test_result_with_cancel                        test_result_waiting_sees_the_leaf_cancelled
test_exception_with_timeout                    test_exception_with_no_time_left_in_each_state
test_exception_with_success                    test_exception_waits_for_the_leaf_to_fail
test_multiple_set_result                       test_set_result_is_the_leafs_alone (decided:
                                               refused, InvalidStateError, in every state)
test_multiple_set_exception                    test_set_exception_is_the_leafs_alone (same)
test_get_snapshot                              not applicable: a private method CPython 3.14
                                               added; 3.11 to 3.13 have no such method
test_20369                                     test_wait_counts_a_repeated_future_once
test_first_completed                           test_wait_first_completed
test_first_completed_some_already_completed    test_wait_first_completed_some_already_done
test_first_exception                           test_wait_first_exception
test_first_exception_some_already_complete     test_wait_first_exception_some_already_done
test_first_exception_one_already_failed        test_wait_first_exception_one_already_failed
test_all_completed                             test_wait_all_completed
test_timeout                                   test_wait_all_completed_times_out
test_pending_calls_race                        test_wait_all_completed_of_many_released_at_once
test_no_timeout                                test_as_completed_without_a_timeout
test_future_times_out                          test_as_completed_times_out
test_duplicate_futures                         test_as_completed_yields_a_repeated_future_once
test_free_reference_yielded_future             test_as_completed_keeps_no_future_it_yielded
test_correct_timeout_exception_msg             test_as_completed_timeout_counts_the_unfinished
=============================================  ==============================================

36 CPython tests: 34 apply and have a twin here, 2 do not apply. One state of
CPython's has no leaf twin: CANCELLED without the notification that
``wait``/``as_completed`` read (an executor's worker sends it when it picks a
cancelled item). A leaf's future is notified as it is cancelled, so where
CPython puts that future in ``not_done``, a cancelled leaf's future is done.

Beyond CPython's list: the future mirrors its leaf at once, even while a
done-callback of the leaf still runs (a wait inside that callback must not
hang), and ``asyncio.wrap_future``/``gather``/``wait`` take it.
"""

import asyncio
import concurrent.futures as cf
import gc
import itertools
import logging
import re
import sys
import threading
import weakref

import jax
import numpy as np
import pytest
from conftest import WAIT, Gate, wait_for

import async_array as aa

F32 = np.float32
STATES = ["pending", "running", "cancelled", "failed", "finished"]


class Boom(OSError):
    """What a failing loader raises (an OSError, as CPython's failed future holds)."""


def finished_leaf(value=42.0):
    x = aa.async_wrap(lambda: np.full(2, value, F32), shape=(2,), dtype=F32)
    x.result(timeout=WAIT)
    return x


def failing_leaf(message="no such file"):
    def load():
        raise Boom(message)

    return aa.async_wrap(load, shape=(2,), dtype=F32)


def failed_leaf():
    x = failing_leaf()
    assert isinstance(x.exception(timeout=WAIT), Boom)
    return x


class Pool:
    """Leaves in each state on a pool of one worker: ``running`` holds the
    worker on a closed gate, so every leaf made after it stays pending."""

    def __init__(self, pool_size, finished=1, failed=1):
        self.finished = [finished_leaf(42.0 + i) for i in range(finished)]
        self.failed = [failed_leaf() for _ in range(failed)]
        pool_size(1)
        self.gate = Gate(np.full(2, 7.0, F32))
        self.running = self.gate.leaf()
        self.running_future = self.running.future()  # taken before it runs
        wait_for(self.gate.started, "the only worker to take the gated loader")

    def pending(self):
        x = aa.async_wrap(lambda: np.full(2, 5.0, F32), shape=(2,), dtype=F32)
        assert not x.running() and not x.done()
        return x

    def cancelled(self):
        x = self.pending()
        x.future()  # taken before the cancel
        assert x.cancel()
        return x

    def leaf(self, state):
        if state == "finished":
            return self.finished[0]
        if state == "failed":
            return self.failed[0]
        if state == "running":
            return self.running
        return getattr(self, state)()


@pytest.fixture
def leaves(pool_size):
    return Pool(pool_size)


def within(fn, what):
    """Runs ``fn()`` on a daemon thread (a wait with no timeout) and returns
    its result; fails the test, saying what never ended, after ``WAIT`` s."""
    out = {}
    ended = threading.Event()

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed back to the test
            out["error"] = exc
        ended.set()

    threading.Thread(target=run, daemon=True).start()
    wait_for(ended, what)
    if "error" in out:
        raise out["error"]
    return out["value"]


class Calls:
    """A done-callback that records each future it is called with."""

    def __init__(self, fn=None):
        self.fn = fn or (lambda f: None)
        self.seen = []
        self.called = threading.Event()

    def __call__(self, fut):
        self.seen.append((fut, self.fn(fut)))
        self.called.set()

    def wait(self, what="the done-callback"):
        wait_for(self.called, what)
        return self.seen


# -- done-callbacks ----------------------------------------------------------------


def test_callback_added_while_pending_gets_the_value():
    gate = Gate(np.arange(2, dtype=F32))
    x = gate.leaf()
    fut = x.future()
    calls = Calls(lambda f: f.result(timeout=0))
    fut.add_done_callback(calls)
    assert not calls.called.is_set()
    gate.open()
    ((called_with, value),) = calls.wait()
    assert called_with is fut
    np.testing.assert_array_equal(value, [0, 1])
    x.result(timeout=WAIT)
    assert len(calls.seen) == 1


def test_callback_added_while_pending_gets_the_error():
    gate = Gate(np.zeros(2, F32), exc=Boom("test"))
    x = gate.leaf()
    calls = Calls(lambda f: f.exception(timeout=0))
    x.future().add_done_callback(calls)
    gate.open()
    ((_, exc),) = calls.wait()
    assert isinstance(exc, Boom) and exc.args == ("test",)


def test_callback_added_while_pending_sees_the_cancel(leaves):
    x = leaves.pending()
    fut = x.future()
    calls = Calls(lambda f: f.cancelled())
    fut.add_done_callback(calls)
    assert fut.cancel()
    # Called by the cancel itself, on this thread, before it returns.
    assert calls.seen == [(fut, True)]
    assert x.cancelled()


def test_a_raising_callback_is_logged_and_the_next_runs(caplog):
    gate = Gate(np.zeros(2, F32))
    x = gate.leaf()
    raised = Calls()

    def raising(f):
        raised(f)
        raise Exception("doh!")

    after = Calls()
    x.future().add_done_callback(raising)
    x.future().add_done_callback(after)
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        gate.open()
        after.wait("the callback after the raising one")
    assert len(raised.seen) == 1 and len(after.seen) == 1
    (record,) = [r for r in caplog.records if r.name == "concurrent.futures"]
    assert "exception calling callback for" in record.getMessage()
    assert record.exc_info[0] is Exception and str(record.exc_info[1]) == "doh!"


def test_callback_added_once_finished_runs_at_once():
    x = finished_leaf(5.0)
    calls = Calls(lambda f: f.result(timeout=0))
    x.future().add_done_callback(calls)
    ((_, value),) = calls.seen  # ran here, before add_done_callback returned
    np.testing.assert_array_equal(value, [5, 5])


def test_callback_added_once_failed_runs_at_once():
    x = failed_leaf()
    calls = Calls(lambda f: f.exception(timeout=0))
    x.future().add_done_callback(calls)
    ((_, exc),) = calls.seen
    assert isinstance(exc, Boom)


def test_callback_added_once_cancelled_runs_at_once(leaves):
    x = leaves.cancelled()
    calls = Calls(lambda f: f.cancelled())
    x.future().add_done_callback(calls)
    assert calls.seen == [(x.future(), True)]


def test_a_raising_callback_added_once_done_is_logged(caplog):
    x = finished_leaf()

    def raising(_):
        raise Exception("doh!")

    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        x.future().add_done_callback(raising)
    (record,) = [r for r in caplog.records if r.name == "concurrent.futures"]
    assert "exception calling callback for" in record.getMessage()
    assert "doh!" in str(record.exc_info[1])


# -- the state, read in each state ----------------------------------------------------

REPRS = {
    "pending": r"state=pending>",
    "running": r"state=running>",
    "cancelled": r"state=cancelled>",
    "failed": r"state=finished raised Boom>",
    "finished": r"state=finished returned ArrayImpl>",
}


@pytest.mark.parametrize("state", STATES)
def test_repr_names_each_state(leaves, state):
    # repr is the first thing asked of the future: nothing else moved its state.
    fut = leaves.leaf(state).future()
    assert re.fullmatch(r"<\w*Future at 0x[0-9a-f]+ " + REPRS[state], repr(fut)), repr(fut)


@pytest.mark.parametrize(
    ("state", "cancels", "after"),
    [
        ("pending", True, "cancelled"),
        ("running", False, "running"),
        ("cancelled", True, "cancelled"),
        ("failed", False, "failed"),
        ("finished", False, "finished"),
    ],
)
def test_cancel_in_each_state(leaves, state, cancels, after):
    x = leaves.leaf(state)
    fut = x.future()
    assert fut.cancel() is cancels
    assert re.search(REPRS[after], repr(fut)), repr(fut)
    assert x.cancelled() is (after == "cancelled")


@pytest.mark.parametrize("state", STATES)
def test_cancelled_in_each_state(leaves, state):
    assert leaves.leaf(state).future().cancelled() is (state == "cancelled")


@pytest.mark.parametrize("state", STATES)
def test_done_in_each_state(leaves, state):
    assert leaves.leaf(state).future().done() is (state not in ("pending", "running"))


@pytest.mark.parametrize("state", STATES)
def test_running_in_each_state(leaves, state):
    assert leaves.leaf(state).future().running() is (state == "running")


def test_running_future_taken_before_the_task_started(leaves):
    assert leaves.running_future.running() and not leaves.running_future.done()


RESULT_AT_ONCE = {
    "pending": cf.TimeoutError,
    "running": cf.TimeoutError,
    "cancelled": cf.CancelledError,
    "failed": Boom,
}


@pytest.mark.parametrize("state", STATES)
def test_result_with_no_time_left_in_each_state(leaves, state):
    fut = leaves.leaf(state).future()
    if state == "finished":
        np.testing.assert_array_equal(fut.result(timeout=0), [42, 42])
    else:
        with pytest.raises(RESULT_AT_ONCE[state]):
            fut.result(timeout=0)


@pytest.mark.parametrize("state", STATES)
def test_exception_with_no_time_left_in_each_state(leaves, state):
    fut = leaves.leaf(state).future()
    if state == "finished":
        assert fut.exception(timeout=0) is None
    elif state == "failed":
        assert isinstance(fut.exception(timeout=0), Boom)
    else:
        with pytest.raises(RESULT_AT_ONCE[state]):
            fut.exception(timeout=0)


def test_result_waits_for_the_leaf():
    gate = Gate(np.full(2, 42.0, F32))
    fut = gate.leaf().future()
    threading.Thread(target=gate.open).start()
    np.testing.assert_array_equal(fut.result(timeout=WAIT), [42, 42])


def test_result_waiting_sees_the_leaf_cancelled(leaves):
    x = leaves.pending()
    fut = x.future()
    cancelled = []
    threading.Thread(target=lambda: cancelled.append(x.cancel())).start()
    with pytest.raises(cf.CancelledError):
        fut.result(timeout=WAIT)
    assert cancelled == [True]


def test_exception_waits_for_the_leaf_to_fail():
    gate = Gate(np.zeros(2, F32), exc=Boom("late"))
    fut = gate.leaf().future()
    threading.Thread(target=gate.open).start()
    exc = fut.exception(timeout=WAIT)
    assert isinstance(exc, Boom) and exc.args == ("late",)


def assert_mirrors(x, fut):
    """``fut`` ended as its leaf ``x`` did."""
    assert cf.wait([fut], timeout=WAIT).done == {fut}
    if x.cancelled():
        assert fut.cancelled()
    elif x.exception(timeout=0) is not None:
        assert fut.exception(timeout=0) is x.exception(timeout=0)
    else:
        assert fut.result(timeout=0) is x.result()


@pytest.mark.parametrize("state", STATES)
def test_set_result_is_the_leafs_alone(leaves, state):
    # The leaf sets its future: a user's set_result would make the two
    # disagree for good, so it is refused in every state (as CPython refuses a
    # second set_result), and the future still ends as its leaf.
    x = leaves.leaf(state)
    with pytest.raises(cf.InvalidStateError, match="set by its leaf"):
        x.future().set_result(2)
    leaves.gate.open()
    assert_mirrors(x, x.future())


@pytest.mark.parametrize("state", STATES)
def test_set_exception_is_the_leafs_alone(leaves, state):
    x = leaves.leaf(state)
    with pytest.raises(cf.InvalidStateError, match="set by its leaf"):
        x.future().set_exception(ValueError("not the leaf's"))
    leaves.gate.open()
    assert_mirrors(x, x.future())


# -- concurrent.futures.wait ----------------------------------------------------------


def test_wait_counts_a_repeated_future_once():
    fut = aa.async_wrap(lambda: np.ones(2, F32), shape=(2,), dtype=F32).future()
    done, not_done = within(
        lambda: cf.wait([fut, fut], return_when=cf.ALL_COMPLETED), "wait with no timeout"
    )
    assert done == {fut} and not_done == set()


def test_wait_first_completed(leaves):
    running = leaves.running.future()
    never = Gate(np.zeros(2, F32))
    queued = never.leaf().future()  # runs after the running leaf, then waits for good
    threading.Thread(target=leaves.gate.open).start()
    done, not_done = within(
        lambda: cf.wait([running, queued], return_when=cf.FIRST_COMPLETED),
        "wait FIRST_COMPLETED with no timeout",
    )
    assert done == {running} and not_done == {queued}


def test_wait_first_completed_some_already_done(leaves):
    cancelled = leaves.cancelled().future()
    finished = leaves.finished[0].future()
    running = leaves.running.future()
    done, not_done = within(
        lambda: cf.wait([cancelled, finished, running], return_when=cf.FIRST_COMPLETED),
        "wait FIRST_COMPLETED with no timeout",
    )
    assert done == {cancelled, finished} and not_done == {running}


def test_wait_first_exception(roomy_pool):
    first = Gate(np.full(2, 42.0, F32))
    failing = Gate(np.zeros(2, F32), exc=Boom("this is an exception"))
    never = Gate(np.zeros(2, F32))
    futures = [first.leaf().future(), failing.leaf().future(), never.leaf().future()]

    def open_in_order():
        first.open()
        futures[0].result(timeout=WAIT)  # the first finishes before the second fails
        failing.open()

    threading.Thread(target=open_in_order).start()
    done, not_done = within(
        lambda: cf.wait(futures, return_when=cf.FIRST_EXCEPTION),
        "wait FIRST_EXCEPTION with no timeout",
    )
    assert done == set(futures[:2]) and not_done == {futures[2]}


def test_wait_first_exception_some_already_done(leaves):
    finished = leaves.finished[0].future()
    cancelled = leaves.cancelled().future()
    failing = failing_leaf().future()  # queued behind the running leaf
    never = Gate(np.zeros(2, F32))
    queued = never.leaf().future()  # queued after it, then waits for good
    leaves.gate.open()
    futures = [finished, cancelled, failing, queued]
    done, not_done = within(
        lambda: cf.wait(futures, return_when=cf.FIRST_EXCEPTION),
        "wait FIRST_EXCEPTION with no timeout",
    )
    # A cancelled leaf's future is done (see the module doc).
    assert done == {finished, cancelled, failing} and not_done == {queued}


def test_wait_first_exception_one_already_failed(leaves):
    failed = leaves.failed[0].future()
    running = leaves.running.future()
    done, not_done = within(
        lambda: cf.wait([failed, running], return_when=cf.FIRST_EXCEPTION),
        "wait FIRST_EXCEPTION with no timeout",
    )
    assert done == {failed} and not_done == {running}


def test_wait_all_completed(leaves):
    futures = [
        leaves.finished[0].future(),
        leaves.cancelled().future(),
        leaves.failed[0].future(),
        failing_leaf().future(),  # queued: fails once the worker is free
        leaves.running.future(),
    ]
    leaves.gate.open()
    done, not_done = within(
        lambda: cf.wait(futures, return_when=cf.ALL_COMPLETED), "wait ALL_COMPLETED"
    )
    assert done == set(futures) and not_done == set()


@pytest.mark.parametrize("timeout", [0, 0.01])
def test_wait_all_completed_times_out(leaves, timeout):
    done_ones = {
        leaves.cancelled().future(),
        leaves.failed[0].future(),
        leaves.finished[0].future(),
    }
    running = leaves.running.future()
    done, not_done = cf.wait(done_ones | {running}, timeout=timeout)
    assert done == done_ones and not_done == {running}


def test_wait_all_completed_of_many_released_at_once(roomy_pool):
    gate = Gate(np.zeros(2, F32))
    futures = {gate.leaf().future() for _ in range(100)}
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        gate.open()
        done, not_done = within(
            lambda: cf.wait(futures, return_when=cf.ALL_COMPLETED), "100 leaves to finish"
        )
    finally:
        sys.setswitchinterval(before)
    assert done == futures and not not_done


# -- concurrent.futures.as_completed ---------------------------------------------------


def test_as_completed_without_a_timeout(leaves):
    futures = {
        leaves.cancelled().future(),
        leaves.failed[0].future(),
        leaves.finished[0].future(),
        leaves.pending().future(),
        leaves.running.future(),
    }
    leaves.gate.open()
    assert within(lambda: set(cf.as_completed(futures)), "as_completed") == futures


@pytest.mark.parametrize("timeout", [0, 0.01])
def test_as_completed_times_out(leaves, timeout):
    done_ones = {
        leaves.cancelled().future(),
        leaves.failed[0].future(),
        leaves.finished[0].future(),
    }
    yielded = set()
    with pytest.raises(cf.TimeoutError):
        for fut in cf.as_completed(done_ones | {leaves.running.future()}, timeout):
            yielded.add(fut)
    assert yielded == done_ones


def test_as_completed_yields_a_repeated_future_once():
    fut = aa.async_wrap(lambda: np.ones(2, F32), shape=(2,), dtype=F32).future()
    got = within(lambda: list(cf.as_completed(itertools.repeat(fut, 3))), "as_completed")
    assert got == [fut]


def test_as_completed_keeps_no_future_it_yielded(leaves):
    # Only the futures are kept: a leaf holds its future.
    gates = [Gate(np.full(2, i, F32)) for i in range(8)]
    leaves.gate.open()
    futures = [g.leaf().future() for g in gates]
    futures += [leaves.cancelled().future(), leaves.finished[0].future()]
    leaves.finished.clear()
    gc.collect()

    def yield_and_forget(timeout, open_next):
        for fut in cf.as_completed(futures, timeout=timeout):
            futures.remove(fut)
            ref = weakref.ref(fut)
            del fut
            gc.collect()
            assert ref() is None
            if open_next and gates:
                gates.pop(0).open()

    with pytest.raises(cf.TimeoutError):
        yield_and_forget(0, open_next=False)
    assert len(futures) == 8
    gates.pop(0).open()
    yield_and_forget(WAIT, open_next=True)
    assert futures == []


def test_as_completed_timeout_counts_the_unfinished(leaves):
    futures = [
        leaves.cancelled().future(),
        leaves.pending().future(),
        leaves.running.future(),
        leaves.finished[0].future(),
    ]
    with pytest.raises(cf.TimeoutError) as caught:
        list(cf.as_completed(futures, timeout=0))
    assert str(caught.value) == "2 (of 4) futures unfinished"


# -- at once: the future never lags its leaf ------------------------------------------


def test_futures_are_done_when_a_callback_of_their_task_runs():
    # A task's callbacks run in order on the finishing thread. One added
    # before the futures were taken (here a callback of the sibling leaf)
    # sees them done, and a wait on them inside it returns.
    gate = Gate({"a": np.ones(2, F32), "b": np.zeros(2, F32)})
    spec = jax.ShapeDtypeStruct((2,), F32)
    tree = aa.async_wrap(gate, like={"a": spec, "b": spec})
    seen = {}
    looked = threading.Event()

    def look(_):
        futures = [tree["a"].future(), tree["b"].future()]
        # First of all a wait, so that no other question moved their state.
        seen["blocking wait"] = cf.wait(futures, timeout=WAIT).done  # WAIT: it hung
        seen["done"] = [f.done() for f in futures]
        seen["repr"] = [repr(f) for f in futures]
        seen["wait"] = cf.wait(futures, timeout=0).done
        seen["as_completed"] = set(cf.as_completed(futures))
        looked.set()

    tree["a"].add_done_callback(look)
    futures = {tree["a"].future(), tree["b"].future()}  # their own callbacks come after
    gate.open()
    wait_for(looked, "the callback to see the futures done")
    assert seen["done"] == [True, True]
    assert all("state=finished" in r for r in seen["repr"]), seen["repr"]
    assert seen["wait"] == seen["blocking wait"] == seen["as_completed"] == futures


def test_future_is_done_once_its_leaf_is():
    # A reader that saw the leaf done sees its future done, whatever the
    # finishing thread still does (here: a callback of the whole tree's
    # future, added before the leaf's future was taken, holds it).
    gate = Gate(np.full(2, 7.0, F32))
    x = gate.leaf()
    release = threading.Event()
    tree_future = aa.future(x)
    tree_future.add_done_callback(lambda _: release.wait(WAIT))
    fut = x.future()
    gate.open()
    x.result(timeout=WAIT)
    try:
        assert fut.done() and "state=finished" in repr(fut)
        assert cf.wait([fut], timeout=0).done == {fut}
        np.testing.assert_array_equal(fut.result(timeout=0), [7, 7])
    finally:
        release.set()


def test_repr_says_running_without_asking_running_first():
    gate = Gate(np.ones(2, F32))
    x = gate.leaf()
    fut = x.future()
    wait_for(gate.started, "the loader to start")
    assert "state=running" in repr(fut)


# -- asyncio ----------------------------------------------------------------------------


def run_async(coro):
    async def bounded():
        return await asyncio.wait_for(coro, WAIT)

    return asyncio.run(bounded())


def test_wrap_future_of_a_leaf_in_each_done_state(leaves):
    async def read(fut):
        return await asyncio.wrap_future(fut)

    np.testing.assert_array_equal(run_async(read(leaves.finished[0].future())), [42, 42])
    with pytest.raises(Boom):
        run_async(read(leaves.failed[0].future()))
    with pytest.raises(asyncio.CancelledError):
        run_async(read(leaves.cancelled().future()))


def test_wrap_future_waits_for_a_running_leaf():
    gate = Gate(np.arange(2, dtype=F32))
    x = gate.leaf()

    async def main():
        asyncio.get_running_loop().call_soon(gate.open)  # runs once the await yields
        return await asyncio.wrap_future(x.future())

    np.testing.assert_array_equal(run_async(main()), [0, 1])


def test_gather_returns_values_errors_and_cancellations(leaves):
    futures = [
        leaves.finished[0].future(),
        leaves.failed[0].future(),
        leaves.cancelled().future(),
        leaves.running.future(),
    ]

    async def main():
        asyncio.get_running_loop().call_soon(leaves.gate.open)
        wrapped = [asyncio.wrap_future(f) for f in futures]
        return await asyncio.gather(*wrapped, return_exceptions=True)

    finished, failed, cancelled, was_running = run_async(main())
    np.testing.assert_array_equal(finished, [42, 42])
    assert isinstance(failed, Boom)
    assert isinstance(cancelled, asyncio.CancelledError)
    np.testing.assert_array_equal(was_running, [7, 7])
    assert isinstance(was_running, jax.Array)


def test_asyncio_wait_first_completed(leaves):
    async def main():
        running = asyncio.wrap_future(leaves.running.future())
        finished = asyncio.wrap_future(leaves.finished[0].future())
        done, pending = await asyncio.wait({running, finished}, return_when="FIRST_COMPLETED")
        leaves.gate.open()
        await running
        return done == {finished} and pending == {running}

    assert run_async(main())


def test_cancelling_the_wrapped_future_cancels_a_queued_leaf(leaves):
    x = leaves.pending()

    async def main():
        wrapped = asyncio.wrap_future(x.future())
        wrapped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wrapped

    run_async(main())
    assert x.cancelled() and x.future().cancelled()


def test_asyncio_wait_does_not_hang_once_the_leaf_ended(leaves):
    # The loop hears of the end through the future's callbacks alone.
    async def main():
        wrapped = asyncio.wrap_future(leaves.running.future())
        asyncio.get_running_loop().call_soon(leaves.gate.open)
        done, _ = await asyncio.wait({wrapped})
        return done == {wrapped}

    assert run_async(main())
