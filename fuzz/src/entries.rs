//! The fuzzed entry points, one per cargo-fuzz target. Shared by the fuzz targets
//! (`fuzz/fuzz_targets/*.rs`, nightly, libFuzzer) and by the corpus replay test
//! (`crates/kiln-server/tests/fuzz_corpus.rs`, stable, every CI run), which includes this file
//! with `#[path]`. Each function must never panic, whatever `data` is: errors are fine.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use kiln_server::anthropic::request::MessagesRequest;
use kiln_server::chat_template::{ChatMessage, ChatTemplate, RenderOptions};
use kiln_server::harmony::Position;
use kiln_server::protocol::{ChatRequest, CompletionRequest};
use kiln_server::reasoning::{ReasoningSplit, Start};
use kiln_server::responses::request::ResponsesRequest;
use kiln_server::routes::chat_input::template_messages;
use kiln_server::tools::{self, ToolCallParser, ToolOutput, ToolSettings, ToolStream};
use kiln_server::validate::{self, Limits};
use kiln_tokenizer::{GenerationDefaults, GgufVocab, Tokenizer};

/// The repository root (the directory holding `tests/fixtures`), found upward from `start`.
fn repo_root(start: &Path) -> PathBuf {
    start
        .ancestors()
        .find(|p| p.join("tests/fixtures/models").is_dir())
        .map_or_else(|| start.to_path_buf(), Path::to_path_buf)
}

/// `data` written to a file of this thread's own, with extension `ext`.
fn temp_file(data: &[u8], ext: &str) -> PathBuf {
    let name = format!("kiln-fuzz-{}-{:?}.{ext}", std::process::id(), std::thread::current().id());
    let path = std::env::temp_dir().join(name.replace(['(', ')'], ""));
    let written = std::fs::File::create(&path).and_then(|mut f| f.write_all(data));
    assert!(written.is_ok(), "cannot write {}", path.display());
    path
}

/// A GGUF file: header, metadata, tensor table, then the whole model load (config,
/// tokenizer, every tensor onto the CPU backend).
pub fn gguf(data: &[u8]) {
    let path = temp_file(data, "gguf");
    let backend = Arc::new(kiln_kernels::Cpu::new(1));
    if let Ok(loaded) = kiln_models::load_model(&path, &backend) {
        let _ = loaded.tokenizer.encode("hello <s> world", true);
    }
    let _ = std::fs::remove_file(&path);
}

/// A safetensors file: the header (checked arithmetic, overlaps) and the tensors it lists.
pub fn safetensors(data: &[u8]) {
    let path = temp_file(data, "safetensors");
    if let Ok(store) = kiln_models::WeightStore::open_files(std::slice::from_ref(&path)) {
        for name in ["w", "a", "b", "model.embed_tokens.weight"] {
            if let Some(shape) = store.shape(name).map(<[usize]>::to_vec) {
                match shape.as_slice() {
                    [n] => {
                        let _ = store.vector(name, *n);
                    }
                    [r, c] => {
                        let _ = store.matrix(name, *r, *c);
                    }
                    _ => {}
                }
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// The tokenizers the text entries use: the llama3 fixture (Hugging Face backend) and a small
/// SentencePiece vocabulary with control, user-defined and byte tokens.
fn tokenizers() -> &'static [Tokenizer; 2] {
    static TOKENIZERS: OnceLock<[Tokenizer; 2]> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let root = repo_root(Path::new(env!("CARGO_MANIFEST_DIR")));
        let hf = Tokenizer::from_dir(&root.join("tests/fixtures/models/llama3")).map(|t| t.0);
        let mut tokens: Vec<String> =
            ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "<tag>", "\u{2581}"]
                .iter()
                .map(|t| (*t).to_owned())
                .collect();
        let mut types = vec![2, 3, 3, 3, 3, 4, 1];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        for word in ["a", "b", "ab", "\u{2581}a", "hello", "\u{2581}world", "\u{e9}"] {
            tokens.push(word.to_owned());
            types.push(1);
        }
        let spm = Tokenizer::from_gguf_vocab(GgufVocab {
            model: "llama".into(),
            tokens,
            token_types: Some(types),
            ..GgufVocab::default()
        });
        match (hf, spm) {
            (Ok(hf), Ok(spm)) => [hf, spm],
            (hf, spm) => panic!("fuzz tokenizers: {:?} {:?}", hf.err(), spm.err()),
        }
    })
}

/// A chat template from the operator (`data` up to the first NUL) rendered over messages
/// (the rest, one message per line, roles alternating), then tokenized with content literal.
/// Renders are fuel-bounded; compile errors and render errors are fine.
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (source, rest) = text.split_once('\0').unwrap_or((&text, "hi\nthere"));
    let Ok(template) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) else {
        return;
    };
    let messages: Vec<ChatMessage> = rest
        .split('\n')
        .take(64)
        .enumerate()
        .map(|(i, line)| ChatMessage::text(if i % 2 == 0 { "user" } else { "assistant" }, line))
        .collect();
    if let Ok(marked) = template.render_marked(&messages, &RenderOptions::new(true)) {
        let ranges = marked.content_ranges.unwrap_or_default();
        for tokenizer in tokenizers() {
            let _ = tokenizer.encode_with_literals(&marked.text, &ranges, false);
        }
    }
}

/// A request body as the server parses and validates it (chat and completions; Responses and
/// Messages bodies translated into chat requests, their messages checked), the chat messages
/// rendered with ChatML and tokenized with content literal, and a GBNF grammar rewritten into
/// Lark.
pub fn request_json(data: &[u8]) {
    if let Ok(req) = serde_json::from_slice::<ResponsesRequest>(data)
        && let Ok(translated) = req.translate(None, true)
    {
        let _ = template_messages(translated.chat.messages);
    }
    if let Ok(req) = serde_json::from_slice::<MessagesRequest>(data)
        && let Ok(translated) = req.translate(false)
    {
        let _ = template_messages(translated.chat.messages);
    }
    if let Ok(text) = std::str::from_utf8(data)
        && text.contains("::=")
    {
        let _ = kiln_engine::structured::gbnf::to_lark(text);
    }
    let limits = Limits {
        max_model_len: 256,
        vocab_size: 512,
        max_logprobs: 20,
        max_tokens_default: Some(16),
        max_tokens_cap: Some(64),
    };
    let defaults = GenerationDefaults::default();
    if let Ok(req) = serde_json::from_slice::<ChatRequest>(data) {
        let max_tokens =
            req.max_completion_tokens.or(req.sampling.max_tokens_given().ok().flatten());
        if let Ok(spec) = validate::spec(req.sampling, max_tokens, None, &limits, &defaults) {
            let _ = spec.for_prompt(10, 1, &limits);
        }
        let settings =
            ToolSettings { parser: Some(ToolCallParser::Hermes), auto_tool_choice: true };
        let tool_fields = (req.tools, req.tool_choice, req.parallel_tool_calls.as_ref());
        let plan = tools::plan(tool_fields.0, tool_fields.1, tool_fields.2, settings, None);
        let mut options = RenderOptions::new(true);
        options.tools = plan.ok().and_then(|(plan, _)| plan.tools);
        if let Ok(messages) = template_messages(req.messages) {
            let chatml = ChatTemplate::fallback(None, None);
            if let Ok(marked) = chatml.render_marked(&messages, &options) {
                let ranges = marked.content_ranges.unwrap_or_default();
                let _ = tokenizers()[0].encode_with_literals(&marked.text, &ranges, false);
            }
        }
    }
    if let Ok(req) = serde_json::from_slice::<CompletionRequest>(data) {
        let max_tokens = req.sampling.max_tokens;
        if let Ok(spec) = validate::spec(req.sampling, max_tokens, Some(2), &limits, &defaults) {
            let _ = spec.for_prompt(255, 0, &limits);
        }
    }
}

/// Token ids (two bytes each, little-endian, some past the vocabulary) streamed through the
/// incremental detokenizer of both backends, with and without special tokens.
pub fn detokenizer(data: &[u8]) {
    for tokenizer in tokenizers() {
        let bound = tokenizer.vocab_size() as u32 + 8;
        let ids: Vec<u32> = data
            .chunks_exact(2)
            .map(|p| u32::from(u16::from_le_bytes([p[0], p[1]])) % bound)
            .collect();
        for skip_special in [false, true] {
            let mut stream = tokenizer.decode_stream(skip_special);
            for &id in &ids {
                if stream.step(id).is_err() {
                    break;
                }
            }
            let _ = tokenizer.decode(&ids, skip_special);
        }
    }
}

/// Model output read by every tool-call parser, and by gpt-oss's harmony reasoning split:
/// whole, and streamed in pieces of every size from 1 to 8 characters (the streaming split
/// must hold at any cut).
pub fn tool_calls(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let chars: Vec<char> = text.chars().collect();
    let harmony = Start::Harmony(Position::Header);
    let whole = ReasoningSplit::whole(harmony, &text);
    for piece in 1..=8 {
        let mut split = ReasoningSplit::new(harmony);
        let (mut reasoning, mut answer) = (String::new(), String::new());
        let pieces: Vec<String> = chars.chunks(piece).map(|c| c.iter().collect()).collect();
        for (i, p) in pieces.iter().enumerate() {
            let step = split.push(p, i + 1 == pieces.len());
            reasoning.push_str(&step.reasoning);
            answer.push_str(&step.answer);
        }
        if !pieces.is_empty() {
            assert_eq!((reasoning, answer), (whole.reasoning.clone(), whole.answer.clone()));
        }
    }
    for parser in [
        ToolCallParser::Hermes,
        ToolCallParser::Llama3Json,
        ToolCallParser::Mistral,
        ToolCallParser::Pythonic,
        ToolCallParser::OpenAi,
    ] {
        let output = ToolOutput::Parsed { parser, parallel: true };
        let whole = tools::answer(&output, text.to_string(), Some("stop"));
        for piece in 1..=8 {
            let mut stream = ToolStream::new(output.clone());
            let mut new_id = || String::from("id");
            let mut num_calls = 0;
            let pieces: Vec<String> = chars.chunks(piece).map(|c| c.iter().collect()).collect();
            for (i, p) in pieces.iter().enumerate() {
                let finish = (i + 1 == pieces.len()).then_some("stop");
                num_calls += stream.push(p, finish, &mut new_id).tool_calls.len();
            }
            assert!(pieces.is_empty() || num_calls == whole.calls.len(), "stream != whole");
        }
    }
    let _ = tools::answer(&ToolOutput::Required, text.to_string(), Some("stop"));
}

/// A template that prints request kwargs, as Llama 3.x prints `date_string`, around the llama3
/// fixture's markers: exactly six control tokens of its own for one user message.
const KWARGS_TEMPLATE: &str = "<|start_header_id|>system<|end_header_id|>\n\n{{ date_string }}\
    {% for k in extra %}{{ k }}: {{ extra[k] }}\n{% endfor %}<|eot_id|>{% for m in messages %}\
    <|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}";

/// `chat_template_kwargs` (`data` as a JSON object, else as the `date_string` text) through the
/// server's check of client text and a template that prints them: whatever the check lets
/// through becomes text, never a control token (the prompt holds only the template's own six).
pub fn template_kwargs(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let kwargs = match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::from_iter([("date_string".to_owned(), text.as_ref().into())]),
    };
    let Ok(template) = ChatTemplate::new(KWARGS_TEMPLATE, None, None) else { return };
    let messages = [ChatMessage::text("user", "hi")];
    let options = RenderOptions { kwargs, ..RenderOptions::new(false) };
    let tokenizer = &tokenizers()[0];
    if kiln_server::routes::chat_input::check_client_text(tokenizer, &messages, &options).is_err() {
        return;
    }
    let Ok(marked) = template.render_marked(&messages, &options) else { return };
    let mut ranges = marked.content_ranges.unwrap_or_default();
    ranges.extend(marked.kwargs_ranges.unwrap_or_default());
    let Ok(ids) = tokenizer.encode_with_literals(&marked.text, &ranges, false) else { return };
    let controls = ids.iter().filter(|&&id| !tokenizer.is_ordinary(id)).count();
    assert_eq!(controls, 6, "client text became control tokens: {:?}", marked.text);
}

/// A peer's bytes on a KV-events socket (the first byte sets the size of each read): the
/// ZMTP greeting, READY, commands, subscriptions and messages through the decoder every
/// connection runs, within its caps (a declared 2^40-byte frame is refused from its header).
pub fn kv_events_socket(data: &[u8]) {
    kiln_server::kv_events::fuzz_peer_bytes(data);
}
