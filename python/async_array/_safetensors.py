"""``load_safetensors``: safetensors weights read by the Rust core, without
the GIL, straight into ``HostBuffer``s that JAX takes without a copy."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from . import _core
from ._convert import convert_one
from ._errors import shallow_copy
from ._map import _one_source_a_leaf
from ._pool import jax_work
from ._spec import LeafSpecs, declare_tree, timeout_seconds
from ._tree import paused_gc

_LOG = logging.getLogger("async_array")
_NAME = "load_safetensors"
_FLOAT8 = {"float8_e4m3fn", "float8_e5m2"}
# Over HTTP, neighbouring tensors of at most _SMALL bytes each share one range
# request while the request stays under _GROUP bytes and the bytes skipped
# between two of them under _GAP: a request costs a round trip.
_SMALL = 1 << 20
_GROUP = 4 << 20
_GAP = 64 << 10
# From a file, tensors of at most _FILE_SMALL bytes share one pool task (a
# pread each) up to _FILE_GROUP bytes: the per-task cost, not the reads, is
# what 10,000 small tensors would pay.
_FILE_SMALL = 64 << 10
_FILE_GROUP = 1 << 20
_MAX_INDEX = 64 << 20


@functools.cache
def _np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a core dtype name (``bfloat16`` and the float8
    kinds from ml_dtypes, as in JAX)."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _source_text(source: Any) -> str:
    """``source`` as the core opens it: a file path, or an http(s) URL
    (a ``file://`` URL becomes its path)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, bytes):
        source = os.fsdecode(source)
    if not isinstance(source, str):
        raise TypeError(
            f"{_NAME}: source must be a path or a file:// or http(s):// URL, "
            f"got {type(source).__name__}"
        )
    if "://" not in source:
        return source
    url = urllib.parse.urlsplit(source)
    if url.scheme == "file":
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"{_NAME}: {source}: a file:// URL must name a local file")
        return urllib.parse.unquote(url.path)
    if url.scheme in ("http", "https"):
        return source
    raise ValueError(f"{_NAME}: {source}: unsupported URL scheme {url.scheme!r}")


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def _read_index(source: str, timeout: float | None, retries: int) -> dict[str, str]:
    """The weight map of a ``model.safetensors.index.json``: tensor name ->
    the path or URL of the file that holds it (resolved against the index)."""
    if _is_url(source):
        data, size = _core.read_url_prefix(source, _MAX_INDEX, timeout=timeout, retries=retries)
        if size > len(data):
            raise ValueError(f"{source}: an index of {size} bytes is over the {_MAX_INDEX} limit")
        base = source
        join = urllib.parse.urljoin
    else:
        with open(source, "rb") as f:
            data = f.read(_MAX_INDEX + 1)
        if len(data) > _MAX_INDEX:
            raise ValueError(f"{source}: an index over {_MAX_INDEX} bytes")
        base = os.path.dirname(source)
        join = os.path.join
    try:
        index = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{source}: the index is not valid JSON: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f'{source}: an index needs a "weight_map" object of tensor name -> file name'
        )
    files: dict[str, str] = {}
    out = {}
    for name, file in weight_map.items():
        if "/" in file or "\\" in file or file in ("", ".", ".."):
            raise ValueError(f"{source}: weight_map[{name!r}] = {file!r} is not a file name")
        out[name] = files.setdefault(file, join(base, file))
    return out


def _tensor_name(path: tuple[Any, ...]) -> str:
    """A ``like`` leaf's tensor name: its key path's keys joined with "."
    (``{"a": {"b": x}}`` names ``a.b``, as flax's ``unflatten_dict(sep=".")``)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


class _Header:
    """The tensors of one opened file, by name."""

    def __init__(self, file: _core.SafetensorsFile) -> None:
        self.file = file
        self.index: dict[str, int] = {}
        self.entries = file.tensors
        for i, (name, *_rest) in enumerate(self.entries):
            self.index[name] = i


class _Load:
    """One ``load_safetensors`` call: which tensor each leaf reads, the jobs
    still to start, the bytes in flight, progress."""

    def __init__(
        self,
        specs: LeafSpecs,
        names: list[str],
        futures: list[_core.Future],
        max_bytes_in_flight: int | None,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.specs = specs
        self.names = names
        self.futures = futures
        self.budget = max_bytes_in_flight
        self.progress = progress
        self.lock = threading.Lock()
        self.queue: list[_Job] = []
        self.next_job = 0
        self.in_flight = 0
        self.done_bytes = 0
        self.total_bytes = 0

    def fail(self, i: int, exc: BaseException) -> None:
        self.futures[i].set_exception(exc)

    def plan(self, where: dict[str, tuple[_Header, int]], sources: str) -> None:
        """Checks every leaf against its file's header (a mismatch fails that
        leaf alone) and queues the reads in file order: one job a tensor
        from a file, neighbouring small tensors together from a URL."""
        specs = self.specs
        jobs: dict[int, tuple[_Header, list[tuple[int, int]]]] = {}  # by header
        for i, name in enumerate(self.names):
            found_at = where.get(name)
            if found_at is None:
                self.fail(
                    i,
                    KeyError(
                        f"{specs.where(i)}: tensor {name!r} is not in {sources} "
                        f"(it has {len(where)} tensors)"
                    ),
                )
                continue
            header, t = found_at
            _, st_dtype, np_name, shape, start, end = header.entries[t]
            aval = specs.avals[i]
            found = _np_dtype(np_name)
            if tuple(shape) != aval.shape or not _dtype_fits(found, aval.dtype):
                self.fail(
                    i,
                    ValueError(
                        f"{specs.where(i)}: tensor {name!r} in {header.file.source} (bytes "
                        f"[{start}, {end})): expected shape {aval.shape} and dtype "
                        f"{aval.dtype}, found shape {tuple(shape)} and dtype {found} "
                        f"({st_dtype})"
                    ),
                )
                continue
            jobs.setdefault(id(header), (header, []))[1].append((t, i))
        queue = []
        for header, pairs in jobs.values():
            pairs.sort()
            entries = header.entries
            small, limit = (_SMALL, _GROUP) if header.file.remote else (_FILE_SMALL, _FILE_GROUP)
            if self.budget is not None:
                limit = min(limit, self.budget)
            group: list[tuple[int, int]] = []
            for t, i in pairs:
                start, end = entries[t][4], entries[t][5]
                joins = (
                    group
                    and end - start <= small
                    and entries[group[0][0]][5] - entries[group[0][0]][4] <= small
                    and start - entries[group[-1][0]][5] <= _GAP
                    and end - entries[group[0][0]][4] <= limit
                )
                if group and not joins:
                    queue.append(_job(header, group))
                    group = []
                group.append((t, i))
            if group:
                queue.append(_job(header, group))
        with self.lock:
            self.queue.extend(queue)
            self.total_bytes += sum(job[3] for job in queue)

    def pump(self) -> None:
        """Starts the queued jobs that fit in the byte budget (always at
        least one when nothing is in flight, so a tensor larger than the
        budget still loads, alone)."""
        start = []
        with self.lock:
            while self.next_job < len(self.queue):
                job = self.queue[self.next_job]
                nbytes = job[3]
                if (
                    self.budget is not None
                    and self.in_flight > 0
                    and self.in_flight + nbytes > self.budget
                ):
                    break
                self.queue[self.next_job] = None  # type: ignore[call-overload]
                self.next_job += 1
                self.in_flight += nbytes
                start.append((self, job))
        if start:
            _core.submit_many(_read_job, start)

    def finished(self, nbytes: int) -> None:
        """Counts a job's bytes as handed to JAX and reports progress; the
        caller then calls :meth:`pump`."""
        with self.lock:
            self.in_flight -= nbytes
            self.done_bytes += nbytes
            done, total = self.done_bytes, self.total_bytes
        try:
            if self.progress is not None:
                self.progress(done, total)
        except Exception:  # the user's callback: logged, and the load goes on
            _LOG.exception("%s: the progress callback raised", self.specs.name)


# A read job: the file, its tensor indices, their leaves, their bytes, their
# numpy dtype names (taken from the header once: the core's tensor list is
# built anew at each access).
_Job = tuple[_core.SafetensorsFile, list[int], list[int], int, list[str]]


def _job(header: _Header, group: list[tuple[int, int]]) -> _Job:
    entries = header.entries
    nbytes = sum(entries[t][5] - entries[t][4] for t, _ in group)
    names = [entries[t][2] for t, _ in group]
    return (header.file, [t for t, _ in group], [i for _, i in group], nbytes, names)


def _dtype_fits(found: np.dtype, declared: np.dtype) -> bool:
    """Whether a tensor of dtype ``found`` loads into a leaf of ``declared``:
    the same, or the 32-bit type JAX makes of a 64-bit one with x64 off."""
    if found == declared:
        return True
    return jax.dtypes.canonicalize_dtype(found) == declared


def _read_job(load: _Load, job: _Job) -> None:
    """A pool task: reads one job's tensors (GIL released in the core), hands
    each to JAX, reports progress, then makes the leaves ready (so a leaf is
    never ready before the progress that counts it), then starts more reads."""
    file, tensors, leaves, nbytes, np_names = job
    specs, futures = load.specs, load.futures
    ready: list[tuple[int, Any]] = []
    failed: BaseException | None = None
    try:
        wanted = [k for k, i in enumerate(leaves) if not futures[i].done()]  # not cancelled
        if wanted and file.remote:
            wanted = list(range(len(leaves)))  # one request for the group anyway
        if wanted:
            dtypes = [_buffer_dtype(np_names[k]) for k in wanted]
            buffers = file.read([tensors[k] for k in wanted], dtypes)
            for k, buf in zip(wanted, buffers, strict=True):
                value: Any = buf
                np_name = np_names[k]
                if np_name in _FLOAT8:  # no DLPack code: one copy, viewed as float8
                    value = np.asarray(buf).view(_np_dtype(np_name))
                with jax_work:
                    ready.append((leaves[k], convert_one(specs, leaves[k], value)))
                del value, buf
            del buffers
    except Exception as exc:
        failed = exc
    finally:
        load.finished(nbytes)
        for i, entry in ready:
            futures[i].set_result([entry])
        del ready
        if failed is not None:
            for i in leaves:
                if not futures[i].done():
                    futures[i].set_exception(shallow_copy(failed))
        load.pump()


@functools.cache
def _buffer_dtype(np_name: str) -> np.dtype:
    return np.dtype(np.uint8) if np_name in _FLOAT8 else _np_dtype(np_name)


class _Bar:
    """``progress=True``: one tqdm bar on stderr for the whole load (bytes,
    MB/s, ETA), made at the first report, when the total is known."""

    def __init__(self, tqdm: Any) -> None:
        self.tqdm = tqdm
        self.bar: Any = None
        self.shown = 0
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            if self.bar is None:
                self.bar = self.tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1000,
                    desc=_NAME,
                    file=sys.stderr,
                    leave=True,
                )
            if done > self.shown:
                self.bar.update(done - self.shown)
                self.shown = done
            if done >= total:
                self.bar.close()


def _progress_callback(progress: Any) -> Callable[[int, int], None] | None:
    if progress is False or progress is None:
        return None
    if progress is True:
        try:
            from tqdm import tqdm  # optional: imported only when asked for
        except ImportError:
            return None
        return _Bar(tqdm)
    if callable(progress):
        return progress
    raise TypeError(
        f"{_NAME}: progress must be True, False or a callable (bytes_done, bytes_total), "
        f"got {type(progress).__name__}"
    )


def _open_header(source: str, timeout: float | None, retries: int) -> _Header:
    return _Header(_core.SafetensorsFile(source, timeout=timeout, retries=retries))


def _is_index(source: str) -> bool:
    return (
        urllib.parse.urlsplit(source).path.endswith(".json")
        if _is_url(source)
        else (source.endswith(".json"))
    )


def _open_all(
    source: str, timeout: float | None, retries: int
) -> tuple[dict[str, tuple[_Header, int]], list[_Header]]:
    """Every tensor name -> (its file's header, its index there), for one
    file or an index of several (their headers read concurrently, on the pool)."""
    if not _is_index(source):
        header = _open_header(source, timeout, retries)
        return {name: (header, t) for name, t in header.index.items()}, [header]
    weight_map = _read_index(source, timeout, retries)
    files = list(dict.fromkeys(weight_map.values()))
    opening = [_core.submit(_open_header, f, timeout, retries) for f in files]
    headers = {f: fut.result() for f, fut in zip(files, opening, strict=True)}
    where = {}
    for name, file in weight_map.items():
        header = headers[file]
        t = header.index.get(name)
        if t is None:
            raise KeyError(f"{source}: the index puts tensor {name!r} in {file}, which lacks it")
        where[name] = (header, t)
    return where, list(headers.values())


def load_safetensors(
    source: Any,
    *,
    like: Any = None,
    sharding: Any = None,
    max_bytes_in_flight: int | None = None,
    timeout: float | None = None,
    retries: int = 3,
    progress: Any = False,
) -> dict[str, Any]:
    """Loads the tensors of safetensors files as ``AsyncArray`` leaves.

    The header is read and validated completely by the Rust core (one read of
    at most 64 KiB per file); then each tensor is read on the pool, without the
    GIL, straight into a 64-byte-aligned ``HostBuffer`` that JAX takes with no
    copy (DLPack): ``pread`` for a file (neighbouring tensors under 64 KiB
    share one pool task, up to 1 MiB); for a URL, HTTP range requests on a
    small pool of keep-alive connections, neighbouring tensors under 1 MiB in
    one request (at most 4 MiB, skipping at most 64 KiB between two). A leaf
    is ready as soon as the read that holds its tensor is.

    Args:
      source: a path (``str`` or ``os.PathLike``), a ``file://`` URL or an
        ``http://``/``https://`` URL of a ``.safetensors`` file, or of a
        ``model.safetensors.index.json`` (a name ending in ``.json``) whose
        ``weight_map`` names the files (beside the index) that hold each
        tensor. HTTPS trusts Mozilla's roots, or the PEM certificates of
        ``$SSL_CERT_FILE`` when set. The server must answer Range requests
        (206 Partial Content).
      like: None, or the tensors to load and what they must be: a flat dict
        ``{name: spec}`` or a nested dict whose key paths joined with ``"."``
        are the names (as flax's ``unflatten_dict(sep=".")`` makes them); each
        spec has ``.shape`` and ``.dtype`` (``jax.ShapeDtypeStruct``). The
        leaves are returned at once, before any header is read; a tensor
        missing from the files fails its leaf with ``KeyError``, one whose
        shape or dtype differs with ``ValueError`` naming the tensor, the
        expected and the found shape and dtype. Tensors that ``like`` lacks
        are not read.
      sharding: not supported yet: must be None (leaves land uncommitted on
        the default device, as ``async_wrap``'s).
      max_bytes_in_flight: at most this many bytes (int, > 0) are allocated
        for tensors and not yet handed to JAX; a read larger than this runs
        alone. None: no bound.
      timeout: seconds (None: none) that each HTTP request may take in all,
        from connecting to its last byte, its retries included: a server that
        trickles bytes fails within it. Files take no timeout.
      retries: how often (int >= 0) an HTTP request that failed to connect,
        lost its connection before the response, or got a 5xx is retried,
        after 0.1 s, then twice as long each time (at most 5 s).
      progress: False; True for one ``tqdm`` progress bar on stderr (bytes,
        MB/s, ETA; nothing when ``tqdm`` is not installed); or a callable,
        called on a pool thread as ``progress(bytes_done, bytes_total)`` after
        each read.

    Returns:
      A dict of ``AsyncArray`` by tensor name in file order (``like=None``), or
      a tree shaped like ``like``. Shapes are the header's; dtypes are the
      header's (``BOOL`` bool, ``U8``-``U64``/``I8``-``I64`` uint8-uint64 and
      int8-int64, ``F16`` float16, ``BF16`` bfloat16, ``F32`` float32, ``F64``
      float64, ``F8_E4M3`` float8_e4m3fn, ``F8_E5M2`` float8_e5m2), except
      that with ``jax_enable_x64`` off 64-bit tensors come as their 32-bit
      types (values checked: one that does not fit fails its leaf with
      ``OverflowError``).

    Raises:
      FileNotFoundError: no such file, or HTTP 404 (at the call when ``like``
        is None, else from every leaf).
      ValueError: a malformed header: length beyond the file, not a JSON
        object, a missing or unknown dtype, offsets out of bounds, overlapping,
        or not matching shape x itemsize; the message names the file, the
        tensor and the byte range. Nothing larger than the file is allocated.
      OSError: a read failed: 5xx or connection errors beyond ``retries``, a
        truncated body, a wrong ``Content-Range`` or ``Content-Length``, a
        server that ignores Range, a refused certificate (from the leaves of
        that read, naming the URL, the tensors and the byte range).
      TimeoutError: a request ran past ``timeout``.
      KeyError: an index names a tensor its file lacks.
      TypeError: bad arguments.
      NotImplementedError: ``sharding`` given.

    Note:
      Zero-copy: each tensor's memory becomes its ``jax.Array``'s (on one
      CPU device). Float8 tensors are copied once (DLPack has no code JAX
      takes for them), as are 64-bit tensors narrowed to 32 bits.

    Examples:
      >>> import os, tempfile
      >>> import numpy as np, safetensors.numpy
      >>> import async_array as aa
      >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
      >>> safetensors.numpy.save_file({"w": np.ones((2, 3), np.float32)}, path)
      >>> params = aa.load_safetensors(path)  # returns at once
      >>> params["w"].shape
      (2, 3)
      >>> float(aa.materialize(params)["w"].sum())
      6.0
    """
    source = _source_text(source)
    if sharding is not None:
        raise NotImplementedError(
            f"{_NAME}: sharding= is not supported yet; load with sharding=None and "
            "jax.device_put the leaves"
        )
    if max_bytes_in_flight is not None:
        if isinstance(max_bytes_in_flight, bool) or not isinstance(max_bytes_in_flight, int):
            raise TypeError(
                f"{_NAME}: max_bytes_in_flight must be an int or None, got "
                f"{type(max_bytes_in_flight).__name__}"
            )
        if max_bytes_in_flight <= 0:
            raise ValueError(
                f"{_NAME}: max_bytes_in_flight must be positive, got {max_bytes_in_flight}"
            )
    timeout = timeout_seconds(timeout, _NAME)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise TypeError(f"{_NAME}: retries must be a non-negative int, got {retries!r}")
    callback = _progress_callback(progress)
    name = f"{_NAME}({source!r})"
    if like is None:
        # On the pool, waited for here: Ctrl-C interrupts the wait.
        where, _ = _core.submit(_open_all, source, timeout, retries).result()
        like = {
            tensor: jax.ShapeDtypeStruct(
                tuple(header.entries[t][3]),
                jax.dtypes.canonicalize_dtype(_np_dtype(header.entries[t][2])),
            )
            for tensor, (header, t) in where.items()
        }
    else:
        where = None
    with paused_gc():
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        paths = [p for p, _ in flat]
        specs = declare_tree(LeafSpecs(name, like, treedef, paths), [s for _, s in flat], None)
        names = [_tensor_name(p) for p in paths]
        futures = [_core.Future() for _ in paths]
        leaves = _one_source_a_leaf(specs, futures)
        load = _Load(specs, names, futures, max_bytes_in_flight, callback)
        if where is not None:
            load.plan(where, source)
            load.pump()
        else:
            opener = _core.submit(_open_and_plan, load, source, timeout, retries)
            opener.add_done_callback(lambda f: _fail_all_if_failed(f, futures))
        return specs.treedef.unflatten(leaves)


def _open_and_plan(load: _Load, source: str, timeout: float | None, retries: int) -> None:
    where, _ = _open_all(source, timeout, retries)
    load.plan(where, source)
    load.pump()


def _fail_all_if_failed(opener: _core.Future, futures: list[_core.Future]) -> None:
    """The header could not be read (or the task was cancelled): every leaf
    not yet finished fails with that exception."""
    if opener.cancelled():
        for fut in futures:
            fut.cancel()
        return
    exc = opener.exception(0)
    if exc is not None:
        for fut in futures:
            if not fut.done():
                fut.set_exception(shallow_copy(exc))
