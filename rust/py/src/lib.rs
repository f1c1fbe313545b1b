//! The PyO3 bindings of async-array-core: the Python module
//! `async_array._core`. This file only wires the module; each class and
//! function lives in the file named after what it wraps.

pub mod current;
pub mod error;
pub mod future;
pub mod host_buffer;
pub mod interp;
pub mod runtime;
pub mod safetensors;
pub mod task;
pub mod testing;

use pyo3::prelude::*;

#[pymodule(module = "async_array")]
mod _core {
    use pyo3::prelude::*;

    #[pymodule_export]
    use super::error::WaitCycleError;
    #[pymodule_export]
    use super::future::{depends_on, wait_all, wait_all_or_failure, PyFuture, Watcher};
    #[pymodule_export]
    use super::host_buffer::{huge_pages, HostBuffer};
    #[pymodule_export]
    use super::runtime::{
        _after_fork_child, configure, default_max_workers, exiting, pool_stats, shutdown,
        wait_for_running_tasks, wait_for_threads_to_end,
    };
    #[pymodule_export]
    use super::safetensors::{read_url_prefix, SafetensorsFile, TensorInfo};
    #[pymodule_export]
    use super::task::{submit, submit_many, submit_urgent};

    /// Alignment in bytes of every `HostBuffer`.
    #[pymodule_export]
    const ALIGNMENT: usize = async_array_core::buffer::ALIGN;
    /// DLPack's device type of host memory.
    #[pymodule_export]
    const DLPACK_CPU: i32 = async_array_core::dlpack::KDL_CPU;
    /// The environment variable that turns huge pages on (`1`) or off (`0`).
    #[pymodule_export]
    const HUGE_PAGES_ENV: &str = async_array_core::buffer::HUGE_PAGES_ENV;
    /// Over HTTP, byte runs at most this far apart share one range request.
    #[pymodule_export]
    const HTTP_GAP: u64 = async_array_core::safetensors::plan::HTTP_GAP;

    /// Test hooks: not part of the API.
    #[pymodule]
    mod _testing {
        #[pymodule_export]
        use crate::testing::{
            _submit_rust_panic, live_host_buffers, set_parallel_ranges, tensor_bytes_read,
        };
    }

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        // The numpy names of the dtypes the loader converts between as it reads.
        m.add(
            "CONVERTED_WHILE_READING",
            pyo3::types::PyFrozenSet::new(
                m.py(),
                async_array_core::safetensors::convert::CONVERTIBLE.map(|d| d.numpy_name()),
            )?,
        )?;
        // The numpy names of the types a HostBuffer holds by their bytes and
        // hands to JAX with one copy (no DLPack type JAX takes).
        m.add(
            "BYTE_TYPES_WITHOUT_DLPACK",
            pyo3::types::PyFrozenSet::new(m.py(), super::host_buffer::BYTE_TYPES_WITHOUT_DLPACK)?,
        )?;
        // The test hooks are no export of the module's.
        m.index()?.call_method1("remove", ("_testing",))?;
        // So that `import async_array._core._testing` finds the submodule.
        m.py()
            .import("sys")?
            .getattr("modules")?
            .set_item("async_array._core._testing", m.getattr("_testing")?)
    }
}
