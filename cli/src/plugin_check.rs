//! `iris plugin check PATH|NAME`: load a plugin, open each of its devices (or the one given with
//! `--ordinal`) with the config's options, and run the conformance suite on each.
//!
//! The table lists every check with its status, and for op checks the time of the op and the
//! throughput it achieved (GFLOP/s for matrix products and attention, GB/s for the rest), so the
//! same command is a first look at a device's speed. `--json` prints the same for machines.
//!
//! Exit status: 0 when no check fails, 1 when one does, 2 when the plugin cannot be loaded or a
//! device cannot be opened.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use iris_core::devices::{Registry, open_device};
use iris_plugin::conformance::{self, Report, Timing};
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
    /// Check only this device (default: every device the plugin's probe reports).
    #[arg(long, value_name = "N")]
    ordinal: Option<u32>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct CheckOutput<'a> {
    plugin: &'a str,
    version: &'a str,
    abi: String,
    path: Option<PathBuf>,
    devices: Vec<DeviceOutput>,
    passed: usize,
    failed: usize,
    unsupported: usize,
}

#[derive(Debug, Serialize)]
struct DeviceOutput {
    ordinal: u32,
    name: String,
    properties: Vec<(String, String)>,
    #[serde(flatten)]
    report: Report,
    passed: usize,
    failed: usize,
    unsupported: usize,
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
    let probe = plugin.probe();
    let ordinals: Vec<u32> = match args.ordinal {
        Some(ordinal) => vec![ordinal],
        None if probe.device_count == 0 => {
            eprintln!(
                "error: plugin `{}` has no devices: {}",
                plugin.name(),
                probe.reason
            );
            return Ok(ExitCode::from(EXIT_UNLOADABLE));
        }
        None => (0..probe.device_count).collect(),
    };
    let options = config.plugin_options(plugin.name());
    let mut devices = Vec::with_capacity(ordinals.len());
    for ordinal in ordinals {
        let device = match open_device(&plugin, ordinal, &options) {
            Ok(device) => Arc::new(device),
            Err(err) => {
                eprintln!("error: {err}");
                return Ok(ExitCode::from(EXIT_UNLOADABLE));
            }
        };
        let report = conformance::run(&plugin, &device);
        let description = device.description();
        devices.push(DeviceOutput {
            ordinal,
            name: description.name.clone(),
            properties: description.properties.clone(),
            passed: report.passed(),
            failed: report.failed(),
            unsupported: report.unsupported(),
            report,
        });
    }
    let (passed, failed, unsupported) = devices.iter().fold((0, 0, 0), |sum, d| {
        (sum.0 + d.passed, sum.1 + d.failed, sum.2 + d.unsupported)
    });
    if args.json {
        let output = CheckOutput {
            plugin: plugin.name(),
            version: plugin.version(),
            abi: format!("{}.{}", plugin.abi_major(), plugin.abi_minor()),
            path: plugin.path().map(PathBuf::from),
            devices,
            passed,
            failed,
            unsupported,
        };
        print_stdout(&(serde_json::to_string_pretty(&output)? + "\n"))?;
    } else {
        let source = plugin
            .path()
            .map_or_else(|| "built-in".to_owned(), |path| path.display().to_string());
        let mut text = format!(
            "plugin {} {} ({source}), ABI {}.{}\n",
            plugin.name(),
            plugin.version(),
            plugin.abi_major(),
            plugin.abi_minor(),
        );
        for device in &devices {
            let properties: Vec<String> = device
                .properties
                .iter()
                .map(|(key, value)| format!("{key} {value}"))
                .collect();
            text.push_str(&format!(
                "\ndevice {}: {} ({})\n\n{}\nchecks: {} pass, {} fail, {} unsupported\n",
                device.ordinal,
                device.name,
                properties.join(", "),
                table(&device.report),
                device.passed,
                device.failed,
                device.unsupported
            ));
        }
        print_stdout(&text)?;
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILED)
    })
}

fn table(report: &Report) -> String {
    let mut rows = vec![[
        "CHECK".to_owned(),
        "STATUS".to_owned(),
        "TIME".to_owned(),
        "THROUGHPUT".to_owned(),
        "DETAIL".to_owned(),
    ]];
    rows.extend(report.checks.iter().map(|check| {
        let (time, throughput) = check.timing.as_ref().map_or_else(
            || (String::new(), String::new()),
            |t: &Timing| {
                (
                    format!("{:.3} ms", t.seconds * 1e3),
                    format!("{:.1} {}", t.throughput, t.unit),
                )
            },
        );
        [
            check.name.clone(),
            check.status.label().to_owned(),
            time,
            throughput,
            check.status.detail().to_owned(),
        ]
    }));
    render(&rows)
}
