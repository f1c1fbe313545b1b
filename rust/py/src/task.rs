//! The Python task: a call `func(*args)` that a pool worker runs attached to
//! the interpreter, batching queued tasks under one hold of the GIL, with
//! `submit` and `submit_many` that queue it, and how a Rust panic in a task
//! becomes its future's error.

use crate::current::{self, CoreFuture, Running};
use crate::error::{Error, TaskError};
use crate::future::PyFuture;
use crate::interp::{call_or_park, park_on_thread_exit};
use crate::runtime::{exiting, pool};
use async_array_core::future::{Outcome, WeakFuture};
use async_array_core::pool::{Abandon, Job, Refusal, SubmitError};
use async_array_core::Error as CoreError;
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
            future.complete(Outcome::Error(TaskError::Core(CoreError::Abandoned)));
        }
    }
}

/// A Python call to run on the pool.
struct PyTask {
    func: Py<PyAny>,
    args: Py<PyTuple>,
    /// How cycle messages name it (see [`current::running`]).
    label: Option<Py<PyAny>>,
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
/// `future` with [`CoreError::Panic`] and the panic's message (a no-op when `body`
/// finished it first). The worker thread lives on.
pub fn fail_on_panic(future: &CoreFuture, body: impl FnOnce()) {
    if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(body)) {
        future.complete(Outcome::Error(TaskError::Core(CoreError::Panic(
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
        let PyTask {
            func,
            args,
            label,
            future,
        } = self;
        if !future.set_running() {
            return;
        }
        let f = future.clone();
        fail_on_panic(&future, move || {
            let running = Running {
                future: &f,
                func: &func,
                args: &args,
                label: label.as_ref(),
                named: RefCell::new(None),
            };
            // Reset when the call returns: a callback that the task's
            // completion runs on this thread waits for itself, not for this task.
            let returned = running.during(|| call_or_park(func.bind(py), args.bind(py), None));
            drop(running);
            let outcome = match returned {
                Ok(v) => Outcome::Value(v.unbind()),
                Err(e) => Outcome::Error(TaskError::from_pyerr(py, e)),
            };
            // Let go of the callable (and what its closure holds) before
            // waking waiters; a destructor may run Python.
            park_on_thread_exit(|| drop((func, args, label)));
            f.complete(outcome);
        });
        current::clear(); // also after a Rust panic
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
                .complete(Outcome::Error(TaskError::Core(CoreError::ShutDown)));
        }
    }

    fn cancel(self: Box<Self>) {
        self.future.cancel();
    }

    fn refuse(self: Box<Self>, why: Refusal) {
        let error = match why {
            Refusal::QueuedAtFork => CoreError::QueuedAtFork,
            Refusal::ThreadStart { error, threads } => CoreError::ThreadStart { error, threads },
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
    label: Option<Py<PyAny>>,
) -> PyResult<PyFuture> {
    let future = CoreFuture::new();
    queue(Box::new(PyTask {
        func,
        args,
        label,
        future: future.clone(),
    }))
    .map_err(|_| Error(CoreError::ShutDown))?;
    Ok(PyFuture::from(future))
}

/// Runs `func(*args)` on the pool; returns its `Future` at once. `label`
/// names the task in `WaitCycleError` messages: a str, or a callable called
/// with the task's args when a message needs it; by default
/// `func.__qualname__`.
#[pyfunction]
#[pyo3(signature = (func, *args, label=None))]
pub fn submit(func: Py<PyAny>, args: Py<PyTuple>, label: Option<Py<PyAny>>) -> PyResult<PyFuture> {
    submit_with(|job| pool().submit(job), func, args, label)
}

/// Runs `func(*args)` on the pool ahead of every task that is not urgent, on
/// a thread beyond `max_workers` if all are busy (an `aa.jit` compile or
/// dispatch must not queue behind loads); returns its `Future` at once.
/// `label` as `submit`'s.
#[pyfunction]
#[pyo3(signature = (func, *args, label=None))]
pub fn submit_urgent(
    func: Py<PyAny>,
    args: Py<PyTuple>,
    label: Option<Py<PyAny>>,
) -> PyResult<PyFuture> {
    submit_with(|job| pool().submit_urgent(job), func, args, label)
}

/// Runs `func(*args)` for each tuple of `args_list` on the pool, queued under
/// one lock; returns their futures, in order, at once. `label` as
/// `submit`'s, shared by every task (a callable gets each task's own args).
#[pyfunction]
#[pyo3(signature = (func, args_list, *, label=None))]
pub fn submit_many(
    py: Python<'_>,
    func: Py<PyAny>,
    args_list: Vec<Py<PyTuple>>,
    label: Option<Py<PyAny>>,
) -> PyResult<Vec<PyFuture>> {
    let mut futures = Vec::with_capacity(args_list.len());
    let mut jobs: Vec<Box<dyn Job>> = Vec::with_capacity(args_list.len());
    for args in args_list {
        let future = CoreFuture::new();
        jobs.push(Box::new(PyTask {
            func: func.clone_ref(py),
            args,
            label: label.as_ref().map(|l| l.clone_ref(py)),
            future: future.clone(),
        }));
        futures.push(PyFuture::from(future));
    }
    pool()
        .submit_all(jobs)
        .map_err(|_| Error(CoreError::ShutDown))?;
    Ok(futures)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panic_of(future: &CoreFuture) -> Option<String> {
        match future.outcome() {
            Some(Outcome::Error(TaskError::Core(CoreError::Panic(msg)))) => Some(msg.clone()),
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
