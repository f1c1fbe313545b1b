//! The core's error enum: what the pool, the futures and the safetensors
//! readers can fail with. The Python bindings map each variant to one
//! exception type; the core knows nothing of Python.

use std::fmt;

/// Everything the core itself can fail with. The variants that carry a
/// message carry all of it: the call site knows what was asked and what was
/// wrong. Each variant's doc names the Python exception the bindings make of it.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// The future was cancelled before it ran: `concurrent.futures.CancelledError`.
    Cancelled,
    /// A wait ran out of time (the timeout, in seconds): `TimeoutError`.
    Timeout(f64),
    /// Rust code panicked while running a task: `RuntimeError`.
    Panic(String),
    /// The task was running in the parent when `os.fork()` made this process:
    /// `RuntimeError`.
    Abandoned,
    /// The task was queued in the parent when `os.fork()` made this process; it
    /// runs there, not here: `RuntimeError`.
    QueuedAtFork,
    /// No pool thread could start (the OS error) while all `threads` were
    /// blocked waiting on queued work, so the task would never run: `RuntimeError`.
    ThreadStart {
        /// The OS error that refused the thread.
        error: String,
        /// How many threads the pool had, all blocked.
        threads: usize,
    },
    /// The pool is shut down (interpreter exit); nothing new runs: `RuntimeError`.
    ShutDown,
    /// An argument's value is out of its domain: `ValueError`.
    InvalidArgument(String),
    /// An argument or receiver of a type the operation does not take: `TypeError`.
    WrongType(String),
    /// A buffer view or DLPack export that cannot be honoured: `BufferError`.
    Buffer(String),
    /// An allocation of this many bytes of host memory failed: `MemoryError`.
    OutOfMemory(usize),
    /// A pool task started a wait that can only end once the task itself goes
    /// on: `WaitCycleError` (a `RuntimeError`). `labels` run from the waiting
    /// task back to it; `index` is the waited-on future that leads back.
    Cycle {
        /// How messages name each task of the cycle, the waiting one first and last.
        labels: Vec<String>,
        /// Which of the waited-on futures leads back.
        index: usize,
    },
    /// A file or URL that is not there (the message names it): `FileNotFoundError`.
    NotFound(String),
    /// A server refused a request (HTTP 401 or 403; the message names the
    /// URL): `PermissionError`.
    Denied(String),
    /// Reading a file or URL failed (the message says what, where, which
    /// bytes): `OSError`.
    Io(String),
    /// As `Io`, where the OS gave an error number: `OSError(errno, message)`,
    /// which Python makes the subclass for it (`ConnectionRefusedError` for
    /// `ECONNREFUSED`, `PermissionError` for `EACCES`), as `open()` and
    /// `socket` raise them.
    Os {
        /// The OS's error number.
        errno: i32,
        /// What failed, and the OS's text for the number.
        message: String,
    },
    /// Data that does not follow its format (a malformed safetensors header):
    /// `ValueError`.
    Format(String),
    /// A request ran past its deadline (the message says which): `TimeoutError`.
    Deadline(String),
    /// A value that the dtype it is converted to cannot hold (the message
    /// says which, where, and the two dtypes): `OverflowError`.
    Overflow(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Cancelled => write!(f, "the task was cancelled before it ran"),
            Error::Timeout(seconds) => write!(f, "task not finished after {seconds} s"),
            Error::Panic(msg) => write!(f, "Rust panic in a worker: {msg}"),
            Error::Abandoned => write!(
                f,
                "the task was running in the parent process when it forked"
            ),
            Error::QueuedAtFork => write!(
                f,
                "the task was queued in the parent process when it forked; it runs there"
            ),
            Error::ThreadStart { error, threads } => write!(
                f,
                "the pool could not start a thread ({error}) while all {threads} of its \
                 threads were blocked waiting on queued work"
            ),
            Error::ShutDown => write!(f, "the pool is shut down; nothing new can run"),
            Error::OutOfMemory(bytes) => write!(
                f,
                "could not allocate {bytes} bytes of {}-byte-aligned memory",
                crate::buffer::ALIGN
            ),
            Error::Cycle { labels, .. } => {
                write!(
                    f,
                    "a wait that would never end (cycle: {})",
                    labels.join(" -> ")
                )
            }
            Error::InvalidArgument(msg)
            | Error::WrongType(msg)
            | Error::Buffer(msg)
            | Error::NotFound(msg)
            | Error::Denied(msg)
            | Error::Io(msg)
            | Error::Os { message: msg, .. }
            | Error::Format(msg)
            | Error::Deadline(msg)
            | Error::Overflow(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for Error {}

/// An I/O error's text without std's " (os error N)" suffix, and N: Python
/// shows the number itself (`[Errno N]`) once it is the exception's errno.
pub fn os_text(e: &std::io::Error) -> (String, Option<i32>) {
    let text = e.to_string();
    match e.raw_os_error() {
        Some(n) => {
            let suffix = format!(" (os error {n})");
            (
                text.strip_suffix(&suffix).unwrap_or(&text).to_owned(),
                Some(n),
            )
        }
        None => (text, None),
    }
}

impl Error {
    /// An I/O error of `what` (a path and what was read): `NotFound` for a
    /// missing file, `Os` where the OS gave its number, else `Io`.
    pub fn from_io(what: &str, e: &std::io::Error) -> Error {
        let (text, errno) = os_text(e);
        let message = format!("{what}: {text}");
        match (e.kind(), errno) {
            (std::io::ErrorKind::NotFound, _) => Error::NotFound(message),
            (_, Some(errno)) => Error::Os { errno, message },
            (_, None) => Error::Io(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_io_picks_not_found_os_or_io_and_drops_the_os_error_suffix() {
        let refused = std::io::Error::from_raw_os_error(libc::ECONNREFUSED);
        assert_eq!(
            Error::from_io("u: header (bytes [0, 8))", &refused),
            Error::Os {
                errno: libc::ECONNREFUSED,
                message: "u: header (bytes [0, 8)): Connection refused".into()
            }
        );
        let missing = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(
            Error::from_io("f", &missing),
            Error::NotFound("f: No such file or directory".into())
        );
        let custom = std::io::Error::other("cut");
        assert_eq!(Error::from_io("f", &custom), Error::Io("f: cut".into()));
    }

    #[test]
    fn display_is_the_message_a_variant_carries() {
        assert_eq!(Error::Format("f: bad".into()).to_string(), "f: bad");
        assert_eq!(
            Error::Timeout(1.5).to_string(),
            "task not finished after 1.5 s"
        );
    }
}
