//! Python's view of the core's futures: the `Future` class, and the waits over
//! many futures at once (`wait_all`, `Watcher`). Every wait goes through
//! [`wait_detached`], so none holds the GIL and Ctrl-C interrupts each.

use crate::current::{self, CoreFuture};
use crate::error::{Error, TaskError};
use crate::interp::{call_or_park, deadline_after, park_on_thread_exit, wait_detached};
use crate::runtime::pool;
use async_array_core::future::cycle::find_cycle;
use async_array_core::future::waits::{self, CompletionQueue, Countdown};
use async_array_core::future::{BlockedOn, Outcome, Status, WeakFuture};
use async_array_core::Error as CoreError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTraceback, PyTuple};
use pyo3::{PyTraverseError, PyVisit};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A wait of the pool task running on this thread, recorded on the task's
/// future for other tasks' cycle checks while it lasts.
struct WaitRecord(CoreFuture);

impl Drop for WaitRecord {
    fn drop(&mut self) {
        self.0.set_blocked_on(None);
    }
}

/// Before a wait on `on` (all of them, or any one when `any`) that may block:
/// on a pool worker running a task, records the wait and fails with
/// [`CoreError::Cycle`] when it could never end. Elsewhere (the main thread, any
/// thread that runs no task) it costs one thread-local read. A poll
/// (`timeout <= 0`) cannot hang and is not checked.
fn check_wait(
    py: Python<'_>,
    on: &[CoreFuture],
    any: bool,
    timeout: Option<f64>,
) -> Result<Option<WaitRecord>, Error> {
    if timeout.is_some_and(|t| t <= 0.0) {
        return Ok(None);
    }
    let Some((me, label)) = current::running(py) else {
        return Ok(None);
    };
    me.set_blocked_on(Some(BlockedOn {
        label: Some(label),
        any,
        on: on.iter().map(CoreFuture::downgrade).collect(),
    }));
    let record = WaitRecord(me);
    match find_cycle(&record.0) {
        None => Ok(Some(record)),
        Some(cycle) => Err(Error(CoreError::Cycle {
            labels: cycle.labels.iter().map(|l| l.to_string()).collect(),
            index: cycle.index,
        })),
    }
}

/// A handle to one task's result, shaped like `concurrent.futures.Future`.
/// Every wait releases the GIL and checks for signals every 50 ms.
#[pyclass(frozen, name = "Future", module = "async_array._core")]
pub struct PyFuture {
    inner: CoreFuture,
}

impl From<CoreFuture> for PyFuture {
    fn from(inner: CoreFuture) -> Self {
        PyFuture { inner }
    }
}

impl PyFuture {
    /// The core future it wraps.
    pub fn core(&self) -> &CoreFuture {
        &self.inner
    }

    fn timed_wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if self.inner.is_finished() {
            return Ok(true);
        }
        if timeout != Some(0.0) && self.inner.mark_wanted() {
            // Someone waits on it: it must not wait behind every task queued first.
            pool().run_next(self.inner.id());
        }
        let deadline = deadline_after(timeout)?;
        let _record = check_wait(py, std::slice::from_ref(&self.inner), false, timeout)?;
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
            return Err(Error(CoreError::Timeout(timeout.unwrap_or_default())).into());
        }
        Ok(self.inner.outcome().expect("finished"))
    }
}

#[pymethods]
impl PyFuture {
    /// Lets Python's cyclic garbage collector see the objects a finished
    /// future holds. A failed leaf's exception, once raised, holds frames
    /// that hold the leaf, which holds this future: without this, that cycle
    /// is never freed. Reported only by the sole handle of the core future
    /// (two handles reporting one reference would make the collector free a
    /// live object); while a task or a wait holds a handle, nothing is
    /// reported, which only delays collection. No `__clear__`: the exception
    /// and the frames in such a cycle clear themselves.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if !self.inner.is_sole_handle() {
            return Ok(());
        }
        match self.inner.outcome() {
            Some(Outcome::Value(value)) => visit.call(value)?,
            Some(Outcome::Error(TaskError::Python { value, traceback })) => {
                visit.call(value)?;
                if let Some(tb) = traceback {
                    visit.call(tb)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

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
            Outcome::Cancelled => Err(Error(CoreError::Cancelled).into()),
        }
    }

    /// What the task raised, or None if it returned.
    #[pyo3(signature = (timeout=None))]
    fn exception(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        match self.finished_or_timeout(py, timeout)? {
            Outcome::Value(_) => Ok(None),
            Outcome::Error(e) => Ok(Some(e.to_pyerr(py).into_value(py).into_any())),
            Outcome::Cancelled => Err(Error(CoreError::Cancelled).into()),
        }
    }

    /// Calls `fn(future)` once finished (at once, here, if it is). An exception
    /// from `fn` is logged to the `async_array` logger, never lost. With
    /// `first`, `fn` runs before every callback added without it.
    #[pyo3(signature = (func, *, first = false))]
    fn add_done_callback(slf: &Bound<'_, Self>, func: Py<PyAny>, first: bool) {
        let me = slf.clone().unbind();
        let callback = move |_: &Outcome<Py<PyAny>, TaskError>| {
            // Skipped once the interpreter is finalizing: no Python runs then.
            Python::try_attach(|py| {
                let called = PyTuple::new(py, [me.bind(py)])
                    .and_then(|args| call_or_park(func.bind(py), &args, None));
                if let Err(err) = called {
                    log_callback_error(py, &func, err);
                }
                park_on_thread_exit(|| drop((func, me)));
            });
        };
        let inner = &slf.get().inner;
        if first {
            inner.add_first_done_callback(callback);
        } else {
            inner.add_done_callback(callback);
        }
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
    if futures.iter().all(|f| f.is_finished()) {
        return Ok(true);
    }
    let deadline = deadline_after(timeout)?;
    let _record = check_wait(py, &futures, false, timeout)?;
    let done = wait_detached(py, pool(), deadline, |slice| {
        waits::wait_all(&futures, slice).then_some(())
    })?;
    Ok(done.is_some())
}

/// Blocks until every future is finished or one of them fails or is
/// cancelled, in one GIL-free wait, or until `timeout` seconds pass. Returns
/// `(stopped, failed)`: `stopped` is False on timeout; `failed` is the index of
/// a failed or cancelled future (the first in list order if one had failed
/// already, else the first to fail), None when none has. A bulk read raises a
/// known failure at once rather than wait for slow leaves first.
#[pyfunction]
#[pyo3(signature = (futures, timeout=None))]
pub fn wait_all_or_failure(
    py: Python<'_>,
    futures: Vec<PyRef<'_, PyFuture>>,
    timeout: Option<f64>,
) -> PyResult<(bool, Option<usize>)> {
    let futures = core_futures(&futures);
    if let Some(i) = futures.iter().position(failed) {
        return Ok((true, Some(i)));
    }
    if futures.iter().all(|f| f.is_finished()) {
        return Ok((true, None));
    }
    let deadline = deadline_after(timeout)?;
    let _record = check_wait(py, &futures, false, timeout)?;
    let pending: Vec<usize> = (0..futures.len())
        .filter(|&i| !futures[i].is_finished())
        .collect();
    let watched: Vec<CoreFuture> = pending.iter().map(|&i| futures[i].clone()).collect();
    let all = Countdown::watch(&watched);
    let stop = wait_detached(py, pool(), deadline, |slice| all.wait_until(slice));
    all.unwatch(&watched); // also after a timeout or a signal
    let stop = stop?;
    Ok(match stop {
        Some(failed) => (true, failed.map(|k| pending[k])),
        None => (false, None),
    })
}

fn failed(future: &CoreFuture) -> bool {
    matches!(future.status(), Status::Failed | Status::Cancelled)
}

/// Yields the indices of `futures` in the order they finish; each `next`
/// is one GIL-free wait. The basis of `wait(FIRST_COMPLETED)` and `as_completed`.
#[pyclass(frozen, module = "async_array._core")]
pub struct Watcher {
    queue: Arc<CompletionQueue>,
    /// The futures watched (weak: a watcher keeps no value alive) and which
    /// of them `next` has returned, for the cycle check of its waits.
    futures: Vec<WeakFuture<Py<PyAny>, TaskError>>,
    returned: Vec<AtomicBool>,
}

#[pymethods]
impl Watcher {
    #[new]
    fn new(futures: Vec<PyRef<'_, PyFuture>>) -> Self {
        let futures = core_futures(&futures);
        Watcher {
            queue: CompletionQueue::watch(&futures),
            returned: futures.iter().map(|_| AtomicBool::new(false)).collect(),
            futures: futures.iter().map(CoreFuture::downgrade).collect(),
        }
    }

    /// The index of the next future to finish, waiting up to `timeout`
    /// seconds (None: forever; 0: do not wait). None on timeout. On a pool
    /// task, raises `WaitCycleError` when every future not yet returned waits
    /// on that task (its `index` is the watched future's index).
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<usize>> {
        if let Some(i) = self.queue.try_pop() {
            return Ok(Some(self.returning(i)));
        }
        let deadline = deadline_after(timeout)?;
        let (indices, left): (Vec<usize>, Vec<CoreFuture>) = if current::running(py).is_some() {
            (0..self.futures.len())
                .filter(|&i| !self.returned[i].load(Ordering::Acquire))
                .filter_map(|i| self.futures[i].upgrade().map(|f| (i, f)))
                .unzip()
        } else {
            (Vec::new(), Vec::new())
        };
        let _record = check_wait(py, &left, true, timeout).map_err(|e| match e {
            Error(CoreError::Cycle { labels, index }) => Error(CoreError::Cycle {
                labels,
                index: indices[index],
            }),
            other => other,
        })?;
        let q = &self.queue;
        let next = wait_detached(py, pool(), deadline, |slice| q.pop_until(slice))?;
        Ok(next.map(|i| self.returning(i)))
    }
}

impl Watcher {
    fn returning(&self, index: usize) -> usize {
        self.returned[index].store(true, Ordering::Release);
        index
    }
}

/// Records that each of `dependents` finishes only once all of `on` have (and
/// names them `label` in cycle messages): for futures that a task completes
/// on behalf of others, such as `aa.jit`'s outputs (they need their inputs)
/// and `async_stream`'s leaves (they need the generator's task), so that a
/// wait on one of them that leads back to the waiting task is found.
#[pyfunction]
#[pyo3(signature = (dependents, on, label=None))]
pub fn depends_on(
    dependents: Vec<PyRef<'_, PyFuture>>,
    on: Vec<PyRef<'_, PyFuture>>,
    label: Option<String>,
) {
    let label: Option<Arc<str>> = label.map(Arc::from);
    let on: Vec<_> = on.iter().map(|f| f.inner.downgrade()).collect();
    for dependent in dependents {
        dependent.inner.set_blocked_on(Some(BlockedOn {
            label: label.clone(),
            any: false,
            on: on.clone(),
        }));
    }
}
