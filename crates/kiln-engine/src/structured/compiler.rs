//! Compiling a [`StructuredOutput`] for one vocabulary, with a cache of compiled grammars.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_core::StructuredOutput;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};

use super::Constraint;

/// Compiled grammars kept for reuse (least recently used evicted first).
const CACHE_CAPACITY: usize = 128;

/// A grammar or schema that cannot be compiled, or a vocabulary llguidance refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct GrammarError {
    pub message: String,
}

fn err(message: impl Into<String>) -> GrammarError {
    GrammarError { message: message.into() }
}

/// Compiles structured-output constraints over one model's vocabulary (module docs of
/// [`crate::structured`]). `Send + Sync`: one per model, shared.
pub struct GrammarCompiler {
    factory: ParserFactory,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Cache {
    entries: HashMap<StructuredOutput, (TokenParser, u64)>,
    clock: u64,
}

/// How a [`GrammarCompiler::compile`] went: from the cache or compiled, and how long it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompileInfo {
    pub cached: bool,
    pub elapsed: Duration,
}

impl GrammarCompiler {
    /// A compiler for a model whose logits have `vocab_size` entries. `token_bytes[id]` is what
    /// token `id` decodes to (special tokens marked with a leading `0xFF`, see
    /// `kiln_tokenizer::Tokenizer::token_bytes`); ids it does not cover are never allowed.
    /// `eos_token_ids` end the output when the grammar is complete.
    pub fn new(
        mut token_bytes: Vec<Vec<u8>>,
        vocab_size: usize,
        eos_token_ids: &[u32],
    ) -> Result<Self, GrammarError> {
        let Some(&eos) = eos_token_ids.first() else {
            return Err(err("structured outputs need the model's end-of-sequence token id"));
        };
        if let Some(bad) = eos_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(err(format!("end-of-sequence id {bad} is outside the vocabulary")));
        }
        let vocab = u32::try_from(vocab_size).map_err(|_| err("vocabulary too large"))?;
        token_bytes.resize(vocab_size, Vec::new());
        let info = TokRxInfo::new(vocab, eos);
        let trie = std::panic::catch_unwind(|| {
            TokTrie::from(&info, &token_bytes).with_eos_tokens(eos_token_ids)
        })
        .map_err(|_| err("llguidance refused the vocabulary (a token longer than 255 bytes?)"))?;
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| err(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory, cache: Mutex::new(Cache::default()) })
    }

    /// A fresh constraint for `spec` (from the cache when it was compiled recently).
    pub fn compile(&self, spec: &StructuredOutput) -> Result<Constraint, GrammarError> {
        self.compile_timed(spec).map(|(c, _)| c)
    }

    /// [`GrammarCompiler::compile`], saying whether the cache had it and how long it took.
    pub fn compile_timed(
        &self,
        spec: &StructuredOutput,
    ) -> Result<(Constraint, CompileInfo), GrammarError> {
        let start = Instant::now();
        if let Some(parser) = self.cached(spec) {
            let info = CompileInfo { cached: true, elapsed: start.elapsed() };
            return Ok((Constraint::new(Matcher::new(Ok(parser)))?, info));
        }
        let grammar = top_level(spec)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| err(e.to_string()))?;
        self.insert(spec, &parser);
        let info = CompileInfo { cached: false, elapsed: start.elapsed() };
        Ok((Constraint::new(Matcher::new(Ok(parser)))?, info))
    }

    fn cached(&self, spec: &StructuredOutput) -> Option<TokenParser> {
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.clock += 1;
        let now = cache.clock;
        cache.entries.get_mut(spec).map(|(parser, used)| {
            *used = now;
            parser.clone()
        })
    }

    fn insert(&self, spec: &StructuredOutput, parser: &TokenParser) {
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if cache.entries.len() >= CACHE_CAPACITY
            && let Some(oldest) =
                cache.entries.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone())
        {
            cache.entries.remove(&oldest);
        }
        let now = cache.clock;
        cache.entries.insert(spec.clone(), (parser.clone(), now));
    }
}

/// llguidance's grammar for `spec`.
fn top_level(spec: &StructuredOutput) -> Result<TopLevelGrammar, GrammarError> {
    Ok(match spec {
        StructuredOutput::JsonSchema(schema) => {
            let value: serde_json::Value = serde_json::from_str(schema)
                .map_err(|e| err(format!("the JSON schema is not valid JSON: {e}")))?;
            if !(value.is_object() || value.is_boolean()) {
                return Err(err("the JSON schema must be an object (or true/false)"));
            }
            TopLevelGrammar::from_json_schema(value)
        }
        StructuredOutput::JsonObject => {
            TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
        }
        StructuredOutput::Regex(regex) => {
            regex_syntax::Parser::new()
                .parse(regex)
                .map_err(|e| err(format!("the regular expression does not parse: {e}")))?;
            TopLevelGrammar::from_regex(regex)
        }
        StructuredOutput::Choice(choices) => {
            if choices.is_empty() {
                return Err(err("the list of choices is empty"));
            }
            let alternatives: Vec<String> =
                choices.iter().map(|c| regex_syntax::escape(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
        }
        StructuredOutput::Grammar(grammar) => {
            if grammar.trim().is_empty() {
                return Err(err("the grammar is empty"));
            }
            if grammar.contains("::=") {
                return Err(err(
                    "GBNF grammars are not supported: write the grammar in Lark syntax \
                     (`start: item+`, `item: /[a-z]+/ \",\"`)",
                ));
            }
            TopLevelGrammar::from_lark(grammar.clone())
        }
    })
}
