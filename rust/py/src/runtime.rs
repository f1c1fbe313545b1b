//! The process-wide pool: the one instance, its size, interpreter-exit
//! shutdown, and what `fork()` does to it (`pthread_atfork` handlers and the
//! `os.register_at_fork` child hook).

use crate::error::Error;
use crate::interp::{deadline_after, drop_thread_state, keep_thread_state, wait_detached};
use async_array_core::pool::{ForkGuard, Pool, ThreadHooks};
use async_array_core::Error as CoreError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

static POOL: OnceLock<Pool> = OnceLock::new();

/// The process-wide pool, started at first use with [`default_max_workers`];
/// `configure` resizes it.
pub fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        install_fork_handlers();
        let hooks = ThreadHooks {
            start: Some(keep_thread_state),
            stop: Some(drop_thread_state),
        };
        Pool::with_hooks("async-array", default_max_workers(), hooks)
    })
}

/// The pool size when none is configured: `min(32, cpus + 4)`, the
/// `ThreadPoolExecutor` rule (loaders mostly wait on I/O), where `cpus` is how
/// many CPUs this process may actually use: its CPU affinity mask and cgroup
/// quota count, which `os.cpu_count()` ignores.
#[pyfunction]
pub fn default_max_workers() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpus + 4).min(32)
}

/// Sets how many tasks run at once (at least 1).
#[pyfunction]
pub fn configure(max_workers: usize) -> PyResult<()> {
    if max_workers == 0 {
        return Err(Error(CoreError::InvalidArgument(
            "max_workers must be at least 1, got 0".into(),
        ))
        .into());
    }
    pool().set_max_workers(max_workers);
    Ok(())
}

/// The pool's counters: max_workers, threads, idle, blocked, queued,
/// spawned_total, urgent_lane.
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
    d.set_item("urgent_lane", s.urgent_lane)?;
    Ok(d)
}

/// Set by [`shutdown`], at interpreter exit.
static EXITING: AtomicBool = AtomicBool::new(false);

/// True once the interpreter's exit has begun ([`shutdown`] was called).
#[pyfunction]
pub fn exiting() -> bool {
    EXITING.load(Ordering::Acquire)
}

/// At interpreter exit: cancels queued tasks and abandons HTTP reads (at
/// their next chunk); running tasks are not waited for.
#[pyfunction]
pub fn shutdown() {
    EXITING.store(true, Ordering::Release);
    async_array_core::safetensors::http::abandon_reads();
    pool().shutdown();
}

/// Waits, GIL released, until no pool worker runs a task, or `timeout`
/// seconds (None: as long as it takes); true when none runs.
#[pyfunction]
#[pyo3(signature = (timeout=None))]
pub fn wait_for_running_tasks(py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
    wait_on_pool(py, timeout, Pool::wait_for_running_jobs)
}

/// Runs one of the pool's bounded waits (`wait(pool, slice_deadline)`, true
/// when its state is reached) detached, in slices, up to `timeout` seconds.
fn wait_on_pool(
    py: Python<'_>,
    timeout: Option<f64>,
    wait: fn(&Pool, Option<Instant>) -> bool,
) -> PyResult<bool> {
    let deadline = deadline_after(timeout)?;
    let pool = pool();
    Ok(wait_detached(py, pool, deadline, |slice| wait(pool, slice).then_some(()))?.is_some())
}

/// After [`shutdown`]: waits, GIL released, until every pool thread has ended
/// (deleted its Python thread state, freeing what it kept in
/// `threading.local`), or `timeout` seconds; true when all have. Called at
/// interpreter exit before finalization: a thread that freed them later would
/// run their destructors (a socket's, a `jax.Array`'s) in a finalizing
/// interpreter, which aborted the process.
#[pyfunction]
#[pyo3(signature = (timeout=None))]
pub fn wait_for_threads_to_end(py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
    wait_on_pool(py, timeout, Pool::wait_for_threads_to_end)
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
    // SAFETY: the handlers are plain functions that live as long as the process
    // (this module is never unloaded) and never unwind.
    let rc = unsafe {
        libc::pthread_atfork(
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
/// refuses what was queued (it runs in the parent).
#[pyfunction]
pub fn _after_fork_child() {
    if let Some(pool) = POOL.get() {
        pool.after_fork_child();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_size_is_usable_cpus_plus_four_capped_at_32() {
        let n = default_max_workers();
        assert!((5..=32).contains(&n), "{n}");
        // Never more than the CPUs the affinity mask allows (a cgroup quota
        // may allow fewer), unlike os.cpu_count().
        Python::initialize();
        Python::attach(|py| {
            let os = py.import("os").unwrap();
            if let Ok(mask) = os.call_method1("sched_getaffinity", (0,)) {
                let allowed = mask.len().unwrap();
                assert!(n <= (allowed + 4).min(32), "{n} for {allowed} CPUs");
            }
        });
    }

    #[test]
    fn the_pool_starts_at_the_default_size() {
        // Only this test touches the process-wide pool in this test binary.
        assert_eq!(pool().max_workers(), default_max_workers());
    }
}
