//! An allocator that counts what each thread holds, so tests and fuzz targets can bound what a reader allocates
//! for a crafted file: [`with_alloc_limit`] runs a closure, returns the peak it held, and makes any allocation
//! beyond the limit fail (which aborts the process, as an out-of-memory would, and is a crash to a fuzzer).
//!
//! Counts are per thread (a reader that allocates on other threads is not measured) and only work in a binary that
//! installs [`CountingAlloc`] as its `#[global_allocator]`; [`with_alloc_limit`] refuses to run otherwise.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// What opening a model file may allocate, as a multiple of the file's size. The worst case is a GGUF metadata array
/// of one-byte values, each of which becomes a 32-byte [`Value`](crate::loader::gguf::Value).
pub const READER_ALLOC_FACTOR: usize = 64;
/// What opening a model file may allocate beyond [`READER_ALLOC_FACTOR`] times its size (paths, maps, messages).
pub const READER_ALLOC_SLACK: usize = 64 << 10;

/// The most opening a model file of `file_len` bytes may allocate.
pub fn reader_alloc_limit(file_len: usize) -> usize {
    file_len.saturating_mul(READER_ALLOC_FACTOR).saturating_add(READER_ALLOC_SLACK)
}

/// The system allocator, counting each thread's live bytes.
pub struct CountingAlloc;

thread_local! {
    /// Bytes this thread holds (allocated here minus freed here; may go negative when others free ours).
    static LIVE: Cell<isize> = const { Cell::new(0) };
    /// The most `LIVE` may reach while a limit is set; `isize::MAX` otherwise.
    static CEILING: Cell<isize> = const { Cell::new(isize::MAX) };
    /// The highest `LIVE` seen since the last reset.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn live() -> isize {
    LIVE.try_with(Cell::get).unwrap_or(0)
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are plain thread-locals without destructors.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let size = layout.size() as isize;
        let now = live().saturating_add(size);
        if now > CEILING.try_with(Cell::get).unwrap_or(isize::MAX) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout is passed on as it came.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let _ = LIVE.try_with(|l| l.set(now));
            let _ = PEAK.try_with(|m| m.set(m.get().max(now)));
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (see `alloc`).
        unsafe { System.dealloc(ptr, layout) };
        let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub(layout.size() as isize)));
    }
}

/// Runs `f` with this thread allowed to hold at most `limit` bytes more than it held before, and returns its result
/// with the most it held (beyond that start) at any one time. An allocation past the limit fails, which aborts.
///
/// # Panics
/// When [`CountingAlloc`] is not the global allocator, since nothing could then be measured.
pub fn with_alloc_limit<R>(limit: usize, f: impl FnOnce() -> R) -> (R, usize) {
    let before = live();
    let probe = std::hint::black_box(Box::new([0u8; 64]));
    assert!(live() >= before + 64, "with_alloc_limit needs `#[global_allocator] static A: CountingAlloc`");
    drop(probe);
    let start = live();
    let outer_ceiling = CEILING.with(|c| c.replace(start.saturating_add(limit.min(isize::MAX as usize) as isize)));
    let outer_peak = PEAK.with(|p| p.replace(start));
    let out = f();
    CEILING.with(|c| c.set(outer_ceiling));
    let peak = PEAK.with(|p| p.replace(outer_peak.max(p.get())));
    (out, (peak - start).max(0) as usize)
}
