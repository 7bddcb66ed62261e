//! The `kiln` command line: `kiln serve`, `kiln generate` and `kiln bench throughput`; `tune` and `plan` join them.

mod bench;
mod engine_args;
mod generate;
mod kv_args;
mod model_arg;
mod serve;

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
    /// Benchmarks (`kiln bench throughput`).
    Bench(bench::BenchArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Bench(args) => bench::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
