//! Memory-mapped safetensors weights, one file or a sharded set with an index.
//!
//! Format: `u64` little-endian header length `N`, `N` bytes of JSON mapping tensor names to
//! `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the data section that
//! follows the header). Every header is checked before any tensor is touched: `N` within the
//! file and a sane cap, offsets ordered and inside the data section, byte sizes equal to
//! `product(shape) * dtype size` with checked arithmetic. Tensor data is then viewed in place
//! when aligned, copied otherwise.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_backend::{GgmlType, HostTensor, MappedFile, Storage};
use serde_json::Value;

use crate::LoadError;

/// Largest header we accept (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;
const MAX_RANK: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    F32,
    F16,
    Bf16,
    /// Packed integer weights (AWQ and GPTQ's `qweight`, `qzeros`, `g_idx`).
    I32,
    /// compressed-tensors' int8 weights.
    I8,
    /// MXFP4 blocks and scales (gpt-oss).
    U8,
    /// Stored in the file but not loadable as a weight (other integers, f64, fp8, ...).
    Other,
}

impl Dtype {
    fn parse(s: &str) -> (Self, usize) {
        match s {
            "F32" => (Self::F32, 4),
            "F16" => (Self::F16, 2),
            "BF16" => (Self::Bf16, 2),
            "F64" | "I64" | "U64" => (Self::Other, 8),
            "I32" => (Self::I32, 4),
            "U32" => (Self::Other, 4),
            "I16" | "U16" => (Self::Other, 2),
            "I8" => (Self::I8, 1),
            "U8" => (Self::U8, 1),
            _ => (Self::Other, 1),
        }
    }
}

struct TensorEntry {
    file: usize,
    dtype: Dtype,
    dtype_name: String,
    shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    start: usize,
    num_elements: usize,
}

/// All tensors of a model, across its shards.
pub struct WeightStore {
    files: Vec<Arc<MappedFile>>,
    tensors: HashMap<String, TensorEntry>,
}

impl WeightStore {
    /// Opens `model.safetensors.index.json` and its shards, or `model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self, LoadError> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let shards = shard_files(&index)?;
            return Self::open_files(&shards.iter().map(|s| dir.join(s)).collect::<Vec<_>>());
        }
        let single = dir.join("model.safetensors");
        if single.exists() {
            return Self::open_files(&[single]);
        }
        Err(LoadError::format(dir, "no model.safetensors or model.safetensors.index.json"))
    }

    pub fn open_files(paths: &[PathBuf]) -> Result<Self, LoadError> {
        let mut store = Self { files: Vec::new(), tensors: HashMap::new() };
        for path in paths {
            let file = Arc::new(MappedFile::open(path).map_err(|e| LoadError::io(path, e))?);
            let file_idx = store.files.len();
            for (name, entry) in parse_header(file.bytes(), path, file_idx)? {
                if store.tensors.insert(name.clone(), entry).is_some() {
                    return Err(LoadError::format(
                        path,
                        format!("tensor `{name}` appears in more than one shard"),
                    ));
                }
            }
            store.files.push(file);
        }
        Ok(store)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Every tensor's name, its bytes and whether it is stored as `I8`.
    pub(crate) fn tensor_sizes(&self) -> impl Iterator<Item = (&str, usize, bool)> {
        self.tensors.iter().map(|(name, e)| {
            let size = Dtype::parse(&e.dtype_name).1;
            (name.as_str(), e.num_elements * size, e.dtype == Dtype::I8)
        })
    }

    /// The stored shape of a tensor.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// Tensor `name`, checked to be of shape `expected`.
    fn shaped(&self, name: &str, expected: &[usize]) -> Result<&TensorEntry, LoadError> {
        let entry = self.tensors.get(name).ok_or_else(|| LoadError::MissingTensor {
            path: self.describe_files(),
            name: name.to_string(),
        })?;
        if entry.shape != expected {
            return Err(LoadError::Shape {
                path: self.files[entry.file].path().to_path_buf(),
                name: name.to_string(),
                expected: expected.to_vec(),
                found: entry.shape.clone(),
            });
        }
        Ok(entry)
    }

    /// Float tensor `name`, checked to be of shape `expected`.
    fn entry(&self, name: &str, expected: &[usize]) -> Result<&TensorEntry, LoadError> {
        let entry = self.shaped(name, expected)?;
        let path = self.files[entry.file].path();
        if matches!(entry.dtype, Dtype::Other | Dtype::I32 | Dtype::I8 | Dtype::U8) {
            return Err(LoadError::Dtype {
                path: path.to_path_buf(),
                name: name.to_string(),
                dtype: entry.dtype_name.clone(),
            });
        }
        Ok(entry)
    }

    fn describe_files(&self) -> PathBuf {
        match self.files.as_slice() {
            [one] => one.path().to_path_buf(),
            many => many.first().and_then(|f| f.path().parent()).unwrap_or(Path::new("")).into(),
        }
    }

    /// A `[rows, cols]` weight in its stored dtype, zero-copy when aligned.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor, LoadError> {
        let entry = self.entry(name, &[rows, cols])?;
        self.host_tensor(entry, rows, cols, name)
    }

    /// A 1-D tensor of `len` elements converted to f32 (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let entry = self.entry(name, &[len])?;
        let t = self.host_tensor(entry, 1, len, name)?;
        t.to_f32_vec().ok_or_else(|| {
            LoadError::format(self.files[entry.file].path(), format!("tensor `{name}` dtype"))
        })
    }

    /// The file holding tensor `name` (the model's directory when there is none).
    pub(crate) fn path_of(&self, name: &str) -> PathBuf {
        match self.tensors.get(name) {
            Some(e) => self.files[e.file].path().to_path_buf(),
            None => self.describe_files(),
        }
    }

    /// An `I32` tensor of `shape`, as integers.
    pub(crate) fn int32s(&self, name: &str, shape: &[usize]) -> Result<Vec<i32>, LoadError> {
        let bytes = self.integer_bytes(name, shape, Dtype::I32)?;
        Ok(bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// The bytes of a `U8` tensor of `shape` (MXFP4 blocks and scales).
    pub(crate) fn uint8s(&self, name: &str, shape: &[usize]) -> Result<&[u8], LoadError> {
        self.integer_bytes(name, shape, Dtype::U8)
    }

    /// An `I8` tensor of `shape`, as integers.
    pub(crate) fn int8s(&self, name: &str, shape: &[usize]) -> Result<Vec<i8>, LoadError> {
        let bytes = self.integer_bytes(name, shape, Dtype::I8)?;
        Ok(bytes.iter().map(|&b| b as i8).collect())
    }

    /// Whether tensor `name` is stored as `I8`.
    pub(crate) fn is_int8(&self, name: &str) -> bool {
        self.tensors.get(name).is_some_and(|e| e.dtype == Dtype::I8)
    }

    /// The bytes of integer tensor `name`, checked to be of `shape` and `dtype`.
    fn integer_bytes(&self, name: &str, shape: &[usize], dtype: Dtype) -> Result<&[u8], LoadError> {
        let entry = self.shaped(name, shape)?;
        let path = self.files[entry.file].path();
        if entry.dtype != dtype {
            return Err(LoadError::Dtype {
                path: path.to_path_buf(),
                name: name.to_string(),
                dtype: format!("{} ({dtype:?} expected)", entry.dtype_name),
            });
        }
        let size = if dtype == Dtype::I32 { 4 } else { 1 };
        self.files[entry.file]
            .bytes()
            .get(entry.start..entry.start + entry.num_elements * size)
            .ok_or_else(|| LoadError::format(path, format!("tensor `{name}` size")))
    }

    /// [`WeightStore::int32s`], `None` when the tensor is absent.
    pub(crate) fn try_int32s(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<i32>>, LoadError> {
        if self.contains(name) { self.int32s(name, shape).map(Some) } else { Ok(None) }
    }

    /// A float tensor of any shape, as f32.
    pub(crate) fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let entry = self.entry(name, shape)?;
        let t = self.host_tensor(entry, 1, entry.num_elements, name)?;
        t.to_f32_vec().ok_or_else(|| {
            LoadError::format(self.files[entry.file].path(), format!("tensor `{name}` dtype"))
        })
    }

    /// The entry's bytes, viewed in the mapped file, as a `[rows, cols]` tensor.
    fn host_tensor(
        &self,
        entry: &TensorEntry,
        rows: usize,
        cols: usize,
        name: &str,
    ) -> Result<HostTensor, LoadError> {
        let file = &self.files[entry.file];
        let ty = match entry.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::Bf16 | Dtype::I32 | Dtype::I8 | Dtype::U8 | Dtype::Other => GgmlType::Bf16,
        };
        let size_err = || LoadError::format(file.path(), format!("tensor `{name}` size"));
        let num_bytes = entry.num_elements.checked_mul(ty.block_bytes()).ok_or_else(size_err)?;
        let bytes =
            Storage::mapped(Arc::clone(file), entry.start, num_bytes).ok_or_else(size_err)?;
        HostTensor::new(ty, rows, cols, bytes).ok_or_else(size_err)
    }
}

/// Shard file names listed in an index's `weight_map`, deduplicated, in first-seen order.
fn shard_files(index: &Path) -> Result<Vec<String>, LoadError> {
    let text = std::fs::read_to_string(index).map_err(|e| LoadError::io(index, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| LoadError::format(index, format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| LoadError::format(index, "missing `weight_map` object"))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            LoadError::format(index, format!("weight_map entry `{tensor}` is not a file name"))
        })?;
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(LoadError::format(
                index,
                format!("shard name `{file}` is not a plain file name"),
            ));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    if files.is_empty() {
        return Err(LoadError::format(index, "weight_map lists no shards"));
    }
    Ok(files)
}

/// Parses and validates one file's header.
fn parse_header(
    bytes: &[u8],
    path: &Path,
    file: usize,
) -> Result<Vec<(String, TensorEntry)>, LoadError> {
    let err = |m: String| LoadError::format(path, m);
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| err(format!("file is {} bytes, too short for a header", bytes.len())))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || header_len > (bytes.len() - 8) as u64 {
        return Err(err(format!(
            "header length {header_len} exceeds the file ({} bytes) or the {MAX_HEADER_BYTES}-byte cap",
            bytes.len()
        )));
    }
    let data_start = 8 + header_len as usize;
    let data_len = bytes.len() - data_start;
    let json: Value = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| err(format!("header is not valid JSON: {e}")))?;
    let obj = json.as_object().ok_or_else(|| err("header is not a JSON object".into()))?;
    let mut out = Vec::with_capacity(obj.len());
    let mut spans: Vec<(usize, usize, &str)> = Vec::with_capacity(obj.len());
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let terr = |m: &str| err(format!("tensor `{name}`: {m}"));
        let dtype_name = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| terr("missing dtype"))?
            .to_string();
        let (dtype, elem_size) = Dtype::parse(&dtype_name);
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| terr("missing shape"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| terr("shape must be non-negative integers"))?;
        if shape.len() > MAX_RANK {
            return Err(terr("rank exceeds 8"));
        }
        let offsets: Vec<usize> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .ok_or_else(|| terr("data_offsets must be [begin, end]"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| terr("data_offsets must be non-negative integers"))?;
        let (begin, end) = (offsets[0], offsets[1]);
        if begin > end || end > data_len {
            return Err(terr(&format!(
                "data_offsets [{begin}, {end}] lie outside the {data_len}-byte data section"
            )));
        }
        let num_elements = shape
            .iter()
            .try_fold(1usize, |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| terr("shape product overflows"))?;
        let num_bytes =
            num_elements.checked_mul(elem_size).ok_or_else(|| terr("size overflows"))?;
        if num_bytes != end - begin {
            return Err(terr(&format!(
                "shape {shape:?} of {dtype_name} needs {num_bytes} bytes but data_offsets span {}",
                end - begin
            )));
        }
        out.push((
            name.clone(),
            TensorEntry { file, dtype, dtype_name, shape, start: data_start + begin, num_elements },
        ));
        spans.push((begin, end, name.as_str()));
    }
    check_disjoint(&mut spans).map_err(err)?;
    Ok(out)
}

/// Refuses tensors whose (non-empty) byte ranges overlap: each tensor must own its bytes.
fn check_disjoint(spans: &mut [(usize, usize, &str)]) -> Result<(), String> {
    spans.sort_unstable();
    let mut last: Option<(usize, usize, &str)> = None;
    for &(begin, end, name) in spans.iter().filter(|s| s.0 < s.1) {
        if let Some((b, e, other)) = last
            && begin < e
        {
            return Err(format!(
                "tensors `{other}` (data_offsets [{b}, {e}]) and `{name}` ([{begin}, {end}]) overlap"
            ));
        }
        if last.is_none_or(|l| end > l.1) {
            last = Some((begin, end, name));
        }
    }
    Ok(())
}

impl crate::weights::WeightSource for WeightStore {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor, LoadError> {
        WeightStore::matrix(self, name, rows, cols)
    }

    /// Slice `e` of a float `[num_experts, rows, cols]` tensor (gpt-oss stacks its experts).
    fn expert_matrix(
        &self,
        name: &str,
        (e, num_experts): (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<HostTensor, LoadError> {
        let entry = self.entry(name, &[num_experts, rows, cols])?;
        let all = self.host_tensor(entry, num_experts * rows, cols, name)?;
        all.rows_slice(e * rows, rows).ok_or_else(|| {
            LoadError::format(self.path_of(name), format!("`{name}`: expert {e} of {num_experts}"))
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        WeightStore::vector(self, name, len)
    }

    fn mxfp4_expert(
        &self,
        name: &str,
        (e, num_experts): (usize, usize),
        part: Option<usize>,
        (rows, cols): (usize, usize),
    ) -> Result<HostTensor, LoadError> {
        crate::safetensors_store::mxfp4::expert(self, name, (e, num_experts), part, (rows, cols))
    }

    fn contains(&self, name: &str) -> bool {
        WeightStore::contains(self, name)
    }
}

pub(crate) mod mxfp4;
#[cfg(test)]
mod tests;
