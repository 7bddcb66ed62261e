//! The `kiln` command line: `kiln serve`, `kiln generate`, `kiln bench serve | latency |
//! throughput`, `kiln tune` and `kiln plan`.

mod bench;
mod engine_args;
mod generate;
mod kv_args;
mod model_arg;
mod plan;
mod serve;
mod tune;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kiln", version, about = "An LLM inference server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for one prompt and stream it to stdout.
    Generate(generate::GenerateArgs),
    /// Serve the model on an OpenAI-compatible HTTP endpoint.
    Serve(serve::ServeArgs),
    /// Benchmarks: `serve` (online, HTTP), `latency` (batch grid), `throughput` (offline).
    Bench(bench::BenchArgs),
    /// Sweep server flags × load with `kiln bench serve`; pick the best for an objective.
    Tune(Box<tune::TuneArgs>),
    /// Capacity and speed planning: what fits in memory, predicted (and measured) tok/s.
    Plan(Box<plan::PlanArgs>),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
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
