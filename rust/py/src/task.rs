//! The Python task: a call `func(*args)` that a pool worker runs attached to
//! the interpreter, batching queued tasks under one hold of the GIL, with
//! `submit` and `submit_many` that queue it, and how a Rust panic in a task
//! becomes its future's error.

use crate::attach::{call_or_park, park_on_thread_exit};
use crate::error::{Error, TaskError};
use crate::future::{Outcome, WeakFuture};
use crate::pool::{Abandon, Job, Refusal, SubmitError};
use crate::pyfuture::{CoreFuture, PyFuture};
use crate::runtime::{exiting, pool};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Fails a future whose worker vanished (the fork child has no such thread).
/// Weak: the pool keeps these for running jobs and drops them under its lock,
/// where freeing a future's value (Python objects) could deadlock on the GIL.
struct AbandonFuture(WeakFuture<Py<PyAny>, TaskError>);

impl Abandon for AbandonFuture {
    fn abandon(&self) {
        if let Some(future) = self.0.upgrade() {
            future.complete(Outcome::Error(TaskError::Core(Error::Abandoned)));
        }
    }
}

/// The task a worker thread runs now: its future and its call, which names it
/// in cycle messages (worked out at its first wait, then kept). It lives on
/// the stack of [`PyTask::call`] while the call runs.
struct Running<'a> {
    future: &'a CoreFuture,
    func: &'a Py<PyAny>,
    args: &'a Py<PyTuple>,
    label: RefCell<Option<Arc<str>>>,
}

thread_local! {
    /// The [`Running`] of this thread's task, or null: a pointer to the
    /// task's own frame, so that a task pays no reference counting for it.
    static RUNNING: Cell<*const Running<'static>> = const { Cell::new(std::ptr::null()) };
}

/// The future and label of the task this thread runs now; `None` on any thread
/// that runs no task (the main thread, a callback after its task finished).
///
/// The label is `func.task_label(*args)` when the task's function has that
/// attribute (how `async_wrap`'s and its kin's runners name their call), else
/// the function's `__qualname__`.
pub fn running(py: Python<'_>) -> Option<(CoreFuture, Arc<str>)> {
    let ptr = RUNNING.with(Cell::get);
    if ptr.is_null() {
        return None;
    }
    // SAFETY: a non-null pointer is set only by `PyTask::call`, to a `Running`
    // on its own stack, and reset to null before that frame ends (a forced
    // unwind at exit parks the thread for good, so the frame never ends then).
    // Only this thread reads it.
    let run = unsafe { &*ptr };
    if let Some(label) = run.label.borrow().as_ref() {
        return Some((run.future.clone(), Arc::clone(label)));
    }
    let func = run.func.bind(py);
    // Through `call_or_park`, never pyo3's `call1`: that reaches `PyObject_Call`
    // through pyo3-ffi's `extern "C"` declaration, and with two declarations of
    // one symbol in this code, the task's own call lost its unwind entry (the
    // forced unwind at interpreter exit then aborted the process).
    let named = match func.getattr("task_label") {
        Ok(namer) => call_or_park(&namer, run.args.bind(py), None).and_then(|l| l.str()),
        Err(_) => func.getattr("__qualname__").and_then(|l| l.str()),
    };
    let label: Arc<str> = match named {
        Ok(text) => Arc::from(text.to_string_lossy().as_ref()),
        Err(_) => Arc::from("a task"),
    };
    *run.label.borrow_mut() = Some(Arc::clone(&label));
    Some((run.future.clone(), label))
}

/// A Python call to run on the pool.
struct PyTask {
    func: Py<PyAny>,
    args: Py<PyTuple>,
    future: CoreFuture,
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Runs `body`, which finishes `future` itself; if it panics instead, fails
/// `future` with [`Error::Panic`] and the panic's message (a no-op when `body`
/// finished it first). The worker thread lives on.
fn fail_on_panic(future: &CoreFuture, body: impl FnOnce()) {
    if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(body)) {
        future.complete(Outcome::Error(TaskError::Core(Error::Panic(
            panic_message(&*payload),
        ))));
    }
}

/// How long a worker that holds the GIL keeps running queued Python tasks
/// before it lets the GIL go: fewer hand-offs of the GIL between threads (each
/// costs a wake-up) for many short tasks, and no thread holds it for long.
const BATCH: Duration = Duration::from_millis(2);

thread_local! {
    static IN_BATCH: Cell<bool> = const { Cell::new(false) };
}

impl PyTask {
    /// Runs the call, attached, and finishes the future with what it gave.
    fn call(self, py: Python<'_>) {
        let PyTask { func, args, future } = self;
        if !future.set_running() {
            return;
        }
        let f = future.clone();
        fail_on_panic(&future, move || {
            let running = Running {
                future: &f,
                func: &func,
                args: &args,
                label: RefCell::new(None),
            };
            RUNNING.with(|r| r.set((&raw const running).cast()));
            let returned = call_or_park(func.bind(py), args.bind(py), None);
            // The task's own waits are over: a callback that its completion
            // runs on this thread waits for itself, not for this task.
            RUNNING.with(|r| r.set(std::ptr::null()));
            drop(running);
            let outcome = match returned {
                Ok(v) => Outcome::Value(v.unbind()),
                Err(e) => Outcome::Error(TaskError::from_pyerr(py, e)),
            };
            // Let go of the callable (and what its closure holds) before
            // waking waiters; a destructor may run Python.
            park_on_thread_exit(|| drop((func, args)));
            f.complete(outcome);
        });
        RUNNING.with(|r| r.set(std::ptr::null())); // also after a Rust panic
        if exiting() && future.is_sole_handle() {
            // The value would be freed here, and freeing jax.Arrays enters
            // JAX's C++, where a thread that finalization ends aborts the
            // process (seen with 300k leaves freed as exit began). The
            // process is ending: its memory goes with it.
            std::mem::forget(future);
        }
    }
}

impl Job for PyTask {
    fn run(self: Box<Self>) {
        if IN_BATCH.with(|b| b.get()) {
            // Taken by the batch below on this thread: already attached.
            return Python::attach(|py| self.call(py));
        }
        // Not a clone of the future kept across the batch: a batch may run
        // for as long as the tasks it takes block, and this task's value
        // must be freed as soon as its leaves are.
        let mut task = Some(self);
        let attached = Python::try_attach(|py| {
            if let Some(task) = task.take() {
                task.call(py);
            }
            IN_BATCH.with(|b| b.set(true));
            let until = Instant::now() + BATCH;
            while Instant::now() < until {
                match pool().try_pop() {
                    Some(job) => job.run(),
                    None => break,
                }
            }
            IN_BATCH.with(|b| b.set(false));
        });
        if let (None, Some(task)) = (attached, task) {
            // The interpreter is finalizing: no Python can run any more.
            task.future
                .complete(Outcome::Error(TaskError::Core(Error::ShutDown)));
        }
    }

    fn cancel(self: Box<Self>) {
        self.future.cancel();
    }

    fn refuse(self: Box<Self>, why: Refusal) {
        let error = match why {
            Refusal::QueuedAtFork => Error::QueuedAtFork,
            Refusal::ThreadStart { error, threads } => Error::ThreadStart { error, threads },
        };
        self.future.complete(Outcome::Error(TaskError::Core(error)));
    }

    fn abandon_handle(&self) -> Option<Arc<dyn Abandon>> {
        Some(Arc::new(AbandonFuture(self.future.downgrade())))
    }

    fn key(&self) -> usize {
        self.future.id()
    }
}

/// Queues `func(*args)` with `queue` (`Pool::submit` or `Pool::submit_urgent`);
/// its `Future` at once.
fn submit_with(
    queue: impl FnOnce(Box<dyn Job>) -> Result<(), SubmitError>,
    func: Py<PyAny>,
    args: Py<PyTuple>,
) -> PyResult<PyFuture> {
    let future = CoreFuture::new();
    queue(Box::new(PyTask {
        func,
        args,
        future: future.clone(),
    }))
    .map_err(|_| Error::ShutDown)?;
    Ok(PyFuture::from(future))
}

/// Runs `func(*args)` on the pool; returns its `Future` at once.
#[pyfunction]
#[pyo3(signature = (func, *args))]
pub fn submit(func: Py<PyAny>, args: Py<PyTuple>) -> PyResult<PyFuture> {
    submit_with(|job| pool().submit(job), func, args)
}

/// Runs `func(*args)` on the pool ahead of every task that is not urgent, on
/// a thread beyond `max_workers` if all are busy (an `aa.jit` compile or
/// dispatch must not queue behind loads); returns its `Future` at once.
#[pyfunction]
#[pyo3(signature = (func, *args))]
pub fn submit_urgent(func: Py<PyAny>, args: Py<PyTuple>) -> PyResult<PyFuture> {
    submit_with(|job| pool().submit_urgent(job), func, args)
}

/// Runs `func(*args)` for each tuple of `args_list` on the pool, queued under
/// one lock; returns their futures, in order, at once.
#[pyfunction]
pub fn submit_many(
    py: Python<'_>,
    func: Py<PyAny>,
    args_list: Vec<Py<PyTuple>>,
) -> PyResult<Vec<PyFuture>> {
    let mut futures = Vec::with_capacity(args_list.len());
    let mut jobs: Vec<Box<dyn Job>> = Vec::with_capacity(args_list.len());
    for args in args_list {
        let future = CoreFuture::new();
        jobs.push(Box::new(PyTask {
            func: func.clone_ref(py),
            args,
            future: future.clone(),
        }));
        futures.push(PyFuture::from(future));
    }
    pool().submit_all(jobs).map_err(|_| Error::ShutDown)?;
    Ok(futures)
}

/// A task that panics in Rust, to test that a panic reaches Python as an
/// ordinary `RuntimeError` (through the same [`fail_on_panic`] as every
/// Python task) and leaves the worker alive.
#[pyfunction]
pub fn _submit_rust_panic(message: String) -> PyResult<PyFuture> {
    struct PanicTask(String, CoreFuture);
    impl Job for PanicTask {
        fn run(self: Box<Self>) {
            let PanicTask(message, future) = *self;
            future.set_running();
            // Silence only this thread's panic message: swapping the global
            // hook for the duration raced with other threads (two such tasks
            // at once could leave every later panic silent).
            static QUIET_HOOK: std::sync::Once = std::sync::Once::new();
            thread_local! {
                static QUIET: Cell<bool> = const { Cell::new(false) };
            }
            QUIET_HOOK.call_once(|| {
                let previous = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    if !QUIET.with(Cell::get) {
                        previous(info);
                    }
                }));
            });
            QUIET.with(|q| q.set(true));
            fail_on_panic(&future, move || panic!("{message}"));
            QUIET.with(|q| q.set(false));
        }
        fn cancel(self: Box<Self>) {
            self.1.cancel();
        }
    }
    let future = CoreFuture::new();
    pool()
        .submit(Box::new(PanicTask(message, future.clone())))
        .map_err(|_| Error::ShutDown)?;
    Ok(PyFuture::from(future))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panic_of(future: &CoreFuture) -> Option<String> {
        match future.outcome() {
            Some(Outcome::Error(TaskError::Core(Error::Panic(msg)))) => Some(msg.clone()),
            _ => None,
        }
    }

    #[test]
    fn a_panic_fails_the_future_with_its_message() {
        let future = CoreFuture::new();
        fail_on_panic(&future, || panic!("task {} broke", 7));
        assert_eq!(panic_of(&future).as_deref(), Some("task 7 broke"));
        let future = CoreFuture::new();
        fail_on_panic(&future, || std::panic::panic_any(3u8));
        assert_eq!(panic_of(&future).as_deref(), Some("(no message)"));
    }

    #[test]
    fn a_body_that_finishes_its_future_keeps_its_outcome() {
        let future = CoreFuture::new();
        let f = future.clone();
        fail_on_panic(&future, move || {
            f.complete(Outcome::Cancelled);
        });
        assert!(matches!(future.outcome(), Some(Outcome::Cancelled)));
    }
}
