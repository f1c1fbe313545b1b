"""Loads a safetensors file over HTTP into ``AsyncArray`` leaves, one range request a tensor.

``read_header`` makes one range request for the header (8 bytes of little-endian
length, then that many bytes of JSON) and turns it into the ``like`` tree: a
nested dict of ``jax.ShapeDtypeStruct`` (``encoder.layer.0.attention.self.query.weight``
becomes ``like["encoder"]["layer"]["0"]["attention"]["self"]["query"]["weight"]``).
That is all ``jax.jit`` needs to compile. ``load`` then returns at once the same
tree of ``AsyncArray``: ``aa.async_map`` runs one pool task a tensor, each making
one range request and reading the body with ``readinto`` straight into an
``aa.empty`` buffer, which JAX then takes without a copy (DLPack). So no byte
is copied between the socket and the memory the encoder reads.

HTTP: the standard library's ``http.client``, one connection a request. Its
responses support ``readinto`` and a socket timeout, which is all this needs.

Errors: a tensor whose bytes cannot be fetched (404, a connection dropped
mid-body, a file cut short, a stalled server past ``timeout``) fails only its
own leaf with a ``FetchError`` naming the tensor, the URL, the byte range and
the bytes expected and received. It is raised where the weight is used: at
dispatch of a ``jax.jit`` function that takes it, ``aa.materialize``, ``result()``.
"""

from __future__ import annotations

import http.client
import json
import re
import struct
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

import async_array as aa

#: safetensors dtype names -> numpy dtypes (stored little-endian).
DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": jax.numpy.bfloat16,
    "I32": np.int32,
    "I64": np.int64,
}

#: Tensors of all-MiniLM-L6-v2 that are not loaded (``read_header``'s default).
#: ``embeddings.position_ids`` is BERT's int64 buffer ``arange(512)``, not a
#: learned weight: the encoder computes positions with ``jnp.arange``, and in
#: JAX's default 32-bit mode an int64 leaf would be narrowed to int32 with a
#: warning anyway. ``pooler.dense`` is BERT's [CLS] pooler, which mean pooling
#: does not use; a jitted function would still wait for it at dispatch.
SKIP = frozenset({"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"})


class FetchError(OSError):
    """A tensor's bytes could not be fetched; the message says which and why."""


@dataclass(frozen=True)
class Header:
    """What ``read_header`` learned about a remote safetensors file.

    Attributes:
      url: the file's URL.
      like: nested dict of ``jax.ShapeDtypeStruct``, one leaf a loaded tensor.
      ranges: dotted tensor name -> absolute byte range ``(start, end)``, end exclusive.
      skipped: names of tensors in the file that ``like`` leaves out.
      first_byte_s: seconds from the request to the first byte of the response.
    """

    url: str
    like: dict[str, Any]
    ranges: dict[str, tuple[int, int]]
    skipped: tuple[str, ...]
    first_byte_s: float


def read_header(url: str, *, timeout: float = 10.0, skip: frozenset[str] = SKIP) -> Header:
    """Fetches the safetensors header of ``url`` (one range request).

    Args:
      url: ``http://host:port/path`` of a safetensors file.
      timeout: socket timeout in seconds (connect and each read).
      skip: tensor names to leave out of ``like``.

    Returns:
      A ``Header``.

    Raises:
      FetchError: the request failed, or the answer is not a safetensors header.
    """
    # Most headers are well under 64 KiB: one request gets the length and the JSON.
    guess = 64 * 1024
    t0 = time.perf_counter()
    head = bytearray(guess)
    first_byte: list[float] = []
    n = _fetch(
        url,
        0,
        memoryview(head),
        timeout=timeout,
        what="the safetensors header",
        on_response=lambda: first_byte.append(time.perf_counter() - t0),
    )
    if n < 8:
        raise FetchError(f"{url}: the safetensors header needs 8 bytes, the file has {n}")
    (size,) = struct.unpack("<Q", head[:8])
    if 8 + size > n:  # a long header: fetch the rest
        head = head[:n] + bytearray(8 + size - n)
        rest = memoryview(head)[n:]
        if _fetch(url, n, rest, timeout=timeout, what="the safetensors header") < len(rest):
            raise FetchError(f"{url}: the file ends inside its {size}-byte safetensors header")
    try:
        entries = json.loads(head[8 : 8 + size])
    except ValueError as exc:
        raise FetchError(f"{url}: the safetensors header is not JSON: {exc}") from None
    entries.pop("__metadata__", None)

    like: dict[str, Any] = {}
    ranges, skipped = {}, []
    for name, entry in entries.items():
        if name in skip:
            skipped.append(name)
            continue
        if entry["dtype"] not in DTYPES:
            raise FetchError(
                f"{url}: tensor {name} has dtype {entry['dtype']}, not one of {list(DTYPES)}"
            )
        begin, end = entry["data_offsets"]
        ranges[name] = (8 + size + begin, 8 + size + end)
        _nest(like, name, jax.ShapeDtypeStruct(tuple(entry["shape"]), DTYPES[entry["dtype"]]))
    return Header(url, like, ranges, tuple(skipped), first_byte[0])


def load(header: Header, *, timeout: float = 10.0) -> dict[str, Any]:
    """Starts fetching every tensor of ``header.like``; returns at once.

    Args:
      header: from ``read_header``.
      timeout: socket timeout in seconds of each request (connect and each read).

    Returns:
      The tree of ``header.like`` with ``AsyncArray`` leaves; each is ready once
      its tensor has arrived.

    Note:
      Zero-copy: ``readinto`` fills ``aa.empty`` memory from the socket and JAX
      takes that memory as it is.
    """

    def fetch(key_path: tuple[Any, ...], spec: jax.ShapeDtypeStruct) -> aa.HostBuffer:
        name = ".".join(str(k.key) for k in key_path)
        start, end = header.ranges[name]
        buf = aa.empty(spec.shape, spec.dtype)
        # Its flat bytes, to fill in slices. (memoryview(buf) would refuse
        # bfloat16, which has no PEP 3118 code; numpy's view serves every dtype.)
        view = memoryview(np.asarray(buf).reshape(-1).view(np.uint8))
        if len(view) != end - start:
            raise FetchError(
                f"tensor {name}: the header gives {end - start} bytes for shape "
                f"{spec.shape} {np.dtype(spec.dtype).name}, which needs {len(view)}"
            )
        got = _fetch(header.url, start, view, timeout=timeout, what=f"tensor {name}")
        if got < len(view):
            raise FetchError(
                f"tensor {name}: GET {header.url} bytes {start}-{end - 1}: expected "
                f"{len(view)} bytes, the file ends after {got}: it is shorter than its header says"
            )
        del view  # no writable view may outlive the hand-off to JAX (see aa.empty)
        if sys.byteorder == "big":
            np.asarray(buf).byteswap(inplace=True)
        return buf

    return aa.async_map(fetch, header.like)


def _nest(tree: dict[str, Any], dotted: str, leaf: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise FetchError(f"tensor {dotted}: {key} is both a tensor and a prefix of one")
    if last in node:
        raise FetchError(f"tensor {dotted}: the name is also a prefix of another tensor")
    node[last] = leaf


_SLICE = 64 * 1024  # bytes a readinto call asks for
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)$")


def _fetch(
    url: str,
    start: int,
    into: memoryview,
    *,
    timeout: float,
    what: str,
    on_response: Callable[[], None] | None = None,
) -> int:
    """GETs bytes ``[start, start + len(into))`` of ``url`` into ``into`` (a byte view).

    Args:
      url: the file's URL.
      start: first byte, from the file's start.
      into: where the bytes go, read with ``readinto`` (no copy).
      timeout: socket timeout in seconds (connect and each read).
      what: how messages name the bytes, e.g. ``"tensor embeddings.LayerNorm.bias"``.
      on_response: called once the status line and headers have arrived.

    Returns:
      The bytes read: ``len(into)``, or fewer when the file ends first.

    Raises:
      FetchError: the server refused, answered other than 206 for ``start``, or
        the body ended, stalled or broke before it had sent all it promised.
    """
    want = len(into)
    where = f"{what}: GET {url} bytes {start}-{start + want - 1}"
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    got, resp = 0, None
    try:
        conn.request("GET", parts.path, headers={"Range": f"bytes={start}-{start + want - 1}"})
        resp = conn.getresponse()
        if on_response is not None:
            on_response()
        content_range = resp.getheader("Content-Range", "")
        if resp.status != 206:
            detail = f", Content-Range {content_range!r}" if content_range else ""
            raise FetchError(f"{where}: HTTP {resp.status} {resp.reason}{detail}, expected 206")
        match = _CONTENT_RANGE.match(content_range)
        if not match or int(match[1]) != start:
            raise FetchError(f"{where}: Content-Range {content_range!r} does not match")
        promised = int(match[2]) + 1 - start  # fewer than want when the file is shorter
        while got < promised:
            # In slices, so that `got` counts what came before a stall or reset
            # (a buffered readinto keeps reading until its slice is full).
            n = resp.readinto(into[got : min(got + _SLICE, promised)])
            if not n:
                raise FetchError(
                    f"{where}: expected {promised} bytes, got {got}: the connection closed"
                )
            got += n
    except (http.client.HTTPException, OSError) as exc:  # refused, reset, timed out
        if isinstance(exc, FetchError):
            raise
        raise FetchError(
            f"{where}: expected {want} bytes, got {got}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        if resp is not None:
            resp.close()  # owns the socket when the server said Connection: close
        conn.close()
    return got
