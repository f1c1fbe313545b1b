"""Waits that would never end: a pool task that waits on its
own leaf, or tasks that wait on each other in a cycle, raise when the wait
starts, naming the calls in the cycle, instead of hanging.

Every wait inside a task here has a timeout of ``WAIT``: should detection
fail, the task ends and the test fails, rather than leave a worker blocked.
"""

from __future__ import annotations

import re
import threading

import jax
import numpy as np
import pytest
from conftest import WAIT, Gate, wait_for

import async_array as aa
from async_array import _core

WaitCycleError = _core.WaitCycleError
F32 = jax.ShapeDtypeStruct((), np.float32)


def wrap_name(f) -> str:
    return f"async_wrap({f.__qualname__})"


def assert_cycle(exc: BaseException | None, *names: str) -> None:
    """``exc`` is the cycle error of a ring of ``names`` (from whichever task found it)."""
    assert isinstance(exc, WaitCycleError) and isinstance(exc, RuntimeError), repr(exc)
    cycle = tuple(exc.cycle)
    assert cycle[0] == cycle[-1] and len(cycle) == len(names) + 1, cycle
    k = names.index(cycle[0])
    assert cycle[:-1] == names[k:] + names[:k], cycle
    assert f"(cycle: {' -> '.join(cycle)})" in str(exc)
    assert str(exc).startswith(f"{cycle[0]}: waiting on ")
    assert "would never end: it waits on this task" in str(exc)


class Later:
    """Leaves a task reads once the test has made them (``set``)."""

    def __init__(self) -> None:
        self.made = threading.Event()
        self.leaves: dict[str, object] = {}

    def set(self, **leaves) -> None:
        self.leaves.update(leaves)
        self.made.set()

    def __getitem__(self, name: str):
        wait_for(self.made, "the test to make the leaves")
        return self.leaves[name]


def test_a_task_waiting_on_its_own_leaf_raises_at_once():
    later = Later()

    def load():
        return later["x"].result(WAIT) + 1

    x = aa.async_wrap(load, shape=(), dtype=np.float32)
    later.set(x=x)
    with pytest.raises(RuntimeError) as info:
        x.result(WAIT)
    name = wrap_name(load)
    assert_cycle(info.value, name)
    assert str(info.value) == (
        f"{name}: waiting on {name} result would never end: it waits on this task "
        f"(cycle: {name} -> {name})"
    )
    assert "load" in [f.name for f in info.traceback], "raised inside the task"


def test_a_timed_wait_on_its_own_leaf_raises_the_cycle_not_a_timeout():
    later = Later()
    got = []

    def load():
        for wait in (lambda x: x.result(WAIT), lambda x: x.exception(WAIT)):
            try:
                wait(later["x"])
            except BaseException as exc:
                got.append(exc)
        try:
            later["x"].result(0)  # a poll never hangs: not a cycle
        except BaseException as exc:
            got.append(exc)
        return 1.0

    x = aa.async_wrap(load, shape=(), dtype=np.float32)
    later.set(x=x)
    assert float(x.result(WAIT)) == 1.0
    assert_cycle(got[0], wrap_name(load))
    assert_cycle(got[1], wrap_name(load))
    assert type(got[2]) is TimeoutError and "not ready after 0" in str(got[2])


def test_two_tasks_waiting_on_each_other_both_fail_naming_the_cycle():
    later = Later()

    def f():
        return later["y"].result(WAIT)

    def g():
        return later["x"].result(WAIT)

    x = aa.async_wrap(f, shape=(), dtype=np.float32)
    y = aa.async_wrap(g, shape=(), dtype=np.float32)
    later.set(x=x, y=y)
    # One task finds the cycle when its wait starts; the other's wait then
    # ends with that task's failure.
    for leaf in (x, y):
        assert_cycle(leaf.exception(WAIT), wrap_name(f), wrap_name(g))


def test_a_ring_of_three_async_map_leaves_names_each_key_path():
    like = {"a": F32, "b": F32, "c": F32}
    after = {"a": "b", "b": "c", "c": "a"}
    later = Later()

    def fetch(path, spec):
        return later["tree"][after[path[0].key]].result(WAIT)

    tree = aa.async_map(fetch, like)
    later.set(tree=tree)
    names = tuple(f"async_map({fetch.__qualname__}) leaf ['{k}']" for k in "abc")
    for leaf in tree.values():
        assert_cycle(leaf.exception(WAIT), *names)


def test_a_cycle_through_an_async_stream_leaf():
    later = Later()

    def f():
        return later["stream"]["a"].result(WAIT)

    def gen():
        yield "['a']", later["x"].result(WAIT)

    x = aa.async_wrap(f, shape=(), dtype=np.float32)
    stream = aa.async_stream(gen, {"a": F32})
    later.set(x=x, stream=stream)
    name = f"async_stream({gen.__qualname__})"
    assert_cycle(x.exception(WAIT), wrap_name(f), name)
    assert_cycle(stream["a"].exception(WAIT), wrap_name(f), name)


def test_a_cycle_through_an_aa_jit_output():
    later = Later()

    def plus(v):
        return v + 1

    plus_one = aa.jit(plus)

    def f():
        return plus_one(later["x"]).result(WAIT)

    x = aa.async_wrap(f, shape=(), dtype=np.float32)
    later.set(x=x)
    assert_cycle(x.exception(WAIT), wrap_name(f), f"aa.jit({plus.__qualname__})")


@pytest.mark.needs_jax_hooks
def test_jax_jit_dispatch_inside_the_task_on_its_own_leaf():
    later = Later()

    def f():
        return jax.jit(lambda v: v * 2)(later["x"])

    x = aa.async_wrap(f, shape=(), dtype=np.float32)
    later.set(x=x)
    assert_cycle(x.exception(WAIT), wrap_name(f))


BULK_WAITS = {
    "materialize": lambda t: aa.materialize(t, timeout=WAIT),
    "wait-all": lambda t: aa.wait(t, timeout=WAIT),
    "wait-first-completed": lambda t: aa.wait(t, WAIT, aa.FIRST_COMPLETED),
    "wait-first-exception": lambda t: aa.wait(t, WAIT, aa.FIRST_EXCEPTION),
    "as_completed": lambda t: list(aa.as_completed(t, timeout=WAIT)),
    "block_until_ready": jax.block_until_ready,
}


@pytest.mark.parametrize("wait", BULK_WAITS.values(), ids=BULK_WAITS.keys())
def test_every_bulk_wait_on_its_own_tree_names_the_leaf(wait):
    later = Later()

    def load():
        wait({"plain": np.float32(1), "own": later["tree"]})
        return {"a": np.float32(0), "b": np.float32(0)}

    tree = aa.async_wrap(load, like={"a": F32, "b": F32})
    later.set(tree=tree)
    exc = tree["b"].exception(WAIT)
    assert_cycle(exc, wrap_name(load))
    if wait is not jax.block_until_ready:  # that one waits leaf by leaf
        assert f"waiting on {wrap_name(load)} leaf ['a'] would never end" in str(exc)


def test_first_completed_and_as_completed_wait_for_a_leaf_outside_the_cycle():
    later = Later()
    gate = Gate(np.float32(5))
    other = gate.leaf()
    seen = []

    def load():
        own = later["x"]
        done, _ = aa.wait([own, other], WAIT, aa.FIRST_COMPLETED)
        seen.append([leaf is other for _, leaf in done])
        try:
            for path, value in aa.as_completed([other, own], timeout=WAIT):
                seen.append((path, float(value)))
        except WaitCycleError as exc:
            seen.append(exc)
        return np.float32(2)

    x = aa.async_wrap(load, shape=(), dtype=np.float32)
    later.set(x=x)
    wait_for(gate.started, "the other leaf's task to start")
    gate.open()
    assert float(x.result(WAIT)) == 2.0
    assert seen[0] == [True], "FIRST_COMPLETED returned the leaf outside the cycle"
    assert seen[1] == ((jax.tree_util.SequenceKey(0),), 5.0)
    assert_cycle(seen[2], wrap_name(load))
    assert "waiting on " + wrap_name(load) + " result" in str(seen[2])


def test_waits_that_are_no_cycle_are_untouched():
    gate = Gate(np.float32(3))
    slow = gate.leaf()

    def middle():
        return slow.result(WAIT) + 1

    mid = aa.async_wrap(middle, shape=(), dtype=np.float32)

    def top():
        # A diamond: mid waits on slow, top on both. No task waits on top.
        values = aa.materialize({"mid": mid, "slow": slow}, timeout=WAIT)
        return values["mid"] + values["slow"]

    result = aa.async_wrap(top, shape=(), dtype=np.float32)
    wait_for(gate.started, "the gated task to start")
    gate.open()
    assert float(result.result(WAIT)) == 7.0


def test_core_tasks_are_named_by_their_function():
    holder = {}
    made = threading.Event()

    def job():
        wait_for(made, "the future")
        return holder["fut"].result(WAIT)

    fut = _core.submit(job)
    holder["fut"] = fut
    made.set()
    with pytest.raises(WaitCycleError, match=re.escape(f"(cycle: {job.__qualname__} -> ")):
        fut.result(WAIT)


@pytest.mark.parametrize("how", ["str", "callable"])
def test_core_tasks_are_named_by_their_label(how):
    holder = {}
    made = threading.Event()
    asked = []

    def job(n):
        wait_for(made, "the future")
        return holder["fut"].result(WAIT)

    def name_of(n):
        asked.append(n)
        return f"job #{n}"

    label = "job #7" if how == "str" else name_of
    fut = _core.submit(job, 7, label=label)
    holder["fut"] = fut
    made.set()
    with pytest.raises(WaitCycleError, match=re.escape("(cycle: job #7 -> job #7)")):
        fut.result(WAIT)
    assert asked == ([] if how == "str" else [7]), "called with the task's args, once"


def test_a_label_callable_is_called_only_when_a_message_needs_it():
    asked = []
    futures = _core.submit_many(len, [("ab",), ("abc",)], label=lambda s: asked.append(s) or s)
    assert [f.result(WAIT) for f in futures] == [2, 3]
    assert asked == [], "no wait, no cycle check, no label"
