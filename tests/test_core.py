"""The Rust core seen from Python: futures, the pool, waits, signals,
interpreter exit, fork, and ``aa.configure``.

Every wait here has a timeout: a hang is a failure, not a stuck run. Process
level behaviour (exit, fork, Ctrl-C, the environment variable) is tested in a
subprocess running a small script.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import queue
import signal
import subprocess
import threading
import traceback
import weakref

import numpy as np
import pytest
from conftest import WAIT, Gate, kill_group, poll_until, run_script, spawn, wait_for

import async_array as aa
from async_array import _core
from async_array._core import _testing


class LineReader:
    """The script's stdout, a line at a time, each read bounded by ``WAIT``."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.err: str | None = None
        self.lines: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def read(self, what: str) -> str:
        """The next line; fails the test, saying what never came and what the
        script wrote to stderr, after ``WAIT`` s."""
        try:
            return self.lines.get(timeout=WAIT)
        except queue.Empty:
            pytest.fail(f"gave up after {WAIT} s waiting for {what}; stderr: {self.close()}")

    def close(self) -> str:
        """Ends the script's process group and returns what it wrote to stderr
        (the same text on every call)."""
        if self.err is None:
            kill_group(self.proc)
            self.thread.join(WAIT)  # the pipe is at its end once the group is gone
            self.err = self.proc.stderr.read()
            self.proc.stdout.close()
            self.proc.stderr.close()
        return self.err


def gate() -> tuple[threading.Event, _core.Future]:
    """A task that runs until the returned event is set (it holds one worker)."""
    hold = Gate("released")
    future = _core.submit(hold)
    wait_for(hold.started, "the gate task to start")
    return hold.opened, future


def raising_task(exc: BaseException):
    def task_body():
        raise exc

    return task_body


# -- results, exceptions, cancellation -------------------------------------------


def test_submit_returns_values_and_reports_status():
    assert _core.submit(pow, 2, 10).result(WAIT) == 1024
    assert _core.submit(lambda *a: a, 1, "two", None).result(WAIT) == (1, "two", None)
    obj = object()
    f = _core.submit(lambda: obj)
    assert f.result(WAIT) is obj, "the very object the task returned"
    assert (f.done(), f.running(), f.cancelled(), f.status) == (True, False, False, "done")
    assert f.exception(WAIT) is None
    assert repr(f) == "<async_array._core.Future done>"


def test_status_goes_pending_running_done(pool_size):
    pool_size(1)
    release, held = gate()
    queued = _core.submit(int, "7")
    assert (queued.status, queued.running(), queued.done()) == ("pending", False, False)
    assert (held.status, held.running()) == ("running", True)
    release.set()
    assert queued.result(WAIT) == 7
    assert (held.result(WAIT), held.status) == ("released", "done")


def test_exception_is_the_same_object_with_the_task_frames():
    raised = KeyError("missing")

    def load_weights():
        raise raised

    f = _core.submit(load_weights)
    tracebacks = []
    for _ in range(5):
        with pytest.raises(KeyError) as info:
            f.result(WAIT)
        assert info.value is raised
        tracebacks.append([fr.name for fr in traceback.extract_tb(info.value.__traceback__)])
    assert "load_weights" in tracebacks[0], "the task's own frame is kept"
    assert all(tb == tracebacks[0] for tb in tracebacks), f"traceback grew: {tracebacks}"
    assert f.status == "failed" and f.done()
    # exception() hands back the same object, with the same traceback.
    assert f.exception(WAIT) is raised
    assert [fr.name for fr in traceback.extract_tb(raised.__traceback__)][-1] == "load_weights"
    with pytest.raises(KeyError):
        f.result(WAIT)
    assert [fr.name for fr in traceback.extract_tb(raised.__traceback__)] == tracebacks[0]


def test_cancel_before_start(pool_size):
    pool_size(1)
    ran = []
    release, held = gate()
    queued = _core.submit(ran.append, "queued task ran")
    assert queued.cancel() is True
    assert queued.cancel() is True, "cancelling twice still answers True"
    assert (queued.cancelled(), queued.done(), queued.status) == (True, True, "cancelled")
    with pytest.raises(concurrent.futures.CancelledError):
        queued.result(WAIT)
    with pytest.raises(concurrent.futures.CancelledError):
        queued.exception(WAIT)
    # The running task cannot be cancelled and still finishes.
    assert held.cancel() is False
    assert not held.cancelled()
    release.set()
    assert held.result(WAIT) == "released"
    assert _core.submit(len, "abc").result(WAIT) == 3, "the worker moved on past the cancelled task"
    assert ran == [], "a cancelled task never runs"
    assert held.cancel() is False, "a finished task cannot be cancelled"


def test_result_timeout_then_value(pool_size):
    pool_size(2)
    release, held = gate()
    # The gate is closed: the only way out of these waits is their timeout.
    with pytest.raises(TimeoutError):
        held.result(timeout=0.2)
    assert held.wait(timeout=0.05) is False
    assert held.wait(timeout=0) is False
    release.set()
    assert held.wait(timeout=WAIT) is True
    assert held.result(timeout=0) == "released"
    with pytest.raises(ValueError, match="nan"):
        _core.Future().wait(timeout=float("nan"))


def test_python_completed_future():
    f = _core.Future()
    assert (f.status, f.done()) == ("pending", False)
    with pytest.raises(TimeoutError):
        f.result(timeout=0.05)
    assert f.set_result([1, 2]) is True
    assert f.set_result("again") is False, "a finished future keeps its first result"
    assert f.set_exception(ValueError("late")) is False
    assert f.result(0) == [1, 2]

    g = _core.Future()
    err = OSError("disk gone")
    assert g.set_exception(err) is True
    assert g.exception(0) is err
    with pytest.raises(OSError) as info:
        g.result(0)
    assert info.value is err


# -- the pool waiting on itself ----------------------------------------------------


def test_single_worker_task_waiting_on_queued_future_does_not_deadlock(pool_size):
    pool_size(1)

    def outer():
        inner = _core.submit(lambda: 41)  # queued behind this very task
        return inner.result(WAIT) + 1

    assert _core.submit(outer).result(WAIT) == 42

    # A chain: every task waits on the next one, all on a pool of one.
    def chain(depth):
        if depth == 0:
            return 0
        return _core.submit(chain, depth - 1).result(WAIT) + 1

    assert _core.submit(chain, 6).result(WAIT) == 6
    assert aa.max_workers() == 1


def test_single_worker_waits_on_work_submitted_later(pool_size):
    """The worker blocks first; the work it waits for is submitted afterwards."""
    pool_size(1)
    box = _core.Future()
    waiting = threading.Event()

    def consumer():
        waiting.set()
        return box.result(WAIT).result(WAIT) * 2

    out = _core.submit(consumer)
    assert waiting.wait(WAIT)
    box.set_result(_core.submit(lambda: 21))
    assert out.result(WAIT) == 42


def test_pool_wakes_idle_worker_after_a_stand_in_retires(pool_size):
    """A worker back from a wait leaves the pool over size; work queued then
    must still reach an idle worker (no lost wake-up)."""

    def quiet():  # no task of an earlier test in this process still holds a worker
        st = _core.pool_stats()
        return st["threads"] == st["idle"] and st["queued"] == 0 and st["blocked"] == 0

    poll_until(quiet, "the pool to be quiet after the earlier tests of this process")
    pool_size(2)
    for _ in range(3):
        unblock = _core.Future()
        release, held = gate()

        def waits_then_submits(unblock):
            # Blocked (the pool may start a stand-in) until the test has seen both
            # spare workers idle, which its own steps may take up to 3 x WAIT to see.
            unblock.result(4 * WAIT)
            ran = threading.Event()
            _core.submit(lambda: ran.set() or "inner")
            # A wait the pool does not see (as on a threading.Event): only the
            # idle worker woken for `inner` can run it, if the wake-up is not lost.
            wait_for(ran, "the inner task")
            return "inner"

        outer = _core.submit(waits_then_submits, unblock)
        # Work queued while `outer` is blocked runs on a stand-in, which then idles.
        assert [_core.submit(abs, -i).result(WAIT) for i in range(3)] == [0, 1, 2]
        release.set()
        assert held.result(WAIT) == "released"

        # Every worker but `outer` asleep (no notification for that: polled), so
        # that `outer`, back from its wait, leaves the pool over size. The
        # stand-in may retire on its own first (the pool was over size while
        # `outer` was blocked), so one sleeper or two.
        def settled():
            st = _core.pool_stats()
            return st["idle"] >= 1 and st["threads"] - st["blocked"] == st["idle"]

        poll_until(settled, "every worker but the blocked one idle")
        unblock.set_result(None)
        assert outer.result(WAIT) == "inner"


# -- callbacks ----------------------------------------------------------------------


def test_done_callbacks_run_once_with_the_future():
    seen = []
    both_ran = threading.Event()
    release_event = threading.Event()
    f = _core.submit(lambda: release_event.wait(WAIT) and "v")
    f.add_done_callback(lambda fut: seen.append(("first", fut.result(0))))
    f.add_done_callback(lambda fut: (seen.append(("second", fut is f)), both_ran.set()))
    release_event.set()
    assert f.result(WAIT) == "v"
    wait_for(both_ran, "the second callback")
    assert seen == [("first", "v"), ("second", True)]
    # Added after completion: runs at once, here.
    f.add_done_callback(lambda fut: seen.append(("late", threading.current_thread().name)))
    assert seen[-1] == ("late", threading.current_thread().name)


def test_raising_done_callback_is_logged_and_worker_keeps_working(pool_size, caplog):
    pool_size(1)
    caplog.set_level(logging.ERROR, logger="async_array")

    def bad_callback(fut):
        raise ValueError(f"callback saw {fut.result(0)}")

    after = []
    after_ran = threading.Event()
    release, held = gate()
    held.add_done_callback(bad_callback)
    held.add_done_callback(lambda fut: (after.append(fut.result(0)), after_ran.set()))
    release.set()
    assert held.result(WAIT) == "released"
    # The single worker ran the callbacks and still runs new work.
    assert [_core.submit(pow, i, 2).result(WAIT) for i in range(5)] == [0, 1, 4, 9, 16]
    # Callbacks run in order: once the second ran, the first has been logged.
    wait_for(after_ran, "the callback after the raising one")
    records = [r for r in caplog.records if r.name == "async_array"]
    assert len(records) == 1
    record = records[0]
    assert record.levelno == logging.ERROR
    assert "done-callback" in record.getMessage()
    assert "bad_callback" in record.getMessage()
    assert isinstance(record.exc_info[1], ValueError)
    assert str(record.exc_info[1]) == "callback saw released"
    assert after == ["released"], "a raising callback does not stop the next one"

    # Also when the callback runs at once on the calling thread: logged, not raised.
    caplog.clear()
    held.add_done_callback(bad_callback)
    assert [r.exc_info[1].args for r in caplog.records] == [("callback saw released",)]


# -- BaseException and panics ---------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [SystemExit(4), KeyboardInterrupt(), GeneratorExit()],
    ids=lambda e: type(e).__name__,
)
def test_base_exception_fails_the_future_and_pool_survives(pool_size, exc):
    pool_size(1)
    f = _core.submit(raising_task(exc))
    with pytest.raises(type(exc)) as info:
        f.result(WAIT)
    assert info.value is exc
    assert f.exception(WAIT) is exc
    assert f.status == "failed"
    # Same single worker, still alive.
    assert [_core.submit(str, i).result(WAIT) for i in range(3)] == ["0", "1", "2"]
    stats = _core.pool_stats()
    assert stats["max_workers"] == 1 and stats["threads"] >= 1


def test_rust_panic_is_an_ordinary_runtime_error(pool_size):
    pool_size(1)
    f = _testing._submit_rust_panic("x")
    with pytest.raises(RuntimeError, match="Rust panic in a worker: x") as info:
        f.result(WAIT)
    assert isinstance(info.value, Exception), "callers catching Exception see it"
    assert type(info.value) is RuntimeError
    assert f.status == "failed"
    assert isinstance(f.exception(WAIT), RuntimeError)
    assert [_core.submit(hex, i).result(WAIT) for i in range(3)] == ["0x0", "0x1", "0x2"]


def test_concurrent_rust_panics_each_fail_their_own_future_quietly(pool_size, capfd):
    pool_size(4)
    futures = [_testing._submit_rust_panic(f"panic {i}") for i in range(16)]
    for i, f in enumerate(futures):
        with pytest.raises(RuntimeError, match=f"Rust panic in a worker: panic {i}$"):
            f.result(WAIT)
    assert [_core.submit(len, "ab").result(WAIT) for _ in range(4)] == [2] * 4
    assert "panicked" not in capfd.readouterr().err


# -- interpreter exit -------------------------------------------------------------------

# Every task here runs for an hour: an exit that waited for one past its
# grace would hang until the test's timeout.
EXIT_SCRIPT = """
import sys, threading, time
import async_array as aa
from async_array import _core

started = threading.Event()

def sleeps():
    started.set()
    time.sleep(3600)

def naps():  # re-takes the GIL many times while the interpreter finalizes
    started.set()
    while True:
        time.sleep(0.01)

def spins():
    started.set()
    while True:
        pass

kind = {kind!r}
aa.configure(max_workers={workers})
if kind == "waiter":
    slow = _core.submit(sleeps)
    _core.submit(slow.result)  # a task blocked on another future
    # The pool starts a stand-in for queued work only once that task waits.
    assert _core.submit(int).result(30) == 0
    waiting = threading.Event()
    # A thread blocked on it, too (it waits from just after setting the event).
    threading.Thread(target=lambda: (waiting.set(), slow.result()), daemon=True).start()
    assert waiting.wait(30)
else:
    slow = _core.submit({{"sleep": sleeps, "nap": naps, "spin": spins}}[kind])
queued = [_core.submit(time.sleep, 3600) for _ in range(5)]
assert started.wait(30)
print("ready", slow.running(), flush=True)
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("kind", "workers"), [("sleep", 1), ("nap", 1), ("spin", 1), ("waiter", 2)]
)
def test_interpreter_exit_with_running_and_queued_tasks(kind, workers):
    # Exit waits for running tasks only that long (one may be inside JAX).
    proc = spawn(EXIT_SCRIPT.format(kind=kind, workers=workers), {"ASYNC_ARRAY_EXIT_GRACE": "1"})
    out = LineReader(proc)
    try:
        assert out.read("the task to start") == "ready True\n"
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the interpreter did not exit: running tasks were waited for")
    finally:
        err = out.close()
    assert proc.returncode == 3, err
    for bad in ("Fatal Python error", "panicked", "Traceback", "Aborted"):
        assert bad not in err, err


# -- fork -----------------------------------------------------------------------------

FORK_SCRIPT = """
import os, signal, sys, threading, warnings
warnings.filterwarnings("ignore", message=".*fork.*")
import async_array as aa
from async_array import _core

aa.configure(max_workers=4)
assert [f.result(30) for f in [_core.submit(pow, i, 2) for i in range(20)]] == [
    i * i for i in range(20)
]
# Threads that keep taking the GIL and the pool's lock while fork happens.
stop = threading.Event()
def churn():
    while not stop.is_set():
        assert _core.submit(abs, -1).result(30) == 1
churners = [threading.Thread(target=churn) for _ in range(3)]
for t in churners:
    t.start()

def child():
    try:
        running.result(timeout=10)
        print("child: the parent's running task finished in the child", flush=True)
    except RuntimeError as exc:
        assert "os.fork()" in str(exc), exc
    fs = [_core.submit(lambda i=i: i * 3) for i in range(200)]
    assert _core.wait_all(fs, 30)
    assert [f.result(0) for f in fs] == [i * 3 for i in range(200)]
    # Work queued in the parent runs in the parent only: here it fails,
    # naming the fork (queued, or taken by a parent's worker at the fork).
    assert _core.wait_all(queued, 30)
    for f in queued:
        assert "os.fork()" in str(f.exception(0)), f.exception(0)

def hold(started, release):
    started.set()
    assert release.wait(30)

for round in range(5):
    started, release = threading.Event(), threading.Event()
    running = _core.submit(hold, started, release)  # runs in the parent until released
    assert started.wait(30)
    queued = [_core.submit(lambda i=i: i + 100) for i in range(50)]
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a hung child dies instead of outliving the test
        code = 1
        try:
            child()
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    release.set()
    assert running.result(30) is None
    assert [f.result(30) for f in queued] == [i + 100 for i in range(50)]
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
stop.set()
for t in churners:
    t.join()
print("parent ok", flush=True)
"""


def test_a_worker_running_more_tasks_keeps_no_earlier_result_alive(pool_size):
    # One worker: when `first` ends, the worker goes on, in the same hold of
    # the GIL, to the queued `second`, which blocks until the test opens it.
    # The first result must be freed as soon as nobody holds it, not when
    # that batch ends.
    pool_size(1)
    first, second = Gate(), Gate()

    class Result:
        pass

    value = Result()
    first.value = value
    fut_first = _core.submit(first)
    fut_second = _core.submit(second)
    first.open()
    wait_for(second.started, "the second task to start on the same worker")
    assert fut_first.result(WAIT) is value
    alive = weakref.ref(value)
    del value, fut_first
    first.value = None
    poll_until(lambda: gc.collect() >= 0 and alive() is None, "the first result to be freed")
    second.open()
    assert fut_second.result(WAIT) is None


def test_results_dropped_at_once_never_deadlock_the_pool():
    # A finished task's value (jax.Arrays, whose destructor releases the GIL)
    # was once freed under the pool's lock while the main thread, holding the
    # GIL, waited for that lock to submit more: a deadlock within ~1,000 calls.
    proc = run_script(
        """
        import numpy as np, async_array as aa
        one = np.ones(16, np.float32)
        for i in range(20_000):
            aa.async_wrap(lambda: one, shape=(16,), dtype=np.float32)  # dropped at once
        last = aa.async_wrap(lambda: one * 3, shape=(16,), dtype=np.float32)
        print("sum", float(last.result().sum()))
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["sum", "48.0"]


def test_fork_child_can_submit_and_wait():
    proc = run_script(FORK_SCRIPT, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["child exit 0"] * 5 + ["parent ok"], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# -- signals (GIL release: test_array.py) ----------------------------------------------


# The SIGINT is sent once another thread sees the main thread inside
# wait_here, that is, in (or a bytecode away from) the blocking f.result().
CTRL_C_SCRIPT = """
import signal, sys, threading, time
from async_array import _core

# A process started in the background by a non-interactive shell (make in a
# CI script, say) ignores SIGINT, and an ignored signal stays ignored across
# exec: take Python's own handler back, as an interactive run has it.
signal.signal(signal.SIGINT, signal.default_int_handler)

f = _core.submit(time.sleep, 3600)

def wait_here():
    return f.result()

def announce():
    # Says "waiting" once the main thread is in wait_here, blocked in f.result().
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        if frame is not None and frame.f_code.co_name == "wait_here":
            print("waiting", flush=True)
            return
        threading.Event().wait(0.001)

threading.Thread(target=announce, daemon=True).start()
try:
    wait_here()
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
print("not interrupted", flush=True)
sys.exit(1)
"""


def test_ctrl_c_interrupts_a_long_wait():
    # How fast is not asserted: a wait that ignored SIGINT would last an hour,
    # and the test's own timeout would fail it.
    # The hour-long task is not waited for at exit (no grace): this is about the wait.
    proc = spawn(CTRL_C_SCRIPT, {"ASYNC_ARRAY_EXIT_GRACE": "0"})
    out = LineReader(proc)
    try:
        lines = [out.read("the script to wait")]
        assert lines == ["waiting\n"]
        proc.send_signal(signal.SIGINT)
        lines.append(out.read("the wait to end after SIGINT"))
        proc.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit after SIGINT; the script said {lines}")
    finally:
        err = out.close()
    assert lines[-1] == "interrupted\n", (lines, err)
    assert proc.returncode == 0, err


# -- stress ----------------------------------------------------------------------------


def test_stress_8_threads_20k_futures():
    # Enough to interleave submits, completions and both kinds of wait in
    # every order; the long soak belongs in benches/, not in the unit suite.
    threads_n, per_thread, batch = 8, 2_500, 500
    errors: list[BaseException] = []
    checked = [0] * threads_n

    def run(t):
        try:
            base = t * per_thread
            for start in range(0, per_thread, batch):
                ids = range(base + start, base + start + batch)
                fs = [_core.submit(divmod, i, 7) for i in ids]
                # Half waited one by one, half in one wait_all.
                if start % (2 * batch):
                    assert _core.wait_all(fs, WAIT)
                got = [f.result(WAIT) for f in fs]
                assert got == [divmod(i, 7) for i in ids]
                checked[t] += len(got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # bounded by the test's timeout
    assert not errors, errors[:3]
    assert sum(checked) == threads_n * per_thread


# -- configure --------------------------------------------------------------------------


def test_configure_sets_the_pool_size(pool_size, monkeypatch):
    monkeypatch.delenv(aa._runtime.ENV_MAX_WORKERS, raising=False)
    pool_size(3)
    assert aa.max_workers() == 3
    assert _core.pool_stats()["max_workers"] == 3
    pool_size(None)
    assert (
        aa.max_workers() == min(32, len(os.sched_getaffinity(0)) + 4) == _core.default_max_workers()
    )


@pytest.mark.parametrize(
    ("bad", "error", "detail"),
    [
        (0, ValueError, "from 1 to 65536, got 0"),
        (-1, ValueError, "from 1 to 65536, got -1"),
        (2**64, ValueError, f"from 1 to 65536, got {2**64}"),
        ("3", TypeError, "must be an integer, got str"),
        (2.5, TypeError, "must be an integer, got float"),
    ],
)
def test_configure_rejects_bad_values(pool_size, bad, error, detail):
    pool_size(2)
    with pytest.raises(error, match=r"aa\.configure") as info:
        aa.configure(bad)
    assert detail in str(info.value)
    assert aa.max_workers() == 2, "a refused value leaves the pool as it was"


def test_core_configure_rejects_zero():
    with pytest.raises(ValueError, match="at least 1"):
        _core.configure(0)


def test_env_max_workers_is_the_default():
    proc = run_script(
        """
        import async_array as aa
        print(aa.max_workers())
        aa.configure(5)
        aa.configure()
        print(aa.max_workers())
        """,
        env={"ASYNC_ARRAY_MAX_WORKERS": "3"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "3"]


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "2.5", "100000"])
def test_bad_env_max_workers_is_a_clear_error(raw):
    proc = run_script("import async_array", env={"ASYNC_ARRAY_MAX_WORKERS": raw})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"ValueError: ASYNC_ARRAY_MAX_WORKERS must be from 1 to 65536, got {raw!r}"), (
        proc.stderr
    )


# -- wait_all and Watcher -----------------------------------------------------------------


def test_wait_all_times_out_then_succeeds(pool_size):
    pool_size(4)
    release, held = gate()
    fs = [held, _core.submit(lambda: "quick")]
    # The gate is closed: the only way out of these waits is their timeout.
    assert _core.wait_all(fs, 0.2) is False
    assert _core.wait_all(fs, 0) is False
    release.set()
    assert _core.wait_all(fs, WAIT) is True
    assert [f.result(0) for f in fs] == ["released", "quick"]
    assert _core.wait_all([], 0) is True


def test_wait_all_or_failure_stops_at_the_first_failure():
    fs = [_core.Future() for _ in range(3)]
    assert _core.wait_all_or_failure(fs, 0) == (False, None)
    # Failed from another thread while the wait runs; fs[0] stays pending.
    t = threading.Thread(target=fs[2].set_exception, args=(KeyError("404"),))
    t.start()
    assert _core.wait_all_or_failure(fs, WAIT) == (True, 2)
    t.join()
    assert fs[1].cancel()
    assert _core.wait_all_or_failure(fs, 0) == (True, 1), "the first in list order once known"
    ok = [_core.Future() for _ in range(2)]
    for f in ok:
        f.set_result(None)
    assert _core.wait_all_or_failure(ok, None) == (True, None)
    assert _core.wait_all_or_failure([], 0) == (True, None)


def test_watcher_yields_completion_order(pool_size):
    pool_size(4)
    done_first = _core.submit(lambda: "early")
    assert done_first.wait(WAIT)
    manual = [_core.Future() for _ in range(4)]
    watcher = _core.Watcher([manual[0], done_first, *manual[1:]])
    assert watcher.next(0) == 1, "a future finished before watching comes first"
    assert watcher.next(0) is None
    assert watcher.next(0.05) is None
    order = [3, 0, 2, 1]  # indices into `manual`
    for i in order:
        # Completed from another thread, one at a time.
        t = threading.Thread(target=manual[i].set_result, args=(i,))
        t.start()
        t.join()
    # Watcher indices are positions in the list it was given.
    positions = {0: 0, 1: 2, 2: 3, 3: 4}
    assert [watcher.next(WAIT) for _ in order] == [positions[i] for i in order]
    assert watcher.next(0) is None


def test_watcher_wakes_on_pool_completion(pool_size):
    pool_size(4)
    releases = []
    futures = []
    for _ in range(3):
        release, held = gate()
        releases.append(release)
        futures.append(held)
    watcher = _core.Watcher(futures)
    for i in (2, 0, 1):
        releases[i].set()
        assert watcher.next(WAIT) == i


# -- what a consumer waits on runs first ------------------------------------------------


def test_a_leaf_waited_on_runs_at_once_while_every_worker_is_busy(pool_size):
    # Once a bug: with six 10 s loads in flight, a quick leaf waited on took 10 s.
    pool_size(1)
    slow = [Gate(np.ones(2, np.float32)) for _ in range(3)]
    loads = [gate.leaf() for gate in slow]
    wait_for(slow[0].started, "the first load to hold the only worker")
    quick = aa.async_wrap(lambda: np.full(2, 7, np.float32), shape=(2,), dtype=np.float32)
    # Behind the loads, or waiting for the only worker, this would time out:
    # the first load holds it until its gate opens below.
    assert quick.result(timeout=WAIT).tolist() == [7.0, 7.0]
    assert not any(load.done() for load in loads)
    for gate in slow:
        gate.open()
    assert [float(leaf.result(timeout=WAIT)[0]) for leaf in loads] == [1.0] * 3


def test_urgent_tasks_run_while_every_worker_is_busy(pool_size):
    pool_size(1)
    started, release = threading.Event(), threading.Event()
    held = _core.submit(lambda: (started.set(), release.wait(WAIT))[1])
    wait_for(started, "the only worker to be taken")
    queued = _core.submit(int, "5")
    assert _core.submit_urgent(pow, 2, 10).result(WAIT) == 1024
    assert not queued.done()
    release.set()
    assert (held.result(WAIT), queued.result(WAIT)) == (True, 5)
