//! cuDNN (`libcudnn.so.9`): the backend (graph) API entry points of the plugin's fused
//! attention, and the handle calls around them.
//!
//! The enums are cudarc's bindings of cuDNN 9's `cudnn_graph.h` (its `cudnn-09021` module);
//! every value the plugin passes (descriptor types, attribute names and types, data types, the
//! heuristic mode) has been the same since cuDNN 9.0. Statuses are plain `int`s: a newer
//! library may return a code the bindings lack.

use std::ffi::{c_char, c_int, c_void};

pub use cudarc::cudnn::sys::{
    cudaStream_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
    cudnnBackendDescriptor_t, cudnnBackendDescriptorType_t, cudnnBackendHeurMode_t,
    cudnnDataType_t, cudnnHandle_t, cudnnStatus_t,
};

super::table! {
    /// cuDNN's entry points.
    pub struct Cudnn {
        /// `major * 10000 + minor * 100 + patch` (cuDNN 9's encoding).
        fn cudnnGetVersion() -> usize;
        /// The CUDA runtime version the library was built for (`12080`, `13000`).
        fn cudnnGetCudartVersion() -> usize;
        fn cudnnGetErrorString(c_int) -> *const c_char;
        fn cudnnCreate(*mut cudnnHandle_t) -> c_int;
        fn cudnnDestroy(cudnnHandle_t) -> c_int;
        fn cudnnSetStream(cudnnHandle_t, cudaStream_t) -> c_int;
        fn cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t, *mut cudnnBackendDescriptor_t) -> c_int;
        fn cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t) -> c_int;
        fn cudnnBackendSetAttribute(
            cudnnBackendDescriptor_t,
            cudnnBackendAttributeName_t,
            cudnnBackendAttributeType_t,
            i64,
            *const c_void,
        ) -> c_int;
        fn cudnnBackendGetAttribute(
            cudnnBackendDescriptor_t,
            cudnnBackendAttributeName_t,
            cudnnBackendAttributeType_t,
            i64,
            *mut i64,
            *mut c_void,
        ) -> c_int;
        fn cudnnBackendFinalize(cudnnBackendDescriptor_t) -> c_int;
        fn cudnnBackendExecute(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t) -> c_int;
    }
}
