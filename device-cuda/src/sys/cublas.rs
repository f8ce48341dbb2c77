//! cuBLAS (`libcublas.so.<major>`): the entry points of the plugin's f32 GEMM and of its
//! fallback when cuBLASLt has no algorithm.

use std::ffi::{c_int, c_void};

pub use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasMath_t, cublasOperation_t,
    cudaDataType, cudaStream_t, libraryPropertyType,
};

super::table! {
    /// cuBLAS's entry points, by their exported (`_v2`) names.
    pub struct Cublas {
        fn cublasCreate_v2(*mut cublasHandle_t) -> c_int;
        fn cublasDestroy_v2(cublasHandle_t) -> c_int;
        fn cublasSetStream_v2(cublasHandle_t, cudaStream_t) -> c_int;
        fn cublasSetMathMode(cublasHandle_t, cublasMath_t) -> c_int;
        fn cublasSetWorkspace_v2(cublasHandle_t, *mut c_void, usize) -> c_int;
        /// The library's version, one part at a time, without a handle (so before a context).
        fn cublasGetProperty(libraryPropertyType, *mut c_int) -> c_int;
        fn cublasGemmEx(
            cublasHandle_t,
            cublasOperation_t,
            cublasOperation_t,
            c_int,
            c_int,
            c_int,
            *const c_void,
            *const c_void,
            cudaDataType,
            c_int,
            *const c_void,
            cudaDataType,
            c_int,
            *const c_void,
            *mut c_void,
            cudaDataType,
            c_int,
            cublasComputeType_t,
            cublasGemmAlgo_t,
        ) -> c_int;
    }
}
