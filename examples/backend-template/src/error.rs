//! Error constructors. Every error carries a code the host acts on (out of memory lets it evict
//! and retry; invalid argument is a bug in the caller) and a message that names the operation
//! and the argument at fault.

use iris_plugin::abi::PluginError;

/// An invalid-argument error for `op`.
pub(crate) fn invalid(op: &str, message: impl std::fmt::Display) -> PluginError {
    PluginError::invalid_argument(format!("{op}: {message}"))
}

/// An out-of-memory error for `op`.
pub(crate) fn out_of_memory(op: &str, message: impl std::fmt::Display) -> PluginError {
    PluginError::out_of_memory(format!("{op}: {message}"))
}
