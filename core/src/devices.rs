//! The plugin registry and device selection.
//!
//! A [`Registry`] holds the built-in plugins the caller links in (the `iris` binary passes the
//! CPU device; core itself depends on no device) and the libraries found on the
//! [`SearchPath`]. A library that fails to load stays in the registry with its [`LoadError`],
//! so `iris devices` can show why.
//!
//! [`Registry::select`] turns a device spec into a plugin:
//!
//! - a path (contains `/` or ends in `.so`): that library, loaded on its own;
//! - `auto`: the first plugin that has devices, trying `cuda`, `ascend`, then `cpu`, then any
//!   other plugin in registry order, then any other library on the search path; it stops at the
//!   first plugin with devices;
//! - a name: the built-in plugin of that name if there is one, else the library of that name
//!   found on the search path. To use a library instead of a built-in of the same name, give
//!   its path.
//!
//! Selecting loads no library it does not need: with [`Registry::new`] nothing is loaded up
//! front, so `--device cpu` opens no vendor library and `auto` loads libraries one by one in
//! its order, stopping at the first with devices. A broken vendor runtime then cannot break a
//! start on another device. [`Registry::discover`] loads every library, for `iris devices`.

use std::path::{Path, PathBuf};

use iris_plugin::loader::is_path_spec;
use iris_plugin::{Device, DeviceError, LoadError, Plugin, SearchPath, load_library};
use thiserror::Error;

use crate::config::{AUTO_DEVICE, Config};

/// The order in which `auto` tries plugins: accelerators first, the CPU last.
pub const AUTO_ORDER: [&str; 3] = ["cuda", "ascend", "cpu"];

/// Why no device could be selected or opened.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DevicesError {
    /// The plugin library could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The plugin loaded but sees no device.
    #[error("plugin `{plugin}` has no devices: {reason}")]
    NoDevices {
        /// The plugin.
        plugin: String,
        /// The plugin's reason.
        reason: String,
    },
    /// `auto` found no plugin with a device.
    #[error("no plugin has a device (device = \"auto\"): {}", tried.join("; "))]
    NoneAvailable {
        /// Each plugin tried, with why it was not used.
        tried: Vec<String>,
    },
    /// The ordinal is not below the plugin's device count.
    #[error("plugin `{plugin}` has {count} device(s); device_ordinal {ordinal} does not exist")]
    NoSuchOrdinal {
        /// The plugin.
        plugin: String,
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices the plugin has.
        count: u32,
    },
    /// The plugin refused to open the device (bad option, driver failure).
    #[error("cannot open device {ordinal} of plugin `{plugin}`: {source}")]
    Open {
        /// The plugin.
        plugin: String,
        /// The ordinal.
        ordinal: u32,
        /// The plugin's error.
        source: DeviceError,
    },
}

/// One plugin the registry knows: loaded, or the error that kept it from loading.
#[derive(Debug)]
pub struct Entry {
    /// The plugin's name (for a failed library, the name in its file name).
    pub name: String,
    /// The library file, `None` for a built-in plugin.
    pub path: Option<PathBuf>,
    /// The loaded plugin, or why it did not load.
    pub plugin: Result<Plugin, LoadError>,
}

impl Entry {
    /// Whether the plugin is linked into the binary.
    pub fn is_builtin(&self) -> bool {
        self.path.is_none()
    }
}

/// Built-in plugins and the libraries found on a search path.
#[derive(Debug)]
pub struct Registry {
    entries: Vec<Entry>,
    search: SearchPath,
}

impl Registry {
    /// A registry of the built-ins only; libraries are looked up on `search` when selected.
    pub fn new(builtins: Vec<Plugin>, search: SearchPath) -> Registry {
        let entries = builtins
            .into_iter()
            .map(|plugin| Entry {
                name: plugin.name().to_owned(),
                path: None,
                plugin: Ok(plugin),
            })
            .collect();
        Registry { entries, search }
    }

    /// The built-ins plus every library on `search`, each loaded (failures kept as entries).
    pub fn discover(builtins: Vec<Plugin>, search: SearchPath) -> Registry {
        let mut registry = Registry::new(builtins, search);
        for path in registry.search.discover() {
            let name = iris_plugin::loader::plugin_name_of(&path).unwrap_or_default();
            let plugin = load_library(&path);
            let name = plugin
                .as_ref()
                .map_or(name, |plugin| plugin.name().to_owned());
            registry.entries.push(Entry {
                name,
                path: Some(path),
                plugin,
            });
        }
        registry
    }

    /// Every entry: built-ins first, then libraries in search order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The search path libraries are looked up on.
    pub fn search_path(&self) -> &SearchPath {
        &self.search
    }

    /// The plugin for a device spec: `auto`, a name, or a library path (see the module docs).
    pub fn select(&self, spec: &str) -> Result<Plugin, DevicesError> {
        if spec == AUTO_DEVICE {
            return self.select_auto();
        }
        if is_path_spec(spec) {
            return self.by_path(Path::new(spec));
        }
        self.by_name(spec)
    }

    /// Selects `config.device`, checks `config.device_ordinal`, and opens it with the
    /// `[plugins.<name>]` options.
    ///
    /// Warns about `[plugins.<name>]` tables that no plugin would read (see
    /// [`Registry::unmatched_plugin_tables`]).
    pub fn open_selected(&self, config: &Config) -> Result<Device, DevicesError> {
        let plugin = self.select(&config.device)?;
        for name in self.unmatched_plugin_tables(config, plugin.name()) {
            tracing::warn!(
                "config has options for plugin `{name}`, which is neither a built-in device ({}) nor a plugin found on the search path: its options reach no plugin (misspelled?)",
                AUTO_ORDER.join(", ")
            );
        }
        open_device(
            &plugin,
            config.device_ordinal,
            &config.plugin_options(plugin.name()),
        )
    }

    /// The `[plugins.<name>]` tables of `config` whose name is none of: `selected` (the
    /// plugin being opened), the built-in device names ([`AUTO_ORDER`], installed or not: a
    /// config shared by hosts with different hardware names them all), a plugin in the
    /// registry, a library on the search path. Such a table's options reach no plugin; a
    /// misspelled name is the usual cause.
    pub fn unmatched_plugin_tables(&self, config: &Config, selected: &str) -> Vec<String> {
        let mut unmatched: Vec<String> = config
            .plugins
            .keys()
            .filter(|name| {
                name.as_str() != selected
                    && !AUTO_ORDER.contains(&name.as_str())
                    && !self.entries.iter().any(|entry| &entry.name == *name)
            })
            .cloned()
            .collect();
        if !unmatched.is_empty() {
            // Names only: nothing is loaded to answer this.
            let on_path: Vec<String> = self
                .search
                .discover()
                .into_iter()
                .filter_map(|path| iris_plugin::loader::plugin_name_of(&path))
                .collect();
            unmatched.retain(|name| !on_path.contains(name));
        }
        unmatched
    }

    fn select_auto(&self) -> Result<Plugin, DevicesError> {
        let mut names: Vec<String> = AUTO_ORDER.iter().map(|name| (*name).to_owned()).collect();
        let listed = self.entries.iter().map(|entry| entry.name.clone());
        // Names only: a library is loaded when its turn comes, not before.
        let on_path = self
            .search
            .discover()
            .into_iter()
            .filter_map(|path| iris_plugin::loader::plugin_name_of(&path));
        for name in listed.chain(on_path) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let mut tried = Vec::new();
        for name in names {
            match self.auto_candidate(&name) {
                Ok(Some(plugin)) => {
                    let probe = plugin.probe();
                    if probe.device_count > 0 {
                        return Ok(plugin);
                    }
                    tried.push(format!("{name}: {}", probe.reason));
                }
                Ok(None) => tried.push(format!("{name}: not installed")),
                Err(err) => tried.push(format!("{name}: {err}")),
            }
        }
        Err(DevicesError::NoneAvailable { tried })
    }

    /// The plugin `auto` tries under `name`: already loaded, else loaded now from the search
    /// path; `None` when no library of that name exists.
    fn auto_candidate(&self, name: &str) -> Result<Option<Plugin>, String> {
        if let Some(plugin) = self.loaded_by_name(name) {
            return Ok(Some(plugin.clone()));
        }
        if let Some(err) = self.failed_by_name(name) {
            return Err(err.to_string());
        }
        match self.search.find(name) {
            Ok(path) => load_library(&path).map(Some).map_err(|err| err.to_string()),
            Err(LoadError::NotFound { .. }) => Ok(None),
            Err(err) => Err(err.to_string()),
        }
    }

    fn by_name(&self, name: &str) -> Result<Plugin, DevicesError> {
        if let Some(plugin) = self.loaded_by_name(name) {
            return Ok(plugin.clone());
        }
        // A discovered library that failed: report its error rather than searching again.
        if let Some(entry) = self
            .entries
            .iter()
            .find(|entry| entry.name == name && entry.plugin.is_err())
            && let Some(path) = &entry.path
        {
            return Ok(load_library(path)?);
        }
        let path = self.search.find(name)?;
        Ok(load_library(&path)?)
    }

    fn by_path(&self, path: &Path) -> Result<Plugin, DevicesError> {
        let loaded = self.entries.iter().find_map(|entry| match &entry.plugin {
            Ok(plugin) if entry.path.as_deref() == Some(path) => Some(plugin.clone()),
            _ => None,
        });
        match loaded {
            Some(plugin) => Ok(plugin),
            None => Ok(load_library(path)?),
        }
    }

    /// The loaded plugin called `name`, built-ins first.
    fn loaded_by_name(&self, name: &str) -> Option<&Plugin> {
        let mut loaded = self
            .entries
            .iter()
            .filter(|entry| entry.name == name)
            .filter_map(|entry| entry.plugin.as_ref().ok());
        loaded.next()
    }

    fn failed_by_name(&self, name: &str) -> Option<&LoadError> {
        self.entries
            .iter()
            .filter(|entry| entry.name == name)
            .find_map(|entry| entry.plugin.as_ref().err())
    }
}

/// Opens device `ordinal` of `plugin` after checking the probe, so that "no devices" and "no
/// such ordinal" are reported as such rather than as the plugin's open error.
pub fn open_device(
    plugin: &Plugin,
    ordinal: u32,
    options: &[(String, String)],
) -> Result<Device, DevicesError> {
    let probe = plugin.probe();
    if probe.device_count == 0 {
        return Err(DevicesError::NoDevices {
            plugin: plugin.name().to_owned(),
            reason: probe.reason,
        });
    }
    if ordinal >= probe.device_count {
        return Err(DevicesError::NoSuchOrdinal {
            plugin: plugin.name().to_owned(),
            ordinal,
            count: probe.device_count,
        });
    }
    plugin
        .open(ordinal, options)
        .map_err(|source| DevicesError::Open {
            plugin: plugin.name().to_owned(),
            ordinal,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtin_cpu() -> Plugin {
        Plugin::builtin(iris_device_cpu::plugin_root())
    }

    fn empty_search() -> SearchPath {
        SearchPath {
            env_dirs: vec![PathBuf::from("/nonexistent/iris-plugins")],
            config_dirs: Vec::new(),
            exe_dir: None,
        }
    }

    #[test]
    fn auto_falls_back_to_the_cpu() {
        let registry = Registry::new(vec![builtin_cpu()], empty_search());
        let plugin = registry.select("auto").unwrap();
        assert_eq!(plugin.name(), "cpu");
        assert!(plugin.path().is_none());
    }

    #[test]
    fn auto_without_any_device_lists_what_was_tried() {
        let registry = Registry::new(Vec::new(), empty_search());
        let err = registry.select("auto").unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, DevicesError::NoneAvailable { .. }), "{err:?}");
        for name in AUTO_ORDER {
            assert!(text.contains(name), "{text}");
        }
    }

    #[test]
    fn by_name_prefers_the_builtin_and_reports_missing_libraries() {
        let registry = Registry::new(vec![builtin_cpu()], empty_search());
        assert!(registry.select("cpu").unwrap().path().is_none());
        let err = registry.select("cuda").unwrap_err();
        assert!(
            matches!(err, DevicesError::Load(LoadError::NotFound { .. })),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("/nonexistent/iris-plugins/libiris_device_cuda.so"),
            "{err}"
        );
    }

    #[test]
    fn plugin_tables_no_plugin_reads_are_named() {
        let dir = std::env::temp_dir().join(format!("iris-unmatched-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Found by name only: the file is never loaded.
        std::fs::write(dir.join("libiris_device_vendor.so"), "not an ELF file").unwrap();
        let search = SearchPath {
            env_dirs: vec![dir.clone()],
            config_dirs: Vec::new(),
            exe_dir: None,
        };
        let registry = Registry::new(vec![builtin_cpu()], search);
        let config = Config::from_toml_str(
            "[plugins.cpu]\nthreads = 1\n[plugins.cdua]\nx = 1\n[plugins.cuda]\nx = 1\n\
             [plugins.vendor]\nx = 1\n[plugins.npu]\nx = 1",
            "test",
        )
        .unwrap();
        // `cuda` is a built-in name, installed or not; `vendor` is on the search path; `npu`
        // is the plugin being opened (a library given by path).
        assert_eq!(registry.unmatched_plugin_tables(&config, "npu"), ["cdua"]);
        assert_eq!(
            registry.unmatched_plugin_tables(&config, "cpu"),
            ["cdua", "npu"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_path_is_not_found() {
        let registry = Registry::new(vec![builtin_cpu()], empty_search());
        let err = registry
            .select("/nonexistent/libiris_device_x.so")
            .unwrap_err();
        assert!(matches!(err, DevicesError::Load(_)), "{err:?}");
    }

    #[test]
    fn open_selected_passes_plugin_options_and_checks_the_ordinal() {
        let registry = Registry::new(vec![builtin_cpu()], empty_search());
        let mut config = Config::from_toml_str(
            "device = \"cpu\"\n[plugins.cpu]\ncapacity = \"1MiB\"\nthreads = 1",
            "test",
        )
        .unwrap();
        let device = registry.open_selected(&config).unwrap();
        assert_eq!(device.mem_info().unwrap().total, 1 << 20);

        config.device_ordinal = 3;
        let err = registry.open_selected(&config).unwrap_err();
        assert!(
            matches!(err, DevicesError::NoSuchOrdinal { count: 1, .. }),
            "{err:?}"
        );

        config.device_ordinal = 0;
        config
            .plugins
            .get_mut("cpu")
            .unwrap()
            .insert("threds".into(), "2".into());
        let err = registry.open_selected(&config).unwrap_err();
        assert!(matches!(err, DevicesError::Open { .. }), "{err:?}");
        assert!(err.to_string().contains("threds"), "{err}");
    }

    #[test]
    fn discovery_keeps_failed_libraries_and_by_path_picks_the_library() {
        let dir = std::env::temp_dir().join(format!("iris-devices-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libiris_device_bogus.so"), "not an ELF file").unwrap();
        // Cargo builds the CPU device's library (a dev-dependency) next to this test binary.
        let deps = std::env::current_exe()
            .unwrap()
            .parent()
            .unwrap()
            .to_path_buf();
        let cpu_library = deps.join("libiris_device_cpu.so");
        let search = SearchPath {
            env_dirs: vec![dir.clone(), deps],
            config_dirs: Vec::new(),
            exe_dir: None,
        };
        let registry = Registry::discover(vec![builtin_cpu()], search);

        let bogus = registry
            .entries()
            .iter()
            .find(|entry| entry.name == "bogus")
            .expect("a library that fails to load stays listed");
        let err = bogus.plugin.as_ref().unwrap_err();
        assert!(matches!(err, LoadError::Open { .. }), "{err:?}");
        assert!(err.to_string().contains("libiris_device_bogus.so"), "{err}");

        let library = registry
            .entries()
            .iter()
            .find(|entry| entry.name == "cpu" && !entry.is_builtin())
            .expect("the CPU library is discovered");
        assert_eq!(library.path.as_deref(), Some(cpu_library.as_path()));

        assert!(
            registry.select("cpu").unwrap().path().is_none(),
            "by name the built-in wins"
        );
        let by_path = registry.select(cpu_library.to_str().unwrap()).unwrap();
        assert_eq!(by_path.path(), Some(cpu_library.as_path()));
        let err = registry.select("bogus").unwrap_err();
        assert!(
            matches!(err, DevicesError::Load(LoadError::Open { .. })),
            "{err:?}"
        );
    }
}
