//! DLPack export of host memory (the `__dlpack__` protocol).
//!
//! Layouts follow `dlpack.h` v1.1 (<https://github.com/dmlc/dlpack>): the legacy
//! `DLManagedTensor` in a capsule named `dltensor`, and `DLManagedTensorVersioned`
//! in one named `dltensor_versioned` for consumers that ask with
//! `max_version >= (1, 0)`. A consumer renames the capsule to `used_...` and
//! calls the deleter when it lets go, from any thread, with or without the GIL;
//! the deleter only drops an `Arc`, so no Python is involved.

use crate::buffer::AlignedBuf;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Arc;

/// `kDLCPU`: the DLPack device type of host memory.
pub const KDL_CPU: i32 = 1;

/// `DLPACK_FLAG_BITMASK_READ_ONLY` (DLPack >= 1.0): the consumer must not write.
pub const FLAG_READ_ONLY: u64 = 1 << 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED` (DLPack >= 1.0): the memory is a copy that
/// the consumer alone owns.
pub const FLAG_IS_COPIED: u64 = 1 << 1;

/// DLPack type codes (`DLDataTypeCode`).
pub mod code {
    pub const INT: u8 = 0;
    pub const UINT: u8 = 1;
    pub const FLOAT: u8 = 2;
    pub const BFLOAT: u8 = 4;
    pub const COMPLEX: u8 = 5;
    pub const BOOL: u8 = 6;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

#[repr(C)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

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
