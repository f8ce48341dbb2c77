//! cuBLASLt (`libcublasLt.so.<major>`): the entry points of the plugin's f16, bf16 and TF32
//! GEMMs with fused epilogues.

use std::ffi::{c_int, c_void};

pub use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtEpilogue_t, cublasLtHandle_t, cublasLtMatmulAlgo_t,
    cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, cublasLtMatmulPreference_t,
    cublasLtMatmulPreferenceAttributes_t, cublasLtMatrixLayout_t, cublasLtReductionScheme_t,
    cudaDataType, cudaStream_t,
};

/// `cublasLtMatmulHeuristicResult_t`, laid out as in CUDA 12's and 13's `cublasLt.h`, with the
/// state as a plain `int` (cudarc's field is an enum a newer library's code could fall outside).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_snake_case)] // the C field names
pub struct HeuristicResult {
    /// The algorithm, to pass to `cublasLtMatmul`.
    pub algo: cublasLtMatmulAlgo_t,
    /// Workspace bytes the algorithm needs.
    pub workspaceSize: usize,
    /// Whether the result is usable (`CUBLAS_STATUS_SUCCESS`, 0).
    pub state: c_int,
    /// Waves of the algorithm (informational).
    pub wavesCount: f32,
    /// Reserved by cuBLASLt.
    pub reserved: [c_int; 4],
}

super::table! {
    /// cuBLASLt's entry points.
    pub struct CublasLt {
        fn cublasLtCreate(*mut cublasLtHandle_t) -> c_int;
        fn cublasLtDestroy(cublasLtHandle_t) -> c_int;
        /// `major * 10000 + minor * 100 + patch`.
        fn cublasLtGetVersion() -> usize;
        fn cublasLtMatmulDescCreate(*mut cublasLtMatmulDesc_t, cublasComputeType_t, cudaDataType) -> c_int;
        fn cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t) -> c_int;
        fn cublasLtMatmulDescSetAttribute(
            cublasLtMatmulDesc_t,
            cublasLtMatmulDescAttributes_t,
            *const c_void,
            usize,
        ) -> c_int;
        fn cublasLtMatrixLayoutCreate(*mut cublasLtMatrixLayout_t, cudaDataType, u64, u64, i64) -> c_int;
        fn cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t) -> c_int;
        fn cublasLtMatmulPreferenceCreate(*mut cublasLtMatmulPreference_t) -> c_int;
        fn cublasLtMatmulPreferenceSetAttribute(
            cublasLtMatmulPreference_t,
            cublasLtMatmulPreferenceAttributes_t,
            *const c_void,
            usize,
        ) -> c_int;
        fn cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t) -> c_int;
        fn cublasLtMatmulAlgoGetHeuristic(
            cublasLtHandle_t,
            cublasLtMatmulDesc_t,
            cublasLtMatrixLayout_t,
            cublasLtMatrixLayout_t,
            cublasLtMatrixLayout_t,
            cublasLtMatrixLayout_t,
            cublasLtMatmulPreference_t,
            c_int,
            *mut HeuristicResult,
            *mut c_int,
        ) -> c_int;
        fn cublasLtMatmul(
            cublasLtHandle_t,
            cublasLtMatmulDesc_t,
            *const c_void,
            *const c_void,
            cublasLtMatrixLayout_t,
            *const c_void,
            cublasLtMatrixLayout_t,
            *const c_void,
            *const c_void,
            cublasLtMatrixLayout_t,
            *mut c_void,
            cublasLtMatrixLayout_t,
            *const cublasLtMatmulAlgo_t,
            *mut c_void,
            usize,
            cudaStream_t,
        ) -> c_int;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn the_heuristic_result_is_laid_out_as_cudarcs() {
        use cudarc::cublaslt::sys::cublasLtMatmulHeuristicResult_t as Theirs;
        assert_eq!(size_of::<HeuristicResult>(), size_of::<Theirs>());
        assert_eq!(align_of::<HeuristicResult>(), align_of::<Theirs>());
        assert_eq!(
            offset_of!(HeuristicResult, workspaceSize),
            offset_of!(Theirs, workspaceSize)
        );
        assert_eq!(
            offset_of!(HeuristicResult, state),
            offset_of!(Theirs, state)
        );
        assert_eq!(
            offset_of!(HeuristicResult, wavesCount),
            offset_of!(Theirs, wavesCount)
        );
        assert_eq!(
            offset_of!(HeuristicResult, reserved),
            offset_of!(Theirs, reserved)
        );
    }
}
