//! GGUF tensors as model weights: shapes checked against the config (ggml lists dims
//! innermost first, so a `[rows, cols]` matrix is stored as `[cols, rows]`), data viewed in
//! place.

use std::sync::Arc;

use kiln_kernels::{GgmlType, Storage, WeightMatrix};

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

    /// The tensor as a `[rows, cols]` weight matrix (quantized types are repacked for the
    /// kernels; float types are viewed in place).
    fn weight(
        &self,
        info: &GgufTensorInfo,
        rows: usize,
        cols: usize,
    ) -> Result<WeightMatrix, LoadError> {
        let err =
            |m: String| LoadError::format(self.path(), format!("tensor `{}`: {m}", info.name));
        let ty = GgmlType::from_gguf_id(info.type_id)
            .ok_or_else(|| err(format!("unsupported type {}", info.type_id)))?;
        let bytes = Storage::mapped(Arc::clone(self.mapped_file()), info.offset, info.num_bytes)
            .ok_or_else(|| err("data out of bounds".into()))?;
        WeightMatrix::from_quantized(rows, cols, ty, bytes).ok_or_else(|| {
            err(format!("{} bytes do not hold [{rows}, {cols}] {}", info.num_bytes, ty.name()))
        })
    }
}

impl WeightSource for GgufFile {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix, LoadError> {
        let info = self.expect(name, &[cols as u64, rows as u64], &[rows, cols])?;
        self.weight(info, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let info = self.expect(name, &[len as u64], &[len])?;
        let m = self.weight(info, 1, len)?;
        let mut out = vec![0.0; len];
        m.row_to_f32(0, &mut out);
        Ok(out)
    }

    fn contains(&self, name: &str) -> bool {
        self.tensor(name).is_some()
    }
}
