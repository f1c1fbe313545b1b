//! The task this thread runs: set by a worker around a task's call, read by
//! the waits of `future.rs` for their cycle check. A module of its own so
//! that tasks and futures both depend on it and not on each other.

use crate::error::TaskError;
use crate::interp::call_or_park;
use async_array_core::future::Future;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use std::cell::{Cell, RefCell};
use std::sync::Arc;

/// The core future behind every Python `Future`: a task's return value, or
/// why it failed.
pub type CoreFuture = Future<Py<PyAny>, TaskError>;

/// The task a worker thread runs now: its future and its call, which names it
/// in cycle messages (worked out at its first wait, then kept). It lives on
/// the stack of the task's call while the call runs.
pub struct Running<'a> {
    /// The task's future.
    pub future: &'a CoreFuture,
    /// The called function.
    pub func: &'a Py<PyAny>,
    /// Its positional arguments.
    pub args: &'a Py<PyTuple>,
    /// The `label=` the task was submitted with: a str, or a callable that
    /// makes one from `args`; `None` names it by `func.__qualname__`.
    pub label: Option<&'a Py<PyAny>>,
    /// The label once worked out.
    pub named: RefCell<Option<Arc<str>>>,
}

impl Running<'_> {
    /// Runs `call` as this thread's task: [`running`] sees `self` meanwhile.
    pub fn during<R>(&self, call: impl FnOnce() -> R) -> R {
        RUNNING.with(|r| r.set((self as *const Running<'_>).cast()));
        let out = call();
        RUNNING.with(|r| r.set(std::ptr::null()));
        out
    }
}

/// Forgets this thread's task (after a Rust panic skipped [`Running::during`]'s reset).
pub fn clear() {
    RUNNING.with(|r| r.set(std::ptr::null()));
}

thread_local! {
    /// The [`Running`] of this thread's task, or null: a pointer to the
    /// task's own frame, so that a task pays no reference counting for it.
    static RUNNING: Cell<*const Running<'static>> = const { Cell::new(std::ptr::null()) };
}

/// The future and label of the task this thread runs now; `None` on any thread
/// that runs no task (the main thread, a callback after its task finished).
///
/// The label is the task's `label=`: the str itself, or what the callable
/// returns for the task's args (called here, at the task's first wait, so
/// that submitting many tasks makes no label); without one, the function's
/// `__qualname__`.
pub fn running(py: Python<'_>) -> Option<(CoreFuture, Arc<str>)> {
    let ptr = RUNNING.with(Cell::get);
    if ptr.is_null() {
        return None;
    }
    // SAFETY: a non-null pointer is set only by `Running::during`, to a
    // `Running` on its caller's stack, and reset to null before that frame ends (a forced
    // unwind at exit parks the thread for good, so the frame never ends then).
    // Only this thread reads it.
    let run = unsafe { &*ptr };
    if let Some(label) = run.named.borrow().as_ref() {
        return Some((run.future.clone(), Arc::clone(label)));
    }
    let func = run.func.bind(py);
    // Through `call_or_park`, never pyo3's `call1`: that reaches `PyObject_Call`
    // through pyo3-ffi's `extern "C"` declaration, and with two declarations of
    // one symbol in this code, the task's own call lost its unwind entry (the
    // forced unwind at interpreter exit then aborted the process).
    let named = match run.label.map(|l| l.bind(py)) {
        Some(text) if text.is_instance_of::<PyString>() => text.str(),
        Some(namer) => call_or_park(namer, run.args.bind(py), None).and_then(|l| l.str()),
        None => func.getattr("__qualname__").and_then(|l| l.str()),
    };
    let label: Arc<str> = match named {
        Ok(text) => Arc::from(text.to_string_lossy().as_ref()),
        Err(_) => Arc::from("a task"),
    };
    *run.named.borrow_mut() = Some(Arc::clone(&label));
    Some((run.future.clone(), label))
}
