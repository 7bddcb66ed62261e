//! GGUF files (llama.cpp's model format, versions 2 and 3): metadata and memory-mapped tensors.
//!
//! Layout: magic `GGUF`, version, tensor count, metadata count, the metadata key/value pairs,
//! one info record per tensor (name, dims, type, offset), then — aligned to
//! `general.alignment` (default 32) — the data section that tensor offsets point into.
//!
//! Invariants, checked once in [`GgufFile::open`] before any tensor is used: strings, arrays
//! and counts are capped and never exceed the bytes left; sizes and offsets use checked
//! arithmetic; the alignment is a nonzero power of two; every tensor has a known type, a row
//! length that is a whole number of blocks, an aligned offset and data inside the file; keys
//! and tensor names are unique. Afterwards tensor data is viewed in place (zero-copy).

mod parse;
mod value;
mod vocab;
mod weights;
pub mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_backend::MappedFile;

use crate::LoadError;

pub use parse::GgufTensorInfo;
pub use value::GgufValue;
pub use vocab::{read_tokenizer, read_vocab};

/// An opened, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    file: Arc<MappedFile>,
    version: u32,
    alignment: usize,
    metadata: HashMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let file = Arc::new(MappedFile::open(path).map_err(|e| LoadError::io(path, e))?);
        let header = parse::parse_header(file.bytes()).map_err(|m| LoadError::format(path, m))?;
        let index = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            version: header.version,
            alignment: header.alignment,
            metadata: header.metadata,
            tensors: header.tensors,
            index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> usize {
        self.alignment
    }

    pub fn mapped_file(&self) -> &Arc<MappedFile> {
        &self.file
    }

    pub fn metadata(&self) -> &HashMap<String, GgufValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (in bounds: checked at open).
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.file.bytes()[info.offset..info.offset + info.num_bytes]
    }

    fn type_error(&self, key: &str, expected: &str, found: &GgufValue) -> LoadError {
        LoadError::format(
            &self.path,
            format!("metadata `{key}` should be {expected}, found {}", found.type_name()),
        )
    }

    /// An optional unsigned integer entry; present with another type is an error.
    pub fn u64(&self, key: &str) -> Result<Option<u64>, LoadError> {
        self.get(key)
            .map(|v| v.as_u64().ok_or_else(|| self.type_error(key, "an unsigned integer", v)))
            .transpose()
    }

    /// A required unsigned integer entry that fits in `usize`.
    pub fn require_usize(&self, key: &str) -> Result<usize, LoadError> {
        let v = self
            .u64(key)?
            .ok_or_else(|| LoadError::format(&self.path, format!("missing metadata `{key}`")))?;
        usize::try_from(v)
            .map_err(|_| LoadError::format(&self.path, format!("metadata `{key}` is too large")))
    }

    pub fn f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        self.get(key)
            .map(|v| v.as_f32().ok_or_else(|| self.type_error(key, "a number", v)))
            .transpose()
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.type_error(key, "a bool", v)))
            .transpose()
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, LoadError> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.type_error(key, "a string", v)))
            .transpose()
    }

    /// An optional array whose elements all convert with `f`.
    pub fn array<T>(
        &self,
        key: &str,
        expected: &str,
        f: impl Fn(&GgufValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>, LoadError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let items = v.as_array().ok_or_else(|| self.type_error(key, "an array", v))?;
        items
            .iter()
            .map(|item| f(item).ok_or_else(|| self.type_error(key, expected, item)))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

#[cfg(test)]
mod tests;
