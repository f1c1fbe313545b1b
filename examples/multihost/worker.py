"""One process of the multi-host example: loads its shards of an MLP's weights
while the sharded forward pass compiles, then runs it.

On real hosts run this file on each with ``--coordinator HOST:PORT --processes N
--process-id I`` (or, where ``jax.distributed.initialize()`` finds them itself,
with ``--auto``); ``run.py`` starts N of them on 127.0.0.1 with 2 CPU devices each.
"""

import argparse
import json
import os
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("weights", help="the file written by run.py (float32 tensors back to back)")
parser.add_argument("--coordinator", default=None)
parser.add_argument("--processes", type=int, default=1)
parser.add_argument("--process-id", type=int, default=0)
parser.add_argument("--local-cpu-devices", type=int, default=0, help="CPU devices (0: real ones)")
parser.add_argument("--auto", action="store_true", help="jax.distributed.initialize() finds all")
args = parser.parse_args()

if args.local_cpu_devices:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_cpu_devices}"

import jax  # noqa: E402

if args.local_cpu_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
if args.auto:
    jax.distributed.initialize()
elif args.processes > 1:
    host = args.coordinator.rsplit(":", 1)[0]
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.processes,
        process_id=args.process_id,
        coordinator_bind_address=args.coordinator if host == "127.0.0.1" else None,
        initialization_timeout=60,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import async_array as aa  # noqa: E402

with open(args.weights + ".json") as f:
    layout = json.load(f)  # {"name": [offset, [rows, cols]]}, float32, row-major

start = time.perf_counter()
mesh = jax.make_mesh((jax.device_count(),), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
# Megatron-style: the first layer split by columns, the second by rows.
placements = {"w1": P(None, "model"), "w2": P("model", None)}
like = {
    name: jax.ShapeDtypeStruct(
        tuple(shape), np.float32, sharding=NamedSharding(mesh, placements[name])
    )
    for name, (_, shape) in layout.items()
}
fd = os.open(args.weights, os.O_RDONLY)
read_bytes = 0
lock = threading.Lock()


def read_shard(key_path, spec, index):
    """This process's shard ``index`` of one tensor, read with os.pread into
    aligned memory handed to JAX without a copy."""
    global read_bytes
    offset, (rows, cols) = layout[key_path[0].key]
    r0, r1, _ = index[0].indices(rows)
    c0, c1, _ = index[1].indices(cols)
    buf = aa.empty((r1 - r0, c1 - c0), np.float32)
    out = np.asarray(buf)
    if c0 == 0 and c1 == cols:  # whole rows: one read
        os.preadv(fd, [out], offset + r0 * cols * 4)
    else:
        for j, r in enumerate(range(r0, r1)):
            os.preadv(fd, [out[j]], offset + (r * cols + c0) * 4)
    with lock:
        read_bytes += out.nbytes
    return buf


params = aa.async_map(read_shard, like, per_shard=True)  # returns at once
x = jnp.ones((8, like["w1"].shape[0]), np.float32)
replicated = NamedSharding(mesh, P())


@aa.jit
def forward(params, x):
    h = jax.nn.relu(x @ params["w1"])
    return jax.lax.with_sharding_constraint(h @ params["w2"], replicated)


y = forward(params, jax.device_put(x, replicated))  # compiles while the shards load
result = np.asarray(y.result().addressable_data(0))
report = {
    "process": jax.process_index(),
    "processes": jax.process_count(),
    "devices": jax.device_count(),
    "read_mib": round(read_bytes / 2**20, 3),
    "total_mib": round(sum(np.prod(s) * 4 for _, s in layout.values()) / 2**20, 3),
    "seconds": round(time.perf_counter() - start, 3),
    "output_row0_first4": [round(float(v), 4) for v in result[0, :4]],
    "output_sum": round(float(result.sum()), 2),
}
print(json.dumps(report), flush=True)
sys.stdout.flush()
if args.processes > 1 or args.auto:
    jax.distributed.shutdown()
