//! `kiln serve`'s choice between generation and pooling (embeddings), as vLLM's `--runner` and
//! `--convert embed` (its older `--task embed` is renamed to `--runner`, `args/foreign.rs`) and
//! llama-server's `--embedding`, with the pooler from the checkpoint or from `--pooler-config`
//! (vLLM's JSON) and `--pooling` (llama-server's).
//!
//! `auto` serves a checkpoint for pooling when it is an embedding model: a base model saved
//! without its head (`Qwen3Model`), a sentence-transformers directory (`modules.json`), or a
//! GGUF file with a pooling type, or any encoder (BERT, XLM-RoBERTa: `[CLS]` pooling,
//! normalised, unless the checkpoint says otherwise, as vLLM); or a cross-encoder
//! (`*ForSequenceClassification`, scored on its last token, or an encoder's first, unnormalised);
//! any other model is served for generation.

use std::path::Path;

use anyhow::Context;
use kiln_models::gguf::GgufFile;
use kiln_models::{ModelConfig, OutputHead, PoolerConfig, PoolingType};
use serde_json::Value;

/// What the model serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Runner {
    #[default]
    Auto,
    Generate,
    Pooling,
}

/// `--runner`: kiln's and vLLM's names, and the values of vLLM's `--task` / `--convert` that
/// mean one of them (the pooling tasks: what a pooling model serves follows from its head, an
/// embedding model's vectors or a sequence classifier's scores and labels); reward models are
/// refused by name.
fn parse_runner(name: &str) -> Result<Runner, String> {
    match name {
        "auto" | "none" => Ok(Runner::Auto),
        "generate" | "generation" => Ok(Runner::Generate),
        "pooling" | "embed" | "embedding" | "score" | "classify" | "rerank" | "reranking" => {
            Ok(Runner::Pooling)
        }
        "reward" => Err("`reward` is not supported yet: kiln serves generation, embeddings, \
                         scores and classification (--runner pooling)"
            .into()),
        _ => Err(format!("unknown runner `{name}` (auto, generate, pooling)")),
    }
}

#[derive(clap::Args, Clone, Debug, Default)]
pub struct PoolingArgs {
    /// What the model serves: `generate` (text: /v1/completions, /v1/chat/completions, ...),
    /// `pooling` (vectors: /v1/embeddings, /pooling), or `auto`: pooling for an embedding
    /// model (a base model saved without its LM head, a sentence-transformers directory, a
    /// GGUF with a pooling type), generation otherwise. vLLM's --task embed and --convert
    /// embed mean `pooling`.
    #[arg(long, default_value = "auto", value_parser = parse_runner)]
    pub(crate) runner: Runner,
    /// vLLM's --convert: `embed` serves a generative checkpoint for pooling (as --runner
    /// pooling), `none` changes nothing.
    #[arg(long, value_parser = parse_runner, value_name = "TYPE")]
    pub(crate) convert: Option<Runner>,
    /// llama-server's --embedding / --embeddings: --runner pooling.
    #[arg(long, visible_alias = "embeddings")]
    pub(crate) embedding: bool,
    /// The pooler, as vLLM's JSON: `{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize":
    /// true | false}` (either key). Default: the checkpoint's sentence-transformers modules
    /// or GGUF pooling type, else the last token, normalised. Implies --runner pooling.
    #[arg(long, visible_alias = "override-pooler-config", value_name = "JSON")]
    pub(crate) pooler_config: Option<String>,
    /// llama-server's --pooling: last, mean or cls (the pooling type alone). Implies --runner
    /// pooling.
    #[arg(long, value_name = "TYPE")]
    pub(crate) pooling: Option<String>,
}

impl PoolingArgs {
    /// The pooler to serve the model at `path` with, or `None` to serve it for generation.
    pub fn resolve(&self, path: &Path) -> anyhow::Result<Option<PoolerConfig>> {
        let overrides = self.overrides()?;
        let asked = self.embedding || overrides.is_some();
        let runner = match (self.runner, self.convert) {
            (runner, None | Some(Runner::Auto)) => runner,
            (Runner::Auto, Some(convert)) => convert,
            (runner, Some(convert)) if runner == convert => runner,
            (runner, Some(convert)) => anyhow::bail!(
                "--runner {runner:?} and --convert {convert:?} disagree: give one of them"
            ),
        };
        let runner = match runner {
            Runner::Generate if asked => anyhow::bail!(
                "--runner generate serves no embeddings: drop --embedding / --pooler-config / \
                 --pooling, or use --runner pooling"
            ),
            Runner::Auto if asked => Runner::Pooling,
            runner => runner,
        };
        if runner == Runner::Generate {
            return Ok(None);
        }
        let declared = PoolerConfig::of_model(path)
            .with_context(|| format!("reading the pooler of {}", path.display()))?;
        let (head, encoder) = checkpoint_head(path)?;
        // `auto`: an embedding model or a cross-encoder (generation returned above).
        let pooling =
            runner == Runner::Pooling || declared.is_some() || head != OutputHead::Lm || encoder;
        if !pooling {
            return Ok(None);
        }
        // A sequence classifier reads the last token (an encoder's: the first) unnormalised
        // (transformers' rule); an encoder embeds its first token, normalised (vLLM's).
        let first_or_last = if encoder { PoolingType::Cls } else { PoolingType::Last };
        let default = match head {
            OutputHead::Classifier { .. } => {
                PoolerConfig { pooling: first_or_last, normalize: false }
            }
            _ => PoolerConfig { pooling: first_or_last, normalize: true },
        };
        let mut config = declared.unwrap_or(default);
        if let Some((pooling, normalize)) = overrides {
            config.pooling = pooling.unwrap_or(config.pooling);
            config.normalize = normalize.unwrap_or(config.normalize);
        }
        Ok(Some(config))
    }

    /// `--pooler-config` and `--pooling`: the pooling type and normalisation they set.
    fn overrides(&self) -> anyhow::Result<Option<(Option<PoolingType>, Option<bool>)>> {
        let mut out = None;
        if let Some(json) = &self.pooler_config {
            let value: Value = serde_json::from_str(json)
                .with_context(|| format!("--pooler-config {json}: not JSON"))?;
            let Value::Object(map) = value else {
                anyhow::bail!("--pooler-config {json}: expected a JSON object");
            };
            let (mut kind, mut normalize) = (None, None);
            for (key, v) in &map {
                match (key.as_str(), v) {
                    ("pooling_type", Value::String(name)) => {
                        kind = Some(PoolingType::parse(name).ok_or_else(|| {
                            anyhow::anyhow!(
                                "--pooler-config: pooling_type `{name}` is not supported (LAST, \
                                 MEAN, CLS)"
                            )
                        })?);
                    }
                    ("normalize", Value::Bool(b)) => normalize = Some(*b),
                    ("pooling_type" | "normalize", _) => {
                        anyhow::bail!("--pooler-config: `{key}` has the wrong type ({v})")
                    }
                    _ => anyhow::bail!(
                        "--pooler-config: `{key}` is not supported (pooling_type, normalize are)"
                    ),
                }
            }
            out = Some((kind, normalize));
        }
        if let Some(name) = &self.pooling {
            let kind = PoolingType::parse(name).ok_or_else(|| {
                anyhow::anyhow!("--pooling `{name}` is not supported (last, mean, cls)")
            })?;
            let normalize = out.and_then(|(_, n)| n);
            out = Some((Some(kind), normalize));
        }
        Ok(out)
    }
}

/// The head of a Hugging Face directory's model (a GGUF file's is an LM head).
/// What sits on the checkpoint's last hidden state, and whether it is an encoder.
fn checkpoint_head(path: &Path) -> anyhow::Result<(OutputHead, bool)> {
    let config = if path.is_file() {
        ModelConfig::from_gguf(&GgufFile::open(path)?)?
    } else if path.join("config.json").is_file() {
        ModelConfig::from_file(&path.join("config.json"))?
    } else {
        return Ok((OutputHead::Lm, false));
    };
    Ok((config.head, config.encoder.is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(kind: &str, name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(kind).join(name)
    }

    fn args(runner: Runner) -> PoolingArgs {
        PoolingArgs { runner, ..PoolingArgs::default() }
    }

    #[test]
    fn auto_serves_embedding_models_for_pooling_and_others_for_generation() {
        let qwen3 = fixture("embedding", "qwen3-embed");
        let got = args(Runner::Auto).resolve(&qwen3).unwrap().unwrap();
        assert_eq!(got, PoolerConfig { pooling: PoolingType::Last, normalize: true });
        assert_eq!(args(Runner::Auto).resolve(&fixture("models", "llama3")).unwrap(), None);
        assert_eq!(args(Runner::Generate).resolve(&qwen3).unwrap(), None);
        // A generative checkpoint served for pooling: vLLM's default.
        let forced = args(Runner::Pooling).resolve(&fixture("models", "llama3")).unwrap();
        assert_eq!(forced, Some(PoolerConfig::DECODER_DEFAULT));
        let reranker = args(Runner::Auto).resolve(&fixture("embedding", "qwen3-rerank")).unwrap();
        assert_eq!(reranker, Some(PoolerConfig { pooling: PoolingType::Last, normalize: false }));
    }

    #[test]
    fn overrides_and_their_refusals() {
        let llama = fixture("models", "llama3");
        let json = PoolingArgs {
            pooler_config: Some(r#"{"pooling_type": "MEAN", "normalize": false}"#.into()),
            ..PoolingArgs::default()
        };
        let got = json.resolve(&llama).unwrap().unwrap();
        assert_eq!(got, PoolerConfig { pooling: PoolingType::Mean, normalize: false });
        let llama_server = PoolingArgs { pooling: Some("cls".into()), ..PoolingArgs::default() };
        let got = llama_server.resolve(&llama).unwrap().unwrap();
        assert_eq!(got, PoolerConfig { pooling: PoolingType::Cls, normalize: true });
        for (bad, needle) in [
            (r#"{"pooling_type": "MAX"}"#, "MAX"),
            (r#"{"softmax": true}"#, "softmax"),
            (r#"{"normalize": "yes"}"#, "wrong type"),
            ("[1]", "object"),
        ] {
            let a = PoolingArgs { pooler_config: Some(bad.into()), ..PoolingArgs::default() };
            let e = a.resolve(&llama).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
        let mixed = PoolingArgs { embedding: true, ..args(Runner::Generate) };
        assert!(mixed.resolve(&llama).unwrap_err().to_string().contains("--runner generate"));
        assert!(parse_runner("reward").unwrap_err().contains("not supported yet"));
        assert_eq!(parse_runner("classify"), Ok(Runner::Pooling));
        assert_eq!(parse_runner("embed"), Ok(Runner::Pooling));
    }
}
