"""A local HTTP server for a safetensors file that behaves like a real network.

It serves one file at ``/<file name>`` on 127.0.0.1 (an ephemeral port) with
``Range`` support (``206 Partial Content`` and ``Content-Range``), from the
standard library's ``ThreadingHTTPServer``. Two knobs make it slow the way a
network is:

* ``bandwidth``: MB/s (10**6 bytes a second) for all connections together, as
  one link is shared; bodies are paced in 64 KiB chunks.
* ``latency``: milliseconds each request waits before its response starts.

And three make it fail, for tests: ``faults={"tensor name": "drop"}`` closes
the connection halfway through that tensor's body, ``"404"`` answers 404 for
it, ``"stall"`` sends half of it, then nothing (a client needs a socket
timeout); ``truncate_to=N`` serves the file as if it had only its first N bytes.
The server reads the file's safetensors header to know where each tensor is.

Examples:
  >>> with WeightServer("model.safetensors", bandwidth=100, latency=20) as srv:  # doctest: +SKIP
  ...     print(srv.url)
  http://127.0.0.1:40123/model.safetensors
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 64 * 1024  # bytes a paced write sends at once
FAULTS = ("drop", "404", "stall")


class Link:
    """One link shared by every connection: each chunk waits for its slot.

    Args:
      bandwidth: MB/s (10**6 bytes a second); None or 0 for no limit.
    """

    def __init__(self, bandwidth: float | None):
        self.bytes_per_s = None if not bandwidth else bandwidth * 1e6
        self._lock = threading.Lock()
        self._free_at = 0.0  # perf_counter time at which the link is next idle

    def send(self, nbytes: int) -> None:
        """Blocks until ``nbytes`` may go out (at once with no bandwidth limit)."""
        if self.bytes_per_s is None:
            return
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            done_at = self._free_at
        delay = done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def tensor_ranges(path: str | Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range ``(start, end)`` in a safetensors file, end exclusive,
    counted from the file's first byte (a local read, no HTTP)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {
        name: (8 + n + entry["data_offsets"][0], 8 + n + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    }


class WeightServer:
    """Serves ``path`` over HTTP in a background thread; a context manager.

    Args:
      path: the safetensors file.
      bandwidth: MB/s shared by all connections; None or 0 for no limit.
      latency: milliseconds each request waits before its response starts.
      faults: tensor name -> ``"drop"``, ``"404"`` or ``"stall"`` (see the module).
      truncate_to: serve only the first ``truncate_to`` bytes, as a file cut short.

    Attributes:
      url: ``http://127.0.0.1:PORT/<file name>``, set by ``start()``.
      requests: number of requests served so far.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        bandwidth: float | None = None,
        latency: float = 0.0,
        faults: dict[str, str] | None = None,
        truncate_to: int | None = None,
    ):
        self.path = Path(path)
        self.link = Link(bandwidth)
        self.latency_s = latency / 1000
        self.size = self.path.stat().st_size if truncate_to is None else truncate_to
        self.faults: dict[int, str] = {}  # tensor's first byte -> fault
        ranges = tensor_ranges(self.path) if faults else {}
        for name, kind in (faults or {}).items():
            if kind not in FAULTS:
                raise ValueError(f"WeightServer: fault {kind!r} for {name}; use one of {FAULTS}")
            if name not in ranges:
                raise KeyError(f"WeightServer: no tensor {name!r} in {self.path}")
            self.faults[ranges[name][0]] = kind
        self.requests = 0
        self._count_lock = threading.Lock()
        self.closing = threading.Event()  # releases stalled responses at close
        self.url = ""
        self._httpd: ThreadingHTTPServer | None = None

    def start(self) -> WeightServer:
        """Binds an ephemeral port on 127.0.0.1 and serves in a daemon thread."""
        handler = type("Handler", (_Handler,), {"server_state": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.block_on_close = False  # a stalled response must not delay close()
        port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{port}/{self.path.name}"
        threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},  # s between checks for shutdown: close() is quick
            name="weight-server",
            daemon=True,
        ).start()
        return self

    def close(self) -> None:
        """Stops serving; stalled responses end."""
        self.closing.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> WeightServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    server_state: WeightServer
    protocol_version = "HTTP/1.1"  # keep-alive, as a real server

    def do_GET(self) -> None:
        state = self.server_state
        with state._count_lock:
            state.requests += 1
        time.sleep(state.latency_s)
        if self.path != "/" + state.path.name:
            self.send_error(HTTPStatus.NOT_FOUND, explain=f"no file {self.path}")
            return
        start, end, status = 0, state.size, HTTPStatus.OK
        match = _RANGE.match(self.headers.get("Range", ""))
        if match:
            start = int(match[1])
            end = min(int(match[2]) + 1, state.size) if match[2] else state.size
            if start >= state.size or start >= end:
                self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                self.send_header("Content-Range", f"bytes */{state.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = HTTPStatus.PARTIAL_CONTENT
        fault = state.faults.get(start) if match else None
        if fault == "404":
            self.send_error(HTTPStatus.NOT_FOUND, explain=f"bytes {start}-{end - 1} are gone")
            return
        self.send_response(status)
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{state.size}")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        self._send_body(start, end, fault)

    def _send_body(self, start: int, end: int, fault: str | None) -> None:
        state = self.server_state
        stop = start + (end - start) // 2 if fault else end
        with open(state.path, "rb") as f:
            f.seek(start)
            pos = start
            try:
                while pos < stop:
                    chunk = f.read(min(CHUNK, stop - pos))
                    state.link.send(len(chunk))
                    self.wfile.write(chunk)
                    pos += len(chunk)
            except ConnectionError:  # the client went away (its timeout, say)
                self.close_connection = True
                return
        if fault == "stall":
            self.wfile.flush()
            state.closing.wait()
        if fault:
            self.close_connection = True  # the client sees the body end early

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the example prints its own timeline
