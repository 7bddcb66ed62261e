//! Reasoning parsers (`--reasoning-parser`): a reasoning model's thinking split from its
//! answer, so that chat returns it as `reasoning_content`, Messages as a `thinking` block and
//! Responses as a reasoning item, and so that tool calls and structured outputs apply to the
//! answer only.
//!
//! `qwen3` and `deepseek_r1` read `<think>…</think>` (Qwen3, QwQ, DeepSeek-R1 and its
//! distills); `openai_gptoss` reads gpt-oss's harmony channels ([`crate::harmony`]). Where the
//! output starts is decided from the prompt: a chat template that ends the prompt inside an
//! opened `<think>` (DeepSeek-R1's, Qwen3-Thinking's) starts the output in the thinking; one
//! that closed it (Qwen3 with `enable_thinking: false`) or never opened it starts it in the
//! answer unless the output itself opens with `<think>`, except for `deepseek_r1`, whose
//! models always think first.
//!
//! Invariants: a streamed split equals the whole one ([`ReasoningSplit::push`] holds back
//! only text that may still be part of a marker, and the whole split is the stream fed at
//! once); the markers never appear in either part; the answer starts after the whitespace that
//! follows `</think>`.

use kiln_core::{ReasoningFormat, ReasoningMarkers, StructuredOutput};

use crate::harmony::{self, HarmonySplit, Position, Route};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// A reasoning parser, by vLLM's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// Qwen3 (hybrid and thinking), QwQ: thinking only when opened.
    Qwen3,
    /// DeepSeek-R1 and its distills: the output starts thinking even without `<think>`.
    DeepSeekR1,
    /// gpt-oss: the `analysis` channel of its harmony messages.
    GptOss,
}

impl ReasoningParser {
    /// The names `--reasoning-parser` takes.
    pub const NAMES: &'static str = "qwen3, deepseek_r1, openai_gptoss";

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "qwen3" => Some(Self::Qwen3),
            "deepseek_r1" => Some(Self::DeepSeekR1),
            "openai_gptoss" => Some(Self::GptOss),
            _ => None,
        }
    }

    /// Whether the format's markers are special tokens, so the text must be decoded with
    /// them (`skip_special_tokens: false`).
    pub fn needs_special_tokens(self) -> bool {
        self == Self::GptOss
    }

    /// How one output of a prompt whose rendered text is `prompt` starts.
    pub fn start(self, prompt: &str) -> Start {
        let prompt = prompt.trim_end();
        if self == Self::GptOss {
            return Start::Harmony(harmony::position(prompt));
        }
        let opened = prompt.ends_with(OPEN);
        match (opened, self) {
            (true, _) | (false, Self::DeepSeekR1) if !prompt.ends_with(CLOSE) => Start::Reasoning,
            _ => Start::Undecided,
        }
    }

    /// `answer` wrapped so that the constraint begins after the thinking.
    pub fn constrain_answer(start: Start, answer: StructuredOutput) -> StructuredOutput {
        let reasoning = match start {
            Start::Harmony(Position::Body(Route::Answer)) => return answer,
            Start::Harmony(position) => {
                ReasoningFormat::Harmony { in_body: position != Position::Header }
            }
            Start::Reasoning | Start::Undecided => ReasoningFormat::Markers(ReasoningMarkers {
                open: OPEN.into(),
                close: CLOSE.into(),
                required: start == Start::Reasoning,
            }),
        };
        StructuredOutput::AfterReasoning { reasoning, answer: Box::new(answer) }
    }
}

/// Where an output starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// Inside the thinking (the prompt opened it).
    Reasoning,
    /// In the answer, unless the output opens the thinking itself.
    Undecided,
    /// gpt-oss's harmony output, from this position.
    Harmony(Position),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace and a prefix of `<think>` yet.
    Undecided,
    /// As `Undecided`, but the output is thinking either way (a `<think>` it repeats dropped).
    ReasoningStart,
    Reasoning,
    /// After `</think>`: whitespace is dropped until the answer's first other character.
    AnswerStart,
    Answer,
}

/// The split of one output as it streams.
#[derive(Clone, Debug)]
pub enum ReasoningSplit {
    Think(ThinkSplit),
    Harmony(HarmonySplit),
}

impl ReasoningSplit {
    pub fn new(start: Start) -> Self {
        match start {
            Start::Harmony(position) => Self::Harmony(HarmonySplit::new(position)),
            Start::Reasoning | Start::Undecided => Self::Think(ThinkSplit::new(start)),
        }
    }

    /// The whole output split at once.
    pub fn whole(start: Start, text: &str) -> SplitStep {
        Self::new(start).push(text, true)
    }

    /// Whether the answer has begun (what follows is answer text).
    pub fn in_answer(&self) -> bool {
        match self {
            Self::Think(s) => s.in_answer(),
            Self::Harmony(s) => s.in_answer(),
        }
    }

    /// Takes the next piece of text (`last`: the output ended); returns what it releases.
    pub fn push(&mut self, text: &str, last: bool) -> SplitStep {
        match self {
            Self::Think(s) => s.push(text, last),
            Self::Harmony(s) => s.push(text, last),
        }
    }
}

/// The split of one `<think>` output as it streams.
#[derive(Clone, Debug)]
pub struct ThinkSplit {
    phase: Phase,
    /// Text received but not yet released (a possible marker prefix).
    held: String,
}

/// What one pushed piece releases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SplitStep {
    pub reasoning: String,
    pub answer: String,
}

impl ThinkSplit {
    fn new(start: Start) -> Self {
        let phase = match start {
            Start::Reasoning => Phase::ReasoningStart,
            Start::Undecided | Start::Harmony(_) => Phase::Undecided,
        };
        Self { phase, held: String::new() }
    }

    fn in_answer(&self) -> bool {
        matches!(self.phase, Phase::Answer | Phase::AnswerStart)
    }

    fn push(&mut self, text: &str, last: bool) -> SplitStep {
        self.held.push_str(text);
        let mut step = SplitStep::default();
        loop {
            match self.phase {
                Phase::Undecided | Phase::ReasoningStart => {
                    let trimmed = self.held.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.held = rest.to_owned();
                        self.phase = Phase::Reasoning;
                    } else if OPEN.starts_with(trimmed) && !last {
                        return step;
                    } else if self.phase == Phase::ReasoningStart {
                        self.phase = Phase::Reasoning;
                    } else {
                        self.phase = Phase::Answer;
                    }
                }
                Phase::Reasoning => {
                    if let Some(at) = self.held.find(CLOSE) {
                        step.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.phase = Phase::AnswerStart;
                        continue;
                    }
                    let keep = if last { 0 } else { marker_prefix_len(&self.held, CLOSE) };
                    let release = self.held.len() - keep;
                    step.reasoning.push_str(&self.held[..release]);
                    self.held.drain(..release);
                    return step;
                }
                Phase::AnswerStart => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty() {
                        self.held.clear();
                        return step;
                    }
                    self.held = trimmed.to_owned();
                    self.phase = Phase::Answer;
                }
                Phase::Answer => {
                    step.answer.push_str(&self.held);
                    self.held.clear();
                    return step;
                }
            }
        }
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `marker`.
fn marker_prefix_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` streamed in pieces of `piece` characters, joined.
    fn streamed(start: Start, text: &str, piece: usize) -> SplitStep {
        let chars: Vec<char> = text.chars().collect();
        let pieces: Vec<String> = chars.chunks(piece).map(|c| c.iter().collect()).collect();
        let mut split = ReasoningSplit::new(start);
        let mut all = SplitStep::default();
        for (i, p) in pieces.iter().enumerate() {
            let step = split.push(p, i + 1 == pieces.len());
            all.reasoning.push_str(&step.reasoning);
            all.answer.push_str(&step.answer);
        }
        all
    }

    fn split(reasoning: &str, answer: &str) -> SplitStep {
        SplitStep { reasoning: reasoning.into(), answer: answer.into() }
    }

    #[test]
    fn outputs_split_the_same_whole_and_streamed() {
        for (start, text, want) in [
            (
                Start::Reasoning,
                "Let me see.\n</think>\n\nIt is 4.",
                split("Let me see.\n", "It is 4."),
            ),
            (Start::Undecided, "<think>\nhm</think>4", split("\nhm", "4")),
            (
                Start::Undecided,
                "  <think>a < b </thi</think>  x</think>",
                split("a < b </thi", "x</think>"),
            ),
            (
                Start::Undecided,
                "Just the answer, <think> inside.",
                split("", "Just the answer, <think> inside."),
            ),
            (Start::Undecided, "<thin", split("", "<thin")),
            (
                Start::Reasoning,
                "cut short by max_tokens </thi",
                split("cut short by max_tokens </thi", ""),
            ),
            (Start::Reasoning, "é</think>ü", split("é", "ü")),
            (Start::Reasoning, "</think>", split("", "")),
            // A model that opens the thinking the prompt already opened.
            (Start::Reasoning, "<think>\nhm</think>ok", split("\nhm", "ok")),
            (Start::Reasoning, " <thi", split(" <thi", "")),
        ] {
            assert_eq!(ReasoningSplit::whole(start, text), want, "{text:?}");
            for piece in [1, 2, 3, 5, 100] {
                assert_eq!(streamed(start, text, piece), want, "{text:?} / {piece}");
            }
        }
    }

    #[test]
    fn the_prompt_decides_where_the_output_starts() {
        let qwen = ReasoningParser::Qwen3;
        let r1 = ReasoningParser::DeepSeekR1;
        assert_eq!(qwen.start("<|im_start|>assistant\n<think>\n"), Start::Reasoning);
        assert_eq!(qwen.start("<|im_start|>assistant\n"), Start::Undecided);
        assert_eq!(qwen.start("<|im_start|>assistant\n<think>\n\n</think>\n\n"), Start::Undecided);
        assert_eq!(r1.start("<｜Assistant｜>"), Start::Reasoning);
        assert_eq!(r1.start("<｜Assistant｜><think>\n\n</think>"), Start::Undecided);
        assert_eq!(ReasoningParser::from_name("deepseek_r1"), Some(r1));
        assert_eq!(ReasoningParser::from_name("granite"), None);
    }
}
