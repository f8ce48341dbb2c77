//! The `iris` command.

// Not reached from `main` yet: the `serve` and `bench` subcommands call into them.
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
