"""``load_safetensors``: safetensors weights read by the Rust core, without
the GIL, straight into ``HostBuffer``s that JAX takes without a copy."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, overload

import jax
import numpy as np

from .. import _core
from .._array import AsyncArray
from .._leaves import fail_all_if_failed, one_source_a_leaf, specs_and_paths
from .._runtime import paused_gc
from .._source import Call
from .._spec import canonical_dtype, numeric_kind, numpy_dtype, timeout_seconds
from ._plan import Load
from ._progress import progress_callback
from ._read import read_job
from ._remote import Remote, remote_options
from ._sources import NAME, Header, open_all, source_text, tensor_name


@overload
def load_safetensors(
    source: str | os.PathLike[str] | bytes,
    *,
    like: None = None,
    dtype: Any = None,
    sharding: Any = None,
    max_bytes_in_flight: int | None = None,
    timeout: float | None = None,
    retries: int = 3,
    progress: bool | Callable[[int, int], object] = False,
    headers: Mapping[str, str] | None = None,
    credentials: Callable[[str], Mapping[str, str]] | None = None,
) -> dict[str, AsyncArray]: ...


@overload
def load_safetensors(
    source: str | os.PathLike[str] | bytes,
    *,
    like: Mapping[str, Any],
    dtype: None = None,
    sharding: Any = None,
    max_bytes_in_flight: int | None = None,
    timeout: float | None = None,
    retries: int = 3,
    progress: bool | Callable[[int, int], object] = False,
    headers: Mapping[str, str] | None = None,
    credentials: Callable[[str], Mapping[str, str]] | None = None,
) -> dict[str, Any]: ...


def load_safetensors(
    source: Any,
    *,
    like: Any = None,
    dtype: Any = None,
    sharding: Any = None,
    max_bytes_in_flight: int | None = None,
    timeout: float | None = None,
    retries: int = 3,
    progress: Any = False,
    headers: Any = None,
    credentials: Any = None,
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
        ``$SSL_CERT_FILE`` when set (one of them may be the server's own,
        a CA certificate too, as ``openssl req -x509`` makes: its host name
        is checked, as Python's ``ssl`` does). A server should answer Range requests
        (206 Partial Content); one that ignores them (200 with the whole
        file, as ``python -m http.server`` does) is read in one request, one
        pass over the file from its first byte that fills every tensor
        wanted, after one warning logged (logger ``"async_array"``). Or ``hf://[datasets/|spaces/]org/repo[@revision]/path``,
        a file (or index) of a Hugging Face repo: read from
        ``$HF_ENDPOINT`` (default ``https://huggingface.co``)
        ``/[datasets/|spaces/]org/repo/resolve/{revision}/{path}``
        (revision default ``main``; ``refs/pr/1`` as one segment), with the
        token of ``$HF_TOKEN``, else of the file ``$HF_HOME/token``
        (``~/.cache/huggingface/token``), as ``Authorization: Bearer``
        unless ``credentials`` or an ``Authorization`` header is given;
        messages name the ``hf://`` URL. Redirects (301, 302, 303, 307, 308) are
        followed, at most 10 (an 11th, or a loop, fails naming the URL);
        the location they lead to serves the file's later reads (the header's
        second read, every tensor's), and a 403, 404 or 410 from there sends
        that read back to the URL once (an expired signed URL).
      like: None, or the tensors to load and what they must be: a flat dict
        ``{name: spec}`` or a nested dict whose key paths joined with ``"."``
        are the names (as flax's ``unflatten_dict(sep=".")`` makes them); each
        spec has ``.shape`` and ``.dtype`` (``jax.ShapeDtypeStruct``). The
        leaves are returned at once, before any header is read; a tensor
        missing from the files fails its leaf with ``KeyError``, one whose
        shape differs, or whose dtype does not cast to the leaf's, with
        ``ValueError`` naming the tensor, the expected and the found shape
        and dtype. A dtype that casts is converted as the tensor is read:
        numpy's same_kind casting (float32 to bfloat16 or float8, float16 to
        float32, int to float) and integers of any width, range-checked (a
        value that does not fit, or a finite float that would become inf or
        nan, fails the leaf with ``OverflowError``). Tensors that ``like``
        lacks are not read.
      dtype: None, or a floating-point dtype (``jnp.bfloat16``, say) every
        floating-point tensor is converted to, as ``like`` converts (only
        without ``like``, whose own dtypes say it per tensor); other tensors
        keep theirs.
      sharding: None (each leaf lands uncommitted on the default device,
        as ``async_wrap``'s), or where to put the tensors, as
        ``jax.device_put`` takes it: one placement for every tensor, or a
        dict of them shaped like the result (by tensor name, or nested as
        ``like``); a placement is a ``NamedSharding`` (sharded, partially
        replicated or replicated), a ``SingleDeviceSharding``, a
        ``jax.Device``, or a ``PartitionSpec`` under ``jax.set_mesh``. A
        ``like`` leaf's own ``.sharding`` is used where this is None. Or a
        callable ``sharding(name, shape, dtype) -> placement or None`` (the
        tensor's name, shape tuple and numpy dtype; None: the default
        placement), called once per tensor at the call, before any read
        ("shard axis 0 where it divides" without knowing the names). Each
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
        the retry asks only for the bytes not yet received), or got a 5xx or
        429 is retried, after 0.1 s, then twice as long each time (at most
        5 s), or after the ``Retry-After`` of a 429 or 503 (seconds or an HTTP
        date; one beyond ``timeout`` fails at once).
      progress: False; True for one ``tqdm`` progress bar on stderr (bytes,
        MB/s, ETA; without ``tqdm``, one plain line there, rewritten at each
        percent); or a callable,
        called on a pool thread as ``progress(bytes_done, bytes_total)``: once
        with 0 as the first read starts, then after each read, one call at a
        time and ``bytes_done`` always growing. ``bytes_total`` counts the
        tensor bytes this process reads (its shards), not the file's size.

      headers: None, or a dict of str to str: headers added to every
        request for an http(s) source, sent to its URL's server (scheme, host
        and port) only, never to a redirect target on another (a CDN); files
        take none. ``Range`` and ``If-Match`` are the loader's own.
      credentials: None, or a callable ``credentials(url) -> dict[str, str]``
        of headers for a URL source (``url`` as given, or each file of an
        index), sent as ``headers`` are and overriding those of the same
        name; called on a pool thread before the source's first request,
        and once more after a 401 or 403 (a token refresh) before the
        request is made again; a second refusal stands. Its exception, or a
        return that is not a dict of str to str, fails the reads that needed
        it. No message or log shows a header's value.

    Returns:
      A dict of ``AsyncArray`` by tensor name in file order (``like=None``), or
      a tree shaped like ``like``, each leaf committed to its sharding when
      one is given. Shapes are the header's (global shapes); dtypes are the
      header's (``BOOL`` bool, ``U8``-``U64``/``I8``-``I64`` uint8-uint64 and
      int8-int64, ``F16`` float16, ``BF16`` bfloat16, ``F32`` float32, ``F64``
      float64, ``C64`` complex64, ``F8_E4M3`` float8_e4m3fn, ``F8_E5M2``
      float8_e5m2, ``F8_E8M0`` float8_e8m0fnu, ``F8_E4M3FNUZ`` and
      ``F8_E5M2FNUZ`` float8_e4m3fnuz and float8_e5m2fnuz), except
      that with ``jax_enable_x64`` off 64-bit tensors come as their 32-bit
      types (values checked: one that does not fit fails its leaf with
      ``OverflowError``).

    Raises:
      FileNotFoundError: no such file, or HTTP 404 or 410 (at the call when
        ``like`` is None, else from every leaf).
      ValueError: a malformed header: length beyond the file, not a JSON
        object, a duplicate key, ``__metadata__`` not null nor an object of
        strings, a missing or unknown dtype, offsets out of bounds or not
        matching shape x itemsize, tensors overlapping or leaving data bytes
        uncovered (as safetensors refuses); the message names the file, the
        tensor and the byte range. Nothing larger than the file is allocated.
        A local source that is not a regular file (a FIFO), at the call.
      OSError: (from the leaves read after it) the source changed since its
        header was read: another size, ETag or Last-Modified over HTTP,
        another size or modification time for a file.
      OSError: a read failed: 5xx, connection errors or a body cut short
        beyond ``retries``, a wrong ``Content-Range`` or ``Content-Length``, a
        server that ignores Range and sends no ``Content-Length``, a refused
        certificate. Each leaf of that
        read fails with its own error, naming the URL or path, its own tensor
        (and shard) and its own byte range, never a neighbour's. Where the OS
        gave an error number it is the exception's ``errno``, and the type is
        Python's subclass for it, as ``open()`` and ``socket`` raise them
        (``ConnectionRefusedError``, ``ConnectionResetError``,
        ``IsADirectoryError``, ``PermissionError``).
      PermissionError: HTTP 401 or 403 (after the one refresh of
        ``credentials``), naming the URL (the ``hf://`` URL as given, saying
        that a private or gated repo needs a token when none was sent).
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
      replica). A converted tensor is read into memory of the leaf's dtype
      (64-bit tensors narrowed to 32 bits, ``like`` and ``dtype=``
      conversions): no zero-copy then, and one more pass over its bytes.

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
    source = source_text(source)
    max_bytes_in_flight = _positive_int_or_none(max_bytes_in_flight, "max_bytes_in_flight")
    timeout = timeout_seconds(timeout, NAME, positive=True)
    retries = _retries(retries)
    remote = remote_options(NAME, timeout, retries, headers, credentials)
    callback = progress_callback(progress)
    name = f"{NAME}({source!r})"
    file_order = like is None
    floats_to = _float_dtype(dtype)
    if like is None:
        # On the pool, waited for here: Ctrl-C interrupts the wait.
        where = _core.submit(open_all, source, remote).result()
        like = _specs(where, floats_to)
    else:
        if floats_to is not None:
            raise ValueError(
                f"{NAME}: pass dtype= or like=, not both: like's dtypes say what each "
                f"tensor becomes (dtype={floats_to})"
            )
        where = None
    if callable(sharding):
        sharding = _sharding_by_rule(sharding, like)
    with paused_gc():
        specs, paths, _ = specs_and_paths(name, like, sharding)
        names = [tensor_name(p) for p in paths]
        futures = [_core.Future() for _ in paths]
        # One call: an exception retrieved from any leaf counts for all (a
        # header that fails fails every leaf; one report, not one a leaf).
        leaves = one_source_a_leaf(specs, futures, Call())
        load = Load(specs, names, futures, max_bytes_in_flight, callback, read_job)
        if where is not None:
            load.plan(where, source)
            load.pump()
        else:
            opener = _core.submit(_open_and_plan, load, source, remote)
            opener.add_done_callback(lambda f: fail_all_if_failed(f, futures))
        tree = specs.treedef.unflatten(leaves)
        # A pytree's dict comes back sorted by key: give the files' order.
        return {tensor: tree[tensor] for tensor in like} if file_order else tree


def _specs(
    where: dict[str, tuple[Header, int]], floats_to: np.dtype | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """Each tensor's shape and dtype (as JAX will hold it: 64-bit types
    narrowed with x64 off; a floating-point one as ``floats_to`` when given),
    in the files' order."""
    specs = {}
    for tensor, (header, t) in where.items():
        dtype = numpy_dtype(header.entries[t].numpy_dtype)
        if floats_to is not None and numeric_kind(dtype) == "f":
            dtype = floats_to
        specs[tensor] = jax.ShapeDtypeStruct(
            tuple(header.entries[t].shape), jax.dtypes.canonicalize_dtype(dtype)
        )
    return specs


def _float_dtype(dtype: Any) -> np.dtype | None:
    """``dtype=`` checked: None, or a floating-point numpy dtype."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{NAME}: dtype must be a floating-point dtype, got {dtype!r}") from None
    if numeric_kind(dt) != "f":
        raise TypeError(
            f"{NAME}: dtype must be a floating-point dtype (float32, bfloat16, float16, a "
            f"float8 kind...), got {dt}"
        )
    # float64 with x64 off: JAX's own warning (or error), as for a like leaf.
    return canonical_dtype(dt, NAME)


class SafetensorsHeader(NamedTuple):
    """What ``aa.safetensors_header`` read: ``specs``, each tensor's
    ``jax.ShapeDtypeStruct`` by name in the files' order; ``metadata``, the
    header's ``__metadata__`` strings (for an index, every file's, merged in
    the index's order)."""

    specs: dict[str, jax.ShapeDtypeStruct]
    metadata: dict[str, str]


def safetensors_header(
    source: str | bytes | os.PathLike[str],
    *,
    timeout: float | None = None,
    retries: int = 3,
    headers: Mapping[str, str] | None = None,
    credentials: Callable[[str], Mapping[str, str]] | None = None,
) -> SafetensorsHeader:
    """Reads only the headers of a safetensors source (one read of at most
    64 KiB a file, the index followed), validated as ``load_safetensors``
    validates them: the names, shapes and dtypes before any tensor is read,
    to build a ``like`` tree or a sharding from.

    Args:
      source, timeout, retries, headers, credentials: as ``load_safetensors``
        takes them.

    Returns:
      A ``SafetensorsHeader(specs, metadata)``: ``specs`` maps each tensor's
      name (in the files' order) to a ``jax.ShapeDtypeStruct`` of its global
      shape and its dtype as JAX holds it (64-bit ones as 32-bit with
      ``jax_enable_x64`` off); ``metadata`` is the ``__metadata__`` dict of
      strings.

    Raises:
      As ``load_safetensors`` raises at its call: ``FileNotFoundError``,
      ``OSError``, ``TimeoutError``, ``ValueError`` for a malformed header, and
      ``PermissionError`` and ``TypeError``/``ValueError`` for a bad
      argument, each starting with ``safetensors_header:`` and naming the
      source.

    Examples:
      >>> import os, tempfile
      >>> import numpy as np, safetensors.numpy
      >>> import async_array as aa
      >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
      >>> safetensors.numpy.save_file({"w": np.ones((2, 3), np.float32)}, path, {"k": "v"})
      >>> header = aa.safetensors_header(path)
      >>> header.specs["w"].shape, header.metadata
      ((2, 3), {'k': 'v'})
    """
    try:
        source = source_text(source)
        timeout = timeout_seconds(timeout, NAME, positive=True)
        retries = _retries(retries)
        remote = remote_options(HEADER_NAME, timeout, retries, headers, credentials)
        # On the pool, waited for here: Ctrl-C interrupts the wait.
        where = _core.submit(open_all, source, remote).result()
    except Exception as exc:
        # The checks and reads are the loader's own: its errors name this call.
        raise _named_for_header(exc) from None
    metadata: dict[str, str] = {}
    seen: set[int] = set()
    for header, _ in where.values():
        if id(header) not in seen:
            seen.add(id(header))
            metadata.update(header.file.metadata)
    return SafetensorsHeader(_specs(where), metadata)


HEADER_NAME = "safetensors_header"


def _named_for_header(exc: Exception) -> Exception:
    """``exc`` (raised by the loader's checks and header reads) with its
    message starting ``safetensors_header:`` instead of ``load_safetensors:``,
    its type, ``errno`` and ``filename`` kept; ``exc`` itself when it starts
    otherwise."""
    old, new = f"{NAME}: ", f"{HEADER_NAME}: "
    try:
        if isinstance(exc, OSError) and exc.errno is not None:
            text = exc.strerror or ""
            if text.startswith(old):
                extra = () if exc.filename is None else (exc.filename,)
                return type(exc)(exc.errno, new + text[len(old) :], *extra)
        elif exc.args and isinstance(exc.args[0], str) and exc.args[0].startswith(old):
            return type(exc)(new + exc.args[0][len(old) :], *exc.args[1:])
    except Exception:  # an exception type built otherwise: as it came
        pass
    return exc


def _sharding_by_rule(rule: Callable[..., Any], like: Any) -> Any:
    """``sharding=`` given as ``rule(name, shape, dtype) -> placement or
    None``: one placement per tensor, called once each, at the call."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    structure: Any = treedef  # a PyTreeDef, which JAX's stubs leave untyped
    placements = []
    for path, spec in flat:
        tensor = tensor_name(path)
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
        try:
            placements.append(rule(tensor, shape, dtype))
        except Exception as exc:
            exc.add_note(f"{NAME}: raised by sharding({tensor!r}, {shape}, {dtype})")
            raise
    return structure.unflatten(placements)


def _positive_int_or_none(value: Any, arg: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{NAME}: {arg} must be a positive int (bytes) or None, got "
            f"{type(value).__name__} {value!r:.40}"
        )
    if value <= 0:
        raise ValueError(f"{NAME}: {arg} must be a positive int (bytes) or None, got {value}")
    return int(value)


_MAX_RETRIES = 2**32 - 1  # the core counts them in a u32


def _retries(retries: Any) -> int:
    if isinstance(retries, bool) or not isinstance(retries, (int, np.integer)):
        raise TypeError(
            f"{NAME}: retries must be an int from 0 to {_MAX_RETRIES}, got "
            f"{type(retries).__name__} {retries!r:.40}"
        )
    if not 0 <= retries <= _MAX_RETRIES:
        raise ValueError(f"{NAME}: retries must be an int from 0 to {_MAX_RETRIES}, got {retries}")
    return int(retries)


def _open_and_plan(load: Load, source: str, remote: Remote) -> None:
    where = open_all(source, remote, set(load.names))
    load.plan(where, source)
    load.pump()
