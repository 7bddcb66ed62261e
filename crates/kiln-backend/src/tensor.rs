//! A tensor as loaded from a model file, before any backend touched it: its ggml type, its
//! `[rows, cols]` shape and its bytes (owned, or a view into a memory-mapped file).
//!
//! Invariant: `bytes` holds exactly `rows` rows of `ty.row_bytes(cols)` bytes; checked once in
//! [`HostTensor::new`]. 1-D tensors are `[1, len]`.

use half::{bf16, f16};

use crate::{GgmlType, Storage};

/// A loaded tensor in its stored format.
pub struct HostTensor {
    ty: GgmlType,
    /// `[rows, cols]`
    shape: [usize; 2],
    bytes: Storage<u8>,
}

impl HostTensor {
    /// `None` unless `bytes` holds exactly `rows` rows of `cols` elements of `ty`.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, bytes: Storage<u8>) -> Option<Self> {
        let expected = rows.checked_mul(ty.row_bytes(cols)?)?;
        (bytes.len() == expected).then_some(Self { ty, shape: [rows, cols], bytes })
    }

    /// An owned f32 tensor `[rows, cols]` (tests, converted weights).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Option<Self> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(GgmlType::F32, rows, cols, bytes.into())
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.shape[0]
    }

    pub fn cols(&self) -> usize {
        self.shape[1]
    }

    pub fn bytes(&self) -> &Storage<u8> {
        &self.bytes
    }

    pub fn into_bytes(self) -> Storage<u8> {
        self.bytes
    }

    /// Rows `first..first + rows` (a part of a fused matrix), viewing the same mapped bytes
    /// (an owned tensor's are copied); `None` when out of range.
    pub fn rows_slice(&self, first: usize, rows: usize) -> Option<Self> {
        let end = first.checked_add(rows).filter(|&e| e <= self.rows())?;
        let row_bytes = self.ty.row_bytes(self.cols())?;
        let (start, len) = (first * row_bytes, (end - first) * row_bytes);
        let bytes = match &self.bytes {
            Storage::Owned(v) => Storage::Owned(v[start..start + len].to_vec()),
            Storage::Mapped { file, byte_offset, .. } => {
                Storage::mapped(std::sync::Arc::clone(file), byte_offset + start, len)?
            }
        };
        Self::new(self.ty, rows, self.cols(), bytes)
    }

    /// The elements as f32, for float types (norm weights and biases are loaded this way);
    /// `None` for block-quantized types, which only backends decode.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        let b = self.bytes.as_slice();
        let pairs = || b.chunks_exact(2).map(|c| [c[0], c[1]]);
        Some(match self.ty {
            GgmlType::F32 => {
                b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            GgmlType::F16 => pairs().map(|c| f16::from_le_bytes(c).to_f32()).collect(),
            GgmlType::Bf16 => pairs().map(|c| bf16::from_le_bytes(c).to_f32()).collect(),
            _ => return None,
        })
    }
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostTensor({} {:?})", self.ty, self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked_and_floats_decode() {
        assert!(HostTensor::new(GgmlType::F16, 2, 3, vec![0u8; 11].into()).is_none());
        assert!(HostTensor::new(GgmlType::Q8_0, 1, 31, vec![0u8; 34].into()).is_none());
        let t = HostTensor::from_f32(1, 3, &[1.0, -2.5, 3.25]).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, -2.5, 3.25]);
        let h: Vec<u8> =
            [0.5f32, -1.0].iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect();
        let t = HostTensor::new(GgmlType::F16, 1, 2, h.into()).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), vec![0.5, -1.0]);
        let q = HostTensor::new(GgmlType::Q8_0, 1, 32, vec![0u8; 34].into()).unwrap();
        assert!(q.to_f32_vec().is_none());
    }
}
