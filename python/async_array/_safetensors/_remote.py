"""What the requests of a URL source carry: ``headers=`` and
``credentials=``, checked at the call and handed to the core per source. No
message here shows a header's value."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

# RFC 9110's token: the characters a header name may have.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
# Headers each request sets itself.
_OWN = {"range", "if-match"}

Headers = list[tuple[str, str]]


class Remote(NamedTuple):
    """How a load's URLs are read: the request ``timeout`` and ``retries``,
    the ``headers`` of every request to a source's server, and the caller's
    ``credentials(url)``."""

    timeout: float | None
    retries: int
    headers: Headers
    credentials: Callable[[str], Any] | None


def checked_headers(value: Any, what: str) -> Headers:
    """``value``, a dict of header name -> value (str), as pairs; TypeError or
    ValueError starting with ``what``, naming a bad header but never showing a
    value."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a dict of str to str, got {type(value).__name__}")
    pairs = []
    for name, text in value.items():
        if not isinstance(name, str):
            raise TypeError(
                f"{what} must be a dict of str to str, got a key of type {type(name).__name__}"
            )
        if not isinstance(text, str):
            raise TypeError(
                f"{what} must be a dict of str to str, got a value of type "
                f"{type(text).__name__} for {name!r}"
            )
        if not _TOKEN.match(name):
            raise ValueError(f"{what}: {name!r} is not a valid header name")
        if name.lower() in _OWN:
            raise ValueError(f"{what}: {name!r} is set by the loader itself, for each request")
        if any(c in text for c in "\r\n\0"):
            # The value is never shown: it may be a token.
            raise ValueError(f"{what}: the value of {name!r} holds a line break or NUL")
        pairs.append((name, text))
    return pairs


def remote_options(
    name: str,
    timeout: float | None,
    retries: int,
    headers: Any,
    credentials: Any,
) -> Remote:
    """The checked ``headers=`` and ``credentials=`` of ``name``'s call."""
    pairs = [] if headers is None else checked_headers(headers, f"{name}: headers")
    if credentials is not None and not callable(credentials):
        raise TypeError(
            f"{name}: credentials must be a callable credentials(url) -> dict[str, str], "
            f"or None, got {type(credentials).__name__}"
        )
    return Remote(timeout, retries, pairs, credentials)


def core_args(url: str, shown: str, remote: Remote) -> dict[str, Any]:
    """The keyword arguments of ``_core.SafetensorsFile`` and
    ``_core.read_url_prefix`` for ``url``, named ``shown`` in messages and
    passed to ``credentials``."""
    credentials = remote.credentials
    ask = None
    if credentials is not None:

        def ask(_: str) -> Headers:  # called by the core, on the reading thread
            return checked_headers(credentials(shown), f"credentials({shown!r}) returned; it")

    return {
        "timeout": remote.timeout,
        "retries": remote.retries,
        "headers": remote.headers,
        "credentials": ask,
        "name": shown,
    }
