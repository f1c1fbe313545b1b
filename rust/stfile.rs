//! `SafetensorsFile`: one safetensors file opened by the core (its header read
//! and validated), whose tensors are read without the GIL straight into
//! `HostBuffer`s. What `async_array.load_safetensors` drives from Python.

use crate::error::Error;
use crate::hostbuffer::HostBuffer;
use crate::http::{Http, RemoteFile};
use crate::safetensors::{LocalFile, ReadError, TensorInfo};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::io::ErrorKind;
use std::time::Duration;

/// A timeout in seconds as Python gives it (None: none; negative: zero).
fn duration(timeout: Option<f64>) -> Result<Option<Duration>, Error> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() => Err(Error::InvalidArgument(
            "timeout must be a number of seconds or None, got nan".into(),
        )),
        Some(t) => Ok(Some(
            Duration::try_from_secs_f64(t.max(0.0)).unwrap_or(Duration::MAX),
        )),
    }
}

fn io_error(err: std::io::Error) -> Error {
    match err.kind() {
        ErrorKind::NotFound => Error::NotFound(err.to_string()),
        ErrorKind::InvalidData => Error::Format(err.to_string()),
        _ => Error::Io(err.to_string()),
    }
}

impl From<ReadError> for Error {
    fn from(err: ReadError) -> Error {
        match err {
            ReadError::OutOfMemory(n) => Error::OutOfMemory(n),
            ReadError::Io(msg) => Error::Io(msg),
        }
    }
}

enum Backing {
    Local(LocalFile),
    Remote(RemoteFile),
}

/// A safetensors file (local, or over HTTP(S)) and its validated header.
#[pyclass(frozen, module = "async_array._core")]
pub struct SafetensorsFile {
    file: Backing,
}

impl SafetensorsFile {
    fn tensor_list(&self) -> &[TensorInfo] {
        match &self.file {
            Backing::Local(f) => &f.tensors,
            Backing::Remote(f) => &f.tensors,
        }
    }
}

#[pymethods]
impl SafetensorsFile {
    /// Opens the file at `source` (a path, or an `http://`/`https://` URL)
    /// and reads its header (one read of at most 64 KiB, a second for a
    /// longer header), detached from the interpreter. For a URL, `timeout`
    /// (seconds, None: none) bounds each request, retries included, and
    /// `retries` is how often a connection error or 5xx is retried.
    /// FileNotFoundError, OSError, TimeoutError, or ValueError for a
    /// malformed header.
    #[new]
    #[pyo3(signature = (source, *, timeout=None, retries=3))]
    fn new(
        py: Python<'_>,
        source: String,
        timeout: Option<f64>,
        retries: u32,
    ) -> Result<Self, Error> {
        let remote = source.starts_with("http://") || source.starts_with("https://");
        let file = if remote {
            let http = Http::new(duration(timeout)?, retries)?;
            Backing::Remote(py.detach(|| RemoteFile::open(&source, http))?)
        } else {
            Backing::Local(py.detach(|| LocalFile::open(&source)).map_err(io_error)?)
        };
        Ok(SafetensorsFile { file })
    }

    /// The path or URL it was opened with.
    #[getter]
    fn source(&self) -> &str {
        match &self.file {
            Backing::Local(f) => &f.path,
            Backing::Remote(f) => &f.url,
        }
    }

    /// The file's size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        match &self.file {
            Backing::Local(f) => f.len,
            Backing::Remote(f) => f.len,
        }
    }

    /// Whether reads are range requests (then neighbouring tensors are
    /// worth reading in one `read`).
    #[getter]
    fn remote(&self) -> bool {
        matches!(self.file, Backing::Remote(_))
    }

    /// The tensors in file order: `(name, safetensors dtype, numpy dtype name,
    /// shape, start, end)`, with absolute byte offsets, end exclusive.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .tensor_list()
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.dtype.name(),
                    t.dtype.numpy_name(),
                    PyTuple::new(py, &t.shape)?,
                    t.start,
                    t.end,
                )
                    .into_pyobject(py)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Reads the tensors at `indices` (positions in `tensors`) into new
    /// 64-byte-aligned `HostBuffer`s of the numpy dtypes `dtypes` (one each,
    /// of the tensor's itemsize), without the GIL: `pread` for a file, one
    /// range request for a URL (`indices` then in file order).
    fn read(
        &self,
        py: Python<'_>,
        indices: Vec<usize>,
        dtypes: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<HostBuffer>> {
        let tensors = self.tensor_list();
        let n = tensors.len();
        if let Some(&bad) = indices.iter().find(|&&i| i >= n) {
            return Err(Error::InvalidArgument(format!(
                "SafetensorsFile.read: index {bad} out of range for {n} tensors"
            ))
            .into());
        }
        if dtypes.len() != indices.len() {
            return Err(Error::InvalidArgument(format!(
                "SafetensorsFile.read: {} indices but {} dtypes",
                indices.len(),
                dtypes.len()
            ))
            .into());
        }
        let memories = py.detach(|| match &self.file {
            Backing::Local(f) => indices
                .iter()
                .map(|&i| f.read(i))
                .collect::<Result<Vec<_>, _>>()
                .map_err(Error::from),
            Backing::Remote(f) => f.read_group(&indices),
        })?;
        memories
            .into_iter()
            .zip(indices.iter().zip(&dtypes))
            .map(|(memory, (&i, dtype))| {
                let shape = tensors[i].shape.iter().map(|&d| d as usize).collect();
                HostBuffer::from_memory(memory, shape, dtype)
            })
            .collect()
    }
}

/// The first at most `max_bytes` bytes of `url` (a `model.safetensors.index.json`,
/// say): one range request, with `timeout` and `retries` as `SafetensorsFile`'s.
/// Returns `(bytes, total size)`: fewer bytes than the size means there is more.
#[pyfunction]
#[pyo3(signature = (url, max_bytes, *, timeout=None, retries=3))]
pub fn read_url_prefix(
    py: Python<'_>,
    url: String,
    max_bytes: u64,
    timeout: Option<f64>,
    retries: u32,
) -> Result<(Vec<u8>, u64), Error> {
    let http = Http::new(duration(timeout)?, retries)?;
    py.detach(|| {
        let mut out = Vec::new();
        let total = http.read_range(&url, 0, max_bytes.max(1), true, "prefix", &mut |b| {
            out.extend_from_slice(b)
        })?;
        Ok((out, total))
    })
}
