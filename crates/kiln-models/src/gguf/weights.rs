//! GGUF tensors as model weights: shapes checked against the config (ggml lists dims
//! innermost first, so a `[rows, cols]` matrix is stored as `[cols, rows]`), data viewed in
//! place.

use std::sync::Arc;

use half::{bf16, f16};
use kiln_kernels::{Storage, WeightData, WeightMatrix};

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

    /// The tensor as a `[rows, cols]` weight matrix.
    fn weight(
        &self,
        info: &GgufTensorInfo,
        rows: usize,
        cols: usize,
    ) -> Result<WeightMatrix, LoadError> {
        let file = Arc::clone(self.mapped_file());
        let n = rows * cols;
        let bytes = self.tensor_bytes(info);
        let data = match info.type_id {
            0 => WeightData::F32(Storage::mapped(file, info.offset, n).unwrap_or_else(|| {
                Storage::Owned(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
            })),
            1 => WeightData::F16(Storage::mapped(file, info.offset, n).unwrap_or_else(|| {
                Storage::Owned(
                    bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect(),
                )
            })),
            30 => WeightData::Bf16(Storage::mapped(file, info.offset, n).unwrap_or_else(|| {
                Storage::Owned(
                    bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect(),
                )
            })),
            t => {
                return Err(LoadError::Dtype {
                    path: self.path().to_path_buf(),
                    name: info.name.clone(),
                    dtype: format!("ggml type {t}"),
                });
            }
        };
        WeightMatrix::new(rows, cols, data)
            .ok_or_else(|| LoadError::format(self.path(), format!("tensor `{}` size", info.name)))
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
