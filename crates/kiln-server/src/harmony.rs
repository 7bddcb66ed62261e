//! gpt-oss's output format, harmony: its thinking, answer and tool calls read out of the text
//! (`--reasoning-parser openai_gptoss` and `--tool-call-parser openai`, vLLM's names).
//!
//! The chat template ends the prompt with `<|start|>assistant`; the output is a sequence of
//! messages, each a header and a body:
//!
//! ```text
//! <|channel|>analysis<|message|>THINKING<|end|>
//! <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
//! <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
//! ```
//!
//! (the recipient may also follow the role: `<|start|>assistant to=functions.NAME<|channel|>`).
//! `<|return|>` and `<|call|>` end the generation, so they are normally not in the text. The
//! text must be decoded with its special tokens (`skip_special_tokens: false`).
//!
//! [`HarmonySplit`] routes bodies as they stream: `analysis` (and any other channel) to the
//! reasoning; `final` and `commentary` without a recipient (a preamble) to the answer; a message
//! with a recipient to the answer in the form `<|channel|>commentary to=R<|message|>ARGS<|call|>`,
//! which [`tool_split`] and [`parse_calls`] read (they also read the raw text).
//!
//! Invariants: a streamed split equals the whole one (only a possible marker prefix, or an
//! unfinished header, is held back); headers and markers never reach the reasoning or the
//! content; nothing here panics on any text.

use crate::reasoning::SplitStep;
use crate::tools::ToolCall;
use crate::tools::parser::Split;

pub const START: &str = "<|start|>";
pub const CHANNEL: &str = "<|channel|>";
pub const MESSAGE: &str = "<|message|>";
pub const END: &str = "<|end|>";
pub const CALL: &str = "<|call|>";
pub const RETURN: &str = "<|return|>";
const CONSTRAIN: &str = "<|constrain|>";
/// What ends a body: the message's end, a call, the output's end, or a new message.
const BODY_ENDS: [&str; 4] = [END, CALL, RETURN, START];
const MARKERS: [&str; 7] = [START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN];

/// Where an output starts, by the prompt's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Position {
    /// At a header (the prompt ends with `<|start|>assistant`, the generation prompt).
    Header,
    /// Inside a body the prompt opened.
    Body(Route),
}

/// Where a message's body goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Reasoning,
    Answer,
    /// A message to a recipient: a tool call.
    Call,
}

/// A message header: its channel and recipient.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Header {
    channel: String,
    recipient: Option<String>,
}

impl Header {
    /// Reads `<|start|>ROLE [to=R]<|channel|>CHANNEL [to=R] [<|constrain|>TYPE]` (any part may
    /// be missing).
    fn parse(text: &str) -> Self {
        let word = |s: &str| -> String {
            s.split(|c: char| c.is_whitespace() || c == '<').next().unwrap_or_default().to_owned()
        };
        let channel = text.find(CHANNEL).map(|at| word(&text[at + CHANNEL.len()..]));
        let recipient = text.find("to=").map(|at| word(&text[at + 3..])).filter(|r| !r.is_empty());
        Self { channel: channel.unwrap_or_default(), recipient }
    }

    fn route(&self) -> Route {
        match (&self.recipient, self.channel.as_str()) {
            (Some(_), _) => Route::Call,
            (None, "final" | "commentary") => Route::Answer,
            (None, _) => Route::Reasoning,
        }
    }
}

/// Where the output of a prompt whose rendered text is `prompt` starts.
pub fn position(prompt: &str) -> Position {
    let Some(head) = prompt.strip_suffix(MESSAGE) else {
        return Position::Header;
    };
    let from = [START, END].iter().filter_map(|m| head.rfind(m)).max().unwrap_or(0);
    Position::Body(Header::parse(&head[from..]).route())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Header,
    Body(Route),
}

/// The split of one harmony output as it streams.
#[derive(Clone, Debug)]
pub struct HarmonySplit {
    phase: Phase,
    /// Text received but not yet released (a header, or a possible marker prefix).
    held: String,
}

impl HarmonySplit {
    pub fn new(start: Position) -> Self {
        let phase = match start {
            Position::Header => Phase::Header,
            Position::Body(route) => Phase::Body(route),
        };
        Self { phase, held: String::new() }
    }

    /// Whether the text that follows is answer text.
    pub fn in_answer(&self) -> bool {
        matches!(self.phase, Phase::Body(Route::Answer | Route::Call))
    }

    /// Takes the next piece of text (`last`: the output ended); returns what it releases.
    pub fn push(&mut self, text: &str, last: bool) -> SplitStep {
        self.held.push_str(text);
        let mut step = SplitStep::default();
        loop {
            match self.phase {
                Phase::Header => {
                    let Some(at) = self.held.find(MESSAGE) else {
                        if last {
                            // A cut header is dropped; text that never spoke harmony is the
                            // answer as it is.
                            if !self.held.trim_start().starts_with("<|") {
                                step.answer.push_str(&self.held);
                            }
                            self.held.clear();
                        }
                        return step;
                    };
                    let header = Header::parse(&self.held[..at]);
                    self.held.drain(..at + MESSAGE.len());
                    let route = header.route();
                    if let (Route::Call, Some(to)) = (route, &header.recipient) {
                        for part in [CHANNEL, "commentary to=", to, MESSAGE] {
                            step.answer.push_str(part);
                        }
                    }
                    self.phase = Phase::Body(route);
                }
                Phase::Body(route) => {
                    let end = BODY_ENDS
                        .iter()
                        .filter_map(|m| self.held.find(m).map(|at| (at, *m)))
                        .min_by_key(|(at, _)| *at);
                    let (release, next) = match end {
                        Some((at, _)) => (at, true),
                        None if last => (self.held.len(), false),
                        None => (self.held.len() - marker_prefix_len(&self.held), false),
                    };
                    let out = match route {
                        Route::Reasoning => &mut step.reasoning,
                        Route::Answer | Route::Call => &mut step.answer,
                    };
                    out.push_str(&self.held[..release]);
                    self.held.drain(..release);
                    if route == Route::Call && (next || last) {
                        step.answer.push_str(CALL);
                    }
                    if !next {
                        return step;
                    }
                    // `<|start|>` opens the next header; the other ends are dropped.
                    if !self.held.starts_with(START) {
                        let len = BODY_ENDS.iter().find(|m| self.held.starts_with(**m));
                        self.held.drain(..len.map_or(0, |m| m.len()));
                    }
                    self.phase = Phase::Header;
                }
            }
        }
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of a marker.
fn marker_prefix_len(text: &str) -> usize {
    let Some(at) = text.rfind('<') else { return 0 };
    let tail = &text[at..];
    if MARKERS.iter().any(|m| m.len() > tail.len() && m.starts_with(tail)) { tail.len() } else { 0 }
}

/// Where the first message with a recipient starts in `text` (`finished`: no more follows).
pub fn tool_split(text: &str, finished: bool) -> Split {
    let mut from = 0;
    loop {
        let opener =
            [START, CHANNEL].iter().filter_map(|m| text[from..].find(m).map(|at| from + at)).min();
        let Some(open) = opener else {
            let held = if finished { 0 } else { marker_prefix_len(&text[from..]) };
            return Split::Content(text.len() - held);
        };
        let Some(len) = text[open..].find(MESSAGE) else {
            return Split::Content(if finished { text.len() } else { open });
        };
        if Header::parse(&text[open..open + len]).recipient.is_some() {
            return Split::Tools(open);
        }
        from = open + len + MESSAGE.len();
    }
}

/// The calls of a section that [`tool_split`] found: every message in it must be a call whose
/// body is a JSON object; `None` otherwise.
pub fn parse_calls(section: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = section.trim_start();
    while !rest.is_empty() {
        let (header, after) = rest.split_once(MESSAGE)?;
        if !(header.starts_with(START) || header.starts_with(CHANNEL)) {
            return None;
        }
        let recipient = Header::parse(header).recipient?;
        let end = BODY_ENDS.iter().filter_map(|m| after.find(m)).min().unwrap_or(after.len());
        let body = after[..end].trim();
        let arguments = if body.is_empty() {
            serde_json::json!({})
        } else {
            serde_json::from_str(body).ok()?
        };
        if !arguments.is_object() {
            return None;
        }
        let name = recipient.strip_prefix("functions.").unwrap_or(&recipient).to_owned();
        calls.push(ToolCall { name, arguments: arguments.to_string() });
        rest = &after[end..];
        for m in [CALL, END, RETURN] {
            rest = rest.strip_prefix(m).unwrap_or(rest);
        }
        rest = rest.trim_start();
    }
    Some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` pushed in pieces of `piece` characters, the releases joined.
    fn streamed(start: Position, text: &str, piece: usize) -> SplitStep {
        let chars: Vec<char> = text.chars().collect();
        let pieces: Vec<String> = chars.chunks(piece).map(|c| c.iter().collect()).collect();
        let mut split = HarmonySplit::new(start);
        let mut all = SplitStep::default();
        for (i, p) in pieces.iter().enumerate() {
            let step = split.push(p, i + 1 == pieces.len());
            all.reasoning.push_str(&step.reasoning);
            all.answer.push_str(&step.answer);
        }
        if pieces.is_empty() {
            return split.push("", true);
        }
        all
    }

    fn split(reasoning: &str, answer: &str) -> SplitStep {
        SplitStep { reasoning: reasoning.into(), answer: answer.into() }
    }

    const CALL_TEXT: &str = "<|channel|>commentary to=functions.get_weather<|message|>\
                             {\"city\": \"Paris\"}<|call|>";

    #[test]
    fn outputs_split_the_same_whole_and_streamed() {
        let cases = [
            (
                Position::Header,
                "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant\
                 <|channel|>final<|message|>It is 4.",
                split("User asks 2+2. Easy.", "It is 4."),
            ),
            (
                Position::Header,
                "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>\
                 commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
                split("Need weather.", CALL_TEXT),
            ),
            // The recipient after the role, and the call marker in the text.
            (
                Position::Header,
                "<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.get_weather\
                 <|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>",
                split("a", CALL_TEXT),
            ),
            // A preamble is content; `<` inside a body is text.
            (
                Position::Header,
                "<|channel|>commentary<|message|>Checking a < b.<|end|><|start|>assistant\
                 <|channel|>final<|message|>Done<|return|>",
                split("", "Checking a < b.Done"),
            ),
            // Cut short inside the thinking, and inside a header.
            (Position::Header, "<|channel|>analysis<|message|>hmm <|en", split("hmm <|en", "")),
            (
                Position::Header,
                "<|channel|>analysis<|message|>x<|end|><|start|>assi",
                split("x", ""),
            ),
            // A model that does not speak harmony keeps its text.
            (Position::Header, "plain words", split("", "plain words")),
            (Position::Body(Route::Answer), "é<|return|>", split("", "é")),
            (Position::Body(Route::Reasoning), "ü<|end|>", split("ü", "")),
        ];
        for (start, text, want) in cases {
            for piece in [1, 2, 3, 7, 1000] {
                assert_eq!(streamed(start, text, piece), want, "{text:?} / {piece}");
            }
        }
    }

    #[test]
    fn the_prompt_decides_where_the_output_starts() {
        assert_eq!(
            position("<|start|>user<|message|>hi<|end|><|start|>assistant"),
            Position::Header
        );
        assert_eq!(
            position("<|end|><|start|>assistant<|channel|>final<|message|>"),
            Position::Body(Route::Answer)
        );
        assert_eq!(
            position("<|start|>assistant<|channel|>analysis<|message|>"),
            Position::Body(Route::Reasoning)
        );
    }

    #[test]
    fn calls_are_found_in_the_split_form_and_in_raw_text() {
        let want =
            vec![ToolCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }];
        let text = format!("Let me check.{CALL_TEXT}");
        assert_eq!(tool_split(&text, true), Split::Tools(13));
        assert_eq!(parse_calls(&text[13..]), Some(want.clone()));
        let raw = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary \
                   to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}";
        let Split::Tools(at) = tool_split(raw, true) else { panic!("no call in {raw}") };
        assert_eq!(parse_calls(&raw[at..]), Some(want));
        // An unfinished header is held back; a finished text without calls is content.
        assert_eq!(tool_split("ok <|channel|>commentary to=fun", false), Split::Content(3));
        assert_eq!(tool_split("ok <|chan", false), Split::Content(3));
        assert_eq!(tool_split("ok <|channel|>final<|message|>x", true), Split::Content(31));
        // Arguments that are not an object, or a message without a recipient, are no calls.
        assert_eq!(parse_calls("<|channel|>commentary to=functions.f<|message|>[1]"), None);
        assert_eq!(parse_calls("<|channel|>final<|message|>{}"), None);
        let empty = parse_calls("<|channel|>commentary to=functions.f<|message|><|call|>");
        assert_eq!(empty, Some(vec![ToolCall { name: "f".into(), arguments: "{}".into() }]));
    }
}
