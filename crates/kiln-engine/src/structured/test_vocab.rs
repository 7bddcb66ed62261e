//! A toy vocabulary for structured-output tests: single characters, multi-character tokens
//! that cross JSON's lexeme boundaries (`{"`, `":`, `, "`, `"}`), words, a padding row with no
//! bytes and an end-of-sequence token last.

use super::{Constraint, GrammarCompiler, StructuredOutput};

/// The tokens' texts, by id (the padding row is `""`, EOS `<eos>`).
pub(crate) const TOKENS: &[&str] = &[
    "0", "1", "2", "5", "9", "00", "12", ".", "-", "a", "b", "c", "ab", "abc", "New", " York",
    "\"", "\"a", "a\"", "\":", "{", "}", "{\"", "\"}", ":", ",", ", \"", " ", "\n", "[", "]",
    "true", "false", "null", "e", "x", "yz", "name", "city", "age", "tags", "",
];

/// The compiler over [`TOKENS`] plus EOS (the last id).
pub(crate) fn compiler() -> GrammarCompiler {
    let eos = TOKENS.len() as u32;
    let mut bytes: Vec<Vec<u8>> = TOKENS.iter().map(|t| t.as_bytes().to_vec()).collect();
    bytes.push(vec![0xFF, b'E']);
    GrammarCompiler::new(bytes, TOKENS.len() + 1, &[eos]).unwrap()
}

/// One spec of each kind, with bounded strings, numbers, arrays and alternatives.
pub(crate) fn specs() -> Vec<StructuredOutput> {
    let schema = r#"{"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4},
        "city": {"type": "string", "minLength": 2, "maxLength": 9},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["ab", "c"]}, "maxItems": 2}},
        "required": ["name", "city", "age", "tags"]}"#;
    vec![
        StructuredOutput::JsonSchema(schema.into()),
        StructuredOutput::JsonObject,
        StructuredOutput::Regex("[a-c]{1,5}(x|yz)?".into()),
        StructuredOutput::Choice(vec!["abc".into(), "New York".into(), "ab".into()]),
        StructuredOutput::Grammar("start: \"{\" item (\",\" item)* \"}\"\nitem: /[a-e]+/".into()),
    ]
}

/// A fresh constraint for `spec`.
pub(crate) fn constraint(spec: &StructuredOutput) -> Constraint {
    compiler().compile(spec).unwrap()
}
