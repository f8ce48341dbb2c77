//! The crate's one error type, and how each case reaches the host as a [`PluginError`].

use iris_plugin::abi::PluginError;
use thiserror::Error;

use crate::result::{AclError, AclnnStatus};

/// Everything that can go wrong between iris and CANN.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AscendError {
    /// An AscendCL runtime call returned an error.
    #[error("{function} failed: {code}{}", recent(message))]
    Acl {
        /// The C function.
        function: &'static str,
        /// Its return value.
        code: AclError,
        /// `aclGetRecentErrMsg()` right after the call (may be empty).
        message: String,
    },
    /// An aclnn call returned an error.
    #[error("{function} failed: {code}{}", recent(message))]
    Aclnn {
        /// The C function.
        function: &'static str,
        /// Its return value.
        code: AclnnStatus,
        /// `aclGetRecentErrMsg()` right after the call (may be empty).
        message: String,
    },
    /// A device allocation failed for lack of memory.
    #[error(
        "out of NPU memory: {function} of {requested} bytes failed with {code} ({free} of {total} bytes free){}",
        recent(message)
    )]
    OutOfMemory {
        /// The allocating function.
        function: &'static str,
        /// Its return value (207001 or 207018).
        code: AclError,
        /// Bytes asked for.
        requested: u64,
        /// Free device memory after the failure, as `aclrtGetMemInfo` reports it.
        free: u64,
        /// Total device memory.
        total: u64,
        /// `aclGetRecentErrMsg()` right after the call.
        message: String,
    },
    /// A library does not export a function iris needs.
    #[error("{function} is not exported by {library}")]
    MissingSymbol {
        /// The C function.
        function: &'static str,
        /// The library file searched, or the kind of library when none was found.
        library: String,
    },
    /// An op (or a dtype of it) this device cannot run.
    #[error("{op}: {reason}")]
    Unsupported {
        /// The ABI op or aclnn function.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// The runtime or the device cannot be used (no driver, stub libraries, no device).
    #[error("{0}")]
    Unavailable(String),
    /// A fault inside the plugin or an answer from CANN that breaks its contract.
    #[error("{0}")]
    Internal(String),
}

impl AscendError {
    /// A runtime call reported a task fault that leaves the stream in error (see
    /// [`AclError::is_task_fault`]).
    pub fn is_task_fault(&self) -> bool {
        matches!(self, AscendError::Acl { code, .. } if code.is_task_fault())
    }

    /// The [`ErrorCode`](iris_plugin::abi::ErrorCode) category of this error.
    pub fn to_plugin_error(&self) -> PluginError {
        let message = self.to_string();
        match self {
            AscendError::OutOfMemory { .. } => PluginError::out_of_memory(message),
            AscendError::Acl { code, .. } if code.is_out_of_memory() => {
                PluginError::out_of_memory(message)
            }
            AscendError::Acl { code, .. } if code.is_unavailable() => {
                PluginError::unavailable(message)
            }
            AscendError::Acl { code, .. } if code.is_unsupported() => {
                PluginError::unsupported(message)
            }
            // iris validated the arguments before the call; an op that still rejects them
            // does not support this combination of shapes and dtypes on this part.
            AscendError::Aclnn { code, .. } if code.is_invalid_parameter() => {
                PluginError::unsupported(message)
            }
            AscendError::MissingSymbol { .. } | AscendError::Unsupported { .. } => {
                PluginError::unsupported(message)
            }
            AscendError::Unavailable(_) => PluginError::unavailable(message),
            AscendError::Acl { .. } | AscendError::Aclnn { .. } | AscendError::Internal(_) => {
                PluginError::internal(message)
            }
        }
    }
}

impl From<AscendError> for PluginError {
    fn from(err: AscendError) -> PluginError {
        err.to_plugin_error()
    }
}

fn recent(message: &str) -> String {
    if message.trim().is_empty() {
        String::new()
    } else {
        format!(" ({})", message.trim())
    }
}

#[cfg(test)]
mod tests {
    use iris_plugin::abi::ErrorCode;

    use super::*;
    use crate::sys;

    fn acl(code: i32) -> AscendError {
        AscendError::Acl {
            function: "aclrtMalloc",
            code: AclError(code),
            message: "EE1001: device memory exhausted".into(),
        }
    }

    #[test]
    fn codes_map_to_categories() {
        let oom = acl(i32::try_from(sys::ACL_ERROR_RT_MEMORY_ALLOCATION).unwrap());
        assert_eq!(oom.to_plugin_error().code, ErrorCode::OUT_OF_MEMORY);
        let oom = acl(i32::try_from(sys::ACL_ERROR_RT_DEVICE_OOM).unwrap());
        assert_eq!(oom.to_plugin_error().code, ErrorCode::OUT_OF_MEMORY);
        let stub = acl(sys::ACL_ERROR_COMPILING_STUB_MODE);
        assert_eq!(stub.to_plugin_error().code, ErrorCode::UNAVAILABLE);
        let other = acl(i32::try_from(sys::ACL_ERROR_RT_AICORE_EXCEPTION).unwrap());
        assert_eq!(other.to_plugin_error().code, ErrorCode::INTERNAL);
        let rejected = AscendError::Aclnn {
            function: "aclnnMatmulGetWorkspaceSize",
            code: AclnnStatus(161_002),
            message: String::new(),
        };
        assert_eq!(rejected.to_plugin_error().code, ErrorCode::UNSUPPORTED);
    }

    #[test]
    fn messages_name_the_function_the_code_and_the_recent_message() {
        let text = acl(207_001).to_string();
        assert!(text.contains("aclrtMalloc"), "{text}");
        assert!(text.contains("207001"), "{text}");
        assert!(text.contains("ACL_ERROR_RT_MEMORY_ALLOCATION"), "{text}");
        assert!(text.contains("EE1001"), "{text}");
    }
}
