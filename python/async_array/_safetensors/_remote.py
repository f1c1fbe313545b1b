"""What the requests of a URL source carry: ``headers=`` and
``credentials=``, checked at the call and handed to the core per source; and
where an ``hf://`` source is, with the Hub token. No message here shows a
header's value."""

from __future__ import annotations

import os
import re
import urllib.parse
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


class CredentialsError(Exception):
    """What ``credentials`` raised, named (the core makes it an ``OSError``)."""


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
        if not all(c == "\t" or " " <= c <= "~" for c in text):
            # Visible ASCII, spaces and tabs only (RFC 9110 field values, as
            # the HTTP client sends them). The value is never shown: it may be a token.
            raise ValueError(
                f"{what}: the value of {name!r} holds a character other than visible "
                "ASCII, space or tab (a line break, NUL, control or non-ASCII character)"
            )
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
            called = f"credentials({shown!r})"
            try:
                got = credentials(shown)
            except Exception as exc:  # the core raises it as OSError, naming the read
                raise CredentialsError(f"{called} raised {type(exc).__name__}: {exc}") from None
            return checked_headers(got, f"the result of {called}")

    return {
        "timeout": remote.timeout,
        "retries": remote.retries,
        "headers": remote.headers,
        "credentials": ask,
        "name": shown,
    }


# -- hf:// sources -----------------------------------------------------------------------

HF = "hf://"
HF_SHAPE = "hf://[datasets/|spaces/]org/repo[@revision]/path/in/repo"
# A revision with slashes of its own: pull requests' and conversions' refs.
_REFS = ("refs/pr/", "refs/convert/")


class HubFile(NamedTuple):
    """One file of a Hugging Face repo: ``kind`` ``""``, ``"datasets/"`` or
    ``"spaces/"``; ``repo`` ``"org/name"``; ``revision`` (decoded); ``path``
    in the repo."""

    kind: str
    repo: str
    revision: str
    path: str


def parse_hf(source: str, name: str) -> HubFile:
    """``hf://[datasets/|spaces/]org/repo[@revision]/path``; ValueError
    naming ``source`` when it is not one."""
    rest = source[len(HF) :]
    kind = next((k for k in ("datasets/", "spaces/") if rest.startswith(k)), "")
    rest = rest[len(kind) :]
    org, _, rest = rest.partition("/")
    repo, _, rest = rest.partition("/")
    revision = "main"
    if "@" in repo:
        repo, revision = repo.split("@", 1)
        # refs/pr/1 is one revision: its slashes belong to it, not to the path.
        ref = f"{revision}/{rest}"
        for refs in _REFS:
            if ref.startswith(refs):
                number, _, rest = ref[len(refs) :].partition("/")
                revision = refs + number
                break
        revision = urllib.parse.unquote(revision)  # refs%2Fpr%2F1 as given, too
    if not org or not repo or not revision or not rest or rest.endswith("/"):
        raise ValueError(f"{name}: {source}: not an hf:// URL of a file ({HF_SHAPE})")
    return HubFile(kind, f"{org}/{repo}", revision, rest)


def hf_endpoint() -> str:
    """``$HF_ENDPOINT``, else the Hub's."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


def hf_url(hub: HubFile) -> str:
    """The endpoint's ``resolve`` URL of ``hub`` (the revision one path
    segment: ``refs/pr/1`` as ``refs%2Fpr%2F1``)."""
    revision = urllib.parse.quote(hub.revision, safe="")
    path = urllib.parse.quote(hub.path)
    return f"{hf_endpoint()}/{hub.kind}{hub.repo}/resolve/{revision}/{path}"


def hf_token() -> str | None:
    """The Hub token as huggingface_hub finds it: ``$HF_TOKEN``, else the
    file ``$HF_HOME/token`` (``~/.cache/huggingface/token``); None when
    neither holds one."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    home = os.environ.get("HF_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "huggingface"
    )
    try:
        with open(os.path.join(home, "token"), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def has_authorization(remote: Remote) -> bool:
    """Whether the requests carry credentials: an ``Authorization`` header,
    or ``credentials``."""
    return remote.credentials is not None or any(
        name.lower() == "authorization" for name, _ in remote.headers
    )


def resolved(source: str, remote: Remote) -> tuple[str, Remote]:
    """The URL that ``source`` is read from, and the options of its requests.
    An ``hf://`` source is its endpoint's ``resolve`` URL, with the Hub token
    as ``Authorization: Bearer`` unless ``credentials`` or an
    ``Authorization`` in ``headers`` rule; like every header, it goes to the
    endpoint's server only, never to the CDN its redirects lead to."""
    if not source.startswith(HF):
        return source, remote
    url = hf_url(parse_hf(source, "load_safetensors"))
    token = None if has_authorization(remote) else hf_token()
    if token is None:
        return url, remote
    return url, remote._replace(headers=[*remote.headers, ("Authorization", f"Bearer {token}")])
