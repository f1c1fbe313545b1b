"""HTTP servers the tests start on loopback addresses: ``FaultServer``, a
Range server with fault knobs, and ``Redirector``, which answers every
request with a redirect elsewhere (an origin in front of a CDN)."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RANGE = re.compile(r"bytes=(\d+)-(\d+)$")


class FaultServer:
    """Serves the files of a folder at ``/<name>`` with Range support.

    Knobs (attributes, applied to data requests, those that do not start at
    byte 0, unless ``fault_header`` is set): ``status_first`` a list of
    statuses answered (once each) before the real answer; ``status`` a status
    answered to every request; ``truncate`` bytes of the body sent before the
    connection closes (``truncate_times``: only that many times, None:
    always); ``content_range_shift`` added to the Content-Range start;
    ``content_length_delta`` added to the Content-Length; ``slow`` sends
    one byte at a time, waiting on an event the test never sets for up to
    ``slow`` seconds between bytes; ``ignore_range`` answers 200 with the whole
    file; ``gate`` an event each request waits for (``gated`` is set when one
    does; the file is read after the wait, so a test can replace it meanwhile;
    ``gates_expired`` counts the requests that waited 30 s and went on;
    ``client_gone`` is set, and ``clients_gone`` released, each time a client
    closed its connection mid-body);
    ``etag`` sends a strong ETag of the file's bytes with every answer, and
    ``if_match`` answers 412 to an ``If-Match`` naming another ETag;
    ``retry_after`` a ``Retry-After`` value sent with the ``status_first``
    and ``status`` answers; ``whole_as_200`` answers 200 with the file to a range that
    covers all of it (as HTTP allows); ``auth`` the ``Authorization`` every
    request must carry (else ``auth_status``, 401); ``refuse_auth`` answers 400 to a request
    with an ``Authorization`` (a CDN's signed URL takes none); ``redirect``
    maps a path to the Location of a 302 answered to it. ``hold_until`` holds
    each request until that many are held at once (``most_held`` the most
    held at once; ``hold_expired`` is set, and no request held any more, when
    one waited 30 s for the others): requests that were in flight together.
    ``requests`` lists every ``(path, start, end)`` asked for,
    ``client_ports`` the client ports they came from (one a connection), and
    ``headers`` the headers of every request (a dict, names lowercased).
    """

    def __init__(self, folder, tls_context=None, host="127.0.0.1"):
        self.folder = folder
        self.status_first: list[int] = []
        self.status: int | None = None
        self.truncate: int | None = None
        self.truncate_times: int | None = None
        self.content_range_shift = 0
        self.content_length_delta = 0
        self.slow: float | None = None
        self.ignore_range = False
        self.fault_header = False
        self.etag = False
        self.if_match = False
        self.retry_after: str | None = None
        self.whole_as_200 = False
        self.auth: str | None = None
        self.auth_status = 401
        self.refuse_auth = False
        self.redirect: dict[str, str] = {}
        self.gate: threading.Event | None = None
        self.gated = threading.Event()
        self.gates_expired = 0
        self.client_gone = threading.Event()
        self.clients_gone = threading.Semaphore(0)
        self.hold_until: int | None = None
        self.held = 0
        self.most_held = 0
        self.hold_full = threading.Event()
        self.hold_expired = threading.Event()
        self.requests: list[tuple[str, int, int]] = []
        self.client_ports: set[int] = set()
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()
        # Looked up at each request: a test may replace `handle`.
        self.httpd = serving(host, lambda h: self.handle(h))
        scheme = "http"
        if tls_context is not None:
            self.httpd.socket = tls_context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        host = "localhost" if tls_context is not None else host
        self.base = f"{scheme}://{host}:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name):
        return self.base + name

    def close(self):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, h):
        with self.lock:
            self.client_ports.add(h.client_address[1])
            self.headers.append({k.lower(): v for k, v in h.headers.items()})
        if self.auth is not None and h.headers.get("Authorization") != self.auth:
            return self.send(h, self.auth_status, b"unauthorized")
        if self.refuse_auth and "Authorization" in h.headers:
            return self.send(h, 400, b"no Authorization here")
        if h.path in self.redirect:
            return self.send(h, 302, b"", {"Location": self.redirect[h.path]})
        path = self.folder / h.path.lstrip("/")
        match = RANGE.match(h.headers.get("Range", ""))
        if not path.is_file():
            return self.send(h, 404, b"")
        data = path.read_bytes()
        if match is None or self.ignore_range:
            return self.send(h, 200, data)
        start, last = int(match.group(1)), int(match.group(2))
        last = min(last, len(data) - 1)
        with self.lock:
            self.requests.append((h.path, start, last + 1))
            faulty = start > 0 or self.fault_header
            first = self.status_first.pop(0) if faulty and self.status_first else None
        if faulty and self.gate is not None:
            self.gated.set()
            if not self.gate.wait(30):
                with self.lock:
                    self.gates_expired += 1
            data = path.read_bytes()
            last = min(int(match.group(2)), len(data) - 1)
        if faulty and self.hold_until is not None:
            self.hold(self.hold_until)
        etag = f'"{hashlib.sha256(data).hexdigest()[:16]}"' if self.etag else None
        wanted = h.headers.get("If-Match")
        if self.if_match and wanted is not None and wanted != etag:
            return self.send(h, 412, b"precondition failed")
        if first is not None:
            extra = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
            return self.send(h, first, b"oops", extra)
        if self.whole_as_200 and start == 0 and last == len(data) - 1:
            return self.send(h, 200, data)
        if faulty and self.status is not None:
            extra = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
            return self.send(h, self.status, b"oops", extra)
        body = data[start : last + 1]
        shift = self.content_range_shift if faulty else 0
        h.send_response(206)
        if etag is not None:
            h.send_header("ETag", etag)
        h.send_header("Content-Range", f"bytes {start + shift}-{last + shift}/{len(data)}")
        delta = self.content_length_delta if faulty else 0
        h.send_header("Content-Length", str(len(body) + delta))
        h.end_headers()
        try:
            cut = faulty and self.truncate is not None
            if cut and self.truncate_times is not None:
                with self.lock:
                    cut = self.truncate_times > 0
                    self.truncate_times -= cut
            if cut:
                h.wfile.write(body[: self.truncate])
                h.wfile.flush()
                h.close_connection = True
                return
            if faulty and self.slow is not None:
                for i in range(len(body)):
                    h.wfile.write(body[i : i + 1])
                    h.wfile.flush()
                    if self.closing.wait(self.slow):
                        return
                return
            h.wfile.write(body)
        except OSError:  # the client gave up
            h.close_connection = True
            self.client_gone.set()
            self.clients_gone.release()

    def hold(self, until):
        with self.lock:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            if self.held >= until:
                self.hold_full.set()
        if not self.hold_full.wait(30):
            self.hold_expired.set()
            self.hold_full.set()  # the others go on at once
        with self.lock:
            self.held -= 1

    def send(self, h, status, body, headers=None):
        h.send_response(status)
        for name, value in (headers or {}).items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


def serving(host: str, on_get: Callable[[BaseHTTPRequestHandler], None]) -> ThreadingHTTPServer:
    """An HTTP/1.1 server on ``host`` (a free port; started by the caller)
    whose every GET goes to ``on_get(handler)``, logging nothing."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            on_get(self)

    httpd = ThreadingHTTPServer((host, 0), Handler)
    httpd.daemon_threads = True
    return httpd


class Redirector:
    """An origin in front of a CDN: answers every GET with what
    ``answer(path, headers)`` returns, ``(status, location)`` (headers a
    dict, names lowercased; location None: no Location header, an empty
    body). ``requests`` lists ``(path, headers)`` of every request."""

    def __init__(
        self,
        answer: Callable[[str, dict[str, str]], tuple[int, str | None]],
        host: str = "127.0.0.1",
    ) -> None:
        self.answer = answer
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.lock = threading.Lock()
        # Looked up at each request: a test may replace `handle`.
        self.httpd = serving(host, lambda h: self.handle(h))
        self.base = f"http://{host}:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        headers = {k.lower(): v for k, v in h.headers.items()}
        with self.lock:
            self.requests.append((h.path, headers))
        status, location = self.answer(h.path, headers)
        h.send_response(status)
        if location is not None:
            h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def url(self, name: str) -> str:
        return self.base + name

    def paths(self) -> list[str]:
        with self.lock:
            return [path for path, _ in self.requests]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
