//! `--ec-transfer-config`: vLLM's `ECTransferConfig` JSON, parsed at the edge into typed values.
//!
//! The schema is vLLM 0.33's (`vllm/config/ec_transfer.py`): `ec_connector`, `ec_role`,
//! `ec_connector_extra_config`, `ec_connector_module_path`, `engine_id`, `ec_buffer_device`,
//! `ec_buffer_size`, `ec_ip`, `ec_port`. iris implements two connectors, one per configuration:
//!
//! - the shared-storage connector (`ECExampleConnector`) as a producer (`ec_producer`, or
//!   `ec_both`, under which iris also reads entries already in the store instead of encoding them
//!   again);
//! - the Mooncake push connector (`ECMooncakeConnector`) as a producer (`ec_producer`): each
//!   request names its consumer, and iris writes the rows into the consumer's receive buffer over
//!   Mooncake's TCP transport (see [`crate::mooncake`]).
//!
//! Anything else is refused with an error that names what is supported: a key iris does not
//! know, a connector or role it does not implement, an extra-config key the connector does not
//! read.
//!
//! `engine_id`, `ec_buffer_device`, `ec_buffer_size`, `ec_ip` and `ec_port` are accepted with
//! vLLM's types so that one JSON can configure every instance of a deployment; they describe a
//! consumer's receive side (or nothing, for shared storage), and iris's producers read none of
//! them.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

/// vLLM's name of the shared-storage connector.
pub const SHARED_STORAGE_CONNECTOR: &str = "ECExampleConnector";
/// vLLM's name of the Mooncake push connector.
pub const MOONCAKE_CONNECTOR: &str = "ECMooncakeConnector";
/// The connectors vLLM 0.33 ships that iris does not implement.
const KNOWN_UNSUPPORTED_CONNECTORS: [&str; 1] = ["ECCPUConnector"];
/// `control_timeout_s` when the extra config does not set it (vLLM's default).
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(30);
/// The extra-config keys iris's Mooncake producer reads.
const MOONCAKE_KEYS: &str = "control_timeout_s, mooncake_protocol (\"tcp\")";
/// `shared_storage_path` when the extra config does not set it (vLLM's default).
pub const DEFAULT_SHARED_STORAGE_PATH: &str = "/tmp";

/// What an instance does with encoder outputs (vLLM's `ec_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EcRole {
    /// Encodes and publishes (`ec_producer`).
    Producer,
    /// Publishes, and reads what is already published (`ec_both`).
    Both,
}

impl EcRole {
    /// vLLM's spelling.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Producer => "ec_producer",
            Self::Both => "ec_both",
        }
    }
}

impl fmt::Display for EcRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The connector a configuration selects, with its own settings.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectorConfig {
    /// `ECExampleConnector`: one safetensors file per item under a shared directory.
    SharedStorage {
        /// `ec_connector_extra_config.shared_storage_path` (default `/tmp`, as vLLM).
        path: PathBuf,
    },
    /// `ECMooncakeConnector`: rows pushed into each request's consumer over Mooncake's TCP
    /// transport.
    Mooncake(MooncakeSettings),
}

/// The producer settings of `ECMooncakeConnector` that iris reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MooncakeSettings {
    /// `control_timeout_s`: the limit of one control exchange, one handshake and one write's
    /// status (default 30 s, as vLLM).
    pub control_timeout: Duration,
}

impl Default for MooncakeSettings {
    fn default() -> Self {
        Self {
            control_timeout: DEFAULT_CONTROL_TIMEOUT,
        }
    }
}

impl ConnectorConfig {
    /// vLLM's class name of the connector.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Self::SharedStorage { .. } => SHARED_STORAGE_CONNECTOR,
            Self::Mooncake(_) => MOONCAKE_CONNECTOR,
        }
    }
}

/// A checked `--ec-transfer-config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EcTransferConfig {
    /// The connector and its settings.
    pub connector: ConnectorConfig,
    /// The instance's role.
    pub role: EcRole,
    /// `engine_id` when given (vLLM makes up a random one otherwise); shown in `server_info`.
    pub engine_id: Option<String>,
}

/// Why a `--ec-transfer-config` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Not JSON, or not a JSON object.
    #[error("--ec-transfer-config is not a JSON object: {0}")]
    NotAnObject(String),
    /// A top-level key vLLM's schema does not have.
    #[error(
        "--ec-transfer-config: unknown key `{0}` (keys: ec_connector, ec_role, ec_connector_extra_config, ec_connector_module_path, engine_id, ec_buffer_device, ec_buffer_size, ec_ip, ec_port)"
    )]
    UnknownKey(String),
    /// A key with a value of the wrong type.
    #[error("--ec-transfer-config: `{key}` must be {expected}, got {got}")]
    WrongType {
        /// The key.
        key: String,
        /// What the schema wants.
        expected: &'static str,
        /// The value given.
        got: String,
    },
    /// No `ec_connector`.
    #[error(
        "--ec-transfer-config: `ec_connector` is required; iris supports \"ECExampleConnector\" and \"ECMooncakeConnector\""
    )]
    MissingConnector,
    /// A connector iris does not implement.
    #[error(
        "--ec-transfer-config: ec_connector {0:?} is not supported by iris; supported: \"ECExampleConnector\" (shared storage), \"ECMooncakeConnector\" (push over Mooncake's TCP transport)"
    )]
    UnsupportedConnector(String),
    /// A connector name vLLM does not ship either.
    #[error(
        "--ec-transfer-config: unknown ec_connector {0:?}; iris supports \"ECExampleConnector\" (shared storage) and \"ECMooncakeConnector\" (push over Mooncake's TCP transport)"
    )]
    UnknownConnector(String),
    /// `ECMooncakeConnector` with a role other than `ec_producer`.
    #[error(
        "--ec-transfer-config: ECMooncakeConnector with ec_role {0} is not supported: iris pushes as an encoder, use \"ec_producer\""
    )]
    MooncakeRole(String),
    /// `mooncake_protocol` other than `tcp`.
    #[error(
        "--ec-transfer-config: mooncake_protocol {0:?} is not supported: iris writes over Mooncake's TCP transport only; set \"tcp\" and start the consumers with MC_FORCE_TCP=1"
    )]
    MooncakeProtocol(String),
    /// A value out of range.
    #[error("--ec-transfer-config: {0}")]
    Invalid(String),
    /// No `ec_role`, or one iris does not implement.
    #[error(
        "--ec-transfer-config: ec_role {0} is not supported; iris is an encoder instance: use \"ec_producer\" or \"ec_both\""
    )]
    UnsupportedRole(String),
    /// `ec_connector_module_path`: an out-of-tree Python connector.
    #[error(
        "--ec-transfer-config: ec_connector_module_path loads a Python connector, which iris cannot run; remove it"
    )]
    ModulePath,
    /// An extra-config key the connector does not read.
    #[error(
        "--ec-transfer-config: ec_connector_extra_config key `{key}` is not read by {connector} (keys it reads: {known})"
    )]
    UnknownExtraKey {
        /// The key.
        key: String,
        /// The connector.
        connector: &'static str,
        /// The keys it reads.
        known: &'static str,
    },
}

impl EcTransferConfig {
    /// Parses and checks vLLM's JSON.
    ///
    /// ```
    /// use iris_ec::config::{ConnectorConfig, EcRole, EcTransferConfig};
    /// let config = EcTransferConfig::parse(
    ///     r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
    ///         "ec_connector_extra_config": {"shared_storage_path": "/mnt/ec"}}"#,
    /// )
    /// .unwrap();
    /// assert_eq!(config.role, EcRole::Producer);
    /// assert_eq!(config.connector, ConnectorConfig::SharedStorage { path: "/mnt/ec".into() });
    /// assert!(EcTransferConfig::parse(r#"{"ec_connector": "ECCPUConnector", "ec_role": "ec_producer"}"#).is_err());
    /// ```
    ///
    /// # Errors
    /// [`ConfigError`] naming the key and what is supported.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(json).map_err(|e| ConfigError::NotAnObject(e.to_string()))?;
        let Value::Object(map) = value else {
            return Err(ConfigError::NotAnObject(format!("got {value}")));
        };
        Self::from_map(&map)
    }

    /// Checks an already parsed JSON object (e.g. a TOML table converted to JSON).
    ///
    /// # Errors
    /// As [`EcTransferConfig::parse`].
    pub fn from_map(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        for (key, value) in map {
            match key.as_str() {
                "ec_connector"
                | "ec_role"
                | "engine_id"
                | "ec_connector_module_path"
                | "ec_buffer_device" => optional_string(key, value)?,
                "ec_ip" => string(key, value)?,
                "ec_buffer_size" => number(key, value)?,
                "ec_port" => integer(key, value)?,
                "ec_connector_extra_config" => {
                    if !value.is_object() {
                        return Err(wrong(key, "an object", value));
                    }
                }
                _ => return Err(ConfigError::UnknownKey(key.clone())),
            }
        }
        let text = |key: &str| map.get(key).and_then(Value::as_str);
        if text("ec_connector_module_path").is_some() {
            return Err(ConfigError::ModulePath);
        }
        let extra = map
            .get("ec_connector_extra_config")
            .and_then(Value::as_object);
        let connector = match text("ec_connector") {
            None => return Err(ConfigError::MissingConnector),
            Some(SHARED_STORAGE_CONNECTOR) => shared_storage(extra)?,
            Some(MOONCAKE_CONNECTOR) => ConnectorConfig::Mooncake(mooncake(extra)?),
            Some(other) if KNOWN_UNSUPPORTED_CONNECTORS.contains(&other) => {
                return Err(ConfigError::UnsupportedConnector(other.to_owned()));
            }
            Some(other) => return Err(ConfigError::UnknownConnector(other.to_owned())),
        };
        let role = match text("ec_role") {
            Some("ec_producer") => EcRole::Producer,
            Some("ec_both") => EcRole::Both,
            Some(other) => return Err(ConfigError::UnsupportedRole(format!("{other:?}"))),
            None => return Err(ConfigError::UnsupportedRole("(missing)".to_owned())),
        };
        if matches!(connector, ConnectorConfig::Mooncake(_)) && role != EcRole::Producer {
            return Err(ConfigError::MooncakeRole(format!("{:?}", role.as_str())));
        }
        Ok(Self {
            connector,
            role,
            engine_id: text("engine_id").map(str::to_owned),
        })
    }
}

fn shared_storage(extra: Option<&Map<String, Value>>) -> Result<ConnectorConfig, ConfigError> {
    let mut path = PathBuf::from(DEFAULT_SHARED_STORAGE_PATH);
    for (key, value) in extra.into_iter().flatten() {
        match key.as_str() {
            "shared_storage_path" => match value {
                Value::String(s) if !s.is_empty() => path = PathBuf::from(s),
                other => return Err(wrong(key, "a non-empty path string", other)),
            },
            _ => {
                return Err(ConfigError::UnknownExtraKey {
                    key: key.clone(),
                    connector: SHARED_STORAGE_CONNECTOR,
                    known: "shared_storage_path",
                });
            }
        }
    }
    Ok(ConnectorConfig::SharedStorage { path })
}

fn mooncake(extra: Option<&Map<String, Value>>) -> Result<MooncakeSettings, ConfigError> {
    let mut settings = MooncakeSettings::default();
    for (key, value) in extra.into_iter().flatten() {
        match key.as_str() {
            "control_timeout_s" => {
                // vLLM takes anything `float()` takes: a number or a numeric string.
                let seconds = match value {
                    Value::Number(n) => n.as_f64(),
                    Value::String(s) => s.trim().parse::<f64>().ok(),
                    _ => None,
                }
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
                .ok_or_else(|| wrong(key, "a number of seconds in (0, 86400]", value))?;
                settings.control_timeout = Duration::from_secs_f64(seconds);
            }
            "mooncake_protocol" => match value {
                Value::String(s) if s == "tcp" => {}
                Value::String(s) => return Err(ConfigError::MooncakeProtocol(s.clone())),
                other => return Err(wrong(key, "\"tcp\"", other)),
            },
            _ => {
                return Err(ConfigError::UnknownExtraKey {
                    key: key.clone(),
                    connector: MOONCAKE_CONNECTOR,
                    known: MOONCAKE_KEYS,
                });
            }
        }
    }
    Ok(settings)
}

fn wrong(key: &str, expected: &'static str, got: &Value) -> ConfigError {
    ConfigError::WrongType {
        key: key.to_owned(),
        expected,
        got: got.to_string(),
    }
}

fn optional_string(key: &str, value: &Value) -> Result<(), ConfigError> {
    match value {
        Value::Null | Value::String(_) => Ok(()),
        other => Err(wrong(key, "a string or null", other)),
    }
}

fn string(key: &str, value: &Value) -> Result<(), ConfigError> {
    match value {
        Value::String(_) => Ok(()),
        other => Err(wrong(key, "a string", other)),
    }
}

fn number(key: &str, value: &Value) -> Result<(), ConfigError> {
    match value {
        Value::Number(_) => Ok(()),
        other => Err(wrong(key, "a number", other)),
    }
}

fn integer(key: &str, value: &Value) -> Result<(), ConfigError> {
    if value.as_i64().is_some() {
        Ok(())
    } else {
        Err(wrong(key, "an integer", value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<EcTransferConfig, ConfigError> {
        EcTransferConfig::parse(json)
    }

    #[test]
    fn the_proxy_examples_config_is_accepted() {
        // As vLLM's disagg_1e1pd_example.sh starts its encoder.
        let config = parse(
            r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec_cache"},
                "engine_id": "e0", "ec_ip": "127.0.0.1", "ec_port": 14579,
                "ec_buffer_device": "cuda", "ec_buffer_size": 1e9}"#,
        )
        .unwrap();
        assert_eq!(
            config,
            EcTransferConfig {
                connector: ConnectorConfig::SharedStorage {
                    path: "/tmp/ec_cache".into()
                },
                role: EcRole::Producer,
                engine_id: Some("e0".into()),
            }
        );
    }

    #[test]
    fn a_mooncake_producer_reads_its_timeout_and_tcp() {
        let config = parse(
            r#"{"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
                "ec_connector_extra_config": {"control_timeout_s": "2.5", "mooncake_protocol": "tcp"},
                "ec_ip": "10.0.0.2", "ec_port": 15000, "ec_buffer_size": 1e9}"#,
        )
        .unwrap();
        assert_eq!(
            config.connector,
            ConnectorConfig::Mooncake(MooncakeSettings {
                control_timeout: Duration::from_millis(2500)
            })
        );
        let plain =
            parse(r#"{"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer"}"#).unwrap();
        assert_eq!(
            plain.connector,
            ConnectorConfig::Mooncake(MooncakeSettings::default())
        );
        assert_eq!(plain.connector.name(), MOONCAKE_CONNECTOR);
    }

    #[test]
    fn the_storage_path_defaults_to_tmp_as_in_vllm() {
        let config =
            parse(r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_both"}"#).unwrap();
        assert_eq!(config.role, EcRole::Both);
        assert_eq!(
            config.connector,
            ConnectorConfig::SharedStorage {
                path: "/tmp".into()
            }
        );
    }

    #[test]
    fn what_iris_does_not_implement_is_refused_by_name() {
        let cases = [
            ("[]", "not a JSON object"),
            (
                r#"{"ec_role": "ec_producer"}"#,
                "`ec_connector` is required",
            ),
            (
                r#"{"ec_connector": "ECCPUConnector", "ec_role": "ec_producer"}"#,
                "\"ECCPUConnector\" is not supported",
            ),
            (
                r#"{"ec_connector": "ECMooncakeConnector", "ec_role": "ec_both"}"#,
                "ECMooncakeConnector with ec_role \"ec_both\" is not supported",
            ),
            (
                r#"{"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
                    "ec_connector_extra_config": {"mooncake_protocol": "rdma"}}"#,
                "MC_FORCE_TCP=1",
            ),
            (
                r#"{"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
                    "ec_connector_extra_config": {"control_timeout_s": 0}}"#,
                "`control_timeout_s` must be a number of seconds",
            ),
            (
                r#"{"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
                    "ec_connector_extra_config": {"push_wait_timeout_s": 5}}"#,
                "key `push_wait_timeout_s` is not read by ECMooncakeConnector",
            ),
            (
                r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer"}"#,
                "ec_role \"ec_consumer\" is not supported",
            ),
            (
                r#"{"ec_connector": "ECExampleConnector"}"#,
                "ec_role (missing) is not supported",
            ),
            (
                r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer", "ec_mode": 1}"#,
                "unknown key `ec_mode`",
            ),
            (
                r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                    "ec_connector_extra_config": {"shared_storage_path": "/x", "ttl": 3}}"#,
                "key `ttl` is not read by ECExampleConnector",
            ),
            (
                r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                    "ec_connector_module_path": "my.module"}"#,
                "ec_connector_module_path",
            ),
            (
                r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer", "ec_port": "x"}"#,
                "`ec_port` must be an integer",
            ),
            (
                r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                    "ec_connector_extra_config": {"shared_storage_path": ""}}"#,
                "a non-empty path string",
            ),
        ];
        for (json, needle) in cases {
            let err = parse(json).unwrap_err().to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
