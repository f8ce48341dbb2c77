//! The runtime calls outside streams, contexts and events (those are in [`crate::stream`]):
//! device count, SoC name, versions, memory figures, allocation, copies and fills. Each
//! resolves its symbol, checks its code and names the function in its error; the callers in
//! [`crate::memory`], [`crate::device`] and the crate root hold no raw `sys` calls.
//!
//! Calls that take device or host addresses stay `unsafe fn`: the runtime cannot check that
//! an address is live or that a range lies inside its block, so the caller keeps that
//! contract, as each function's `# Safety` says.

use std::ffi::{CStr, c_char, c_void};

use crate::error::AscendError;
use crate::result::AclError;
use crate::runtime::Runtime;
use crate::sys;

/// A runtime string (`aclrtGetSocName`, `aclGetRecentErrMsg`, a version field), copied and
/// trimmed; `None` when null or empty.
///
/// # Safety
/// `ptr` is null or a NUL-terminated string that stays valid during the call.
pub(crate) unsafe fn text(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract); copied at once.
    let text = unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .trim()
        .to_owned();
    (!text.is_empty()).then_some(text)
}

/// `usize` for a byte count, or the error naming it.
fn size(bytes: u64) -> Result<usize, AscendError> {
    usize::try_from(bytes)
        .map_err(|_| AscendError::Internal(format!("{bytes} bytes do not fit in memory")))
}

impl Runtime {
    /// `aclrtGetDeviceCount`: the raw code on failure, so that the caller can tell the link
    /// stubs (100039) from other failures.
    pub fn device_count(&self) -> Result<u32, Result<AclError, AscendError>> {
        let get = self
            .acl()
            .aclrtGetDeviceCount
            .as_ref()
            .map_err(|_| Err(self.missing("aclrtGetDeviceCount")))?;
        let mut count = 0u32;
        // SAFETY: `count` is a valid out-pointer.
        let code = AclError(unsafe { get(&mut count) });
        code.result().map(|()| count).map_err(Ok)
    }

    /// `aclrtGetSocName` (`Ascend910B3`), when the runtime has it.
    pub fn soc_name(&self) -> Option<String> {
        let get = self.acl().aclrtGetSocName.as_ref().ok()?;
        // SAFETY: no arguments; returns a static C string owned by the runtime, or null.
        unsafe { text(get()) }
    }

    /// The CANN release (`8.5.0`, `8.0.RC3`): `aclsysGetCANNVersion` for the CANN package,
    /// else for the runtime package. `None` where the runtime has neither (the function is
    /// deprecated from CANN 8.5 and may go) or no version file is installed.
    pub fn cann_version(&self) -> Option<String> {
        let get = self.acl().aclsysGetCANNVersion.as_ref().ok()?;
        [
            sys::aclCANNPackageName::ACL_PKG_NAME_CANN,
            sys::aclCANNPackageName::ACL_PKG_NAME_RUNTIME,
        ]
        .into_iter()
        .find_map(|name| {
            // SAFETY: plain data; all zeros is a valid value.
            let mut version: sys::aclCANNPackageVersion = unsafe { std::mem::zeroed() };
            // SAFETY: `version` is a valid out-pointer of the header's layout.
            let code = unsafe { get(name, &mut version) };
            // The last byte stays 0 whatever the runtime wrote before it.
            version.version[version.version.len() - 1] = 0;
            // SAFETY: a NUL-terminated array (its last byte was set to 0 above).
            (code == sys::ACL_SUCCESS)
                .then(|| unsafe { text(version.version.as_ptr()) })
                .flatten()
        })
    }

    /// `aclrtGetVersion`: the AscendCL API version (`1.0.0`), deprecated and distinct from the
    /// CANN release.
    pub fn acl_api_version(&self) -> Option<String> {
        let get = self.acl().aclrtGetVersion.as_ref().ok()?;
        let (mut major, mut minor, mut patch) = (0i32, 0i32, 0i32);
        // SAFETY: valid out-pointers.
        let code = unsafe { get(&mut major, &mut minor, &mut patch) };
        (code == sys::ACL_SUCCESS).then(|| format!("{major}.{minor}.{patch}"))
    }

    /// `aclrtGetMemInfo`: `(free, total)` bytes of `attr` on the current context's device.
    pub fn mem_info(&self, attr: sys::aclrtMemAttr::Type) -> Result<(u64, u64), AscendError> {
        let get = self
            .acl()
            .aclrtGetMemInfo
            .as_ref()
            .map_err(|_| self.missing("aclrtGetMemInfo"))?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        self.check("aclrtGetMemInfo", unsafe {
            get(attr, &mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    /// `aclrtMallocAlign32` (`align32`) or `aclrtMalloc` of `bytes` with huge pages first: the
    /// block's address, or the runtime's code (`Err(None)`: the function is missing).
    pub fn malloc_device(
        &self,
        bytes: usize,
        align32: bool,
    ) -> Result<*mut c_void, Option<AclError>> {
        let policy = sys::aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST;
        let function = if align32 {
            self.acl().aclrtMallocAlign32.as_ref()
        } else {
            self.acl().aclrtMalloc.as_ref()
        };
        let malloc = function.map_err(|_| None)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer.
        let code = AclError(unsafe { malloc(&mut ptr, bytes, policy) });
        code.result().map_err(Some)?;
        if ptr.is_null() {
            return Err(Some(AclError(sys::ACL_ERROR_BAD_ALLOC)));
        }
        Ok(ptr)
    }

    /// `aclrtFree`. Errors are dropped: a free runs on drop, where nothing can act on them.
    ///
    /// # Safety
    /// `ptr` came from [`Runtime::malloc_device`], is freed once, and no queued work uses it.
    pub unsafe fn free_device(&self, ptr: *mut c_void) {
        if let Ok(free) = self.acl().aclrtFree.as_ref() {
            // SAFETY: the caller's contract.
            let _ = unsafe { free(ptr) };
        }
    }

    /// `aclrtMallocHost`: `bytes` of pinned host memory.
    pub fn malloc_host(&self, bytes: u64) -> Result<*mut c_void, AscendError> {
        let malloc = self
            .acl()
            .aclrtMallocHost
            .as_ref()
            .map_err(|_| self.missing("aclrtMallocHost"))?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer.
        self.check("aclrtMallocHost", unsafe { malloc(&mut ptr, size(bytes)?) })?;
        if ptr.is_null() {
            return Err(AscendError::Internal(
                "aclrtMallocHost succeeded but returned null".into(),
            ));
        }
        Ok(ptr)
    }

    /// `aclrtFreeHost`; errors dropped as for [`Runtime::free_device`].
    ///
    /// # Safety
    /// `ptr` came from [`Runtime::malloc_host`], is freed once, and no queued work uses it.
    pub unsafe fn free_host(&self, ptr: *mut c_void) {
        if let Ok(free) = self.acl().aclrtFreeHost.as_ref() {
            // SAFETY: the caller's contract.
            let _ = unsafe { free(ptr) };
        }
    }

    /// `aclrtMemcpy` of `bytes` (synchronous; it does not wait for queued work).
    ///
    /// # Safety
    /// Both ranges are live memory of the kind `kind` names, `bytes` long; no queued work
    /// writes the source or touches the destination.
    pub unsafe fn memcpy(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        bytes: u64,
        kind: sys::aclrtMemcpyKind::Type,
    ) -> Result<(), AscendError> {
        let copy = self
            .acl()
            .aclrtMemcpy
            .as_ref()
            .map_err(|_| self.missing("aclrtMemcpy"))?;
        let len = size(bytes)?;
        // SAFETY: the caller's contract.
        self.check("aclrtMemcpy", unsafe { copy(dst, len, src, len, kind) })
    }

    /// `aclrtMemcpyAsync` of `bytes` on `stream`.
    ///
    /// # Safety
    /// Both ranges are live memory of the kind `kind` names, `bytes` long, and stay live and
    /// untouched by the host until the copy has run (queue-ordered frees).
    pub unsafe fn memcpy_async(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        bytes: u64,
        kind: sys::aclrtMemcpyKind::Type,
        stream: sys::aclrtStream,
    ) -> Result<(), AscendError> {
        let copy = self
            .acl()
            .aclrtMemcpyAsync
            .as_ref()
            .map_err(|_| self.missing("aclrtMemcpyAsync"))?;
        let len = size(bytes)?;
        // SAFETY: the caller's contract.
        self.check("aclrtMemcpyAsync", unsafe {
            copy(dst, len, src, len, kind, stream)
        })
    }

    /// `aclrtMemsetAsync` of `bytes` bytes to `value` on `stream`.
    ///
    /// # Safety
    /// The range is live device memory, `bytes` long, that stays live until the fill has run.
    pub unsafe fn memset_async(
        &self,
        dst: *mut c_void,
        bytes: u64,
        value: u8,
        stream: sys::aclrtStream,
    ) -> Result<(), AscendError> {
        let set = self
            .acl()
            .aclrtMemsetAsync
            .as_ref()
            .map_err(|_| self.missing("aclrtMemsetAsync"))?;
        let len = size(bytes)?;
        // SAFETY: the caller's contract.
        self.check("aclrtMemsetAsync", unsafe {
            set(dst, len, i32::from(value), len, stream)
        })
    }
}
