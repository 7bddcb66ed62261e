//! Host storage for weights: owned vectors or zero-copy views into a memory-mapped file.
//!
//! Invariant: a `Storage::Mapped` view is in bounds of its file and aligned for `T`; both are
//! checked once in [`Storage::mapped`], so [`Storage::as_slice`] is a plain cast afterwards.
//! Like every memory-mapped loader, kiln assumes model files are not modified while it runs.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};

/// Plain-old-data element types that may be viewed directly in file bytes (little-endian).
pub trait Pod: Copy + Send + Sync + 'static + private::Sealed {}
impl Pod for f32 {}
impl Pod for f16 {}
impl Pod for bf16 {}
impl Pod for u8 {}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u8 {}
}

/// A read-only memory map that remembers where it came from (for error messages).
pub struct MappedFile {
    map: memmap2::Mmap,
    path: PathBuf,
}

impl MappedFile {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        // SAFETY: the map is read-only and kiln documents that model files must not be
        // modified while loaded; all reads are bounds-checked against `map.len()`.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(Self { map, path: path.to_path_buf() })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Elements of type `T`, owned or borrowed from a mapped file.
pub enum Storage<T: Pod> {
    Owned(Vec<T>),
    Mapped { file: Arc<MappedFile>, byte_offset: usize, len: usize },
}

impl<T: Pod> Storage<T> {
    /// A view of `len` elements at `byte_offset`, or `None` when out of bounds or misaligned.
    pub fn mapped(file: Arc<MappedFile>, byte_offset: usize, len: usize) -> Option<Self> {
        let num_bytes = len.checked_mul(size_of::<T>())?;
        let end = byte_offset.checked_add(num_bytes)?;
        let bytes = file.bytes();
        if end > bytes.len() {
            return None;
        }
        let addr = bytes.as_ptr() as usize + byte_offset;
        if !addr.is_multiple_of(align_of::<T>()) {
            return None;
        }
        Some(Self::Mapped { file, byte_offset, len })
    }

    pub fn as_slice(&self) -> &[T] {
        match self {
            Self::Owned(v) => v,
            Self::Mapped { file, byte_offset, len } => {
                let bytes = &file.bytes()[*byte_offset..];
                // SAFETY: `mapped` checked that `len` elements fit in bounds from `byte_offset`
                // and that the address is aligned for `T`; `T: Pod` accepts any bit pattern.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), *len) }
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Owned(v) => v.len(),
            Self::Mapped { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: Pod> From<Vec<T>> for Storage<T> {
    fn from(v: Vec<T>) -> Self {
        Self::Owned(v)
    }
}
