//! Raw tables of the cuBLAS, cuBLASLt, NVRTC and cuDNN entry points the plugin calls, each resolved
//! from one opened library file.
//!
//! The driver's bindings are cudarc's (its CUDA 12.4 API, which every 12.x and 13.x driver
//! runs). cudarc's cuBLAS, cuBLASLt and NVRTC functions are not used: cudarc opens those
//! libraries itself, by names fixed by its compile-time CUDA major, so one build could never
//! open both `libcublas.so.12` and `libcublas.so.13`. These tables are resolved from whichever
//! file [`crate::libraries`] chose, so one plugin runs over either major.
//!
//! The argument types are cudarc's (its 12.4 bindings). Every type a table passes has the same
//! values and layout in CUDA 12 and CUDA 13: comparing cudarc's generated `cuda-12040` and
//! `cuda-13000` modules, CUDA 13 only adds enum members (narrow floating types, emulated compute
//! types and math modes, `CUBLAS_GEMM_AUTOTUNE`, scale-mode descriptor attributes, NVRTC status
//! codes 13 to 17) and drops four cuBLASLt descriptor attributes the plugin never sets
//! (`ATOMIC_SYNC_*`); the functions' signatures are identical. Status codes are returned as
//! plain `int`s ([`crate::result::BlasStatus`], [`crate::result::NvrtcStatus`]): a newer
//! library may return a code the 12.4 enums lack, which must not become an invalid Rust enum.
//! For the same reason [`cublaslt::HeuristicResult`] is declared here with an `int` state.
//!
//! Each table resolves all of its symbols when it is loaded: a library that lacks one is
//! refused as a whole, never a crash at the first call.

pub mod cublas;
pub mod cublaslt;
pub mod cudnn;
pub mod nvrtc;

pub use cublas::Cublas;
pub use cublaslt::CublasLt;
pub use cudnn::Cudnn;
pub use nvrtc::Nvrtc;

/// Declares a table of C entry points: one field per function, named as in C, and an unsafe
/// `load` that resolves them all from a library and keeps the library with the table.
macro_rules! table {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fmeta:meta])* fn $f:ident($($ty:ty),* $(,)?) -> $ret:ty; )*
        }
    ) => {
        $(#[$meta])*
        #[allow(non_snake_case)] // the fields carry the C names
        pub struct $name {
            $(
                #[doc = concat!("`", stringify!($f), "`, as the library exports it.")]
                $(#[$fmeta])*
                pub $f: unsafe extern "C" fn($($ty),*) -> $ret,
            )*
            /// The library the functions live in; dropped (closed) with the table.
            _library: libloading::Library,
        }

        impl $name {
            /// Resolves every entry point of the table in `library`.
            ///
            /// # Safety
            ///
            /// `library` must be the vendor library whose C signatures the table declares (a
            /// symbol of the same name with another signature would be called wrongly).
            pub unsafe fn load(library: libloading::Library) -> Result<$name, libloading::Error> {
                // SAFETY: the caller vouches for the signatures; each pointer is copied out of
                // its `Symbol` and stays valid while `_library`, kept below, is open.
                unsafe {
                    Ok($name {
                        $( $f: *library.get::<unsafe extern "C" fn($($ty),*) -> $ret>(
                            concat!(stringify!($f), "\0").as_bytes(),
                        )?, )*
                        _library: library,
                    })
                }
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).finish_non_exhaustive()
            }
        }
    };
}
pub(crate) use table;
