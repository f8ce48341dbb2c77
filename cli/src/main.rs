//! The `iris` command.
//!
//! Configuration comes from a TOML file (`--config`, or `iris.toml` in the current folder),
//! overridden by the global flags, overridden by environment variables (see
//! [`iris_core::config`]). Subcommands live in their own modules: [`devices`] lists plugins and
//! their devices, [`plugin_check`] runs the conformance suite against one plugin, [`encode`] runs
//! a vision tower on images, [`profile`] reports start-up memory, [`simulate`] runs a workload through the scheduler for capacity
//! planning, [`serve`] puts the [`engine`] behind the [`http`] server, and [`bench`](mod@bench) is the main
//! job: load, memory checkpoints and the verdict.

mod bench;
mod devices;
mod encode;
mod engine;
mod epd;
mod http;
mod plugin_check;
mod profile;
mod progress;
mod serve;
mod settings;
mod simulate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// iris: the multimodal front half of a vision-language serving engine.
#[derive(Debug, Parser)]
#[command(name = "iris", version, about)]
struct Cli {
    #[command(flatten)]
    global: settings::GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List every device plugin (built in and found on the plugin path) and its devices.
    Devices(devices::DevicesArgs),
    /// Encode images with a vision tower and write the embeddings to a safetensors file.
    Encode(encode::EncodeArgs),
    /// Work with device plugins.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
    /// Start-up memory profile: weights, peak activation, encoder cache, available memory.
    Profile(profile::ProfileArgs),
    /// Capacity planning: run a workload through the scheduler and encoder cache manager.
    Simulate(simulate::SimulateArgs),
    /// Serve the engine over HTTP (loopback by default) until Ctrl-C or SIGTERM.
    Serve(serve::ServeCmd),
    /// The main job: load an engine (or --url a server), measure throughput, latency and
    /// memory before start, after start, after the load and after reset_all, with a verdict.
    Bench(bench::BenchCmd),
}

#[derive(Debug, Subcommand)]
enum PluginCommand {
    /// Load a plugin, open each of its devices and run the conformance suite against them.
    Check(plugin_check::CheckArgs),
}

/// Environment variable with the log filter (`tracing` directives, e.g. `info` or
/// `iris::plugin=debug`); warnings and errors are shown when it is unset.
const LOG_ENV: &str = "IRIS_LOG";

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs go to stderr, so that JSON and tables on stdout stay clean. Plugins log through the
    // host into the same output, under the target `iris::plugin` with their name and device.
    let filter = tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal, never in files and pipes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match &cli.command {
        Command::Devices(args) => devices::run(&cli.global, args),
        Command::Encode(args) => encode::run(&cli.global, args),
        Command::Plugin {
            command: PluginCommand::Check(args),
        } => plugin_check::run(&cli.global, args),
        Command::Profile(args) => profile::run(&cli.global, args),
        Command::Simulate(args) => cli
            .global
            .config()
            .and_then(|config| simulate::run(args, config.scheduler_policy))
            .map(|()| ExitCode::SUCCESS),
        Command::Serve(args) => serve::run(&cli.global, args),
        Command::Bench(args) => bench::run(&cli.global, args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", error_text(&err));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, `outer: cause: ...`, as anyhow's `{:#}` writes them,
/// but without a cause whose text the line already holds: many errors name their source in
/// their own message, and would otherwise print it twice.
fn error_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::error_text;

    #[test]
    fn an_error_naming_its_source_prints_it_once() {
        let read = iris_core::config::Config::resolve(
            Some(std::path::Path::new("/nonexistent/iris.toml")),
            &iris_core::config::Overrides::default(),
        )
        .context("cannot read configuration")
        .unwrap_err();
        let text = error_text(&read);
        assert_eq!(
            text.matches("No such file or directory").count(),
            1,
            "{text}"
        );
        assert!(
            text.starts_with(
                "cannot read configuration: cannot read config file /nonexistent/iris.toml"
            ),
            "{text}"
        );
        // Causes not already in the text are kept, in order.
        let chained = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_text(&chained), "outer: middle: inner");
    }
}
