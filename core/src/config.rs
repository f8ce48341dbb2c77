//! Configuration: a TOML file, overridden by command-line flags, overridden by environment
//! variables.
//!
//! The file is given with `--config PATH`; without it, `iris.toml` in the current folder is
//! read if present. Keys:
//!
//! ```toml
//! device = "auto"            # "auto", a plugin name (cpu, cuda, ascend, ...), or a .so path
//!                            # (a relative path is relative to this file)
//! device_ordinal = 0
//! plugin_dirs = ["/opt/iris/plugins"]   # relative paths are relative to this file
//!
//! [plugins.cpu]              # options passed to the plugin's `open`, as text
//! threads = 8
//! capacity = "16GiB"
//!
//! [scheduler]
//! policy = "vllm"            # "vllm" (vLLM 0.33.0 step for step) or "progress"; --scheduler-policy
//!
//! [ec_transfer_config]       # vLLM's EC transfer configuration; --ec-transfer-config overrides it
//! ec_connector = "ECExampleConnector"
//! ec_role = "ec_producer"
//! ec_connector_extra_config = { shared_storage_path = "/mnt/ec_cache" }
//! ```
//!
//! `[ec_transfer_config]` is kept as JSON and checked by the encoder-instance layer (iris-ec),
//! which owns its meaning.
//!
//! Environment: `IRIS_DEVICE` overrides `device`; `IRIS_PLUGIN_PATH` (folders separated by `:`)
//! is searched before `plugin_dirs` (see [`iris_plugin::SearchPath`]).
//!
//! Every key is checked: an unknown key or a value of the wrong type is a [`ConfigError`] whose
//! message names the full key path (`plugins.cpu.threads`). Sections are read one by one in
//! [`Config::from_table`]; a later section is a struct with `#[serde(deny_unknown_fields)]` read
//! with [`section`], which puts the key path into serde's errors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use thiserror::Error;
use toml::{Table, Value};

/// The file read when no `--config` is given, if it exists in the current folder.
pub const DEFAULT_CONFIG_FILE: &str = "iris.toml";
/// Environment variable that overrides `device`.
pub const DEVICE_ENV: &str = "IRIS_DEVICE";
/// The `device` value that picks the first plugin with devices (cuda, ascend, then cpu).
pub const AUTO_DEVICE: &str = "auto";

/// Why a configuration could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config file {}: invalid TOML: {message}", path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A key this version of iris does not know.
    #[error("{origin}: unknown key `{key}`{hint}")]
    UnknownKey {
        /// Where the key came from (a file path, or `config`).
        origin: String,
        /// Full key path, e.g. `scheduler.max_num_seq`.
        key: String,
        /// The known keys at that level, as ` (known: a, b)`.
        hint: String,
    },
    /// A key whose value has the wrong type or is out of range.
    #[error("{origin}: invalid value for `{key}`: {message}")]
    InvalidValue {
        /// Where the key came from (a file path, an environment variable, or `config`).
        origin: String,
        /// Full key path, e.g. `plugins.cpu.threads`.
        key: String,
        /// What is wrong.
        message: String,
    },
}

/// The whole configuration. Add a section by adding a field and a branch in
/// [`Config::from_table`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// Which device plugin to use: [`AUTO_DEVICE`], a plugin name, or a library path.
    pub device: String,
    /// Which device of that plugin.
    pub device_ordinal: u32,
    /// Extra folders searched for plugin libraries, after `IRIS_PLUGIN_PATH`.
    pub plugin_dirs: Vec<PathBuf>,
    /// `[plugins.<name>]`: options passed to each plugin's `open`, values as text.
    pub plugins: BTreeMap<String, BTreeMap<String, String>>,
    /// `[scheduler] policy`: the scheduler rules when no `--scheduler-policy` is given.
    pub scheduler_policy: Option<crate::budget::Policy>,
    /// `[admission]`: the engine's backpressure bounds when no flag gives them.
    pub admission: crate::engine::admission::AdmissionConfig,
    /// `[ec_transfer_config]`: vLLM's EC transfer configuration as JSON, when no
    /// `--ec-transfer-config` gives it (checked where it is used).
    pub ec_transfer_config: Option<serde_json::Value>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            device: AUTO_DEVICE.to_owned(),
            device_ordinal: 0,
            plugin_dirs: Vec::new(),
            plugins: BTreeMap::new(),
            scheduler_policy: None,
            admission: crate::engine::admission::AdmissionConfig::default(),
            ec_transfer_config: None,
        }
    }
}

/// Values given on the command line; `None` and empty lists leave the file's values alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--device`.
    pub device: Option<String>,
    /// `--device-ordinal`.
    pub device_ordinal: Option<u32>,
    /// `--plugin-dir`, searched before the file's `plugin_dirs`.
    pub plugin_dirs: Vec<PathBuf>,
}

impl Config {
    /// The configuration in effect: the file (`path`, or [`DEFAULT_CONFIG_FILE`] in the current
    /// folder if it exists, or the defaults), then `flags`, then the process environment.
    pub fn resolve(path: Option<&Path>, flags: &Overrides) -> Result<Config, ConfigError> {
        let mut config = Config::load(path)?;
        config.apply_overrides(flags);
        config.apply_env(|name| std::env::var(name).ok())?;
        Ok(config)
    }

    /// Reads `path`, or [`DEFAULT_CONFIG_FILE`] in the current folder when `path` is `None`
    /// and that file exists; otherwise the defaults.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        match path {
            Some(path) => Config::from_file(path),
            None => {
                let default = Path::new(DEFAULT_CONFIG_FILE);
                if default.is_file() {
                    Config::from_file(default)
                } else {
                    Ok(Config::default())
                }
            }
        }
    }

    /// Reads a TOML file. Relative `plugin_dirs`, and a `device` given as a relative library
    /// path, are taken relative to the file's folder, so a config means the same files from
    /// whatever folder iris is started in (`--device` and `IRIS_DEVICE` stay relative to the
    /// current folder, as the shell that gives them).
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let table: Table = text
            .parse()
            .map_err(|err: toml::de::Error| ConfigError::Syntax {
                path: path.to_path_buf(),
                message: err.to_string().trim_end().to_owned(),
            })?;
        let mut config = Config::from_table(table, &path.display().to_string())?;
        let base = path.parent().unwrap_or(Path::new(""));
        for dir in &mut config.plugin_dirs {
            if dir.is_relative() {
                *dir = base.join(&*dir);
            }
        }
        if iris_plugin::loader::is_path_spec(&config.device)
            && Path::new(&config.device).is_relative()
        {
            // A bare file name (`libiris_device_x.so`) is a path too: the file beside the config.
            config.device = base.join(&config.device).display().to_string();
        }
        Ok(config)
    }

    /// Parses TOML text; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let table: Table = text
            .parse()
            .map_err(|err: toml::de::Error| ConfigError::Syntax {
                path: PathBuf::from(origin),
                message: err.to_string().trim_end().to_owned(),
            })?;
        Config::from_table(table, origin)
    }

    /// Builds a configuration from a parsed TOML table, checking every key.
    pub fn from_table(table: Table, origin: &str) -> Result<Config, ConfigError> {
        const KNOWN: &[&str] = &[
            "device",
            "device_ordinal",
            "plugin_dirs",
            "plugins",
            "scheduler",
            "admission",
            "ec_transfer_config",
        ];
        let mut config = Config::default();
        for (key, value) in table {
            match key.as_str() {
                "device" => config.device = device_spec(origin, "device", value)?,
                "device_ordinal" => {
                    config.device_ordinal = section(origin, "device_ordinal", value)?
                }
                "plugin_dirs" => config.plugin_dirs = section(origin, "plugin_dirs", value)?,
                "plugins" => config.plugins = plugin_tables(origin, value)?,
                "scheduler" => {
                    config.scheduler_policy =
                        section::<SchedulerSection>(origin, "scheduler", value)?.policy;
                }
                "admission" => {
                    config.admission = section(origin, "admission", value)?;
                    // As the flag: zero would be taken as one.
                    if config.admission.max_queued_requests == Some(0) {
                        return Err(ConfigError::InvalidValue {
                            origin: origin.to_owned(),
                            key: "admission.max_queued_requests".to_owned(),
                            message: "must be at least 1, got 0".to_owned(),
                        });
                    }
                }
                "ec_transfer_config" => {
                    let table: Table = section(origin, "ec_transfer_config", value)?;
                    let json =
                        serde_json::to_value(table).map_err(|err| ConfigError::InvalidValue {
                            origin: origin.to_owned(),
                            key: key.clone(),
                            message: err.to_string(),
                        })?;
                    config.ec_transfer_config = Some(json);
                }
                _ => return Err(unknown_key(origin, &key, KNOWN)),
            }
        }
        Ok(config)
    }

    /// Applies command-line values.
    pub fn apply_overrides(&mut self, flags: &Overrides) {
        if let Some(device) = &flags.device {
            self.device.clone_from(device);
        }
        if let Some(ordinal) = flags.device_ordinal {
            self.device_ordinal = ordinal;
        }
        if !flags.plugin_dirs.is_empty() {
            let mut dirs = flags.plugin_dirs.clone();
            dirs.append(&mut self.plugin_dirs);
            self.plugin_dirs = dirs;
        }
    }

    /// Applies environment variables, read through `var` (the process environment in
    /// [`Config::resolve`]; a map in tests). `IRIS_PLUGIN_PATH` is read by the plugin search
    /// path itself.
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(device) = var(DEVICE_ENV) {
            self.device = device_spec(DEVICE_ENV, "device", Value::String(device))?;
        }
        Ok(())
    }

    /// The `[plugins.<name>]` options as `(key, value)` pairs for `Plugin::open`.
    pub fn plugin_options(&self, name: &str) -> Vec<(String, String)> {
        self.plugins
            .get(name)
            .map(|options| {
                options
                    .iter()
                    .map(|(key, value)| (key.clone(), value.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Where plugin libraries are searched: `IRIS_PLUGIN_PATH`, `plugin_dirs`, the executable's
    /// folder.
    pub fn search_path(&self) -> iris_plugin::SearchPath {
        iris_plugin::SearchPath::from_env(&self.plugin_dirs)
    }
}

/// `[scheduler]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SchedulerSection {
    policy: Option<crate::budget::Policy>,
}

/// Deserialises one key's value into `T`, naming `key` in the error. A section struct with
/// `#[serde(deny_unknown_fields)]` gets its unknown fields reported as `key.field`.
pub fn section<T: DeserializeOwned>(
    origin: &str,
    key: &str,
    value: Value,
) -> Result<T, ConfigError> {
    T::deserialize(value).map_err(|err| {
        let message = err.to_string().trim_end().to_owned();
        match unknown_field_name(&message) {
            Some(field) => ConfigError::UnknownKey {
                origin: origin.to_owned(),
                key: format!("{key}.{field}"),
                hint: message
                    .split_once(", expected ")
                    .map(|(_, known)| format!(" (expected {known})"))
                    .unwrap_or_default(),
            },
            None => ConfigError::InvalidValue {
                origin: origin.to_owned(),
                key: key.to_owned(),
                message,
            },
        }
    })
}

/// The field in serde's "unknown field `x`, expected ..." message.
fn unknown_field_name(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("unknown field `")?;
    rest.split_once('`').map(|(field, _)| field)
}

fn unknown_key(origin: &str, key: &str, known: &[&str]) -> ConfigError {
    ConfigError::UnknownKey {
        origin: origin.to_owned(),
        key: key.to_owned(),
        hint: format!(" (known: {})", known.join(", ")),
    }
}

fn invalid(origin: &str, key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::InvalidValue {
        origin: origin.to_owned(),
        key: key.to_owned(),
        message: message.into(),
    }
}

fn device_spec(origin: &str, key: &str, value: Value) -> Result<String, ConfigError> {
    let spec: String = section(origin, key, value)?;
    let spec = spec.trim().to_owned();
    if spec.is_empty() {
        return Err(invalid(
            origin,
            key,
            "expected `auto`, a plugin name or a library path, got an empty string",
        ));
    }
    Ok(spec)
}

fn plugin_tables(
    origin: &str,
    value: Value,
) -> Result<BTreeMap<String, BTreeMap<String, String>>, ConfigError> {
    let Value::Table(plugins) = value else {
        return Err(invalid(
            origin,
            "plugins",
            format!(
                "expected a table of `[plugins.<name>]` tables, got a {}",
                value.type_str()
            ),
        ));
    };
    let mut out = BTreeMap::new();
    for (name, options) in plugins {
        let path = format!("plugins.{name}");
        let Value::Table(options) = options else {
            return Err(invalid(
                origin,
                &path,
                format!("expected a table of options, got a {}", options.type_str()),
            ));
        };
        let mut parsed = BTreeMap::new();
        for (key, value) in options {
            let text = match value {
                Value::String(text) => text,
                Value::Integer(number) => number.to_string(),
                // Debug keeps a float a float: `1.0` stays "1.0", where Display gives "1",
                // which a plugin reads as an integer (a capacity of 1.0, the whole memory,
                // became one byte).
                Value::Float(number) => format!("{number:?}"),
                Value::Boolean(flag) => flag.to_string(),
                other => {
                    return Err(invalid(
                        origin,
                        &format!("{path}.{key}"),
                        format!(
                            "plugin options are strings, integers, floats or booleans, got a {}",
                            other.type_str()
                        ),
                    ));
                }
            };
            parsed.insert(key, text);
        }
        out.insert(name, parsed);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(text, "test.toml")
    }

    #[test]
    fn defaults_when_empty() {
        let config = parse("").unwrap();
        assert_eq!(config, Config::default());
        assert_eq!(config.device, "auto");
        assert_eq!(config.device_ordinal, 0);
    }

    #[test]
    fn every_key_is_read_and_options_become_text() {
        let config = parse(
            r#"
            device = "cpu"
            device_ordinal = 2
            plugin_dirs = ["/opt/a", "/opt/b"]
            [plugins.cpu]
            threads = 4
            capacity = "1GiB"
            fraction = 0.5
            whole = 1.0
            pinned = true
            "#,
        )
        .unwrap();
        assert_eq!(config.device, "cpu");
        assert_eq!(config.device_ordinal, 2);
        assert_eq!(
            config.plugin_dirs,
            vec![PathBuf::from("/opt/a"), PathBuf::from("/opt/b")]
        );
        let options: HashMap<String, String> = config.plugin_options("cpu").into_iter().collect();
        assert_eq!(options["threads"], "4");
        assert_eq!(options["capacity"], "1GiB");
        assert_eq!(options["fraction"], "0.5");
        assert_eq!(options["whole"], "1.0");
        assert_eq!(options["pinned"], "true");
        assert!(config.plugin_options("cuda").is_empty());
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = parse("devise = \"cpu\"").unwrap_err();
        assert!(matches!(err, ConfigError::UnknownKey { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("`devise`"), "{text}");
        assert!(text.contains("test.toml"), "{text}");
    }

    #[test]
    fn bad_values_name_the_key_path() {
        let err = parse("[plugins.cpu]\nthreads = [1, 2]").unwrap_err();
        assert!(matches!(err, ConfigError::InvalidValue { .. }), "{err:?}");
        assert!(err.to_string().contains("plugins.cpu.threads"), "{err}");

        let err = parse("device_ordinal = -1").unwrap_err();
        assert!(err.to_string().contains("`device_ordinal`"), "{err}");

        let err = parse("device = 3").unwrap_err();
        assert!(err.to_string().contains("`device`"), "{err}");

        let err = parse("device = \"  \"").unwrap_err();
        assert!(err.to_string().contains("`device`"), "{err}");

        let err = parse("plugin_dirs = \"/opt\"").unwrap_err();
        assert!(err.to_string().contains("`plugin_dirs`"), "{err}");

        let err = parse("plugins = 1").unwrap_err();
        assert!(err.to_string().contains("`plugins`"), "{err}");

        let err = parse("[plugins]\ncpu = 1").unwrap_err();
        assert!(err.to_string().contains("`plugins.cpu`"), "{err}");
    }

    #[test]
    fn scheduler_policy_section() {
        use crate::budget::Policy;
        assert_eq!(parse("").unwrap().scheduler_policy, None);
        let config = parse("[scheduler]\npolicy = \"progress\"").unwrap();
        assert_eq!(config.scheduler_policy, Some(Policy::Progress));
        let err = parse("[scheduler]\npolcy = \"vllm\"").unwrap_err();
        assert!(err.to_string().contains("scheduler.polcy"), "{err}");
        let err = parse("[scheduler]\npolicy = \"fifo\"").unwrap_err();
        assert!(err.to_string().contains("`progress`"), "{err}");
    }

    #[test]
    fn admission_section() {
        assert_eq!(parse("").unwrap().admission.max_queued_requests, None);
        let config =
            parse("[admission]\nmax_queued_requests = 64\nmax_pending_tokens = 9000").unwrap();
        assert_eq!(config.admission.max_queued_requests, Some(64));
        assert_eq!(config.admission.max_pending_tokens, Some(9000));
        let err = parse("[admission]\nmax_queued_requests = 0").unwrap_err();
        assert!(
            err.to_string().contains("admission.max_queued_requests")
                && err.to_string().contains("at least 1, got 0"),
            "{err}"
        );
        let err = parse("[admission]\nmax_queue = 1").unwrap_err();
        assert!(err.to_string().contains("admission.max_queue"), "{err}");
    }

    #[test]
    fn syntax_errors_name_the_file() {
        let err = parse("device = ").unwrap_err();
        assert!(matches!(err, ConfigError::Syntax { .. }), "{err:?}");
        assert!(err.to_string().contains("test.toml"), "{err}");
    }

    #[test]
    fn sections_report_unknown_fields_with_their_path() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Scheduler {
            max_num_seqs: u32,
        }
        let value: Table = "max_num_seq = 4".parse().unwrap();
        let err = section::<Scheduler>("f", "scheduler", Value::Table(value)).unwrap_err();
        assert!(matches!(err, ConfigError::UnknownKey { .. }), "{err:?}");
        assert!(err.to_string().contains("scheduler.max_num_seq"), "{err}");
    }

    #[test]
    fn file_then_flags_then_environment() {
        let mut config =
            parse("device = \"cuda\"\ndevice_ordinal = 1\nplugin_dirs = [\"/f\"]").unwrap();
        assert_eq!(config.device, "cuda");

        config.apply_overrides(&Overrides {
            device: Some("ascend".into()),
            device_ordinal: None,
            plugin_dirs: vec!["/flag".into()],
        });
        assert_eq!(config.device, "ascend");
        assert_eq!(
            config.device_ordinal, 1,
            "an absent flag keeps the file's value"
        );
        assert_eq!(
            config.plugin_dirs,
            vec![PathBuf::from("/flag"), PathBuf::from("/f")]
        );

        config.apply_env(|_| None).unwrap();
        assert_eq!(
            config.device, "ascend",
            "an unset variable keeps the flag's value"
        );

        config
            .apply_env(|name| (name == DEVICE_ENV).then(|| "cpu".to_owned()))
            .unwrap();
        assert_eq!(config.device, "cpu");

        let err = config
            .apply_env(|name| (name == DEVICE_ENV).then(String::new))
            .unwrap_err();
        assert!(err.to_string().contains(DEVICE_ENV), "{err}");
    }

    #[test]
    fn relative_plugin_dirs_follow_the_file() {
        let dir = std::env::temp_dir().join(format!("iris-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("iris.toml");
        std::fs::write(&file, "plugin_dirs = [\"plugins\", \"/abs\"]\n").unwrap();
        let config = Config::load(Some(&file)).unwrap();
        assert_eq!(
            config.plugin_dirs,
            vec![dir.join("plugins"), PathBuf::from("/abs")]
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let err = Config::load(Some(&dir.join("missing.toml"))).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }), "{err:?}");
    }

    #[test]
    fn a_relative_device_path_follows_the_file() {
        let dir = std::env::temp_dir().join(format!("iris-config-device-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("iris.toml");
        let read = |device: &str| {
            std::fs::write(&file, format!("device = \"{device}\"\n")).unwrap();
            Config::load(Some(&file)).unwrap().device
        };
        let beside = |name: &str| dir.join(name).display().to_string();
        assert_eq!(
            read("plugins/libiris_device_x.so"),
            beside("plugins/libiris_device_x.so")
        );
        assert_eq!(read("libiris_device_x.so"), beside("libiris_device_x.so"));
        assert_eq!(read("/opt/libiris_device_x.so"), "/opt/libiris_device_x.so");
        // Names and `auto` are not paths.
        assert_eq!(read("cuda"), "cuda");
        assert_eq!(read("auto"), "auto");
        // The flag keeps its own meaning: relative to the current folder.
        let mut config = Config::load(Some(&file)).unwrap();
        config.apply_overrides(&Overrides {
            device: Some("lib/libiris_device_y.so".to_owned()),
            ..Overrides::default()
        });
        assert_eq!(config.device, "lib/libiris_device_y.so");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
