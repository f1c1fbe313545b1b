"""Starting a JAX job of N processes on 127.0.0.1 (``jax.distributed``, CPU
devices): a free port, every process's output read in its own thread, one
deadline for the whole job, and only our own children ended, by pid."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_data(path: Path, leaves: int, rows: int, cols: int) -> np.ndarray:
    """``leaves`` float32 arrays of (rows, cols) back to back; returns them."""
    data = (np.arange(leaves * rows * cols, dtype=np.float32) % 1009).reshape(leaves, rows, cols)
    data.tofile(path)
    return data


class Job:
    """The processes of one run and what each printed."""

    def __init__(self, n: int, args: list[str], timeout: float, env: dict[str, str]) -> None:
        self.n = n
        self.timeout = timeout
        port = free_port()
        full_env = dict(os.environ)
        full_env.pop("XLA_FLAGS", None)  # the worker sets its own device count
        full_env.update(env)
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(port), str(n), str(i), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=full_env,
            )
            for i in range(n)
        ]
        self.out = [""] * n
        self.err = [""] * n
        self.readers = []
        for i, p in enumerate(self.procs):
            for stream, sink in ((p.stdout, self.out), (p.stderr, self.err)):
                t = threading.Thread(target=self._drain, args=(stream, sink, i), daemon=True)
                t.start()
                self.readers.append(t)

    @staticmethod
    def _drain(stream, sink: list[str], i: int) -> None:
        with stream:
            sink[i] = stream.read()

    def wait(self) -> list[dict]:
        """Waits for every process (one deadline for all); kills the rest by
        pid on expiry. Returns each process's RESULT object."""
        done = threading.Event()
        waiter = threading.Thread(target=lambda: [p.wait() for p in self.procs] and done.set())
        waiter.daemon = True
        waiter.start()
        finished = done.wait(self.timeout)
        self.kill()
        for t in self.readers:
            t.join(10)
        codes = [p.returncode for p in self.procs]
        if not finished or any(codes):
            detail = "\n".join(
                f"--- process {i} (exit {codes[i]}) stderr:\n{self.err[i][-3000:]}"
                for i in range(self.n)
            )
            state = "timed out" if not finished else "failed"
            raise AssertionError(f"multi-process job {state} after <= {self.timeout} s\n{detail}")
        results = []
        for i, text in enumerate(self.out):
            lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            assert lines, f"process {i} printed no RESULT:\n{text}\n{self.err[i][-3000:]}"
            results.append(json.loads(lines[-1][len("RESULT ") :]))
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_job(n: int, args: list[str], timeout: float = 90, env: dict | None = None) -> list[dict]:
    job = Job(n, args, timeout, env or {})
    try:
        return job.wait()
    finally:
        job.kill()
