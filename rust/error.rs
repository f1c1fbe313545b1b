//! The core's errors and their one conversion to Python exceptions.

use pyo3::exceptions::{
    PyBufferError, PyMemoryError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTraceback, PyType};

/// Everything the core itself can fail with. Exceptions raised by Python code
/// that a task ran travel as [`TaskError::Python`] and are re-raised unchanged.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// The future was cancelled before it ran.
    Cancelled,
    /// A wait ran out of time (seconds).
    Timeout(f64),
    /// Rust code panicked while running a task.
    Panic(String),
    /// The task was running in the parent when `os.fork()` made this process.
    Abandoned,
    /// The pool is shut down (interpreter exit); nothing new runs.
    ShutDown,
    /// An argument was out of its domain.
    InvalidArgument(String),
    /// A buffer export that cannot be honoured.
    Buffer(String),
    /// An allocation of this many bytes failed.
    OutOfMemory(usize),
}

static CANCELLED_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn cancelled_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    CANCELLED_ERROR.import(py, "concurrent.futures", "CancelledError")
}

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        match err {
            Error::Cancelled => Python::attach(|py| match cancelled_error(py) {
                Ok(t) => PyErr::from_type(t.clone(), "the task was cancelled before it ran"),
                Err(e) => e,
            }),
            Error::Timeout(seconds) => {
                PyTimeoutError::new_err(format!("not finished after {seconds} s"))
            }
            Error::Panic(msg) => {
                PyRuntimeError::new_err(format!("async_array: Rust panic in a worker: {msg}"))
            }
            Error::Abandoned => PyRuntimeError::new_err(
                "async_array: this task was running in the parent process when os.fork() \
                 was called; the child has no thread to finish it",
            ),
            Error::ShutDown => PyRuntimeError::new_err(
                "async_array: the pool is shut down (interpreter exit); nothing new can run",
            ),
            Error::InvalidArgument(msg) => PyValueError::new_err(msg),
            Error::Buffer(msg) => PyBufferError::new_err(msg),
            Error::OutOfMemory(bytes) => PyMemoryError::new_err(format!(
                "async_array: could not allocate {bytes} bytes of 64-byte-aligned host memory"
            )),
        }
    }
}

/// Why a task's future failed.
#[derive(Debug)]
pub enum TaskError {
    /// The task raised: the exception object and the traceback it had when it
    /// left the task, restored at each re-raise so it never grows.
    Python {
        value: Py<pyo3::exceptions::PyBaseException>,
        traceback: Option<Py<PyTraceback>>,
    },
    Core(Error),
}

impl TaskError {
    pub fn from_pyerr(py: Python<'_>, err: PyErr) -> Self {
        // pyo3's PanicException derives from BaseException; callers get an ordinary one.
        if err.is_instance_of::<pyo3::panic::PanicException>(py) {
            return TaskError::Core(Error::Panic(err.value(py).to_string()));
        }
        let traceback = err.traceback(py).map(Bound::unbind);
        TaskError::Python {
            value: err.into_value(py),
            traceback,
        }
    }

    /// The exception to raise: the same object every time, its traceback reset.
    pub fn to_pyerr(&self, py: Python<'_>) -> PyErr {
        match self {
            TaskError::Python { value, traceback } => {
                let value = value.bind(py);
                let tb = traceback.as_ref().map(|t| t.bind(py).clone().into_any());
                let _ = value.setattr("__traceback__", tb);
                PyErr::from_value(value.clone().into_any())
            }
            TaskError::Core(err) => err.clone().into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyo3::exceptions::PyException;

    fn raised(err: Error) -> (String, String) {
        Python::initialize();
        Python::attach(|py| {
            let e: PyErr = err.into();
            let name = e.get_type(py).name().unwrap().to_string();
            assert!(
                e.is_instance_of::<PyException>(py),
                "{name} must be an ordinary Exception"
            );
            (name, e.value(py).to_string())
        })
    }

    #[test]
    fn cancelled_is_concurrent_futures_cancelled_error() {
        let (name, _) = raised(Error::Cancelled);
        assert_eq!(name, "CancelledError");
        Python::attach(|py| {
            let e: PyErr = Error::Cancelled.into();
            let cf = py.import("concurrent.futures").unwrap();
            assert!(e.get_type(py).is(cf.getattr("CancelledError").unwrap()));
        });
    }

    #[test]
    fn each_core_error_maps_to_its_python_type() {
        assert_eq!(
            raised(Error::Timeout(1.5)),
            ("TimeoutError".into(), "not finished after 1.5 s".into())
        );
        let (name, msg) = raised(Error::Panic("boom".into()));
        assert_eq!(name, "RuntimeError");
        assert!(msg.contains("boom"));
        let (name, msg) = raised(Error::Abandoned);
        assert_eq!(name, "RuntimeError");
        assert!(msg.contains("os.fork()"));
        let (name, msg) = raised(Error::ShutDown);
        assert_eq!(name, "RuntimeError");
        assert!(msg.contains("shut down"));
        assert_eq!(
            raised(Error::InvalidArgument("bad".into())),
            ("ValueError".into(), "bad".into())
        );
        assert_eq!(
            raised(Error::Buffer("no".into())),
            ("BufferError".into(), "no".into())
        );
        let (name, msg) = raised(Error::OutOfMemory(1 << 50));
        assert_eq!(name, "MemoryError");
        assert!(msg.contains(&(1u64 << 50).to_string()));
    }

    #[test]
    fn python_errors_reraise_as_the_same_object_with_the_same_traceback() {
        Python::initialize();
        Python::attach(|py| {
            let err = py
                .run(c"def f():\n    raise KeyError('k')\nf()", None, None)
                .unwrap_err();
            let original = err.value(py).clone().unbind();
            let tb_before = err.traceback(py).unwrap().unbind();
            let task = TaskError::from_pyerr(py, err);
            for _ in 0..3 {
                let again = task.to_pyerr(py);
                assert!(again.value(py).is(original.bind(py)));
                assert!(again.traceback(py).unwrap().is(tb_before.bind(py)));
            }
        });
    }

    #[test]
    fn panic_exception_becomes_runtime_error() {
        Python::initialize();
        Python::attach(|py| {
            let panic = pyo3::panic::PanicException::new_err("kaboom");
            let task = TaskError::from_pyerr(py, panic);
            let e = task.to_pyerr(py);
            assert!(e.is_instance_of::<PyRuntimeError>(py));
            assert!(e.value(py).to_string().contains("kaboom"));
        });
    }
}
