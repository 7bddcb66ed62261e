//! Compiling a [`StructuredOutput`] for one vocabulary, with a cache of compiled grammars.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_core::{ReasoningFormat, StructuredOutput};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};

use super::Constraint;
use super::constraint::NumberCap;

/// Compiled grammars kept for reuse at most (least recently used evicted first).
const CACHE_CAPACITY: usize = 128;

/// Bytes the kept grammars may take at most, by [`grammar_bytes`] (least recently used
/// evicted first; a grammar larger than a quarter of this is used but not kept).
pub const CACHE_BYTES: usize = 256 << 20;

/// The largest compiled grammar accepted, by [`grammar_bytes`]: a larger one is refused.
pub const MAX_GRAMMAR_BYTES: usize = 128 << 20;

/// Memory of a compiled grammar per byte of its source, beyond its lexer's (measured: a
/// 65 KB `anyOf` schema compiles to a 6.9 MB lexer and about 7 MB in all).
const GRAMMAR_BYTES_PER_SOURCE_BYTE: usize = 8;

/// What a compiled grammar holds in memory: its lexer (regular expressions and their
/// derivatives, which grow as masks are computed: shared by every copy of the parser) and the
/// grammar itself (by the size of its source).
fn grammar_bytes(spec: &StructuredOutput, parser: &TokenParser) -> usize {
    parser.parser.lexer_stats().num_bytes + source_bytes(spec) * GRAMMAR_BYTES_PER_SOURCE_BYTE
}

/// The size of `spec`'s source text.
fn source_bytes(spec: &StructuredOutput) -> usize {
    match spec {
        StructuredOutput::JsonSchema(s)
        | StructuredOutput::Regex(s)
        | StructuredOutput::Grammar(s) => s.len(),
        StructuredOutput::Choice(choices) => choices.iter().map(String::len).sum(),
        StructuredOutput::JsonObject => 0,
        StructuredOutput::AfterReasoning { reasoning, answer } => {
            let markers = match reasoning {
                ReasoningFormat::Markers(m) => m.open.len() + m.close.len(),
                ReasoningFormat::Harmony { .. } => HARMONY.len(),
            };
            markers + source_bytes(answer)
        }
    }
}

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
    /// Tokens whose first byte is an ASCII digit, and `0` (the digit cap of JSON numbers).
    digit_start: Arc<SimpleVob>,
    zero_start: Arc<SimpleVob>,
    cache: Mutex<Cache>,
    /// Constraints handed out by [`GrammarCompiler::compile`], from the cache or compiled.
    num_compiles: AtomicU64,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

/// Compiled grammars by spec: the parser, when it was last used, its bytes when last
/// measured; `bytes` is their sum, kept at most `budget`.
struct Cache {
    entries: HashMap<StructuredOutput, CacheEntry>,
    clock: u64,
    bytes: usize,
    budget: usize,
}

struct CacheEntry {
    parser: TokenParser,
    used: u64,
    bytes: usize,
}

impl Cache {
    fn new(budget: usize) -> Self {
        Self { entries: HashMap::new(), clock: 0, bytes: 0, budget }
    }

    /// Evicts the least recently used entries (never `keep`) until the cache fits its budget
    /// and capacity.
    fn evict(&mut self, keep: Option<&StructuredOutput>) {
        while self.bytes > self.budget || self.entries.len() > CACHE_CAPACITY {
            let oldest = self
                .entries
                .iter()
                .filter(|(k, _)| Some(*k) != keep)
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone());
            let Some(oldest) = oldest else { return };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.bytes;
            }
        }
    }
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
        let mut digit_start = SimpleVob::alloc(vocab_size);
        let mut zero_start = SimpleVob::alloc(vocab_size);
        for (id, bytes) in (0u32..).zip(&token_bytes) {
            if bytes.first().is_some_and(u8::is_ascii_digit) {
                digit_start.allow_token(id);
            }
            if bytes.first() == Some(&b'0') {
                zero_start.allow_token(id);
            }
        }
        let info = TokRxInfo::new(vocab, eos);
        let trie = std::panic::catch_unwind(|| {
            TokTrie::from(&info, &token_bytes).with_eos_tokens(eos_token_ids)
        })
        .map_err(|_| err("llguidance refused the vocabulary (a token longer than 255 bytes?)"))?;
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| err(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory,
            digit_start: Arc::new(digit_start),
            zero_start: Arc::new(zero_start),
            cache: Mutex::new(Cache::new(CACHE_BYTES)),
            num_compiles: AtomicU64::new(0),
        })
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
        self.num_compiles.fetch_add(1, Ordering::Relaxed);
        let cap = is_json(spec)
            .then(|| NumberCap::new(Arc::clone(&self.digit_start), Arc::clone(&self.zero_start)));
        if let Some(parser) = self.cached(spec) {
            let info = CompileInfo { cached: true, elapsed: start.elapsed() };
            return Ok((Constraint::new(Matcher::new(Ok(parser)), cap)?, info));
        }
        let grammar = top_level(spec)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| err(e.to_string()))?;
        let bytes = grammar_bytes(spec, &parser);
        if bytes > MAX_GRAMMAR_BYTES {
            return Err(err(format!(
                "the constraint is too large: it compiles to about {} MB, at most {} MB",
                bytes >> 20,
                MAX_GRAMMAR_BYTES >> 20
            )));
        }
        let mut constraint = Constraint::new(Matcher::new(Ok(parser.clone())), cap)?;
        // An empty language (`[^\s\S]`, `start: start`, a schema no value meets) would mask
        // every token: refused here, before a request runs on it.
        if !constraint.admits_some_output() {
            return Err(err(
                "the constraint admits no output (no text matches it): check the schema, \
                 regular expression or grammar",
            ));
        }
        self.insert(spec, &parser);
        let info = CompileInfo { cached: false, elapsed: start.elapsed() };
        Ok((constraint, info))
    }

    /// The cached parser of `spec`, its size measured again (its lexer grows with use).
    fn cached(&self, spec: &StructuredOutput) -> Option<TokenParser> {
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.clock += 1;
        let now = cache.clock;
        let entry = cache.entries.get_mut(spec)?;
        entry.used = now;
        let parser = entry.parser.clone();
        let (old, new) = (entry.bytes, grammar_bytes(spec, &entry.parser));
        entry.bytes = new;
        cache.bytes = cache.bytes - old + new;
        cache.evict(Some(spec));
        if cache.bytes > cache.budget {
            // Grown past the budget alone: no longer kept.
            if let Some(e) = cache.entries.remove(spec) {
                cache.bytes -= e.bytes;
            }
        }
        Some(parser)
    }

    fn insert(&self, spec: &StructuredOutput, parser: &TokenParser) {
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let bytes = grammar_bytes(spec, parser);
        if bytes > cache.budget / 4 {
            return;
        }
        let used = cache.clock;
        let entry = CacheEntry { parser: parser.clone(), used, bytes };
        if let Some(old) = cache.entries.insert(spec.clone(), entry) {
            cache.bytes -= old.bytes;
        }
        cache.bytes += bytes;
        cache.evict(Some(spec));
    }

    /// How many times [`GrammarCompiler::compile`] ran (a cache hit counts), since built.
    pub fn num_compiles(&self) -> u64 {
        self.num_compiles.load(Ordering::Relaxed)
    }

    /// Bytes the kept grammars take (by [`grammar_bytes`]), and how many there are.
    pub fn cache_usage(&self) -> (usize, usize) {
        let cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (cache.bytes, cache.entries.len())
    }

    /// Keeps compiled grammars up to `budget` bytes instead of [`CACHE_BYTES`] (evicting now
    /// what no longer fits).
    pub fn set_cache_budget(&self, budget: usize) {
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.budget = budget;
        cache.evict(None);
    }
}

/// Whitespace JSON may carry between tokens unless a schema says otherwise (its own
/// `x-guidance` options): one space, or a newline and up to 20 spaces or tabs, as llama.cpp's
/// JSON grammars allow. llguidance's default (any run of whitespace) lets a model emit
/// whitespace until `max_tokens`, which small models do at temperature 0.
const JSON_WHITESPACE: &str = r"(?: |\n[ \t]{0,20})";

/// `schema` with [`JSON_WHITESPACE`] unless it sets llguidance's `x-guidance` options itself.
fn with_bounded_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut()
        && !obj.contains_key("x-guidance")
    {
        obj.insert("x-guidance".into(), serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    schema
}

/// Whether `spec`'s output (its answer, after any reasoning) is JSON.
fn is_json(spec: &StructuredOutput) -> bool {
    match spec {
        StructuredOutput::JsonSchema(_) | StructuredOutput::JsonObject => true,
        StructuredOutput::AfterReasoning { answer, .. } => is_json(answer),
        _ => false,
    }
}

/// Whitespace between the end of the reasoning and the answer (models write `</think>` and
/// two newlines).
const AFTER_REASONING: &str = r"[ \n]{0,4}";

/// gpt-oss's messages before the final one, in Lark: a body is text (it cannot hold a special
/// token), and each message but the final one ends with `<|end|><|start|>assistant`.
const HARMONY: &str = r#"msg: <|channel|> CHANNEL <|message|> BODY <|end|> <|start|> "assistant"
CHANNEL: /analysis|commentary/
BODY: /(?s:.*)/
"#;

/// The answer grammar after a reasoning section: a Lark wrapper whose thinking ends as
/// `reasoning` says, and `answer` (its own grammars, the first named `answer`).
fn after_reasoning(
    reasoning: &ReasoningFormat,
    answer: &StructuredOutput,
) -> Result<TopLevelGrammar, GrammarError> {
    if matches!(answer, StructuredOutput::AfterReasoning { .. }) {
        return Err(err("a reasoning section cannot hold another one"));
    }
    let mut inner = top_level(answer)?;
    inner.grammars[0].name = Some("answer".into());
    let reasoning = match reasoning {
        ReasoningFormat::Markers(markers) => markers,
        ReasoningFormat::Harmony { in_body } => {
            let opened = if *in_body { r#"BODY <|end|> <|start|> "assistant" "# } else { "" };
            let start = format!(r#"start: {opened}msg* <|channel|> "final" <|message|> @answer"#);
            let mut grammar = TopLevelGrammar::from_lark(format!("{start}\n{HARMONY}"));
            grammar.grammars.append(&mut inner.grammars);
            return Ok(grammar);
        }
    };
    if reasoning.open.is_empty() || reasoning.close.is_empty() {
        return Err(err("the reasoning markers must not be empty"));
    }
    let close = regex_syntax::escape(&reasoning.close).replace('/', "\\/");
    let open = regex_syntax::escape(&reasoning.open).replace('/', "\\/");
    let think = if reasoning.required {
        format!("think[lazy]: /(?s:.*){close}/")
    } else {
        format!("think[lazy]: /[ \\n]*{open}(?s:.*){close}/")
    };
    let start =
        if reasoning.required { "start: think GAP @answer" } else { "start: (think GAP)? @answer" };
    let lark = format!("{start}\n{think}\nGAP: /{AFTER_REASONING}/\n");
    let mut grammar = TopLevelGrammar::from_lark(lark);
    grammar.grammars.append(&mut inner.grammars);
    Ok(grammar)
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
            TopLevelGrammar::from_json_schema(with_bounded_whitespace(value))
        }
        StructuredOutput::JsonObject => TopLevelGrammar::from_json_schema(with_bounded_whitespace(
            serde_json::json!({"type": "object"}),
        )),
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
            // GBNF (llama.cpp, xgrammar) defines rules with `::=`, which Lark never has.
            if grammar.contains("::=") {
                let lark = super::gbnf::to_lark(grammar)
                    .map_err(|e| err(format!("the GBNF grammar does not parse: {e}")))?;
                TopLevelGrammar::from_lark(lark)
            } else {
                TopLevelGrammar::from_lark(grammar.clone())
            }
        }
        StructuredOutput::AfterReasoning { reasoning, answer } => {
            return after_reasoning(reasoning, answer);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structured::MAX_NUMBER_DIGITS;

    /// A toy vocabulary: digits, JSON punctuation, whitespace, a few words; EOS last.
    fn compiler() -> (GrammarCompiler, Vec<String>) {
        let mut vocab: Vec<String> = (0..10).map(|d| d.to_string()).collect();
        vocab.extend(
            ["00", ".", "-", "{", "}", "\"", ":", ",", " ", "\n", "  ", "p", "e", "true"]
                .map(String::from),
        );
        vocab.extend(
            ["<think>", "</think>", "<", "/", "think", ">", "hm", "\n\n"].map(String::from),
        );
        let eos = vocab.len() as u32;
        let mut bytes: Vec<Vec<u8>> = vocab.iter().map(|t| t.as_bytes().to_vec()).collect();
        bytes.push(vec![0xFF, b'E']);
        vocab.push("<eos>".into());
        (GrammarCompiler::new(bytes, vocab.len(), &[eos]).unwrap(), vocab)
    }

    /// Greedy decoding under `schema` of a "model" that ranks tokens by `prefer` (first best);
    /// returns the text, cut at `max` tokens.
    fn decode(schema: &str, prefer: &[&str], max: usize) -> String {
        let (compiler, vocab) = compiler();
        let mut constraint =
            compiler.compile(&StructuredOutput::JsonSchema(schema.into())).unwrap();
        let mut text = String::new();
        for _ in 0..max {
            let mut logits: Vec<f32> = vocab
                .iter()
                .map(|t| prefer.iter().position(|p| p == t).map_or(-10.0, |i| 10.0 - i as f32))
                .collect();
            constraint.mask(&mut logits);
            let (best, _) = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap();
            if vocab[best] == "<eos>" {
                return text;
            }
            text.push_str(&vocab[best]);
            constraint.accept(best as u32);
        }
        text
    }

    #[test]
    fn numbers_stop_after_the_digit_cap_when_the_grammar_lets_them() {
        let schema = r#"{"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["p"]}"#;
        // A model that loves zeros (and whitespace) still ends the record.
        let text =
            decode(schema, &["0", "00", "\n", " ", ".", "{", "\"", "p", ":", "}", "<eos>"], 200);
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["p"].is_number(), "{text}");
        let digits = text
            .split('.')
            .nth(1)
            .map_or(0, |f| f.chars().take_while(char::is_ascii_digit).count());
        assert!(digits <= MAX_NUMBER_DIGITS + 1, "{text}");
        assert!(!text.contains("\n\n") && !text.contains("                      "), "{text:?}");
    }

    /// Feeds `tokens` (texts of the toy vocabulary) to `constraint`, each checked first.
    fn feed(constraint: &mut Constraint, vocab: &[String], tokens: &[&str]) {
        for t in tokens {
            let id = vocab.iter().position(|v| v == t).unwrap() as u32;
            assert!(constraint.admits(id), "{t:?} refused");
            constraint.accept(id);
        }
    }

    /// Whether the next mask allows `token`.
    fn admits(constraint: &mut Constraint, vocab: &[String], token: &str) -> bool {
        let mut logits = vec![0.0; vocab.len()];
        constraint.mask(&mut logits);
        logits[vocab.iter().position(|v| v == token).unwrap()].is_finite()
    }

    fn after_reasoning(required: bool) -> StructuredOutput {
        StructuredOutput::AfterReasoning {
            reasoning: ReasoningFormat::Markers(kiln_core::ReasoningMarkers {
                open: "<think>".into(),
                close: "</think>".into(),
                required,
            }),
            answer: Box::new(StructuredOutput::JsonSchema(
                r#"{"type": "object", "properties": {"p": {"type": "number"}}, "required": ["p"]}"#
                    .into(),
            )),
        }
    }

    #[test]
    fn a_required_reasoning_section_is_free_text_until_it_closes_then_the_answer_is_constrained() {
        let (compiler, vocab) = compiler();
        let spec = after_reasoning(true);
        assert_eq!(spec.kind(), "json");
        let mut c = compiler.compile(&spec).unwrap();
        // Inside the thinking anything goes, JSON-looking text and a split `</think>` prefix
        // included; the end of the sequence does not.
        feed(&mut c, &vocab, &["hm", "{", "\n", "<", "think", ">", "hm", "<", "/"]);
        assert!(!admits(&mut c, &vocab, "<eos>"));
        feed(&mut c, &vocab, &["hm", "</think>", "\n\n"]);
        // After it, only the schema's JSON.
        assert!(!admits(&mut c, &vocab, "hm"));
        assert!(!admits(&mut c, &vocab, "<think>"));
        feed(&mut c, &vocab, &["{", "\"", "p", "\"", ":", "1", "}"]);
        assert!(admits(&mut c, &vocab, "<eos>"));
    }

    #[test]
    fn an_optional_reasoning_section_may_open_or_be_skipped() {
        let (compiler, vocab) = compiler();
        let mut skipped = compiler.compile(&after_reasoning(false)).unwrap();
        assert!(!admits(&mut skipped, &vocab, "hm"));
        feed(&mut skipped, &vocab, &["{", "\"", "p", "\"", ":", "2", "}"]);
        assert!(admits(&mut skipped, &vocab, "<eos>"));
        let mut opened = compiler.compile(&after_reasoning(false)).unwrap();
        // The close split over tokens ends the thinking as well as the one token does.
        feed(&mut opened, &vocab, &["\n", "<think>", "hm", "<", "/", "think", ">", "\n", "{"]);
        assert!(!admits(&mut opened, &vocab, "hm"));
    }

    /// gpt-oss's messages: the toy vocabulary with harmony's special tokens (marked `0xFF`).
    fn harmony_compiler() -> (GrammarCompiler, Vec<String>) {
        let mut vocab: Vec<String> = ["{", "}", "\"", "p", ":", "1", "hm", " ", "<", "|"]
            .into_iter()
            .chain(["analysis", "final", "commentary", "assistant", "fin", "al"])
            .map(String::from)
            .collect();
        let specials = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"];
        let mut bytes: Vec<Vec<u8>> = vocab.iter().map(|t| t.as_bytes().to_vec()).collect();
        for s in specials {
            bytes.push([&[0xFF], s.as_bytes()].concat());
            vocab.push(s.into());
        }
        let eos = (vocab.len() - 1) as u32;
        (GrammarCompiler::new(bytes, vocab.len(), &[eos]).unwrap(), vocab)
    }

    /// Feeds `tokens`, each checked by the mask first (special tokens are left to it).
    fn feed_masked(constraint: &mut Constraint, vocab: &[String], tokens: &[&str]) {
        for t in tokens {
            assert!(admits(constraint, vocab, t), "{t:?} refused");
            constraint.accept(vocab.iter().position(|v| v == t).unwrap() as u32);
        }
    }

    fn after_harmony(in_body: bool) -> StructuredOutput {
        StructuredOutput::AfterReasoning {
            reasoning: ReasoningFormat::Harmony { in_body },
            answer: Box::new(StructuredOutput::JsonSchema(
                r#"{"type": "object", "properties": {"p": {"type": "number"}}, "required": ["p"]}"#
                    .into(),
            )),
        }
    }

    #[test]
    fn harmony_messages_are_free_until_the_final_channel_then_the_answer_is_constrained() {
        let (compiler, vocab) = harmony_compiler();
        let mut c = compiler.compile(&after_harmony(false)).unwrap();
        // An analysis message of any text (marker look-alikes included), then a preamble.
        feed_masked(
            &mut c,
            &vocab,
            &["<|channel|>", "analysis", "<|message|>", "hm", "{", "<", "|"],
        );
        assert!(!admits(&mut c, &vocab, "<|return|>"));
        assert!(!admits(&mut c, &vocab, "<|channel|>"));
        feed_masked(&mut c, &vocab, &["<|end|>", "<|start|>", "assistant", "<|channel|>"]);
        feed_masked(&mut c, &vocab, &["commentary", "<|message|>", "hm", "<|end|>", "<|start|>"]);
        feed_masked(&mut c, &vocab, &["assistant", "<|channel|>", "fin", "al", "<|message|>"]);
        // The final message is the schema's JSON only.
        assert!(!admits(&mut c, &vocab, "hm"));
        assert!(!admits(&mut c, &vocab, "<|end|>"));
        feed_masked(&mut c, &vocab, &["{", "\"", "p", "\"", ":", "1", "}"]);
        assert!(admits(&mut c, &vocab, "<|return|>"));
        // A prompt that opened a body: the output ends it first.
        let mut opened = compiler.compile(&after_harmony(true)).unwrap();
        assert!(!admits(&mut opened, &vocab, "<|channel|>"));
        feed_masked(
            &mut opened,
            &vocab,
            &["hm", "<|end|>", "<|start|>", "assistant", "<|channel|>"],
        );
        feed_masked(&mut opened, &vocab, &["final", "<|message|>", "{"]);
    }

    /// A schema of `n` alternatives whose names depend on `seed` (about 110 bytes each).
    fn big_schema(seed: usize, n: usize) -> String {
        let alternatives: Vec<serde_json::Value> = (0..n)
            .map(|i| {
                let key = format!("k{seed}_{i}");
                serde_json::json!({"type": "object", "required": [key],
                    "properties": {key: {"enum": [format!("v{i}a{seed}"), format!("v{i}b")]}}})
            })
            .collect();
        serde_json::json!({"anyOf": alternatives}).to_string()
    }

    /// Issue 53: the cache is bounded in bytes, not only in entries: distinct large schemas
    /// evict the least recently used ones, a grammar too large to keep is used but not kept,
    /// and every compiled grammar still works.
    #[test]
    fn the_grammar_cache_is_bounded_in_bytes() {
        let (compiler, vocab) = compiler();
        let one = {
            let spec = StructuredOutput::JsonSchema(big_schema(0, 200));
            compiler.compile(&spec).unwrap();
            compiler.cache_usage().0
        };
        assert!(one > 100_000, "a 22 KB schema measured {one} bytes");
        // Room for about four such grammars (each under a quarter of the budget).
        let budget = one * 9 / 2;
        compiler.set_cache_budget(budget);
        assert_eq!(compiler.cache_usage().1, 1);
        for seed in 1..12 {
            let spec = StructuredOutput::JsonSchema(big_schema(seed, 200));
            let mut c = compiler.compile(&spec).unwrap();
            let mut logits = vec![0.0f32; vocab.len()];
            c.mask(&mut logits);
            assert!(logits.iter().any(|l| l.is_finite()), "seed {seed}: nothing allowed");
            let (bytes, entries) = compiler.cache_usage();
            assert!(bytes <= budget, "{bytes} cached bytes past the budget of {budget}");
            assert!((1..=4).contains(&entries), "{entries} entries");
        }
        // The most recent one is a hit; one larger than a quarter of the budget is not kept.
        let last = StructuredOutput::JsonSchema(big_schema(11, 200));
        assert!(compiler.compile_timed(&last).unwrap().1.cached);
        compiler.set_cache_budget(one);
        let big = StructuredOutput::JsonSchema(big_schema(99, 200));
        assert!(!compiler.compile_timed(&big).unwrap().1.cached);
        assert!(!compiler.compile_timed(&big).unwrap().1.cached);
        assert!(compiler.cache_usage().0 <= one);
    }

    #[test]
    fn constraints_without_any_output_are_refused() {
        let (compiler, _) = compiler();
        for spec in [
            StructuredOutput::Regex("[^\\s\\S]".into()),
            StructuredOutput::Grammar("start: start".into()),
            StructuredOutput::JsonSchema(
                r#"{"type": "string", "minLength": 3, "maxLength": 2}"#.into(),
            ),
        ] {
            assert!(compiler.compile(&spec).is_err(), "{spec:?} compiled");
        }
        // An empty output is some output.
        assert!(compiler.compile(&StructuredOutput::Regex(String::new())).is_ok());
    }

    #[test]
    fn the_grammar_wins_over_the_cap() {
        // 0 < x: after `0.` and any number of zeros only a digit may follow; past the cap a
        // non-zero one, which lets the number end.
        let schema = r#"{"type": "number", "exclusiveMinimum": 0, "maximum": 1}"#;
        let text = decode(schema, &["0", ".", "<eos>", "5"], 60);
        assert_eq!(text, format!("0.{}5", "0".repeat(MAX_NUMBER_DIGITS)));
        // Strings are not numbers: digits in a string are never capped.
        let schema = r#"{"type": "string", "pattern": "^[0-9]{30}$"}"#;
        assert_eq!(decode(schema, &["0", "\"", "<eos>"], 80), format!("\"{}\"", "0".repeat(30)));
    }
}
