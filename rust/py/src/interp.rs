//! The rules for touching the interpreter from threads.
//!
//! 1. Every blocking wait reachable from Python goes through [`wait_detached`]:
//!    it detaches from the interpreter (so other Python threads and the
//!    workers run), waits in slices of at most [`SLICE`], and checks for
//!    signals between slices so that Ctrl-C interrupts a wait of any length.
//!    On a pool worker it also tells the pool the worker is blocked, so the
//!    pool can start a stand-in.
//! 2. A worker calls Python only through [`call_or_park`] (or inside
//!    [`park_on_thread_exit`]), never while it holds a core lock.
//!
//! Why rule 2: before Python 3.14, a thread that retakes the GIL while the interpreter
//! finalizes is ended with `pthread_exit`, a forced unwind. Python code inside
//! a task retakes the GIL on its own (after `time.sleep`, a blocking read, an
//! extension that released it), so that unwind can start in any call into
//! Python. Reaching a Rust `catch_unwind` (ours, or the one around every
//! `std::thread`) it aborts the process. [`park_on_thread_exit`] puts a guard
//! on the stack right above the call: its destructor runs during that unwind
//! and parks the thread for good instead, and the process exits as it meant to
//! (pyo3 guards `PyGILState_Ensure` the same way). The call itself must be
//! declared `C-unwind`: see [`call_or_park`].

use crate::error::Error;
use async_array_core::pool::Pool;
use async_array_core::time::timeout_from_secs;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// Longest stretch without a signal check (the contract says Ctrl-C within 100 ms).
pub const SLICE: Duration = Duration::from_millis(50);

/// The deadline of a timeout in seconds as Python gives it (`None`, or one
/// too far to reach: none).
pub fn deadline_after(timeout: Option<f64>) -> Result<Option<Instant>, Error> {
    Ok(timeout_from_secs(timeout)?.and_then(|d| Instant::now().checked_add(d)))
}

/// Calls `attempt(slice_deadline)` detached from the interpreter until it
/// returns `Some`, or until `deadline` passes (then `Ok(None)`). `attempt` must
/// return promptly once its slice deadline passes.
pub fn wait_detached<R: Send>(
    py: Python<'_>,
    pool: &Pool,
    deadline: Option<Instant>,
    mut attempt: impl FnMut(Option<Instant>) -> Option<R> + Send,
) -> PyResult<Option<R>> {
    pool.blocking(|| loop {
        let now = Instant::now();
        let slice_end = match deadline {
            Some(d) if d <= now + SLICE => d,
            _ => now + SLICE,
        };
        if let Some(r) = py.detach(|| attempt(Some(slice_end))) {
            return Ok(Some(r));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    })
}

/// Runs `call` (a call into Python) so that a `pthread_exit` during it parks
/// this thread instead of unwinding further. A Rust panic passes through.
pub fn park_on_thread_exit<R>(call: impl FnOnce() -> R) -> R {
    struct ParkOnForcedUnwind;
    impl Drop for ParkOnForcedUnwind {
        fn drop(&mut self) {
            // A Rust panic sets `panicking`; a foreign forced unwind does not.
            if !std::thread::panicking() {
                loop {
                    std::thread::park();
                }
            }
        }
    }
    let guard = ParkOnForcedUnwind;
    let out = call();
    std::mem::forget(guard);
    out
}

mod unwinding_ffi {
    use pyo3::ffi::PyObject;

    // pyo3-ffi declares it "C": a call that cannot unwind (see `call_or_park`).
    extern "C-unwind" {
        pub fn PyObject_Call(
            callable: *mut PyObject,
            args: *mut PyObject,
            kwargs: *mut PyObject,
        ) -> *mut PyObject;
    }
}

/// Calls `func(*args, **kwargs)` so that a `pthread_exit` inside it parks this
/// thread (see [`park_on_thread_exit`]).
///
/// The guard only sees that unwind if every frame between CPython and it may
/// unwind. A function declared `extern "C"`, as pyo3-ffi declares
/// `PyObject_Call` (and as pyo3's `call1` reaches it), is assumed not to: the
/// unwind aborts the process at that call, before the guard. Hence the
/// `C-unwind` declaration here. Worker code calls Python through this
/// function only: a `call1` next to it brings pyo3-ffi's `extern "C"`
/// declaration of the same symbol into the same code, and the call here then
/// lost its unwind entry too (seen as an abort at interpreter exit).
pub fn call_or_park<'py>(
    func: &Bound<'py, PyAny>,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = kwargs.map_or(std::ptr::null_mut(), |k| k.as_ptr());
    // SAFETY: the thread is attached (the Bound arguments prove it) and every
    // pointer is a live object borrowed for the call.
    let ret = park_on_thread_exit(|| unsafe {
        unwinding_ffi::PyObject_Call(func.as_ptr(), args.as_ptr(), kwargs)
    });
    // SAFETY: PyObject_Call returns a new reference, or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(func.py(), ret) }
}

thread_local! {
    /// The thread state a worker keeps while detached, and its GIL-state token.
    static PERSISTENT: Cell<Option<(*mut ffi::PyThreadState, ffi::PyGILState_STATE)>> =
        const { Cell::new(None) };
}

/// Worker start hook: gives this thread a Python thread state for its lifetime.
///
/// Without one, every `Python::attach` creates a thread state and deletes it
/// again (tens of microseconds a task), and Python thread-local state (context
/// variables, JAX's thread-local configuration) is rebuilt for every task.
pub fn keep_thread_state() {
    // SAFETY: the interpreter is initialized (the pool is started from Python);
    // PyGILState_Ensure makes this thread's state and takes the GIL, and
    // PyEval_SaveThread releases the GIL while keeping that state.
    unsafe {
        if ffi::Py_IsInitialized() == 0 {
            return;
        }
        let token = park_on_thread_exit(|| ffi::PyGILState_Ensure());
        let tstate = ffi::PyEval_SaveThread();
        PERSISTENT.with(|p| p.set(Some((tstate, token))));
    }
}

/// Worker retire hook: deletes the thread state `keep_thread_state` made.
pub fn drop_thread_state() {
    if let Some((tstate, token)) = PERSISTENT.with(|p| p.take()) {
        // SAFETY: the state and token come from `keep_thread_state` on this
        // thread, which holds no GIL now; restoring then releasing deletes it.
        unsafe {
            if ffi::Py_IsInitialized() == 0 {
                return;
            }
            park_on_thread_exit(|| ffi::PyEval_RestoreThread(tstate));
            ffi::PyGILState_Release(token);
        }
    }
}
