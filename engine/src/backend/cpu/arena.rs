//! Resident weights copied into anonymous memory backed by transparent huge pages.
//!
//! Why: a decode step streams every weight once, and a mapped model file sits in 4 KiB page-cache pages, so
//! the kernels take a TLB miss every 4 KiB (~24,000 per token for SmolLM2-135M's 96 MB). Copied into 2 MiB
//! pages they take one per 2 MiB. Most tensors are far smaller than 2 MiB, so they are packed one after another
//! into shared chunks, each advised `MADV_HUGEPAGE` and aligned to 2 MiB. Measured in docs/performance.md.
//!
//! The copy is skipped (weights stay zero-copy in the file's map) where the kernel's transparent huge pages are
//! off (`never` in `/sys/kernel/mm/transparent_hugepage/enabled`): an operator turns this off there.

use std::sync::{Arc, Mutex, PoisonError};

use memmap2::{Advice, MmapOptions, MmapRaw};

use crate::tensor::{ArenaWindow, Bytes};
use crate::{Error, Result};

/// A transparent huge page on x86-64 and (with 4 KiB base pages) arm64.
const HUGE_PAGE: usize = 2 << 20;
/// Chunk size: few enough mappings for a large model, little enough reserved and unused at the end of the last.
const CHUNK: usize = 64 << 20;
/// Every tensor starts on a cache line (and so is aligned for any element type).
const ALIGN: usize = 64;

/// Where the kernel's transparent huge page setting says `madvise` regions get huge pages.
const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// Packs weights into huge-page-advised anonymous chunks; each tensor gets a window no one writes again.
pub struct WeightArena {
    current: Mutex<Option<Chunk>>,
}

struct Chunk {
    map: Arc<MmapRaw>,
    /// Next free byte; the first is on a 2 MiB boundary.
    next: usize,
}

impl WeightArena {
    /// An arena if this system grants huge pages to regions that ask for them.
    pub fn if_supported() -> Option<WeightArena> {
        let setting = std::fs::read_to_string(THP_ENABLED).ok()?;
        thp_allows_madvise(&setting).then(WeightArena::new)
    }

    pub(super) fn new() -> WeightArena {
        WeightArena { current: Mutex::new(None) }
    }

    /// A copy of `src` in the arena.
    pub fn copy(&self, src: &[u8]) -> Result<Bytes> {
        if src.is_empty() {
            return Ok(Bytes::owned(src));
        }
        self.write(src.len(), |dst| {
            dst.copy_from_slice(src);
            Ok(())
        })
    }

    /// `len` bytes in the arena, written by `fill` (which sees them zeroed): what a tensor becomes when it is
    /// converted on the way in, without a second buffer for it.
    pub fn write(&self, len: usize, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<Bytes> {
        let (map, offset) = {
            let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
            let chunk = match &mut *current {
                Some(chunk) if chunk.next + len <= chunk.map.len() => chunk,
                slot => slot.insert(Chunk::new(len)?),
            };
            let offset = chunk.next;
            chunk.next = (offset + len).next_multiple_of(ALIGN);
            (Arc::clone(&chunk.map), offset)
        };
        // SAFETY: offset..offset + len was reserved above for this call alone and lies inside the map (zeroed, as
        // a fresh anonymous map is); no window over it exists yet, and other threads only write their own
        // reserved windows.
        let dst = unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().add(offset), len) };
        fill(dst)?;
        // SAFETY: written just above and never written again; the window holds the map alive.
        Ok(Bytes::Arena(unsafe { ArenaWindow::new(map, offset, len) }))
    }
}

impl Chunk {
    /// A chunk that holds at least `need` bytes after its 2 MiB-aligned start.
    fn new(need: usize) -> Result<Chunk> {
        let size = need.max(CHUNK).next_multiple_of(HUGE_PAGE);
        // One huge page more than needed, so the usable part can start on a 2 MiB boundary wherever the kernel
        // places the map (newer kernels align large anonymous maps themselves).
        let io = |what: &str, e: std::io::Error| Error::Device(format!("weight arena: {what} {size} bytes: {e}"));
        let map = MmapOptions::new().len(size + HUGE_PAGE).map_anon().map_err(|e| io("cannot map", e))?;
        let map = MmapRaw::from(map);
        map.advise(Advice::HugePage).map_err(|e| io("cannot advise huge pages for", e))?;
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        Ok(Chunk { map: Arc::new(map), next: start })
    }
}

/// Whether a `transparent_hugepage/enabled` setting (`always [madvise] never`, the choice in brackets) gives
/// huge pages to a region advised `MADV_HUGEPAGE`.
fn thp_allows_madvise(setting: &str) -> bool {
    setting.contains("[always]") || setting.contains("[madvise]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_keep_their_bytes_and_alignment_across_chunks() -> Result<()> {
        let arena = WeightArena::new();
        // Small tensors, one larger than a chunk, then small ones again (a new chunk after the big one).
        let sizes = [1usize, 100, 4096, 3, 2 * CHUNK + 5, 64, 7];
        let srcs: Vec<Vec<u8>> =
            sizes.iter().enumerate().map(|(i, &n)| (0..n).map(|j| (i * 31 + j * 7) as u8).collect()).collect();
        let copies = srcs.iter().map(|s| arena.copy(s)).collect::<Result<Vec<_>>>()?;
        for (src, copy) in srcs.iter().zip(&copies) {
            assert!(matches!(copy, Bytes::Arena(_)), "{copy:?}");
            assert!(copy.as_slice() == src.as_slice(), "{} bytes changed", src.len());
            assert!((copy.as_slice().as_ptr() as usize).is_multiple_of(ALIGN));
        }
        // The small ones before the big one share a chunk, packed.
        let ptr = |i: usize| copies[i].as_slice().as_ptr() as usize;
        assert_eq!(ptr(1) - ptr(0), ALIGN);
        assert_eq!(ptr(2) - ptr(1), 128);
        // Chunks start on a huge page.
        assert!(ptr(0).is_multiple_of(HUGE_PAGE) && ptr(4).is_multiple_of(HUGE_PAGE), "{:x} {:x}", ptr(0), ptr(4));
        Ok(())
    }

    #[test]
    fn copies_made_from_many_threads_do_not_overlap() -> Result<()> {
        let arena = WeightArena::new();
        let copies: Vec<(u8, Bytes)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4u8)
                .map(|t| {
                    let arena = &arena;
                    s.spawn(move || (0..200).map(|i| arena.copy(&vec![t; 1000 + i]).map(|b| (t, b))).collect())
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect::<Result<Vec<Vec<_>>>>()
        })?
        .into_iter()
        .flatten()
        .collect();
        for (t, b) in &copies {
            assert!(b.as_slice().iter().all(|x| x == t), "a window was overwritten");
        }
        Ok(())
    }

    #[test]
    fn only_always_and_madvise_grant_advised_huge_pages() {
        assert!(thp_allows_madvise("always [madvise] never\n"));
        assert!(thp_allows_madvise("[always] madvise never\n"));
        assert!(!thp_allows_madvise("always madvise [never]\n"));
        assert!(!thp_allows_madvise(""));
    }
}
