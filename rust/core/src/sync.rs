//! The core's locks: `std::sync`, with poisoning ignored.
//!
//! Why std and not parking_lot: after `os.fork()` the child inherits every
//! lock's state, and parking_lot keeps its waiters in a process-wide table.
//! Threads of the parent that were parked in it do not exist in the child, yet
//! an unlock there can hand the lock to one of them, and the child deadlocks.
//! std's futex-based `Mutex` and `Condvar` keep all their state in the object
//! itself and their waiters in the kernel, which forgets them at fork.
//!
//! These two helpers are the only callers of `Mutex::lock` and the raw
//! `Condvar` waits (`clippy.toml` refuses them anywhere else). The rule they
//! keep: a thread holding one of these locks never waits for the GIL (never
//! attaches, runs Python, or drops a Python object), so the order is always
//! GIL, then lock, and the two cannot deadlock.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// Locks `mutex`. No code of the core panics while holding one of its locks,
/// and a poisoned one still holds consistent data, so poisoning is ignored.
#[allow(clippy::disallowed_methods)] // the one door to Mutex::lock
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `cond` once, until notified, spuriously woken, or `deadline`
/// passes (`None`: no deadline). The caller re-checks its condition.
#[allow(clippy::disallowed_methods)] // the one door to the raw Condvar waits
pub fn wait_once<'a, T>(
    cond: &Condvar,
    guard: MutexGuard<'a, T>,
    deadline: Option<Instant>,
) -> MutexGuard<'a, T> {
    match deadline {
        None => cond.wait(guard).unwrap_or_else(PoisonError::into_inner),
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            cond.wait_timeout(guard, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0
        }
    }
}
