//! cuBLAS, cuBLASLt and NVRTC calls that return a `Result`, over the tables of [`crate::sys`].
//!
//! Each function takes the table it calls through as its first argument (cudarc's `result`
//! functions have the same names and shapes, with the library implied). Status codes are the
//! newtypes [`BlasStatus`] (cuBLAS and cuBLASLt share `cublasStatus_t`) and [`NvrtcStatus`],
//! named after cudarc's enums where they know the code and by number otherwise.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::fmt;
use std::mem::MaybeUninit;

use cudarc::cublas::sys::cublasStatus_t;
use cudarc::nvrtc::sys::nvrtcResult;

/// A cuBLAS or cuBLASLt status (`cublasStatus_t`, an `int`); 0 is success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlasStatus(pub c_int);

impl BlasStatus {
    /// `CUBLAS_STATUS_NOT_SUPPORTED`, also what an empty heuristic answer becomes.
    pub const NOT_SUPPORTED: BlasStatus =
        BlasStatus(cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED as c_int);
    /// `CUBLAS_STATUS_ALLOC_FAILED`: the library could not allocate.
    pub const ALLOC_FAILED: BlasStatus =
        BlasStatus(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED as c_int);

    /// `Ok` for `CUBLAS_STATUS_SUCCESS`, else the status.
    pub fn result(self) -> Result<(), BlasStatus> {
        if self.0 == cublasStatus_t::CUBLAS_STATUS_SUCCESS as c_int {
            Ok(())
        } else {
            Err(self)
        }
    }

    /// The constant's name in `cublas_api.h`, when cudarc's enum has the code.
    pub fn name(self) -> Option<String> {
        use cublasStatus_t::*;
        [
            CUBLAS_STATUS_SUCCESS,
            CUBLAS_STATUS_NOT_INITIALIZED,
            CUBLAS_STATUS_ALLOC_FAILED,
            CUBLAS_STATUS_INVALID_VALUE,
            CUBLAS_STATUS_ARCH_MISMATCH,
            CUBLAS_STATUS_MAPPING_ERROR,
            CUBLAS_STATUS_EXECUTION_FAILED,
            CUBLAS_STATUS_INTERNAL_ERROR,
            CUBLAS_STATUS_NOT_SUPPORTED,
            CUBLAS_STATUS_LICENSE_ERROR,
        ]
        .into_iter()
        .find(|known| *known as c_int == self.0)
        .map(|known| format!("{known:?}"))
    }
}

impl fmt::Display for BlasStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(&name),
            None => write!(f, "cublasStatus_t {}", self.0),
        }
    }
}

impl std::error::Error for BlasStatus {}

/// An NVRTC status (`nvrtcResult`, an `int`); 0 is success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NvrtcStatus(pub c_int);

impl NvrtcStatus {
    /// `Ok` for `NVRTC_SUCCESS`, else the status.
    pub fn result(self) -> Result<(), NvrtcStatus> {
        if self.0 == nvrtcResult::NVRTC_SUCCESS as c_int {
            Ok(())
        } else {
            Err(self)
        }
    }

    /// The constant's name in `nvrtc.h`, when cudarc's (CUDA 12.4) enum has the code.
    pub fn name(self) -> Option<String> {
        use nvrtcResult::*;
        [
            NVRTC_SUCCESS,
            NVRTC_ERROR_OUT_OF_MEMORY,
            NVRTC_ERROR_PROGRAM_CREATION_FAILURE,
            NVRTC_ERROR_INVALID_INPUT,
            NVRTC_ERROR_INVALID_PROGRAM,
            NVRTC_ERROR_INVALID_OPTION,
            NVRTC_ERROR_COMPILATION,
            NVRTC_ERROR_BUILTIN_OPERATION_FAILURE,
            NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION,
            NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION,
            NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID,
            NVRTC_ERROR_INTERNAL_ERROR,
        ]
        .into_iter()
        .find(|known| *known as c_int == self.0)
        .map(|known| format!("{known:?}"))
    }
}

impl fmt::Display for NvrtcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(&name),
            None => write!(f, "nvrtcResult {}", self.0),
        }
    }
}

impl std::error::Error for NvrtcStatus {}

/// cuBLAS calls.
pub mod cublas {
    use super::*;
    use crate::sys::cublas::{
        Cublas, cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasMath_t,
        cublasOperation_t, cudaDataType, cudaStream_t, libraryPropertyType,
    };

    /// `cublasCreate`: a handle on the current context.
    pub fn create_handle(lib: &Cublas) -> Result<cublasHandle_t, BlasStatus> {
        let mut handle = MaybeUninit::uninit();
        // SAFETY: the pointer is valid for one write; cuBLAS writes the handle on success.
        unsafe {
            BlasStatus((lib.cublasCreate_v2)(handle.as_mut_ptr())).result()?;
            Ok(handle.assume_init())
        }
    }

    /// `cublasDestroy`.
    ///
    /// # Safety
    ///
    /// `handle` was created by [`create_handle`] with `lib` and is destroyed once.
    pub unsafe fn destroy_handle(lib: &Cublas, handle: cublasHandle_t) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasDestroy_v2)(handle) }).result()
    }

    /// `cublasSetStream`: the stream the handle's work is enqueued on.
    ///
    /// # Safety
    ///
    /// `handle` is alive and `stream` belongs to its context.
    pub unsafe fn set_stream(
        lib: &Cublas,
        handle: cublasHandle_t,
        stream: cudaStream_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasSetStream_v2)(handle, stream) }).result()
    }

    /// `cublasSetMathMode`.
    ///
    /// # Safety
    ///
    /// `handle` is alive.
    pub unsafe fn set_math_mode(
        lib: &Cublas,
        handle: cublasHandle_t,
        mode: cublasMath_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasSetMathMode)(handle, mode) }).result()
    }

    /// `cublasSetWorkspace`: the scratch the handle's next calls use.
    ///
    /// # Safety
    ///
    /// `handle` is alive; `workspace` is `bytes` of device memory (256-byte aligned) that stays
    /// valid for the work enqueued with it.
    pub unsafe fn set_workspace(
        lib: &Cublas,
        handle: cublasHandle_t,
        workspace: *mut c_void,
        bytes: usize,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasSetWorkspace_v2)(handle, workspace, bytes) }).result()
    }

    /// cuBLAS's version, `(major, minor, patch)`, from `cublasGetProperty` (no handle needed).
    pub fn version(lib: &Cublas) -> Result<(i32, i32, i32), BlasStatus> {
        let part = |property| {
            let mut value: c_int = 0;
            // SAFETY: the pointer is valid for one write.
            BlasStatus(unsafe { (lib.cublasGetProperty)(property, &mut value) }).result()?;
            Ok(value)
        };
        Ok((
            part(libraryPropertyType::MAJOR_VERSION)?,
            part(libraryPropertyType::MINOR_VERSION)?,
            part(libraryPropertyType::PATCH_LEVEL)?,
        ))
    }

    /// `cublasGemmEx`: `C = alpha · op(A) · op(B) + beta · C`, column-major.
    ///
    /// # Safety
    ///
    /// `handle` is alive; the pointers and leading dimensions describe device matrices of the
    /// given types and shapes, alive until the enqueued work has run; `alpha` and `beta` point
    /// at scalars of the compute type's scale type (f32 here).
    #[allow(clippy::too_many_arguments)] // the C function's parameters, in its order
    pub unsafe fn gemm_ex(
        lib: &Cublas,
        handle: cublasHandle_t,
        transa: cublasOperation_t,
        transb: cublasOperation_t,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: *const c_void,
        a: *const c_void,
        a_type: cudaDataType,
        lda: c_int,
        b: *const c_void,
        b_type: cudaDataType,
        ldb: c_int,
        beta: *const c_void,
        c: *mut c_void,
        c_type: cudaDataType,
        ldc: c_int,
        compute_type: cublasComputeType_t,
        algo: cublasGemmAlgo_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe {
            (lib.cublasGemmEx)(
                handle,
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                a,
                a_type,
                lda,
                b,
                b_type,
                ldb,
                beta,
                c,
                c_type,
                ldc,
                compute_type,
                algo,
            )
        })
        .result()
    }
}

/// cuBLASLt calls.
pub mod cublaslt {
    use super::*;
    use crate::sys::cublaslt::{
        CublasLt, HeuristicResult, cublasComputeType_t, cublasLtHandle_t, cublasLtMatmulAlgo_t,
        cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, cublasLtMatmulPreference_t,
        cublasLtMatmulPreferenceAttributes_t, cublasLtMatrixLayout_t, cudaDataType, cudaStream_t,
    };

    /// `cublasLtCreate`.
    pub fn create_handle(lib: &CublasLt) -> Result<cublasLtHandle_t, BlasStatus> {
        let mut handle = MaybeUninit::uninit();
        // SAFETY: the pointer is valid for one write; cuBLASLt writes the handle on success.
        unsafe {
            BlasStatus((lib.cublasLtCreate)(handle.as_mut_ptr())).result()?;
            Ok(handle.assume_init())
        }
    }

    /// `cublasLtDestroy`.
    ///
    /// # Safety
    ///
    /// `handle` was created by [`create_handle`] with `lib` and is destroyed once.
    pub unsafe fn destroy_handle(
        lib: &CublasLt,
        handle: cublasLtHandle_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasLtDestroy)(handle) }).result()
    }

    /// `cublasLtGetVersion`: `major * 10000 + minor * 100 + patch`.
    pub fn version(lib: &CublasLt) -> usize {
        // SAFETY: a query without arguments.
        unsafe { (lib.cublasLtGetVersion)() }
    }

    /// `cublasLtMatmulDescCreate`.
    pub fn create_matmul_desc(
        lib: &CublasLt,
        compute_type: cublasComputeType_t,
        scale_type: cudaDataType,
    ) -> Result<cublasLtMatmulDesc_t, BlasStatus> {
        let mut desc = MaybeUninit::uninit();
        // SAFETY: the pointer is valid for one write, made on success.
        unsafe {
            BlasStatus((lib.cublasLtMatmulDescCreate)(
                desc.as_mut_ptr(),
                compute_type,
                scale_type,
            ))
            .result()?;
            Ok(desc.assume_init())
        }
    }

    /// `cublasLtMatmulDescDestroy`.
    ///
    /// # Safety
    ///
    /// `desc` was created with `lib` and is destroyed once.
    pub unsafe fn destroy_matmul_desc(
        lib: &CublasLt,
        desc: cublasLtMatmulDesc_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasLtMatmulDescDestroy)(desc) }).result()
    }

    /// `cublasLtMatmulDescSetAttribute`.
    ///
    /// # Safety
    ///
    /// `desc` is alive; `value` points at `size` bytes of the type the attribute takes.
    pub unsafe fn set_matmul_desc_attribute(
        lib: &CublasLt,
        desc: cublasLtMatmulDesc_t,
        attr: cublasLtMatmulDescAttributes_t,
        value: *const c_void,
        size: usize,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasLtMatmulDescSetAttribute)(desc, attr, value, size) })
            .result()
    }

    /// `cublasLtMatrixLayoutCreate`: a column-major `rows x cols` layout.
    pub fn create_matrix_layout(
        lib: &CublasLt,
        data_type: cudaDataType,
        rows: u64,
        cols: u64,
        ld: i64,
    ) -> Result<cublasLtMatrixLayout_t, BlasStatus> {
        let mut layout = MaybeUninit::uninit();
        // SAFETY: the pointer is valid for one write, made on success.
        unsafe {
            BlasStatus((lib.cublasLtMatrixLayoutCreate)(
                layout.as_mut_ptr(),
                data_type,
                rows,
                cols,
                ld,
            ))
            .result()?;
            Ok(layout.assume_init())
        }
    }

    /// `cublasLtMatrixLayoutDestroy`.
    ///
    /// # Safety
    ///
    /// `layout` was created with `lib` and is destroyed once.
    pub unsafe fn destroy_matrix_layout(
        lib: &CublasLt,
        layout: cublasLtMatrixLayout_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasLtMatrixLayoutDestroy)(layout) }).result()
    }

    /// `cublasLtMatmulPreferenceCreate`.
    pub fn create_matmul_pref(lib: &CublasLt) -> Result<cublasLtMatmulPreference_t, BlasStatus> {
        let mut pref = MaybeUninit::uninit();
        // SAFETY: the pointer is valid for one write, made on success.
        unsafe {
            BlasStatus((lib.cublasLtMatmulPreferenceCreate)(pref.as_mut_ptr())).result()?;
            Ok(pref.assume_init())
        }
    }

    /// `cublasLtMatmulPreferenceSetAttribute`.
    ///
    /// # Safety
    ///
    /// `pref` is alive; `value` points at `size` bytes of the type the attribute takes.
    pub unsafe fn set_matmul_pref_attribute(
        lib: &CublasLt,
        pref: cublasLtMatmulPreference_t,
        attr: cublasLtMatmulPreferenceAttributes_t,
        value: *const c_void,
        size: usize,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasLtMatmulPreferenceSetAttribute)(pref, attr, value, size) })
            .result()
    }

    /// `cublasLtMatmulPreferenceDestroy`.
    ///
    /// # Safety
    ///
    /// `pref` was created with `lib` and is destroyed once.
    pub unsafe fn destroy_matmul_pref(
        lib: &CublasLt,
        pref: cublasLtMatmulPreference_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe { (lib.cublasLtMatmulPreferenceDestroy)(pref) }).result()
    }

    /// `cublasLtMatmulAlgoGetHeuristic` for the one best algorithm. No algorithm for the problem
    /// is [`BlasStatus::NOT_SUPPORTED`].
    ///
    /// # Safety
    ///
    /// The handle, descriptor, layouts and preference are alive.
    #[allow(clippy::too_many_arguments)] // the C function's parameters, in its order
    pub unsafe fn get_matmul_algo_heuristic(
        lib: &CublasLt,
        handle: cublasLtHandle_t,
        desc: cublasLtMatmulDesc_t,
        a: cublasLtMatrixLayout_t,
        b: cublasLtMatrixLayout_t,
        c: cublasLtMatrixLayout_t,
        d: cublasLtMatrixLayout_t,
        pref: cublasLtMatmulPreference_t,
    ) -> Result<cublasLtMatmulAlgo_t, BlasStatus> {
        let mut found = MaybeUninit::<HeuristicResult>::uninit();
        let mut count: c_int = 0;
        // SAFETY: as the caller promises; room for the one result asked for.
        unsafe {
            BlasStatus((lib.cublasLtMatmulAlgoGetHeuristic)(
                handle,
                desc,
                a,
                b,
                c,
                d,
                pref,
                1,
                found.as_mut_ptr(),
                &mut count,
            ))
            .result()?;
            if count == 0 {
                return Err(BlasStatus::NOT_SUPPORTED);
            }
            // Written: cuBLASLt returned one result.
            let found = found.assume_init();
            BlasStatus(found.state).result()?;
            Ok(found.algo)
        }
    }

    /// `cublasLtMatmul`: `D = alpha · (A · B) + beta · C`.
    ///
    /// # Safety
    ///
    /// Every descriptor is alive and describes its matrix; the matrices and the workspace
    /// (`workspace_bytes`, 256-byte aligned) are device memory alive until the enqueued work has
    /// run; `algo` was chosen for these descriptors; `stream` belongs to the handle's context.
    #[allow(clippy::too_many_arguments)] // the C function's parameters, in its order
    pub unsafe fn matmul(
        lib: &CublasLt,
        handle: cublasLtHandle_t,
        desc: cublasLtMatmulDesc_t,
        alpha: *const c_void,
        beta: *const c_void,
        a: *const c_void,
        a_layout: cublasLtMatrixLayout_t,
        b: *const c_void,
        b_layout: cublasLtMatrixLayout_t,
        c: *const c_void,
        c_layout: cublasLtMatrixLayout_t,
        d: *mut c_void,
        d_layout: cublasLtMatrixLayout_t,
        algo: &cublasLtMatmulAlgo_t,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: cudaStream_t,
    ) -> Result<(), BlasStatus> {
        // SAFETY: as the caller promises.
        BlasStatus(unsafe {
            (lib.cublasLtMatmul)(
                handle,
                desc,
                alpha,
                a,
                a_layout,
                b,
                b_layout,
                beta,
                c,
                c_layout,
                d,
                d_layout,
                algo,
                workspace,
                workspace_bytes,
                stream,
            )
        })
        .result()
    }
}

/// NVRTC calls.
pub mod nvrtc {
    use super::*;
    use crate::sys::nvrtc::{Nvrtc, nvrtcProgram};

    /// NVRTC's version, `(major, minor)`.
    pub fn version(lib: &Nvrtc) -> Result<(i32, i32), NvrtcStatus> {
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: both pointers are valid for writes.
        NvrtcStatus(unsafe { (lib.nvrtcVersion)(&mut major, &mut minor) }).result()?;
        Ok((major, minor))
    }

    /// The `sm_XY` architectures NVRTC compiles for, as `XY` numbers.
    pub fn supported_archs(lib: &Nvrtc) -> Result<Vec<c_int>, NvrtcStatus> {
        let mut count: c_int = 0;
        // SAFETY: the pointer is valid for writes.
        NvrtcStatus(unsafe { (lib.nvrtcGetNumSupportedArchs)(&mut count) }).result()?;
        let mut archs = vec![0 as c_int; usize::try_from(count).unwrap_or(0)];
        // SAFETY: `archs` has room for the `count` values NVRTC writes.
        NvrtcStatus(unsafe { (lib.nvrtcGetSupportedArchs)(archs.as_mut_ptr()) }).result()?;
        Ok(archs)
    }

    /// `nvrtcCreateProgram` from `source`, named `name`, without headers.
    pub fn create_program(
        lib: &Nvrtc,
        source: &CStr,
        name: &CStr,
    ) -> Result<nvrtcProgram, NvrtcStatus> {
        let mut program = MaybeUninit::uninit();
        // SAFETY: both strings are NUL-terminated and outlive the call; no headers (null
        // arrays with a count of 0); the program pointer is valid for one write.
        unsafe {
            NvrtcStatus((lib.nvrtcCreateProgram)(
                program.as_mut_ptr(),
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ))
            .result()?;
            Ok(program.assume_init())
        }
    }

    /// `nvrtcCompileProgram` with `options`.
    ///
    /// # Safety
    ///
    /// `program` is alive.
    pub unsafe fn compile_program(
        lib: &Nvrtc,
        program: nvrtcProgram,
        options: &[CString],
    ) -> Result<(), NvrtcStatus> {
        let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let count = c_int::try_from(pointers.len()).unwrap_or(c_int::MAX);
        // SAFETY: the program is alive (caller); every option is a NUL-terminated string that
        // outlives the call.
        NvrtcStatus(unsafe { (lib.nvrtcCompileProgram)(program, count, pointers.as_ptr()) })
            .result()
    }

    /// `nvrtcDestroyProgram`.
    ///
    /// # Safety
    ///
    /// `program` was created with `lib` and is destroyed once.
    pub unsafe fn destroy_program(lib: &Nvrtc, program: nvrtcProgram) -> Result<(), NvrtcStatus> {
        let mut program = program;
        // SAFETY: as the caller promises; NVRTC sets the variable to null.
        NvrtcStatus(unsafe { (lib.nvrtcDestroyProgram)(&mut program) }).result()
    }

    /// The compiler's log, up to its terminating NUL.
    ///
    /// # Safety
    ///
    /// `program` is alive.
    pub unsafe fn get_program_log(
        lib: &Nvrtc,
        program: nvrtcProgram,
    ) -> Result<Vec<u8>, NvrtcStatus> {
        // SAFETY: as the caller promises.
        unsafe { sized(lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog, program) }
    }

    /// The PTX of a program compiled for a virtual architecture (`compute_XY`), with its NUL.
    ///
    /// # Safety
    ///
    /// `program` is alive and compiled.
    pub unsafe fn get_ptx(lib: &Nvrtc, program: nvrtcProgram) -> Result<Vec<u8>, NvrtcStatus> {
        // SAFETY: as the caller promises.
        unsafe { sized(lib.nvrtcGetPTXSize, lib.nvrtcGetPTX, program) }
    }

    /// The cubin of a program compiled for a real architecture (`sm_XY`).
    ///
    /// # Safety
    ///
    /// `program` is alive and compiled.
    pub unsafe fn get_cubin(lib: &Nvrtc, program: nvrtcProgram) -> Result<Vec<u8>, NvrtcStatus> {
        // SAFETY: as the caller promises.
        unsafe { sized(lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN, program) }
    }

    /// Reads one of the program's outputs: its size from `size`, then its bytes from `get`.
    ///
    /// # Safety
    ///
    /// `program` is alive and in a state where both calls are valid.
    unsafe fn sized(
        size: unsafe extern "C" fn(nvrtcProgram, *mut usize) -> c_int,
        get: unsafe extern "C" fn(nvrtcProgram, *mut c_char) -> c_int,
        program: nvrtcProgram,
    ) -> Result<Vec<u8>, NvrtcStatus> {
        let mut bytes = 0usize;
        // SAFETY: the program is alive (caller); the pointer is valid for one write.
        NvrtcStatus(unsafe { size(program, &mut bytes) }).result()?;
        let mut out = vec![0u8; bytes];
        // SAFETY: `out` has the size NVRTC reported.
        NvrtcStatus(unsafe { get(program, out.as_mut_ptr().cast()) }).result()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_named_when_known_and_numbered_otherwise() {
        assert_eq!(BlasStatus(0).result(), Ok(()));
        assert_eq!(
            BlasStatus::NOT_SUPPORTED.to_string(),
            "CUBLAS_STATUS_NOT_SUPPORTED"
        );
        assert_eq!(BlasStatus::ALLOC_FAILED.0, 3);
        assert_eq!(BlasStatus(42).to_string(), "cublasStatus_t 42");
        assert_eq!(NvrtcStatus(6).to_string(), "NVRTC_ERROR_COMPILATION");
        // NVRTC 13's NVRTC_ERROR_CANCELLED, which cudarc's 12.4 enum lacks.
        assert_eq!(NvrtcStatus(16).to_string(), "nvrtcResult 16");
        assert_eq!(NvrtcStatus(0).result(), Ok(()));
    }
}
