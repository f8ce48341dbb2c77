//! The ops: GEMM through cuBLASLt and cuBLAS (`gemm`), everything else through the NVRTC
//! kernels of [`crate::kernels`]: `norm` (layer and RMS norm), `elementwise` (activations,
//! binary ops, casts, row gathers), `rotary`, `attention` (with `sdpa`, its runs through
//! cuDNN's fused attention where that serves); the batched copy is here. Each
//! kernel's parameters are a struct of its own ([`kernel_args!`]), typed as the kernel's
//! signature reads them.
//!
//! [`Compute`] is what a device needs to run ops, created at `open` unless the device is opened
//! memory-only: the CUDA libraries of the process ([`crate::libraries`]: cuBLAS, cuBLASLt and
//! NVRTC of one CUDA major), the cuBLAS and cuBLASLt handles (bound to the device's stream),
//! the loaded kernel module, a device status word through which kernels report bad gather
//! indices and attention segment bounds, a fixed buffer of copy descriptors for batched copies (allocated at `open`, so
//! that no later call grows what the device holds; a larger batch runs as several launches),
//! and cuDNN with its handle where the `attention_engine` option and the device allow it.
//! Every op validates its arguments with [`iris_plugin::validate`] before it enqueues anything.

mod attention;
mod elementwise;
mod gemm;
mod norm;
mod rotary;
mod sdpa;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{DriverError, result};
use iris_plugin::Logger;
use iris_plugin::abi::{DType, HeldMemory, OpKind, PluginError, Property, property};
use iris_plugin::validate::Mat;

use crate::device::{AttentionQueries, CudaDevice, CudaOptions, Info, push_growth, used};
use crate::error::{CudaError, DriverResultExt};
use crate::kernels::{self, Cache, Module, Target};
use crate::libraries::{self, CudaLibraries};
use crate::loader::{self, Library};
use crate::result::{cublas, cublaslt};
use crate::sys;

pub use gemm::GemmState;

/// The ops this device implements.
pub const SUPPORTED: [OpKind; 9] = OpKind::ALL;

/// A batched copy of more small regions than this runs them as one kernel; fewer run as driver
/// copies.
pub const COPY_KERNEL_MIN_REGIONS: usize = 8;
/// Regions of this many bytes and more go to the copy engine (`cuMemcpyDtoDAsync`), which moves
/// them at full bandwidth without taking SMs; smaller ones are cheaper in one kernel.
pub const COPY_ENGINE_MIN_BYTES: u64 = 64 << 10;
/// Bytes of a region one block of the copy kernel moves (16 bytes per thread).
const COPY_CHUNK: u64 = THREADS as u64 * 16;

/// Bytes of the copy descriptor buffer: 2730 regions of three 8-byte words per launch.
const DESCRIPTOR_BYTES: u64 = 64 << 10;

/// Regions one launch of the batched-copy kernel takes from the descriptor buffer.
const REGIONS_PER_LAUNCH: usize = (DESCRIPTOR_BYTES / 24) as usize;

/// Threads per block of the elementwise, norm and gather kernels.
pub(crate) const THREADS: u32 = 256;
/// Threads per block of both attention kernels (4 warps).
pub(crate) const ATTENTION_THREADS: u32 = 128;
/// Queries per block of the f32-compute attention kernel.
pub(crate) const ATTENTION_QUERIES: u64 = 32;
/// Largest grid y and z dimension.
pub(crate) const GRID_YZ: u64 = 65_535;
/// Column blocks of an elementwise grid at most (the kernels stride over the rest).
pub(crate) const GRID_X_ELEMENTWISE: u64 = 1024;
/// Blocks of a four-wide elementwise grid at most (the kernels stride over the rest).
pub(crate) const GRID_X_GROUPS: u64 = 1 << 16;
/// Columns a thread of an elementwise, norm or rotary kernel takes at once where every view
/// allows it ([`lanes`]): one access of 8 (f16, bf16) or 16 bytes (f32) per view.
pub(crate) const WIDE_LANES: u32 = 4;
/// Row blocks of a norm grid at most (the kernel strides over the rest).
pub(crate) const GRID_X_NORM: u64 = 1 << 20;

/// Library handles, kernels and scratch of one device.
pub struct Compute {
    /// The process's cuBLAS, cuBLASLt and NVRTC.
    libs: &'static CudaLibraries,
    lt: LtHandle,
    blas: BlasHandle,
    module: Module,
    /// Flags kernels set (a bad gather index, attention segment bounds outside the call's
    /// rows), its page-locked copy, whether a kernel that may set one was enqueued since the
    /// last check, and the lock of one check at a time.
    status: DeviceWord,
    status_host: HostWord,
    status_pending: AtomicBool,
    status_read: Mutex<()>,
    descriptors: Mutex<Descriptors>,
    gemm: Mutex<GemmState>,
    tf32: bool,
    cc: (i32, i32),
    kernel_origin: String,
    /// Streaming multiprocessors (0 when the driver did not say), for the attention kernels'
    /// choice of block size.
    sms: u64,
    attention_queries: AttentionQueries,
    /// The 128-query attention kernels: which head dims they serve, and what the check said.
    pub(crate) q128: WideAttention,
    /// The most columns per thread the elementwise kernels may take ([`lanes`]): 1 until the
    /// device's open has run them four-wide against one-wide on the same inputs
    /// (`CudaDevice::check_elementwise_lanes`), [`WIDE_LANES`] once they gave the same results,
    /// unless option `elementwise_lanes = 1` holds it at 1. The check sets it to each width in
    /// turn.
    pub(crate) lanes_cap: AtomicU32,
    /// What `iris devices` shows of the elementwise kernels' width: in use, and why.
    pub(crate) lanes_note: String,
    /// cuDNN's fused attention, where the options and the device allow it.
    pub(crate) sdpa: sdpa::Sdpa,
    /// The device's log (what a new cuBLASLt problem cost, at debug level).
    log: Logger,
}

/// Head dims whose 128-query attention kernel serves: none until the device's open has run it
/// against the 64-query kernel (`CudaDevice::check_attention_kernels`), then those that gave the
/// same bits.
#[derive(Debug, Clone, Default)]
pub(crate) struct WideAttention {
    /// Head dims that passed.
    pub(crate) ready: Vec<u64>,
    /// Head dims whose kernel can run at all on this device (its shared memory fits).
    pub(crate) loadable: Vec<u64>,
    /// What `iris devices` shows: the kernels in use, and why any is not.
    pub(crate) note: String,
}

// SAFETY: the library handles, module and device addresses are driver objects usable from any
// thread while the context lives; the cuBLAS handle and the descriptor buffer are used under
// their mutexes (cuBLASLt's handle is thread-safe).
unsafe impl Send for Compute {}
// SAFETY: as above.
unsafe impl Sync for Compute {}

impl Compute {
    /// Loads (at the process's first use) cuBLASLt, cuBLAS and NVRTC of one CUDA major, then
    /// creates the handles and loads the kernels for the device whose context is current.
    pub(crate) fn open(
        stream: &cudarc::driver::CudaStream,
        info: &Info,
        options: &CudaOptions,
        log: &Logger,
        held: &mut Vec<HeldMemory>,
    ) -> Result<Compute, CudaError> {
        let libs = libraries::load(info.driver_version, info.cc, log)?;
        let before = used()?;
        let lt = LtHandle {
            lib: &libs.cublaslt,
            raw: cublaslt::create_handle(&libs.cublaslt)
                .map_err(|e| CudaError::blas("cublasLtCreate", e))?,
        };
        push_growth(held, "cuBLASLt handle", before)?;
        let before = used()?;
        let blas = BlasHandle {
            lib: &libs.cublas,
            raw: cublas::create_handle(&libs.cublas)
                .map_err(|e| CudaError::blas("cublasCreate", e))?,
        };
        // SAFETY: the handle is alive and the stream belongs to the current context.
        unsafe { cublas::set_stream(&libs.cublas, blas.raw, stream.cu_stream().cast()) }
            .map_err(|e| CudaError::blas("cublasSetStream", e))?;
        // Reductions (split-K) in the f32 accumulator type, never in an f16/bf16 output: a
        // half-precision output is rounded once (the default math mode allows rounding partial
        // sums to the output type).
        // SAFETY: the handle is alive.
        unsafe {
            cublas::set_math_mode(
                &libs.cublas,
                blas.raw,
                sys::cublas::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
            )
        }
        .map_err(|e| CudaError::blas("cublasSetMathMode", e))?;
        push_growth(held, "cuBLAS handle", before)?;

        let before = used()?;
        let LoadedKernels {
            module,
            origin: kernel_origin,
        } = load_kernels(info, options, log, libs)?;
        let growth = used()?.saturating_sub(before);
        let mut q128 = WideAttention {
            note: format!(
                "none: no tensor-core attention below compute capability {}.{}",
                FLASH_ATTENTION_COMPUTE_CAPABILITY.0, FLASH_ATTENTION_COMPUTE_CAPABILITY.1
            ),
            ..WideAttention::default()
        };
        if info.cc >= FLASH_ATTENTION_COMPUTE_CAPABILITY {
            let (loadable, refused) = allow_flash_attention_shared(&module)?;
            q128.note = if !kernels::q128_runs_on(info.cc) {
                format!(
                    "none: not built for compute capability {}.{} (the kernels spill registers \
                     there)",
                    info.cc.0, info.cc.1
                )
            } else if refused.is_empty() {
                "not checked yet".to_owned()
            } else {
                format!("head dims {refused}: more shared memory than the device gives a block")
            };
            if kernels::q128_runs_on(info.cc) {
                q128.loadable = loadable;
            }
        }
        held.push(HeldMemory {
            what: "kernels".into(),
            bytes: growth.max(module.image_bytes),
        });
        // Measured, as the descriptors below: a 4-byte `cuMemAlloc` may take a fresh page.
        let before = used()?;
        let status = DeviceWord::new()?;
        held.push(HeldMemory {
            what: "kernel status word".into(),
            bytes: used()?.saturating_sub(before).max(DeviceWord::BYTES as u64),
        });
        let before = used()?;
        let descriptors = Descriptors::new()?;
        let growth = used()?.saturating_sub(before);
        held.push(HeldMemory {
            what: "copy descriptors".into(),
            bytes: growth.max(DESCRIPTOR_BYTES),
        });
        let status_host = HostWord::new()?;
        let sdpa = sdpa::Sdpa::open(libs.major, stream, info, options, log, held)?;
        Ok(Compute {
            libs,
            lt,
            blas,
            module,
            status,
            status_host,
            status_pending: AtomicBool::new(false),
            status_read: Mutex::new(()),
            descriptors: Mutex::new(descriptors),
            gemm: Mutex::new(GemmState::default()),
            tf32: options.tf32,
            cc: info.cc,
            kernel_origin,
            sms: u64::try_from(info.sms).unwrap_or(0),
            attention_queries: options.attention_queries,
            q128,
            lanes_cap: AtomicU32::new(1),
            lanes_note: "1 (not checked)".to_owned(),
            sdpa,
            log: *log,
        })
    }

    /// Plugin-specific description properties.
    pub(crate) fn properties(&self) -> Vec<Property> {
        vec![
            Property::new("cuda_libraries", self.libs.summary()),
            Property::new("cublas_version", self.libs.cublas_version_number()),
            Property::new("cublaslt_version", self.libs.cublaslt_version),
            Property::new("kernels", &self.kernel_origin),
            Property::new("f32_gemm", if self.tf32 { "tf32" } else { "f32" }),
            Property::new(
                "attention_q128",
                format!(
                    "{}; attention_queries = {}",
                    self.q128.note,
                    match self.attention_queries {
                        AttentionQueries::Auto => "auto".to_owned(),
                        AttentionQueries::Fixed(queries) => queries.to_string(),
                    }
                ),
            ),
            Property::new("elementwise_lanes", &self.lanes_note),
            Property::new("attention_engine", &self.sdpa.note),
            // cuBLASLt chooses its kernel per problem size, and the libraries load kernels
            // (and grow local memory for them) on first use: the host should run its steps at
            // a range of sizes before serving and before its post-start memory checkpoint.
            Property::new(property::WARM_UP, property::WARM_UP_STEP_SIZES),
        ]
    }

    /// Waits for `stream` with `wait` and reports what kernels enqueued before it recorded in
    /// the status word (a bad gather index, bad attention segment bounds), naming `op`, the
    /// ABI call that waited. The word is read only when such a kernel was enqueued since the
    /// last check, and then without a blocking copy: its copy into page-locked memory (and its
    /// reset) are enqueued on `stream` before the wait, and the host reads the copy after it.
    pub(crate) fn synchronize_with_status(
        &self,
        op: &str,
        stream: CUstream,
        wait: impl FnOnce() -> Result<(), PluginError>,
    ) -> Result<(), PluginError> {
        if !self.status_pending.swap(false, Ordering::AcqRel) {
            return wait();
        }
        // One reader at a time: the page-locked word is shared.
        let _reading = lock(&self.status_read);
        if let Err(err) = self.status.enqueue_read(stream, &self.status_host) {
            // Not read: the next wait reads it.
            self.status_pending.store(true, Ordering::Release);
            return Err(err.into_plugin(op));
        }
        wait()?;
        match status_message(self.status_host.take()) {
            None => Ok(()),
            Some(found) => Err(PluginError::invalid_argument(format!("{op}: {found}"))),
        }
    }

    /// Marks the status word as worth reading at the next synchronisation: a kernel that may
    /// set it was enqueued.
    pub(crate) fn status_may_change(&self) {
        self.status_pending.store(true, Ordering::Release);
    }

    /// Enqueues kernels copying every `(src, dst, bytes)` region, each spread over
    /// `bytes / COPY_CHUNK` blocks: one launch per [`REGIONS_PER_LAUNCH`] regions, each reading
    /// its regions from the descriptor buffer after the previous launch has read it (the copy
    /// into it and the launches are ordered on `stream`).
    pub(crate) fn copy_regions(
        &self,
        stream: CUstream,
        moves: &[(u64, u64, u64)],
    ) -> Result<(), CudaError> {
        let descriptors = lock(&self.descriptors);
        for part in moves.chunks(REGIONS_PER_LAUNCH) {
            self.copy_regions_once(stream, &descriptors, part)?;
        }
        Ok(())
    }

    fn copy_regions_once(
        &self,
        stream: CUstream,
        descriptors: &Descriptors,
        moves: &[(u64, u64, u64)],
    ) -> Result<(), CudaError> {
        let words: Vec<u64> = moves.iter().flat_map(|&(s, d, n)| [s, d, n]).collect();
        debug_assert!((words.len() * 8) as u64 <= DESCRIPTOR_BYTES);
        // SAFETY: the descriptor buffer holds DESCRIPTOR_BYTES, at least `words` (the caller
        // splits batches by REGIONS_PER_LAUNCH); the pageable source is staged before the call
        // returns. The previous launch read the buffer earlier on the same stream.
        unsafe { result::memcpy_htod_async(descriptors.ptr, &words, stream) }
            .call("cuMemcpyHtoDAsync")?;
        let count = moves.len() as u64;
        let longest = moves.iter().map(|&(_, _, n)| n).max().unwrap_or(0);
        let mut args = CopyRegionsArgs {
            regions: descriptors.ptr,
            count: i64_of(count),
            chunk: i64_of(COPY_CHUNK),
        };
        // Chunks along x, regions along y (the kernel strides over regions beyond the grid).
        let dims = (
            grid(longest.div_ceil(COPY_CHUNK), i32::MAX as u64),
            grid(count, GRID_YZ),
            1,
        );
        self.launch(stream, "copy_regions", dims, THREADS, &mut args)
    }

    pub(crate) fn launch(
        &self,
        stream: CUstream,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut impl KernelArgs,
    ) -> Result<(), CudaError> {
        self.launch_with_shared(stream, name, grid, block, 0, args)
    }

    /// Launches a kernel with `shared` bytes of dynamic shared memory (beyond 48 KiB only for
    /// kernels whose limit `open` raised).
    pub(crate) fn launch_with_shared(
        &self,
        stream: CUstream,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &mut impl KernelArgs,
    ) -> Result<(), CudaError> {
        let function = self.module.function(name)?;
        let mut params = args.params();
        // SAFETY: the function comes from the loaded module; `params` points at each field of
        // `args`, which lives until the call returns (the driver copies the values), one per
        // kernel parameter in order with the type the kernel's signature reads; every address
        // was checked against a live buffer by the caller.
        unsafe { result::launch_kernel(function, grid, (block, 1, 1), shared, stream, &mut params) }
            .call("cuLaunchKernel")
    }

    /// Whether the tensor-core attention kernels run on this device (sm_80 and later).
    pub(crate) fn has_flash_attention(&self) -> bool {
        self.cc >= FLASH_ATTENTION_COMPUTE_CAPABILITY
    }
}

/// The compute capability from which the tensor-core attention kernels run (`mma.sync` with
/// bf16, `cp.async`); before it, f16 and bf16 attention runs on the f32-compute kernel.
pub(crate) const FLASH_ATTENTION_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Lets each tensor-core attention kernel have the dynamic shared memory it launches with:
/// above 48 KiB (head dims 96 and 128) a kernel needs the function's opt-in. A 64-query kernel
/// that cannot have it fails the open; a 128-query one is left out (sm_86 and sm_89 give a block
/// at most 99 KiB; every kernel fits it today, but a larger one would be refused there). Returns
/// the head dims
/// whose 128-query kernels can run, and the others as text.
fn allow_flash_attention_shared(module: &Module) -> Result<(Vec<u64>, String), CudaError> {
    let allow = |name: &str, bytes: u32| -> Result<Result<(), DriverError>, CudaError> {
        let function = module.function(name)?;
        // SAFETY: the function comes from the loaded module, which outlives the call.
        Ok(unsafe {
            result::function::set_function_attribute(
                function,
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32::try_from(bytes).unwrap_or(i32::MAX),
            )
        })
    };
    let [narrow, wide] = kernels::FLASH_ATTENTION_QUERIES;
    for size in kernels::FLASH_ATTENTION_SIZES {
        let bytes = kernels::flash_attention_shared_bytes(size, narrow);
        for dtype in kernels::FLASH_ATTENTION_TYPES {
            allow(&kernels::flash_attention_name(dtype, size, narrow), bytes)?
                .call("cuFuncSetAttribute")?;
        }
    }
    let mut loadable = Vec::new();
    let mut refused = Vec::new();
    for size in kernels::FLASH_ATTENTION_Q128_SIZES {
        let bytes = kernels::flash_attention_shared_bytes(size, wide);
        let mut fits = true;
        for dtype in kernels::FLASH_ATTENTION_TYPES {
            fits &= allow(&kernels::flash_attention_name(dtype, size, wide), bytes)?.is_ok();
        }
        if fits {
            loadable.push(size);
        } else {
            refused.push(size.to_string());
        }
    }
    Ok((loadable, refused.join(", ")))
}

/// A kernel's parameters, each passed to `cuLaunchKernel` by address with its own type and size,
/// in the order of the kernel's signature. Written with [`kernel_args!`].
pub(crate) trait KernelArgs {
    /// The address of each parameter, in order.
    fn params(&mut self) -> Vec<*mut c_void>;
}

/// Declares a kernel's parameter struct: one field per parameter of the CUDA signature, in
/// order, typed as the kernel reads it (`u64` for a device pointer, `i64`, `i32`, `f32`).
macro_rules! kernel_args {
    ($(#[$meta:meta])* struct $name:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy)]
        pub(crate) struct $name {
            $(pub(crate) $field: $ty),*
        }

        impl $crate::ops::KernelArgs for $name {
            fn params(&mut self) -> Vec<*mut std::ffi::c_void> {
                vec![$((&mut self.$field as *mut $ty).cast::<std::ffi::c_void>()),*]
            }
        }
    };
}
pub(crate) use kernel_args;

kernel_args! {
    /// `copy_regions(const u64* regions, i64 count, i64 chunk)`.
    struct CopyRegionsArgs { regions: u64, count: i64, chunk: i64 }
}

/// A size or stride as the kernels' `i64` (validated sizes lie far below `i64::MAX`).
pub(crate) fn i64_of(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// A dimension or stride of a checked view as the kernels' `i64`.
pub(crate) fn dim(value: usize) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// A grid dimension of `n` blocks, clamped to `[1, cap]`.
pub(crate) fn grid(n: u64, cap: u64) -> u32 {
    u32::try_from(n.clamp(1, cap)).unwrap_or(u32::MAX)
}

/// A grid for a `[rows, cols]` elementwise kernel: column blocks in x, rows in y.
pub(crate) fn grid_2d(rows: u64, cols: u64) -> (u32, u32, u32) {
    (
        grid(cols.div_ceil(u64::from(THREADS)), GRID_X_ELEMENTWISE),
        grid(rows, GRID_YZ),
        1,
    )
}

/// One view an elementwise kernel reads or writes: its first element's device address, its row
/// stride in elements and its element size in bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Access {
    pub addr: u64,
    pub stride: u64,
    pub elem_bytes: u64,
}

impl Access {
    /// A checked view at device address `addr`.
    pub(crate) fn of(addr: u64, mat: &Mat) -> Access {
        Access {
            addr,
            stride: mat.stride as u64,
            elem_bytes: mat.dtype.size().unwrap_or(4),
        }
    }
}

impl Compute {
    /// Columns per thread for an elementwise kernel: [`lanes`], within what the device's open
    /// proved and the options allow.
    pub(crate) fn lanes(&self, rows: u64, cols: u64, views: &[Access]) -> u32 {
        if self.lanes_cap.load(Ordering::Acquire) < WIDE_LANES {
            1
        } else {
            lanes(rows, cols, views)
        }
    }
}

/// Columns per thread for a kernel over `groups` rows of `cols` columns touching `views`:
/// [`WIDE_LANES`] when `cols`, every view's row stride and every view's address (in its own
/// elements) are multiples of it, so that each group is one aligned access (a GPU faults on a
/// misaligned one), and the kernels' 32-bit group index covers the whole grid; otherwise 1.
pub(crate) fn lanes(rows: u64, cols: u64, views: &[Access]) -> u32 {
    let wide = u64::from(WIDE_LANES);
    let aligned = views
        .iter()
        .all(|v| v.stride.is_multiple_of(wide) && v.addr.is_multiple_of(wide * v.elem_bytes));
    let fits = rows
        .checked_mul(cols / wide)
        .is_some_and(|groups| groups < 1 << 31);
    if cols.is_multiple_of(wide) && aligned && fits {
        WIDE_LANES
    } else {
        1
    }
}

/// The grid of an elementwise kernel over `[rows, cols]` taking `lanes` columns per thread:
/// [`grid_2d`] for one, the flattened groups in x for [`WIDE_LANES`].
pub(crate) fn lanes_grid(rows: u64, cols: u64, lanes: u32) -> (u32, u32, u32) {
    if lanes == 1 {
        return grid_2d(rows, cols);
    }
    let groups = rows * (cols / u64::from(lanes));
    (
        grid(groups.div_ceil(u64::from(THREADS)), GRID_X_GROUPS),
        1,
        1,
    )
}

pub(crate) fn dtype_name(dtype: DType) -> &'static str {
    dtype.name().unwrap_or("f32")
}

/// Device address of a checked view's first element.
pub(crate) fn addr(device: &CudaDevice, op: &str, mat: &Mat) -> Result<u64, PluginError> {
    Ok(device.view(op, mat.buf)?.at(mat.offset))
}

pub(crate) fn optional_addr(
    device: &CudaDevice,
    op: &str,
    mat: &Option<Mat>,
) -> Result<u64, PluginError> {
    match mat {
        Some(mat) => addr(device, op, mat),
        None => Ok(0),
    }
}

/// The kernel module of a device and where it came from (for the description).
struct LoadedKernels {
    module: Module,
    origin: String,
}

/// Compiles (with the NVRTC of `libs`) or loads from the cache the kernel module for the
/// device.
fn load_kernels(
    info: &Info,
    options: &CudaOptions,
    log: &Logger,
    libs: &CudaLibraries,
) -> Result<LoadedKernels, CudaError> {
    let cache = Cache::locate(options.kernel_cache.as_deref());
    let cc = u32::try_from(info.cc.0 * 10 + info.cc.1)
        .map_err(|_| CudaError::Unsupported(format!("compute capability {:?}", info.cc)))?;
    let nvrtc = libs.nvrtc.as_ref().ok();
    let nvrtc_version = nvrtc.map(|nvrtc| nvrtc.version);
    let target = match nvrtc {
        Some(nvrtc) => kernels::target_for(cc, &kernels::supported_archs(&nvrtc.lib)?),
        None => Target::Cubin(cc),
    };
    if let Some((path, image)) = cache.load(target, info.driver_version, nvrtc_version) {
        match Module::load(&image) {
            Ok(module) => {
                log.info(format!(
                    "kernels for {} loaded from {}",
                    target.arch(),
                    path.display()
                ));
                return Ok(LoadedKernels {
                    module,
                    origin: format!("cached {}", target.arch()),
                });
            }
            Err(err) => log.warn(format!(
                "cached kernels {} do not load ({err}); compiling again",
                path.display()
            )),
        }
    }
    let Some(nvrtc) = nvrtc else {
        let why = libs.nvrtc.as_ref().err().cloned().unwrap_or_default();
        let cached = match cache.dir() {
            Some(dir) => format!(
                "no cached kernels for {} in {}",
                target.arch(),
                dir.display()
            ),
            None => "the kernel cache is off".to_owned(),
        };
        return Err(CudaError::LibraryMissing {
            library: Library::Nvrtc.file_name(libs.major),
            tried: format!(
                "NVRTC of CUDA {}, the major of the cuBLAS loaded, compiles the kernels: {why}; {}; \
                 and {cached}",
                libs.major,
                loader::searched()
            ),
        });
    };
    let (major, minor) = nvrtc.version;
    let compiled = kernels::compile(&nvrtc.lib, target, &[])?;
    log.info(format!(
        "compiled {} kernels for {} with NVRTC {major}.{minor} in {} ms ({} KiB)",
        kernels::kernel_names().len(),
        target.arch(),
        compiled.millis,
        compiled.image.len() >> 10
    ));
    if cache.dir().is_some() {
        match cache.store(target, info.driver_version, (major, minor), &compiled.image) {
            Ok(path) => log.debug(format!("kernels cached at {}", path.display())),
            Err(err) => log.warn(format!("kernel cache not written: {err}")),
        }
    }
    let module = Module::load(&compiled.image)?;
    Ok(LoadedKernels {
        module,
        origin: format!("compiled {} in {} ms", target.arch(), compiled.millis),
    })
}

/// A cuBLASLt handle, destroyed on drop.
struct LtHandle {
    lib: &'static sys::CublasLt,
    raw: sys::cublaslt::cublasLtHandle_t,
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle` with `lib`, destroyed once.
        let _ = unsafe { cublaslt::destroy_handle(self.lib, self.raw) };
    }
}

/// A cuBLAS handle, destroyed on drop.
struct BlasHandle {
    lib: &'static sys::Cublas,
    raw: sys::cublas::cublasHandle_t,
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle` with `lib`, destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.lib, self.raw) };
    }
}

/// A 4-byte device word kernels set flags in.
/// Status word bit: a `gather_rows` index outside its source rows (`STATUS_BAD_GATHER_INDEX`
/// in the kernels).
const STATUS_BAD_GATHER_INDEX: u32 = 1;
/// Status word bit: an attention segment whose bounds in the device copy of `cu_seqlens` lie
/// outside the call's rows, or past the queries the launch (sized from the host copy) reaches
/// (`STATUS_BAD_SEGMENT` in the kernels).
const STATUS_BAD_SEGMENT: u32 = 2;

/// What the status word `word` says the caller got wrong, one sentence per bit set; `None`
/// when it is 0.
fn status_message(word: u32) -> Option<String> {
    if word == 0 {
        return None;
    }
    let mut found = Vec::new();
    if word & STATUS_BAD_GATHER_INDEX != 0 {
        found.push(
            "a gather_rows enqueued earlier had an index outside its source rows; those rows \
             were written as zeros",
        );
    }
    if word & STATUS_BAD_SEGMENT != 0 {
        found.push(
            "an attention enqueued earlier found segment bounds in `cu_seqlens_device` that \
             disagree with `cu_seqlens` (outside the call's rows, or longer than the launch \
             sized from `cu_seqlens` reaches); those segments were not computed",
        );
    }
    if word & !(STATUS_BAD_GATHER_INDEX | STATUS_BAD_SEGMENT) != 0 {
        found.push("a kernel set an unknown status bit");
    }
    Some(found.join("; "))
}

struct DeviceWord {
    ptr: CUdeviceptr,
}

impl DeviceWord {
    const BYTES: usize = 4;

    fn new() -> Result<DeviceWord, CudaError> {
        // SAFETY: a plain allocation in the current context, zeroed synchronously below.
        let ptr = unsafe { result::malloc_sync(Self::BYTES) }.call("cuMemAlloc")?;
        let word = DeviceWord { ptr };
        // SAFETY: the word is 4 bytes of live device memory.
        unsafe { result::memset_d8_sync(word.ptr, 0, Self::BYTES) }.call("cuMemsetD8")?;
        // That memset is ordered on the legacy stream, which nothing orders the plugin's
        // non-blocking stream after: wait for it here, once, at open.
        result::ctx::synchronize().call("cuCtxSynchronize")?;
        Ok(word)
    }

    /// Enqueues on `stream` a copy of the word into `host`, then its reset to zero.
    fn enqueue_read(&self, stream: CUstream, host: &HostWord) -> Result<(), CudaError> {
        // SAFETY: the word is 4 live bytes and `host` 4 page-locked bytes that live as long as
        // the device; the host reads them only after waiting for the stream.
        unsafe {
            result::memcpy_dtoh_async(
                std::slice::from_raw_parts_mut(host.ptr, 1),
                self.ptr,
                stream,
            )
            .call("cuMemcpyDtoHAsync")?;
            result::memset_d8_async(self.ptr, 0, Self::BYTES, stream).call("cuMemsetD8Async")
        }
    }
}

/// 4 bytes of page-locked host memory, the copy of a [`DeviceWord`].
struct HostWord {
    ptr: *mut u32,
}

impl HostWord {
    fn new() -> Result<HostWord, CudaError> {
        // SAFETY: a plain page-locked allocation (cached, flags 0), zeroed before use.
        let ptr = unsafe { result::malloc_host(DeviceWord::BYTES, 0) }.call("cuMemHostAlloc")?;
        let word = HostWord { ptr: ptr.cast() };
        // SAFETY: 4 live, aligned bytes no device work uses yet.
        unsafe { word.ptr.write_volatile(0) };
        Ok(word)
    }

    /// The value copied in, reset to zero for the next copy (the caller waited for the copy).
    fn take(&self) -> u32 {
        // SAFETY: 4 live, aligned bytes; the copy into them has completed (the caller waited
        // for the stream) and no other copy is enqueued (one check at a time).
        unsafe {
            let value = self.ptr.read_volatile();
            self.ptr.write_volatile(0);
            value
        }
    }
}

impl Drop for HostWord {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once, after the queue drained (device close).
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

impl Drop for DeviceWord {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once, after the queue drained (device close).
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// The device buffer batched copies read their regions from, [`DESCRIPTOR_BYTES`] long.
struct Descriptors {
    ptr: CUdeviceptr,
}

impl Descriptors {
    fn new() -> Result<Descriptors, CudaError> {
        // SAFETY: a plain allocation in the current context.
        let ptr = unsafe { result::malloc_sync(crate::usize_of(DESCRIPTOR_BYTES)) }
            .map_err(|err| CudaError::driver("cuMemAlloc", err))?;
        Ok(Descriptors { ptr })
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once, after the queue drained (device close, or a
        // failed open before anything was enqueued).
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded values stay consistent across a panic (plain fields written at once).
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(addr: u64, stride: u64, elem_bytes: u64) -> Access {
        Access {
            addr,
            stride,
            elem_bytes,
        }
    }

    #[test]
    fn four_lanes_only_where_every_access_is_aligned() {
        // bf16 out (8-byte groups) and an f32 source (16-byte groups), both aligned.
        let bf16 = view(0x1000, 1152, 2);
        let f32 = view(0x2000, 1152, 4);
        assert_eq!(lanes(8192, 1152, &[bf16, f32]), WIDE_LANES);
        // A broadcast row (stride 0) is aligned wherever its address is.
        assert_eq!(lanes(8192, 1152, &[bf16, view(0x3008, 0, 2)]), WIDE_LANES);
        // An address one bf16 element past alignment; an f32 one 8 bytes past.
        assert_eq!(lanes(8192, 1152, &[view(0x1002, 1152, 2)]), 1);
        assert_eq!(lanes(8192, 1152, &[bf16, view(0x2008, 1152, 4)]), 1);
        // A row stride that moves the next row off alignment (a column slice of width 1150).
        assert_eq!(lanes(8192, 1152, &[view(0x1000, 1150, 2)]), 1);
        // Columns not a multiple of four.
        assert_eq!(lanes(8192, 1150, &[view(0x1000, 1152, 2)]), 1);
        // More groups than the kernels' 32-bit index covers.
        assert_eq!(lanes(1 << 22, 1 << 11, &[bf16]), 1);
        assert_eq!(lanes((1 << 22) - 1, 1 << 11, &[bf16]), WIDE_LANES);
    }

    #[test]
    fn four_lane_grids_cover_every_group_in_x() {
        assert_eq!(lanes_grid(3, 10, 1), grid_2d(3, 10));
        // 8192 rows of 4304 columns: 8,814,592 groups, 34,432 blocks of 256.
        assert_eq!(lanes_grid(8192, 4304, WIDE_LANES), (34_432, 1, 1));
        // Capped: the kernels stride over the rest.
        assert_eq!(lanes_grid(1 << 20, 1 << 12, WIDE_LANES), (1 << 16, 1, 1));
    }
}
