//! Where a model's weights come from: a safetensors store or a GGUF file, as host tensors
//! moved onto the model's backend, optionally converted as they load (matrices only: norms and
//! biases stay f32).

use std::collections::HashMap;

use kiln_backend::{Backend, GgmlType, HostTensor};

use crate::LoadError;
use crate::names::{ExpertMatrix, ExpertName, Naming, Tensor};

/// Tensors by stored name.
pub(crate) trait WeightSource {
    /// A `[rows, cols]` matrix in its stored format.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor, LoadError>;
    /// [`WeightSource::matrix`], for a caller that can permute the matrix's input: a matrix
    /// whose columns are stored in another order than its input's (act-order GPTQ, sorted by
    /// group) comes with that order, column `j` being input `order[j]`.
    fn ordered_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(HostTensor, Option<Vec<usize>>), LoadError> {
        Ok((self.matrix(name, rows, cols)?, None))
    }
    /// Expert `e`'s `[rows, cols]` slice of a `[n, rows, cols]` tensor, `expert = (e, n)`.
    fn expert_matrix(
        &self,
        name: &str,
        expert: (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<HostTensor, LoadError>;
    /// A 1-D tensor of `len` elements as f32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError>;
    fn contains(&self, name: &str) -> bool;
    /// Expert `e`'s `[rows, cols]` matrix as GGUF's MXFP4 blocks, from a checkpoint's MXFP4
    /// `{name}_blocks` / `{name}_scales` stacks (gpt-oss; `part` as in
    /// [`ExpertName::StackedTransposed`], over rows). Only safetensors stores have them.
    fn mxfp4_expert(
        &self,
        name: &str,
        expert: (usize, usize),
        part: Option<usize>,
        shape: (usize, usize),
    ) -> Result<HostTensor, LoadError> {
        let _ = (expert, part, shape);
        Err(LoadError::Backend {
            name: name.to_string(),
            message: "MXFP4 expert blocks come from safetensors checkpoints only".into(),
        })
    }
}

/// A source whose tensors are stored under other names: `rename` maps the name the decoder
/// asks for to the stored one (a multimodal checkpoint's text model under its prefix,
/// [`text_model_name`]; a family's own GGUF names).
pub(crate) struct Renamed<'a, F: Fn(&str) -> String> {
    pub inner: &'a dyn WeightSource,
    pub rename: F,
}

impl<F: Fn(&str) -> String> WeightSource for Renamed<'_, F> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor, LoadError> {
        self.inner.matrix(&(self.rename)(name), rows, cols)
    }

    fn ordered_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(HostTensor, Option<Vec<usize>>), LoadError> {
        self.inner.ordered_matrix(&(self.rename)(name), rows, cols)
    }

    fn expert_matrix(
        &self,
        name: &str,
        expert: (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<HostTensor, LoadError> {
        self.inner.expert_matrix(&(self.rename)(name), expert, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        self.inner.vector(&(self.rename)(name), len)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(&(self.rename)(name))
    }

    fn mxfp4_expert(
        &self,
        name: &str,
        expert: (usize, usize),
        part: Option<usize>,
        shape: (usize, usize),
    ) -> Result<HostTensor, LoadError> {
        self.inner.mxfp4_expert(&(self.rename)(name), expert, part, shape)
    }
}

/// Where a checkpoint keeps its text model under another prefix than `model.`, as `(model
/// prefix, head name)`: a multimodal checkpoint's, transformers 5's layout, then the Hub's
/// (`Gemma3ForConditionalGeneration`); a bare base model's, at the top; `None` when `source`
/// has none of them.
pub(crate) fn text_model_layout(source: &dyn WeightSource) -> Option<(&'static str, &'static str)> {
    [
        ("model.language_model.", "lm_head.weight"),
        ("language_model.model.", "language_model.lm_head.weight"),
        // A base model saved alone (`Qwen3Model`: an embedding model's tensors, no head).
        ("", "lm_head.weight"),
    ]
    .into_iter()
    .find(|(model, _)| source.contains(&format!("{model}embed_tokens.weight")))
}

/// The stored name of `name` in a text model laid out as `(model, head)`
/// ([`text_model_layout`]): `model.X` is `{model}X`, the head is `head`.
pub(crate) fn text_model_name(model: &str, head: &str, name: &str) -> String {
    match name.strip_prefix("model.") {
        Some(rest) => format!("{model}{rest}"),
        None if name == "lm_head.weight" => head.to_owned(),
        None => name.to_owned(),
    }
}

/// Matrices stored fused and read as their parts (Phi-3's `qkv_proj`, `gate_up_proj`):
/// `parts` maps a part's name to the fused tensor's name, the part's first row and the fused
/// tensor's rows. Other names pass through.
pub(crate) struct FusedParts<'a> {
    pub inner: &'a dyn WeightSource,
    pub parts: HashMap<String, (String, usize, usize)>,
}

impl FusedParts<'_> {
    /// Rows `first..first + rows` of `whole` (the fused tensor `fused`), as part `name`.
    fn part(
        whole: &HostTensor,
        fused: &str,
        name: &str,
        first: usize,
        rows: usize,
    ) -> Result<HostTensor, LoadError> {
        whole.rows_slice(first, rows).ok_or_else(|| LoadError::Shape {
            path: std::path::PathBuf::from(fused),
            name: name.to_owned(),
            expected: vec![rows, whole.cols()],
            found: vec![whole.rows(), whole.cols()],
        })
    }
}

impl WeightSource for FusedParts<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor, LoadError> {
        let Some((fused, first, total)) = self.parts.get(name) else {
            return self.inner.matrix(name, rows, cols);
        };
        let whole = self.inner.matrix(fused, *total, cols)?;
        Self::part(&whole, fused, name, *first, rows)
    }

    fn ordered_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(HostTensor, Option<Vec<usize>>), LoadError> {
        let Some((fused, first, total)) = self.parts.get(name) else {
            return self.inner.ordered_matrix(name, rows, cols);
        };
        let (whole, order) = self.inner.ordered_matrix(fused, *total, cols)?;
        Ok((Self::part(&whole, fused, name, *first, rows)?, order))
    }

    fn expert_matrix(
        &self,
        name: &str,
        expert: (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<HostTensor, LoadError> {
        self.inner.expert_matrix(name, expert, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        self.inner.vector(name, len)
    }

    fn contains(&self, name: &str) -> bool {
        match self.parts.get(name) {
            Some((fused, ..)) => self.inner.contains(fused),
            None => self.inner.contains(name),
        }
    }
}

/// A source, its naming, the backend the weights go to, and the conversion to apply to float
/// matrices.
pub(crate) struct Weights<'a, B: Backend> {
    pub source: &'a dyn WeightSource,
    pub naming: Naming,
    pub backend: &'a B,
    /// Quantize float matrices to this type as they load (`--quantization`).
    pub quantize: Option<GgmlType>,
}

impl<B: Backend> Weights<'_, B> {
    pub(crate) fn contains(&self, t: Tensor) -> bool {
        self.source.contains(&self.naming.name(t))
    }

    pub(crate) fn matrix(
        &self,
        t: Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<B::Weight, LoadError> {
        let name = self.naming.name(t);
        let tensor = self.source.matrix(&name, rows, cols)?;
        self.load(name, tensor)
    }

    /// [`Weights::matrix`] with its input order ([`WeightSource::ordered_matrix`]), for a
    /// caller that permutes the matrix's input when there is one; refused on a backend that
    /// cannot ([`Backend::supports_permuted_inputs`]).
    pub(crate) fn ordered_matrix(
        &self,
        t: Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<(B::Weight, Option<Vec<usize>>), LoadError> {
        let name = self.naming.name(t);
        let (tensor, order) = self.source.ordered_matrix(&name, rows, cols)?;
        if order.is_some() && !self.backend.supports_permuted_inputs() {
            return Err(LoadError::Backend {
                name,
                message: format!(
                    "act-order (desc_act) GPTQ matrices need their input permuted, which the {} \
                     backend does not do",
                    self.backend.name()
                ),
            });
        }
        Ok((self.load(name, tensor)?, order))
    }

    /// Moves `tensor` (matrix `name`) onto the backend, converted as `--quantization` says.
    fn load(&self, name: String, tensor: HostTensor) -> Result<B::Weight, LoadError> {
        let cols = tensor.cols();
        let convert = self.quantize.and_then(|ty| conversion(tensor.ty(), ty, cols));
        self.backend
            .load_weight(tensor, convert)
            .map_err(|e| LoadError::Backend { name, message: e.to_string() })
    }

    /// Row ranges `parts` (`(first, rows)`) of the `[rows, cols]` matrix `t`, each one matrix,
    /// converted like [`Weights::matrix`].
    pub(crate) fn matrix_parts(
        &self,
        t: Tensor,
        (rows, cols): (usize, usize),
        parts: &[(usize, usize)],
    ) -> Result<Vec<B::Weight>, LoadError> {
        let name = self.naming.name(t);
        let tensor = self.source.matrix(&name, rows, cols)?;
        parts
            .iter()
            .map(|&(first, n)| {
                let part = tensor.rows_slice(first, n).ok_or_else(|| LoadError::Backend {
                    name: name.clone(),
                    message: format!("rows {first}..{} of {rows}", first + n),
                })?;
                self.load(format!("{name}[{first}..{}]", first + n), part)
            })
            .collect()
    }

    /// The matrix stored as `name` (a model whose tensors have no [`Tensor`] role: an
    /// encoder), converted like [`Weights::matrix`].
    pub(crate) fn named_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<B::Weight, LoadError> {
        let tensor = self.source.matrix(name, rows, cols)?;
        self.load(name.to_string(), tensor)
    }

    /// The vector stored as `name`, as f32 on the backend.
    pub(crate) fn named_vector(&self, name: &str, len: usize) -> Result<B::Vector, LoadError> {
        let values = self.source.vector(name, len)?;
        self.backend
            .load_vector(&values)
            .map_err(|e| LoadError::Backend { name: name.to_string(), message: e.to_string() })
    }

    /// Moves a matrix built on the host (`name` names it in errors) onto the backend,
    /// converted like [`Weights::matrix`].
    pub(crate) fn host_matrix(
        &self,
        name: String,
        tensor: HostTensor,
    ) -> Result<B::Weight, LoadError> {
        self.load(name, tensor)
    }

    /// A matrix kept in its stored type whatever `--quantization` asks (a router: its scores
    /// pick the experts, so they are computed in float as the checkpoint has them).
    pub(crate) fn float_matrix(
        &self,
        t: Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<B::Weight, LoadError> {
        let name = self.naming.name(t);
        let tensor = self.source.matrix(&name, rows, cols)?;
        self.backend
            .load_weight(tensor, None)
            .map_err(|e| LoadError::Backend { name, message: e.to_string() })
    }

    /// Expert `e` (of `num_experts`)'s matrix `m` of layer `l`, `[rows, cols]`, converted like
    /// [`Weights::matrix`].
    pub(crate) fn expert_matrix(
        &self,
        (l, m): (usize, ExpertMatrix),
        (e, num_experts): (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<B::Weight, LoadError> {
        let (name, tensor) = match self.naming.expert(l, m, e) {
            ExpertName::Own(name) => {
                let tensor = self.source.matrix(&name, rows, cols)?;
                (name, tensor)
            }
            ExpertName::Stacked(name) => {
                let tensor = self.source.expert_matrix(&name, (e, num_experts), rows, cols)?;
                (format!("{name}[{e}]"), tensor)
            }
            ExpertName::StackedTransposed { name, part } => {
                let tensor = self.transposed_expert(&name, (e, num_experts), (rows, cols), part)?;
                (format!("{name}[{e}]"), tensor)
            }
        };
        let convert = self.quantize.and_then(|ty| conversion(tensor.ty(), ty, cols));
        self.backend
            .load_weight(tensor, convert)
            .map_err(|e| LoadError::Backend { name, message: e.to_string() })
    }

    /// Expert `e`'s `[rows, cols]` matrix from a stack of transposed ones (`[num_experts, cols,
    /// width]`, `width` twice `rows` with `part`: every second column from `part`).
    fn transposed_expert(
        &self,
        name: &str,
        (e, num_experts): (usize, usize),
        (rows, cols): (usize, usize),
        part: Option<usize>,
    ) -> Result<HostTensor, LoadError> {
        if !self.source.contains(name) && self.source.contains(&format!("{name}_blocks")) {
            // An MXFP4 checkpoint (gpt-oss as released): its blocks become GGUF's, as they are.
            return self.source.mxfp4_expert(name, (e, num_experts), part, (rows, cols));
        }
        let width = if part.is_some() { 2 * rows } else { rows };
        let stored = self.source.expert_matrix(name, (e, num_experts), cols, width)?;
        let bad = |m: &str| LoadError::Backend { name: name.to_string(), message: m.to_string() };
        let values = stored.to_f32_vec().ok_or_else(|| bad("a stacked expert must be floats"))?;
        let (step, first) = part.map_or((1, 0), |p| (2, p));
        let mut out = vec![0.0f32; rows * cols];
        for (c, stored_row) in values.chunks_exact(width).enumerate() {
            for r in 0..rows {
                out[r * cols + c] = stored_row[first + step * r];
            }
        }
        HostTensor::from_f32(rows, cols, &out).ok_or_else(|| bad("expert shape"))
    }

    /// Every expert's `[width]` bias of matrix `m` of layer `l` (gpt-oss), on the backend.
    pub(crate) fn expert_biases(
        &self,
        (l, m): (usize, ExpertMatrix),
        num_experts: usize,
        width: usize,
    ) -> Result<Vec<B::Vector>, LoadError> {
        let (name, part) = self.naming.expert_bias(l, m);
        let stored = if part.is_some() { 2 * width } else { width };
        let tensor = self.source.matrix(&name, num_experts, stored)?;
        let bad = |m: &str| LoadError::Backend { name: name.clone(), message: m.to_string() };
        let values = tensor.to_f32_vec().ok_or_else(|| bad("expert biases must be floats"))?;
        let (step, first) = part.map_or((1, 0), |p| (2, p));
        values
            .chunks_exact(stored)
            .map(|row| {
                let bias: Vec<f32> = (0..width).map(|i| row[first + step * i]).collect();
                self.backend.load_vector(&bias).map_err(|e| bad(&e.to_string()))
            })
            .collect()
    }

    pub(crate) fn vector(&self, t: Tensor, len: usize) -> Result<B::Vector, LoadError> {
        let values = self.source.vector(&self.naming.name(t), len)?;
        self.load_vector(t, &values)
    }

    /// Moves `values` (the f32 form of `t`) onto the backend.
    pub(crate) fn load_vector(&self, t: Tensor, values: &[f32]) -> Result<B::Vector, LoadError> {
        self.backend
            .load_vector(values)
            .map_err(|e| LoadError::Backend { name: self.naming.name(t), message: e.to_string() })
    }

    /// The vector when `present`, else `None`.
    pub(crate) fn optional_vector(
        &self,
        t: Tensor,
        len: usize,
        present: bool,
    ) -> Result<Option<B::Vector>, LoadError> {
        if present { self.vector(t, len).map(Some) } else { Ok(None) }
    }
}

/// The conversion to apply to a matrix stored as `stored` when `--quantization` asks for
/// `wanted`: float checkpoints are quantized; quantized GGUF tensors keep their own type unless
/// a float type is asked for (dequantize: exact-arithmetic checks and debugging). `None` keeps
/// the matrix as it is.
fn conversion(stored: GgmlType, wanted: GgmlType, cols: usize) -> Option<GgmlType> {
    let ty = fallback_type(wanted, cols)?;
    let keep = stored == ty || (stored.is_quantized() && ty.is_quantized());
    (!keep).then_some(ty)
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
