//! The core's errors and their one conversion to Python exceptions.
//!
//! Every exception the bindings raise themselves is a core error, wrapped in
//! [`Error`], turned into a Python exception by the one `From<Error> for PyErr`
//! below; no other file builds one (clippy's `disallowed-methods` in `clippy.toml` refuses
//! `PyValueError::new_err` and its kin elsewhere). Exceptions that Python code
//! raised (a task, an import, a signal handler) pass through unchanged.

use async_array_core::Error as CoreError;
use pyo3::exceptions::{
    PyBufferError, PyFileNotFoundError, PyMemoryError, PyOSError, PyOverflowError,
    PyPermissionError, PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTraceback, PyTuple, PyType};

pyo3::create_exception!(
    async_array._core,
    WaitCycleError,
    PyRuntimeError,
    "A wait that would never end: the waiting task waits, directly or through \
     other tasks, on itself. `cycle` names the calls from the waiting task back \
     to it; `index` is the position, among the futures waited on, of the one \
     that leads back."
);

/// A core error on its way to Python: the orphan rule forbids
/// `From<CoreError> for PyErr` here, so binding functions return this
/// newtype (or build a `PyErr` from it) and `?` on a core result converts.
#[derive(Debug, Clone, PartialEq)]
pub struct Error(pub CoreError);

impl From<CoreError> for Error {
    fn from(err: CoreError) -> Self {
        Error(err)
    }
}

static CANCELLED_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn cancelled_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    CANCELLED_ERROR.import(py, "concurrent.futures", "CancelledError")
}

impl From<Error> for PyErr {
    // The one place that builds the core's own exceptions.
    #[allow(clippy::disallowed_methods)]
    fn from(Error(err): Error) -> PyErr {
        match err {
            CoreError::Cancelled => Python::attach(|py| match cancelled_error(py) {
                Ok(t) => PyErr::from_type(t.clone(), "the task was cancelled before it ran"),
                Err(e) => e,
            }),
            CoreError::Timeout(seconds) => {
                PyTimeoutError::new_err(format!("async_array: task not finished after {seconds} s"))
            }
            CoreError::Panic(msg) => {
                PyRuntimeError::new_err(format!("async_array: Rust panic in a worker: {msg}"))
            }
            CoreError::Abandoned => PyRuntimeError::new_err(
                "async_array: this task was running in the parent process when os.fork() \
                 was called; the child has no thread to finish it",
            ),
            CoreError::QueuedAtFork => PyRuntimeError::new_err(
                "async_array: this task was queued in the parent process when os.fork() was \
                 called; it runs in the parent, not in this child (submit it again here to run it here)",
            ),
            CoreError::ThreadStart { error, threads } => PyRuntimeError::new_err(format!(
                "async_array: the pool could not start a thread ({error}) while all {threads} of \
                 its threads were blocked waiting on queued work, so this task would never run. \
                 A task that waits on another gets a stand-in thread, as far as the OS allows \
                 (pid limits, RLIMIT_AS, memory): wait on fewer leaves from inside tasks, or raise the limit"
            )),
            CoreError::ShutDown => PyRuntimeError::new_err(
                "async_array: the pool is shut down (interpreter exit); nothing new can run",
            ),
            CoreError::InvalidArgument(msg) => PyValueError::new_err(msg),
            CoreError::WrongType(msg) => PyTypeError::new_err(msg),
            CoreError::Buffer(msg) => PyBufferError::new_err(msg),
            CoreError::OutOfMemory(bytes) => PyMemoryError::new_err(format!(
                "async_array: could not allocate {bytes} bytes of {}-byte-aligned host memory",
                async_array_core::buffer::ALIGN
            )),
            CoreError::Cycle { labels, index } => Python::attach(|py| {
                let me = labels.first().map_or("a task", String::as_str);
                let target = labels.get(1).map_or(me, String::as_str);
                let err = WaitCycleError::new_err(format!(
                    "{me}: waiting on {target} would never end: it waits on this task \
                     (cycle: {})",
                    labels.join(" -> ")
                ));
                let value = err.value(py);
                let set = PyTuple::new(py, &labels)
                    .and_then(|cycle| value.setattr("cycle", cycle))
                    .and_then(|()| value.setattr("index", index));
                match set {
                    Ok(()) => err,
                    Err(e) => e,
                }
            }),
            CoreError::NotFound(msg) => PyFileNotFoundError::new_err(msg),
            CoreError::Denied(msg) => PyPermissionError::new_err(msg),
            CoreError::Io(msg) => PyOSError::new_err(msg),
            CoreError::Os { errno, message } => PyOSError::new_err((errno, message)),
            CoreError::Format(msg) => PyValueError::new_err(msg),
            CoreError::Deadline(msg) => PyTimeoutError::new_err(msg),
            CoreError::Overflow(msg) => PyOverflowError::new_err(msg),
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
    /// The core failed it (a panic, a shutdown, a fork).
    Core(CoreError),
}

impl TaskError {
    pub fn from_pyerr(py: Python<'_>, err: PyErr) -> Self {
        // pyo3's PanicException derives from BaseException; callers get an ordinary one.
        if err.is_instance_of::<pyo3::panic::PanicException>(py) {
            return TaskError::Core(CoreError::Panic(err.value(py).to_string()));
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
            TaskError::Core(err) => Error(err.clone()).into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyo3::exceptions::PyException;
    use pyo3::PyTypeInfo;

    /// Raises `err` as Python would see it; checks that its type is exactly
    /// `T` and an ordinary `Exception`, and returns its message.
    fn raised<T: PyTypeInfo>(err: CoreError) -> String {
        Python::initialize();
        Python::attach(|py| {
            let e: PyErr = Error(err).into();
            let ty = e.get_type(py);
            assert!(
                ty.is(T::type_object(py)),
                "raised {}, expected {}",
                ty.name().unwrap(),
                T::type_object(py).name().unwrap()
            );
            assert!(e.is_instance_of::<PyException>(py), "an ordinary Exception");
            e.value(py).to_string()
        })
    }

    #[test]
    fn cancelled_is_concurrent_futures_cancelled_error() {
        Python::initialize();
        Python::attach(|py| {
            let e: PyErr = Error(CoreError::Cancelled).into();
            let cf = py.import("concurrent.futures").unwrap();
            assert!(e.get_type(py).is(cf.getattr("CancelledError").unwrap()));
            assert!(e.is_instance_of::<PyException>(py));
            assert_eq!(
                e.value(py).to_string(),
                "the task was cancelled before it ran"
            );
        });
    }

    #[test]
    fn timeout_is_timeout_error_with_the_seconds() {
        assert_eq!(
            raised::<PyTimeoutError>(CoreError::Timeout(1.5)),
            "async_array: task not finished after 1.5 s"
        );
    }

    #[test]
    fn panic_is_runtime_error_with_the_panic_message() {
        assert_eq!(
            raised::<PyRuntimeError>(CoreError::Panic("boom".into())),
            "async_array: Rust panic in a worker: boom"
        );
    }

    #[test]
    fn abandoned_is_runtime_error_that_names_fork() {
        let msg = raised::<PyRuntimeError>(CoreError::Abandoned);
        assert!(msg.starts_with("async_array: this task was running in the parent"));
        assert!(msg.contains("os.fork()"), "{msg}");
    }

    #[test]
    fn queued_at_fork_is_runtime_error_that_names_fork() {
        let msg = raised::<PyRuntimeError>(CoreError::QueuedAtFork);
        assert!(msg.starts_with("async_array: this task was queued in the parent"));
        assert!(msg.contains("os.fork()"), "{msg}");
    }

    #[test]
    fn thread_start_is_runtime_error_with_the_os_error_and_the_count() {
        let msg = raised::<PyRuntimeError>(CoreError::ThreadStart {
            error: "Resource temporarily unavailable (os error 11)".into(),
            threads: 7,
        });
        assert!(
            msg.starts_with("async_array: the pool could not start a thread (Resource temporarily unavailable (os error 11)) while all 7"),
            "{msg}"
        );
    }

    #[test]
    fn shut_down_is_runtime_error() {
        assert_eq!(
            raised::<PyRuntimeError>(CoreError::ShutDown),
            "async_array: the pool is shut down (interpreter exit); nothing new can run"
        );
    }

    #[test]
    fn invalid_argument_is_value_error_with_its_message() {
        assert_eq!(
            raised::<PyValueError>(CoreError::InvalidArgument("bad shape".into())),
            "bad shape"
        );
    }

    #[test]
    fn wrong_type_is_type_error_with_its_message() {
        assert_eq!(
            raised::<PyTypeError>(CoreError::WrongType("len() of a 0-d HostBuffer".into())),
            "len() of a 0-d HostBuffer"
        );
    }

    #[test]
    fn buffer_is_buffer_error_with_its_message() {
        assert_eq!(
            raised::<PyBufferError>(CoreError::Buffer("read-only".into())),
            "read-only"
        );
    }

    #[test]
    fn out_of_memory_is_memory_error_with_the_size() {
        assert_eq!(
            raised::<PyMemoryError>(CoreError::OutOfMemory(1 << 50)),
            format!(
                "async_array: could not allocate {} bytes of 64-byte-aligned host memory",
                1u64 << 50
            )
        );
    }

    #[test]
    fn cycle_is_wait_cycle_error_a_runtime_error_naming_the_cycle() {
        let labels = vec!["async_wrap(f)".to_owned(), "async_wrap(g)".to_owned()];
        let mut cycle = labels.clone();
        cycle.push(labels[0].clone());
        assert_eq!(
            raised::<WaitCycleError>(CoreError::Cycle {
                labels: cycle,
                index: 2
            }),
            "async_wrap(f): waiting on async_wrap(g) would never end: it waits on this task \
             (cycle: async_wrap(f) -> async_wrap(g) -> async_wrap(f))"
        );
        Python::attach(|py| {
            let e: PyErr = Error(CoreError::Cycle {
                labels: vec!["f".into(), "f".into()],
                index: 0,
            })
            .into();
            assert!(e.is_instance_of::<PyRuntimeError>(py));
            let value = e.value(py);
            let cycle: Vec<String> = value.getattr("cycle").unwrap().extract().unwrap();
            assert_eq!(cycle, ["f", "f"]);
            assert_eq!(
                value.getattr("index").unwrap().extract::<usize>().unwrap(),
                0
            );
        });
    }

    #[test]
    fn not_found_is_file_not_found_error_with_its_message() {
        assert_eq!(
            raised::<PyFileNotFoundError>(CoreError::NotFound("f.safetensors: gone".into())),
            "f.safetensors: gone"
        );
    }

    #[test]
    fn denied_is_permission_error_with_its_message() {
        assert_eq!(
            raised::<PyPermissionError>(CoreError::Denied("u: HTTP 403 (forbidden)".into())),
            "u: HTTP 403 (forbidden)"
        );
    }

    #[test]
    fn io_is_os_error_with_its_message() {
        assert_eq!(
            raised::<PyOSError>(CoreError::Io("f: bytes [8, 16): EIO".into())),
            "f: bytes [8, 16): EIO"
        );
    }

    #[test]
    fn an_os_error_number_picks_the_python_subclass_and_stays_its_errno() {
        let refused = std::io::Error::from_raw_os_error(libc::ECONNREFUSED);
        let err = CoreError::from_io("u: header (bytes [0, 8))", &refused);
        let CoreError::Os { errno, message } = &err else {
            panic!("expected CoreError::Os, got {err:?}");
        };
        // std's " (os error 111)" is dropped: Python shows "[Errno 111]" itself.
        assert_eq!(
            (*errno, message.as_str()),
            (
                libc::ECONNREFUSED,
                "u: header (bytes [0, 8)): Connection refused"
            )
        );
        Python::initialize();
        Python::attach(|py| {
            let e: PyErr = Error(err).into();
            let refused_type = py
                .import("builtins")
                .and_then(|b| b.getattr("ConnectionRefusedError"))
                .unwrap();
            assert!(e.value(py).is_instance(&refused_type).unwrap());
            let got: i32 = e.value(py).getattr("errno").unwrap().extract().unwrap();
            assert_eq!(got, libc::ECONNREFUSED);
        });
        let missing = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert!(
            matches!(CoreError::from_io("f", &missing), CoreError::NotFound(m) if m == "f: No such file or directory")
        );
        let custom = std::io::Error::other("cut");
        assert_eq!(
            CoreError::from_io("f", &custom),
            CoreError::Io("f: cut".into())
        );
    }

    #[test]
    fn format_is_value_error_with_its_message() {
        assert_eq!(
            raised::<PyValueError>(CoreError::Format("f: header is not a JSON object".into())),
            "f: header is not a JSON object"
        );
    }

    #[test]
    fn deadline_is_timeout_error_with_its_message() {
        assert_eq!(
            raised::<PyTimeoutError>(CoreError::Deadline("u: bytes [0, 8): past 2 s".into())),
            "u: bytes [0, 8): past 2 s"
        );
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
