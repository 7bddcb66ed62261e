//! The `tojson` filter as transformers defines it for chat templates: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, with
//! those four arguments accepted positionally (in that order) or by keyword.
//!
//! Python's output, not serde_json's: separators `", "` / `": "` (`","` / `": "` with an
//! indent), floats as Python's `repr` (`1.0`, `1e+20`, `2.5e-07`, `NaN`, `Infinity`), strings
//! escaping only `"`, `\`, and control characters (everything outside printable ASCII with
//! `ensure_ascii`), and no HTML escaping (minijinja's own `tojson` escapes `<>&'`).
//!
//! Invariants: nesting deeper than [`MAX_DEPTH`] is an error, so a template cannot recurse
//! the writer off the stack; map keys serialize in the value's own iteration order unless
//! `sort_keys` (by their JSON key text).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Deepest nesting of lists / maps `tojson` writes.
const MAX_DEPTH: usize = 256;

struct Options {
    ensure_ascii: bool,
    /// The indent unit; `None` writes everything on one line.
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// `value | tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
#[allow(clippy::needless_pass_by_value)] // minijinja hands `Kwargs` over by value
pub(super) fn tojson(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(Error::from(ErrorKind::TooManyArguments));
    }
    let arg = |name: &str| -> Result<Option<Value>, Error> {
        let positional = NAMES.iter().position(|n| *n == name).and_then(|i| args.get(i)).cloned();
        let keyword: Option<Value> = kwargs.get(name)?;
        match (positional, keyword) {
            (Some(_), Some(_)) => Err(invalid(format!("tojson got multiple values for `{name}`"))),
            (p, k) => Ok(p.or(k)),
        }
    };
    let ensure_ascii = arg("ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match arg("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.as_str().is_some() => v.as_str().map(str::to_owned),
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| invalid("tojson indent must be an int or str"))?;
            Some(" ".repeat(usize::try_from(n).unwrap_or(0).min(64)))
        }
    };
    let (item_separator, key_separator) = match arg("separators")? {
        Some(v) if !v.is_none() => {
            let pair: Vec<Value> = v.try_iter()?.collect();
            match pair.as_slice() {
                [item, key] => match (item.as_str(), key.as_str()) {
                    (Some(item), Some(key)) => (item.to_owned(), key.to_owned()),
                    _ => return Err(invalid("tojson separators must be two strings")),
                },
                _ => return Err(invalid("tojson separators must be two strings")),
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let sort_keys = arg("sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let options = Options { ensure_ascii, indent, item_separator, key_separator, sort_keys };
    let mut out = String::new();
    write_value(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

fn invalid(message: impl Into<std::borrow::Cow<'static, str>>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

fn write_value(out: &mut String, value: &Value, opts: &Options, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => {
            let _ = write!(out, "{value}");
        }
        ValueKind::Number => {
            let f = f64::try_from(value.clone())?;
            out.push_str(&python_float_repr(f));
        }
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), &items, opts, depth, |out, item, depth| {
                write_value(out, item, opts, depth)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_text(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, ('{', '}'), &entries, opts, depth, |out, (key, item), depth| {
                write_string(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_separator);
                write_value(out, item, opts, depth)
            })?;
        }
        kind => return Err(invalid(format!("Object of type {kind} is not JSON serializable"))),
    }
    Ok(())
}

/// `open items close`, items separated and indented as `opts` says.
fn write_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: &[T],
    opts: &Options,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    if depth >= MAX_DEPTH {
        return Err(invalid(format!("tojson: nesting deeper than {MAX_DEPTH}")));
    }
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(unit) = &opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(unit);
            }
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        newline(out, depth + 1);
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// A map key as Python's json writes it: strings as they are, numbers, booleans and `None`
/// as their JSON text.
fn key_text(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => python_float_repr(f64::try_from(key.clone())?),
        kind => {
            return Err(invalid(format!("keys must be str, int, float, bool or None, not {kind}")));
        }
    })
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for exponents in
/// `-4..16` (always with a fractional part), else `d.ddde±XX`.
pub(super) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let scientific = format!("{f:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let mut s = format!("{f}");
        if !s.contains('.') {
            s.push_str(".0");
        }
        s
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
    }
}
