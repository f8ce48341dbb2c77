//! iris-device-cuda: the CUDA device plugin, `libiris_device_cuda.so`.
//!
//! Built on cudarc with dynamic loading and a fixed CUDA API version, so the plugin builds with
//! no toolkit, driver or nvcc on the machine and links only libc: every vendor library is opened
//! at run time. One build loads one CUDA major's user-space libraries (cuBLAS, cuBLASLt, NVRTC),
//! chosen by a feature: `cuda-12` (the default, cudarc's 12.4 API, `libcublas.so.12`...) or
//! `cuda-13` (13.0, `libcublas.so.13`...); a host with only one of them runs that build. The
//! layers, as in every iris device crate:
//!
//! - vendor bindings: cudarc's `sys` (raw, lazily resolved symbols) and `result` (every call
//!   returns a `Result`) layers for the driver, cuBLAS, cuBLASLt and NVRTC;
//! - [`loader`]: finds those libraries before cudarc would panic on a missing one (install roots
//!   such as `CUDA_HOME` and pip's `nvidia/*/lib` are loaded by absolute path first) and names
//!   what it tried when one is missing;
//! - safe types: `memory` (stream-ordered pool allocations behind opaque handles, the
//!   non-owning `DeviceView` ops hand to kernels and cuBLAS, pinned host buffers, fences, and
//!   every driver call on memory and transfers), [`kernels`] (NVRTC compilation, the on-disk
//!   kernel cache, the loaded module), `ops` (cuBLASLt/cuBLAS GEMM, and one file per kernel
//!   family as in the other devices: `norm`, `elementwise`, `rotary`, `attention`, each kernel
//!   with a typed parameter struct);
//! - [`device::CudaDevice`], the [`iris_plugin::Backend`] the ABI shims call, and [`error`],
//!   which maps CUDA failures onto the ABI's error codes (out of memory with sizes; everything
//!   else carries the CUDA name of the failure).
//!
//! `probe` never panics and never fails: without a driver, with the toolkit's link stub, with no
//! device or with `CUDA_VISIBLE_DEVICES` hiding every device, it reports zero devices and why.
//! Every entry point runs under a panic guard (a panic inside cudarc would otherwise abort the
//! host), and so does closing a device, whose drops release library handles.
//!
//! Options (`[plugins.cuda]` in the config): `tf32` (f32 GEMMs on TF32 tensor cores; default
//! off), `kernel_cache` (a folder, or `off`), `memory_only` (driver only: memory, transfers,
//! staging, no ops). docs/CUDA.md has requirements, environment variables and what is verified
//! without a GPU.

pub mod device;
pub mod error;
pub mod kernels;
pub mod loader;
pub(crate) mod memory;
pub(crate) mod ops;

pub use device::{CudaDevice, CudaOptions};

#[cfg(all(feature = "cuda-12", feature = "cuda-13"))]
compile_error!(
    "features `cuda-12` and `cuda-13` exclude each other: build with `--no-default-features --features cuda-13` for CUDA 13"
);
#[cfg(not(any(feature = "cuda-12", feature = "cuda-13")))]
compile_error!("enable one of the features `cuda-12` (the default) or `cuda-13`");

#[cfg(not(target_pointer_width = "64"))]
compile_error!("the CUDA plugin needs a 64-bit target: CUDA 12 has no 32-bit host platform");

/// A byte count or index as `usize`. Lossless: the crate builds only for 64-bit targets.
pub(crate) fn usize_of(value: u64) -> usize {
    // 64-bit targets only (see the compile_error above): u64 and usize have the same width.
    #[allow(clippy::cast_possible_truncation)]
    let value = value as usize;
    value
}

use iris_plugin::Logger;
use iris_plugin::abi::{PluginError, ProbeResult};

/// The plugin's name.
pub const NAME: &str = "cuda";

fn probe() -> ProbeResult {
    match device::probe_devices() {
        Ok(count) => iris_plugin::backend::probe_result(count, ""),
        Err(reason) => iris_plugin::backend::probe_result(0, reason),
    }
}

fn open(ordinal: u32, options: &[(&str, &str)], log: Logger) -> Result<CudaDevice, PluginError> {
    CudaDevice::open(ordinal, CudaOptions::parse(options)?, log)
}

iris_plugin::export_plugin! {
    name: NAME,
    version: env!("CARGO_PKG_VERSION"),
    probe: probe,
    open: open,
}
