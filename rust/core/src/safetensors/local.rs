//! A local safetensors file: opened, its header read with `pread`, and its
//! tensor bytes read with `preadv` straight into their destination.

use super::http::Failure;
use super::{
    count_tensor_bytes, header_len, parse_header_and_metadata, Metadata, TensorInfo, FIRST_READ,
};
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
    /// The path it was opened with (lossy where it is not UTF-8).
    pub path: String,
    /// The open file.
    pub file: File,
    /// Its size in bytes when the header was read.
    pub len: u64,
    /// Its tensors, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Its header's `__metadata__`.
    pub metadata: Metadata,
    /// The modification time when the header was read: with `len`, what a
    /// later read checks the file against (see [`LocalFile::changed`]).
    pub modified: Option<std::time::SystemTime>,
}

impl LocalFile {
    /// Opens `path` and reads its header: one read of at most [`FIRST_READ`]
    /// bytes, a second only for a longer header.
    ///
    /// Anything but a regular file is refused: opening a FIFO for reading
    /// would block until a writer came (so it is opened non-blocking, then
    /// checked), and a device or socket has no stable size to check reads by.
    pub fn open(path: &std::path::Path) -> Result<LocalFile, Error> {
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path);
        // Messages show a path that is not UTF-8 with its bytes replaced.
        let shown = path.to_string_lossy();
        let path: &str = &shown;
        let file = opened.map_err(|e| Error::from_io(path, &e))?;
        let meta = file.metadata().map_err(|e| Error::from_io(path, &e))?;
        let kind = meta.file_type();
        if kind.is_dir() {
            return Err(Error::Os {
                errno: libc::EISDIR,
                message: format!("{path}: is a directory, not a safetensors file"),
            });
        }
        if !kind.is_file() {
            let what = if kind.is_fifo() {
                "a FIFO (named pipe)"
            } else if kind.is_socket() {
                "a socket"
            } else if kind.is_block_device() || kind.is_char_device() {
                "a device"
            } else {
                "not a regular file"
            };
            return Err(Error::InvalidArgument(format!(
                "{path}: is {what}; a safetensors file must be a regular file \
                 (its tensors are read at offsets)"
            )));
        }
        let len = meta.len();
        let modified = meta.modified().ok();
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
        let (tensors, metadata) = parse_header_and_metadata(path, &json, len).map_err(invalid)?;
        Ok(LocalFile {
            path: path.to_owned(),
            file,
            len,
            tensors,
            metadata,
            modified,
        })
    }

    /// Why the file is no longer as its header was read (written to since:
    /// another size or modification time), or None. Reads go through the
    /// descriptor opened with the header, so a file replaced by a rename
    /// reads on consistently; one rewritten in place is caught here.
    pub fn changed(&self) -> Option<String> {
        let what = match self.file.metadata() {
            Err(e) => format!("it cannot be checked: {e}"),
            Ok(m) if m.len() != self.len => {
                format!("its size was {} bytes, now {}", self.len, m.len())
            }
            Ok(m) if m.modified().ok() != self.modified => "it was modified".to_owned(),
            Ok(_) => return None,
        };
        Some(format!(
            "the file changed since its header was read ({what}); no tensor is read from a \
             file whose offsets may have moved: load it again"
        ))
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
