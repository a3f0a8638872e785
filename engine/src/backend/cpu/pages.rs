//! Zeroed memory in an anonymous mapping of its own, handed back to the system when dropped.
//!
//! Why: the KV cache is what a stage allocates most of besides its weights (which live in the weight arena or the
//! file's map), and it lives as long as the stage. The binaries keep every block freed on the heap in the process
//! ([`crate::heap`]: right for a step's temporaries, which the next step reuses), so a cache allocated there
//! stayed resident after its stage was replaced: a worker reloading under `--memory-limit` still held 37-54 MiB
//! of the old cache while it measured the new stage's peak, and sized the new cache that much smaller (or refused
//! the plan). A mapping of its own is unmapped when the cache is dropped.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use bytemuck::Pod;
use memmap2::{MmapMut, MmapOptions};

use crate::{Error, Result};

/// `len` elements of `T`, zeroed until written.
pub(super) struct Pages<T> {
    /// `None` for no elements (a mapping cannot be empty).
    map: Option<MmapMut>,
    _elements: PhantomData<T>,
}

impl<T: Pod> Pages<T> {
    /// `len` zeroed elements; the pages become resident as they are first written.
    pub(super) fn zeroed(len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::Device(format!("cannot map {len} elements of {} bytes", size_of::<T>())))?;
        let map = match bytes {
            0 => None,
            _ => Some(
                MmapOptions::new()
                    .len(bytes)
                    .map_anon()
                    .map_err(|e| Error::Device(format!("cannot map {bytes} bytes: {e}")))?,
            ),
        };
        Ok(Pages { map, _elements: PhantomData })
    }

    /// A copy of `values`.
    #[cfg(test)]
    pub(super) fn from_slice(values: &[T]) -> Result<Self> {
        let mut pages = Self::zeroed(values.len())?;
        pages.copy_from_slice(values);
        Ok(pages)
    }
}

impl<T: Pod> Deref for Pages<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // The map is page-aligned and exactly `len` elements long, so the cast cannot fail.
        self.map.as_ref().map_or(&[], |m| bytemuck::cast_slice(m))
    }
}

impl<T: Pod> DerefMut for Pages<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.map.as_mut().map_or(&mut [], |m| bytemuck::cast_slice_mut(m))
    }
}

impl<T: Pod> fmt::Debug for Pages<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pages({} × {} bytes)", self.len(), size_of::<T>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn pages_start_zeroed_and_keep_what_is_written() -> Result<()> {
        assert!(Pages::<f32>::zeroed(0)?.is_empty());
        let mut pages = Pages::<f16>::zeroed(3)?;
        assert_eq!(&pages[..], &[f16::ZERO; 3]);
        pages[1] = f16::ONE;
        assert_eq!(&pages[..], &[f16::ZERO, f16::ONE, f16::ZERO]);
        assert_eq!(&Pages::from_slice(&[1u8, 2, 3])?[..], &[1, 2, 3]);
        assert!(Pages::<f32>::zeroed(usize::MAX / 2).is_err(), "a size that overflows is an error, not a panic");
        Ok(())
    }
}
