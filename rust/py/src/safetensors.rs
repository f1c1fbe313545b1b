//! `SafetensorsFile`: one safetensors file opened by the core (its header read
//! and validated), whose tensors are read without the GIL straight into
//! `HostBuffer`s. What `async_array.load_safetensors` drives from Python.

use crate::error::Error;
use crate::future::PyFuture;
use crate::host_buffer::HostBuffer;
use crate::interp::call_or_park;
use async_array_core::safetensors::http::{Credentials, Failure, Http, RemoteFile, Target};
use async_array_core::safetensors::local::LocalFile;
use async_array_core::safetensors::plan::{Plan, Wanted};
use async_array_core::safetensors::{Dtype, TensorInfo as CoreTensorInfo};
use async_array_core::time::timeout_from_secs;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use std::sync::Arc;

/// A source's headers in the order given: `(name, value)` pairs.
type Headers = Vec<(String, String)>;

/// `credentials=`: a Python callable `(url) -> list of (name, value)`
/// (`async_array._safetensors` wraps the user's, checks what it returns and
/// words its errors), called on the reading thread, attached to the
/// interpreter for the call. A TypeError stays one, a ValueError too; any
/// other exception becomes an OSError with its message.
struct PyCredentials(Py<PyAny>);

impl Credentials for PyCredentials {
    fn headers(&self, url: &str) -> Result<Headers, Failure> {
        Python::attach(|py| {
            let failed = |err: PyErr| {
                let what = err
                    .get_type(py)
                    .name()
                    .map_or_else(|_| "an exception".into(), |n| n.to_string());
                let text = err
                    .value(py)
                    .str()
                    .map_or_else(|_| String::new(), |s| s.to_string());
                // The checking wrapper's message names the call and the URL.
                let detail = if text.is_empty() { what } else { text };
                if err.is_instance_of::<PyTypeError>(py) {
                    Failure::wrong_type(detail)
                } else if err.is_instance_of::<PyValueError>(py) {
                    Failure::invalid(&detail)
                } else {
                    Failure::io(detail)
                }
            };
            let args = PyTuple::new(py, [url]).map_err(failed)?;
            let got = call_or_park(self.0.bind(py), &args, None).map_err(failed)?;
            got.extract::<Headers>().map_err(failed)
        })
    }
}

/// The target of a URL source: its headers, and its credentials when given.
fn target(url: &str, headers: Headers, credentials: Option<Py<PyAny>>) -> Result<Target, Error> {
    let credentials = credentials.map(|c| Arc::new(PyCredentials(c)) as Arc<dyn Credentials>);
    Ok(Target::new(url, headers, credentials)?)
}

/// One tensor of a safetensors file, as its header describes it.
#[pyclass(frozen, name = "TensorInfo", module = "async_array._core")]
#[derive(Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name in the header.
    #[pyo3(get)]
    name: String,
    /// Its safetensors dtype code (`"F32"`, `"BF16"`).
    #[pyo3(get)]
    dtype: &'static str,
    /// The numpy dtype of the same elements (`"float32"`, `"bfloat16"`).
    #[pyo3(get)]
    numpy_dtype: &'static str,
    shape: Vec<u64>,
    /// Its first byte, counted from the start of the file.
    #[pyo3(get)]
    start: u64,
    /// One past its last byte, counted from the start of the file.
    #[pyo3(get)]
    end: u64,
}

impl From<&CoreTensorInfo> for TensorInfo {
    fn from(t: &CoreTensorInfo) -> Self {
        TensorInfo {
            name: t.name.clone(),
            dtype: t.dtype.name(),
            numpy_dtype: t.dtype.numpy_name(),
            shape: t.shape.clone(),
            start: t.start,
            end: t.end,
        }
    }
}

#[pymethods]
impl TensorInfo {
    /// Its shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let name = PyString::new(py, &self.name).repr()?;
        let shape = self.shape(py)?.repr()?;
        Ok(format!(
            "TensorInfo(name={name}, dtype='{}', numpy_dtype='{}', shape={shape}, start={}, end={})",
            self.dtype, self.numpy_dtype, self.start, self.end
        ))
    }
}

/// One item of `SafetensorsFile.read`: tensor, numpy dtype, block bounds or None.
type Want<'py> = (usize, Bound<'py, PyAny>, Option<Vec<(u64, u64)>>);

enum Backing {
    Local(LocalFile),
    Remote(Box<RemoteFile>),
}

/// A safetensors file (local, or over HTTP(S)) and its validated header.
#[pyclass(frozen, module = "async_array._core")]
pub struct SafetensorsFile {
    file: Backing,
}

impl SafetensorsFile {
    fn tensor_list(&self) -> &[CoreTensorInfo] {
        match &self.file {
            Backing::Local(f) => &f.tensors,
            Backing::Remote(f) => &f.tensors,
        }
    }
}

#[pymethods]
impl SafetensorsFile {
    /// Opens the file at `source` (a path: str, bytes or os.PathLike; or an
    /// `http://`/`https://` URL)
    /// and reads its header (one read of at most 64 KiB, a second for a
    /// longer header), detached from the interpreter. For a URL, `timeout`
    /// (seconds, None: none) bounds each request, retries included, and
    /// `retries` is how often a connection error or 5xx is retried;
    /// `headers` (`(name, value)` pairs) go with every request to the URL's
    /// server (scheme, host and port), never to a redirect target on
    /// another; `credentials`, a callable `(url) -> [(name, value), ...]`,
    /// adds its headers the same way, called before the first request and
    /// again once after a 401 or 403; `name` is how messages and `source`
    /// name the file (default: the URL). Redirects are followed (at most 10)
    /// and the last location is where later reads go.
    /// FileNotFoundError, PermissionError (401, 403), OSError, TimeoutError,
    /// or ValueError for a malformed header.
    #[new]
    #[pyo3(signature = (source, *, timeout=None, retries=3, headers=Vec::new(), credentials=None, name=None))]
    fn new(
        py: Python<'_>,
        source: std::path::PathBuf,
        timeout: Option<f64>,
        retries: u32,
        headers: Headers,
        credentials: Option<Py<PyAny>>,
        name: Option<String>,
    ) -> Result<Self, Error> {
        // A path as the OS has it (str, bytes or os.PathLike, not only UTF-8);
        // a URL is text.
        let url = source
            .to_str()
            .filter(|s| s.starts_with("http://") || s.starts_with("https://"));
        let file = if let Some(url) = url {
            let http = Http::new(timeout_from_secs(timeout)?, retries)?;
            let target = target(url, headers, credentials)?;
            let name = name.as_deref().unwrap_or(url);
            Backing::Remote(Box::new(
                py.detach(|| RemoteFile::open(target, name, http))?,
            ))
        } else {
            Backing::Local(py.detach(|| LocalFile::open(&source))?)
        };
        Ok(SafetensorsFile { file })
    }

    /// The path or URL it was opened with (or the `name` it was given).
    #[getter]
    fn source(&self) -> &str {
        match &self.file {
            Backing::Local(f) => &f.path,
            Backing::Remote(f) => &f.name,
        }
    }

    /// False for a server that ignores range requests (it answered one with
    /// the whole file): each `read` then streams the file from its first
    /// byte, so one `read` should take every tensor wanted.
    #[getter]
    fn ranged(&self) -> bool {
        match &self.file {
            Backing::Local(_) => true,
            Backing::Remote(f) => f.ranged(),
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

    /// The tensors in file order, a `TensorInfo` each.
    #[getter]
    fn tensors(&self) -> Vec<TensorInfo> {
        self.tensor_list().iter().map(TensorInfo::from).collect()
    }

    /// The header's `__metadata__`: (key, value) string pairs, by key (empty
    /// when the header has none).
    #[getter]
    fn metadata(&self) -> Vec<(String, String)> {
        match &self.file {
            Backing::Local(f) => f.metadata.clone(),
            Backing::Remote(f) => f.metadata.clone(),
        }
    }

    /// Reads tensors or blocks of them into new 64-byte-aligned
    /// `HostBuffer`s, without the GIL. Each item of `wants` is
    /// `(tensor, dtype, bounds)`: `tensor` a position in `tensors`, `dtype`
    /// the numpy dtype of the buffer (the tensor's, of its itemsize, or
    /// another of float16, bfloat16, float32, float64 when the tensor is one
    /// of them: converted as it is read), `bounds` None for the whole tensor
    /// or a `(start, stop)` per axis for a block (a shard). `futures`, if
    /// given, has one `Future` a want: a want whose future has finished is
    /// not read (over HTTP, a request for finished wants only is not sent,
    /// or dropped while its body arrives). Returns, per item, its `HostBuffer` (of the block's shape)
    /// or the exception that item failed with, naming the file, the tensor,
    /// the block and its bytes: one item's failure fails no other item that
    /// was not in the same request.
    ///
    /// From a file, exactly the blocks' bytes are read (`preadv`, straight
    /// into each buffer); over HTTP, blocks at most 64 KiB apart share one
    /// range request.
    #[pyo3(signature = (wants, futures=None))]
    fn read(
        &self,
        py: Python<'_>,
        wants: Vec<Want<'_>>,
        futures: Option<Vec<PyRef<'_, PyFuture>>>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let tensors = self.tensor_list();
        let mut plan = Plan::default();
        for (tensor, dtype, bounds) in &wants {
            // The dtype asked for: another float type than the file's
            // converts while reading.
            let name: String = dtype.getattr("name")?.extract()?;
            let to = Dtype::from_numpy_name(&name);
            plan.add(tensors, *tensor, bounds.as_deref(), to)
                .map_err(Error)?;
        }
        // With `futures` (one a want), a want whose future has finished
        // (its leaf was cancelled) is not read: over HTTP a request whose
        // every want finished is not sent, or is dropped once in flight.
        if let Some(futures) = futures {
            plan.wanted = futures
                .iter()
                .map(|f| {
                    let f = f.core().clone();
                    Some(Wanted(Box::new(move || !f.is_finished())))
                })
                .collect();
        }
        plan.sort();
        let results = py.detach(|| match &self.file {
            Backing::Local(f) => plan.read_local(f),
            Backing::Remote(f) => plan.read_remote(f),
        });
        results
            .into_iter()
            .zip(plan.outputs.iter().zip(&wants))
            .map(|(result, (out, (_, dtype, _)))| match result {
                Ok(memory) => {
                    let shape = out.shape.iter().map(|&d| d as usize).collect();
                    let buffer = HostBuffer::from_memory(memory, shape, dtype)?;
                    Ok(Py::new(py, buffer)?.into_any())
                }
                Err(err) => Ok(PyErr::from(Error(err)).into_value(py).into_any()),
            })
            .collect()
    }
}

/// The first at most `max_bytes` bytes of `url` (a `model.safetensors.index.json`,
/// say): one range request, with `timeout`, `retries`, `headers`,
/// `credentials` and `name` as `SafetensorsFile`'s.
/// Returns `(bytes, total size)`: fewer bytes than the size means there is more.
#[pyfunction]
#[pyo3(signature = (url, max_bytes, *, timeout=None, retries=3, headers=Vec::new(), credentials=None, name=None))]
#[allow(clippy::too_many_arguments)]
pub fn read_url_prefix(
    py: Python<'_>,
    url: String,
    max_bytes: u64,
    timeout: Option<f64>,
    retries: u32,
    headers: Headers,
    credentials: Option<Py<PyAny>>,
    name: Option<String>,
) -> Result<(Vec<u8>, u64), Error> {
    let http = Http::new(timeout_from_secs(timeout)?, retries)?;
    let target = target(&url, headers, credentials)?;
    let name = name.as_deref().unwrap_or(&url);
    py.detach(|| {
        let mut out = Vec::new();
        let end = max_bytes.max(1);
        let total = http
            .read_range(&target, 0, end, true, None, &mut |b| {
                out.extend_from_slice(b);
                true
            })
            .map_err(|f| f.at(&format!("{name}: bytes [0, {end})")))?
            .total;
        Ok((out, total))
    })
}
