//! The `kiln` command line: `kiln serve`, `kiln generate`, `kiln bench serve | latency |
//! throughput`, `kiln tune` and `kiln plan`.

mod args;
mod bench;
mod device;
mod engine_args;
mod generate;
mod hub;
mod kv_args;
mod kv_transfer_args;
mod lora_args;
mod memory_fit;
mod model_arg;
mod plan;
mod pooling_args;
mod prefix_persist;
mod serve;
mod tune;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kiln", version, about = "An LLM inference server")]
struct Cli {
    /// Kernel instruction set: scalar, avx2, avx512, avx512-vnni or amx (default: the best this
    /// CPU has). A path the CPU lacks is refused. Every path gives the same bits; this is for
    /// benchmarking and testing a lower path on a newer machine.
    #[arg(long, global = true, env = kiln_kernels::ISA_ENV, value_name = "ISA",
          value_parser = kiln_kernels::CpuIsa::parse)]
    isa: Option<kiln_kernels::CpuIsa>,
    /// Cache level the kernels' weight prefetches fill: l1 or l2 (default: l2 on Intel, l1
    /// elsewhere). Results are the same bits; this is for measuring.
    #[arg(long, global = true, env = kiln_kernels::PREFETCH_ENV, value_name = "LEVEL",
          value_parser = kiln_kernels::PrefetchLevel::parse)]
    prefetch: Option<kiln_kernels::PrefetchLevel>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for one prompt and stream it to stdout.
    Generate(Box<generate::GenerateArgs>),
    /// Serve the model on an OpenAI-compatible HTTP endpoint.
    Serve(Box<serve::ServeArgs>),
    /// Benchmarks: `serve` (online, HTTP), `latency` (batch grid), `throughput` (offline).
    Bench(Box<bench::BenchArgs>),
    /// Sweep server flags × load with `kiln bench serve`; pick the best for an objective.
    Tune(Box<tune::TuneArgs>),
    /// Capacity and speed planning: what fits in memory, predicted (and measured) tok/s.
    Plan(Box<plan::PlanArgs>),
}

/// Parses `argv` after [`args::expand`] (env variables, `--config`, other servers' flags);
/// returns the CLI and the warnings to print.
fn parse(argv: &[String], env: &[(String, String)]) -> Result<(Cli, Vec<String>), clap::Error> {
    let mut command = Cli::command();
    let expanded = args::expand(argv, env, &command)
        .map_err(|e| command.error(clap::error::ErrorKind::ValueValidation, e))?;
    let matches = command.try_get_matches_from_mut(&expanded.argv)?;
    let cli = Cli::from_arg_matches(&matches)?;
    Ok((cli, expanded.warnings))
}

fn main() -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect();
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| args::env::is_read(k))
        .collect();
    let cli = match parse(&argv, &env) {
        Ok((cli, warnings)) => {
            for w in warnings {
                eprintln!("warning: {w}");
            }
            cli
        }
        Err(e) => e.exit(),
    };
    let isa = cli.isa.unwrap_or_else(kiln_kernels::CpuIsa::best);
    if let Err(e) = isa.select() {
        eprintln!("error: --isa: {e}");
        return std::process::ExitCode::FAILURE;
    }
    if let Some(Err(e)) = cli.prefetch.map(kiln_kernels::PrefetchLevel::select) {
        eprintln!("error: --prefetch: {e}");
        return std::process::ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Generate(args) => generate::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Tune(args) => tune::run(&args),
        Command::Plan(args) => plan::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use kiln_kernels::CpuIsa;

    fn isa_of(line: &str) -> Result<Option<CpuIsa>, String> {
        let argv: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        super::parse(&argv, &[]).map(|(cli, _)| cli.isa).map_err(|e| e.to_string())
    }

    #[test]
    fn isa_flag_goes_before_or_after_the_subcommand_and_unknown_names_are_refused() {
        assert_eq!(isa_of("kiln --isa avx2 plan"), Ok(Some(CpuIsa::Avx2)));
        assert_eq!(isa_of("kiln serve --isa avx512-vnni"), Ok(Some(CpuIsa::Avx512Vnni)));
        assert_eq!(isa_of("kiln bench latency --isa scalar"), Ok(Some(CpuIsa::Scalar)));
        let err = isa_of("kiln serve --isa sse9").unwrap_err();
        assert!(err.contains("unknown ISA \"sse9\"") && err.contains("avx512-vnni"), "{err}");
    }

    #[test]
    fn prefetch_flag_names_a_cache_level() {
        use kiln_kernels::PrefetchLevel;
        let prefetch_of = |line: &str| {
            let argv: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
            super::parse(&argv, &[]).map(|(cli, _)| cli.prefetch).map_err(|e| e.to_string())
        };
        assert_eq!(prefetch_of("kiln --prefetch l2 plan"), Ok(Some(PrefetchLevel::L2)));
        assert_eq!(prefetch_of("kiln bench latency --prefetch L1"), Ok(Some(PrefetchLevel::L1)));
        assert_eq!(prefetch_of("kiln plan"), Ok(None));
        let err = prefetch_of("kiln serve --prefetch l3").unwrap_err();
        assert!(err.contains("\"l3\"") && err.contains("l1 or l2"), "{err}");
    }
}
