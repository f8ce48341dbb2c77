//! Global flags and how they become a [`Config`], and the plugins built into the binary.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use iris_core::config::{Config, Overrides};
use iris_core::devices::Registry;
use iris_plugin::Plugin;

/// Flags every subcommand accepts.
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Config file (default: `iris.toml` in the current folder, if present).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Device plugin: `auto`, a plugin name (cpu, cuda, ascend, ...) or a library path.
    /// `IRIS_DEVICE` overrides it.
    #[arg(long, global = true, value_name = "SPEC")]
    pub device: Option<String>,
    /// Which device of the plugin.
    #[arg(long, global = true, value_name = "N")]
    pub device_ordinal: Option<u32>,
    /// Extra folder to search for plugin libraries (repeatable); searched after
    /// `IRIS_PLUGIN_PATH` and before the config's `plugin_dirs`.
    #[arg(long = "plugin-dir", global = true, value_name = "DIR")]
    pub plugin_dirs: Vec<PathBuf>,
}

impl GlobalArgs {
    /// The configuration in effect: file, then these flags, then the environment.
    pub fn config(&self) -> anyhow::Result<Config> {
        let overrides = Overrides {
            device: self.device.clone(),
            device_ordinal: self.device_ordinal,
            plugin_dirs: self.plugin_dirs.clone(),
        };
        Config::resolve(self.config.as_deref(), &overrides).context("cannot read configuration")
    }
}

/// The plugins linked into the binary: the CPU device.
pub fn builtins() -> Vec<Plugin> {
    vec![Plugin::builtin(iris_device_cpu::plugin_root())]
}

/// A registry of the built-ins and every library on the config's search path, each loaded:
/// for `iris devices`, which shows them all.
pub fn discover(config: &Config) -> Registry {
    Registry::discover(builtins(), config.search_path())
}

/// A registry for selecting one device: the built-ins, with libraries loaded only when the
/// device spec needs them (`--device cpu` opens no vendor library).
pub fn registry(config: &Config) -> Registry {
    Registry::new(builtins(), config.search_path())
}

/// Writes `text` to standard output. A closed pipe (`iris devices | head`) is not an error:
/// the reader has what it wanted.
pub fn print_stdout(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(err).context("cannot write to standard output")
        }
        _ => Ok(()),
    }
}
