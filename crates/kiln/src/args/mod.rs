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
//! Flag names may be written with underscores (`--max_model_len`, as vLLM accepts). For
//! `kiln serve`, the flags of `vllm serve` and `llama-server` that kiln does not define are then
//! handled by [`foreign`]: renamed to kiln's flag of the same meaning, accepted with one warning
//! when they mean nothing on this backend, or refused with a message naming what to use.
//! Everything else is left to clap (unknown flags are clap's errors).

pub mod config_file;
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
    let env_args = env::to_args(env, &flags, &mut warnings);
    let given = given_ids(&cli_args, &flags);
    let env_args = drop_given(env_args, &given, &flags);
    let given: HashSet<String> = given.union(&given_ids(&env_args, &flags)).cloned().collect();
    let config_args = drop_given(config_args, &given, &flags);
    let mut args: Vec<String> = config_args.into_iter().chain(env_args).chain(cli_args).collect();
    if path == ["serve"] {
        args = foreign::translate(args, &flags, &mut warnings)?;
    }
    let mut out: Vec<String> = argv[..depth].to_vec();
    out.extend(args);
    Ok(Expanded { argv: out, warnings })
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
