//! Python bindings of the pool and futures: `submit`, `Future`, `wait_all`,
//! `Watcher`, `configure`, and the interpreter-exit and fork hooks.

use crate::attach::{call_or_park, drop_thread_state, keep_thread_state, park_on_thread_exit};
use crate::error::{Error, TaskError};
use crate::future::{self, CompletionQueue, Outcome, Status};
use crate::pool::{Abandon, ForkGuard, Job, Pool, ThreadHooks};
use crate::wait::{deadline_after, wait_detached};
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTraceback, PyTuple};
use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

type CoreFuture = future::Future<Py<PyAny>, TaskError>;

static POOL: OnceLock<Pool> = OnceLock::new();

/// The process-wide pool; `configure` resizes it.
pub fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        install_fork_handlers();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let hooks = ThreadHooks {
            start: Some(keep_thread_state),
            stop: Some(drop_thread_state),
        };
        Pool::with_hooks("async-array", (cpus + 4).min(32), hooks)
    })
}

/// A handle to one task's result, shaped like `concurrent.futures.Future`.
/// Every wait releases the GIL and checks for signals every 50 ms.
#[pyclass(frozen, name = "Future", module = "async_array._core")]
pub struct PyFuture {
    inner: CoreFuture,
}

impl PyFuture {
    fn timed_wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if self.inner.is_finished() {
            return Ok(true);
        }
        let deadline = deadline_after(timeout)?;
        let f = &self.inner;
        Ok(wait_detached(py, pool(), deadline, |slice| {
            f.wait_until(slice).then_some(())
        })?
        .is_some())
    }

    fn finished_or_timeout(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<&Outcome<Py<PyAny>, TaskError>> {
        if !self.timed_wait(py, timeout)? {
            return Err(PyTimeoutError::new_err(format!(
                "async_array: task not finished after {} s",
                timeout.unwrap_or_default()
            )));
        }
        Ok(self.inner.outcome().expect("finished"))
    }
}

#[pymethods]
impl PyFuture {
    /// A pending future that Python completes with `set_result` or
    /// `set_exception` (for results produced inside another task).
    #[new]
    fn new() -> Self {
        PyFuture {
            inner: CoreFuture::new(),
        }
    }

    /// Completes the future with `value`; False if it had already finished.
    fn set_result(&self, value: Py<PyAny>) -> bool {
        self.inner.complete(Outcome::Value(value))
    }

    /// Fails the future with `exception` (its traceback as it is now is the
    /// one every waiter sees); False if it had already finished.
    fn set_exception(&self, exception: Bound<'_, pyo3::exceptions::PyBaseException>) -> bool {
        let traceback = exception
            .getattr("__traceback__")
            .ok()
            .and_then(|tb| tb.cast_into::<PyTraceback>().ok())
            .map(Bound::unbind);
        self.inner.complete(Outcome::Error(TaskError::Python {
            value: exception.unbind(),
            traceback,
        }))
    }

    /// The return value if the task finished and returned, else None; never
    /// blocks or raises (the per-leaf fast path of a finished tree).
    fn peek(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match self.inner.outcome() {
            Some(Outcome::Value(v)) => Some(v.clone_ref(py)),
            _ => None,
        }
    }

    /// True once finished, failed or cancelled. Never blocks.
    fn done(&self) -> bool {
        self.inner.is_finished()
    }

    fn running(&self) -> bool {
        self.inner.status() == Status::Running
    }

    fn cancelled(&self) -> bool {
        self.inner.status() == Status::Cancelled
    }

    /// One of "pending", "running", "done", "failed", "cancelled".
    #[getter]
    fn status(&self) -> &'static str {
        match self.inner.status() {
            Status::Pending => "pending",
            Status::Running => "running",
            Status::Done => "done",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    /// Cancels the task if it has not started; True if it is cancelled.
    fn cancel(&self) -> bool {
        self.inner.cancel()
    }

    /// Blocks up to `timeout` seconds (None: forever); True when finished.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        self.timed_wait(py, timeout)
    }

    /// The task's return value. Raises what the task raised (the same object,
    /// its traceback as it left the task), `TimeoutError` after `timeout`
    /// seconds, or `concurrent.futures.CancelledError`.
    #[pyo3(signature = (timeout=None))]
    fn result(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        match self.finished_or_timeout(py, timeout)? {
            Outcome::Value(v) => Ok(v.clone_ref(py)),
            Outcome::Error(e) => Err(e.to_pyerr(py)),
            Outcome::Cancelled => Err(Error::Cancelled.into()),
        }
    }

    /// What the task raised, or None if it returned.
    #[pyo3(signature = (timeout=None))]
    fn exception(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        match self.finished_or_timeout(py, timeout)? {
            Outcome::Value(_) => Ok(None),
            Outcome::Error(e) => Ok(Some(e.to_pyerr(py).into_value(py).into_any())),
            Outcome::Cancelled => Err(Error::Cancelled.into()),
        }
    }

    /// Calls `fn(future)` once finished (at once, here, if it is). An exception
    /// from `fn` is logged to the `async_array` logger, never lost.
    fn add_done_callback(slf: &Bound<'_, Self>, func: Py<PyAny>) {
        let me = slf.clone().unbind();
        slf.get().inner.add_done_callback(move |_| {
            // Skipped once the interpreter is finalizing: no Python runs then.
            Python::try_attach(|py| {
                let called = PyTuple::new(py, [me.bind(py)])
                    .and_then(|args| call_or_park(func.bind(py), &args, None));
                if let Err(err) = called {
                    log_callback_error(py, &func, err);
                }
                park_on_thread_exit(|| drop((func, me)));
            });
        });
    }

    fn __repr__(&self) -> String {
        format!("<async_array._core.Future {}>", self.status())
    }
}

static LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Logs an exception raised by a done-callback, as `concurrent.futures` does.
fn log_callback_error(py: Python<'_>, func: &Py<PyAny>, err: PyErr) {
    let logged = LOGGER
        .get_or_try_init(py, || -> PyResult<_> {
            Ok(py
                .import("logging")?
                .call_method1("getLogger", ("async_array",))?
                .unbind())
        })
        .and_then(|logger| {
            let kwargs = PyDict::new(py);
            // (type, value, traceback): the log shows where the callback raised.
            let exc_info = (err.get_type(py), err.value(py), err.traceback(py));
            kwargs.set_item("exc_info", exc_info)?;
            let args = PyTuple::new(
                py,
                [
                    "async_array: exception in done-callback %r"
                        .into_pyobject(py)?
                        .into_any(),
                    func.bind(py).clone(),
                ],
            )?;
            call_or_park(&logger.bind(py).getattr("error")?, &args, Some(&kwargs))
        });
    if logged.is_err() {
        err.write_unraisable(py, Some(func.bind(py)));
    }
}

/// Fails a future whose worker vanished (the fork child has no such thread).
/// Weak: the pool keeps these for running jobs and drops them under its lock,
/// where freeing a future's value (Python objects) could deadlock on the GIL.
struct AbandonFuture(future::WeakFuture<Py<PyAny>, TaskError>);

impl Abandon for AbandonFuture {
    fn abandon(&self) {
        if let Some(future) = self.0.upgrade() {
            future.complete(Outcome::Error(TaskError::Core(Error::Abandoned)));
        }
    }
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
        let ran = std::panic::catch_unwind(AssertUnwindSafe(move || {
            let returned = call_or_park(func.bind(py), args.bind(py), None);
            let outcome = match returned {
                Ok(v) => Outcome::Value(v.unbind()),
                Err(e) => Outcome::Error(TaskError::from_pyerr(py, e)),
            };
            // Let go of the callable (and what its closure holds) before
            // waking waiters; a destructor may run Python.
            park_on_thread_exit(|| drop((func, args)));
            f.complete(outcome);
        }));
        if let Err(payload) = ran {
            future.complete(Outcome::Error(TaskError::Core(Error::Panic(
                panic_message(&*payload),
            ))));
        }
    }
}

impl Job for PyTask {
    fn run(self: Box<Self>) {
        if IN_BATCH.with(|b| b.get()) {
            // Taken by the batch below on this thread: already attached.
            return Python::attach(|py| self.call(py));
        }
        let future = self.future.clone();
        let attached = Python::try_attach(|py| {
            self.call(py);
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
        if attached.is_none() {
            // The interpreter is finalizing: no Python can run any more.
            future.complete(Outcome::Error(TaskError::Core(Error::ShutDown)));
        }
    }

    fn cancel(self: Box<Self>) {
        self.future.cancel();
    }

    fn abandon_handle(&self) -> Option<Arc<dyn Abandon>> {
        Some(Arc::new(AbandonFuture(self.future.downgrade())))
    }
}

/// Runs `func(*args)` on the pool; returns its `Future` at once.
#[pyfunction]
#[pyo3(signature = (func, *args))]
pub fn submit(func: Py<PyAny>, args: Py<PyTuple>) -> PyResult<PyFuture> {
    let future = CoreFuture::new();
    pool()
        .submit(Box::new(PyTask {
            func,
            args,
            future: future.clone(),
        }))
        .map_err(|_| Error::ShutDown)?;
    Ok(PyFuture { inner: future })
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
        futures.push(PyFuture { inner: future });
    }
    pool().submit_all(jobs).map_err(|_| Error::ShutDown)?;
    Ok(futures)
}

/// A task that panics in Rust, to test that a panic reaches Python as an
/// ordinary `RuntimeError` and leaves the worker alive.
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
                static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
            }
            QUIET_HOOK.call_once(|| {
                let previous = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    if !QUIET.with(std::cell::Cell::get) {
                        previous(info);
                    }
                }));
            });
            QUIET.with(|q| q.set(true));
            let caught = std::panic::catch_unwind(move || -> () { panic!("{message}") });
            QUIET.with(|q| q.set(false));
            if let Err(payload) = caught {
                future.complete(Outcome::Error(TaskError::Core(Error::Panic(
                    panic_message(&*payload),
                ))));
            }
        }
        fn cancel(self: Box<Self>) {
            self.1.cancel();
        }
    }
    let future = CoreFuture::new();
    pool()
        .submit(Box::new(PanicTask(message, future.clone())))
        .map_err(|_| Error::ShutDown)?;
    Ok(PyFuture { inner: future })
}

fn core_futures(futures: &[PyRef<'_, PyFuture>]) -> Vec<CoreFuture> {
    futures.iter().map(|f| f.inner.clone()).collect()
}

/// Blocks until every future is finished, in one GIL-free wait, or until
/// `timeout` seconds pass. True when all are finished.
#[pyfunction]
#[pyo3(signature = (futures, timeout=None))]
pub fn wait_all(
    py: Python<'_>,
    futures: Vec<PyRef<'_, PyFuture>>,
    timeout: Option<f64>,
) -> PyResult<bool> {
    let futures = core_futures(&futures);
    let mut next = match futures.iter().position(|f| !f.is_finished()) {
        None => return Ok(true),
        Some(i) => i,
    };
    let deadline = deadline_after(timeout)?;
    let done = wait_detached(py, pool(), deadline, |slice| {
        match future::wait_all(&futures, next, slice) {
            Ok(()) => Some(()),
            Err(i) => {
                next = i;
                None
            }
        }
    })?;
    Ok(done.is_some())
}

/// Yields the indices of `futures` in the order they finish; each `next`
/// is one GIL-free wait. The basis of `wait(FIRST_COMPLETED)` and `as_completed`.
#[pyclass(frozen, module = "async_array._core")]
pub struct Watcher {
    queue: Arc<CompletionQueue>,
}

#[pymethods]
impl Watcher {
    #[new]
    fn new(futures: Vec<PyRef<'_, PyFuture>>) -> Self {
        Watcher {
            queue: CompletionQueue::watch(&core_futures(&futures)),
        }
    }

    /// The index of the next future to finish, waiting up to `timeout`
    /// seconds (None: forever; 0: do not wait). None on timeout.
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<usize>> {
        if let Some(i) = self.queue.try_pop() {
            return Ok(Some(i));
        }
        let deadline = deadline_after(timeout)?;
        let q = &self.queue;
        wait_detached(py, pool(), deadline, |slice| q.pop_until(slice))
    }
}

/// Sets how many tasks run at once (at least 1).
#[pyfunction]
pub fn configure(max_workers: usize) -> PyResult<()> {
    if max_workers == 0 {
        return Err(Error::InvalidArgument("max_workers must be at least 1, got 0".into()).into());
    }
    pool().set_max_workers(max_workers);
    Ok(())
}

/// The pool's counters: max_workers, threads, idle, blocked, queued, spawned_total.
#[pyfunction]
pub fn pool_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = pool().stats();
    let d = PyDict::new(py);
    d.set_item("max_workers", s.max_workers)?;
    d.set_item("threads", s.threads)?;
    d.set_item("idle", s.idle)?;
    d.set_item("blocked", s.blocked)?;
    d.set_item("queued", s.queued)?;
    d.set_item("spawned_total", s.spawned_total)?;
    Ok(d)
}

/// At interpreter exit: cancels queued tasks; running ones are not waited for.
#[pyfunction]
pub fn shutdown() {
    pool().shutdown();
}

thread_local! {
    /// The pool's lock, from the `fork()` prepare handler to the parent or child handler.
    static FORK_GUARD: RefCell<Option<ForkGuard<'static>>> = const { RefCell::new(None) };
}

extern "C" fn lock_pool_for_fork() {
    if let Some(pool) = POOL.get() {
        let _ = FORK_GUARD.try_with(|g| {
            let mut held = g.borrow_mut();
            if held.is_none() {
                *held = Some(pool.lock_for_fork());
            }
        });
    }
}

extern "C" fn unlock_pool_after_fork() {
    let _ = FORK_GUARD.try_with(|g| drop(g.borrow_mut().take()));
}

/// Holds the pool's lock across every `fork()` of the process, and only across
/// the call itself: Python's `os.register_at_fork` hooks run Python code (other
/// libraries' hooks) between `before` and `after`, during which the forking
/// thread may let the GIL go; a lock held over that window deadlocks against a
/// thread that takes the GIL and then wants the lock.
#[cfg(unix)]
fn install_fork_handlers() {
    extern "C" {
        fn pthread_atfork(
            prepare: Option<extern "C" fn()>,
            parent: Option<extern "C" fn()>,
            child: Option<extern "C" fn()>,
        ) -> std::ffi::c_int;
    }
    // SAFETY: the handlers are plain functions that live as long as the process
    // (this module is never unloaded) and never unwind.
    let rc = unsafe {
        pthread_atfork(
            Some(lock_pool_for_fork),
            Some(unlock_pool_after_fork),
            Some(unlock_pool_after_fork),
        )
    };
    debug_assert_eq!(rc, 0, "pthread_atfork failed");
}

#[cfg(not(unix))]
fn install_fork_handlers() {}

/// In the child of `os.fork()` (an `after_in_child` hook, run with the GIL and
/// no other thread): fails the tasks the parent's workers were running and
/// starts workers for what is still queued.
#[pyfunction]
pub fn _after_fork_child() {
    if let Some(pool) = POOL.get() {
        pool.after_fork_child();
    }
}
