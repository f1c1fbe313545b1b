//! 64-byte-aligned host memory, freed exactly once when the last owner drops it.
//!
//! Plain Rust. XLA's CPU client aliases host memory without a copy only when it
//! is aligned to 64 bytes (its minimum buffer alignment); the system allocator
//! and numpy guarantee 16. Contents are never zeroed (like `np.empty`): the
//! loader overwrites them. Large allocations are aligned to a huge page and
//! advised to use huge pages, as numpy does for its own large arrays: first
//! touch then faults in 2 MiB at a time, not 4 KiB (filling 512 MiB ran 4x
//! slower than `np.empty` without it). Except in a VM whose balloon device
//! reports free pages to the host: there a huge page is most often memory the
//! host took back, and its first touch faults on the host 4 KiB at a time
//! (440 MiB in a fresh process: 0.08 to 2.9 s with huge pages, 0.18 to 0.27 s
//! without, back to back on a 2-core VM).

use std::alloc::{self, Layout};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Alignment in bytes of every [`AlignedBuf`].
pub const ALIGN: usize = 64;

/// From this size on, buffers start on a huge-page boundary and ask for huge pages.
const HUGE_FROM: usize = 4 << 20;
/// x86-64's and aarch64's (4 KiB pages) transparent huge page size.
const HUGE_PAGE: usize = 2 << 20;

fn layout_for(len: usize) -> Option<Layout> {
    let align = if len >= HUGE_FROM { HUGE_PAGE } else { ALIGN };
    Layout::from_size_align(len, align).ok()
}

/// `ASYNC_ARRAY_HUGE_PAGES`: `1` always asks for huge pages, `0` never;
/// unset (or anything else), asks unless free pages go back to a VM's host.
pub const HUGE_PAGES_ENV: &str = "ASYNC_ARRAY_HUGE_PAGES";

/// Whether large buffers ask for huge pages (decided once a process).
pub fn huge_pages() -> bool {
    static HUGE: OnceLock<bool> = OnceLock::new();
    *HUGE.get_or_init(|| match std::env::var(HUGE_PAGES_ENV).as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => !reports_free_pages(Path::new("/sys/bus/virtio/drivers/virtio_balloon")),
    })
}

/// Whether a virtio balloon device under `driver` (its sysfs driver folder)
/// has free page reporting (`VIRTIO_BALLOON_F_REPORTING`, feature bit 5; the
/// `features` file lists bits 0, 1, ... as '0'/'1').
fn reports_free_pages(driver: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(driver) else {
        return false;
    };
    entries.flatten().any(|e| {
        std::fs::read_to_string(e.path().join("features"))
            .is_ok_and(|bits| bits.as_bytes().get(5) == Some(&b'1'))
    })
}

/// Asks the kernel for transparent huge pages over the buffer; only advice,
/// so a refusal (no THP, another OS) changes nothing but speed.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: [ptr, ptr + len) is one live allocation of ours, starting on a
    // huge-page (so page) boundary; MADV_HUGEPAGE changes no contents.
    unsafe {
        libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

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
            let layout = layout_for(len)?;
            // SAFETY: `layout` has a non-zero size.
            let ptr = NonNull::new(unsafe { alloc::alloc(layout) })?;
            if len >= HUGE_FROM && huge_pages() {
                advise_huge_pages(ptr.as_ptr(), len);
            }
            ptr
        };
        LIVE.fetch_add(1, Ordering::SeqCst);
        Some(AlignedBuf { ptr, len })
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is zero bytes long.
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
            let layout = layout_for(self.len).expect("valid when allocated");
            // SAFETY: allocated in `uninit` with this very layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
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
        let bufs: Vec<_> = [0usize, 1, 63, 64, 65, 4096, 1 << 22]
            .iter()
            .map(|&n| AlignedBuf::uninit(n).unwrap())
            .collect();
        for b in &bufs {
            assert_eq!(b.as_ptr() as usize % ALIGN, 0, "len {}", b.len());
        }
        // Large ones start on a huge page, so huge pages can cover them whole.
        assert_eq!(bufs[6].as_ptr() as usize % HUGE_PAGE, 0);
        // Other tests allocate and free meanwhile (the count is the
        // process's): only what these alone make certain is checked.
        assert!(live_buffers() >= bufs.len());
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
    fn free_page_reporting_is_feature_bit_5_of_a_balloon_device() {
        let root = std::env::temp_dir().join(format!("aa-balloon-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert!(!reports_free_pages(&root), "no balloon driver");
        let device = root.join("virtio0");
        std::fs::create_dir_all(&device).unwrap();
        assert!(!reports_free_pages(&root), "no features file");
        std::fs::write(device.join("features"), "0110000100000000\n").unwrap();
        assert!(!reports_free_pages(&root));
        std::fs::write(device.join("features"), "0110010100000000\n").unwrap();
        assert!(reports_free_pages(&root));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn absurd_sizes_are_refused_not_aborted() {
        assert!(AlignedBuf::uninit(usize::MAX - 8).is_none());
    }
}
