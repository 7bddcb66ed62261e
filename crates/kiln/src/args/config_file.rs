//! `--config FILE.yaml`: a YAML mapping of flag names (with `-` or `_`) to values, as vLLM's
//! config files:
//!
//! ```yaml
//! model: Qwen/Qwen3-0.6B
//! port: 8001
//! max-model-len: 32k
//! enable-prefix-caching: true
//! served-model-name: [qwen, default]
//! ```
//!
//! `true` sets an on/off flag, `false` sets its `--no-` form where there is one (else nothing);
//! a list gives the flag several values; a mapping is passed as JSON text. Flags given on the
//! command line or in `KILN_ARG_*` win over the file's. Values are attached to their flags
//! (`--served-model-name=qwen`, once per list item), so none is read as a flag or takes in the
//! command line's positional arguments.

use serde_norway::Value;

use super::Flags;

/// The flags of the config file at `path`.
pub fn to_args(path: &str, flags: &Flags) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("--config {path}: {e}"))?;
    parse(&text, flags).map_err(|e| format!("--config {path}: {e}"))
}

/// The flags of a config file's text.
pub fn parse(text: &str, flags: &Flags) -> Result<Vec<String>, String> {
    let value: Value = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    let map = match value {
        Value::Mapping(map) => map,
        Value::Null => return Ok(Vec::new()),
        _ => return Err("expected a mapping of flag names to values".into()),
    };
    let mut args = Vec::new();
    for (key, value) in map {
        let Some(key) = key.as_str() else {
            return Err(format!("keys must be flag names, got {key:?}"));
        };
        let name = key.trim_start_matches('-').replace('_', "-");
        match value {
            Value::Null => {}
            Value::Bool(true) => args.push(format!("--{name}")),
            Value::Bool(false) => {
                let negated = format!("no-{name}");
                if flags.get(&negated).is_some() {
                    args.push(format!("--{negated}"));
                }
            }
            Value::Sequence(items) => {
                for item in items {
                    let v = scalar(&item)
                        .ok_or_else(|| format!("`{key}`: list items must be scalars"))?;
                    args.push(format!("--{name}={v}"));
                }
            }
            Value::Mapping(_) => {
                let json = serde_json::to_string(&value).map_err(|e| format!("`{key}`: {e}"))?;
                args.push(format!("--{name}={json}"));
            }
            other => {
                let v = scalar(&other).ok_or_else(|| format!("`{key}`: unsupported value"))?;
                args.push(format!("--{name}={v}"));
            }
        }
    }
    Ok(args)
}

fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}
