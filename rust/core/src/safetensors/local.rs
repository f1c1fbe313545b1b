//! A local safetensors file: opened, its header read with `pread`, and its
//! tensor bytes read with `preadv` straight into their destination.

use super::http::Failure;
use super::{count_tensor_bytes, header_len, parse_header, TensorInfo, FIRST_READ};
use crate::error::Error;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// Reads exactly `buf.len()` bytes at `offset` of `file` (`pread`, retried
/// on interruption and short reads). `what` names the read in errors.
pub fn pread_exact(
    file: &File,
    mut buf: &mut [u8],
    mut offset: u64,
    what: &str,
) -> Result<(), Error> {
    let total = buf.len();
    while !buf.is_empty() {
        match file.read_at(buf, offset) {
            Ok(0) => {
                return Err(Error::Format(format!(
                    "{what}: the file ended after {} of {total} bytes (it was truncated \
                     while being read?)",
                    total - buf.len()
                )))
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::from_io(what, &e)),
        }
    }
    Ok(())
}

/// An open local safetensors file and its validated header.
pub struct LocalFile {
    /// The path it was opened with.
    pub path: String,
    /// The open file.
    pub file: File,
    /// Its size in bytes.
    pub len: u64,
    /// Its tensors, in file order.
    pub tensors: Vec<TensorInfo>,
}

impl LocalFile {
    /// Opens `path` and reads its header: one read of at most [`FIRST_READ`]
    /// bytes, a second only for a longer header.
    pub fn open(path: &str) -> Result<LocalFile, Error> {
        let file = File::open(path).map_err(|e| Error::from_io(path, &e))?;
        let len = file.metadata().map_err(|e| Error::from_io(path, &e))?.len();
        let invalid = Error::Format;
        let mut first = vec![0u8; FIRST_READ.min(len) as usize];
        let what = format!("{path}: header (bytes [0, {}))", first.len());
        pread_exact(&file, &mut first, 0, &what)?;
        let n = header_len(path, &first, len).map_err(invalid)?;
        let json: Vec<u8> = if 8 + n <= first.len() as u64 {
            first[8..(8 + n) as usize].to_vec()
        } else {
            // Within the file (checked above), so never more than its size.
            let mut rest = vec![0u8; n as usize];
            pread_exact(
                &file,
                &mut rest,
                8,
                &format!("{path}: header (bytes [8, {}))", 8 + n),
            )?;
            rest
        };
        let tensors = parse_header(path, &json, len).map_err(invalid)?;
        Ok(LocalFile {
            path: path.to_owned(),
            file,
            len,
            tensors,
        })
    }
}

/// Reads exactly the bytes `iov` describes, from `offset` on (retried on
/// interruption and short reads). The failure says what went wrong, with
/// the OS's error number where it gave one.
pub fn preadv_exact(
    file: &std::fs::File,
    iov: &mut [libc::iovec],
    mut offset: u64,
) -> Result<(), Failure> {
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let mut done = 0usize;
    let mut first = 0usize;
    while first < iov.len() {
        let rest = &iov[first..];
        // SAFETY: every iovec points to writable memory of its length that
        // outlives the call.
        let n = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                rest.as_ptr(),
                rest.len() as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            let (text, errno) = crate::error::os_text(&e);
            return Err(Failure::os(text, errno));
        }
        let mut n = n as usize;
        if n == 0 {
            return Err(Failure::io(format!(
                "the file ended after {done} of {total} bytes (it was truncated while being read?)"
            )));
        }
        count_tensor_bytes(n as u64);
        done += n;
        offset += n as u64;
        while n > 0 && first < iov.len() {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: `n < iov_len`: still within the same memory.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
        while first < iov.len() && iov[first].iov_len == 0 {
            first += 1;
        }
    }
    Ok(())
}
