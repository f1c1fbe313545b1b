//! Hooks for the test suite, in the submodule `async_array._core._testing`:
//! counters that leak tests read and a task that panics in Rust. Not part of
//! the API.

use crate::current::CoreFuture;
use crate::error::Error;
use crate::future::PyFuture;
use crate::runtime::pool;
use crate::task::fail_on_panic;
use async_array_core::pool::Job;
use async_array_core::Error as CoreError;
use pyo3::prelude::*;
use std::cell::Cell;

/// How many aligned host allocations are alive (for leak tests).
#[pyfunction]
pub fn live_host_buffers() -> usize {
    async_array_core::buffer::live_buffers()
}

/// Bytes of tensor data this process has read from safetensors files and
/// URLs so far (headers not counted; over HTTP, bytes between the blocks of
/// one request count, since they came).
#[pyfunction]
pub fn tensor_bytes_read() -> u64 {
    async_array_core::safetensors::tensor_bytes_read()
}

/// Over HTTP, a range request of more than `above` bytes is read as
/// concurrent parts of at most `part` bytes (at least 1) from now on, in this
/// process (32 MiB and 16 MiB by default). Returns the values before.
#[pyfunction]
pub fn set_parallel_ranges(above: u64, part: u64) -> (u64, u64) {
    async_array_core::safetensors::plan::set_parallel_ranges(above, part)
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
        .map_err(|_| Error(CoreError::ShutDown))?;
    Ok(PyFuture::from(future))
}
