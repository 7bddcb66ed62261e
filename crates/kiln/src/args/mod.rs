//! Where a subcommand's arguments come from before clap parses them, and the flags of other
//! servers (vLLM, llama-server) that kiln understands or explains.
//!
//! [`expand`] turns the process arguments into the ones clap sees, in this order of precedence
//! (a flag given by a stronger source drops the weaker source's value):
//! 1. the command line;
//! 2. environment variables `KILN_ARG_<FLAG>` (`KILN_ARG_MAX_MODEL_LEN=32k` is
//!    `--max-model-len 32k`; for on/off flags `1`/`true`/`on` sets it, `0`/`false`/`off` not),
//!    as llama-server's `LLAMA_ARG_*` ([`env`]);
//! 3. `--config FILE.yaml`, a mapping of flag names to values as vLLM's ([`config_file`]).
//!
//! The command line's positional MODEL counts as its `--model`. Values from the environment
//! and the file are attached to their flags (`--api-key=KEY`) and placed after the command
//! line's arguments, so a value that looks like a flag stays a value and a list flag never
//! swallows the command line's positional model.
//!
//! Flag names may be written with underscores (`--max_model_len`, as vLLM accepts). For
//! `kiln serve`, the flags of `vllm serve` and `llama-server` that kiln does not define are then
//! handled by [`foreign`]: renamed to kiln's flag of the same meaning, accepted with one warning
//! when they mean nothing on this backend, or refused with a message naming what to use.
//! Everything else is left to clap (unknown flags are clap's errors).

pub mod config_file;
pub mod dtype;
pub mod env;
pub mod foreign;
pub mod vllm;

use std::collections::HashSet;

use clap::{ArgAction, Command};

/// The arguments clap is to parse, and the warnings to print first.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Expanded {
    pub argv: Vec<String>,
    pub warnings: Vec<String>,
}

/// What a subcommand knows about one of its long flags.
#[derive(Clone, Debug)]
pub(crate) struct FlagInfo {
    /// The arg's id (aliases share it).
    pub id: String,
    pub takes_value: bool,
    /// Values may repeat after the flag (`--served-model-name a b`).
    pub multiple: bool,
}

/// The long flags (names and aliases) of a subcommand.
#[derive(Clone, Debug, Default)]
pub(crate) struct Flags(Vec<(String, FlagInfo)>);

impl Flags {
    fn of(cmd: &Command) -> Self {
        let mut flags = Vec::new();
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            let action = arg.get_action();
            let takes_value = action.takes_values();
            let multiple = matches!(action, ArgAction::Append)
                || arg.get_num_args().is_some_and(|n| n.max_values() > 1);
            let info = FlagInfo { id: arg.get_id().to_string(), takes_value, multiple };
            flags.push((long.to_owned(), info.clone()));
            for alias in arg.get_all_aliases().into_iter().flatten() {
                flags.push((alias.to_owned(), info.clone()));
            }
        }
        Self(flags)
    }

    pub(crate) fn get(&self, long: &str) -> Option<&FlagInfo> {
        self.0.iter().find(|(name, _)| name == long).map(|(_, info)| info)
    }
}

/// Expands `argv` (the program name first) with `env` (`KILN_ARG_*` pairs; others are ignored)
/// and any `--config` file, for the subcommand of `cli` it names; see the module docs.
pub fn expand(
    argv: &[String],
    env: &[(String, String)],
    cli: &Command,
) -> Result<Expanded, String> {
    let (depth, sub) = subcommand(argv, cli);
    let Some(sub) = sub else {
        return Ok(Expanded { argv: argv.to_vec(), warnings: Vec::new() });
    };
    let flags = Flags::of(sub);
    let path: Vec<&str> = argv[1..depth].iter().map(String::as_str).collect();
    let mut warnings = Vec::new();
    let mut cli_args: Vec<String> = argv[depth..].iter().map(|a| normalize_flag(a)).collect();
    let config_args = match take_config(&mut cli_args)? {
        Some(file) if flags.get("config").is_some() => config_file::to_args(&file, &flags)?,
        Some(_) => return Err(format!("`kiln {}` takes no --config file", path.join(" "))),
        None => Vec::new(),
    };
    let mut env_args = env::to_args(env, &flags, &mut warnings);
    let mut config_args = config_args;
    if path == ["serve"] {
        cli_args = foreign::translate(cli_args, &flags, &mut warnings)?;
        env_args = foreign::translate(env_args, &flags, &mut warnings)?;
        config_args = foreign::translate(config_args, &flags, &mut warnings)?;
    }
    let mut given = given_ids(&cli_args, &flags);
    if has_positional(&cli_args, &flags) && flags.get("model").is_some() {
        // The positional MODEL is `--model` given on the command line.
        given.insert("model".to_owned());
    }
    let env_args = drop_given(env_args, &given, &flags);
    let given: HashSet<String> = given.union(&given_ids(&env_args, &flags)).cloned().collect();
    let config_args = drop_given(config_args, &given, &flags);
    // The merged flags go after the command line's own arguments (before a `--`), each value
    // attached to its flag: nothing of theirs can be read as a positional or take one in.
    let end = cli_args.iter().position(|a| a == "--").unwrap_or(cli_args.len());
    let mut out: Vec<String> = argv[..depth].to_vec();
    out.extend(cli_args[..end].iter().cloned());
    out.extend(config_args.into_iter().chain(env_args));
    out.extend(cli_args[end..].iter().cloned());
    Ok(Expanded { argv: out, warnings })
}

/// Whether `args` (a command line, foreign flags translated) holds a positional argument:
/// a word that is no flag's value, as clap reads it (a list flag takes every word up to the
/// next flag).
fn has_positional(args: &[String], flags: &Flags) -> bool {
    let mut it = args.iter().peekable();
    while let Some(arg) = it.next() {
        if arg == "--" {
            return it.next().is_some();
        }
        let Some(body) = arg.strip_prefix("--") else {
            if arg.starts_with('-') && arg != "-" {
                continue;
            }
            return true;
        };
        let Some(info) = flags.get(body) else { continue };
        if !info.takes_value {
            continue;
        }
        if info.multiple {
            while it.next_if(|v| !v.starts_with('-')).is_some() {}
        } else {
            it.next();
        }
    }
    false
}

/// How many leading arguments name the program and its subcommands, and the innermost
/// subcommand (`None` when no leaf subcommand is named, e.g. `kiln --help`).
fn subcommand<'a>(argv: &[String], cli: &'a Command) -> (usize, Option<&'a Command>) {
    let mut cmd = cli;
    let mut depth = 1;
    while let Some(next) = argv.get(depth).and_then(|a| cmd.find_subcommand(a)) {
        cmd = next;
        depth += 1;
    }
    let leaf = depth > 1 && !cmd.has_subcommands();
    (depth, leaf.then_some(cmd))
}

/// `--max_model_len=5` → `--max-model-len=5` (vLLM accepts either spelling).
fn normalize_flag(arg: &str) -> String {
    let Some(body) = arg.strip_prefix("--") else { return arg.to_owned() };
    let (name, value) = match body.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (body, None),
    };
    let name = name.replace('_', "-");
    match value {
        Some(v) => format!("--{name}={v}"),
        None => format!("--{name}"),
    }
}

/// Removes `--config FILE` / `--config=FILE` from `args` and returns the file.
fn take_config(args: &mut Vec<String>) -> Result<Option<String>, String> {
    let Some(at) = args.iter().position(|a| a == "--config" || a.starts_with("--config=")) else {
        return Ok(None);
    };
    let flag = args.remove(at);
    if let Some(file) = flag.strip_prefix("--config=") {
        return Ok(Some(file.to_owned()));
    }
    if at < args.len() {
        return Ok(Some(args.remove(at)));
    }
    Err("--config needs a file".into())
}

/// The ids of the long flags present in `args`.
fn given_ids(args: &[String], flags: &Flags) -> HashSet<String> {
    args.iter()
        .filter_map(|a| a.strip_prefix("--"))
        .filter_map(|a| flags.get(a.split('=').next().unwrap_or(a)))
        .map(|f| f.id.clone())
        .collect()
}

/// `args` (flag, then its values) without the flags whose id is in `given`.
fn drop_given(args: Vec<String>, given: &HashSet<String>, flags: &Flags) -> Vec<String> {
    let mut out = Vec::new();
    let mut dropping = false;
    for a in args {
        if let Some(name) = a.strip_prefix("--") {
            let id = flags.get(name.split('=').next().unwrap_or(name)).map(|f| f.id.as_str());
            dropping = id.is_some_and(|id| given.contains(id));
        }
        if !dropping {
            out.push(a);
        }
    }
    out
}
