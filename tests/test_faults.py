"""Reliability under faults: nothing leaks, nothing hangs without a
way out, every failure names its cause."""

from __future__ import annotations

import gc
import http.server
import os
import signal
import subprocess
import threading
import weakref

import jax
import numpy as np
import pytest
from conftest import WAIT, Gate, kill_group, poll_until, run_script, spawn, wait_for

import async_array as aa

F32 = np.float32
SPEC = jax.ShapeDtypeStruct((2,), F32)
FAILURES = 2000


def _broken() -> None:
    raise ValueError("404: the weights are gone")


def _broken_map(path, spec) -> None:
    raise ValueError("404: the weights are gone")


def _broken_stream():
    raise ValueError("404: the weights are gone")
    yield  # a generator


MAKERS = {
    "async_wrap": lambda: aa.async_wrap(_broken, shape=(2,), dtype=F32),
    "async_map": lambda: aa.async_map(_broken_map, {"w": SPEC})["w"],
    "async_stream": lambda: aa.async_stream(_broken_stream, {"w": SPEC})["w"],
    "validation": lambda: aa.async_wrap(lambda: np.zeros(3, F32), shape=(2,), dtype=F32),
}


class CallerLocal:
    """Stands for a caller's large local: it lives in the frame that the
    raised exception's traceback holds."""


def _raise_and_swallow(make) -> tuple[weakref.ref, weakref.ref]:
    local = CallerLocal()
    leaf = make()
    try:
        leaf.result(timeout=WAIT)
    except (ValueError, TypeError):
        pass
    else:
        raise AssertionError("the leaf did not fail")
    return weakref.ref(leaf), weakref.ref(local)


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_failed_leaves_whose_exception_was_raised_are_freed(make):
    refs = [_raise_and_swallow(make) for _ in range(FAILURES)]

    def alive() -> tuple[int, int]:
        gc.collect()
        return sum(r() is not None for r, _ in refs), sum(r() is not None for _, r in refs)

    # A worker lets go of its last future a moment after finishing it.
    poll_until(lambda: alive() == (0, 0), "the failed leaves to be freed", tries=500)
    assert alive() == (0, 0)


# -- a pool that cannot start threads ---------------------------------------------------

THREAD_LIMIT_SCRIPT = """
import resource, threading
import jax
import numpy as np
import async_array as aa

jax.numpy.zeros(1).block_until_ready()  # JAX's own threads start before the cap
aa.configure(max_workers=1)
# Room for a few more 64 MiB thread stacks (RUST_MIN_STACK) and no more: thread
# creation fails, as under a container's pid or memory limit, while small
# allocations still succeed.
status = open("/proc/self/status").read().splitlines()
vm_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, ((vm_kb << 10) + (512 << 20), resource.RLIM_INFINITY))

N = 3000
start = threading.Event()
leaves = []

def task(k):
    def f():
        assert start.wait(120)
        if k + 1 < N:
            leaves[k + 1].result(timeout=120)  # each waits on a leaf queued behind it
        return np.zeros(1, np.float32)
    return f

leaves.extend(aa.async_wrap(task(k), shape=(1,), dtype=np.float32) for k in range(N))
start.set()
exc = leaves[0].exception(timeout=120)
print(type(exc).__name__, exc, flush=True)
"""


def test_a_pool_that_cannot_start_threads_fails_the_waits_instead_of_hanging():
    env = {"RUST_MIN_STACK": str(64 << 20), "MALLOC_ARENA_MAX": "1"}
    proc = run_script(THREAD_LIMIT_SCRIPT, env=env, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "RuntimeError async_array: the pool could not start a thread ("
    ), proc.stdout + proc.stderr
    assert "blocked waiting on queued work" in proc.stdout


# -- fork ----------------------------------------------------------------------------

FORK_HANDOFF_SCRIPT = """
import os, signal, sys, threading, warnings
warnings.filterwarnings("ignore", message=".*fork.*")
import numpy as np
import async_array as aa

ready = aa.async_wrap(lambda: np.arange(4, dtype=np.float32), shape=(4,), dtype=np.float32)
assert ready.result(30).tolist() == [0, 1, 2, 3]
stop = threading.Event()

def hand_off():
    # Workers keep handing results to JAX (device puts) while main forks.
    while not stop.is_set():
        leaves = [
            aa.async_wrap(lambda: np.ones(256, np.float32), shape=(256,), dtype=np.float32)
            for _ in range(8)
        ]
        aa.materialize(leaves, timeout=30)

threads = [threading.Thread(target=hand_off) for _ in range(2)]
for t in threads:
    t.start()
for _ in range(FORKS):
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a hung child dies (SIGALRM) instead of outliving the test
        os._exit(0 if ready.result(10).shape == (4,) else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        print("child", os.waitstatus_to_exitcode(status), flush=True)
stop.set()
for t in threads:
    t.join()
print("parent ok", flush=True)
"""


def test_forks_while_workers_hand_off_to_jax_never_hang():
    proc = run_script(f"FORKS = 40\n{FORK_HANDOFF_SCRIPT}", timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["parent ok"], proc.stdout + proc.stderr


QUEUED_AT_FORK_SCRIPT = """
import os, signal, sys, threading, warnings
warnings.filterwarnings("ignore", message=".*fork.*")
import numpy as np
import async_array as aa

aa.configure(max_workers=1)
release = threading.Event()
started = threading.Event()
runs = []

def hold():
    started.set()
    assert release.wait(30)
    return np.zeros(1, np.float32)

def load(i):
    def f():
        runs.append((os.getpid(), i))
        return np.full(1, i, np.float32)
    return f

running = aa.async_wrap(hold, shape=(1,), dtype=np.float32)
assert started.wait(30)
queued = [aa.async_wrap(load(i), shape=(1,), dtype=np.float32) for i in range(10)]
pid = os.fork()
if pid == 0:
    signal.alarm(60)
    errors = [str(leaf.exception(timeout=30)) for leaf in [running, *queued]]
    ok = all("os.fork()" in e for e in errors) and "queued in the parent" in errors[1]
    # New work runs here; what was queued never ran here.
    ok = ok and aa._core.submit(pow, 3, 2).result(30) == 9 and runs == []
    sys.stdout.write(f"child {ok} {errors[1]}\\n")
    sys.stdout.flush()
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
release.set()
print([float(leaf.result(30)[0]) for leaf in queued], flush=True)
code = os.waitstatus_to_exitcode(status)
print("parent runs", sorted(i for _, i in runs), "child", code, flush=True)
"""


def test_tasks_queued_at_fork_run_in_the_parent_only():
    proc = run_script(QUEUED_AT_FORK_SCRIPT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    child, values, parent = proc.stdout.splitlines()
    assert child.startswith("child True async_array: this task was queued in the parent"), child
    assert values == str([float(i) for i in range(10)])
    assert parent == f"parent runs {list(range(10))} child 0"


# -- interpreter exit -------------------------------------------------------------------


def assert_exited_cleanly(proc: subprocess.CompletedProcess, code: int) -> None:
    """The child exited with ``code``: no abort, no fatal error, no traceback."""
    for bad in ("terminate called", "FATAL", "Fatal Python error", "Aborted", "Traceback"):
        assert bad not in proc.stderr, proc.stderr
    assert proc.returncode == code, proc.stderr


EXIT_INSIDE_JAX_SCRIPT = """
import sys, threading
import jax.numpy as jnp
import numpy as np
import async_array as aa

inside = threading.Event()

def f():  # a loader that computes with JAX: exit comes while it is inside XLA
    a = jnp.ones((384, 384), jnp.float32)
    for _ in range(60):
        a = (a @ a) / 384.0
        a.block_until_ready()
        inside.set()
    return np.asarray(a)

leaf = aa.async_wrap(f, shape=(384, 384), dtype=np.float32)
assert inside.wait(60)
sys.exit(3)
"""


def test_exit_while_a_task_is_inside_jax_keeps_the_exit_code():
    proc = run_script(EXIT_INSIDE_JAX_SCRIPT, timeout=120)
    assert_exited_cleanly(proc, 3)


EXIT_DURING_A_COMPILE_SCRIPT = """
import sys, threading
import jax.numpy as jnp
import numpy as np
import async_array as aa
from async_array import _jit

lowered_now = threading.Event()

def compile_observed(traced, context):  # as _jit._compile, with a gate between lower and compile
    with context:
        lowered = traced.lower()
        lowered_now.set()
        return lowered.compile()

_jit._compile = compile_observed

def model(x):  # unrolled, so that XLA's compile outlasts the exit
    for i in range(80):
        x = jnp.sin(x @ x.T + i) * 0.5
    return x.sum()

x = aa.async_wrap(lambda: np.ones((64, 64), np.float32), shape=(64, 64), dtype=np.float32)
y = aa.jit(model)(x)
assert lowered_now.wait(60)
sys.exit(3)
"""


def test_exit_during_a_compile_longer_than_the_grace_waits_for_it():
    # A grace of 0 s: every compile outlasts it. Before, exit went on, and a
    # compile that ended during finalization aborted the process (1 run in 10).
    proc = run_script(
        EXIT_DURING_A_COMPILE_SCRIPT, env={"ASYNC_ARRAY_EXIT_GRACE": "0"}, timeout=120
    )
    assert_exited_cleanly(proc, 3)
    assert "async_array: exit waits for 1 piece(s) of work inside JAX" in proc.stderr


EXIT_AS_A_TASK_FREES_ITS_VALUE_SCRIPT = """
import contextlib, sys, threading
import jax
import numpy as np
import async_array as aa
from async_array import _wrap

converting = threading.Event()
_paused_gc = _wrap.paused_gc

@contextlib.contextmanager
def observed():  # as _wrap.paused_gc, telling when the hand-off to JAX starts
    converting.set()
    with _paused_gc():
        yield

_wrap.paused_gc = observed
n = 200_000
like = {f"w{i}": jax.ShapeDtypeStruct((16,), np.float32) for i in range(n)}
values = {k: np.ones((16,), np.float32) for k in like}
tree = aa.async_wrap(lambda: values, like=like)
del tree  # the task alone holds its value now: the worker frees 200k jax.Arrays
assert converting.wait(60)
sys.exit(3)
"""


def test_exit_while_a_task_frees_its_jax_arrays_keeps_the_exit_code():
    # Freeing a jax.Array enters JAX's C++; a worker doing so when
    # finalization began was ended there and aborted the process (3 of 3).
    proc = run_script(
        EXIT_AS_A_TASK_FREES_ITS_VALUE_SCRIPT, env={"ASYNC_ARRAY_EXIT_GRACE": "0"}, timeout=120
    )
    assert_exited_cleanly(proc, 3)


EXIT_WITH_A_TASK_ASLEEP_SCRIPT = """
import signal, sys, threading
import numpy as np
import async_array as aa

# Started in the background by a non-interactive shell (make in a CI script),
# a process ignores SIGINT, and so would this one (ignored signals stay
# ignored across exec): Python's own handler, as an interactive run has it.
signal.signal(signal.SIGINT, signal.default_int_handler)

started, never = threading.Event(), threading.Event()

def f():  # a loader blocked on a socket, say
    started.set()
    never.wait()

leaf = aa.async_wrap(f, shape=(2,), dtype=np.float32)
assert started.wait(60)
sys.exit(5)
"""


def test_exit_says_why_it_waits_for_a_running_task():
    proc = run_script(EXIT_WITH_A_TASK_ASLEEP_SCRIPT, env={"ASYNC_ARRAY_EXIT_GRACE": "2"})
    assert_exited_cleanly(proc, 5)
    assert "async_array: exit waits up to 2 s ($ASYNC_ARRAY_EXIT_GRACE) for the pool's" in (
        proc.stderr
    )


def test_a_second_ctrl_c_during_the_exit_wait_leaves_without_a_traceback():
    proc = spawn(EXIT_WITH_A_TASK_ASLEEP_SCRIPT, env={"ASYNC_ARRAY_EXIT_GRACE": "3600"})
    try:
        said = threading.Event()
        lines: list[str] = []

        def read_stderr():
            for line in proc.stderr:
                lines.append(line)
                if "exit waits up to" in line:
                    said.set()

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        assert said.wait(WAIT), "".join(lines)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(WAIT) == 128 + signal.SIGINT
        reader.join(WAIT)
    finally:
        kill_group(proc)
        proc.stdout.close()
        proc.stderr.close()
    text = "".join(lines)
    assert "exit interrupted; leaving without waiting for the pool's tasks" in text, text
    for bad in ("Traceback", "Exception ignored", "FATAL", "Fatal Python error"):
        assert bad not in text, text


THREAD_LOCALS_AT_EXIT_SCRIPT = """
import http.client, sys, threading
import jax
import jax.numpy as jnp
import numpy as np
import async_array as aa

local = threading.local()

def load(path, spec):  # a keep-alive connection and a jax.Array per pool thread
    if getattr(local, "conn", None) is None:
        local.conn = http.client.HTTPConnection("127.0.0.1", PORT)
    local.conn.request("GET", "/")
    data = local.conn.getresponse().read()
    local.array = jnp.asarray(np.frombuffer(data, np.float32))
    return np.frombuffer(data, np.float32)[: spec.shape[0]].copy()

like = [jax.ShapeDtypeStruct((256,), np.float32)] * 64
assert len(aa.materialize(aa.async_map(load, like), 60)) == 64
sys.exit(7)
"""


def test_what_pool_threads_keep_in_threading_local_never_aborts_the_exit():
    body = np.arange(1024, dtype=F32).tobytes()

    class Blob(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blob)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # It aborted 1 run in 4 ("FATAL: exception not rethrown"): five in a row.
        for _ in range(5):
            port = server.server_address[1]
            proc = run_script(f"PORT = {port}\n" + THREAD_LOCALS_AT_EXIT_SCRIPT)
            assert_exited_cleanly(proc, 7)
    finally:
        server.shutdown()
        server.server_close()


def test_a_bad_exit_grace_fails_at_import():
    proc = run_script("import async_array", env={"ASYNC_ARRAY_EXIT_GRACE": "soon"})
    assert proc.returncode == 1
    assert "ASYNC_ARRAY_EXIT_GRACE must be a number of seconds >= 0, got 'soon'" in proc.stderr


# -- Ctrl-C ---------------------------------------------------------------------------


def test_an_async_map_interrupted_while_making_its_leaves_runs_and_logs_nothing(
    monkeypatch, pool_size, async_array_log
):
    # Ctrl-C while 300k leaves were made: each pending leaf dropped by the
    # raise set up a check for an unretrieved failure (0.3 s before the
    # KeyboardInterrupt reached the user), and all 300k loads still ran.
    from async_array import _multiprocess

    pool_size(1)
    holder = Gate(np.zeros(2, F32))
    held = holder.leaf()
    wait_for(holder.started, "the only worker to be taken")
    ran = []

    def interrupted(specs, sources):
        raise KeyboardInterrupt  # once every leaf is made

    monkeypatch.setattr(_multiprocess, "track", interrupted)
    with pytest.raises(KeyboardInterrupt):
        aa.async_map(lambda path, spec: ran.append(path) or _broken(), [SPEC] * 100)
    monkeypatch.undo()
    gc.collect()
    holder.open()
    assert held.result(timeout=WAIT).tolist() == [0.0, 0.0]
    after = aa.async_map(lambda path, spec: np.ones(2, F32), [SPEC])
    assert aa.materialize(after)[0].tolist() == [1.0, 1.0]  # behind the cancelled ones
    assert ran == []
    assert async_array_log.records == []


@pytest.mark.parametrize("leaves", [1_000, 20_000])
def test_a_bulk_window_hands_its_objects_to_the_oldest_generation(leaves):
    # The next young collection would walk all of them with the GIL held
    # (0.2-0.6 s for 300k leaves, and a Ctrl-C waits for it); 1k leaves are
    # above the young generation's threshold (700) too.
    gc.collect()
    tree = aa.async_map(lambda path, spec: np.ones(2, F32), [SPEC] * leaves)
    oldest = {id(obj) for obj in gc.get_objects(generation=2)}
    assert sum(id(leaf) in oldest for leaf in tree) == leaves
    assert gc.isenabled()
    assert aa.materialize(tree)[-1].tolist() == [1.0, 1.0]


def test_a_small_window_leaves_its_objects_young():
    # Below the young generation's threshold nothing is due: no splice.
    gc.collect()
    tree = aa.async_map(lambda path, spec: np.ones(2, F32), [SPEC] * 10)
    young = {id(obj) for obj in gc.get_objects(generation=0)}
    assert sum(id(leaf) in young for leaf in tree) == 10
    assert aa.materialize(tree)[-1].tolist() == [1.0, 1.0]


def test_a_program_that_froze_objects_keeps_them_frozen():
    # Checked on objects of its own: the freeze count also drops when other
    # threads free frozen objects that earlier tests left behind.
    mine = [[i] for i in range(1000)]
    gc.freeze()
    try:
        tree = aa.async_map(lambda path, spec: np.ones(2, F32), [SPEC] * 20_000)
        assert len(aa.materialize(tree)) == 20_000
        # A frozen object is in no generation, so gc.get_objects() omits it.
        thawed = {id(o) for o in mine} & {id(o) for o in gc.get_objects()}
        assert not thawed, f"{len(thawed)} of 1000 frozen objects were unfrozen"
    finally:
        gc.unfreeze()
    assert len({id(o) for o in mine} & {id(o) for o in gc.get_objects()}) == 1000


# -- bad input fails at the call, naming it ---------------------------------------------


def test_a_shape_with_more_elements_than_int64_counts_is_refused_at_the_call():
    with pytest.raises(
        ValueError, match=r"async_wrap\(.*\): shape \(1099511627776, 1099511627776\)"
    ):
        aa.async_wrap(_broken, shape=(2**40, 2**40), dtype=F32)
    with pytest.raises(ValueError, match=r"aa.empty: shape \(9223372036854775808,\) has more"):
        aa.empty((2**63,), np.int8)


def test_a_void_dtype_is_refused_at_the_call():
    with pytest.raises(
        TypeError,
        match=r"async_wrap\(.*\): dtype \|V8 is not a JAX array dtype \(expected bool, an integer, "
        r"float or complex type, or one of ml_dtypes' such as bfloat16",
    ):
        aa.async_wrap(_broken, shape=(2,), dtype="V8")


def test_an_async_map_fn_of_the_wrong_arity_is_refused_at_the_call():
    with pytest.raises(TypeError, match=r"async_map: fn must take \(key_path, spec\), got .*\(k\)"):
        aa.async_map(lambda k: np.zeros(2, F32), {"w": SPEC})


def test_a_stream_key_path_that_is_not_a_key_path_is_named(caplog):
    leaves = aa.async_stream(
        lambda: iter([(0, np.zeros(2, F32)), ((jax.tree_util.SequenceKey(1),), np.ones(2, F32))]),
        [SPEC, SPEC],
    )
    assert leaves[1].result(timeout=WAIT).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"unknown key paths 0 \(int, not a key path\)"):
        leaves[0].result(timeout=WAIT)
    assert "yielded key path 0 (int, not a key path)" in caplog.text


class KeywordOnlyError(Exception):
    def __init__(self, *, url: str) -> None:
        super().__init__(f"404: {url}")
        self.url = url


def test_notes_of_an_exception_that_copy_cannot_make_stay_per_leaf():
    def fails():
        raise KeywordOnlyError(url="https://example.com/w.bin")

    tree = aa.async_wrap(fails, like={"a": SPEC, "b": SPEC})
    raised = {}
    for key in "ab":
        with pytest.raises(KeywordOnlyError) as info:
            tree[key].result(timeout=WAIT)
        raised[key] = info.value
    assert raised["a"].url == raised["b"].url == "https://example.com/w.bin"
    assert [n.rsplit(" ", 1)[-1] for n in raised["a"].__notes__] == ["['a']"]
    assert [n.rsplit(" ", 1)[-1] for n in raised["b"].__notes__] == ["['b']"]


def test_many_distinct_shapes_keep_a_bounded_number_of_avals():
    n = 6000
    like = {i: jax.ShapeDtypeStruct((i + 1,), F32) for i in range(n)}
    leaves = aa.async_wrap(lambda: {i: np.zeros(i + 1, F32) for i in range(n)}, like=like)
    assert not aa.wait(leaves, timeout=WAIT).not_done
    del leaves, like
    gc.collect()
    avals = sum(type(o).__name__ == "ShapedArray" for o in gc.get_objects())
    assert avals < n
