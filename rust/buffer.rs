//! 64-byte-aligned host memory, freed exactly once when the last owner drops it.
//!
//! Plain Rust. XLA's CPU client aliases host memory without a copy only when it
//! is aligned to 64 bytes (its minimum buffer alignment); the system allocator
//! and numpy guarantee 16. Large allocations are not zeroed eagerly: the pages
//! come from the kernel on first touch.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Alignment in bytes of every [`AlignedBuf`].
pub const ALIGN: usize = 64;

static LIVE: AtomicUsize = AtomicUsize::new(0);

/// How many [`AlignedBuf`]s exist now (for leak tests).
pub fn live_buffers() -> usize {
    LIVE.load(Ordering::SeqCst)
}

/// An owned, 64-byte-aligned allocation of `len` bytes.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the allocation is plain bytes owned by this value; access is
// synchronised by whoever holds views of it (as for a Vec<u8>).
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes whose contents are unspecified (like `np.empty`).
    /// `None` when the allocator refuses.
    pub fn uninit(len: usize) -> Option<Self> {
        let ptr = if len == 0 {
            // A dangling but aligned pointer: nothing is read or freed through it.
            NonNull::new(ALIGN as *mut u8)?
        } else {
            let layout = Layout::from_size_align(len, ALIGN).ok()?;
            // SAFETY: `layout` has a non-zero size.
            NonNull::new(unsafe { alloc::alloc(layout) })?
        };
        LIVE.fetch_add(1, Ordering::SeqCst);
        Some(AlignedBuf { ptr, len })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A new allocation holding a copy of these bytes; `None` when the
    /// allocator refuses.
    pub fn try_clone(&self) -> Option<Self> {
        let copy = AlignedBuf::uninit(self.len)?;
        if self.len != 0 {
            // SAFETY: both allocations are `len` bytes long and distinct. The
            // source may be written meanwhile through a Python view (as numpy's
            // own copy may be); the bytes are plain data, any value is valid.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), copy.as_ptr(), self.len) };
        }
        Some(copy)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated in `uninit` with this very layout.
            unsafe {
                alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, ALIGN),
                )
            };
        }
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn aligned_for_every_size_and_counted() {
        let before = live_buffers();
        let bufs: Vec<_> = [0usize, 1, 63, 64, 65, 4096, 1 << 22]
            .iter()
            .map(|&n| AlignedBuf::uninit(n).unwrap())
            .collect();
        for b in &bufs {
            assert_eq!(b.as_ptr() as usize % ALIGN, 0, "len {}", b.len());
        }
        assert!(live_buffers() >= before + bufs.len());
        let big = &bufs[6];
        // Writable over its whole length.
        unsafe { std::ptr::write_bytes(big.as_ptr(), 0xAB, big.len()) };
        assert_eq!(unsafe { *big.as_ptr().add(big.len() - 1) }, 0xAB);
    }

    #[test]
    fn freed_once_by_the_last_owner_on_any_thread() {
        let shared = Arc::new(AlignedBuf::uninit(1 << 16).unwrap());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let s = Arc::clone(&shared);
                std::thread::spawn(move || drop(s))
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(Arc::strong_count(&shared), 1);
        drop(shared);
    }

    #[test]
    fn try_clone_copies_into_new_aligned_memory() {
        for n in [0usize, 1, 100, 1 << 16] {
            let original = AlignedBuf::uninit(n).unwrap();
            for i in 0..n {
                unsafe { *original.as_ptr().add(i) = (i % 251) as u8 };
            }
            let copy = original.try_clone().unwrap();
            assert_eq!(copy.len(), n);
            assert_eq!(copy.as_ptr() as usize % ALIGN, 0);
            if n > 0 {
                assert_ne!(copy.as_ptr(), original.as_ptr());
            }
            for i in 0..n {
                assert_eq!(unsafe { *copy.as_ptr().add(i) }, (i % 251) as u8);
            }
        }
    }

    #[test]
    fn absurd_sizes_are_refused_not_aborted() {
        assert!(AlignedBuf::uninit(usize::MAX - 8).is_none());
    }
}
