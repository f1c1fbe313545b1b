"""``load_safetensors``: safetensors weights read by the Rust core, without
the GIL, straight into ``HostBuffer``s that JAX takes without a copy."""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import sys
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from . import _core, _jax_hooks
from ._convert import convert_one
from ._errors import shallow_copy
from ._map import _one_source_a_leaf
from ._pool import jax_work
from ._shards import Layout, index_text, layout, shard_host
from ._source import Call
from ._spec import LeafSpecs, declare_tree
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


def _local_readers() -> int:
    """How many reads of local files run at once: one core fewer than this
    process may use (at least one). A read from the page cache is CPU work
    (the kernel's copy, page faults), and with a reader on every core the
    compile that overlaps the load lost its core: on 2 cores, 6 readers
    stretched the encoder's compile from 0.95 to 1.2-1.4 s. Reads over HTTP
    wait on the network and are not limited here."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


_MAX_INDEX = 64 << 20
_SingleDevice = jax.sharding.SingleDeviceSharding


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
        for i, entry in enumerate(self.entries):
            self.index[entry.name] = i


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
        self.local_jobs = 0  # local-file jobs running (at most _local_readers())
        self.local_limit = _local_readers()
        self.done_bytes = 0
        self.total_bytes = 0
        # Reports go out one at a time and only forward: two reads that end
        # together on two threads must not report 80 and then 40 bytes.
        self.report_lock = threading.Lock()
        self.reported = -1  # bytes_done last reported; -1: none yet

    def fail(self, i: int, exc: BaseException) -> None:
        self.futures[i].set_exception(exc)

    def plan(self, where: dict[str, tuple[_Header, int]], sources: str) -> None:
        """Checks every leaf against its file's header (a mismatch fails that
        leaf alone) and queues the reads in file order: one job a tensor
        (all its local shards) from a file, neighbouring small tensors
        together from a URL."""
        specs = self.specs
        jobs: dict[int, tuple[_Header, list[tuple[int, int, _Read]]]] = {}  # by header
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
            entry = header.entries[t]
            st_dtype, np_name, shape = entry.dtype, entry.numpy_dtype, entry.shape
            start, end = entry.start, entry.end
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
            read = _leaf_read(specs, i, t, np_name, end - start)
            if read.layout is not None and not read.layout.indices:
                # No device of this process holds any of it: the global array
                # (this process's part of it is empty) at once.
                self.place_nothing(i, read)
                continue
            jobs.setdefault(id(header), (header, []))[1].append((t, i, read))
        queue = []
        for header, leaves in jobs.values():
            leaves.sort(key=lambda x: x[:2])
            entries = header.entries
            small, limit = (_SMALL, _GROUP) if header.file.remote else (_FILE_SMALL, _FILE_GROUP)
            if self.budget is not None:
                limit = min(limit, self.budget)
            group: list[tuple[int, int, _Read]] = []
            for t, i, read in leaves:
                start, end = entries[t].start, entries[t].end
                joins = (
                    group
                    and read.nbytes <= small
                    and group[0][2].nbytes <= small
                    and start - entries[group[-1][0]].end <= _GAP
                    and end - entries[group[0][0]].start <= limit
                )
                if group and not joins:
                    queue.append(_job(header, group))
                    group = []
                group.append((t, i, read))
            if group:
                queue.append(_job(header, group))
        with self.lock:
            self.queue.extend(queue)
            self.total_bytes += sum(job.nbytes for job in queue)

    def place_nothing(self, i: int, read: _Read) -> None:
        specs = self.specs
        try:
            with jax_work:
                array = _jax_hooks.put_shards(
                    [], [], specs.avals[i], specs.shardings[i], specs.committed[i], True
                )
        except Exception as exc:
            self.fail(i, exc)
            return
        self.futures[i].set_result([array])

    def pump(self) -> None:
        """Starts the queued jobs that fit in the byte budget (always at
        least one when nothing is in flight, so a tensor larger than the
        budget still loads, alone)."""
        start = []
        with self.lock:
            while self.next_job < len(self.queue):
                job = self.queue[self.next_job]
                nbytes = job.nbytes
                if (
                    self.budget is not None
                    and self.in_flight > 0
                    and self.in_flight + nbytes > self.budget
                ):
                    break
                local = not job.file.remote
                if local and self.local_jobs >= self.local_limit:
                    break
                self.queue[self.next_job] = None  # type: ignore[call-overload]
                self.next_job += 1
                self.in_flight += nbytes
                self.local_jobs += local
                start.append((self, job))
        if start:
            _core.submit_many(_read_job, start)

    def finished(self, nbytes: int, local: bool) -> None:
        """Counts a job's bytes as handed to JAX and reports progress; the
        caller then calls :meth:`pump`."""
        with self.lock:
            self.in_flight -= nbytes
            self.local_jobs -= local
            self.done_bytes += nbytes
            done, total = self.done_bytes, self.total_bytes
        self.report(done, total)

    def started(self) -> None:
        """A read job starts: the first reports ``(0, total)``, so that a
        bar shows before the first read ends (over HTTP, seconds later)."""
        if self.reported < 0:
            self.report(0, self.total_bytes)

    def report(self, done: int, total: int) -> None:
        if self.progress is None:
            return
        with self.report_lock:
            if done <= self.reported:
                return
            self.reported = done
            try:
                self.progress(done, total)
            except Exception:  # the user's callback: logged, and the load goes on
                _LOG.exception("%s: the progress callback raised", self.specs.name)


class _Read(NamedTuple):
    """What one leaf reads: tensor ``t`` of its file, as ``np_name``; whole
    (``layout`` None: one buffer, handed to JAX as the leaf) or the distinct
    local shards of ``layout`` (``bounds[k]`` the (start, stop) per axis of
    ``layout.indices[k]``, None when that index is the whole tensor);
    ``nbytes`` the bytes it allocates and reads."""

    leaf: int
    t: int
    np_name: str
    layout: Layout | None
    bounds: list[list[tuple[int, int]] | None] | None
    nbytes: int


def _leaf_read(specs: LeafSpecs, i: int, t: int, np_name: str, nbytes: int) -> _Read:
    sharding = specs.shardings[i]
    if type(sharding) is _SingleDevice:
        return _Read(i, t, np_name, None, None, nbytes)
    shape = specs.avals[i].shape
    lay = layout(sharding, shape)
    bounds: list[list[tuple[int, int]] | None] = []
    itemsize = nbytes // max(1, math.prod(shape))
    total = 0
    for index, block in zip(lay.indices, lay.shapes, strict=True):
        pairs = [s.indices(d)[:2] for s, d in zip(index, shape, strict=True)]
        whole = all(a == 0 and b == d for (a, b), d in zip(pairs, shape, strict=True))
        bounds.append(None if whole else pairs)
        total += math.prod(block) * itemsize
    return _Read(i, t, np_name, lay, bounds, total)


class _Job(NamedTuple):
    """A read job: one file, its leaves' reads (in file order), their bytes."""

    file: _core.SafetensorsFile
    reads: list[_Read]
    nbytes: int


def _job(header: _Header, group: list[tuple[int, int, _Read]]) -> _Job:
    reads = [read for _, _, read in group]
    return _Job(header.file, reads, sum(r.nbytes for r in reads))


def _dtype_fits(found: np.dtype, declared: np.dtype) -> bool:
    """Whether a tensor of dtype ``found`` loads into a leaf of ``declared``:
    the same, or the 32-bit type JAX makes of a 64-bit one with x64 off."""
    if found == declared:
        return True
    return jax.dtypes.canonicalize_dtype(found) == declared


def _read_job(load: _Load, job: _Job) -> None:
    """A pool task: reads one job's tensors and shards (GIL released in the
    core), hands each leaf to JAX, reports progress, then makes the leaves
    ready (so a leaf is never ready before the progress that counts it), then
    starts more reads. A leaf fails alone, with the error its own read gave."""
    file = job.file
    specs, futures = load.specs, load.futures
    done: list[tuple[int, Any]] = []
    load.started()
    try:
        reads = job.reads
        if not file.remote:  # a cancelled leaf is not read (over HTTP: one request anyway)
            reads = [r for r in reads if not futures[r.leaf].done()]
        wants: list[tuple[int, np.dtype, Any]] = []
        for r in reads:
            dtype = _buffer_dtype(r.np_name)
            if r.bounds is None:
                wants.append((r.t, dtype, None))
            else:
                wants.extend((r.t, dtype, b) for b in r.bounds)
        results = file.read(wants) if wants else []
        del wants
        at = 0
        for r in reads:
            count = 1 if r.bounds is None else len(r.bounds)
            mine = results[at : at + count]
            at += count
            failed = next((x for x in mine if isinstance(x, BaseException)), None)
            if failed is not None:
                done.append((r.leaf, failed))
                continue
            with jax_work:
                done.append((r.leaf, _to_jax(specs, r, mine)))
            del mine
        del results
    except Exception as exc:
        for r in job.reads:
            done.append((r.leaf, shallow_copy(exc)))
    finally:
        load.finished(job.nbytes, not file.remote)
        for i, entry in done:
            if futures[i].done():
                continue
            if isinstance(entry, BaseException):
                futures[i].set_exception(entry)
            else:
                futures[i].set_result([entry])
        del done
        load.pump()


def _to_jax(specs: LeafSpecs, r: _Read, buffers: list[Any]) -> Any:
    """A leaf's ``Source`` entry (its ``jax.Array``, or the exception its
    conversion failed with) from its read buffers."""
    i = r.leaf
    if r.np_name in _FLOAT8:  # no DLPack code: one copy, viewed as float8
        buffers = [np.asarray(b).view(_np_dtype(r.np_name)) for b in buffers]
    if r.layout is None:
        return convert_one(specs, i, buffers[0])
    lay = r.layout
    dtype = specs.avals[i].dtype
    try:
        hosts = [
            shard_host(b, shape, dtype, f"{specs.where(i)} shard {index_text(index)}")
            for b, shape, index in zip(buffers, lay.shapes, lay.indices, strict=True)
        ]
        return _jax_hooks.put_shards(
            [hosts[k] for k in lay.slots],
            lay.devices,
            specs.avals[i],
            specs.shardings[i],
            specs.committed[i],
            True,
        )
    except Exception as exc:
        return exc


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
    try:
        return _Header(_core.SafetensorsFile(source, timeout=timeout, retries=retries))
    except FileNotFoundError as exc:
        if not _is_url(source):
            # As open() raises it: errno and filename set, for code that reads them.
            raise FileNotFoundError(errno.ENOENT, f"{_NAME}: no such file", source) from None
        raise FileNotFoundError(f"{_NAME}: {exc}") from None
    except OSError as exc:  # TimeoutError is an OSError
        # The core's message names the file and bytes; this names the call.
        if exc.errno is None:
            raise type(exc)(f"{_NAME}: {exc}") from None
        # The OS's number stays the exception's errno (ConnectionRefusedError...).
        raise type(exc)(exc.errno, f"{_NAME}: {exc.strerror}") from None
    except ValueError as exc:
        raise type(exc)(f"{_NAME}: {exc}") from None


def _is_index(source: str) -> bool:
    return (
        urllib.parse.urlsplit(source).path.endswith(".json")
        if _is_url(source)
        else (source.endswith(".json"))
    )


def _open_all(
    source: str, timeout: float | None, retries: int, wanted: set[str] | None = None
) -> dict[str, tuple[_Header, int]]:
    """Every tensor name -> (its file's header, its index there), for one
    file or an index of several (their headers read concurrently, on the pool).
    With ``wanted`` (the names ``like`` asks for), an index's files that hold
    none of them are not opened: a missing or unread file of tensors nobody
    asked for fails nothing."""
    if not _is_index(source):
        header = _open_header(source, timeout, retries)
        return {name: (header, t) for name, t in header.index.items()}
    full_map = weight_map = _read_index(source, timeout, retries)
    if wanted is not None:
        weight_map = {name: file for name, file in weight_map.items() if name in wanted}
    files = list(dict.fromkeys(weight_map.values()))
    opening = [_core.submit(_open_header, f, timeout, retries) for f in files]
    headers = {}
    for file, fut in zip(files, opening, strict=True):
        try:
            headers[file] = fut.result()
        except FileNotFoundError as exc:
            held = [name for name, f in full_map.items() if f == file]
            shown = ", ".join(repr(name) for name in held[:5])
            more = ", ..." if len(held) > 5 else ""
            base = file.rsplit("/", 1)[-1] if _is_url(file) else os.path.basename(file)
            if exc.errno is None:  # a URL: the core's message says why (HTTP 404)
                why = str(exc).removeprefix(f"{_NAME}: ")
            else:
                why = "no such file"  # its path is the exception's filename
            message = (
                f"{_NAME}: {source}: names {base}, which does not exist ({why}); it was to "
                f"hold {len(held)} tensor{'s' if len(held) != 1 else ''}: {shown}{more}"
            )
            if exc.errno is None:
                raise FileNotFoundError(message) from None
            # As open() raises it: errno and filename (the missing file) set.
            raise FileNotFoundError(exc.errno, message, exc.filename) from None
    where = {}
    for name, file in weight_map.items():
        header = headers[file]
        t = header.index.get(name)
        if t is None:
            raise KeyError(f"{source}: the index puts tensor {name!r} in {file}, which lacks it")
        where[name] = (header, t)
    return where


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
    share one pool task, up to 1 MiB; at most as many tasks at once as the
    process has usable cores less one, at least one, so a compile beside the
    load keeps a core); for a URL, HTTP range requests on a small pool of
    keep-alive connections (at most 8 requests per server), neighbouring tensors under 1 MiB in
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
      sharding: None (each leaf lands uncommitted on the default device,
        as ``async_wrap``'s), or where to put the tensors, as
        ``jax.device_put`` takes it: one placement for every tensor, or a
        dict of them shaped like the result (by tensor name, or nested as
        ``like``); a placement is a ``NamedSharding`` (sharded, partially
        replicated or replicated), a ``SingleDeviceSharding``, a
        ``jax.Device``, or a ``PartitionSpec`` under ``jax.set_mesh``. A
        ``like`` leaf's own ``.sharding`` is used where this is None. Each
        tensor is read once per distinct index among this process's devices
        (a replica is read once and placed on every local device holding
        it); under ``jax.distributed`` each process reads only its shards
        and the leaf is the global array. A shard split on axis 0 is one
        byte range; split on a later axis it is one run of bytes a row:
        from a file exactly those runs are read (``preadv`` into the shard's
        memory), over HTTP runs at most 64 KiB apart share one request.
      max_bytes_in_flight: at most this many bytes (int, > 0) are allocated
        for tensors (or shards) and not yet handed to JAX; a read larger than
        this runs alone. None: no bound.
      timeout: seconds (a positive number; None: none) that each HTTP request
        may take in all, from connecting to its last byte, its retries
        included: a server that trickles bytes fails within it. Files take
        no timeout.
      retries: how often (an int from 0 to 2**32 - 1) an HTTP request that
        failed to connect, lost its connection (before or during the body:
        the retry asks only for the bytes not yet received), or got a 5xx is
        retried, after 0.1 s, then twice as long each time (at most 5 s).
      progress: False; True for one ``tqdm`` progress bar on stderr (bytes,
        MB/s, ETA; nothing when ``tqdm`` is not installed); or a callable,
        called on a pool thread as ``progress(bytes_done, bytes_total)``: once
        with 0 as the first read starts, then after each read, one call at a
        time and ``bytes_done`` always growing. ``bytes_total`` counts the
        tensor bytes this process reads (its shards), not the file's size.

    Returns:
      A dict of ``AsyncArray`` by tensor name in file order (``like=None``), or
      a tree shaped like ``like``, each leaf committed to its sharding when
      one is given. Shapes are the header's (global shapes); dtypes are the
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
      OSError: a read failed: 5xx, connection errors or a body cut short
        beyond ``retries``, a wrong ``Content-Range`` or ``Content-Length``, a
        server that ignores Range, a refused certificate. Each leaf of that
        read fails with its own error, naming the URL or path, its own tensor
        (and shard) and its own byte range, never a neighbour's. Where the OS
        gave an error number it is the exception's ``errno``, and the type is
        Python's subclass for it, as ``open()`` and ``socket`` raise them
        (``ConnectionRefusedError``, ``ConnectionResetError``,
        ``IsADirectoryError``, ``PermissionError``).
      TimeoutError: a request ran past ``timeout``.
      KeyError: an index names a tensor its file lacks.
      FileNotFoundError: an index names a file that does not exist (the
        message names the index, the file and the tensors it was to hold; for
        a local file ``errno`` is ``ENOENT`` and ``filename`` its path).
      TypeError, ValueError: bad arguments, at the call, naming
        ``load_safetensors``, the argument, what it must be and what came; a
        sharding that does not divide a tensor's shape (``jax.device_put``'s
        own error, naming the leaf).

    Note:
      Zero-copy: each tensor's (or shard's) memory becomes its
      ``jax.Array``'s on CPU devices (one buffer for every device holding a
      replica). Float8 tensors are copied once (DLPack has no code JAX
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
    max_bytes_in_flight = _positive_int_or_none(max_bytes_in_flight, "max_bytes_in_flight")
    timeout = _request_timeout(timeout)
    retries = _retries(retries)
    callback = _progress_callback(progress)
    name = f"{_NAME}({source!r})"
    if like is None:
        # On the pool, waited for here: Ctrl-C interrupts the wait.
        where = _core.submit(_open_all, source, timeout, retries).result()
        like = {
            tensor: jax.ShapeDtypeStruct(
                header.entries[t].shape,
                jax.dtypes.canonicalize_dtype(_np_dtype(header.entries[t].numpy_dtype)),
            )
            for tensor, (header, t) in where.items()
        }
    else:
        where = None
    with paused_gc():
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        paths = [p for p, _ in flat]
        specs = declare_tree(LeafSpecs(name, like, treedef, paths), [s for _, s in flat], sharding)
        names = [_tensor_name(p) for p in paths]
        futures = [_core.Future() for _ in paths]
        # One call: an exception retrieved from any leaf counts for all (a
        # header that fails fails every leaf; one report, not one a leaf).
        leaves = _one_source_a_leaf(specs, futures, Call())
        load = _Load(specs, names, futures, max_bytes_in_flight, callback)
        if where is not None:
            load.plan(where, source)
            load.pump()
        else:
            opener = _core.submit(_open_and_plan, load, source, timeout, retries)
            opener.add_done_callback(lambda f: _fail_all_if_failed(f, futures))
        return specs.treedef.unflatten(leaves)


def _positive_int_or_none(value: Any, arg: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{_NAME}: {arg} must be a positive int (bytes) or None, got "
            f"{type(value).__name__} {value!r:.40}"
        )
    if value <= 0:
        raise ValueError(f"{_NAME}: {arg} must be a positive int (bytes) or None, got {value}")
    return int(value)


def _request_timeout(timeout: Any) -> float | None:
    """``timeout`` as the core takes it: None, or positive seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{_NAME}: timeout must be a positive number of seconds or None, got "
            f"{type(timeout).__name__} {timeout!r:.40}"
        )
    t = float(timeout)
    if not t > 0:  # NaN too
        raise ValueError(
            f"{_NAME}: timeout must be a positive number of seconds or None, got {timeout!r}"
        )
    return t


_MAX_RETRIES = 2**32 - 1  # the core counts them in a u32


def _retries(retries: Any) -> int:
    if isinstance(retries, bool) or not isinstance(retries, (int, np.integer)):
        raise TypeError(
            f"{_NAME}: retries must be an int from 0 to {_MAX_RETRIES}, got "
            f"{type(retries).__name__} {retries!r:.40}"
        )
    if not 0 <= retries <= _MAX_RETRIES:
        raise ValueError(f"{_NAME}: retries must be an int from 0 to {_MAX_RETRIES}, got {retries}")
    return int(retries)


def _open_and_plan(load: _Load, source: str, timeout: float | None, retries: int) -> None:
    where = _open_all(source, timeout, retries, set(load.names))
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
