//! Where a model's weights come from: a safetensors store or a GGUF file, optionally
//! quantized as they load (matrices only: norms and biases stay f32).

use kiln_kernels::{GgmlType, WeightData, WeightMatrix};

use crate::LoadError;
use crate::names::{Naming, Tensor};

/// Tensors by stored name.
pub(crate) trait WeightSource {
    /// A `[rows, cols]` matrix in its stored format.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix, LoadError>;
    /// A 1-D tensor of `len` elements as f32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError>;
    fn contains(&self, name: &str) -> bool;
}

/// A source, its naming, and the quantization to apply to float matrices.
pub(crate) struct Weights<'a> {
    pub source: &'a dyn WeightSource,
    pub naming: Naming,
    /// Quantize float matrices to this type as they load (`--quantization`).
    pub quantize: Option<GgmlType>,
}

impl Weights<'_> {
    pub(crate) fn contains(&self, t: Tensor) -> bool {
        self.source.contains(&self.naming.name(t))
    }

    pub(crate) fn matrix(
        &self,
        t: Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<WeightMatrix, LoadError> {
        let name = self.naming.name(t);
        let m = self.source.matrix(&name, rows, cols)?;
        let Some(ty) = self.quantize.and_then(|ty| fallback_type(ty, cols)) else { return Ok(m) };
        // Float checkpoints are quantized; quantized GGUF tensors keep their own type unless
        // a float type is asked for (dequantize: exact-arithmetic checks and debugging).
        let stored_quantized = matches!(m.data(), WeightData::Quant(_));
        if m.data().dtype_name() == ty.name() || (stored_quantized && ty.is_quantized()) {
            return Ok(m);
        }
        m.quantize(ty).map_err(|e| LoadError::Quantize { name, message: e.to_string() })
    }

    pub(crate) fn vector(&self, t: Tensor, len: usize) -> Result<Vec<f32>, LoadError> {
        self.source.vector(&self.naming.name(t), len)
    }

    /// The vector when `present`, else `None`.
    pub(crate) fn optional_vector(
        &self,
        t: Tensor,
        len: usize,
        present: bool,
    ) -> Result<Option<Vec<f32>>, LoadError> {
        if present { self.vector(t, len).map(Some) } else { Ok(None) }
    }
}

/// `ty`, or the type llama.cpp falls back to when `cols` is not a whole number of `ty`'s
/// blocks (K-quants need multiples of 256); `None` keeps the matrix as it is.
fn fallback_type(ty: GgmlType, cols: usize) -> Option<GgmlType> {
    let candidates = match ty {
        GgmlType::Q4K => [ty, GgmlType::Q5_0],
        GgmlType::Q5K | GgmlType::Q6K => [ty, GgmlType::Q8_0],
        _ => [ty, ty],
    };
    candidates.into_iter().find(|t| t.row_bytes(cols).is_some())
}
