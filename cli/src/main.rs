//! The `iris` command.

// Built and tested now; `iris serve` and `iris bench` call into them once the engine lands.
#[allow(dead_code)]
mod bench;
#[allow(dead_code)]
mod http;

use clap::Parser;

/// iris: the multimodal front half of a vision-language serving engine.
#[derive(Debug, Parser)]
#[command(name = "iris", version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
