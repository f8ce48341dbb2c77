//! iris-device-cuda: the CUDA device plugin, `libiris_device_cuda.so`.
//!
//! Built on cudarc's driver bindings with dynamic loading and a fixed CUDA API version (12.4,
//! which every 12.x and 13.x driver runs), so the plugin builds with no toolkit, driver or nvcc
//! on the machine and links only libc: every vendor library is opened at run time. One plugin
//! runs over CUDA 12's and CUDA 13's user-space libraries (cuBLAS, cuBLASLt, NVRTC, whose file
//! names carry their major): [`libraries`] picks the major per process, newest first where the
//! driver and device run it, one major's libraries and never a mix. The layers, as in every
//! iris device crate:
//!
//! - vendor bindings: cudarc's `sys` and `result` layers for the driver; for cuBLAS, cuBLASLt
//!   and NVRTC the plugin's own [`sys`] (a table of entry points per opened library file, with
//!   cudarc's types) and [`result`] (every call returns a `Result`), since cudarc opens those
//!   libraries only by names fixed at compile time;
//! - [`loader`]: finds the libraries (install roots such as `CUDA_HOME` and pip's
//!   `nvidia/*/lib` first, by absolute path, then the loader's path), checks the driver before
//!   cudarc would panic on a missing one, and names what it tried when one is missing;
//!   [`libraries`]: which major, and why not the other;
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
//! cuDNN (`libcudnn.so.9`), where present, runs attention on Hopper ([`cudnn`]): the fused
//! attention PyTorch's SDPA runs there, through cuDNN's backend API, checked at open against the
//! plugin's own kernel before it serves.
//!
//! Options (`[plugins.cuda]` in the config): `tf32` (f32 GEMMs on TF32 tensor cores; default
//! off), `kernel_cache` (a folder, or `off`), `memory_only` (driver only: memory, transfers,
//! staging, no ops), `staged_writes`, `attention_queries`, `attention_engine` (`auto`, `cudnn`
//! or `kernel`), `elementwise_lanes`. docs/CUDA.md has requirements, environment variables and
//! what is verified without a GPU.

pub mod cudnn;
pub mod device;
pub mod error;
pub mod kernels;
pub mod libraries;
pub mod loader;
pub(crate) mod memory;
pub(crate) mod ops;
pub mod result;
pub mod sys;

pub use device::{AttentionEngine, AttentionQueries, CudaDevice, CudaOptions};

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
