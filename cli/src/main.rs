//! The `iris` command.

mod simulate;

use clap::{Parser, Subcommand};

/// iris: the multimodal front half of a vision-language serving engine.
#[derive(Debug, Parser)]
#[command(name = "iris", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Capacity planning: run a workload through the scheduler and encoder cache manager.
    Simulate(simulate::SimulateArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Simulate(args)) => simulate::run(&args),
        None => Ok(()),
    }
}
