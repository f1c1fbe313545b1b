"""The package's exceptions and the helpers that shape them.

``WaitCycleError`` (raised by the Rust core) and ``RemoteFailure`` are public,
as ``async_array.WaitCycleError`` and ``async_array.RemoteFailure``. The
helpers: freeing a failed function's locals, one exception shared by many
leaves or calls without their notes mixing, errors in a result marked
:func:`invalid` (the leaf's name goes in front), and :func:`reworded`, the one
way a message is prefixed with the call or leaf it concerns."""

from __future__ import annotations

import copy
import traceback
from types import TracebackType
from typing import Literal, TypeVar

from ._core import WaitCycleError

__all__ = [
    "RemoteFailure",
    "WaitCycleError",
    "frames_freed",
    "free_frames",
    "invalid",
    "is_invalid",
    "noted",
    "reworded",
    "shallow_copy",
    "waiting_on",
]

E = TypeVar("E", bound=BaseException)


class RemoteFailure(RuntimeError):
    """Another process of a ``jax.distributed`` job failed where this one
    waits for it: its share of a leaf, or a call spanning the processes. The
    message names the process and the leaf (``async_array.RemoteFailure``)."""

    __module__ = "async_array"


def invalid(kind: type[Exception], message: str) -> Exception:
    """An error in a result (``message`` starts with ``": "``) that the leaf's
    name is put in front of where it is reported (see :func:`is_invalid`);
    any other exception is the producer's own and keeps its message."""
    exc = kind(message)
    exc._async_array_invalid = True  # type: ignore[attr-defined]
    return exc


def is_invalid(exc: BaseException) -> bool:
    """Whether ``exc`` was made by :func:`invalid`."""
    return getattr(exc, "_async_array_invalid", False)


def reworded(exc: E, prefix: str, text: str | None = None) -> E:
    """A new exception of ``exc``'s type whose message is ``prefix`` followed by
    ``text`` (default: ``exc``'s message). An ``OSError`` with an error number
    keeps it (``errno``, and the subclass ``open()`` would raise); its text is
    then ``prefix`` and its ``strerror``. Raise it ``from None``: the
    original adds nothing the new message lacks."""
    if isinstance(exc, OSError) and exc.errno is not None and text is None:
        return type(exc)(exc.errno, f"{prefix}{exc.strerror}")
    return type(exc)(f"{prefix}{exc if text is None else text}")


class _FramesFreed:
    """``with frames_freed: value = f()``: an exception leaving the block keeps
    ``f``'s frames in its traceback, for the user to read, but their locals (a
    loader's half-filled buffers, say) are freed at once, not when the
    exception is. The exception propagates unchanged."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if tb is not None:
            traceback.clear_frames(tb)  # skips the frames still running (this one's caller)
        return False


frames_freed = _FramesFreed()


def free_frames(exc: BaseException) -> BaseException:
    """Frees the locals of the frames in ``exc``'s traceback (as
    :data:`frames_freed`), for an exception that is stored rather than raised;
    returns ``exc``."""
    traceback.clear_frames(exc.__traceback__)
    return exc


def shallow_copy(exc: BaseException) -> BaseException:
    """A copy of ``exc`` (same type, args, traceback, cause, context and notes),
    so notes added to the copy never reach the original; ``exc`` itself when it
    cannot be made."""
    try:
        dup = copy.copy(exc)
    except Exception:
        # copy.copy calls type(exc)(*exc.args), which fails for an __init__
        # with keyword-only arguments: make it without calling __init__.
        try:
            dup = type(exc).__new__(type(exc))
            dup.args = exc.args
            if hasattr(exc, "__dict__"):
                dup.__dict__.update(exc.__dict__)
        except Exception:
            return exc
    dup.__traceback__ = exc.__traceback__
    dup.__cause__ = exc.__cause__
    dup.__context__ = exc.__context__
    dup.__suppress_context__ = exc.__suppress_context__
    if hasattr(exc, "__notes__"):
        dup.__notes__ = list(exc.__notes__)
    return dup


def noted(exc: BaseException, note: str) -> BaseException:
    """A copy of ``exc`` (see :func:`shallow_copy`) with ``note`` added, so notes
    of different calls sharing one exception never mix (an exception that
    cannot be copied takes the note itself)."""
    dup = shallow_copy(exc)
    dup.add_note(note)
    return dup


def waiting_on(exc: WaitCycleError, what: str) -> WaitCycleError:
    """The cycle the core found (``exc``), reworded to name the leaf waited on
    (``what``, e.g. ``async_wrap(g) leaf ['b']``) where the core could name
    only its task; ``cycle`` and ``index`` are kept."""
    cycle = tuple(exc.cycle)
    me = cycle[0] if cycle else "this task"
    new = WaitCycleError(
        f"{me}: waiting on {what} would never end: it waits on this task "
        f"(cycle: {' -> '.join(cycle)})"
    )
    new.cycle, new.index = cycle, exc.index
    return new
