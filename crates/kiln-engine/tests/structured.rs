//! Structured outputs on the tiny random-weight fixtures: whatever the (random) model prefers,
//! every output belongs to its language (JSON without free whitespace, which a random model
//! would emit forever) (a choice, a regex, a JSON schema, a Lark grammar) and
//! ends with an end-of-sequence token; constrained and unconstrained requests batched together
//! give what each gives alone; speculation and preemption give the same tokens as none; a
//! grammar that does not compile is refused before anything is queued; a request prepared off
//! the engine (one compile for all its samples) is admitted without compiling again and gives
//! what an unprepared one gives; no KV block is left held.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use kiln_core::{FinishReason, RequestId, SamplingParams, StructuredOutput, TokenId};
use kiln_engine::structured::GrammarCompiler;
use kiln_engine::{
    CompiledOutput, EngineConfig, EngineCore, EngineError, PrepareError, PreparedRequest,
    SchedulerConfig, SpeculativeConfig,
};
use kiln_kernels::Cpu;
use kiln_models::{load_model, load_tokenizer};
use kiln_tokenizer::Tokenizer;
use serde_json::Value;

const FIXTURES: [&str; 6] = ["llama2", "llama3", "mistral", "qwen2", "qwen3", "gemma3"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

fn engine(name: &str, spec: Option<SpeculativeConfig>) -> (EngineCore, Tokenizer) {
    engine_with_blocks(name, spec, 512, 160)
}

fn engine_with_blocks(
    name: &str,
    spec: Option<SpeculativeConfig>,
    num_kv_blocks: usize,
    max_model_len: usize,
) -> (EngineCore, Tokenizer) {
    engine_of(name, spec, num_kv_blocks, max_model_len, false)
}

fn engine_of(
    name: &str,
    spec: Option<SpeculativeConfig>,
    num_kv_blocks: usize,
    max_model_len: usize,
    async_scheduling: bool,
) -> (EngineCore, Tokenizer) {
    let model = load_model(&fixture(name), &Arc::new(Cpu::new(2))).unwrap().model;
    let tokenizer = load_tokenizer(&fixture(name)).unwrap();
    let vocab_size = model.config().vocab_size;
    let eos: Vec<TokenId> = tokenizer.eos_token_ids().iter().map(|&t| TokenId(t)).collect();
    let config = EngineConfig {
        // Rows sampled on two host threads, as the CLI does on the CPU backend's pool.
        host_pool: kiln_engine::HostPool::new(std::sync::Arc::new(kiln_models::HostThreads::new(
            2,
        ))),
        block_size: 4,
        num_kv_blocks,
        max_model_len: Some(max_model_len),
        scheduler: SchedulerConfig { max_num_batched_tokens: 512, ..SchedulerConfig::default() },
        eos_token_ids: eos,
        speculative: spec,
        async_scheduling,
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(model, config).unwrap();
    let compiler =
        GrammarCompiler::new(tokenizer.token_bytes(), vocab_size, tokenizer.eos_token_ids())
            .unwrap();
    core.set_grammar_compiler(Arc::new(compiler));
    (core, tokenizer)
}

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "age", "tags", "ok"],
  "additionalProperties": false,
  "x-guidance": {"whitespace_flexible": false}
}"#;

const REGEX: &str = "[0-9]{3}-[a-z]{2,4}";
const GRAMMAR: &str = "start: item \",\" item \",\" item\nitem: /[a-c]{1,3}/ | \"none\"";
/// [`GRAMMAR`] in GBNF, as llama.cpp and xgrammar write it (the same language).
const GBNF: &str =
    "root ::= item \",\" item \",\" item\nitem ::= [a-c]{1,3} | \"none\"  # comment\n";

fn choices() -> Vec<String> {
    vec!["alpha".into(), "beta gamma".into(), "δ".into()]
}

fn outputs() -> Vec<StructuredOutput> {
    vec![
        StructuredOutput::Choice(choices()),
        StructuredOutput::Regex(REGEX.into()),
        StructuredOutput::JsonSchema(SCHEMA.into()),
        StructuredOutput::Grammar(GRAMMAR.into()),
        StructuredOutput::Grammar(GBNF.into()),
        StructuredOutput::JsonObject,
    ]
}

fn params(output: Option<StructuredOutput>, seed: Option<u64>) -> SamplingParams {
    SamplingParams {
        temperature: if seed.is_some() { 0.9 } else { 0.0 },
        seed,
        structured: output,
        ..SamplingParams::greedy(120)
    }
}

/// Runs every request to completion: tokens and finish reason, in request order.
fn run(
    core: &mut EngineCore,
    requests: &[(Vec<TokenId>, SamplingParams)],
) -> Vec<(Vec<TokenId>, FinishReason)> {
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(p, params)| core.add_request(p.clone(), params.clone(), 0).unwrap())
        .collect();
    let mut tokens: HashMap<RequestId, (Vec<TokenId>, Option<FinishReason>)> = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            let entry = tokens.entry(out.id).or_default();
            entry.0.push(out.new_token);
            entry.1 = entry.1.or(out.finish_reason);
        }
    }
    let stats = core.stats();
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
    ids.iter()
        .map(|id| {
            let (t, f) = tokens.remove(id).unwrap();
            (t, f.unwrap())
        })
        .collect()
}

fn prompt(i: u32) -> Vec<TokenId> {
    (0..5 + i).map(|t| TokenId(3 + (t * 37 + i * 11) % 200)).collect()
}

/// The text of a finished constrained output (its final end-of-sequence token dropped).
fn text(tokenizer: &Tokenizer, tokens: &[TokenId], finish: FinishReason) -> String {
    assert_eq!(finish, FinishReason::Stop, "a constrained output must end with EOS: {tokens:?}");
    let last = tokens.last().unwrap().0;
    assert!(tokenizer.eos_token_ids().contains(&last), "last token {last} is not an EOS id");
    let ids: Vec<u32> = tokens[..tokens.len() - 1].iter().map(|t| t.0).collect();
    tokenizer.decode(&ids, false).unwrap()
}

fn check(output: &StructuredOutput, text: &str) {
    let bad = || format!("{output:?} produced {text:?}");
    match output {
        StructuredOutput::Choice(c) => assert!(c.iter().any(|c| c == text), "{}", bad()),
        StructuredOutput::Regex(_) => {
            let (digits, letters) = text.split_once('-').unwrap_or_else(|| panic!("{}", bad()));
            assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{}", bad());
            assert!((2..=4).contains(&letters.len()), "{}", bad());
            assert!(letters.bytes().all(|b| b.is_ascii_lowercase()), "{}", bad());
        }
        StructuredOutput::JsonSchema(_) => {
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{}: {e}", bad()));
            let obj = v.as_object().unwrap_or_else(|| panic!("{}", bad()));
            assert_eq!(obj.len(), 4, "{}", bad());
            assert!(obj["name"].as_str().is_some_and(|s| s.chars().count() <= 6), "{}", bad());
            assert!(obj["age"].as_u64().is_some_and(|a| a <= 120), "{}", bad());
            let tags = obj["tags"].as_array().unwrap_or_else(|| panic!("{}", bad()));
            assert!(tags.len() <= 3, "{}", bad());
            assert!(tags.iter().all(|t| ["a", "b", "c"].contains(&t.as_str().unwrap_or(""))));
            assert!(obj["ok"].is_boolean(), "{}", bad());
        }
        StructuredOutput::Grammar(_) => {
            let items: Vec<&str> = text.split(',').collect();
            assert_eq!(items.len(), 3, "{}", bad());
            for item in items {
                let abc =
                    (1..=3).contains(&item.len()) && item.bytes().all(|b| b"abc".contains(&b));
                assert!(abc || item == "none", "{}", bad());
            }
        }
        StructuredOutput::JsonObject => {
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{}: {e}", bad()));
            assert!(v.is_object(), "{}", bad());
        }
        StructuredOutput::AfterReasoning { .. } => panic!("not among this test's outputs"),
    }
}

/// Every kind of output, greedy and seeded, on every fixture; each request also run alone.
#[test]
fn outputs_belong_to_their_language_and_batching_changes_nothing() {
    for name in FIXTURES {
        let mut requests = Vec::new();
        for (i, output) in outputs().into_iter().enumerate() {
            let i = i as u32;
            requests.push((prompt(i), params(Some(output.clone()), None)));
            requests.push((prompt(i + 7), params(Some(output), Some(u64::from(i)))));
        }
        // Unconstrained neighbours in the same batches.
        requests.push((prompt(20), SamplingParams { ignore_eos: true, ..params(None, None) }));
        requests.push((prompt(21), SamplingParams { ignore_eos: true, ..params(None, Some(5)) }));
        let (mut core, tokenizer) = engine(name, None);
        let batched = run(&mut core, &requests);
        for ((_, p), (tokens, finish)) in requests.iter().zip(&batched) {
            match &p.structured {
                // Any object with any whitespace: a random model may not finish one in time.
                Some(StructuredOutput::JsonObject) if *finish == FinishReason::Length => {}
                Some(output) => check(output, &text(&tokenizer, tokens, *finish)),
                None => {}
            }
        }
        for (request, expected) in requests.iter().zip(&batched) {
            let alone = run(&mut core, std::slice::from_ref(request));
            assert_eq!(&alone[0], expected, "{name}: {:?} alone", request.1.structured);
        }
    }
}

#[test]
fn speculation_gives_the_same_constrained_tokens() {
    let mut spec = SpeculativeConfig::ngram(4, 1, 3);
    spec.disable_by_batch_size = 64;
    for name in ["llama3", "gemma3"] {
        let requests: Vec<_> = outputs()
            .into_iter()
            .enumerate()
            .map(|(i, o)| (prompt(i as u32), params(Some(o), (i % 2 == 1).then_some(3))))
            .collect();
        let expected = run(&mut engine(name, None).0, &requests);
        let mut core = engine(name, Some(spec.clone())).0;
        assert_eq!(run(&mut core, &requests), expected, "{name}");
        assert!(core.stats().spec_decode.num_drafts > 0, "{name}: nothing drafted");
    }
}

/// Asynchronous scheduling samples each step after the next one was planned: the grammar
/// states advance exactly as in the synchronous engine, preempted requests included.
#[test]
fn async_scheduling_gives_the_same_constrained_tokens() {
    let requests: Vec<_> = outputs()
        .into_iter()
        .chain(outputs())
        .enumerate()
        .map(|(i, o)| {
            let params = params(Some(o), (i % 2 == 1).then_some(5));
            (prompt(i as u32), SamplingParams { max_tokens: 40, ..params })
        })
        .collect();
    for blocks in [512, 16] {
        let expected = run(&mut engine_of("llama3", None, blocks, 64, false).0, &requests);
        let mut core = engine_of("llama3", None, blocks, 64, true).0;
        assert_eq!(run(&mut core, &requests), expected, "{blocks} blocks");
        assert_eq!(core.stats().num_preemptions > 0, blocks == 16, "{:?}", core.stats());
    }
}

/// A cache too small for the batch preempts requests (by recompute); their grammar state
/// survives with their sampler, so every output is what it is without preemption.
#[test]
fn preemption_gives_the_same_constrained_tokens() {
    let requests: Vec<_> = outputs()
        .into_iter()
        .chain(outputs())
        .enumerate()
        .map(|(i, o)| {
            let params = params(Some(o), (i % 2 == 1).then_some(7));
            (prompt(i as u32), SamplingParams { max_tokens: 40, ..params })
        })
        .collect();
    let expected = run(&mut engine_with_blocks("llama3", None, 512, 64).0, &requests);
    let mut core = engine_with_blocks("llama3", None, 16, 64).0;
    assert_eq!(run(&mut core, &requests), expected);
    assert!(core.stats().num_preemptions > 0, "nothing was preempted");
}

#[test]
fn grammars_that_do_not_compile_are_refused_and_change_nothing() {
    let (mut core, _) = engine("qwen3", None);
    for bad in [
        StructuredOutput::JsonSchema("{not json".into()),
        StructuredOutput::JsonSchema(
            r##"{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}"##.into(),
        ),
        StructuredOutput::Regex("(unclosed".into()),
        StructuredOutput::Grammar("start: missing_rule".into()),
        StructuredOutput::Grammar("root ::= missing".into()),
        StructuredOutput::Choice(vec![]),
    ] {
        let err = core.add_request(prompt(1), params(Some(bad.clone()), None), 0).unwrap_err();
        let EngineError::Rejected(e) = err else { panic!("{bad:?}: {err}") };
        assert!(e.to_string().contains("invalid structured output"), "{bad:?}: {e}");
    }
    assert!(!core.has_unfinished());
    let ok =
        run(&mut core, &[(prompt(2), params(Some(StructuredOutput::Regex(REGEX.into())), None))]);
    assert_eq!(ok[0].1, FinishReason::Stop);
}

#[test]
fn ignore_eos_with_a_structured_output_is_refused() {
    let (mut core, _) = engine("llama3", None);
    let p = SamplingParams { ignore_eos: true, ..params(Some(StructuredOutput::JsonObject), None) };
    let err = core.add_request(prompt(1), p, 0).unwrap_err();
    assert!(err.to_string().contains("ignore_eos"), "{err}");
}

#[test]
fn aborting_constrained_requests_frees_everything() {
    let (mut core, _) = engine("mistral", None);
    let ids: Vec<RequestId> = (0..4)
        .map(|i| {
            core.add_request(
                prompt(i),
                params(Some(StructuredOutput::JsonSchema(SCHEMA.into())), None),
                0,
            )
            .unwrap()
        })
        .collect();
    core.step().unwrap();
    core.step().unwrap();
    for id in ids {
        core.abort(id);
    }
    let stats = core.stats();
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
}

/// Three samples of one request share one compile; the engine admits them without compiling
/// (the compiler's count does not move) and they give what requests it compiles itself give.
#[test]
fn prepared_requests_are_not_compiled_again() {
    let (mut core, _) = engine("qwen3", None);
    let pending = core.grammar_compiler().unwrap().clone();
    let compiler = Arc::clone(pending.wait().unwrap());
    let vocab_size = core.model().config().vocab_size;
    let output = StructuredOutput::JsonSchema(SCHEMA.into());
    let samples: Vec<(Vec<TokenId>, SamplingParams)> = (0..3)
        .map(|seed| (prompt(seed as u32), params(Some(output.clone()), Some(seed))))
        .collect();

    let before = compiler.num_compiles();
    let compiled = CompiledOutput::compile(&output, Some(&pending)).unwrap();
    let mut ids = Vec::new();
    for (i, (p, params)) in samples.iter().enumerate() {
        let request =
            PreparedRequest::new(p.clone(), params.clone(), vocab_size, Some(&compiled)).unwrap();
        let id = RequestId(100 + i as u64);
        core.add_prepared(id, request, 0).unwrap();
        ids.push(id);
    }
    assert_eq!(compiler.num_compiles(), before + 1, "one compile for three samples");
    let mut prepared: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            prepared.entry(out.id).or_default().push(out.new_token);
        }
    }
    assert_eq!(compiler.num_compiles(), before + 1, "the engine compiled a prepared request");

    let plain = run(&mut core, &samples);
    assert_eq!(compiler.num_compiles(), before + 4, "an unprepared request compiles once");
    for (id, (tokens, _)) in ids.iter().zip(&plain) {
        assert_eq!(&prepared[id], tokens);
    }
}

#[test]
fn mismatched_preparations_are_refused_and_change_nothing() {
    let (mut core, _) = engine("llama3", None);
    let pending = core.grammar_compiler().unwrap().clone();
    let vocab_size = core.model().config().vocab_size;
    let regex = StructuredOutput::Regex(REGEX.into());
    let compiled = CompiledOutput::compile(&regex, Some(&pending)).unwrap();
    let json = params(Some(StructuredOutput::JsonObject), None);
    let err = PreparedRequest::new(prompt(1), json, vocab_size, Some(&compiled)).unwrap_err();
    assert!(matches!(err, PrepareError::OutputMismatch), "{err}");
    let free = params(None, None);
    let err = PreparedRequest::new(prompt(1), free.clone(), vocab_size, Some(&compiled));
    assert!(matches!(err, Err(PrepareError::OutputMismatch)));
    let out_of_vocab = vec![TokenId(3), TokenId(vocab_size as u32)];
    let err = PreparedRequest::new(out_of_vocab, free.clone(), vocab_size, None).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "prompt: token id {vocab_size} is outside the vocabulary (valid ids are 0 to {})",
            vocab_size - 1
        )
    );
    // Prepared for another model's vocabulary: refused by the engine, which holds nothing.
    let other = PreparedRequest::new(prompt(1), free, vocab_size + 1, None).unwrap();
    let err = core.add_prepared(RequestId(7), other, 0).unwrap_err();
    assert!(err.to_string().contains("prepared for a vocabulary"), "{err}");
    assert!(!core.has_unfinished());
    let ok = run(&mut core, &[(prompt(2), params(Some(regex), None))]);
    assert_eq!(ok[0].1, FinishReason::Stop);
}
