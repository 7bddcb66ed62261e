//! The served model's tokenizer as `kiln bench serve`'s [`PromptTokenizer`]: loaded from a
//! GGUF file or HF directory without the weights (or the default model, fetched once).

use anyhow::Context;
use kiln_bench::PromptTokenizer;
use kiln_models::load_tokenizer;
use kiln_tokenizer::Tokenizer;

use crate::model_arg::ModelArgs;

pub struct BenchTokenizer(Tokenizer);

impl BenchTokenizer {
    /// `spec`: a GGUF file, an HF directory, or the default model's name.
    pub fn load(spec: &str) -> anyhow::Result<Self> {
        let path = ModelArgs::named(spec).resolve()?;
        let tok = load_tokenizer(&path)
            .with_context(|| format!("loading the tokenizer of {}", path.display()))?;
        Ok(Self(tok))
    }
}

impl PromptTokenizer for BenchTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.0.encode(text, false).unwrap_or_default()
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.0.decode(ids, true).unwrap_or_default()
    }

    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }

    fn is_special(&self, id: u32) -> bool {
        !self.0.is_ordinary(id)
    }
}
