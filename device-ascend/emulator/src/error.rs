//! Status codes the emulation returns (values from CANN's headers) and the error that carries
//! one with its message for `aclGetRecentErrMsg()`.

use std::cell::RefCell;
use std::ffi::CString;

/// Codes, as `acl_base_rt.h`, `rt_error_codes.h` and aclnn's documentation define them.
pub mod codes {
    /// `ACL_SUCCESS`.
    pub const SUCCESS: i32 = 0;
    /// `ACL_ERROR_INVALID_PARAM`.
    pub const INVALID_PARAM: i32 = 100_000;
    /// `ACL_ERROR_UNINITIALIZE`.
    pub const UNINITIALIZE: i32 = 100_001;
    /// `ACL_ERROR_REPEAT_INITIALIZE`.
    pub const REPEAT_INITIALIZE: i32 = 100_002;
    /// `ACL_ERROR_COMPILING_STUB_MODE`.
    pub const STUB_MODE: i32 = 100_039;
    /// `ACL_ERROR_RT_PARAM_INVALID`.
    pub const RT_PARAM_INVALID: i32 = 107_000;
    /// `ACL_ERROR_RT_INVALID_DEVICEID`.
    pub const RT_INVALID_DEVICEID: i32 = 107_001;
    /// `ACL_ERROR_RT_CONTEXT_NULL`.
    pub const RT_CONTEXT_NULL: i32 = 107_002;
    /// `ACL_ERROR_RT_STREAM_CONTEXT`.
    pub const RT_STREAM_CONTEXT: i32 = 107_003;
    /// `ACL_ERROR_RT_ADDR_UNALIGNED`.
    pub const RT_ADDR_UNALIGNED: i32 = 107_008;
    /// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`.
    pub const RT_FEATURE_NOT_SUPPORT: i32 = 207_000;
    /// `ACL_ERROR_RT_MEMORY_ALLOCATION`.
    pub const RT_MEMORY_ALLOCATION: i32 = 207_001;
    /// `ACL_ERROR_RT_NO_EVENT_RESOURCE`.
    pub const RT_NO_EVENT_RESOURCE: i32 = 207_007;
    /// `ACL_ERROR_RT_MEMORY_FREE`.
    pub const RT_MEMORY_FREE: i32 = 207_002;
    /// `ACL_ERROR_RT_INTERNAL_ERROR`.
    pub const RT_INTERNAL_ERROR: i32 = 507_000;
    /// `ACL_ERROR_RT_AICORE_EXCEPTION`.
    pub const RT_AICORE_EXCEPTION: i32 = 507_015;
    /// `ACL_ERROR_RT_DEVICE_MEM_ERROR`.
    pub const RT_DEVICE_MEM_ERROR: i32 = 507_053;
    /// `ACLNN_ERR_PARAM_NULLPTR`.
    pub const ACLNN_PARAM_NULLPTR: i32 = 161_001;
    /// `ACLNN_ERR_PARAM_INVALID`.
    pub const ACLNN_PARAM_INVALID: i32 = 161_002;
    /// `ACLNN_ERR_INNER`.
    pub const ACLNN_INNER: i32 = 561_000;

    /// Whether `code` is a task fault of the 507xxx range (`rt_error_codes.h`: AI core and
    /// vector core exceptions, memory and DMA faults, timeouts), which leaves its stream in
    /// error.
    pub fn is_task_fault(code: i32) -> bool {
        (507_000..508_000).contains(&code)
    }
}

/// A failure: a status code and what `aclGetRecentErrMsg()` then says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmuError {
    /// The status code.
    pub code: i32,
    /// The message.
    pub message: String,
}

impl EmuError {
    /// An error with a code and a message.
    pub fn new(code: i32, message: impl Into<String>) -> EmuError {
        EmuError {
            code,
            message: message.into(),
        }
    }
}

thread_local! {
    static RECENT: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Records `err` as this thread's recent message and returns its code.
pub fn report(err: &EmuError) -> i32 {
    let text = format!("EE9999: emulated CANN: {}", err.message).replace('\0', " ");
    RECENT.with(|recent| *recent.borrow_mut() = CString::new(text).ok());
    err.code
}

/// `aclGetRecentErrMsg()`: the last message of this thread, or null.
pub fn recent() -> *const std::ffi::c_char {
    RECENT.with(|recent| {
        recent
            .borrow()
            .as_ref()
            .map_or(std::ptr::null(), |text| text.as_ptr())
    })
}
