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
//!
//! Split models (llama.cpp's `gguf-split`: `NAME-00001-of-00003.gguf`, ...) open from their first
//! file: its metadata is the model's, `split.count` names how many files there are, and each
//! other file, found beside it by name, must say it is `split.no` i of the same count; the
//! tensors of all files form one set (names unique across them, as many as
//! `split.tensors.count` says), each viewed in its own mapped file.

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

/// Most files one split model may have (llama.cpp writes at most 99,999).
const MAX_SPLITS: u64 = 1024;

/// An opened, validated GGUF file (or the files of a split model).
pub struct GgufFile {
    path: PathBuf,
    /// The mapped files: the one opened, then the other shards of a split model in order.
    files: Vec<Arc<MappedFile>>,
    version: u32,
    alignment: usize,
    metadata: HashMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let (file, header) = Self::open_one(path)?;
        let mut gguf = Self {
            path: path.to_path_buf(),
            files: vec![file],
            version: header.version,
            alignment: header.alignment,
            metadata: header.metadata,
            tensors: header.tensors,
            index: HashMap::new(),
        };
        gguf.open_other_shards()?;
        for (i, t) in gguf.tensors.iter().enumerate() {
            if gguf.index.insert(t.name.clone(), i).is_some() {
                let m = format!("tensor `{}` is in more than one file of the split model", t.name);
                return Err(LoadError::format(path, m));
            }
        }
        if gguf.files.len() > 1
            && let Some(total) = gguf.u64("split.tensors.count")?
            && total != gguf.tensors.len() as u64
        {
            let (files, held) = (gguf.files.len(), gguf.tensors.len());
            let m =
                format!("split.tensors.count is {total} but the {files} files hold {held} tensors");
            return Err(LoadError::format(path, m));
        }
        Ok(gguf)
    }

    fn open_one(path: &Path) -> Result<(Arc<MappedFile>, parse::Header), LoadError> {
        let file = Arc::new(MappedFile::open(path).map_err(|e| LoadError::io(path, e))?);
        let header = parse::parse_header(file.bytes()).map_err(|m| LoadError::format(path, m))?;
        Ok((file, header))
    }

    /// With `split.count` > 1: opens the other files of the split model (see the module docs).
    fn open_other_shards(&mut self) -> Result<(), LoadError> {
        let count = self.u64("split.count")?.unwrap_or(1);
        if count <= 1 {
            return Ok(());
        }
        let path = self.path.clone();
        let bad = |m: String| LoadError::format(&path, m);
        if count > MAX_SPLITS {
            return Err(bad(format!("split.count {count} exceeds the {MAX_SPLITS} cap")));
        }
        let first = shard_name(&path, 0, count);
        if self.u64("split.no")? != Some(0) || first.as_deref() != Some(path.as_path()) {
            let name = first.map_or_else(
                || format!("the file named like NAME-00001-of-{count:05}.gguf"),
                |f| f.display().to_string(),
            );
            return Err(bad(format!(
                "this is one file of a model split in {count}: open its first file, {name}"
            )));
        }
        for no in 1..count {
            let Some(shard) = shard_name(&path, no, count) else { unreachable!("named above") };
            let (file, header) = Self::open_one(&shard)?;
            let said = |key: &str| header.metadata.get(key).and_then(GgufValue::as_u64);
            if said("split.no") != Some(no) || said("split.count") != Some(count) {
                return Err(LoadError::format(
                    &shard,
                    format!(
                        "expected part {} of {count} of {} (split.no {no}), found split.no {:?} of \
                         split.count {:?}",
                        no + 1,
                        path.display(),
                        said("split.no"),
                        said("split.count"),
                    ),
                ));
            }
            let shard_index = self.files.len();
            self.files.push(file);
            self.tensors.extend(header.tensors.into_iter().map(|mut t| {
                t.shard = shard_index;
                t
            }));
        }
        Ok(())
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

    /// The mapped file that holds `info`'s data.
    pub fn mapped_file(&self, info: &GgufTensorInfo) -> &Arc<MappedFile> {
        &self.files[info.shard]
    }

    /// How many files the model is made of (1 unless it is split).
    pub fn num_files(&self) -> usize {
        self.files.len()
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
        &self.files[info.shard].bytes()[info.offset..info.offset + info.num_bytes]
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

/// The path of file `no` (from 0) of a model split in `count`, beside `path` and named as
/// llama.cpp's `gguf-split` names them (`PREFIX-00002-of-00003.gguf`); `None` when `path` is not
/// named so.
pub fn shard_name(path: &Path, no: u64, count: u64) -> Option<PathBuf> {
    let (prefix, of) = split_parts(path)?;
    (of == count).then(|| path.with_file_name(format!("{prefix}-{:05}-of-{count:05}.gguf", no + 1)))
}

/// How many files the split model `path` belongs to, by its name (`None`: not named as a part).
pub fn split_count(path: &Path) -> Option<u64> {
    split_parts(path).map(|(_, count)| count)
}

/// The prefix and the file count of a name `PREFIX-0000i-of-0000n.gguf`.
fn split_parts(path: &Path) -> Option<(&str, u64)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, of) = stem.rsplit_once("-of-")?;
    let (prefix, part) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    (digits(part) && digits(of)).then_some(())?;
    Some((prefix, of.parse().ok()?))
}

#[cfg(test)]
mod tests;
