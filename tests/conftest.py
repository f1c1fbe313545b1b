"""Shared test set-up.

Four CPU devices (set before JAX is imported) let sharding tests run on this
machine; the default device stays CPU 0.

No test reads a clock or sleeps to wait for a state: a test waits on an event,
a condition or a future, each wait bounded by ``WAIT`` seconds whose expiry
fails the test with a message. A slow load is a ``Gate``: a loader that blocks
until the test opens it, so the test decides what is still pending.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax

assert len(jax.devices()) >= 1


import logging  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import async_array as aa  # noqa: E402

# Every dtype a leaf may have: JAX's array dtypes (bfloat16 from ml_dtypes, as in JAX).
DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, jax.numpy.bfloat16, np.float32, np.float64, np.complex64,
    np.complex128,
]  # fmt: skip
DTYPE_IDS = [np.dtype(d).name for d in DTYPES]

# The bound of every wait for a state: long enough for a loaded 2-core machine
# (a healthy run takes milliseconds); reaching it is a failure, not a slow pass.
WAIT = 30


def wait_for(event: threading.Event, what: str, timeout: float = WAIT) -> None:
    """Waits for ``event``; fails the test, saying what never happened, after ``timeout`` s."""
    assert event.wait(timeout), f"gave up after {timeout} s waiting for {what}"


def poll_until(predicate: Callable[[], bool], what: str, tries: int = 3000) -> None:
    """For a state that sends no notification (a count that settles after a
    garbage collection on another thread, a pool's idle workers): checks
    ``predicate`` up to ``tries`` times, 10 ms apart (at least 30 s in all),
    and fails the test, saying what never happened. Prefer an event."""
    pause = threading.Event()  # never set: wait(0.01) is a pause that reads no clock here
    for _ in range(tries):
        if predicate():
            return
        pause.wait(0.01)
    assert predicate(), f"gave up waiting for {what}"


# -- scripts in a fresh interpreter ----------------------------------------------------


def spawn(code: str, env: dict[str, str] | None = None, *, stdin: bool = False) -> subprocess.Popen:
    """Starts ``code`` in a fresh interpreter, in its own process group (so that
    a hung forked grandchild is killed with it); with ``stdin``, a pipe the
    test writes to (a line there can tell the script when to go on)."""
    full_env = dict(os.environ)
    full_env.pop(aa._runtime.ENV_MAX_WORKERS, None)
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    """Kills whatever is left of the script's process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_script(
    code: str, *, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter; returns the CompletedProcess."""
    proc = spawn(code, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class Gate:
    """A loader that blocks until the test calls ``open()``, then returns
    ``value`` (or raises ``exc``). ``started`` is set once the loader runs.

    Every gate still closed when a test ends is opened then (see
    ``_open_gates``), so a failing test leaves no pool worker blocked.
    """

    _all: list["Gate"] = []

    def __init__(self, value=None, exc: BaseException | None = None):
        self.value = value
        self.exc = exc
        self.started = threading.Event()
        self.opened = threading.Event()
        Gate._all.append(self)

    def __call__(self, *_args):
        self.started.set()
        wait_for(self.opened, "the test to open the gate")
        if self.exc is not None:
            raise self.exc
        return self.value

    def open(self) -> None:
        self.opened.set()

    def leaf(self, **kw) -> aa.AsyncArray:
        """``aa.async_wrap(self, ...)``: shape and dtype of ``value`` unless given."""
        if "like" not in kw and "shape" not in kw:
            value = np.asarray(self.value)
            kw = {"shape": value.shape, "dtype": value.dtype, **kw}
        return aa.async_wrap(self, **kw)


@pytest.fixture(autouse=True)
def _open_gates():
    yield
    while Gate._all:
        Gate._all.pop().open()


class LogRecords(logging.Handler):
    """The records of the ``async_array`` logger, with a wait for the n-th one
    (records come from the worker thread that logged them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def wait_for(self, n: int, what: str) -> list[logging.LogRecord]:
        with self._cond:
            got = self._cond.wait_for(lambda: len(self.records) >= n, WAIT)
            assert got, f"gave up after {WAIT} s waiting for {what}: {self.records}"
            return list(self.records)


@pytest.fixture
def async_array_log():
    """Collects what the ``async_array`` logger logs during one test."""
    logger = logging.getLogger("async_array")
    handler = LogRecords()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def sds(shape=(2,), dtype=np.float32):
    """A ``jax.ShapeDtypeStruct`` (a leaf's declaration), float32 (2,) by default."""
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture
def roomy_pool(pool_size):
    """Gated loaders each hold a worker: room for 16 of them, whatever earlier tests left."""
    pool_size(16)


@pytest.fixture
def pool_size():
    """``aa.configure`` for one test (``pool_size(n)``); the pool's size from
    before the test is restored afterwards."""
    before = aa.max_workers()
    yield aa.configure
    aa.configure(before)


@pytest.fixture
def server(tmp_path):
    """A ``FaultServer`` (tests/helpers/http_server.py) serving ``tmp_path``
    on 127.0.0.1, closed at the test's end."""
    from helpers.http_server import FaultServer

    srv = FaultServer(tmp_path)
    yield srv
    srv.close()
