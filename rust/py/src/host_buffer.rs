//! `HostBuffer`: aligned host memory owned by the core, exposed to Python
//! through the buffer protocol (for `readinto`, `recv_into`, numpy views) and
//! through DLPack (for a zero-copy hand-off to JAX).

use crate::error::Error;
use async_array_core::buffer::{self, AlignedBuf};
use async_array_core::dlpack::{self, code, DLDataType};
use async_array_core::dlpack::{
    DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion, DLTensor, KDL_CPU,
};
use async_array_core::Error as CoreError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

static UNIT_STRIDE: [isize; 1] = [1];

static NUMPY_DTYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Types of one byte an element that ml_dtypes gives numpy and JAX builds
/// but DLPack cannot carry to JAX (its `int4`, `float4` are packed, two to a
/// byte, in XLA): held by their bytes, handed over with one copy.
pub const BYTE_TYPES_WITHOUT_DLPACK: [&str; 7] = [
    "int2",
    "uint2",
    "int4",
    "uint4",
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
];

/// A supported element type in DLPack and PEP 3118 terms.
struct ElementType {
    itemsize: usize,
    /// None for the types DLPack cannot carry to JAX ([`BYTE_TYPES_WITHOUT_DLPACK`]).
    code: Option<u8>,
    /// None for bfloat16 and the ml_dtypes kinds, which have no PEP 3118
    /// code (numpy views them through `__array__` instead).
    format: Option<&'static CStr>,
}

impl ElementType {
    /// The element type of a numpy dtype: bool, int8-64, uint8-64, float16,
    /// bfloat16, float32, float64, complex64 or complex128, in native byte
    /// order, or an ml_dtypes kind of one byte (every float8, float6, float4,
    /// int4, uint4, int2 and uint2).
    fn of(dtype: &Bound<'_, PyAny>) -> PyResult<Self> {
        let kind: char = dtype.getattr("kind")?.extract()?;
        let itemsize: usize = dtype.getattr("itemsize")?.extract()?;
        let native: bool = dtype.getattr("isnative")?.extract()?;
        let name = dtype.getattr("name")?.extract::<String>()?;
        if itemsize == 1 && matches!(kind, 'V' | 'f') {
            // ml_dtypes' kinds (numpy says 'f' for some, 'V' for others).
            let code = code::float8(&name);
            if code.is_some() || BYTE_TYPES_WITHOUT_DLPACK.contains(&name.as_str()) {
                return Ok(ElementType {
                    itemsize,
                    code,
                    format: None,
                });
            }
        }
        // numpy's own formats: 64-bit integers are 'l' where C long has 64 bits.
        let long64 = std::mem::size_of::<std::ffi::c_long>() == 8;
        let (code, format) = match (kind, itemsize) {
            ('b', 1) => (code::BOOL, Some(c"?")),
            ('i', 1) => (code::INT, Some(c"b")),
            ('i', 2) => (code::INT, Some(c"h")),
            ('i', 4) => (code::INT, Some(c"i")),
            ('i', 8) => (code::INT, Some(if long64 { c"l" } else { c"q" })),
            ('u', 1) => (code::UINT, Some(c"B")),
            ('u', 2) => (code::UINT, Some(c"H")),
            ('u', 4) => (code::UINT, Some(c"I")),
            ('u', 8) => (code::UINT, Some(if long64 { c"L" } else { c"Q" })),
            ('f', 2) => (code::FLOAT, Some(c"e")),
            ('f', 4) => (code::FLOAT, Some(c"f")),
            ('f', 8) => (code::FLOAT, Some(c"d")),
            ('c', 8) => (code::COMPLEX, Some(c"Zf")),
            ('c', 16) => (code::COMPLEX, Some(c"Zd")),
            ('V', 2) if name == "bfloat16" => (code::BFLOAT, None),
            _ => return Err(Self::unsupported(dtype).into()),
        };
        if !native {
            return Err(Self::unsupported(dtype).into());
        }
        Ok(ElementType {
            itemsize,
            code: Some(code),
            format,
        })
    }

    fn unsupported(dtype: &Bound<'_, PyAny>) -> Error {
        let name = dtype
            .str()
            .map_or_else(|_| "?".to_owned(), |s| s.to_string());
        Error(CoreError::WrongType(format!(
            "dtype {name} is not supported: a HostBuffer holds bool, int8-int64, \
             uint8-uint64, float16, bfloat16, float32, float64, complex64 or \
             complex128, in native byte order, and by their bytes {}, {} and \
             the float8 kinds of ml_dtypes",
            BYTE_TYPES_WITHOUT_DLPACK[..BYTE_TYPES_WITHOUT_DLPACK.len() - 1].join(", "),
            BYTE_TYPES_WITHOUT_DLPACK[BYTE_TYPES_WITHOUT_DLPACK.len() - 1],
        )))
    }
}

/// 64-byte-aligned, C-contiguous host memory of a fixed shape and dtype.
#[pyclass(frozen, module = "async_array._core")]
pub struct HostBuffer {
    memory: Arc<AlignedBuf>,
    shape: Vec<usize>,
    dtype: Py<PyAny>,
    itemsize: usize,
    /// PEP 3118 format, when the dtype has one (bfloat16 has none).
    format: Option<&'static CStr>,
    /// None for the types DLPack cannot carry to JAX: `__dlpack__` refuses them.
    dl_dtype: Option<DLDataType>,
    /// Element-typed shape and strides, in bytes, for typed buffer views.
    view_shape: Vec<isize>,
    view_strides: Vec<isize>,
    /// The same memory as flat bytes, for views that ask for no format.
    byte_shape: [isize; 1],
    exported: AtomicBool,
}

impl HostBuffer {
    pub fn nbytes(&self) -> usize {
        self.memory.len()
    }

    /// A buffer over `memory` already filled by the core (a tensor read from
    /// a file or a socket), viewed as `shape` elements of the numpy `dtype`.
    pub fn from_memory(
        memory: AlignedBuf,
        shape: Vec<usize>,
        dtype: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let dtype = NUMPY_DTYPE
            .import(dtype.py(), "numpy", "dtype")?
            .call1((dtype,))?;
        let element = ElementType::of(&dtype)?;
        let needed = shape
            .iter()
            .try_fold(element.itemsize, |acc, &d| acc.checked_mul(d));
        if needed != Some(memory.len()) {
            return Err(Error(CoreError::InvalidArgument(format!(
                "HostBuffer: {} bytes cannot hold shape {shape:?} of itemsize {}",
                memory.len(),
                element.itemsize
            )))
            .into());
        }
        Ok(Self::with_memory(memory, shape, dtype.unbind(), element))
    }

    /// The DLPack type of the elements; a `BufferError` for the types that
    /// have none JAX takes.
    fn dlpack_type(&self, py: Python<'_>) -> Result<DLDataType, Error> {
        self.dl_dtype.ok_or_else(|| {
            let name = self
                .dtype
                .bind(py)
                .str()
                .map_or_else(|_| "?".to_owned(), |s| s.to_string());
            Error(CoreError::Buffer(format!(
                "HostBuffer.__dlpack__: dtype {name} has no DLPack type that JAX takes \
                 (XLA packs it, two or more to a byte); np.asarray(buf) views it"
            )))
        })
    }

    fn with_memory(
        memory: AlignedBuf,
        shape: Vec<usize>,
        dtype: Py<PyAny>,
        element: ElementType,
    ) -> Self {
        let itemsize = element.itemsize;
        let nbytes = memory.len();
        let mut view_strides = vec![0isize; shape.len()];
        let mut stride = itemsize as isize;
        for (s, &d) in view_strides.iter_mut().zip(&shape).rev() {
            *s = stride;
            stride *= d as isize;
        }
        HostBuffer {
            memory: Arc::new(memory),
            view_shape: shape.iter().map(|&d| d as isize).collect(),
            shape,
            dtype,
            itemsize,
            format: element.format,
            dl_dtype: element.code.map(|code| DLDataType {
                code,
                bits: (itemsize * 8) as u8,
                lanes: 1,
            }),
            view_strides,
            byte_shape: [nbytes as isize],
            exported: AtomicBool::new(false),
        }
    }
}

#[pymethods]
impl HostBuffer {
    /// Allocates an uninitialised buffer of `shape` elements of `dtype` (what
    /// `async_array.empty` calls). The buffer works out its DLPack type and
    /// PEP 3118 format from the dtype itself, so no description given from
    /// outside can make an export claim more bytes than were allocated.
    #[new]
    fn new(shape: Vec<isize>, dtype: &Bound<'_, PyAny>) -> PyResult<Self> {
        let dtype = NUMPY_DTYPE
            .import(dtype.py(), "numpy", "dtype")?
            .call1((dtype,))?;
        let element = ElementType::of(&dtype)?;
        let itemsize = element.itemsize;
        if shape.iter().any(|&d| d < 0) {
            return Err(Error(CoreError::InvalidArgument(format!(
                "HostBuffer: negative dimension in shape {shape:?}"
            )))
            .into());
        }
        let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        let nbytes = shape
            .iter()
            .try_fold(itemsize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= isize::MAX as usize)
            .ok_or_else(|| {
                Error(CoreError::InvalidArgument(format!(
                    "HostBuffer of shape {shape:?} and itemsize {itemsize} overflows the address space"
                )))
            })?;
        let memory = AlignedBuf::uninit(nbytes).ok_or(Error(CoreError::OutOfMemory(nbytes)))?;
        Ok(Self::with_memory(memory, shape, dtype.unbind(), element))
    }

    /// The shape, in elements.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The numpy dtype of the elements.
    #[getter]
    fn dtype(&self, py: Python<'_>) -> Py<PyAny> {
        self.dtype.clone_ref(py)
    }

    #[getter]
    fn ndim(&self) -> usize {
        self.shape.len()
    }

    #[getter]
    fn size(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size in bytes.
    #[getter(nbytes)]
    fn py_nbytes(&self) -> usize {
        self.nbytes()
    }

    #[getter]
    fn itemsize(&self) -> usize {
        self.itemsize
    }

    /// Address of the first byte (a multiple of 64).
    #[getter]
    fn address(&self) -> usize {
        self.memory.as_ptr() as usize
    }

    /// True once the memory was handed to JAX: new writable views are refused.
    #[getter]
    fn exported(&self) -> bool {
        self.exported.load(Ordering::Acquire)
    }

    /// Marks the memory as handed over: from now on only read-only views.
    fn mark_exported(&self) {
        self.exported.store(true, Ordering::Release);
    }

    fn __len__(&self) -> Result<usize, Error> {
        self.shape
            .first()
            .copied()
            .ok_or_else(|| Error(CoreError::WrongType("len() of a 0-d HostBuffer".into())))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let dtype = self.dtype.bind(py).str()?;
        let state = if self.exported() { ", exported" } else { "" };
        let dims: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        let shape = match dims.len() {
            1 => format!("({},)", dims[0]),
            _ => format!("({})", dims.join(", ")),
        };
        Ok(format!(
            "HostBuffer(shape={shape}, dtype={dtype}, nbytes={}{state})",
            self.nbytes()
        ))
    }

    /// DLPack export (the array API's `__dlpack__`), CPU only.
    ///
    /// - `copy=True`: a copy of the bytes in new memory that the consumer alone
    ///   owns, writable (flagged `IS_COPIED` in the versioned layout); this
    ///   buffer is left as it was.
    /// - otherwise (zero-copy): the first export hands the memory over (the
    ///   buffer is marked exported, as when a loader returns it). Once
    ///   exported, the memory belongs to a `jax.Array` and is read-only: a
    ///   consumer that asks with `max_version >= (1, 0)` gets the versioned
    ///   capsule flagged `READ_ONLY` (numpy >= 2.1 then makes a read-only
    ///   array); a legacy consumer, which cannot be told, gets a `BufferError`.
    ///
    /// The versioned layout (`dltensor_versioned`) is used whenever the
    /// consumer passes `max_version >= (1, 0)`.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let this = slf.get();
        if stream.is_some_and(|s| !s.is_none()) {
            return Err(Error(CoreError::Buffer(
                "HostBuffer.__dlpack__: host memory takes no stream; pass stream=None".into(),
            ))
            .into());
        }
        if let Some(dev) = dl_device {
            let cpu = (dlpack::KDL_CPU, 0);
            if dev != cpu {
                return Err(Error(CoreError::Buffer(format!(
                    "HostBuffer.__dlpack__: memory is on the CPU (device {cpu:?}); dl_device={dev:?} asks for another"
                )))
                .into());
            }
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        // Refused before anything changes: a refused export hands nothing over.
        let dl_dtype = this.dlpack_type(slf.py())?;
        if copy == Some(true) {
            let memory = this
                .memory
                .try_clone()
                .ok_or(Error(CoreError::OutOfMemory(this.nbytes())))?;
            return export(
                slf.py(),
                Export {
                    memory: &Arc::new(memory),
                    shape: &this.shape,
                    dtype: dl_dtype,
                    versioned,
                    flags: if versioned { dlpack::FLAG_IS_COPIED } else { 0 },
                },
            );
        }
        // One thread wins the hand-over; every later export is read-only.
        let was_exported = this.exported.swap(true, Ordering::AcqRel);
        if was_exported && !versioned {
            return Err(Error(CoreError::Buffer(
                "HostBuffer.__dlpack__: the buffer was handed to JAX and is read-only, and a \
                 consumer that passes no max_version (DLPack < 1.0) cannot be told so. Ask \
                 with max_version=(1, 0) for a read-only export (np.from_dlpack does from \
                 numpy 2.1), with copy=True for a writable copy, or use np.asarray(buf) \
                 (a read-only view) or the jax.Array itself"
                    .into(),
            ))
            .into());
        }
        export(
            slf.py(),
            Export {
                memory: &this.memory,
                shape: &this.shape,
                dtype: dl_dtype,
                versioned,
                flags: if was_exported {
                    dlpack::FLAG_READ_ONLY
                } else {
                    0
                },
            },
        )
    }

    /// The zero-copy hand-off to JAX: a legacy DLPack capsule of the memory
    /// (the layout every JAX reads), whether or not the buffer was exported
    /// before (JAX never writes an array's memory). Marks the buffer exported.
    fn jax_capsule<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let dl_dtype = self.dlpack_type(py)?;
        self.mark_exported();
        export(
            py,
            Export {
                memory: &self.memory,
                shape: &self.shape,
                dtype: dl_dtype,
                versioned: false,
                flags: 0,
            },
        )
    }

    /// A numpy view of the memory (no copy unless `copy=True` or another `dtype`
    /// is asked for; that with `copy=False` is a ValueError, as numpy 2 asks).
    /// Read-only once the buffer is exported. numpy takes the buffer protocol
    /// first; this serves dtypes that have no PEP 3118 code.
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let bytes = ByteView {
            owner: slf.clone().unbind(),
        };
        let np = py.import("numpy")?;
        let mut array = np
            .call_method1("asarray", (Py::new(py, bytes)?,))?
            .call_method1("view", (this.dtype.bind(py),))?
            .call_method1("reshape", (PyTuple::new(py, &this.shape)?,))?;
        let wanted = dtype.filter(|d| !d.is_none());
        if let Some(wanted) = wanted {
            let wanted = np.getattr("dtype")?.call1((wanted,))?;
            if !wanted.eq(this.dtype.bind(py))? {
                if copy == Some(false) {
                    return Err(Error(CoreError::InvalidArgument(format!(
                        "HostBuffer: a {} view of {} memory needs a copy, and copy=False forbids one",
                        wanted.str()?,
                        this.dtype.bind(py).str()?
                    )))
                    .into());
                }
                return array.call_method1("astype", (wanted,));
            }
        }
        if copy == Some(true) {
            array = array.call_method0("copy")?;
        }
        Ok(array)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (dlpack::KDL_CPU, 0)
    }

    /// Buffer protocol. With a format request, a typed N-d view (refused for
    /// dtypes that have no PEP 3118 code, so numpy falls back to `__array__`);
    /// without one, flat bytes, which is what `readinto` and `recv_into` ask for.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        if view.is_null() {
            return Err(Error(CoreError::Buffer("HostBuffer: no view to fill".into())).into());
        }
        let writable = flags & ffi::PyBUF_WRITABLE != 0;
        let exported = this.exported();
        if writable && exported {
            return Err(Error(CoreError::Buffer(
                "HostBuffer was handed to JAX (zero-copy) and is now read-only; \
                 allocate a new buffer with async_array.empty() to write"
                    .into(),
            ))
            .into());
        }
        let typed = flags & ffi::PyBUF_FORMAT != 0;
        if typed && this.format.is_none() {
            return Err(Error(CoreError::Buffer(
                "HostBuffer: this dtype has no PEP 3118 format; use np.asarray(buf)".into(),
            ))
            .into());
        }
        // SAFETY: `view` is non-null (checked); every pointer stored in it
        // points into `this`, which the view keeps alive through `obj`.
        unsafe {
            let v = &mut *view;
            v.buf = this.memory.as_ptr().cast();
            v.len = this.nbytes() as isize;
            v.readonly = exported as c_int;
            v.suboffsets = std::ptr::null_mut();
            v.internal = std::ptr::null_mut();
            if typed {
                v.itemsize = this.itemsize as isize;
                v.format = this
                    .format
                    .as_ref()
                    .map_or(std::ptr::null(), |f| f.as_ptr()) as *mut _;
                v.ndim = this.shape.len() as c_int;
                v.shape = this.view_shape.as_ptr() as *mut _;
                v.strides = this.view_strides.as_ptr() as *mut _;
            } else {
                v.itemsize = 1;
                v.format = std::ptr::null_mut();
                v.ndim = 1;
                v.shape = if flags & ffi::PyBUF_ND != 0 {
                    this.byte_shape.as_ptr() as *mut _
                } else {
                    std::ptr::null_mut()
                };
                v.strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                    UNIT_STRIDE.as_ptr() as *mut _
                } else {
                    std::ptr::null_mut()
                };
            }
            v.obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// The memory of a `HostBuffer` as flat bytes, through numpy's
/// `__array_interface__`; the numpy array it makes keeps the buffer alive.
#[pyclass(frozen, module = "async_array._core")]
struct ByteView {
    owner: Py<HostBuffer>,
}

#[pymethods]
impl ByteView {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let buf = self.owner.get();
        let d = PyDict::new(py);
        d.set_item("shape", (buf.nbytes(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (buf.memory.as_ptr() as usize, buf.exported()))?;
        d.set_item("version", 3)?;
        Ok(d)
    }
}

/// Whether buffers from 4 MiB on ask for transparent huge pages in this
/// process (see `buffer`: not where a VM's balloon reports free pages, unless
/// `ASYNC_ARRAY_HUGE_PAGES` says otherwise).
#[pyfunction]
pub fn huge_pages() -> bool {
    buffer::huge_pages()
}

// DLPack export: the legacy `DLManagedTensor` in a capsule named `dltensor`,
// and `DLManagedTensorVersioned` in one named `dltensor_versioned` for
// consumers that ask with `max_version >= (1, 0)`. A consumer renames the
// capsule to `used_...` and calls the deleter when it lets go, from any
// thread, with or without the GIL; the deleter only drops an `Arc`, so no
// Python is involved.

/// What a tensor export keeps alive: the memory and the shape it points at.
struct Owner {
    _memory: Arc<AlignedBuf>,
    shape: Vec<i64>,
}

/// A managed tensor and its owner in one allocation, freed by its deleter.
#[repr(C)]
struct Holder<M> {
    managed: M,
    owner: Owner,
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    if !managed.is_null() {
        // SAFETY: `managed` is the first field of a boxed `Holder` made in `export`.
        drop(unsafe { Box::from_raw(managed.cast::<Holder<DLManagedTensor>>()) });
    }
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    if !managed.is_null() {
        // SAFETY: as above.
        drop(unsafe { Box::from_raw(managed.cast::<Holder<DLManagedTensorVersioned>>()) });
    }
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// Frees an export nobody consumed (the capsule still has its first name).
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython calls this with a live capsule; the name checks tell which
    // layout (if any) it still owns, and never set an error when they fail.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            delete_legacy(m);
        } else if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            delete_versioned(m);
        }
    }
}

/// A C-contiguous CPU tensor to export.
pub struct Export<'a> {
    pub memory: &'a Arc<AlignedBuf>,
    pub shape: &'a [usize],
    pub dtype: DLDataType,
    /// `DLManagedTensorVersioned` (DLPack >= 1.0) rather than the legacy layout.
    pub versioned: bool,
    /// `FLAG_*` bits; only the versioned layout can carry them.
    pub flags: u64,
}

/// Wraps `export` in a DLPack capsule that keeps its memory alive.
pub fn export<'py>(py: Python<'py>, export: Export<'_>) -> PyResult<Bound<'py, PyAny>> {
    debug_assert!(
        export.versioned || export.flags == 0,
        "the legacy layout has no flags"
    );
    let mut owner = Owner {
        _memory: Arc::clone(export.memory),
        shape: export.shape.iter().map(|&d| d as i64).collect(),
    };
    let tensor = DLTensor {
        data: export.memory.as_ptr().cast(),
        device: DLDevice {
            device_type: KDL_CPU,
            device_id: 0,
        },
        ndim: owner.shape.len() as i32,
        dtype: export.dtype,
        shape: owner.shape.as_mut_ptr(),
        // NULL strides means C-contiguous (DLPack >= 0.2).
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    let (ptr, name): (*mut c_void, &'static CStr) = if export.versioned {
        let holder = Box::new(Holder {
            managed: DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 1 },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags: export.flags,
                dl_tensor: tensor,
            },
            owner,
        });
        (Box::into_raw(holder).cast(), VERSIONED)
    } else {
        let holder = Box::new(Holder {
            managed: DLManagedTensor {
                dl_tensor: tensor,
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            },
            owner,
        });
        (Box::into_raw(holder).cast(), LEGACY)
    };
    // SAFETY: `ptr` is a live boxed holder whose layout `name` tells; the capsule
    // destructor frees it unless a consumer renamed the capsule (then the
    // consumer calls the deleter).
    unsafe {
        let capsule = ffi::PyCapsule_New(
            ptr,
            name.as_ptr() as *const c_char,
            Some(capsule_destructor),
        );
        if capsule.is_null() {
            if export.versioned {
                delete_versioned(ptr.cast());
            } else {
                delete_legacy(ptr.cast());
            }
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule))
    }
}
