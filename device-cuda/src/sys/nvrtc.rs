//! NVRTC (`libnvrtc.so.<major>`): the entry points that compile the plugin's kernels.

use std::ffi::{c_char, c_int};

pub use cudarc::nvrtc::sys::nvrtcProgram;

super::table! {
    /// NVRTC's entry points.
    pub struct Nvrtc {
        fn nvrtcVersion(*mut c_int, *mut c_int) -> c_int;
        fn nvrtcGetNumSupportedArchs(*mut c_int) -> c_int;
        fn nvrtcGetSupportedArchs(*mut c_int) -> c_int;
        fn nvrtcCreateProgram(
            *mut nvrtcProgram,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> c_int;
        fn nvrtcCompileProgram(nvrtcProgram, c_int, *const *const c_char) -> c_int;
        fn nvrtcDestroyProgram(*mut nvrtcProgram) -> c_int;
        fn nvrtcGetProgramLogSize(nvrtcProgram, *mut usize) -> c_int;
        fn nvrtcGetProgramLog(nvrtcProgram, *mut c_char) -> c_int;
        fn nvrtcGetPTXSize(nvrtcProgram, *mut usize) -> c_int;
        fn nvrtcGetPTX(nvrtcProgram, *mut c_char) -> c_int;
        fn nvrtcGetCUBINSize(nvrtcProgram, *mut usize) -> c_int;
        fn nvrtcGetCUBIN(nvrtcProgram, *mut c_char) -> c_int;
    }
}
