//! How a pooling model (an embedding model) turns a sequence's final hidden states — the
//! decoder's output after its final norm, one row per token — into one vector: which rows
//! ([`PoolingType`]) and whether the result is scaled to unit length.
//!
//! Where it comes from, as vLLM reads it: a sentence-transformers checkpoint's `modules.json`
//! (its `Pooling` module's `config.json`, a `Normalize` module); a GGUF file's
//! `{arch}.pooling_type` (llama.cpp's embedding convention, normalised as llama-server's
//! `/v1/embeddings` answers); else vLLM's default for a decoder, the last token, normalised.
//! A module or mode kiln does not compute (`Dense`, max pooling, `include_prompt: false`) is
//! refused by name, never skipped.

use std::path::Path;

use serde_json::Value;

use crate::LoadError;
use crate::gguf::GgufFile;

/// Which final hidden rows make the vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolingType {
    /// The last token's row (Qwen3-Embedding, e5-mistral, gte-Qwen2).
    Last,
    /// The mean of every token's row.
    Mean,
    /// The first token's row.
    Cls,
}

impl PoolingType {
    /// vLLM's `pooling_type` names (`LAST`, `MEAN`, `CLS`) and llama-server's `--pooling`
    /// (`last`, `mean`, `cls`), any case.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "last" | "lasttoken" => Self::Last,
            "mean" => Self::Mean,
            "cls" => Self::Cls,
            _ => return None,
        })
    }

    /// vLLM's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Last => "LAST",
            Self::Mean => "MEAN",
            Self::Cls => "CLS",
        }
    }
}

/// A pooling model's pooler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolerConfig {
    pub pooling: PoolingType,
    /// Scale the pooled vector to unit L2 norm.
    pub normalize: bool,
}

impl PoolerConfig {
    /// vLLM's default for a decoder served for embeddings: the last token, normalised.
    pub const DECODER_DEFAULT: Self = Self { pooling: PoolingType::Last, normalize: true };

    /// The pooler the model at `path` (an HF directory or a GGUF file) declares, or `None`
    /// when it declares none.
    pub fn of_model(path: &Path) -> Result<Option<Self>, LoadError> {
        if path.is_file() {
            return Self::of_gguf(&GgufFile::open(path)?);
        }
        let modules = path.join("modules.json");
        if !modules.is_file() {
            return Ok(None);
        }
        Self::of_sentence_transformers(path, &read_json(&modules)?).map(Some)
    }

    /// A GGUF file's `{arch}.pooling_type` (llama.cpp: 0 none, 1 mean, 2 cls, 3 last, 4 rank).
    pub fn of_gguf(file: &GgufFile) -> Result<Option<Self>, LoadError> {
        let arch = file.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("");
        let key = format!("{arch}.pooling_type");
        let Some(value) = file.get(&key) else { return Ok(None) };
        let pooling = match value.as_u64() {
            Some(0) => return Ok(None),
            Some(1) => PoolingType::Mean,
            Some(2) => PoolingType::Cls,
            Some(3) => PoolingType::Last,
            Some(4) => {
                return Err(LoadError::format(
                    file.path(),
                    format!("{key} = 4 (rank): reranking models are not supported yet"),
                ));
            }
            _ => {
                return Err(LoadError::format(
                    file.path(),
                    format!("{key}: expected 0 to 4, found {}", value.type_name()),
                ));
            }
        };
        Ok(Some(Self { pooling, normalize: true }))
    }

    /// A sentence-transformers directory: `modules` is its `modules.json`.
    fn of_sentence_transformers(dir: &Path, modules: &Value) -> Result<Self, LoadError> {
        let path = dir.join("modules.json");
        let err = |m: String| LoadError::format(&path, m);
        let list = modules.as_array().ok_or_else(|| err("expected a list of modules".into()))?;
        let mut pooling = None;
        let mut normalize = false;
        for module in list {
            let kind = module.get("type").and_then(Value::as_str).unwrap_or("");
            let name = kind.rsplit('.').next().unwrap_or(kind);
            match name {
                "Transformer" if pooling.is_none() => {}
                "Pooling" if pooling.is_none() => {
                    let sub = module.get("path").and_then(Value::as_str).unwrap_or("");
                    if sub.contains("..") || sub.starts_with('/') {
                        return Err(err(format!("module path {sub:?} leaves the model directory")));
                    }
                    let config = dir.join(sub).join("config.json");
                    pooling = Some(pooling_module(&config, &read_json(&config)?)?);
                }
                "Normalize" if pooling.is_some() && !normalize => normalize = true,
                _ => {
                    return Err(err(format!(
                        "sentence-transformers module `{kind}` is not supported here (kiln \
                         computes Transformer, Pooling, Normalize, in that order)"
                    )));
                }
            }
        }
        let pooling = pooling.ok_or_else(|| err("no Pooling module".into()))?;
        Ok(Self { pooling, normalize })
    }
}

/// A sequence classifier's head (a cross-encoder's `score`), applied on the host to a pooled
/// last-token hidden state: `num_labels` logits, then the sigmoid of the one logit (a
/// relevance score, as vLLM's `/score` gives it) or the softmax over several labels.
#[derive(Clone, Debug, PartialEq)]
pub struct Classifier {
    num_labels: usize,
    /// `[num_labels, hidden]`
    weight: Vec<f32>,
    /// `[num_labels]` (an encoder's classifier; a decoder's `score` has none).
    bias: Option<Vec<f32>>,
    /// `([hidden, hidden], [hidden])`: a dense layer and tanh before `weight` (BERT's pooler,
    /// RoBERTa's `classifier.dense`).
    pre_dense: Option<(Vec<f32>, Vec<f32>)>,
    /// Each label's name (the checkpoint's `id2label`, else transformers' `LABEL_{i}`).
    labels: Vec<String>,
}

impl Classifier {
    /// `weight` is `[num_labels, hidden]`; `None` when its length is not a multiple. The
    /// labels are named `LABEL_{i}` until [`Self::with_labels`].
    pub fn new(num_labels: usize, weight: Vec<f32>) -> Option<Self> {
        let labels = (0..num_labels).map(|i| format!("LABEL_{i}")).collect();
        (num_labels > 0 && weight.len().is_multiple_of(num_labels) && !weight.is_empty())
            .then_some(Self { num_labels, weight, bias: None, pre_dense: None, labels })
    }

    /// The same head with a bias on its logits (`[num_labels]`).
    #[must_use]
    pub fn with_bias(mut self, bias: Vec<f32>) -> Self {
        self.bias = Some(bias);
        self
    }

    /// The same head with `tanh(weight · h + bias)` (`[hidden, hidden]`, `[hidden]`) applied
    /// to the pooled state first.
    #[must_use]
    pub fn with_pre_dense(mut self, weight: Vec<f32>, bias: Vec<f32>) -> Self {
        self.pre_dense = Some((weight, bias));
        self
    }

    /// The same head with the names of `id2label` (a map from the label's index, as a
    /// string, to its name); indices it lacks keep `LABEL_{i}`, others are ignored.
    #[must_use]
    pub fn with_labels(mut self, id2label: &serde_json::Map<String, serde_json::Value>) -> Self {
        for (index, name) in id2label {
            let slot = index.parse::<usize>().ok().and_then(|i| self.labels.get_mut(i));
            if let (Some(slot), Some(name)) = (slot, name.as_str()) {
                name.clone_into(slot);
            }
        }
        self
    }

    pub fn num_labels(&self) -> usize {
        self.num_labels
    }

    /// The labels' names, by index.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// The hidden size its rows take.
    pub fn width(&self) -> usize {
        self.weight.len() / self.num_labels
    }

    /// The scores of `hidden` (`[hidden]`): the dense layer and tanh when the head has one,
    /// then each label's logit (a dot product summed in element order, plus its bias), then
    /// the activation.
    pub fn scores(&self, hidden: &[f32]) -> Vec<f32> {
        let width = self.weight.len() / self.num_labels;
        let dot = |row: &[f32], x: &[f32]| row.iter().zip(x).map(|(w, h)| w * h).sum::<f32>();
        let dense: Option<Vec<f32>> = self.pre_dense.as_ref().map(|(w, b)| {
            w.chunks_exact(width)
                .zip(b)
                .map(|(row, bias)| (dot(row, hidden) + bias).tanh())
                .collect()
        });
        let x = dense.as_deref().unwrap_or(hidden);
        let logits: Vec<f32> = self
            .weight
            .chunks_exact(width)
            .enumerate()
            .map(|(i, row)| dot(row, x) + self.bias.as_ref().map_or(0.0, |b| b[i]))
            .collect();
        if let [logit] = logits[..] {
            return vec![1.0 / (1.0 + (-logit).exp())];
        }
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
        let sum: f32 = exp.iter().sum();
        exp.iter().map(|e| e / sum).collect()
    }
}

/// One sequence's pooled vector being gathered from its final hidden rows, chunk by chunk.
///
/// Rows come in position order; a chunk starting at position 0 starts again (a request
/// recomputed after preemption). The mean is a running f32 sum in position order, so a
/// prompt split into any chunks gives the same bits as one pass.
#[derive(Clone, Debug)]
pub struct PoolAccumulator {
    pooling: PoolingType,
    /// `[width]` the sum of rows (mean), or the row kept (last, CLS).
    acc: Vec<f32>,
    /// Positions added so far (mean: rows summed; CLS: whether row 0 was seen).
    rows: usize,
}

impl PoolAccumulator {
    pub fn new(pooling: PoolingType, width: usize) -> Self {
        Self { pooling, acc: vec![0.0; width], rows: 0 }
    }

    /// Which rows of a chunk the pool reads: every row (mean), the chunk's last row when it
    /// ends the sequence (last), or every row of the chunk holding position 0 (CLS).
    pub fn wants_all_rows(&self, first_position: usize) -> bool {
        match self.pooling {
            PoolingType::Mean => true,
            PoolingType::Cls => first_position == 0,
            PoolingType::Last => false,
        }
    }

    /// Adds the final hidden rows (`[n, width]`, back to back) of positions
    /// `first_position..first_position + n`. `Err` when a mean's rows skip positions (the
    /// caller must hand over every row: no prefix-cache hit).
    pub fn add(&mut self, first_position: usize, rows: &[f32]) -> Result<(), String> {
        let width = self.acc.len();
        if width == 0 || rows.is_empty() {
            return Ok(());
        }
        if first_position == 0 {
            self.acc.fill(0.0);
            self.rows = 0;
        }
        match self.pooling {
            PoolingType::Last => {
                self.acc.copy_from_slice(&rows[rows.len() - width..]);
                self.rows = first_position + rows.len() / width;
            }
            PoolingType::Cls => {
                if first_position == 0 {
                    self.acc.copy_from_slice(&rows[..width]);
                    self.rows = 1;
                }
            }
            PoolingType::Mean => {
                if first_position != self.rows {
                    return Err(format!(
                        "mean pooling got rows from position {first_position} after {} rows",
                        self.rows
                    ));
                }
                for row in rows.chunks_exact(width) {
                    for (a, x) in self.acc.iter_mut().zip(row) {
                        *a += x;
                    }
                    self.rows += 1;
                }
            }
        }
        Ok(())
    }

    /// The pooled vector: its first `dimensions` values (all by default; a Matryoshka
    /// model's shorter embedding), scaled to unit length when `normalize` (as
    /// `torch.nn.functional.normalize`: divided by the norm, at least 1e-12). `None` before
    /// any row.
    pub fn finish(&self, normalize: bool, dimensions: Option<usize>) -> Option<Vec<f32>> {
        if self.rows == 0 {
            return None;
        }
        let scale = match self.pooling {
            PoolingType::Mean => 1.0 / self.rows as f32,
            PoolingType::Last | PoolingType::Cls => 1.0,
        };
        let len = dimensions.unwrap_or(self.acc.len()).min(self.acc.len());
        let mut out: Vec<f32> = self.acc[..len].iter().map(|a| a * scale).collect();
        if normalize {
            let norm = out.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            for x in &mut out {
                *x /= norm;
            }
        }
        Some(out)
    }
}

/// A `Pooling` module's `config.json`: sentence-transformers 5's `pooling_mode` string or the
/// older `pooling_mode_*` flags, exactly one of them set.
fn pooling_module(path: &Path, config: &Value) -> Result<PoolingType, LoadError> {
    let err = |m: String| LoadError::format(path, m);
    if config.get("include_prompt").and_then(Value::as_bool) == Some(false) {
        return Err(err("include_prompt: false (an instruction left out of the pool) is not \
                        supported"
            .into()));
    }
    let modes: Vec<String> = match config.get("pooling_mode").and_then(Value::as_str) {
        Some(mode) => vec![mode.to_owned()],
        None => [
            ("pooling_mode_cls_token", "cls"),
            ("pooling_mode_mean_tokens", "mean"),
            ("pooling_mode_max_tokens", "max"),
            ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
            ("pooling_mode_weightedmean_tokens", "weightedmean"),
            ("pooling_mode_lasttoken", "lasttoken"),
        ]
        .into_iter()
        .filter(|(key, _)| config.get(key).and_then(Value::as_bool) == Some(true))
        .map(|(_, mode)| mode.to_owned())
        .collect(),
    };
    match modes.as_slice() {
        [mode] => PoolingType::parse(mode).ok_or_else(|| {
            err(format!("pooling mode `{mode}` is not supported (cls, mean, lasttoken are)"))
        }),
        [] => Err(err("no pooling mode set".into())),
        _ => Err(err(format!(
            "several pooling modes at once ({}) are not supported",
            modes.join(", ")
        ))),
    }
}

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::format(path, format!("invalid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module_dir(modules: &str, pooling: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("modules.json"), modules).unwrap();
        std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
        std::fs::write(dir.path().join("1_Pooling/config.json"), pooling).unwrap();
        dir
    }

    const MODULES: &str = r#"[
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    ]"#;

    #[test]
    fn sentence_transformers_modes_old_and_new() {
        let dir = module_dir(MODULES, r#"{"pooling_mode": "lasttoken"}"#);
        let c = PoolerConfig::of_model(dir.path()).unwrap().unwrap();
        assert_eq!(c, PoolerConfig { pooling: PoolingType::Last, normalize: true });
        let flags = r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false}"#;
        let without_normalize = MODULES.replace(
            r#",
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}"#,
            "",
        );
        let dir = module_dir(&without_normalize, flags);
        let c = PoolerConfig::of_model(dir.path()).unwrap().unwrap();
        assert_eq!(c, PoolerConfig { pooling: PoolingType::Mean, normalize: false });
    }

    #[test]
    fn what_kiln_does_not_compute_is_refused_by_name() {
        let refused = |modules: &str, pooling: &str, needle: &str| {
            let dir = module_dir(modules, pooling);
            let e = PoolerConfig::of_model(dir.path()).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        };
        refused(MODULES, r#"{"pooling_mode": "max"}"#, "`max`");
        refused(
            MODULES,
            r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}"#,
            "several",
        );
        refused(MODULES, r#"{"pooling_mode": "mean", "include_prompt": false}"#, "include_prompt");
        let dense = MODULES.replace("models.Normalize", "models.Dense");
        refused(&dense, r#"{"pooling_mode": "mean"}"#, "models.Dense");
        let escape = MODULES.replace(r#""path": "1_Pooling""#, r#""path": "../x""#);
        refused(&escape, r#"{"pooling_mode": "mean"}"#, "leaves");
    }

    #[test]
    fn chunks_give_the_bits_of_one_pass() {
        let rows: Vec<f32> = (0..5 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
        for pooling in [PoolingType::Mean, PoolingType::Last, PoolingType::Cls] {
            let mut one = PoolAccumulator::new(pooling, 3);
            one.add(0, &rows).unwrap();
            let mut chunked = PoolAccumulator::new(pooling, 3);
            chunked.add(0, &rows[..6]).unwrap();
            // What the runner hands over after the first chunk: every row, or the last.
            let rest = if pooling == PoolingType::Mean { &rows[6..] } else { &rows[12..] };
            let first = if pooling == PoolingType::Mean { 2 } else { 4 };
            chunked.add(first, rest).unwrap();
            for normalize in [false, true] {
                assert_eq!(one.finish(normalize, None), chunked.finish(normalize, None));
            }
        }
        let mut mean = PoolAccumulator::new(PoolingType::Mean, 3);
        assert_eq!(mean.finish(true, None), None);
        mean.add(0, &rows[..3]).unwrap();
        assert!(mean.add(2, &rows[3..6]).unwrap_err().contains("position 2"));
        let short = mean.finish(true, Some(2)).unwrap();
        assert_eq!(short.len(), 2);
        assert!((short[0].hypot(short[1]) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn classifier_scores_are_a_sigmoid_or_a_softmax() {
        let one = Classifier::new(1, vec![1.0, -2.0]).unwrap();
        let got = one.scores(&[0.5, 0.25])[0];
        assert!((got - 0.5).abs() < 1e-7, "the sigmoid of 0 is 0.5, got {got}");
        let three = Classifier::new(3, vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0]).unwrap();
        let p = three.scores(&[2.0, -1.0]);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(p[0] > p[2] && p[2] > p[1], "{p:?}");
        assert_eq!(three.width(), 2);
        assert!(Classifier::new(3, vec![1.0; 4]).is_none());
        assert!(Classifier::new(0, vec![]).is_none());
    }

    #[test]
    fn no_modules_json_declares_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(PoolerConfig::of_model(dir.path()).unwrap(), None);
        assert_eq!(PoolingType::parse("LAST"), Some(PoolingType::Last));
        assert_eq!(PoolingType::parse("max"), None);
    }
}
