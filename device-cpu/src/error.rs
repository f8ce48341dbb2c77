//! Error helpers: every failure the CPU device reports names the argument at fault.

use iris_plugin::abi::PluginError;

/// An invalid-argument error for `op`, naming the problem.
pub(crate) fn invalid(op: &str, message: impl std::fmt::Display) -> PluginError {
    PluginError::invalid_argument(format!("{op}: {message}"))
}
