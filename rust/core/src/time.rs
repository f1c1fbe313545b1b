//! The one helper through which every blocking wait reachable from Python goes.
//!
//! It detaches from the interpreter (so other Python threads and the workers run),
//! waits in slices of at most [`SLICE`], and calls `check_signals` between slices
//! so that Ctrl-C interrupts a wait of any length. On a pool worker it also tells
//! the pool the worker is blocked, so the pool can start a stand-in.

use crate::error::Error;
use crate::pool::Pool;
use pyo3::prelude::*;
use std::time::{Duration, Instant};

/// Longest stretch without a signal check (the contract says Ctrl-C within 100 ms).
pub const SLICE: Duration = Duration::from_millis(50);

/// A timeout in seconds as Python gives it: `None` waits forever, negative
/// counts as zero (as `concurrent.futures` does).
pub fn deadline_after(timeout: Option<f64>) -> Result<Option<Instant>, Error> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() => Err(Error::InvalidArgument(
            "timeout must be a number of seconds or None, got nan".into(),
        )),
        Some(t) => Ok(Duration::try_from_secs_f64(t.max(0.0))
            .ok()
            .and_then(|d| Instant::now().checked_add(d))),
    }
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
