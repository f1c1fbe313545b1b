"""One process of a multi-process JAX job on 127.0.0.1 (``tests/test_multihost.py``
starts N of them): runs every scenario, then prints one JSON line starting
with ``RESULT``. Every wait here is bounded.

Usage: ``python multihost_worker.py PORT NUM_PROCESSES PROCESS_ID DATA_FILE``.
"""

import json
import os
import sys
import threading

PORT, N, PID, DATA = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
LOCAL = 2  # CPU devices per process
ROWS, COLS = 16, 8  # of the data file's arrays (float32)

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL}"

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{PORT}",
    num_processes=N,
    process_id=PID,
    coordinator_bind_address=f"127.0.0.1:{PORT}",
    initialization_timeout=60,
    heartbeat_timeout_seconds=30,
    shutdown_timeout_seconds=30,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import async_array as aa  # noqa: E402
from async_array._core import _testing  # noqa: E402

WAIT = 60
ITEM = np.dtype(np.float32).itemsize
LEAF_BYTES = ROWS * COLS * ITEM


class Reader:
    """Reads shards of the data file's arrays with ``os.pread``, counting bytes."""

    def __init__(self) -> None:
        self.fd = os.open(DATA, os.O_RDONLY)
        self.lock = threading.Lock()
        self.bytes = 0
        self.calls = 0

    def read(self, leaf: int, index: tuple[slice, ...]) -> np.ndarray:
        rows = range(*index[0].indices(ROWS))
        c0, c1, _ = index[1].indices(COLS)
        out = aa.empty((len(rows), c1 - c0), np.float32)
        view = np.asarray(out)
        for j, r in enumerate(rows):
            at = leaf * LEAF_BYTES + (r * COLS + c0) * ITEM
            got = os.pread(self.fd, (c1 - c0) * ITEM, at)
            view[j] = np.frombuffer(got, np.float32)
        with self.lock:
            self.bytes += len(rows) * (c1 - c0) * ITEM
            self.calls += 1
        return out


def checksum(x: jax.Array) -> float:
    """The global sum, computed by a program that spans every process."""
    return float(jax.jit(jnp.sum, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x))


def local_values(x: jax.Array) -> list:
    """Each local shard: its device, its index as [start, stop] per axis, its values."""
    return [
        [
            s.device.id,
            [list(sl.indices(dim)[:2]) for sl, dim in zip(s.index, x.shape, strict=True)],
            np.asarray(s.data).tolist(),
        ]
        for s in x.addressable_shards
    ]


out: dict = {"process": PID, "local_devices": [d.id for d in jax.local_devices()]}

# 1. make_array_from_callback sharded on rows over every device of every process.
mesh1 = jax.make_mesh((N * LOCAL,), ("x",))
rows = NamedSharding(mesh1, PartitionSpec("x"))
reader = Reader()
x = aa.make_array_from_callback((ROWS, COLS), rows, lambda i: reader.read(0, i), dtype=np.float32)
x = x.result(WAIT)
out["callback"] = {
    "bytes": reader.bytes,
    "calls": reader.calls,
    "sum": checksum(x),
    "shards": local_values(x),
    "fully_addressable": x.is_fully_addressable,
}

# 2. async_map per shard on a partially replicated (N, 2) mesh: each process
# holds one block of rows on both its devices, and reads it once.
mesh2 = jax.make_mesh((N, LOCAL), ("data", "model"))
like = {
    "rows": jax.ShapeDtypeStruct((ROWS, COLS), np.float32),
    "cols": jax.ShapeDtypeStruct((ROWS, COLS), np.float32),
}
placements = {
    "rows": NamedSharding(mesh2, PartitionSpec("data", None)),
    "cols": NamedSharding(mesh2, PartitionSpec(None, "model")),
}
readers = {name: Reader() for name in like}
tree = aa.async_map(
    lambda path, spec, index: readers[path[0].key].read(1 if path[0].key == "rows" else 2, index),
    like,
    sharding=placements,
    per_shard=True,
)
tree = aa.materialize(tree, timeout=WAIT)
out["partial"] = {
    name: {
        "bytes": readers[name].bytes,
        "calls": readers[name].calls,
        "sum": checksum(tree[name]),
        "shards": local_values(tree[name]),
    }
    for name in like
}

# 2a. Many leaves of one call: several finish while the call still sets up
# its leaves, and the call is ready once all are, on every process.
MANY = 300
many = aa.async_map(
    lambda path, spec, index: np.full((ROWS // (N * LOCAL), COLS), path[0].idx, np.float32),
    [jax.ShapeDtypeStruct((ROWS, COLS), np.float32)] * MANY,
    sharding=rows,
    per_shard=True,
)
many = aa.materialize(many, timeout=WAIT)
stacked = jax.jit(
    lambda xs: sum(x.sum() for x in xs), out_shardings=NamedSharding(mesh1, PartitionSpec())
)
out["many_sum"] = float(stacked(many))

# 2b. load_safetensors of the job's safetensors file (beside DATA): rows
# over every device, and columns (a later-axis split: one run a row a shard).
# Each process reads the bytes of its own shards, counted by the core.
st_sharding = {
    "rows": NamedSharding(mesh1, PartitionSpec("x")),
    "cols": NamedSharding(mesh1, PartitionSpec(None, "x")),
}
before = _testing.tensor_bytes_read()
st = aa.load_safetensors(os.path.join(os.path.dirname(DATA), "m.safetensors"), sharding=st_sharding)
st = aa.materialize(st, timeout=WAIT)
out["safetensors"] = {
    "bytes": _testing.tensor_bytes_read() - before,
    "sums": {name: checksum(st[name]) for name in st_sharding},
    "shards": {name: local_values(st[name]) for name in st_sharding},
}

# 3. Without sharding=: a local device of this process, usable at once.
plain = aa.async_wrap(lambda: np.arange(4, dtype=np.float32), shape=(4,), dtype=np.float32)
value = plain.result(WAIT)
out["default"] = {
    "device": next(iter(value.devices())).id,
    "committed": value.committed,
    "plus_one": np.asarray(jnp.asarray(value) + 1).tolist(),
}

# 4. Program order: two runs of one program over every process whose inputs arrive in
# opposite orders (on even processes p first, on odd ones q first) launch in
# call order everywhere, as plain jax.jit would; out of order their
# collectives would pair wrongly.
arrived = {"p": threading.Event(), "q": threading.Event()}
order_reader = Reader()


def load(name: str, leaf: int):
    waits_for = ("p" if name == "q" else None) if PID % 2 == 0 else ("q" if name == "p" else None)

    def callback(index):
        if waits_for is not None:
            assert arrived[waits_for].wait(WAIT), f"{waits_for} never arrived"
        shard = order_reader.read(leaf, index)
        # Arrived here: not the leaf's readiness, which waits for every
        # process's share, and so for the other process's gate.
        arrived[name].set()
        return shard

    return callback


replicated = NamedSharding(mesh1, PartitionSpec())
sum_all = aa.jit(jnp.sum, out_shardings=replicated)
# Compiled beforehand (x has p's and q's shape and sharding), so that the
# order in which inputs arrive is what would decide the launch order.
aa.materialize(sum_all(x), timeout=WAIT)
p = aa.make_array_from_callback((ROWS, COLS), rows, load("p", 0), dtype=np.float32)
q = aa.make_array_from_callback((ROWS, COLS), rows, load("q", 1), dtype=np.float32)
first, second = sum_all(p), sum_all(q)
out["order"] = [float(first.result(WAIT)), float(second.result(WAIT))]


# 5. One process fails: the last one's callback raises. There it raises at
# once; every other process's program over the same global array raises,
# naming that process and leaf, instead of hanging in a collective.
def flaky(index):
    if PID == N - 1:
        raise KeyError("shard lost on purpose")
    return order_reader.read(0, index)


lost = aa.make_array_from_callback((ROWS, COLS), rows, flaky, dtype=np.float32)
try:
    sum_all(lost).result(WAIT)
    out["failure"] = None
except Exception as exc:
    out["failure"] = {"type": type(exc).__name__, "message": str(exc)}

# 6. The same failure seen by a plain wait and by jax.jit: the healthy
# processes' shares are loaded, yet their waits raise, naming the process.
waited = aa.make_array_from_callback((ROWS, COLS), rows, flaky, dtype=np.float32)
try:
    aa.materialize(waited, timeout=WAIT)
    out["wait_failure"] = None
except Exception as exc:
    out["wait_failure"] = {"type": type(exc).__name__, "message": str(exc)}
jitted = aa.make_array_from_callback((ROWS, COLS), rows, flaky, dtype=np.float32)
try:
    jax.block_until_ready(jax.jit(jnp.sum)(jitted))
    out["jit_failure"] = None
except Exception as exc:
    out["jit_failure"] = {"type": type(exc).__name__, "message": str(exc)}

print("RESULT " + json.dumps(out), flush=True)
jax.distributed.shutdown()
