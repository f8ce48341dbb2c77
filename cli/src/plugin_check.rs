//! `iris plugin check PATH|NAME`: load a plugin, open its device 0 with the config's options,
//! and run the conformance suite.
//!
//! Exit status: 0 when no check fails, 1 when one does, 2 when the plugin cannot be loaded or
//! its device cannot be opened.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use iris_core::devices::{Registry, open_device};
use iris_plugin::conformance::{self, Report};
use serde::Serialize;

use crate::devices::render;
use crate::settings::{GlobalArgs, builtins, print_stdout};

/// Exit status when a check fails.
const EXIT_FAILED: u8 = 1;
/// Exit status when the plugin cannot be loaded or opened.
const EXIT_UNLOADABLE: u8 = 2;

/// Flags of `iris plugin check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The plugin: a library path, or a name (`cpu` is the built-in CPU device; other names are
    /// searched on the plugin path).
    #[arg(value_name = "PATH|NAME")]
    plugin: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct CheckOutput<'a> {
    plugin: &'a str,
    path: Option<PathBuf>,
    checks: Vec<CheckLine<'a>>,
    passed: usize,
    failed: usize,
    unsupported: usize,
}

#[derive(Debug, Serialize)]
struct CheckLine<'a> {
    name: &'a str,
    status: &'static str,
    detail: &'a str,
}

/// Runs `iris plugin check`.
pub fn run(global: &GlobalArgs, args: &CheckArgs) -> anyhow::Result<ExitCode> {
    let config = match global.config() {
        Ok(config) => config,
        Err(err) => {
            eprintln!("error: {err:#}");
            return Ok(ExitCode::from(EXIT_UNLOADABLE));
        }
    };
    let registry = Registry::new(builtins(), config.search_path());
    let plugin = match registry.select(&args.plugin) {
        Ok(plugin) => plugin,
        Err(err) => {
            eprintln!("error: cannot load plugin `{}`: {err}", args.plugin);
            return Ok(ExitCode::from(EXIT_UNLOADABLE));
        }
    };
    let device = match open_device(&plugin, 0, &config.plugin_options(plugin.name())) {
        Ok(device) => device,
        Err(err) => {
            eprintln!("error: {err}");
            return Ok(ExitCode::from(EXIT_UNLOADABLE));
        }
    };
    let report = conformance::run(&plugin, &device);
    drop(device);
    if args.json {
        let output = CheckOutput {
            plugin: plugin.name(),
            path: plugin.path().map(PathBuf::from),
            checks: report
                .checks
                .iter()
                .map(|check| CheckLine {
                    name: &check.name,
                    status: check.status.label(),
                    detail: check.status.detail(),
                })
                .collect(),
            passed: report.passed(),
            failed: report.failed(),
            unsupported: report.unsupported(),
        };
        print_stdout(&(serde_json::to_string_pretty(&output)? + "\n"))?;
    } else {
        let source = plugin
            .path()
            .map_or_else(|| "built-in".to_owned(), |path| path.display().to_string());
        let text = format!(
            "plugin {} {} ({source}), ABI {}.{}\n\n{}\nchecks: {} pass, {} fail, {} unsupported\n",
            plugin.name(),
            plugin.version(),
            plugin.abi_major(),
            plugin.abi_minor(),
            table(&report),
            report.passed(),
            report.failed(),
            report.unsupported()
        );
        print_stdout(&text)?;
    }
    Ok(if report.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILED)
    })
}

fn table(report: &Report) -> String {
    let mut rows = vec![["CHECK".to_owned(), "STATUS".to_owned(), "DETAIL".to_owned()]];
    rows.extend(report.checks.iter().map(|check| {
        [
            check.name.clone(),
            check.status.label().to_owned(),
            check.status.detail().to_owned(),
        ]
    }));
    render(&rows)
}
