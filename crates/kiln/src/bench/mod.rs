//! `kiln bench`: `serve` (online, over HTTP against any OpenAI-compatible server), `latency`
//! (in-process batch × input × output grid), `throughput` (in-process, everything queued at
//! once), `speculative` (speculative against plain decoding, one prompt at a time) and
//! `structured` (JSON-schema-constrained against unconstrained decoding).

pub mod latency;
mod serve;
mod speculative;
mod structured;
mod throughput;
mod tokenizer;

pub use serve::{DatasetArgs, ServeBenchArgs, run_serve_bench};
pub use tokenizer::BenchTokenizer;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(clap::Subcommand, Debug)]
enum BenchCommand {
    /// Online load against an OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput, goodput.
    Serve(Box<ServeBenchArgs>),
    /// In-process grid of batch size × input length × output length: prefill and decode tok/s.
    Latency(latency::LatencyArgs),
    /// Offline throughput: N random prompts of I tokens, O output tokens each, all at once.
    Throughput(throughput::ThroughputArgs),
    /// Speculative decoding against plain decoding, one prompt at a time, same outputs checked.
    Speculative(Box<speculative::SpeculativeArgs>),
    /// Structured outputs (a JSON schema) against unconstrained decoding of the same lengths.
    Structured(Box<structured::StructuredArgs>),
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    match &args.command {
        BenchCommand::Serve(a) => run_serve_bench(a).map(|_| ()),
        BenchCommand::Latency(a) => latency::run(a),
        BenchCommand::Throughput(a) => throughput::run(a),
        BenchCommand::Speculative(a) => speculative::run(a),
        BenchCommand::Structured(a) => structured::run(a),
    }
}
