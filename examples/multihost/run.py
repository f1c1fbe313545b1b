"""Multi-host loading on one machine: writes an MLP's weights to a file, starts
N processes on 127.0.0.1 (``jax.distributed``, 2 CPU devices each) that each
read only their shards while the sharded forward pass compiles, and prints
process 0's report (and each process's bytes read on stderr).

    python examples/multihost/run.py [--processes 4] [--hidden 2048]

Every wait is bounded (--timeout); only the processes started here are ended.
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--processes", type=int, default=4)
parser.add_argument("--hidden", type=int, default=2048)
parser.add_argument("--timeout", type=float, default=120)
args = parser.parse_args()

with tempfile.TemporaryDirectory() as tmp:
    weights = Path(tmp) / "mlp.bin"
    rng = np.random.default_rng(0)
    d, h = 512, args.hidden
    tensors = {
        "w1": (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
        "w2": (rng.standard_normal((h, d)) / np.sqrt(h)).astype(np.float32),
    }
    layout, offset = {}, 0
    with open(weights, "wb") as f:
        for name, t in tensors.items():
            layout[name] = [offset, list(t.shape)]
            f.write(t.tobytes())
            offset += t.nbytes
    Path(str(weights) + ".json").write_text(json.dumps(layout))
    reference = np.maximum(np.ones((8, d), np.float32) @ tensors["w1"], 0) @ tensors["w2"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).with_name("worker.py")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                str(weights),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--processes",
                str(args.processes),
                "--process-id",
                str(i),
                "--local-cpu-devices",
                "2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(args.processes)
    ]
    outputs = [None] * len(procs)

    def collect(i):
        outputs[i] = procs[i].communicate()

    threads = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    done = threading.Event()
    threading.Thread(target=lambda: [t.join() for t in threads] and done.set(), daemon=True).start()
    finished = done.wait(args.timeout)
    for p in procs:  # only ours, by pid
        if p.poll() is None:
            p.kill()
        p.wait()
    if not finished or any(p.returncode for p in procs):
        for i, out in enumerate(outputs):
            err = out[1] if out else ""
            print(f"--- process {i} (exit {procs[i].returncode}):\n{err[-2000:]}", file=sys.stderr)
        sys.exit(f"the job {'timed out' if not finished else 'failed'}")
    reports = [json.loads(out[0].strip().splitlines()[-1]) for out in outputs]
    for r in reports:
        print(
            f"process {r['process']}: read {r['read_mib']} of {r['total_mib']} MiB "
            f"in {r['seconds']} s",
            file=sys.stderr,
        )
    r0 = reports[0]
    r0["matches_numpy"] = bool(
        np.isclose(r0["output_sum"], float(reference.sum()), rtol=1e-3, atol=1e-2)
    )
    print(json.dumps(r0))
