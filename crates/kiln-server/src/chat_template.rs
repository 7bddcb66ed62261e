//! Chat templates: a model's Jinja template that turns a conversation into its prompt text,
//! rendered with minijinja the way Hugging Face transformers' `apply_chat_template` renders it.
//!
//! Where the template comes from ([`load_chat_template`]), first match wins:
//! 1. the operator's `--chat-template FILE`;
//! 2. the tokenizer's own: `chat_template.jinja`, else `tokenizer_config.json` `chat_template`,
//!    of an HF directory, or a GGUF file's `tokenizer.chat_template`;
//! 3. ChatML ([`ChatTemplate::fallback`]), as llama.cpp falls back.
//!
//! Templates come from the model or the operator, never from requests; requests only supply
//! the messages, which the template sees as data.
//!
//! Invariants:
//! - a template compiles once, at start-up ([`ChatTemplate::new`]); a syntax error fails there.
//!   Unknown filters / functions are only detected when a render reaches them;
//! - the environment matches transformers' (`utils/chat_template_utils.py`): `trim_blocks` and
//!   `lstrip_blocks` on, no trailing-newline keeping, no autoescape, loop controls; globals
//!   `raise_exception(msg)` and `strftime_now(fmt)` (UTC here, local time there); `tojson` is
//!   Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)` ([`json`]); Python `str` / `dict` methods through
//!   `minijinja_contrib::pycompat`; `none` / `true` print as `None` / `True` (minijinja does);
//! - the context holds `messages` (each a map `role`, `content`, then `reasoning_content`,
//!   `tool_calls`, `tool_call_id`, `name` where the message has them, in that order; the
//!   thinking also answers to `thinking`, gpt-oss's name for it),
//!   `add_generation_prompt`, `bos_token` / `eos_token` (the empty string when the tokenizer has
//!   none; transformers leaves them undefined, which prints the same), `tools` (the request's
//!   list, or `none` as transformers passes `None`, which templates test with `is not none`),
//!   `documents` set to `none`, and the request's `chat_template_kwargs` (never replacing the
//!   names before, [`RESERVED_VARIABLES`]);
//! - maps keep their insertion order (minijinja's `preserve_order`), as Python dicts do: a
//!   tool's JSON reaches the prompt with the keys in the order the client sent them;
//! - every render is bounded: at most [`FUEL`] minijinja instructions (Qwen3's template, the
//!   largest we test, needs about 290 for four messages and 56,000 for a thousand), and
//!   minijinja's macro recursion limit (500 frames, which fits a 2 MiB thread stack) stays in
//!   place, so an endless loop or runaway recursion ends in an error, not a hang or a stack
//!   overflow. What a render prints is bounded: past [`MAX_RENDER_BYTES`] it fails with
//!   [`TemplateError::TooLarge`] (and the caller refuses a prompt too long in bytes for the
//!   context before tokenizing it). Not bounded: values a template builds without printing
//!   them (minijinja caps one string repetition at 100 MB, not a loop of concatenations), and
//!   the depth of values a template builds: on a 2 MiB stack, printing a list nested some
//!   5,000 deep, or dropping one some 30,000 deep (either takes a deliberate `namespace`
//!   loop), overflows; `tojson` stops at 256 levels. Templates are trusted not to be
//!   malicious, only buggy;
//! - a render error from `raise_exception(msg)` is [`TemplateError::Raised`] with `msg`
//!   verbatim: it rejects the caller's conversation (for example roles that do not alternate);
//!   other render errors are bugs of the template or unsupported input.
//!
//! Known differences from Python Jinja: `bos_token` is defined (empty) where transformers
//! leaves it undefined; an empty conversation is rejected, as transformers rejects it.
//!
//! Message content is data in a second sense: [`ChatTemplate::render_marked`] also returns the
//! byte ranges of the prompt that came from message content, so the tokenizer can keep
//! control-token text typed by a client as text (`Tokenizer::encode_with_literals`). It
//! renders twice: once as usual, once with each message's content and `reasoning_content`
//! (their whitespace-trimmed cores) wrapped in the noncharacters U+FDD0 / U+FDD1; the wrapped render, markers removed,
//! must equal the plain one and the markers must pair up, else the ranges are unknown (the
//! template transformed the content, or the content holds a marker itself) and `None` is
//! returned.
//!
//! Complexity: a render is linear in the template's executed instructions plus output length.

mod json;
mod strftime;
#[cfg(test)]
mod tests;

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_tokenizer::Tokenizer;
use minijinja::value::{Enumerator, Object, Value};
use minijinja::{AutoEscape, Environment, ErrorKind, context};

/// Instructions one render may execute before it fails with [`TemplateError::OutOfFuel`].
pub const FUEL: u64 = 10_000_000;

/// Name of the one template in a [`ChatTemplate`]'s environment (no extension: no autoescape).
const TEMPLATE_NAME: &str = "chat_template";

/// ChatML, llama.cpp's fallback: `<|im_start|>{role}\n{content}<|im_end|>\n` per message and
/// `<|im_start|>assistant\n` as generation prompt.
const CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// One message as the template sees it.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's thinking (`reasoning_content`), client text like `content`.
    pub reasoning_content: Option<String>,
    /// An assistant message's calls, `[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`, with `arguments` as a JSON object (parsed from the API's string, as
    /// vLLM passes them, so templates can `tojson` or iterate them). `None`: the key is absent.
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool message's `tool_call_id`.
    pub tool_call_id: Option<String>,
    /// A message's `name` (a tool message's function).
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with only a role and text.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), ..Self::default() }
    }
}

/// What a render sees besides the messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// End with the opening of the assistant's turn.
    pub add_generation_prompt: bool,
    /// The request's `tools` as given (`None`: the template sees `none`, as transformers
    /// passes `tools=None`).
    pub tools: Option<Vec<serde_json::Value>>,
    /// `chat_template_kwargs`: more variables of the context (never one of the names above,
    /// [`RESERVED_VARIABLES`]).
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

impl RenderOptions {
    pub fn new(add_generation_prompt: bool) -> Self {
        Self { add_generation_prompt, ..Self::default() }
    }
}

/// Context variables the server sets itself, which `chat_template_kwargs` may not replace.
pub const RESERVED_VARIABLES: [&str; 6] =
    ["messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"];

/// A rendered prompt and the byte ranges of it that came from message content and from the
/// strings of `chat_template_kwargs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkedPrompt {
    pub text: String,
    /// `None` when the content could not be located (see the module docs).
    pub content_ranges: Option<Vec<Range<usize>>>,
    /// The printed kwargs strings; `None` when they could not be located (the template
    /// compared or transformed one); empty when there are none.
    pub kwargs_ranges: Option<Vec<Range<usize>>>,
}

/// A compiled chat template with the token strings its context needs. Shareable across
/// threads; every [`render`](Self::render) is independent.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    source_name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("reading chat template {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("chat template from {source_name} does not compile: {source}")]
    Compile { source_name: String, source: minijinja::Error },
    /// The template called `raise_exception(message)`; `message` is the template's, verbatim.
    #[error("{message}")]
    Raised { message: String },
    #[error("chat template from {source_name} ran out of fuel ({limit} instructions)")]
    OutOfFuel { source_name: String, limit: u64 },
    #[error("chat template from {source_name} failed to render: {source}")]
    Render { source_name: String, source: minijinja::Error },
    #[error("cannot apply a chat template to an empty conversation")]
    EmptyConversation,
    #[error("chat template from {source_name} printed more than {limit} bytes")]
    TooLarge { source_name: String, limit: usize },
}

/// Bytes one render may print before it fails with [`TemplateError::TooLarge`] (a prompt
/// longer than any context: a million tokens of 32 bytes).
pub const MAX_RENDER_BYTES: usize = 32 << 20;

/// A render's output, refusing a write that would take it past `limit` bytes (and noting
/// that it did: `full`).
struct BoundedOutput {
    bytes: Vec<u8>,
    limit: usize,
    full: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.limit {
            self.full = true;
            return Err(std::io::Error::other("the rendered prompt is too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The error `raise_exception` returns, found again in the error chain after rendering.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_name", &self.source_name)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; fails at start-up rather than per request. Its
    /// [`source_name`](Self::source_name) is `"custom"`; see [`Self::with_source_name`].
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        Self::with_source_name(source, "custom", bos_token, eos_token)
    }

    /// [`Self::new`] naming where the template came from (shown in errors and logs).
    pub fn with_source_name(
        source: &str,
        source_name: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let source_name = source_name.into();
        let mut env = environment();
        if let Err(source) = env.add_template_owned(TEMPLATE_NAME, source.to_owned()) {
            return Err(TemplateError::Compile { source_name, source });
        }
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
            source_name,
        })
    }

    /// The documented fallback when a model ships no template: ChatML
    /// (`<|im_start|>role\ncontent<|im_end|>\n`, generation prompt `<|im_start|>assistant\n`),
    /// as llama.cpp falls back.
    pub fn fallback(bos_token: Option<String>, eos_token: Option<String>) -> Self {
        Self::with_source_name(CHATML, "fallback (ChatML)", bos_token, eos_token)
            .expect("the built-in ChatML template compiles")
    }

    /// The prompt text of `messages`; with `add_generation_prompt` it ends with the opening of
    /// the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, &RenderOptions::new(add_generation_prompt))
    }

    /// [`Self::render`] with tools and extra variables.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
    ) -> Result<String, TemplateError> {
        self.render_counting_fuel(messages, options).map(|(text, _)| text)
    }

    /// [`Self::render`], plus the byte ranges of the text that came from message content
    /// (`None` when they cannot be located; see the module docs).
    pub fn render_marked(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
    ) -> Result<MarkedPrompt, TemplateError> {
        let plain = self.render_with(messages, options)?;
        let content_ranges = self.content_ranges(messages, options, &plain);
        let kwargs_ranges = self.kwargs_ranges(messages, options, &plain);
        Ok(MarkedPrompt { text: plain, content_ranges, kwargs_ranges })
    }

    /// Where message content landed in `plain` (module docs).
    fn content_ranges(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
        plain: &str,
    ) -> Option<Vec<Range<usize>>> {
        let marked = |t: &str| t.contains([CONTENT_OPEN, CONTENT_CLOSE]);
        if messages
            .iter()
            .any(|m| marked(&m.content) || m.reasoning_content.as_deref().is_some_and(marked))
        {
            return None;
        }
        let wrapped: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage {
                content: wrap_content(&m.content),
                reasoning_content: m.reasoning_content.as_deref().map(wrap_content),
                ..m.clone()
            })
            .collect();
        // A template may branch on content (`if content == ''`): a failure here only means
        // the ranges are unknown.
        let marked = self.render_with(&wrapped, options).ok()?;
        strip_markers(&marked).filter(|(text, _)| text == plain).map(|(_, r)| r)
    }

    /// Where the strings of `chat_template_kwargs` (values at any depth, not keys) landed in
    /// `plain`, found as content is, in a render of their own: a template that compares one
    /// (`reasoning_effort == 'high'`) loses only these ranges.
    fn kwargs_ranges(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
        plain: &str,
    ) -> Option<Vec<Range<usize>>> {
        let mut any = false;
        let mut marked_in_value = false;
        let kwargs: serde_json::Map<String, serde_json::Value> = options
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), wrap_strings(v, &mut any, &mut marked_in_value)))
            .collect();
        if marked_in_value {
            return None;
        }
        if !any {
            return Some(Vec::new());
        }
        let wrapped = RenderOptions { kwargs, ..options.clone() };
        let marked = self.render_with(messages, &wrapped).ok()?;
        strip_markers(&marked).filter(|(text, _)| text == plain).map(|(_, r)| r)
    }

    /// [`Self::render`] that also returns the fuel the render consumed.
    pub fn render_with_fuel(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<(String, u64), TemplateError> {
        self.render_counting_fuel(messages, &RenderOptions::new(add_generation_prompt))
    }

    fn render_counting_fuel(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
    ) -> Result<(String, u64), TemplateError> {
        if messages.is_empty() {
            return Err(TemplateError::EmptyConversation);
        }
        let messages: Vec<Value> = messages.iter().map(MessageObject::value).collect();
        let tools = options.tools.as_ref().map_or(Value::from(()), Value::from_serialize);
        let extra = options
            .kwargs
            .iter()
            .filter(|(k, _)| !RESERVED_VARIABLES.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)));
        let extra: Value = extra.collect();
        let ctx = context! {
            messages,
            add_generation_prompt => options.add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            tools,
            documents => Value::from(()),
            ..extra
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| self.render_error(e))?;
        let mut out = BoundedOutput { bytes: Vec::new(), limit: MAX_RENDER_BYTES, full: false };
        let captured = template.render_captured_to(ctx, &mut out).map_err(|e| {
            if out.full {
                let source_name = self.source_name.clone();
                return TemplateError::TooLarge { source_name, limit: MAX_RENDER_BYTES };
            }
            self.render_error(e)
        })?;
        let consumed = captured.state().fuel_levels().map_or(0, |(consumed, _)| consumed);
        // minijinja writes whole `str`s, and the writer takes a write whole or not at all.
        let text = String::from_utf8(out.bytes).map_err(|e| TemplateError::Render {
            source_name: self.source_name.clone(),
            source: minijinja::Error::new(ErrorKind::WriteFailure, e.to_string()),
        })?;
        Ok((text, consumed))
    }

    /// Where the template came from: `"--chat-template FILE"`, `"tokenizer_config.json"`,
    /// `"chat_template.jinja"`, `"GGUF tokenizer.chat_template"`, `"fallback (ChatML)"`, or
    /// the name given to [`Self::with_source_name`].
    /// Whether the template reads the variable `name` (one it does not define itself), so
    /// that a request field feeding it has an effect.
    pub fn reads_variable(&self, name: &str) -> bool {
        self.env
            .get_template(TEMPLATE_NAME)
            .is_ok_and(|t| t.undeclared_variables(false).contains(name))
    }

    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    fn render_error(&self, err: minijinja::Error) -> TemplateError {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
        while let Some(e) = cause {
            if let Some(raised) = e.downcast_ref::<RaisedException>() {
                return TemplateError::Raised { message: raised.0.clone() };
            }
            cause = e.source();
        }
        let source_name = self.source_name.clone();
        if err.kind() == ErrorKind::OutOfFuel {
            return TemplateError::OutOfFuel { source_name, limit: FUEL };
        }
        TemplateError::Render { source_name, source: err }
    }
}

/// Picks the template of a model: `override_file` (the `--chat-template FILE` flag) first, else
/// the tokenizer's own, else the ChatML fallback. `bos_token` is the text of the tokenizer's
/// BOS id; `eos_token` the text of the EOS its configuration names
/// ([`Tokenizer::eos_token_id`]), else of the first of its end-of-generation ids.
pub fn load_chat_template(
    tokenizer: &Tokenizer,
    override_file: Option<&Path>,
    builtin: Option<BuiltinTemplate>,
) -> Result<ChatTemplate, TemplateError> {
    let file = override_file.map(|p| TemplateOverride::File(p.to_owned()));
    load_chat_template_from(tokenizer, file.as_ref(), builtin)
}

/// A chat template given by the operator (`--chat-template`): a file, or the template's text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateOverride {
    File(std::path::PathBuf),
    Inline(String),
}

impl TemplateOverride {
    /// vLLM's reading of `--chat-template ARG`: an existing file; else, if it holds any of
    /// `{`, `}` or a newline, the template itself; else an error (a path that does not exist).
    pub fn from_arg(arg: &str) -> Result<Self, String> {
        let path = Path::new(arg);
        if path.is_file() {
            return Ok(Self::File(path.to_owned()));
        }
        if arg.contains(['{', '}', '\n']) {
            return Ok(Self::Inline(arg.to_owned()));
        }
        Err(format!(
            "`{arg}` is neither a chat template file nor a template (no `{{`, `}}` or newline)"
        ))
    }
}

/// [`load_chat_template`] with a file or inline override.
pub fn load_chat_template_from(
    tokenizer: &Tokenizer,
    override_template: Option<&TemplateOverride>,
    builtin: Option<BuiltinTemplate>,
) -> Result<ChatTemplate, TemplateError> {
    let bos = tokenizer.bos_token_id().and_then(|id| tokenizer.token_text(id));
    let eos = tokenizer
        .eos_token_id()
        .or_else(|| tokenizer.eos_token_ids().first().copied())
        .and_then(|id| tokenizer.token_text(id));
    match override_template {
        Some(TemplateOverride::File(path)) => {
            let source = std::fs::read_to_string(path)
                .map_err(|source| TemplateError::Read { path: path.clone(), source })?;
            let name = format!("--chat-template {}", path.display());
            return ChatTemplate::with_source_name(&source, name, bos, eos);
        }
        Some(TemplateOverride::Inline(source)) => {
            return ChatTemplate::with_source_name(source, "--chat-template (inline)", bos, eos);
        }
        None => {}
    }
    match (tokenizer.chat_template(), tokenizer.chat_template_origin()) {
        (Some(source), Some(origin)) => ChatTemplate::with_source_name(source, origin, bos, eos),
        (Some(source), None) => ChatTemplate::with_source_name(source, "tokenizer", bos, eos),
        (None, _) => match builtin.map(BuiltinTemplate::name_and_source) {
            Some((name, source)) => ChatTemplate::with_source_name(source, name, bos, eos),
            None => Ok(ChatTemplate::fallback(bos, eos)),
        },
    }
}

/// Google's Gemma 3 instruction template (from `google/gemma-3-*-it`), for Gemma 3 files that
/// ship none (the default model's GGUF has no `tokenizer.chat_template`).
pub const GEMMA3_TEMPLATE: &str = include_str!("../templates/gemma3.jinja");

/// A model family whose instruction template kiln ships, used when a model of that family
/// carries none. Which family a model belongs to is the loader's knowledge, not the server's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuiltinTemplate {
    Gemma3,
}

impl BuiltinTemplate {
    /// The template's name (as [`ChatTemplate::source_name`] reports it) and its source.
    pub fn name_and_source(self) -> (&'static str, &'static str) {
        match self {
            Self::Gemma3 => ("built-in Gemma 3 template", GEMMA3_TEMPLATE),
        }
    }
}

/// Marker before a message's content in [`ChatTemplate::render_marked`] (a noncharacter).
const CONTENT_OPEN: char = '\u{FDD0}';
/// Marker after a message's content.
const CONTENT_CLOSE: char = '\u{FDD1}';

/// `content` with its trimmed core between the markers, whitespace outside them (so a
/// template's `| trim` removes the same whitespace as without markers).
fn wrap_content(content: &str) -> String {
    let core = content.trim();
    if core.is_empty() {
        return content.to_owned();
    }
    let start = content.len() - content.trim_start().len();
    let end = start + core.len();
    format!("{}{CONTENT_OPEN}{core}{CONTENT_CLOSE}{}", &content[..start], &content[end..])
}

/// `value` with every string wrapped as [`wrap_content`] wraps content; sets `any` when it
/// held a non-blank string and `marked` when one already held a marker.
fn wrap_strings(value: &serde_json::Value, any: &mut bool, marked: &mut bool) -> serde_json::Value {
    use serde_json::Value as J;
    match value {
        J::String(s) => {
            *marked |= s.contains([CONTENT_OPEN, CONTENT_CLOSE]);
            *any |= !s.trim().is_empty();
            J::String(wrap_content(s))
        }
        J::Array(items) => J::Array(items.iter().map(|v| wrap_strings(v, any, marked)).collect()),
        J::Object(map) => {
            J::Object(map.iter().map(|(k, v)| (k.clone(), wrap_strings(v, any, marked))).collect())
        }
        other => other.clone(),
    }
}

/// `marked` without the markers, and the byte ranges (in the result) they enclosed; `None`
/// unless every marker pairs up, unnested.
fn strip_markers(marked: &str) -> Option<(String, Vec<Range<usize>>)> {
    let mut text = String::with_capacity(marked.len());
    let mut ranges = Vec::new();
    let mut open: Option<usize> = None;
    for c in marked.chars() {
        match (c, open) {
            (CONTENT_OPEN, None) => open = Some(text.len()),
            (CONTENT_CLOSE, Some(start)) => {
                ranges.push(start..text.len());
                open = None;
            }
            (CONTENT_OPEN | CONTENT_CLOSE, _) => return None,
            _ => text.push(c),
        }
    }
    open.is_none().then_some((text, ranges))
}

/// The environment transformers renders chat templates in (see the module docs).
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: &str| strftime::strftime_now(format));
    env.add_filter("tojson", json::tojson);
    env
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

/// A message as a map that keeps Python's key order (`role`, `content`, then the tool keys a
/// message has) when a template iterates it or serializes it with `tojson`; keys the message
/// lacks are absent (templates test `'tool_calls' in message`).
#[derive(Debug)]
struct MessageObject {
    keys: Vec<&'static str>,
    values: Vec<Value>,
}

impl MessageObject {
    fn value(message: &ChatMessage) -> Value {
        let mut keys = vec!["role", "content"];
        let mut values =
            vec![Value::from(message.role.as_str()), Value::from(message.content.as_str())];
        if let Some(reasoning) = &message.reasoning_content {
            keys.push("reasoning_content");
            values.push(Value::from(reasoning.as_str()));
        }
        if let Some(calls) = &message.tool_calls {
            keys.push("tool_calls");
            values.push(Value::from_serialize(calls));
        }
        if let Some(id) = &message.tool_call_id {
            keys.push("tool_call_id");
            values.push(Value::from(id.as_str()));
        }
        if let Some(name) = &message.name {
            keys.push("name");
            values.push(Value::from(name.as_str()));
        }
        Value::from_object(Self { keys, values })
    }
}

/// Another name templates read an assistant message's thinking by: gpt-oss's template (and
/// transformers' convention for it) says `thinking`. It is not listed among the keys, so a
/// message's `tojson` and iteration are unchanged.
const THINKING_ALIAS: &str = "thinking";

impl Object for MessageObject {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        let key = if key == THINKING_ALIAS { "reasoning_content" } else { key };
        self.keys.iter().position(|k| *k == key).map(|i| self.values[i].clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.keys.iter().map(|k| Value::from(*k)).collect())
    }
}
