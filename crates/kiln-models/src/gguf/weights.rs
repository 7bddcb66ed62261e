//! GGUF tensors as model weights: shapes checked against the config (ggml lists dims
//! innermost first, so a `[rows, cols]` matrix is stored as `[cols, rows]`), data viewed in
//! place.

use std::sync::Arc;

use kiln_backend::{GgmlType, HostTensor, Storage};

use super::{GgufFile, GgufTensorInfo};
use crate::LoadError;
use crate::weights::WeightSource;

impl GgufFile {
    fn expect(
        &self,
        name: &str,
        dims: &[u64],
        shape: &[usize],
    ) -> Result<&GgufTensorInfo, LoadError> {
        let info = self.tensor(name).ok_or_else(|| LoadError::MissingTensor {
            path: self.path().to_path_buf(),
            name: name.to_string(),
        })?;
        if info.dims != dims {
            return Err(LoadError::Shape {
                path: self.path().to_path_buf(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: info.dims.iter().rev().map(|&d| d as usize).collect(),
            });
        }
        Ok(info)
    }

    /// The tensor as a `[rows, cols]` host tensor viewing the mapped file.
    fn weight(
        &self,
        info: &GgufTensorInfo,
        rows: usize,
        cols: usize,
    ) -> Result<HostTensor, LoadError> {
        let err =
            |m: String| LoadError::format(self.path(), format!("tensor `{}`: {m}", info.name));
        let ty = GgmlType::from_gguf_id(info.type_id)
            .ok_or_else(|| err(format!("unsupported type {}", info.type_id)))?;
        let bytes =
            Storage::mapped(Arc::clone(self.mapped_file(info)), info.offset, info.num_bytes)
                .ok_or_else(|| err("data out of bounds".into()))?;
        HostTensor::new(ty, rows, cols, bytes).ok_or_else(|| {
            err(format!("{} bytes do not hold [{rows}, {cols}] {}", info.num_bytes, ty.name()))
        })
    }
}

impl WeightSource for GgufFile {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor, LoadError> {
        // A one-row matrix may be stored 1-D (llama.cpp's `ffn_gate_inp_shexp`).
        let flat = rows == 1 && self.tensor(name).is_some_and(|t| t.dims == [cols as u64]);
        let dims: &[u64] = if flat { &[cols as u64] } else { &[cols as u64, rows as u64] };
        let info = self.expect(name, dims, &[rows, cols])?;
        self.weight(info, rows, cols)
    }

    fn expert_matrix(
        &self,
        name: &str,
        (expert, num_experts): (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<HostTensor, LoadError> {
        let dims = [cols as u64, rows as u64, num_experts as u64];
        let info = self.expect(name, &dims, &[num_experts, rows, cols])?;
        let err = |m: String| LoadError::format(self.path(), format!("tensor `{name}`: {m}"));
        let ty = GgmlType::from_gguf_id(info.type_id)
            .ok_or_else(|| err(format!("unsupported type {}", info.type_id)))?;
        let per_expert = ty
            .row_bytes(cols)
            .and_then(|b| b.checked_mul(rows))
            .filter(|b| b.checked_mul(num_experts) == Some(info.num_bytes))
            .ok_or_else(|| {
                err(format!("{} bytes do not hold {num_experts} experts", info.num_bytes))
            })?;
        let start = info.offset + expert * per_expert;
        let bytes = Storage::mapped(Arc::clone(self.mapped_file(info)), start, per_expert)
            .ok_or_else(|| err("data out of bounds".into()))?;
        HostTensor::new(ty, rows, cols, bytes)
            .ok_or_else(|| err(format!("expert {expert} does not hold [{rows}, {cols}]")))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let info = self.expect(name, &[len as u64], &[len])?;
        let t = self.weight(info, 1, len)?;
        t.to_f32_vec().ok_or_else(|| {
            LoadError::format(self.path(), format!("1-D tensor `{name}` is not a float type"))
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.tensor(name).is_some()
    }
}
