"""Where a load's tensors are: a path, ``file://``, http(s) or ``hf://``
URL, or an index of several files; their headers opened by the core (errors reworded
here, naming the call), each tensor's record a ``_core.TensorInfo``."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import urllib.parse
from collections.abc import Callable
from typing import Any

from .. import _core
from .._errors import reworded
from ._remote import HF, Remote, core_args, has_authorization, parse_hf, resolved

_LOG = logging.getLogger("async_array")
NAME = "load_safetensors"
MAX_INDEX = 64 << 20
MAX_PATH = 4096  # Linux's PATH_MAX, in bytes


def source_text(source: Any) -> str:
    """``source`` as the core opens it: a file path, or an http(s) URL
    (a ``file://`` URL becomes its path)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, bytes):
        if b"\0" in source or len(source) > MAX_PATH:
            # A file's contents passed for its path: say so, not 87 MB of it.
            raise TypeError(
                f"{NAME}: source must be a path or a file://, http(s):// or hf:// URL, got "
                f"bytes of length {len(source)} that no path has (a file's contents?)"
            )
        source = os.fsdecode(source)  # a path as the OS has it, UTF-8 or not
    if not isinstance(source, str):
        raise TypeError(
            f"{NAME}: source must be a path or a file://, http(s):// or hf:// URL, "
            f"got {type(source).__name__}"
        )
    scheme, sep, rest = source.partition("://")
    if sep and scheme.lower() != scheme and scheme.isalpha():
        source = f"{scheme.lower()}://{rest}"  # schemes are case-insensitive (RFC 3986)
    if source.startswith(HF):
        parse_hf(source, NAME)  # refused at the call when it names no file
        return source
    if "://" not in source:
        return regular_or_missing(source)
    try:
        url = urllib.parse.urlsplit(source)
    except ValueError as exc:  # "Invalid IPv6 URL", say
        raise ValueError(f"{NAME}: {source}: not a valid URL ({exc})") from None
    if url.scheme == "file":
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"{NAME}: {source}: a file:// URL must name a local file")
        return regular_or_missing(urllib.parse.unquote(url.path))
    if url.scheme in ("http", "https"):
        return source
    raise ValueError(f"{NAME}: {source}: unsupported URL scheme {url.scheme!r}")


def regular_or_missing(path: str) -> str:
    """``path``, refused at the call unless it is a regular file or missing
    (the read says so then): opening a FIFO blocks until a writer comes, and
    a device has no size to check reads against. Files named by an index are
    checked by the core as they are opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path
    if stat.S_ISREG(mode):
        return path
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, f"{NAME}: is a directory, not a file", path)
    what = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "not a regular file"
    raise ValueError(f"{NAME}: {path}: is {what}; a safetensors file must be a regular file")


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://", HF))


def read_index(source: str, remote: Remote) -> dict[str, str]:
    """The weight map of a ``model.safetensors.index.json``: tensor name ->
    the path or URL of the file that holds it (resolved against the index)."""
    if is_url(source):
        url, remote = resolved(source, remote)
        try:
            data, size = _core.read_url_prefix(url, MAX_INDEX, **core_args(url, source, remote))
        except PermissionError as exc:
            raise PermissionError(f"{NAME}: {exc}{token_hint(source, remote)}") from None
        except OSError as exc:  # the core names the URL and bytes: the call goes first
            raise reworded(exc, f"{NAME}: ") from None
        if size > len(data):
            raise ValueError(
                f"{NAME}: {source}: an index of {size} bytes is over the {MAX_INDEX} limit"
            )
        base = source
        join: Callable[[str, str], str] = urllib.parse.urljoin
        if source.startswith(HF):  # the same repo and revision: beside it in the repo
            base, join = source.rsplit("/", 1)[0], "{}/{}".format
    else:
        try:
            with open(source, "rb") as f:
                data = f.read(MAX_INDEX + 1)
        except OSError as exc:  # as open() raises it, named for the call
            raise type(exc)(exc.errno, f"{NAME}: {exc.strerror}", source) from None
        if len(data) > MAX_INDEX:
            raise ValueError(f"{NAME}: {source}: an index over {MAX_INDEX} bytes")
        base = os.path.dirname(source)
        join = os.path.join
    try:
        index = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{NAME}: {source}: the index is not valid JSON: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f'{NAME}: {source}: an index needs a "weight_map" object of tensor name -> file name'
        )
    files: dict[str, str] = {}
    out = {}
    for name, file in weight_map.items():
        if "/" in file or "\\" in file or file in ("", ".", ".."):
            raise ValueError(
                f"{NAME}: {source}: weight_map[{name!r}] = {file!r} is not a file name"
            )
        out[name] = files.setdefault(file, join(base, file))
    return out


def tensor_name(path: tuple[Any, ...]) -> str:
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


class Header:
    """The tensors of one opened file, by name."""

    def __init__(self, file: _core.SafetensorsFile) -> None:
        self.file = file
        self.index: dict[str, int] = {}
        self.entries = file.tensors
        for i, entry in enumerate(self.entries):
            self.index[entry.name] = i


def open_header(source: str, remote: Remote) -> Header:
    try:
        if is_url(source):
            url, remote = resolved(source, remote)
            header = Header(_core.SafetensorsFile(url, **core_args(url, source, remote)))
            if not header.file.ranged:
                _LOG.warning(
                    "%s: %s: the server ignores Range requests (it answered one with the whole "
                    "file): ranged reads are unavailable, so the tensors wanted are read in one "
                    "pass over the file from its first byte",
                    NAME,
                    source,
                )
            return header
        return Header(_core.SafetensorsFile(source))
    except FileNotFoundError as exc:
        if not is_url(source):
            # As open() raises it: errno and filename set, for code that reads them.
            raise FileNotFoundError(errno.ENOENT, f"{NAME}: no such file", source) from None
        raise FileNotFoundError(f"{NAME}: {exc}") from None
    except PermissionError as exc:
        if not is_url(source):  # a file's: errno EACCES, as open() raises it
            raise reworded(exc, f"{NAME}: ") from None
        raise PermissionError(f"{NAME}: {exc}{token_hint(source, remote)}") from None
    except (OSError, ValueError, TypeError) as exc:  # TimeoutError is an OSError
        # The core's message names the file and bytes; this names the call
        # (an OS error number stays the exception's: ConnectionRefusedError...).
        raise reworded(exc, f"{NAME}: ") from None


def token_hint(source: str, remote: Remote) -> str:
    """What a refused ``hf://`` source sent without a token adds to its error."""
    if not source.startswith(HF) or has_authorization(remote):
        return ""
    return (
        " (a private or gated repo needs a token: set HF_TOKEN, or log in with "
        "`hf auth login` (it writes $HF_HOME/token))"
    )


def is_index(source: str) -> bool:
    return (
        urllib.parse.urlsplit(source).path.endswith(".json")
        if is_url(source)
        else (source.endswith(".json"))
    )


def open_all(
    source: str, remote: Remote, wanted: set[str] | None = None
) -> dict[str, tuple[Header, int]]:
    """Every tensor name -> (its file's header, its index there), for one
    file or an index of several (their headers read concurrently, on the pool).
    With ``wanted`` (the names ``like`` asks for), an index's files that hold
    none of them are not opened: a missing or unread file of tensors nobody
    asked for fails nothing."""
    if not is_index(source):
        header = open_header(source, remote)
        return {name: (header, t) for name, t in header.index.items()}
    full_map = weight_map = read_index(source, remote)
    if wanted is not None:
        weight_map = {name: file for name, file in weight_map.items() if name in wanted}
    files = list(dict.fromkeys(weight_map.values()))
    opening = [_core.submit(open_header, f, remote) for f in files]
    headers = {}
    for file, fut in zip(files, opening, strict=True):
        try:
            headers[file] = fut.result()
        except FileNotFoundError as exc:
            held = [name for name, f in full_map.items() if f == file]
            shown = ", ".join(repr(name) for name in held[:5])
            more = ", ..." if len(held) > 5 else ""
            base = file.rsplit("/", 1)[-1] if is_url(file) else os.path.basename(file)
            if exc.errno is None:  # a URL: the core's message says why (HTTP 404)
                why = str(exc).removeprefix(f"{NAME}: ")
            else:
                why = "no such file"  # its path is the exception's filename
            message = (
                f"{NAME}: {source}: names {base}, which does not exist ({why}); it was to "
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
            raise KeyError(
                f"{NAME}: {source}: the index puts tensor {name!r} in {file}, which lacks it"
            )
        where[name] = (header, t)
    return where
