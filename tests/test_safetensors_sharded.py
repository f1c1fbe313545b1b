"""aa.load_safetensors(sharding=...): every placement jax.device_put takes,
values bit-exact against the safetensors package's reader, and exactly the
bytes of the distinct local shards read (counted by the core for files, by
the server over HTTP). On this process's 4 CPU devices, and once on 8 in a
fresh interpreter (``python tests/test_safetensors_sharded.py FILE``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the 8-device run: before JAX is imported
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import async_array as aa
from async_array._core import _testing

WANT = {
    "rows": ((16, 12), np.float32),  # sharded on axis 0: one byte range a shard
    "cols": ((16, 24), np.float32),  # split on axis 1: one run a row a shard
    "partial": ((8, 6), np.int32),  # rows split, replicated over the other mesh axis
    "replicated": ((5, 3), np.float16),
    "bias": ((12,), np.float32),
}


def write(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        name: (rng.standard_normal(shape) * 100).astype(dtype)
        for name, (shape, dtype) in WANT.items()
    }
    safetensors.numpy.save_file(arrays, str(path))
    return arrays


def placements() -> dict[str, object]:
    n = len(jax.devices())
    line = jax.make_mesh((n,), ("x",))
    grid = jax.make_mesh((n // 2, 2), ("x", "y"))
    return {
        "rows": NamedSharding(line, P("x")),
        "cols": NamedSharding(line, P(None, "x")),
        "partial": NamedSharding(grid, P("x", None)),
        "replicated": NamedSharding(line, P()),
        "bias": SingleDeviceSharding(jax.devices()[1]),
    }


def unique_local_bytes(arrays: dict[str, np.ndarray], shardings: dict[str, object]) -> int:
    """What a process must read: each distinct index its devices hold, once."""
    total = 0
    for name, s in shardings.items():
        a = arrays[name]
        seen = {}
        for index in s.addressable_devices_indices_map(a.shape).values():
            seen[tuple((x.start, x.stop) for x in index)] = a[index].nbytes
        total += sum(seen.values())
    return total


def check(path: Path, source: str | None = None) -> dict[str, int]:
    """Loads ``source`` (default: ``path``) with a sharding per tensor;
    checks placement and values against the safetensors package; returns
    the bytes the core read and the bytes it had to."""
    reference = safetensors.numpy.load_file(str(path))
    shardings = placements()
    before = _testing.tensor_bytes_read()
    tree = aa.load_safetensors(source or path, sharding=shardings, timeout=30)
    got = aa.materialize(tree, timeout=60)
    read = _testing.tensor_bytes_read() - before
    for name, s in shardings.items():
        x = got[name]
        assert isinstance(x, jax.Array) and not isinstance(x, aa.AsyncArray)
        assert x.sharding == s, (name, x.sharding, s)
        assert x.committed
        assert np.asarray(x).tobytes() == reference[name].tobytes(), name
        for shard in x.addressable_shards:
            assert np.asarray(shard.data).tobytes() == reference[name][shard.index].tobytes()
    return {"read": read, "expected": unique_local_bytes(reference, shardings)}


def test_each_placement_bit_exact_and_each_shard_read_once(tmp_path):
    path = tmp_path / "m.safetensors"
    write(path)
    counts = check(path)
    # One process holds every shard: each tensor read once in all, however
    # many devices hold a replica.
    assert counts["read"] == counts["expected"] == sum(a.nbytes for a in _arrays(path).values())


def _arrays(path: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(path))


def test_eight_devices_in_a_fresh_interpreter(tmp_path):
    from conftest import run_script

    path = tmp_path / "m.safetensors"
    write(path)
    code = (
        f"import runpy, sys; sys.argv = ['x', {str(path)!r}]; "
        f"runpy.run_path({__file__!r}, run_name='__main__')"
    )
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    proc = run_script(code, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["devices"] == 8
    assert counts["read"] == counts["expected"] == sum(a.nbytes for a in _arrays(path).values())


def test_a_later_axis_split_on_some_devices_from_like(tmp_path):
    """A column split over 2 of the 4 devices, given on the ``like`` leaf:
    each device's block is 16 runs of 48 bytes (one a row), read once; the
    other devices get nothing."""
    path = tmp_path / "m.safetensors"
    arrays = write(path)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = NamedSharding(mesh, P(None, "x"))
    before = _testing.tensor_bytes_read()
    got = aa.load_safetensors(
        path, like={"cols": jax.ShapeDtypeStruct((16, 24), np.float32, sharding=sharding)}
    )
    value = got["cols"].result(timeout=30)
    assert _testing.tensor_bytes_read() - before == arrays["cols"].nbytes
    assert value.sharding == sharding
    np.testing.assert_array_equal(np.asarray(value), arrays["cols"])
    assert {s.device for s in value.addressable_shards} == set(jax.devices()[:2])


def test_a_device_and_a_partition_spec_under_set_mesh(tmp_path):
    path = tmp_path / "m.safetensors"
    arrays = write(path)
    device = jax.devices()[2]
    got = aa.materialize(aa.load_safetensors(path, sharding=device), timeout=30)
    for name, a in arrays.items():
        assert got[name].devices() == {device} and got[name].committed
        np.testing.assert_array_equal(np.asarray(got[name]), a)
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    like = {"rows": jax.ShapeDtypeStruct((16, 12), np.float32)}
    with jax.set_mesh(mesh):
        tree = aa.load_safetensors(path, like=like, sharding=P("x"))
    value = tree["rows"].result(timeout=30)
    assert value.sharding == NamedSharding(mesh, P("x"))
    np.testing.assert_array_equal(np.asarray(value), arrays["rows"])


def test_an_uneven_split_raises_jaxs_error_at_the_call(tmp_path):
    path = tmp_path / "m.safetensors"
    write(path)
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    with pytest.raises(ValueError, match=r"leaf \['replicated'\].*does not evenly divide"):
        aa.load_safetensors(path, sharding=NamedSharding(mesh, P("x")))


def test_over_http_the_server_sends_each_shard_once(tmp_path):
    from test_safetensors_http import FaultServer

    path = tmp_path / "m.safetensors"
    write(path)
    server = FaultServer(tmp_path)
    try:
        counts = check(path, server.url("m.safetensors"))
        with server.lock:
            served = sum(end - start for _, start, end in server.requests if start > 0)
    finally:
        server.close()
    assert counts["read"] == served == counts["expected"]


if __name__ == "__main__":
    counts = check(Path(sys.argv[1]))
    counts["devices"] = len(jax.devices())
    print(json.dumps(counts), flush=True)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"])
def test_float8_tensors_load_sharded_bit_exact(tmp_path, name):
    dt = np.dtype(getattr(jax.numpy, name))
    raw = np.random.default_rng(3).integers(0, 256, (8, 6), dtype=np.uint8)
    path = tmp_path / "f8.safetensors"
    safetensors.numpy.save_file({"w": raw.view(dt)}, str(path))
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    for spec in (P("a", "b"), P(None, "b"), P()):
        sharding = NamedSharding(mesh, spec)
        got = aa.load_safetensors(path, sharding=sharding)["w"].result(timeout=30)
        assert got.dtype == dt and got.sharding == sharding, spec
        assert np.asarray(got).view(np.uint8).tobytes() == raw.tobytes(), spec
