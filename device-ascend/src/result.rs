//! Status codes of AscendCL (`aclError`) and aclnn (`aclnnStatus`) as typed values.
//!
//! [`AclError::result`] and [`AclnnStatus::result`] turn a return value into a `Result`; the
//! safe layer ([`crate::runtime::Runtime::check`]) adds the function's name and
//! `aclGetRecentErrMsg()` to make an [`AscendError`](crate::error::AscendError). For example
//! `AclError(207_001)` displays as `ACL_ERROR_RT_MEMORY_ALLOCATION (207001)` and is out of
//! memory; `AclError(0).result()` is `Ok(())`.

use std::fmt;

use crate::sys;

/// First code of the runtime's task faults (`ACL_ERROR_RT_INTERNAL_ERROR`).
const TASK_FAULTS_FIRST: i32 = 507_000;
/// Last code of the range.
const TASK_FAULTS_LAST: i32 = 507_999;

/// An AscendCL status (`aclError`, an `int`); 0 is success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AclError(pub i32);

/// An aclnn status (`aclnnStatus`, an `int32_t`); 0 is success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AclnnStatus(pub i32);

impl AclError {
    /// `ACL_ERROR_RT_MEMORY_ALLOCATION`: the runtime's out-of-memory code.
    pub const MEMORY_ALLOCATION: AclError = AclError(rt(sys::ACL_ERROR_RT_MEMORY_ALLOCATION));
    /// `ACL_ERROR_RT_DEVICE_OOM`: device memory exhausted.
    pub const DEVICE_OOM: AclError = AclError(rt(sys::ACL_ERROR_RT_DEVICE_OOM));
    /// `ACL_ERROR_REPEAT_INITIALIZE`: `aclInit` was already called in this process.
    pub const REPEAT_INITIALIZE: AclError = AclError(sys::ACL_ERROR_REPEAT_INITIALIZE);
    /// `ACL_ERROR_COMPILING_STUB_MODE`: the library is one of the SDK's link stubs.
    pub const STUB_MODE: AclError = AclError(sys::ACL_ERROR_COMPILING_STUB_MODE);
    /// `ACL_ERROR_RT_NO_DEVICE`.
    pub const NO_DEVICE: AclError = AclError(rt(sys::ACL_ERROR_RT_NO_DEVICE));

    /// `Ok` for success, else the code.
    pub fn result(self) -> Result<(), AclError> {
        if self.0 == sys::ACL_SUCCESS {
            Ok(())
        } else {
            Err(self)
        }
    }

    /// The runtime ran out of device memory.
    pub fn is_out_of_memory(self) -> bool {
        self == Self::MEMORY_ALLOCATION
            || self == Self::DEVICE_OOM
            || self.0 == sys::ACL_ERROR_BAD_ALLOC
    }

    /// The driver, the device or a real runtime is missing, or the device is lost.
    pub fn is_unavailable(self) -> bool {
        self == Self::STUB_MODE
            || self == Self::NO_DEVICE
            || self.0 == rt(sys::ACL_ERROR_RT_INVALID_DEVICEID)
            || self.0 == rt(sys::ACL_ERROR_RT_LOST_HEARTBEAT)
            || self.0 == sys::ACL_ERROR_INVALID_DEVICE
    }

    /// A task fault (`rt_error_codes.h`'s 507xxx range: AI core and vector core exceptions,
    /// memory and DMA faults, timeouts). It leaves the stream in error: every later call on
    /// that stream fails until the stream is destroyed.
    pub fn is_task_fault(self) -> bool {
        (TASK_FAULTS_FIRST..=TASK_FAULTS_LAST).contains(&self.0)
    }

    /// The runtime does not support the request on this part.
    pub fn is_unsupported(self) -> bool {
        self.0 == rt(sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
            || self.0 == sys::ACL_ERROR_FEATURE_UNSUPPORTED
    }

    /// The constant's name in `acl_base_rt.h` or `rt_error_codes.h`, for the codes iris meets.
    pub fn name(self) -> Option<&'static str> {
        let code = self.0;
        let names: [(i32, &str); 25] = [
            (sys::ACL_ERROR_INVALID_PARAM, "ACL_ERROR_INVALID_PARAM"),
            (sys::ACL_ERROR_UNINITIALIZE, "ACL_ERROR_UNINITIALIZE"),
            (
                sys::ACL_ERROR_REPEAT_INITIALIZE,
                "ACL_ERROR_REPEAT_INITIALIZE",
            ),
            (
                sys::ACL_ERROR_COMPILING_STUB_MODE,
                "ACL_ERROR_COMPILING_STUB_MODE",
            ),
            (sys::ACL_ERROR_BAD_ALLOC, "ACL_ERROR_BAD_ALLOC"),
            (sys::ACL_ERROR_INVALID_DEVICE, "ACL_ERROR_INVALID_DEVICE"),
            (
                sys::ACL_ERROR_FEATURE_UNSUPPORTED,
                "ACL_ERROR_FEATURE_UNSUPPORTED",
            ),
            (
                rt(sys::ACL_ERROR_RT_PARAM_INVALID),
                "ACL_ERROR_RT_PARAM_INVALID",
            ),
            (
                rt(sys::ACL_ERROR_RT_INVALID_DEVICEID),
                "ACL_ERROR_RT_INVALID_DEVICEID",
            ),
            (
                rt(sys::ACL_ERROR_RT_CONTEXT_NULL),
                "ACL_ERROR_RT_CONTEXT_NULL",
            ),
            (
                rt(sys::ACL_ERROR_RT_ADDR_UNALIGNED),
                "ACL_ERROR_RT_ADDR_UNALIGNED",
            ),
            (
                rt(sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT),
                "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
            ),
            (
                rt(sys::ACL_ERROR_RT_MEMORY_ALLOCATION),
                "ACL_ERROR_RT_MEMORY_ALLOCATION",
            ),
            (
                rt(sys::ACL_ERROR_RT_MEMORY_FREE),
                "ACL_ERROR_RT_MEMORY_FREE",
            ),
            (rt(sys::ACL_ERROR_RT_NO_DEVICE), "ACL_ERROR_RT_NO_DEVICE"),
            (rt(sys::ACL_ERROR_RT_DEVICE_OOM), "ACL_ERROR_RT_DEVICE_OOM"),
            (
                rt(sys::ACL_ERROR_RT_INTERNAL_ERROR),
                "ACL_ERROR_RT_INTERNAL_ERROR",
            ),
            (
                rt(sys::ACL_ERROR_RT_LOST_HEARTBEAT),
                "ACL_ERROR_RT_LOST_HEARTBEAT",
            ),
            (
                rt(sys::ACL_ERROR_RT_MODEL_EXECUTE),
                "ACL_ERROR_RT_MODEL_EXECUTE",
            ),
            (
                rt(sys::ACL_ERROR_RT_AICORE_EXCEPTION),
                "ACL_ERROR_RT_AICORE_EXCEPTION",
            ),
            (
                rt(sys::ACL_ERROR_RT_AICORE_TRAP_EXCEPTION),
                "ACL_ERROR_RT_AICORE_TRAP_EXCEPTION",
            ),
            (
                rt(sys::ACL_ERROR_RT_VECTOR_CORE_EXCEPTION),
                "ACL_ERROR_RT_VECTOR_CORE_EXCEPTION",
            ),
            (
                rt(sys::ACL_ERROR_RT_DEVICE_MEM_ERROR),
                "ACL_ERROR_RT_DEVICE_MEM_ERROR",
            ),
            (
                rt(sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT),
                "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT",
            ),
            (
                rt(sys::ACL_ERROR_RT_AICORE_TIMEOUT),
                "ACL_ERROR_RT_AICORE_TIMEOUT",
            ),
        ];
        names
            .iter()
            .find(|(value, _)| *value == code)
            .map(|(_, name)| *name)
    }
}

impl fmt::Display for AclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "aclError {}", self.0),
        }
    }
}

impl AclnnStatus {
    /// `ACLNN_ERR_PARAM_NULLPTR`.
    pub const PARAM_NULLPTR: AclnnStatus = AclnnStatus(161_001);
    /// `ACLNN_ERR_PARAM_INVALID`: the op rejects the arguments (shape, dtype, part).
    pub const PARAM_INVALID: AclnnStatus = AclnnStatus(161_002);
    /// `ACLNN_ERR_RUNTIME_ERROR`.
    pub const RUNTIME_ERROR: AclnnStatus = AclnnStatus(361_001);

    /// `Ok` for success, else the status.
    pub fn result(self) -> Result<(), AclnnStatus> {
        if self.0 == 0 { Ok(()) } else { Err(self) }
    }

    /// The op rejected its arguments.
    pub fn is_invalid_parameter(self) -> bool {
        self == Self::PARAM_INVALID
    }

    /// The family of the status as aclnn's documentation names it.
    pub fn name(self) -> &'static str {
        match self.0 {
            161_001 => "ACLNN_ERR_PARAM_NULLPTR",
            161_002 => "ACLNN_ERR_PARAM_INVALID",
            361_001 => "ACLNN_ERR_RUNTIME_ERROR",
            561_000..=561_999 => "ACLNN_ERR_INNER",
            _ => "aclnnStatus",
        }
    }
}

impl fmt::Display for AclnnStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// `rt_error_codes.h` defines its codes as unsigned macros; every one fits in an `int`.
const fn rt(code: u32) -> i32 {
    // All runtime codes are six-digit decimals, far below i32::MAX.
    #[allow(clippy::cast_possible_wrap)]
    let code = code as i32;
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_ok_and_codes_have_names() {
        assert!(AclError(0).result().is_ok());
        assert_eq!(AclError(207_001).result(), Err(AclError::MEMORY_ALLOCATION));
        assert!(AclError(207_018).is_out_of_memory());
        assert_eq!(
            AclError(100_039).to_string(),
            "ACL_ERROR_COMPILING_STUB_MODE (100039)"
        );
        assert_eq!(
            AclError(107_008).to_string(),
            "ACL_ERROR_RT_ADDR_UNALIGNED (107008)"
        );
        assert_eq!(AclError(42).to_string(), "aclError 42");
        assert!(AclnnStatus(0).result().is_ok());
        assert_eq!(AclnnStatus(561_103).name(), "ACLNN_ERR_INNER");
    }
}
