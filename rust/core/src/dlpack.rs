//! The DLPack ABI: the `repr(C)` structs, type codes and flags of
//! `dlpack.h` v1.1 (<https://github.com/dmlc/dlpack>), the legacy
//! `DLManagedTensor` and the versioned `DLManagedTensorVersioned`. Data only:
//! the bindings put them in Python capsules.

use std::ffi::c_void;

/// `kDLCPU`: the DLPack device type of host memory.
pub const KDL_CPU: i32 = 1;

/// `DLPACK_FLAG_BITMASK_READ_ONLY` (DLPack >= 1.0): the consumer must not write.
pub const FLAG_READ_ONLY: u64 = 1 << 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED` (DLPack >= 1.0): the memory is a copy that
/// the consumer alone owns.
pub const FLAG_IS_COPIED: u64 = 1 << 1;

/// DLPack type codes (`DLDataTypeCode`).
pub mod code {
    /// `kDLInt`: signed integers.
    pub const INT: u8 = 0;
    /// `kDLUInt`: unsigned integers.
    pub const UINT: u8 = 1;
    /// `kDLFloat`: IEEE floats.
    pub const FLOAT: u8 = 2;
    /// `kDLBfloat`: bfloat16.
    pub const BFLOAT: u8 = 4;
    /// `kDLComplex`: complex floats.
    pub const COMPLEX: u8 = 5;
    /// `kDLBool`: booleans.
    pub const BOOL: u8 = 6;
    /// `kDLFloat8_e3m4` (DLPack 1.1), and the float8 kinds after it, one byte each.
    pub const FLOAT8_E3M4: u8 = 7;
    /// `kDLFloat8_e4m3`.
    pub const FLOAT8_E4M3: u8 = 8;
    /// `kDLFloat8_e4m3b11fnuz`.
    pub const FLOAT8_E4M3B11FNUZ: u8 = 9;
    /// `kDLFloat8_e4m3fn`.
    pub const FLOAT8_E4M3FN: u8 = 10;
    /// `kDLFloat8_e4m3fnuz`.
    pub const FLOAT8_E4M3FNUZ: u8 = 11;
    /// `kDLFloat8_e5m2`.
    pub const FLOAT8_E5M2: u8 = 12;
    /// `kDLFloat8_e5m2fnuz`.
    pub const FLOAT8_E5M2FNUZ: u8 = 13;
    /// `kDLFloat8_e8m0fnu`.
    pub const FLOAT8_E8M0FNU: u8 = 14;

    /// The DLPack code of a float8 kind by its numpy (ml_dtypes) name.
    pub fn float8(name: &str) -> Option<u8> {
        Some(match name {
            "float8_e3m4" => FLOAT8_E3M4,
            "float8_e4m3" => FLOAT8_E4M3,
            "float8_e4m3b11fnuz" => FLOAT8_E4M3B11FNUZ,
            "float8_e4m3fn" => FLOAT8_E4M3FN,
            "float8_e4m3fnuz" => FLOAT8_E4M3FNUZ,
            "float8_e5m2" => FLOAT8_E5M2,
            "float8_e5m2fnuz" => FLOAT8_E5M2FNUZ,
            "float8_e8m0fnu" => FLOAT8_E8M0FNU,
            _ => return None,
        })
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// `DLDevice`: where the memory is.
pub struct DLDevice {
    /// `DLDeviceType` ([`KDL_CPU`] here).
    pub device_type: i32,
    /// Which device of that type (0 for host memory).
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// `DLDataType`: an element type.
pub struct DLDataType {
    /// A [`code`] value.
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes per element (1: not a vector type).
    pub lanes: u16,
}

#[repr(C)]
/// `DLTensor`: a view of memory as an n-d array.
pub struct DLTensor {
    /// The first byte.
    pub data: *mut c_void,
    /// Where `data` is.
    pub device: DLDevice,
    /// How many axes.
    pub ndim: i32,
    /// The element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for C-contiguous.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

#[repr(C)]
/// `DLManagedTensor`: the legacy (pre-1.0) exported tensor.
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context (unused here: the deleter finds its owner by address).
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when it lets go.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
/// `DLPackVersion`.
pub struct DLPackVersion {
    /// Major version (1).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

#[repr(C)]
/// `DLManagedTensorVersioned`: the exported tensor of DLPack >= 1.0.
pub struct DLManagedTensorVersioned {
    /// The ABI version it follows.
    pub version: DLPackVersion,
    /// The producer's context (unused here).
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when it lets go.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `FLAG_*` bits.
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}
