"""Peak memory of a streaming consumer: a 512 MiB model loaded with
``max_bytes_in_flight`` and consumed leaf by leaf (``aa.as_completed``, each
leaf dropped once used), so that the loader's bound, not the model, sets the
peak. Target: the peak RSS growth at most 1.2x the budget plus one tensor.
The twin, what a user does without async_array: one tensor at a time read
from the file (its header parsed as the format says) into ``jax.device_put``.

Each way runs in a fresh interpreter (this file as a script) over a file the
test writes, and reports how far its peak RSS (``VmHWM``, reset before the
load) rose above the RSS before the load.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

TENSORS = 64
TENSOR_BYTES = 8 << 20  # 64 x 8 MiB = 512 MiB
BUDGET = 64 << 20
WAYS = ["async_array: load_safetensors + as_completed", "one tensor at a time + device_put"]

pytestmark = pytest.mark.timeout(900)


def peak_growth(way: str, path: str) -> dict:
    """In this (fresh) process: bytes the peak RSS grew by during the load."""
    import jax
    import numpy as np
    import psutil

    import async_array as aa

    jax.device_put(np.zeros(4, np.float32)).block_until_ready()  # JAX started
    # The kernel's high-water mark of this process's RSS (VmHWM), reset here:
    # ru_maxrss would carry the parent's RSS at the fork across the exec.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = psutil.Process().memory_info().rss
    checksum = 0.0
    if way.startswith("async_array"):
        done = aa.as_completed(aa.load_safetensors(path, max_bytes_in_flight=BUDGET))
        for _, x in done:  # the generator holds only the leaves still pending
            checksum += float(np.asarray(x)[0])  # a view on CPU: no compile, no copy
            del x
    else:
        # safe_open's own numpy reads map the file (its pages would count in
        # RSS): read each tensor's bytes as a plain loader does.
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for entry in header.values():
                start, end = entry["data_offsets"]
                f.seek(8 + n + start)
                x = jax.device_put(np.frombuffer(f.read(end - start), np.float32))
                checksum += float(np.asarray(x)[0])  # a view on CPU: no compile, no copy
                del x
    with open("/proc/self/status") as f:
        (peak_kib,) = [int(line.split()[1]) for line in f if line.startswith("VmHWM:")]
    peak = peak_kib * 1024
    return {"growth": peak - before, "checksum": checksum}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import numpy as np
    import safetensors.numpy

    path = tmp_path_factory.mktemp("stream") / "model.safetensors"
    n = TENSOR_BYTES // 4
    arrays = {f"t{i:02d}": np.full(n, i, np.float32) for i in range(TENSORS)}
    safetensors.numpy.save_file(arrays, str(path))
    return path


@pytest.mark.parametrize("way", WAYS)
def test_streaming_peak(benchmark, rounds, model, way):
    benchmark.group = "streaming consumer of 512 MiB, max_bytes_in_flight 64 MiB"
    growths = []

    def one_round():
        proc = subprocess.run(
            [sys.executable, __file__, way, str(model)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["checksum"] == sum(range(TENSORS))
        growths.append(out["growth"])

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    benchmark.extra_info["peak_growth_bytes"] = growths
    benchmark.extra_info["bound_bytes"] = 1.2 * BUDGET + TENSOR_BYTES


if __name__ == "__main__":
    print(json.dumps(peak_growth(sys.argv[1], sys.argv[2])))
