//! `KILN_ARG_<FLAG>` environment variables as command-line flags (llama-server's
//! `LLAMA_ARG_*`): the name is the long flag upper-cased with `_` for `-`
//! (`KILN_ARG_MAX_NUM_SEQS=64` is `--max-num-seqs 64`). On/off flags take `1`/`true`/`on`/`yes`
//! (set) or `0`/`false`/`off`/`no` (not set); list flags take comma-separated values. A
//! variable naming no flag of the subcommand gets a warning.
//!
//! Every value is attached to its flag (`--api-key=secret`, one `--flag=value` per list
//! item), so a value is never read as a flag (`--x`) and never takes in the command line's
//! positional arguments (`KILN_ARG_API_KEY=k kiln serve model.gguf` serves `model.gguf`).
//!
//! vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is read the same way, as
//! `--allow-runtime-lora-updating`.

use super::Flags;

pub const PREFIX: &str = "KILN_ARG_";

/// vLLM's environment variables that kiln reads, with the flag each one sets.
pub const VLLM_VARS: [(&str, &str); 1] =
    [("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "allow-runtime-lora-updating")];

/// Whether `key` is a variable [`to_args`] reads.
pub fn is_read(key: &str) -> bool {
    key.starts_with(PREFIX) || VLLM_VARS.iter().any(|(var, _)| *var == key)
}

/// The flags `env` sets, in a stable (sorted) order.
pub fn to_args(env: &[(String, String)], flags: &Flags, warnings: &mut Vec<String>) -> Vec<String> {
    let mut vars: Vec<&(String, String)> = env.iter().filter(|(k, _)| is_read(k)).collect();
    vars.sort();
    let mut args = Vec::new();
    for (key, value) in vars {
        let name = match VLLM_VARS.iter().find(|(var, _)| var == key) {
            Some((_, flag)) => (*flag).to_owned(),
            None => key[PREFIX.len()..].to_ascii_lowercase().replace('_', "-"),
        };
        let Some(flag) = flags.get(&name) else {
            warnings.push(format!("{key} names no flag of this command (--{name}); ignored"));
            continue;
        };
        if !flag.takes_value {
            match value.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "on" | "yes" | "" => args.push(format!("--{name}")),
                "0" | "false" | "off" | "no" => {}
                other => {
                    warnings.push(format!("{key}={other}: expected 1/true or 0/false; ignored"));
                }
            }
            continue;
        }
        if flag.multiple {
            let values = value.split(',').map(str::trim).filter(|v| !v.is_empty());
            args.extend(values.map(|v| format!("--{name}={v}")));
        } else {
            args.push(format!("--{name}={value}"));
        }
    }
    args
}
