//! GBNF (llama.cpp's grammar format, also what vLLM's xgrammar backend reads) rewritten as
//! the Lark syntax llguidance compiles.
//!
//! GBNF: rules `name ::= body`, the start rule `root`; string literals with `\n \r \t \\ \"
//! \xHH \uHHHH \UHHHHHHHH` escapes; character classes `[a-z]` and `[^...]`; `.` for any
//! character; grouping, `|`, `* + ?` and `{m}`, `{m,}`, `{m,n}`, `{,n}`; `#` comments.
//!
//! Invariants: the rewrite is token for token (the grammar's structure is unchanged, only
//! spelled in Lark): names become lowercase Lark rules under an injective mapping (`Foo-bar`
//! and `foo_bar` cannot meet), literals become JSON strings, classes and `.` become regexes
//! whose characters are all escaped; an empty alternative becomes `""`. A reference to an
//! undefined rule, a second definition, a missing `root` or a malformed token is an error
//! naming it.

use std::collections::HashSet;
use std::fmt::Write;

/// One lexical token of a GBNF grammar.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Name(String),
    Define,
    /// A string literal, decoded.
    Literal(String),
    /// A character class: negated, then its items (a char or an inclusive range).
    Class(bool, Vec<(char, char)>),
    Any,
    Open,
    Close,
    Bar,
    /// `*`, `+` or `?`.
    Op(char),
    /// `{m}`, `{m,}`, `{m,n}` or `{,n}`, as written (digits and a comma).
    Repeat(String),
}

/// The Lark grammar of a GBNF grammar, or what is wrong with it.
pub fn to_lark(gbnf: &str) -> Result<String, String> {
    let tokens = lex(gbnf)?;
    // A rule starts at a name followed by `::=`; its body runs to the next such pair.
    let starts: Vec<usize> = (0..tokens.len())
        .filter(|&i| matches!(tokens[i], Tok::Name(_)) && tokens.get(i + 1) == Some(&Tok::Define))
        .collect();
    match starts.first() {
        None => return Err("no rule (`name ::= ...`) found".into()),
        Some(&0) => {}
        Some(_) => return Err("the grammar must start with a rule (`name ::= ...`)".into()),
    }
    let mut defined = HashSet::new();
    let mut rules = Vec::with_capacity(starts.len());
    for (k, &start) in starts.iter().enumerate() {
        let Tok::Name(name) = &tokens[start] else { unreachable!("starts are names") };
        if !defined.insert(name.clone()) {
            return Err(format!("rule `{name}` is defined twice"));
        }
        let end = starts.get(k + 1).copied().unwrap_or(tokens.len());
        rules.push((name.clone(), &tokens[start + 2..end]));
    }
    if !defined.contains("root") {
        return Err("the grammar has no `root` rule".into());
    }
    let mut lark = format!("start: {}\n", rule_name("root"));
    for (name, body) in rules {
        write!(lark, "{}:", rule_name(&name)).map_err(|e| e.to_string())?;
        let mut depth = 0usize;
        let mut previous: Option<&Tok> = None;
        for tok in body {
            // An empty alternative (at a body's start, after `(` or `|`, before `|` or `)`).
            let opens = matches!(previous, None | Some(Tok::Open | Tok::Bar));
            if opens && matches!(tok, Tok::Bar | Tok::Close) {
                lark.push_str(" \"\"");
            }
            if matches!(tok, Tok::Op(_) | Tok::Repeat(_))
                && (opens || previous == Some(&Tok::Define))
            {
                return Err(format!("in rule `{name}`: a repetition with nothing to repeat"));
            }
            match tok {
                Tok::Name(n) if !defined.contains(n) => {
                    return Err(format!("in rule `{name}`: rule `{n}` is not defined"));
                }
                Tok::Name(n) => write!(lark, " {}", rule_name(n)).map_err(|e| e.to_string())?,
                Tok::Define => return Err(format!("in rule `{name}`: a stray `::=`")),
                Tok::Literal(s) => {
                    lark.push(' ');
                    lark.push_str(&serde_json::to_string(s).map_err(|e| e.to_string())?);
                }
                Tok::Class(negated, items) => {
                    lark.push_str(" /[");
                    if *negated {
                        lark.push('^');
                    }
                    for &(lo, hi) in items {
                        push_escaped(&mut lark, lo);
                        if hi != lo {
                            lark.push('-');
                            push_escaped(&mut lark, hi);
                        }
                    }
                    lark.push_str("]/");
                }
                Tok::Any => lark.push_str(" /(?s:.)/"),
                Tok::Open => {
                    depth += 1;
                    lark.push_str(" (");
                }
                Tok::Close => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or_else(|| format!("in rule `{name}`: an unmatched `)`"))?;
                    lark.push_str(" )");
                }
                Tok::Bar => lark.push_str(" |"),
                Tok::Op(op) => lark.push(*op),
                Tok::Repeat(r) => write!(lark, "{{{r}}}").map_err(|e| e.to_string())?,
            }
            previous = Some(tok);
        }
        if matches!(previous, None | Some(Tok::Bar)) {
            lark.push_str(" \"\"");
        }
        if depth > 0 {
            return Err(format!("in rule `{name}`: an unclosed `(`"));
        }
        lark.push('\n');
    }
    Ok(lark)
}

/// The Lark rule of GBNF name `name`: lowercase, `-` as `_d`, an uppercase letter `X` as
/// `_ux` (GBNF names have no `_`, so the mapping is injective).
fn rule_name(name: &str) -> String {
    let mut out = String::from("g_");
    for c in name.chars() {
        match c {
            '-' => out.push_str("_d"),
            c if c.is_ascii_uppercase() => {
                out.push_str("_u");
                out.push(c.to_ascii_lowercase());
            }
            c => out.push(c),
        }
    }
    out
}

/// `c` inside a regex character class: ASCII letters, digits and space as they are, every
/// other character as `\x{..}` (never a class metacharacter or a `/` ending the regex).
fn push_escaped(out: &mut String, c: char) {
    if c.is_ascii_alphanumeric() || c == ' ' {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

fn lex(src: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = src.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '"' => {
                let (text, next) = literal(&chars, i + 1)?;
                tokens.push(Tok::Literal(text));
                i = next;
            }
            '[' => {
                let (class, next) = class(&chars, i + 1)?;
                tokens.push(class);
                i = next;
            }
            '.' => {
                tokens.push(Tok::Any);
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                tokens.push(match c {
                    '(' => Tok::Open,
                    ')' => Tok::Close,
                    '|' => Tok::Bar,
                    op => Tok::Op(op),
                });
                i += 1;
            }
            '{' => {
                let end = chars[i..].iter().position(|&c| c == '}').map(|p| i + p);
                let end = end.ok_or("an unclosed `{`")?;
                let inner: String =
                    chars[i + 1..end].iter().filter(|c| !c.is_whitespace()).collect();
                let valid = !inner.is_empty()
                    && inner != ","
                    && inner.chars().all(|c| c.is_ascii_digit() || c == ',')
                    && inner.matches(',').count() <= 1;
                if !valid {
                    return Err(format!(
                        "`{{{inner}}}` is not a repetition ({{m}}, {{m,}}, {{m,n}}, {{,n}})"
                    ));
                }
                tokens.push(Tok::Repeat(inner));
                i = end + 1;
            }
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                tokens.push(Tok::Define);
                i += 3;
            }
            c if c.is_ascii_alphanumeric() || c == '-' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '-') {
                    i += 1;
                }
                tokens.push(Tok::Name(chars[start..i].iter().collect()));
            }
            other => return Err(format!("unexpected character {other:?}")),
        }
    }
    Ok(tokens)
}

/// The character of an escape starting after a backslash at `chars[i]`; and the index after.
fn escape(chars: &[char], i: usize) -> Result<(char, usize), String> {
    let Some(&c) = chars.get(i) else { return Err("a `\\` at the end".into()) };
    let hex = |digits: usize| -> Result<(char, usize), String> {
        let text: String = chars.get(i + 1..i + 1 + digits).unwrap_or_default().iter().collect();
        u32::from_str_radix(&text, 16)
            .ok()
            .filter(|_| text.len() == digits)
            .and_then(char::from_u32)
            .map(|c| (c, i + 1 + digits))
            .ok_or_else(|| format!("`\\{c}{text}` is not a valid escape"))
    };
    match c {
        'n' => Ok(('\n', i + 1)),
        'r' => Ok(('\r', i + 1)),
        't' => Ok(('\t', i + 1)),
        'x' => hex(2),
        'u' => hex(4),
        'U' => hex(8),
        '\\' | '"' | '[' | ']' | '-' | '^' => Ok((c, i + 1)),
        other => Err(format!("`\\{other}` is not a valid escape")),
    }
}

/// A string literal whose text starts at `chars[i]`; its text and the index after it.
fn literal(chars: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut text = String::new();
    loop {
        match chars.get(i) {
            None => return Err("an unclosed string literal".into()),
            Some('"') => return Ok((text, i + 1)),
            Some('\\') => {
                let (c, next) = escape(chars, i + 1)?;
                text.push(c);
                i = next;
            }
            Some(&c) => {
                text.push(c);
                i += 1;
            }
        }
    }
}

/// A character class whose items start at `chars[i]`; the token and the index after it.
fn class(chars: &[char], mut i: usize) -> Result<(Tok, usize), String> {
    let negated = chars.get(i) == Some(&'^');
    if negated {
        i += 1;
    }
    let mut items = Vec::new();
    let read = |i: usize| -> Result<(char, usize), String> {
        match chars.get(i) {
            None => Err("an unclosed character class".into()),
            Some('\\') => escape(chars, i + 1),
            Some(&c) => Ok((c, i + 1)),
        }
    };
    loop {
        match chars.get(i) {
            None => return Err("an unclosed character class".into()),
            Some(']') => break,
            _ => {}
        }
        let (lo, next) = read(i)?;
        i = next;
        if chars.get(i) == Some(&'-') && chars.get(i + 1).is_some_and(|&c| c != ']') {
            let (hi, next) = read(i + 1)?;
            if hi < lo {
                return Err(format!("the range {lo:?}-{hi:?} is reversed"));
            }
            items.push((lo, hi));
            i = next;
        } else {
            items.push((lo, lo));
        }
    }
    if items.is_empty() {
        return Err("an empty character class".into());
    }
    Ok((Tok::Class(negated, items), i + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grammar_is_rewritten_token_for_token() {
        let gbnf = r#"
            # a list of moves
            root   ::= move ("," ws? move){0,3} tail
            move   ::= [a-h] [1-8] | "O-O" | piece-X
            piece-X ::= [^\n\]"] .
            ws ::= [ \t]+
            tail ::= "\u00e9\x41\"" |
        "#;
        let lark = to_lark(gbnf).unwrap();
        let expected = "start: g_root\n\
            g_root: g_move ( \",\" g_ws? g_move ){0,3} g_tail\n\
            g_move: /[a-h]/ /[1-8]/ | \"O-O\" | g_piece_d_ux\n\
            g_piece_d_ux: /[^\\x{a}\\x{5d}\\x{22}]/ /(?s:.)/\n\
            g_ws: /[ \\x{9}]/+\n\
            g_tail: \"éA\\\"\" | \"\"\n";
        assert_eq!(lark, expected);
    }

    #[test]
    fn malformed_grammars_are_refused_with_what_is_wrong() {
        for (gbnf, why) in [
            ("item ::= \"a\"", "no `root` rule"),
            ("root ::= item", "rule `item` is not defined"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            ("root ::= \"a", "unclosed string"),
            ("root ::= [a-", "unclosed character class"),
            ("root ::= [z-a]", "reversed"),
            ("root ::= (\"a\"", "unclosed `(`"),
            ("root ::= \"a\")", "unmatched `)`"),
            ("root ::= \"a\"{x}", "not a repetition"),
            ("root ::= * \"a\"", "nothing to repeat"),
            ("root ::= \"\\q\"", "not a valid escape"),
            ("root ::= \"a\" ; ", "unexpected character"),
            ("\"a\" root ::= \"a\"", "must start with a rule"),
            ("just text", "no rule"),
        ] {
            let e = to_lark(gbnf).unwrap_err();
            assert!(e.contains(why), "{gbnf}: {e}");
        }
    }

    #[test]
    fn names_map_injectively() {
        let names = ["a-b", "aB", "ab", "a-B", "A"];
        let mapped: HashSet<String> = names.iter().map(|n| rule_name(n)).collect();
        assert_eq!(mapped.len(), names.len());
    }
}
