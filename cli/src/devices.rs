//! `iris devices`: every plugin found, built in or on the plugin path, and its devices.
//!
//! A library that fails to load is listed with its error; a plugin without devices with its
//! probe's reason. Each device is opened (with the config's `[plugins.<name>]` options) to read
//! its description and memory, then closed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use iris_core::config::Config;
use iris_core::devices::{Entry, open_device};
use serde::Serialize;

use crate::settings::{GlobalArgs, discover, print_stdout};

/// Flags of `iris devices`.
#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The JSON document: `{"plugins": [...]}`.
#[derive(Debug, Serialize)]
struct Listing {
    plugins: Vec<PluginInfo>,
}

#[derive(Debug, Serialize)]
struct PluginInfo {
    name: String,
    path: Option<PathBuf>,
    version: Option<String>,
    abi_major: Option<u32>,
    abi_minor: Option<u32>,
    devices: Vec<DeviceInfo>,
    /// Why the plugin has no devices (its probe's answer, or why none could be opened).
    reason: Option<String>,
    /// Why the library did not load.
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct DeviceInfo {
    ordinal: u32,
    name: String,
    vendor: String,
    total_bytes: u64,
    free_bytes: u64,
    /// Device memory the plugin holds outside `alloc` (context, libraries, kernels), by item.
    held: BTreeMap<String, u64>,
    /// The device's properties (compute capability, memory bandwidth, queue, kernel tier...).
    properties: BTreeMap<String, String>,
}

/// Runs `iris devices`.
pub fn run(global: &GlobalArgs, args: &DevicesArgs) -> anyhow::Result<ExitCode> {
    let config = global.config()?;
    let registry = discover(&config);
    let listing = Listing {
        plugins: registry
            .entries()
            .iter()
            .map(|entry| describe(entry, &config))
            .collect(),
    };
    let text = if args.json {
        serde_json::to_string_pretty(&listing)? + "\n"
    } else {
        table(&listing)
    };
    print_stdout(&text)?;
    Ok(ExitCode::SUCCESS)
}

fn describe(entry: &Entry, config: &Config) -> PluginInfo {
    let plugin = match &entry.plugin {
        Ok(plugin) => plugin,
        Err(err) => {
            return PluginInfo {
                name: entry.name.clone(),
                path: entry.path.clone(),
                version: None,
                abi_major: None,
                abi_minor: None,
                devices: Vec::new(),
                reason: None,
                error: Some(err.to_string()),
            };
        }
    };
    let probe = plugin.probe();
    let options = config.plugin_options(plugin.name());
    let mut devices = Vec::new();
    let mut problems = Vec::new();
    for ordinal in 0..probe.device_count {
        let opened = open_device(plugin, ordinal, &options).map_err(|err| err.to_string());
        let info = opened.and_then(|device| {
            let mem = device.mem_info().map_err(|err| err.to_string())?;
            let report = device.memory_report().map_err(|err| err.to_string())?;
            let desc = device.description();
            Ok(DeviceInfo {
                ordinal,
                name: desc.name.clone(),
                vendor: desc.vendor.clone(),
                total_bytes: mem.total,
                free_bytes: mem.free,
                held: report.held.into_iter().collect(),
                properties: desc.properties.iter().cloned().collect(),
            })
        });
        match info {
            Ok(info) => devices.push(info),
            Err(problem) => problems.push(format!("device {ordinal}: {problem}")),
        }
    }
    let reason = if probe.device_count == 0 {
        Some(probe.reason)
    } else if problems.is_empty() {
        None
    } else {
        Some(problems.join("; "))
    };
    PluginInfo {
        name: plugin.name().to_owned(),
        path: entry.path.clone(),
        version: Some(plugin.version().to_owned()),
        abi_major: Some(plugin.abi_major()),
        abi_minor: Some(plugin.abi_minor()),
        devices,
        reason,
        error: None,
    }
}

fn table(listing: &Listing) -> String {
    let mut rows = vec![
        [
            "PLUGIN",
            "VERSION",
            "ABI",
            "DEVICE",
            "NAME",
            "VENDOR",
            "TOTAL",
            "FREE",
            "SOURCE",
            "PROPERTIES",
        ]
        .map(str::to_owned),
    ];
    let mut notes = Vec::new();
    for plugin in &listing.plugins {
        let source = plugin
            .path
            .as_ref()
            .map_or_else(|| "built-in".to_owned(), |path| path.display().to_string());
        if let Some(error) = &plugin.error {
            notes.push(format!("{} did not load: {error}", plugin.name));
            continue;
        }
        let abi = match (plugin.abi_major, plugin.abi_minor) {
            (Some(major), Some(minor)) => format!("{major}.{minor}"),
            _ => "-".to_owned(),
        };
        let version = plugin.version.clone().unwrap_or_else(|| "-".to_owned());
        for device in &plugin.devices {
            rows.push([
                plugin.name.clone(),
                version.clone(),
                abi.clone(),
                device.ordinal.to_string(),
                device.name.clone(),
                device.vendor.clone(),
                bytes(device.total_bytes),
                bytes(device.free_bytes),
                source.clone(),
                device
                    .properties
                    .iter()
                    .map(|(key, value)| format!("{key}={value}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            ]);
        }
        if let Some(reason) = &plugin.reason {
            notes.push(format!(
                "{} ({source}) has no usable device: {reason}",
                plugin.name
            ));
        }
    }
    let mut out = render(&rows);
    if !notes.is_empty() {
        out.push('\n');
        for note in notes {
            out.push_str(&note);
            out.push('\n');
        }
    }
    out
}

/// Left-aligned columns; the last column is not padded, so long error messages stay readable.
pub fn render<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == N {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Bytes in binary units, e.g. `15.6 GiB`.
fn bytes(value: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut scaled = value;
    while scaled >= 1024 && unit + 1 < UNITS.len() {
        scaled /= 1024;
        unit += 1;
    }
    if unit == 0 {
        return format!("{value} B");
    }
    // Display only: a rounded figure is what a person wants to read.
    #[allow(clippy::cast_precision_loss)]
    let shown = value as f64 / (1u64 << (10 * unit)) as f64;
    format!("{shown:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_shown_in_binary_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(64 << 20), "64.0 MiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn columns_align() {
        let rows = vec![
            ["a".to_owned(), "bb".to_owned(), "x".to_owned()],
            ["ccc".to_owned(), "d".to_owned(), "long last".to_owned()],
        ];
        assert_eq!(render(&rows), "a    bb  x\nccc  d   long last\n");
    }
}
