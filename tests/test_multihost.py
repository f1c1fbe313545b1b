"""The real thing: N processes on 127.0.0.1 under
``jax.distributed``, 2 CPU devices each, each running ``multihost_worker.py``.

One job per N runs every scenario (a job costs seconds to start: 5 s for 2
processes, 8 s for 4), so each N is one test. Each process reports what it
read and what it got; the checks here compare that with a single-process
reference computed from the same file with numpy.
"""

import numpy as np
import pytest
import safetensors.numpy
from helpers.multihost import run_job, write_data

# Telling other processes of a failure needs jax.distributed's key-value
# store, found through a private name (async_array/_jax_hooks.py).
pytestmark = pytest.mark.needs_jax_hooks

ROWS, COLS = 16, 8  # as in multihost_worker.py
LOCAL = 2
LEAF_BYTES = ROWS * COLS * 4


def _check_shards(shards, reference, device_ids):
    assert {d for d, _, _ in shards} == set(device_ids)
    for _, index, values in shards:
        (r0, r1), (c0, c1) = index
        np.testing.assert_array_equal(np.array(values, np.float32), reference[r0:r1, c0:c1])


def _run(tmp_path, n):
    data = write_data(tmp_path / "data.bin", 3, ROWS, COLS)
    tensors = {"rows": data[0], "cols": data[1]}
    safetensors.numpy.save_file(tensors, str(tmp_path / "m.safetensors"))
    results = run_job(n, [str(tmp_path / "data.bin")], timeout=90)
    assert [r["process"] for r in results] == list(range(n))
    for r in results:
        devices = r["local_devices"]
        assert len(devices) == LOCAL

        # make_array_from_callback, rows over all 2N devices: a global array
        # whose global sum (a program over every process) is the reference's.
        cb = r["callback"]
        assert not cb["fully_addressable"]
        assert cb["sum"] == pytest.approx(float(data[0].sum()))
        _check_shards(cb["shards"], data[0], devices)
        # Exactly its share: 2 of 2N row blocks, each read once.
        assert cb["bytes"] == LEAF_BYTES // n and cb["calls"] == LOCAL

        # Partially replicated: P("data", None) on an (N, 2) mesh puts one row
        # block on both devices of a process: read once, not once a device.
        rows = r["partial"]["rows"]
        assert rows["sum"] == pytest.approx(float(data[1].sum()))
        _check_shards(rows["shards"], data[1], devices)
        assert rows["bytes"] == LEAF_BYTES // n and rows["calls"] == 1
        # P(None, "model"): each process holds both column halves of every row.
        cols = r["partial"]["cols"]
        assert cols["sum"] == pytest.approx(float(data[2].sum()))
        _check_shards(cols["shards"], data[2], devices)
        assert cols["bytes"] == LEAF_BYTES and cols["calls"] == LOCAL

        # load_safetensors with sharding=: each process read only its share
        # (2 of 2N row blocks; 2 of 2N column blocks of every row), and the
        # global arrays are the file's.
        st = r["safetensors"]
        assert st["bytes"] == 2 * LEAF_BYTES // n
        for name, want in tensors.items():
            assert st["sums"][name] == pytest.approx(float(want.sum()))
            _check_shards(st["shards"][name], want, devices)

        # 300 leaves of one call, leaf k all k.
        assert r["many_sum"] == float(ROWS * COLS * sum(range(300)))

        # No sharding=: this process's first local device, uncommitted.
        plain = r["default"]
        assert plain["device"] == devices[0] and not plain["committed"]
        assert plain["plus_one"] == [1.0, 2.0, 3.0, 4.0]

        # aa.jit in program order although inputs arrived in opposite orders.
        assert r["order"] == pytest.approx([float(data[0].sum()), float(data[1].sum())])

        # One process failing: it raises its own error; the others raise
        # one that names it and the leaf (the job ended, so nobody hung).
        # Through aa.jit, a plain wait and jax.jit alike.
        for failure in (r["failure"], r["wait_failure"], r["jit_failure"]):
            assert failure is not None
            if r["process"] == n - 1:
                assert failure["type"] == "KeyError"
            else:
                assert failure["type"] == "RemoteFailure", failure
                assert f"process {n - 1}" in failure["message"]
                assert "make_array_from_callback(flaky)" in failure["message"]
                assert "shard lost on purpose" in failure["message"]
    return results


def test_two_processes(tmp_path):
    _run(tmp_path, 2)


def test_four_processes(tmp_path):
    _run(tmp_path, 4)
