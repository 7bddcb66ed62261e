//! Where a model's weights come from: a safetensors store or a GGUF file, optionally
//! quantized as they load.

use kiln_kernels::WeightMatrix;

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
        self.source.matrix(&name, rows, cols)
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
