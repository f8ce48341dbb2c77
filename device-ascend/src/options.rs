//! The device's options, from the `[plugins.ascend]` table of the config.

use iris_plugin::abi::PluginError;

/// How attention runs (option `attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionMode {
    /// The fused op where the part, dtype and op library allow it, else composed.
    Auto,
    /// Always `aclnnFlashAttentionVarLenScore` (an error where it cannot run).
    Fused,
    /// Always batched matmul, softmax, batched matmul.
    Composed,
}

/// Options of [`crate::AscendDevice::open`], from the `[plugins.ascend]` table of the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AscendOptions {
    /// `attention = "auto" | "fused" | "composed"` (default `auto`).
    pub attention: AttentionMode,
}

impl AscendOptions {
    /// Parses `key = value` options; unknown keys are errors naming the key.
    pub fn parse(pairs: &[(&str, &str)]) -> Result<AscendOptions, PluginError> {
        let mut options = AscendOptions {
            attention: AttentionMode::Auto,
        };
        for (key, value) in pairs {
            match *key {
                "attention" => {
                    options.attention = match value.trim() {
                        "auto" => AttentionMode::Auto,
                        "fused" => AttentionMode::Fused,
                        "composed" => AttentionMode::Composed,
                        other => {
                            return Err(PluginError::invalid_argument(format!(
                                "open: option `attention`: expected `auto`, `fused` or `composed`, got `{other}`"
                            )));
                        }
                    };
                }
                other => {
                    return Err(PluginError::invalid_argument(format!(
                        "open: unknown option `{other}` (known: attention)"
                    )));
                }
            }
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_name_unknown_keys() {
        let options = AscendOptions::parse(&[("attention", "composed")]).unwrap();
        assert_eq!(options.attention, AttentionMode::Composed);
        let err = AscendOptions::parse(&[("attention", "sometimes")]).unwrap_err();
        assert!(err.message.contains("`attention`"), "{}", err.message);
        let err = AscendOptions::parse(&[("threads", "2")]).unwrap_err();
        assert!(err.message.contains("`threads`"), "{}", err.message);
    }
}
