//! Python call syntax as tool calls: `[get_weather(city="Paris", days=3), now()]`, the format
//! of vLLM's `pythonic` parser (Llama 3.2 / 4, and the Gemma 3 tool template kiln ships).
//! Also accepted: one call without the brackets, a `print(...)` around a call, and Gemma's
//! Markdown fence ```` ```tool_code ... ``` ```` around either.
//!
//! Arguments are keyword arguments whose values are Python literals (strings in single, double
//! or triple quotes with escapes, ints, floats, `True` / `False` / `None`, lists, tuples,
//! dicts with literal keys); they become a JSON object, in the order written. Anything else
//! (an expression, a positional argument) makes the whole text not a tool call.
//!
//! Invariants: never panics on any input (it is model output); nesting deeper than
//! [`MAX_DEPTH`] is refused, so hostile text cannot recurse off the stack.

use serde_json::{Map, Number, Value};

use super::ToolCall;

/// Deepest nesting of literal lists / dicts.
const MAX_DEPTH: usize = 64;

/// The calls of `text`, or `None` when it is not (wholly) Python call syntax.
pub fn parse_calls(text: &str) -> Option<Vec<ToolCall>> {
    let body = strip_fence(text.trim())?.trim();
    let mut p = Parser { s: body.as_bytes(), i: 0 };
    let calls = if body.starts_with('[') {
        p.i += 1;
        let calls = p.sequence(b']', Parser::call)?;
        if calls.is_empty() {
            return None;
        }
        calls
    } else {
        vec![p.call()?]
    };
    p.ws();
    (p.i == p.s.len()).then_some(calls)
}

/// `text` without a ```` ```tool_code ```` (or ```` ```python ````) fence around it.
fn strip_fence(text: &str) -> Option<&str> {
    let Some(rest) = text.strip_prefix("```") else {
        return Some(text);
    };
    let rest = rest.strip_prefix("tool_code").or_else(|| rest.strip_prefix("python"))?;
    rest.trim_end().strip_suffix("```")
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn ident(&mut self) -> Option<String> {
        self.ws();
        let start = self.i;
        while self
            .s
            .get(self.i)
            .is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.')
        {
            self.i += 1;
        }
        let name = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        (!name.is_empty() && !name.as_bytes()[0].is_ascii_digit()).then(|| name.to_owned())
    }

    /// Items separated by commas up to `close` (a trailing comma allowed); the opening bracket
    /// is already consumed.
    fn sequence<T>(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Option<T>,
    ) -> Option<Vec<T>> {
        let mut items = Vec::new();
        loop {
            if self.eat(close) {
                return Some(items);
            }
            items.push(item(self)?);
            if !self.eat(b',') {
                return self.eat(close).then_some(items);
            }
        }
    }

    /// `name(key=literal, ...)`, or `print(call)`.
    fn call(&mut self) -> Option<ToolCall> {
        let name = self.ident()?;
        if !self.eat(b'(') {
            return None;
        }
        if name == "print" {
            let call = self.call()?;
            return self.eat(b')').then_some(call);
        }
        let args = self.sequence(b')', |p| {
            let key = p.ident()?;
            if !p.eat(b'=') {
                return None;
            }
            Some((key, p.literal(0)?))
        })?;
        let arguments: Map<String, Value> = args.into_iter().collect();
        Some(ToolCall { name, arguments: Value::Object(arguments).to_string() })
    }

    fn literal(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        match *self.s.get(self.i)? {
            b'"' | b'\'' => self.string().map(Value::String),
            b'[' | b'(' => {
                let close = if self.s[self.i] == b'[' { b']' } else { b')' };
                self.i += 1;
                self.sequence(close, |p| p.literal(depth + 1)).map(Value::Array)
            }
            b'{' => {
                self.i += 1;
                let pairs = self.sequence(b'}', |p| {
                    let key = match p.literal(depth + 1)? {
                        Value::String(s) => s,
                        Value::Number(n) => n.to_string(),
                        Value::Bool(b) => if b { "True" } else { "False" }.to_owned(),
                        _ => return None,
                    };
                    if !p.eat(b':') {
                        return None;
                    }
                    Some((key, p.literal(depth + 1)?))
                })?;
                Some(Value::Object(pairs.into_iter().collect()))
            }
            b'-' | b'+' | b'.' | b'0'..=b'9' => self.number(),
            _ => match self.ident()?.as_str() {
                "True" | "true" => Some(Value::Bool(true)),
                "False" | "false" => Some(Value::Bool(false)),
                "None" | "null" => Some(Value::Null),
                _ => None,
            },
        }
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.i;
        while self.s.get(self.i).is_some_and(|&c| {
            c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E' | b'_')
        }) {
            self.i += 1;
        }
        let text: String = std::str::from_utf8(&self.s[start..self.i])
            .ok()?
            .chars()
            .filter(|&c| c != '_')
            .collect();
        if let Ok(i) = text.parse::<i64>() {
            return Some(Value::Number(i.into()));
        }
        let f: f64 = text.parse().ok()?;
        Number::from_f64(f).map(Value::Number)
    }

    /// A quoted string (single, double or triple quotes; an `r` prefix is not supported) with
    /// Python's escapes.
    fn string(&mut self) -> Option<String> {
        let quote = self.s[self.i];
        let triple = self.s.get(self.i..self.i + 3) == Some(&[quote; 3]);
        self.i += if triple { 3 } else { 1 };
        let mut out = Vec::new();
        loop {
            let c = *self.s.get(self.i)?;
            if c == quote && (!triple || self.s.get(self.i..self.i + 3) == Some(&[quote; 3])) {
                self.i += if triple { 3 } else { 1 };
                return String::from_utf8(out).ok();
            }
            if c == b'\n' && !triple {
                return None;
            }
            self.i += 1;
            if c != b'\\' {
                out.push(c);
                continue;
            }
            let e = *self.s.get(self.i)?;
            self.i += 1;
            let simple = match e {
                b'n' => Some(b'\n'),
                b't' => Some(b'\t'),
                b'r' => Some(b'\r'),
                b'0' => Some(0),
                b'\\' | b'\'' | b'"' => Some(e),
                b'\n' => continue,
                _ => None,
            };
            if let Some(byte) = simple {
                out.push(byte);
                continue;
            }
            let digits = match e {
                b'x' => 2,
                b'u' => 4,
                b'U' => 8,
                _ => {
                    out.extend_from_slice(&[b'\\', e]);
                    continue;
                }
            };
            let hex = std::str::from_utf8(self.s.get(self.i..self.i + digits)?).ok()?;
            self.i += digits;
            let ch = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
            out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn calls(text: &str) -> Option<Vec<(String, Value)>> {
        parse_calls(text).map(|calls| {
            calls
                .into_iter()
                .map(|c| (c.name, serde_json::from_str(&c.arguments).unwrap()))
                .collect()
        })
    }

    #[test]
    fn lists_of_calls_with_python_literals() {
        let got = calls(
            r#"[get_weather(city="Paris", days=3, metric=True), search(q='it\'s', tags=["a", 'b'], opts={"x": None, 'y': 1.5}), now()]"#,
        )
        .unwrap();
        assert_eq!(
            got,
            vec![
                ("get_weather".into(), json!({"city": "Paris", "days": 3, "metric": true})),
                (
                    "search".into(),
                    json!({"q": "it's", "tags": ["a", "b"], "opts": {"x": null, "y": 1.5}})
                ),
                ("now".into(), json!({})),
            ]
        );
    }

    #[test]
    fn fences_print_and_bare_calls() {
        let want = vec![("f".to_owned(), json!({"a": "x\ny", "b": -2}))];
        for text in [
            "```tool_code\nprint(f(a=\"x\\ny\", b=-2))\n```",
            "f(a='''x\ny''', b=-2)",
            "  [f(a=\"x\\u000ay\", b=-2,)]  ",
        ] {
            assert_eq!(calls(text), Some(want.clone()), "{text}");
        }
    }

    #[test]
    fn anything_else_is_not_a_call() {
        for text in [
            "",
            "[]",
            "Hello there.",
            "f(1, 2)",
            "f(a=b)",
            "f(a=1) and more",
            "[f(a=1)",
            "f(a=\"unterminated)",
            "```tool_code\nf(a=1)",
            &format!("f(a={}{})", "[".repeat(100), "]".repeat(100)),
        ] {
            assert_eq!(calls(text), None, "{text}");
        }
    }
}
