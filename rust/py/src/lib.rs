//! async_array's Rust core: the worker pool, futures, waits, aligned host
//! buffers and DLPack export. This file only wires the Python module.

#[path = "interp.rs"]
pub mod attach;
#[path = "../../core/src/buffer.rs"]
pub mod buffer;
#[path = "../../core/src/future/cycle.rs"]
pub mod cycle;
#[path = "../../core/src/dlpack.rs"]
pub mod dlpack;
#[path = "error.rs"]
pub mod error;
#[path = "../../core/src/future/mod.rs"]
pub mod future;
#[path = "host_buffer.rs"]
pub mod hostbuffer;
#[path = "../../core/src/safetensors/http.rs"]
pub mod http;
#[path = "../../core/src/sync.rs"]
pub mod locks;
#[path = "../../core/src/pool.rs"]
pub mod pool;
#[path = "future.rs"]
pub mod pyfuture;
#[path = "../../core/src/safetensors/plan.rs"]
pub mod readplan;
#[path = "runtime.rs"]
pub mod runtime;
#[path = "../../core/src/safetensors/mod.rs"]
pub mod safetensors;
#[path = "safetensors.rs"]
pub mod stfile;
#[path = "task.rs"]
pub mod task;
#[path = "../../core/src/time.rs"]
pub mod wait;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("ALIGNMENT", buffer::ALIGN)?;
    m.add("DLPACK_CPU", dlpack::KDL_CPU)?;
    m.add_class::<pyfuture::PyFuture>()?;
    m.add_class::<pyfuture::Watcher>()?;
    m.add_class::<hostbuffer::HostBuffer>()?;
    m.add("WaitCycleError", m.py().get_type::<error::WaitCycleError>())?;
    m.add_class::<stfile::SafetensorsFile>()?;
    m.add_function(wrap_pyfunction!(task::submit, m)?)?;
    m.add_function(wrap_pyfunction!(task::submit_many, m)?)?;
    m.add_function(wrap_pyfunction!(task::submit_urgent, m)?)?;
    m.add_function(wrap_pyfunction!(task::_submit_rust_panic, m)?)?;
    m.add_function(wrap_pyfunction!(pyfuture::wait_all, m)?)?;
    m.add_function(wrap_pyfunction!(pyfuture::wait_all_or_failure, m)?)?;
    m.add_function(wrap_pyfunction!(pyfuture::depends_on, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::configure, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::default_max_workers, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::exiting, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::wait_for_running_tasks, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::_after_fork_child, m)?)?;
    m.add_function(wrap_pyfunction!(hostbuffer::live_host_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(hostbuffer::huge_pages, m)?)?;
    m.add_function(wrap_pyfunction!(stfile::read_url_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(stfile::tensor_bytes_read, m)?)?;
    Ok(())
}
