//! The `iris` command.

use clap::Parser;

/// iris: the multimodal front half of a vision-language serving engine.
#[derive(Debug, Parser)]
#[command(name = "iris", version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
