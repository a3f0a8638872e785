//! The C allocator's settings for the engine's allocation pattern. Every step allocates and frees the same large
//! temporaries (activations, the logits: 3 MiB at 16 tokens of a 49k vocabulary; a 1.1B model's MLP
//! activations at a 1,536-token prompt: 35 MiB each), and glibc's defaults give such blocks back to the kernel when
//! they are freed, so the next step faults the same pages in again and the kernel zeroes them. glibc gives memory
//! back three ways, and each is closed here:
//! - blocks above the mmap threshold are mapped and unmapped one by one: none is mapped (`M_MMAP_MAX` 0), so a
//!   block of any size comes from the heap and is reused;
//! - the top of the heap is trimmed: only above 512 MiB of free space (`M_TRIM_THRESHOLD`);
//! - every thread that allocates gets an arena of its own, made of 64 MiB heaps that glibc deletes as soon as one
//!   is empty, whatever the trim threshold (`heap_trim` keeps only `M_TOP_PAD`): the engine's worker threads
//!   allocate a step's outputs, so a long prompt's step created and deleted such heaps ~130 times. One arena for
//!   the process (`M_ARENA_MAX` 1) keeps them; small blocks still come from each thread's cache without a lock.
//!
//! Keeping freed blocks in the process made batch-16 decode 14 % faster on the development VM (median of 7
//! interleaved pairs); one arena and no mapped blocks cut a 1.1B model's 1,536-token prefill's page faults 5×
//! (docs/performance.md). It does not raise the peak a stage's memory budget is sized by (the profiling batch's
//! `VmHWM`): what is kept is what the step held at its peak anyway.

/// Blocks mapped on their own: none (every block comes from the heap, so a freed one is reused).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_MAX: libc::c_int = 0;
/// Arenas: the main one only (see the module's note on per-thread heaps).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const ARENA_MAX: libc::c_int = 1;
/// Free space at the top of a heap kept rather than given back to the kernel.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = 512 << 20;

/// How the process's allocator was left by [`keep_freed_memory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeapTuning {
    /// Freed blocks stay in the process.
    Applied,
    /// `GLIBC_TUNABLES` sets malloc parameters itself: the operator's settings are left alone.
    LeftToGlibcTunables,
    /// Not glibc on Linux, or glibc refused the values: the allocator's defaults.
    Unsupported,
}

/// Keeps the blocks the engine frees in the process instead of handing them back to the kernel after every step.
/// Call once, first thing in a binary that runs the engine; libraries never call it (it changes the whole process).
pub fn keep_freed_memory() -> HeapTuning {
    if tunables_set_malloc() {
        return HeapTuning::LeftToGlibcTunables;
    }
    apply()
}

/// Whether the operator set glibc's malloc parameters through `GLIBC_TUNABLES`.
fn tunables_set_malloc() -> bool {
    std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."))
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> HeapTuning {
    // SAFETY: mallopt only sets glibc's malloc parameters (under its own lock); any thread may call it any time.
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_MAX, MMAP_MAX) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            && libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX) == 1
    };
    if ok { HeapTuning::Applied } else { HeapTuning::Unsupported }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> HeapTuning {
    HeapTuning::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_accepts_the_settings() {
        let got = keep_freed_memory();
        if tunables_set_malloc() {
            assert_eq!(got, HeapTuning::LeftToGlibcTunables);
        } else if cfg!(all(target_os = "linux", target_env = "gnu")) {
            // Every value was taken (mallopt answers 0 for a parameter or value it refuses).
            assert_eq!(got, HeapTuning::Applied);
        } else {
            assert_eq!(got, HeapTuning::Unsupported);
        }
    }
}
