//! Errors of the CUDA device: one enum for every vendor failure, mapped onto the ABI's codes.
//!
//! Vendor status codes keep their names (`CUDA_ERROR_OUT_OF_MEMORY`,
//! `CUBLAS_STATUS_NOT_SUPPORTED`, `NVRTC_ERROR_COMPILATION`) and the call that returned them, so
//! a message read in a log says what failed without a lookup. The names come from cudarc's
//! enums' `Debug` form, not from `cuGetErrorName`, so mapping an error never calls into the
//! driver.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::CUresult;
use iris_plugin::abi::PluginError;
use thiserror::Error;

use crate::result::{BlasStatus, NvrtcStatus};

/// A failure of the CUDA device, before it becomes a [`PluginError`].
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A driver call returned an error code.
    #[error("{call} failed: {}{}", driver_name(*code), driver_hint(*code))]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its status.
        code: CUresult,
    },
    /// A device allocation could not be satisfied.
    #[error("{what}: {requested} bytes requested, {free} of {total} bytes free ({})", driver_name(*code))]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Bytes asked for.
        requested: u64,
        /// Free device memory as the driver reported it after the failure.
        free: u64,
        /// Total device memory.
        total: u64,
        /// The driver's status.
        code: CUresult,
    },
    /// A cuBLAS or cuBLASLt call returned an error status.
    #[error("{call} failed: {status}")]
    Blas {
        /// The library function.
        call: &'static str,
        /// Its status name.
        status: String,
        /// Whether the status is an allocation failure.
        alloc_failed: bool,
    },
    /// A cuDNN call returned an error status.
    #[error("{call} failed: {status}")]
    Cudnn {
        /// The library function, and the descriptor or attribute it was given.
        call: String,
        /// Its status, named by the library, with its number.
        status: String,
        /// Whether the status is an allocation failure.
        alloc_failed: bool,
    },
    /// A library call failed in a context that a fault (of this call's work or earlier work on
    /// the queue) had made unusable: the driver's sticky error is the cause, the library's
    /// status (cuBLAS, cuBLASLt and cuDNN report it as an execution failure of their own) only
    /// its symptom.
    #[error("the device faulted: {}{} (the queue's sticky error; the call saw: {symptom})", driver_name(*code), driver_hint(*code))]
    Faulted {
        /// The driver's sticky error.
        code: CUresult,
        /// How the library call failed.
        symptom: String,
    },
    /// NVRTC failed to compile the kernels.
    #[error("NVRTC: {call} failed: {status}{}", log_suffix(log))]
    Nvrtc {
        /// The NVRTC function.
        call: &'static str,
        /// Its status name.
        status: String,
        /// The compiler log, if any.
        log: String,
    },
    /// A vendor library could not be found or loaded.
    #[error("{library} not found (tried {tried})")]
    LibraryMissing {
        /// The library, by its file name (`libcublasLt.so.12`).
        library: String,
        /// The names and paths tried, for the message.
        tried: String,
    },
    /// No CUDA major's cuBLAS and cuBLASLt could be loaded; the text says why, per major.
    #[error("{0}")]
    Libraries(String),
    /// No device can be used (hidden by `CUDA_VISIBLE_DEVICES`, say).
    #[error("{0}")]
    Unavailable(String),
    /// The device or driver cannot run this plugin (compute capability, driver version).
    #[error("{0}")]
    Unsupported(String),
    /// An option or argument is wrong.
    #[error("{0}")]
    Invalid(String),
}

impl CudaError {
    /// A driver error for `call`.
    pub fn driver(call: &'static str, err: DriverError) -> CudaError {
        CudaError::Driver { call, code: err.0 }
    }

    /// A cuBLAS or cuBLASLt error for `call`.
    pub fn blas(call: &'static str, status: BlasStatus) -> CudaError {
        CudaError::Blas {
            call,
            alloc_failed: status == BlasStatus::ALLOC_FAILED,
            status: status.to_string(),
        }
    }

    /// An NVRTC error for `call`, with the compiler's log.
    pub fn nvrtc(call: &'static str, status: NvrtcStatus, log: String) -> CudaError {
        CudaError::Nvrtc {
            call,
            status: status.to_string(),
            log,
        }
    }

    /// Whether this is an allocation failure.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            CudaError::OutOfMemory { .. } => true,
            CudaError::Driver { code, .. } => *code == CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CudaError::Blas { alloc_failed, .. } | CudaError::Cudnn { alloc_failed, .. } => {
                *alloc_failed
            }
            _ => false,
        }
    }

    /// The error as the ABI reports it, its message prefixed with the ABI call `op`.
    pub fn into_plugin(self, op: &str) -> PluginError {
        let message = format!("{op}: {self}");
        if self.is_out_of_memory() {
            return PluginError::out_of_memory(message);
        }
        match &self {
            CudaError::Driver { code, .. } if unavailable(*code) => {
                PluginError::unavailable(message)
            }
            CudaError::Driver {
                code: CUresult::CUDA_ERROR_NOT_SUPPORTED,
                ..
            }
            | CudaError::Unsupported(_) => PluginError::unsupported(message),
            CudaError::Faulted { .. }
            | CudaError::LibraryMissing { .. }
            | CudaError::Libraries(_)
            | CudaError::Unavailable(_) => PluginError::unavailable(message),
            CudaError::Invalid(_) => PluginError::invalid_argument(message),
            _ => PluginError::internal(message),
        }
    }
}

/// Shorthand: `result.map_err(|e| CudaError::driver(call, e))`.
pub trait DriverResultExt<T> {
    /// Names the driver call of an error.
    fn call(self, call: &'static str) -> Result<T, CudaError>;
}

impl<T> DriverResultExt<T> for Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T, CudaError> {
        self.map_err(|err| CudaError::driver(call, err))
    }
}

/// The name of a driver status, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
pub fn driver_name(code: CUresult) -> String {
    format!("{code:?}")
}

/// Why a driver status stops the device from being used, where a hint helps: an HGX or DGX
/// whose NVSwitch fabric manager is not running answers `cuInit` with `SYSTEM_NOT_READY`.
pub fn driver_hint(code: CUresult) -> &'static str {
    match code {
        CUresult::CUDA_ERROR_STUB_LIBRARY => {
            " (the libcuda found is the toolkit's link stub, not the driver)"
        }
        CUresult::CUDA_ERROR_NO_DEVICE => " (no CUDA device)",
        CUresult::CUDA_ERROR_SYSTEM_NOT_READY => {
            " (the system is not ready: on NVSwitch systems (HGX, DGX) start the fabric manager, \
             `systemctl start nvidia-fabricmanager`, matching the driver's version)"
        }
        _ => "",
    }
}

/// Driver codes that mean the driver or device cannot be used (as opposed to a fault of this
/// plugin): no device, no driver, a stub library, a driver too old, a lost device, a system
/// whose fabric manager is not running, a fault that left the context unusable.
pub(crate) fn unavailable(code: CUresult) -> bool {
    matches!(
        code,
        CUresult::CUDA_ERROR_NO_DEVICE
            | CUresult::CUDA_ERROR_SYSTEM_NOT_READY
            | CUresult::CUDA_ERROR_NOT_INITIALIZED
            | CUresult::CUDA_ERROR_DEINITIALIZED
            | CUresult::CUDA_ERROR_STUB_LIBRARY
            | CUresult::CUDA_ERROR_INVALID_DEVICE
            | CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE
            | CUresult::CUDA_ERROR_DEVICE_NOT_LICENSED
            | CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
            | CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
            | CUresult::CUDA_ERROR_ECC_UNCORRECTABLE
            | CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUresult::CUDA_ERROR_LAUNCH_FAILED
            | CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
    )
}

fn log_suffix(log: &str) -> String {
    let log = log.trim();
    if log.is_empty() {
        String::new()
    } else {
        format!("\n{log}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iris_plugin::ErrorCode;

    #[test]
    fn driver_errors_carry_the_call_and_the_cuda_name() {
        let err = CudaError::driver(
            "cuMemcpyHtoDAsync",
            DriverError(CUresult::CUDA_ERROR_INVALID_VALUE),
        );
        let plugin = err.into_plugin("write");
        assert_eq!(plugin.code, ErrorCode::INTERNAL);
        assert_eq!(
            plugin.message.as_str(),
            "write: cuMemcpyHtoDAsync failed: CUDA_ERROR_INVALID_VALUE"
        );
    }

    #[test]
    fn a_fault_behind_a_library_failure_is_unavailable_and_named() {
        let err = CudaError::Faulted {
            code: CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            symptom: "cublasGemmEx failed: CUBLAS_STATUS_EXECUTION_FAILED".into(),
        };
        let plugin = err.into_plugin("gemm");
        assert_eq!(plugin.code, ErrorCode::UNAVAILABLE);
        assert_eq!(
            plugin.message.as_str(),
            "gemm: the device faulted: CUDA_ERROR_ILLEGAL_ADDRESS (the queue's sticky error; \
             the call saw: cublasGemmEx failed: CUBLAS_STATUS_EXECUTION_FAILED)"
        );
    }

    #[test]
    fn out_of_memory_is_its_own_code_with_sizes() {
        let err = CudaError::OutOfMemory {
            what: "cuMemAllocFromPoolAsync".into(),
            requested: 4096,
            free: 1024,
            total: 8192,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        };
        let plugin = err.into_plugin("alloc");
        assert_eq!(plugin.code, ErrorCode::OUT_OF_MEMORY);
        assert!(
            plugin
                .message
                .contains("4096 bytes requested, 1024 of 8192 bytes free")
        );
        let bare = CudaError::driver(
            "cuMemHostAlloc",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        assert_eq!(
            bare.into_plugin("alloc_host").code,
            ErrorCode::OUT_OF_MEMORY
        );
    }

    #[test]
    fn cudnn_allocation_failures_are_out_of_memory_and_other_statuses_internal() {
        let cudnn = |status: &str, number: i32| CudaError::Cudnn {
            call: "cudnnBackendExecute".into(),
            status: format!("{status} ({number})"),
            alloc_failed: crate::cudnn::alloc_failed(number),
        };
        for (status, number) in [
            ("CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED", 4003),
            ("CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", 4004),
        ] {
            let plugin = cudnn(status, number).into_plugin("attention");
            assert_eq!(plugin.code, ErrorCode::OUT_OF_MEMORY, "{status}");
            assert_eq!(
                plugin.message.as_str(),
                format!("attention: cudnnBackendExecute failed: {status} ({number})")
            );
        }
        for (status, number) in [
            ("CUDNN_STATUS_INTERNAL_ERROR", 4000),
            ("CUDNN_STATUS_EXECUTION_FAILED", 5000),
            ("CUDNN_STATUS_NOT_SUPPORTED", 3000),
        ] {
            let plugin = cudnn(status, number).into_plugin("attention");
            assert_eq!(plugin.code, ErrorCode::INTERNAL, "{status}");
        }
    }

    #[test]
    fn a_missing_driver_or_device_is_unavailable() {
        for code in [
            CUresult::CUDA_ERROR_NO_DEVICE,
            CUresult::CUDA_ERROR_STUB_LIBRARY,
            CUresult::CUDA_ERROR_SYSTEM_NOT_READY,
        ] {
            let err = CudaError::driver("cuInit", DriverError(code));
            assert_eq!(err.into_plugin("open").code, ErrorCode::UNAVAILABLE);
        }
        let not_ready =
            CudaError::driver("cuInit", DriverError(CUresult::CUDA_ERROR_SYSTEM_NOT_READY));
        assert!(
            not_ready.to_string().contains("fabric manager"),
            "{not_ready}"
        );
        let missing = CudaError::LibraryMissing {
            library: "libnvrtc.so.12".into(),
            tried: "the loader path".into(),
        };
        let plugin = missing.into_plugin("open");
        assert_eq!(plugin.code, ErrorCode::UNAVAILABLE);
        assert!(plugin.message.contains("libnvrtc.so.12 not found"));
    }
}
