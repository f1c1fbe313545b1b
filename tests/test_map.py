"""Many-leaf producers: async_map (one task a leaf, each leaf ready and
failing on its own) and async_stream (one generator whose leaves become
ready as it yields them)."""

import logging
import threading
import traceback

import jax
import numpy as np
import pytest
from conftest import WAIT, sds, wait_for

import async_array as aa

F32 = np.float32
keystr = jax.tree_util.keystr


pytestmark = pytest.mark.usefixtures("roomy_pool")


# -- async_map ----------------------------------------------------------------


def test_async_map_calls_fn_per_leaf_with_key_path_and_spec():
    like = {"emb": sds((3, 2)), "layers": [{"w": sds((2, 2)), "b": sds((2,), np.int32)}] * 2}
    calls = []
    lock = threading.Lock()

    def fetch(path, spec):
        with lock:
            calls.append(keystr(path))
        return np.full(spec.shape, len(keystr(path)), spec.dtype)

    tree = aa.async_map(fetch, like)
    out = aa.materialize(tree)
    assert sorted(calls) == sorted(
        keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]
    )
    assert out["layers"][1]["b"].dtype == np.int32
    assert int(out["layers"][1]["b"][0]) == len("['layers'][1]['b']")
    assert out["emb"].shape == (3, 2)


def test_async_map_leaves_are_ready_one_by_one_and_fail_alone():
    gates = {k: threading.Event() for k in "abc"}

    def fetch(path, spec):
        key = path[0].key
        wait_for(gates[key], f"the test to open {key}")
        if key == "b":
            raise ConnectionError(f"lost {key}")
        return np.ones(spec.shape, spec.dtype)

    tree = aa.async_map(fetch, {k: sds((1,)) for k in "abc"})
    gates["a"].set()
    assert tree["a"].result(timeout=WAIT).tolist() == [1.0]
    assert not tree["c"].done()
    gates["b"].set()
    gates["c"].set()
    with pytest.raises(ConnectionError, match="lost b") as e:
        tree["b"].result()
    assert e.value.__notes__ == [
        "async_array: raised in async_map(test_async_map_leaves_are_ready_one_by_one_and_fail_alone"
        ".<locals>.fetch) leaf ['b']"
    ]
    assert tree["c"].result().tolist() == [1.0]


def test_async_map_validates_each_leaf():
    tree = aa.async_map(lambda p, s: np.ones((5,)), {"w": sds((2,))})
    with pytest.raises(ValueError, match=r"leaf \['w'\]: expected shape \(2,\), got \(5,\)"):
        tree["w"].result()
    with pytest.raises(TypeError, match="fn must be callable"):
        aa.async_map(None, {"w": sds((2,))})


def test_async_map_ten_thousand_leaves():
    like = [sds((4,), np.int32) for _ in range(10_000)]
    out = aa.materialize(aa.async_map(lambda p, s: np.full(4, p[0].idx, np.int32), like))
    assert [int(out[i][0]) for i in (0, 1, 5000, 9999)] == [0, 1, 5000, 9999]


# -- async_stream ----------------------------------------------------------------


def test_async_stream_leaves_ready_as_yielded():
    like = {"a": sds((1,)), "b": sds((1,)), "c": sds((1,))}
    step = threading.Semaphore(0)

    def gen():
        for key in ("b", "a", "c"):
            assert step.acquire(timeout=WAIT), "the test never released the next step"
            yield (jax.tree_util.DictKey(key),), np.array([ord(key)], F32)

    tree = aa.async_stream(gen, like)
    step.release()
    assert tree["b"].result(timeout=WAIT).tolist() == [ord("b")]
    assert not tree["a"].done() and not tree["c"].done()
    step.release()
    step.release()
    out = aa.materialize(tree)
    assert [float(out[k][0]) for k in "abc"] == [ord(k) for k in "abc"]


def test_async_stream_missing_duplicate_and_unknown_paths(caplog):
    like = {"a": sds((1,)), "b": sds((1,)), "c": sds((1,))}

    def gen():
        yield "['a']", [1.0]
        yield "['a']", [2.0]  # duplicate
        yield "['zz']", [3.0]  # unknown
        yield "['c']", [4.0]
        # "b" never comes

    with caplog.at_level(logging.ERROR, logger="async_array"):
        tree = aa.async_stream(gen, like)
        assert tree["a"].result().tolist() == [1.0]  # keeps the first value
        assert tree["c"].result().tolist() == [4.0]
        with pytest.raises(ValueError) as e:
            tree["b"].result()
    msg = str(e.value)
    assert "leaf ['b']" in msg and "without yielding it" in msg and "['zz']" in msg
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "async_array")
    assert "['a'] twice" in logged and "['zz']" in logged


@pytest.mark.parametrize(
    ("gen_fn", "match"),
    [
        (lambda: 3, r"gen_fn\(\) must return an iterable of \(key_path, value\) pairs, got int"),
        (lambda: iter([np.ones(1)]), r"must yield \(key_path, value\) pairs, got ndarray"),
    ],
    ids=["not_iterable", "not_pairs"],
)
def test_async_stream_misuse_says_what_it_needs(gen_fn, match):
    tree = aa.async_stream(gen_fn, {"a": sds((1,))})
    with pytest.raises(TypeError, match=match):
        tree["a"].result(timeout=10)


def test_async_stream_exception_fails_only_leaves_not_yet_yielded():
    like = {"a": sds((1,)), "b": sds((1,)), "c": sds((1,))}

    def gen():
        yield "['a']", [1.0]
        raise TimeoutError("stream cut")

    tree = aa.async_stream(gen, like)
    for key in ("b", "c", "b"):
        with pytest.raises(TimeoutError, match="stream cut") as e:
            tree[key].result()
        # Each leaf's note names it alone, however often and in whatever order they are used.
        assert [n for n in e.value.__notes__ if n.startswith("async_array")] == [
            f"async_array: raised in async_stream(test_async_stream_exception_fails_only_leaves"
            f"_not_yet_yielded.<locals>.gen) leaf ['{key}']"
        ]
        assert "gen" in [f.name for f in traceback.extract_tb(e.value.__traceback__)]
    assert tree["a"].result().tolist() == [1.0]
