"""Whole-tree waits: materialize, wait and as_completed, each one wait on the
tasks behind a tree's leaves (async_map and async_stream are in test_map.py)."""

import threading

import jax
import numpy as np
import pytest
from conftest import WAIT, Gate, sds

import async_array as aa

F32 = np.float32
keystr = jax.tree_util.keystr


pytestmark = pytest.mark.usefixtures("roomy_pool")


def open_when_done(leaf, gate):
    """Opens ``gate`` once ``leaf`` is done (from the thread that finished it)."""
    leaf.add_done_callback(lambda _: gate.open())


# -- materialize ----------------------------------------------------------------


def test_materialize_returns_jax_arrays_and_passes_other_leaves():
    gate_a, gate_c = Gate([1, 2]), Gate(7)
    tree = {
        "a": gate_a.leaf(shape=(2,), dtype=F32),
        "b": [np.ones(1), 3, "text"],
        "c": gate_c.leaf(shape=(), dtype=np.int32),
    }
    open_when_done(tree["a"], gate_c)  # "c" loads only after "a"
    threading.Thread(target=gate_a.open).start()  # while materialize waits, or before
    out = aa.materialize(tree)
    assert type(out["a"]) is type(jax.numpy.zeros(1)) and out["a"].tolist() == [1.0, 2.0]
    assert out["b"][1] == 3 and out["b"][2] == "text" and int(out["c"]) == 7


def test_materialize_times_out_and_raises_the_first_failure():
    slow = Gate([1.0]).leaf(shape=(1,), dtype=F32)  # never opened: only the timeout ends the wait
    with pytest.raises(
        TimeoutError,
        match=r"aa.materialize: 1 leaf not ready after 0\.2 s \(the first: \['slow'\] of the "
        r"tree, async_wrap\(.*\)",
    ):
        aa.materialize({"slow": slow, "fast": np.ones(1)}, timeout=0.2)
    assert not slow.done()

    def boom():
        raise ZeroDivisionError("in loader")

    bad = aa.async_wrap(boom, shape=(1,), dtype=F32)
    with pytest.raises(ZeroDivisionError) as e:
        aa.materialize([bad])
    assert (
        "async_wrap(test_materialize_times_out_and_raises_the_first_failure.<locals>.boom)"
        in (e.value.__notes__[0])
    )


def test_one_hundred_thousand_leaves_values_and_key_paths():
    n = 100_000
    like = {}
    for i in range(n):
        like.setdefault(f"layer{i // 100:04d}", {})[f"w{i % 100:02d}"] = sds((2,), np.int32)

    def f():
        return {
            layer: {w: np.array([int(layer[5:]), int(w[1:])], np.int32) for w in ws}
            for layer, ws in like.items()
        }

    tree = aa.async_wrap(f, like=like)
    out = aa.materialize(tree)
    flat = jax.tree_util.tree_flatten_with_path(out)[0]
    assert len(flat) == n
    for path, value in flat[::997]:
        layer, w = path[0].key, path[1].key
        assert value.tolist() == [int(layer[5:]), int(w[1:])]
        assert keystr(path) == f"['{layer}']['{w}']"


# -- wait ----------------------------------------------------------------


def _three():
    """Three leaves whose loaders each wait for their gate (all closed): "fast"
    returns, "fails" raises, "slow" returns."""
    gates = {"fast": Gate([1.0]), "fails": Gate(exc=KeyError("b")), "slow": Gate([3.0])}
    tree = {k: g.leaf(shape=(1,), dtype=F32) for k, g in gates.items()}
    return gates, tree


def _paths(pairs):
    return sorted(keystr(p) for p, _ in pairs)


def test_wait_all_completed():
    gates, tree = _three()
    # They finish in order fast, fails, slow, each opening the next gate.
    open_when_done(tree["fast"], gates["fails"])
    open_when_done(tree["fails"], gates["slow"])
    gates["fast"].open()
    done, not_done = aa.wait(tree)
    assert _paths(done) == ["['fails']", "['fast']", "['slow']"] and not_done == []
    assert all(leaf is tree[p[0].key] for p, leaf in done)


def test_wait_first_completed():
    gates, tree = _three()
    gates["fast"].open()  # the others stay closed: only "fast" can end the wait
    done, not_done = aa.wait(tree, return_when=aa.FIRST_COMPLETED)
    assert _paths(done) == ["['fast']"]
    assert _paths(not_done) == ["['fails']", "['slow']"]


def test_wait_first_exception():
    gates, tree = _three()
    open_when_done(tree["fast"], gates["fails"])  # "fails" fails after "fast" is done
    gates["fast"].open()  # "slow" stays closed: only the failure can end the wait
    done, not_done = aa.wait(tree, return_when=aa.FIRST_EXCEPTION)
    assert _paths(done) == ["['fails']", "['fast']"] and _paths(not_done) == ["['slow']"]
    assert isinstance(tree["fails"].exception(), KeyError)
    # No exception at all: FIRST_EXCEPTION waits for everything ("b" loads after "a").
    gate_a, gate_b = Gate([1.0]), Gate([2.0])
    ok = {"a": gate_a.leaf(shape=(1,), dtype=F32), "b": gate_b.leaf(shape=(1,), dtype=F32)}
    open_when_done(ok["a"], gate_b)
    gate_a.open()
    done, not_done = aa.wait(ok, return_when=aa.FIRST_EXCEPTION)
    assert _paths(done) == ["['a']", "['b']"] and not_done == []


def test_wait_timeout_is_not_an_error():
    gates, tree = _three()
    gates["fast"].open()
    tree["fast"].result(WAIT)
    # "fails" and "slow" stay closed: only the timeout ends the wait.
    done, not_done = aa.wait(tree, timeout=0.15)
    assert _paths(done) == ["['fast']"] and _paths(not_done) == ["['fails']", "['slow']"]
    with pytest.raises(ValueError, match="return_when"):
        aa.wait(tree, return_when="SOMETIMES")


# -- as_completed ----------------------------------------------------------------


def test_as_completed_follows_completion_order():
    order = ["c", "d", "a", "b"]  # not the order of the tree's leaves (a, b, c, d)
    gates = {k: Gate([float(order.index(k))]) for k in order}
    tree = {k: gates[k].leaf(shape=(1,), dtype=F32) for k in "dabc"}
    gates["c"].open()
    tree["c"].result(timeout=WAIT)  # "c" is done before iteration starts
    got = []
    for path, v in aa.as_completed(tree, timeout=WAIT):
        got.append((path[0].key, float(v[0])))
        if len(got) < len(order):
            # The next leaf loads only now: each next() waits for it alone.
            gates[order[len(got)]].open()
    assert got == [("c", 0.0), ("d", 1.0), ("a", 2.0), ("b", 3.0)]


def test_as_completed_yields_a_tasks_leaves_together_and_times_out():
    one = Gate({"x": [1.0], "y": [2.0]})
    tree = {
        "one": one.leaf(like={"x": sds((1,)), "y": sds((1,))}),
        "late": Gate([0.0]).leaf(shape=(1,), dtype=F32),  # never opened
    }
    one.open()
    tree["one"]["x"].result(WAIT)  # done before the iteration's 0.5 s begin
    it = aa.as_completed(tree, timeout=0.5)
    assert [keystr(next(it)[0]), keystr(next(it)[0])] == ["['one']['x']", "['one']['y']"]
    with pytest.raises(TimeoutError, match=r"aa.as_completed: 1 leaf not ready .* result\)"):
        next(it)
