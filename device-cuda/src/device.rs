//! The CUDA device: options, opening, description, memory, transfers, fills, staging and
//! fences. Ops live in the private `ops` module.
//!
//! One opened device is the primary context of its ordinal and one non-blocking stream, the
//! ABI's in-order queue. The context is bound to the calling thread at the top of every entry
//! point (cuBLAS and cuBLASLt do not bind it themselves, and the host calls from any thread).
//! Errors of enqueued work are sticky in CUDA: they surface at the next driver call, at the
//! latest at `synchronize`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{CudaContext, CudaStream};
use iris_plugin::abi::{
    Activation, ActivationArgs, AsyncWrite, AttentionArgs, BinaryArgs, BufferHandle, BufferSlice,
    CastArgs, CopyRegion, DType, DeviceDesc, FillArgs, GatherArgs, GemmArgs, HeldMemory, HostAlloc,
    HostBufferId, MatRef, MemInfo, MemoryReport, NormArgs, PluginError, Property, RotaryArgs,
    StagedCopy, property,
};
use iris_plugin::validate::{self, Checker};
use iris_plugin::{Backend, ErrorCode, Logger};

use crate::error::{CudaError, DriverResultExt};
use crate::loader;
use crate::memory::{self, AsyncUploads, DeviceView, Fences, HostBuffers, Memory};
use crate::ops::{Compute, WIDE_LANES};

/// The driver API version of the plugin's driver bindings (cudarc's CUDA 12.4 API), as
/// `cuDriverGetVersion` writes versions. Every 12.x and 13.x driver runs it; CUDA 13's own
/// bindings would call `_v2` entry points that 12.x drivers lack.
pub const DRIVER_API_VERSION: i32 = 12040;
/// The oldest driver the plugin runs on: CUDA 12.0 (R525). Which CUDA major's libraries it then
/// loads depends on the driver too ([`crate::libraries`]: CUDA 13's need a 13.0 driver).
pub const MIN_DRIVER_VERSION: i32 = 12000;
/// The oldest compute capability the kernels and cuBLASLt paths are written for: Volta, with
/// CUDA 12's libraries (CUDA 13's and its NVRTC start at Turing, 7.5; see
/// [`crate::libraries::min_compute_capability`]).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (7, 0);
/// The compute capability from which bf16 is offered (cuBLASLt has no bf16 GEMM before Ampere).
pub const BF16_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Options of [`CudaDevice::open`], from the `[plugins.cuda]` table of the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Let f32 GEMMs use TF32 tensor cores (faster, about 10 bits of mantissa). Default: off,
    /// f32 GEMMs compute in full f32.
    pub tf32: bool,
    /// The kernel cache folder, or `off`; `None`: [`crate::kernels::CACHE_ENV`] or the default.
    pub kernel_cache: Option<String>,
    /// Open with the driver only: memory, transfers, fills, staging and fences, and no ops
    /// (neither cuBLAS nor NVRTC is loaded).
    pub memory_only: bool,
    /// Answer `write_async` with "unsupported", so that the host converts and stages every
    /// upload itself on its own thread (as before ABI 2.2): for comparisons.
    pub staged_writes: bool,
    /// Queries per block of the tensor-core attention kernels.
    pub attention_queries: AttentionQueries,
    /// The most columns per thread the elementwise kernels (GEMM epilogue, norms, rotary,
    /// activations, add and multiply, casts) take: 4 (the default; where the views are aligned
    /// and the open-time check passed) or 1 (one element per thread, as before; for
    /// comparisons).
    pub elementwise_lanes: u32,
    /// Which attention runs for f16 and bf16: cuDNN's fused kernel or the plugin's own.
    pub attention_engine: AttentionEngine,
    /// Device memory, in bytes, that cuDNN's plans built after open may take (measured at each
    /// plan's first execution: the kernels cuDNN compiles or loads for it); once they hold that
    /// much, shapes without a plan run the plugin's kernel. Default 256 MiB.
    pub cudnn_plan_memory: u64,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            tf32: false,
            kernel_cache: None,
            memory_only: false,
            staged_writes: false,
            attention_queries: AttentionQueries::default(),
            elementwise_lanes: WIDE_LANES,
            attention_engine: AttentionEngine::default(),
            cudnn_plan_memory: DEFAULT_CUDNN_PLAN_MEMORY,
        }
    }
}

/// [`CudaOptions::cudnn_plan_memory`]'s default.
pub const DEFAULT_CUDNN_PLAN_MEMORY: u64 = 256 << 20;

/// Which attention serves f16 and bf16: cuDNN's fused kernel (`libcudnn.so.9`, 9.13.1 or newer,
/// loaded at run time) or the plugin's tensor-core kernels. cuDNN serves a head dim only after
/// the check at open gave the plugin kernel's results on the same inputs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionEngine {
    /// cuDNN on compute capability 9.0 and newer where it loads (PyTorch's attention runs it
    /// there, at two to three times the plugin kernel's rate on an H200), the plugin's kernels
    /// elsewhere.
    #[default]
    Auto,
    /// cuDNN on any device of compute capability 8.0 or newer; the open fails when it cannot be
    /// loaded.
    Cudnn,
    /// The plugin's kernels only; cuDNN is not loaded.
    Kernel,
}

/// Which tensor-core attention kernels run: 64 queries per block, 128, or the choice per call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionQueries {
    /// 128 queries per block where a launch has enough of them to fill the device twice over
    /// (a block reads each K and V tile once for twice the queries of a 64-query block, but a
    /// launch has half the blocks) and its segments fill three quarters of their rows, 64
    /// otherwise.
    #[default]
    Auto,
    /// Always this many (64 or 128) where the kernel is available (128: where it passed its
    /// check at open).
    Fixed(u64),
}

impl CudaOptions {
    /// Parses `key = value` options: `tf32`, `memory_only` and `staged_writes` (`true`/`false`),
    /// `kernel_cache` (a folder or `off`), `attention_queries` (`auto`, `64` or `128`) and
    /// `elementwise_lanes` (`4` or `1`), `attention_engine` (`auto`, `cudnn` or `kernel`) and
    /// `cudnn_plan_memory` (MiB).
    /// Unknown keys are errors naming the key.
    pub fn parse(pairs: &[(&str, &str)]) -> Result<CudaOptions, PluginError> {
        let mut options = CudaOptions::default();
        for (key, value) in pairs {
            match *key {
                "tf32" => options.tf32 = parse_bool(key, value)?,
                "memory_only" => options.memory_only = parse_bool(key, value)?,
                "staged_writes" => options.staged_writes = parse_bool(key, value)?,
                "kernel_cache" => {
                    if value.trim().is_empty() {
                        return Err(invalid_option("kernel_cache", value, "a folder or `off`"));
                    }
                    options.kernel_cache = Some(value.trim().to_owned());
                }
                "attention_queries" => {
                    options.attention_queries = match value.trim() {
                        "auto" => AttentionQueries::Auto,
                        "64" => AttentionQueries::Fixed(64),
                        "128" => AttentionQueries::Fixed(128),
                        _ => return Err(invalid_option(key, value, "`auto`, `64` or `128`")),
                    }
                }
                "elementwise_lanes" => {
                    options.elementwise_lanes = match value.trim() {
                        "4" => 4,
                        "1" => 1,
                        _ => return Err(invalid_option(key, value, "`4` or `1`")),
                    }
                }
                "attention_engine" => {
                    options.attention_engine = match value.trim() {
                        "auto" => AttentionEngine::Auto,
                        "cudnn" => AttentionEngine::Cudnn,
                        "kernel" => AttentionEngine::Kernel,
                        _ => {
                            return Err(invalid_option(key, value, "`auto`, `cudnn` or `kernel`"));
                        }
                    }
                }
                "cudnn_plan_memory" => {
                    options.cudnn_plan_memory = value
                        .trim()
                        .parse::<u64>()
                        .ok()
                        .and_then(|mib| mib.checked_mul(1 << 20))
                        .ok_or_else(|| {
                            invalid_option(key, value, "a whole number of MiB, such as `256`")
                        })?;
                }
                other => {
                    return Err(PluginError::invalid_argument(format!(
                        "open: unknown option `{other}` (known: tf32, kernel_cache, memory_only, \
                         staged_writes, attention_queries, elementwise_lanes, attention_engine, \
                         cudnn_plan_memory)"
                    )));
                }
            }
        }
        Ok(options)
    }
}

/// Facts about the device read once at open.
#[derive(Debug, Clone)]
pub struct Info {
    /// Device name.
    pub name: String,
    /// Total memory in bytes.
    pub total_memory: u64,
    /// Compute capability.
    pub cc: (i32, i32),
    /// Streaming multiprocessors (0 when the driver does not say).
    pub sms: i32,
    /// Peak memory bandwidth in bytes per second (0 when the driver does not say).
    pub bandwidth: u64,
    /// The SMs' highest clock in kHz, as the driver reports it (0 when it does not say).
    pub clock_khz: i32,
    /// `cuDriverGetVersion`, e.g. 12040.
    pub driver_version: i32,
}

/// An opened CUDA device.
pub struct CudaDevice {
    /// `write_async`'s page-locked slots and copy stream. First, because fields drop in order
    /// after `drop`: its copy stream and page-locked memory go while the context (released
    /// with `ctx` and `stream`) still exists and is bound to the closing thread.
    uploads: Mutex<AsyncUploads>,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) memory: Memory,
    host: HostBuffers,
    fences: Fences,
    pub(crate) compute: Option<Compute>,
    pub(crate) info: Info,
    held: Vec<HeldMemory>,
    options: CudaOptions,
    pub(crate) log: Logger,
    /// With [`CHECK_GROWTH_ENV`] set: the device memory in use beyond the report at the last
    /// entry point, and that entry point.
    growth: Option<Mutex<(i128, String)>>,
}

/// Set to `1`, every entry point first waits for the queue and logs a warning when the device
/// memory in use beyond what the memory report accounts for (buffers, held items, freed pool
/// memory) grew since the previous entry point, naming it: a way to find what a library or the
/// driver allocates on its own. It serialises the queue, so it is for diagnosis only.
pub const CHECK_GROWTH_ENV: &str = "IRIS_CUDA_CHECK_GROWTH";

impl CudaDevice {
    /// Opens device `ordinal` (as the driver numbers it, after `CUDA_VISIBLE_DEVICES`).
    pub fn open(
        ordinal: u32,
        options: CudaOptions,
        log: Logger,
    ) -> Result<CudaDevice, PluginError> {
        Self::open_inner(ordinal, options, log).map_err(|err| err.into_plugin("open"))
    }

    fn open_inner(
        ordinal: u32,
        options: CudaOptions,
        log: Logger,
    ) -> Result<CudaDevice, CudaError> {
        if let Some(hidden) = hidden_by_visible_devices() {
            return Err(CudaError::Unavailable(hidden));
        }
        loader::require_driver()?;
        result::init().call("cuInit")?;
        let driver_version = driver_version()?;
        if driver_version < MIN_DRIVER_VERSION {
            return Err(CudaError::Unsupported(format!(
                "the driver supports CUDA {}, this plugin needs {} or newer",
                version_text(driver_version),
                version_text(MIN_DRIVER_VERSION)
            )));
        }
        let count = result::device::get_count().call("cuDeviceGetCount")?;
        let index = i32::try_from(ordinal)
            .ok()
            .filter(|index| *index < count)
            .ok_or_else(|| {
                CudaError::Invalid(format!(
                    "device {ordinal} does not exist ({count} CUDA devices)"
                ))
            })?;
        let cu_device = result::device::get(index).call("cuDeviceGet")?;
        let was_active = primary_context_active(cu_device)?;
        let ctx = CudaContext::new(ordinal as usize).call("cuDevicePrimaryCtxRetain")?;
        let mut held = Vec::new();
        let (free, total) = result::mem_get_info().call("cuMemGetInfo")?;
        if !was_active {
            // Approximate: what the device uses right after this process created the context;
            // on a device shared with other processes their memory is counted too.
            push_held(&mut held, "context", (total - free) as u64);
        }
        let cc = ctx.compute_capability().call("cuDeviceGetAttribute")?;
        if cc < MIN_COMPUTE_CAPABILITY {
            return Err(CudaError::Unsupported(format!(
                "compute capability {}.{} is below the {}.{} this plugin needs",
                cc.0, cc.1, MIN_COMPUTE_CAPABILITY.0, MIN_COMPUTE_CAPABILITY.1
            )));
        }
        // Informational only: a driver that does not answer leaves them out of the description.
        let sms = attribute(
            &ctx,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .unwrap_or_else(|err| {
            log.warn(format!("open: SM count unknown: {err}"));
            0
        });
        let bandwidth = bandwidth(&ctx).unwrap_or_else(|err| {
            log.warn(format!("open: memory bandwidth unknown: {err}"));
            0
        });
        let clock_khz = attribute(
            &ctx,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
        )
        .unwrap_or_else(|err| {
            log.warn(format!("open: SM clock unknown: {err}"));
            0
        });
        let info = Info {
            name: ctx.name().call("cuDeviceGetName")?,
            total_memory: total as u64,
            cc,
            sms,
            bandwidth,
            clock_khz,
            driver_version,
        };
        let before = used()?;
        let stream = ctx.new_stream().call("cuStreamCreate")?;
        // SAFETY: the plugin never uses cudarc's owning slices, whose cross-stream tracking this
        // turns off; it orders all its work on its one stream itself.
        unsafe { ctx.disable_event_tracking() };
        let pools = attribute(
            &ctx,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
        )? > 0;
        let memory = Memory::new(index, pools)?;
        // The pool is the device's own: a failed open destroys it, or every one leaks a pool.
        let release = |memory: &Memory, err: CudaError| {
            if let Err(release) = memory.release_all(stream.cu_stream()) {
                log.warn(format!("open: {release}"));
            }
            err
        };
        let used_now = used().map_err(|err| release(&memory, err))?;
        push_held(
            &mut held,
            "stream and memory pool",
            used_now.saturating_sub(before),
        );
        let before = used_now;
        let uploads = AsyncUploads::new().map_err(|err| release(&memory, err))?;
        let used_now = used().map_err(|err| release(&memory, err))?;
        // The copy stream's own device memory (about 2 MiB on an H200 with driver 580).
        push_held(
            &mut held,
            "write_async's copy stream",
            used_now.saturating_sub(before),
        );
        let compute = if options.memory_only {
            None
        } else {
            Some(
                Compute::open(&stream, &info, &options, &log, &mut held)
                    .map_err(|err| release(&memory, err))?,
            )
        };
        let opened = format!(
            "opened CUDA device {ordinal}: {} (compute capability {}.{}, {} SMs, {} MiB, driver {}){}",
            info.name,
            cc.0,
            cc.1,
            info.sms,
            info.total_memory >> 20,
            version_text(driver_version),
            if compute.is_none() {
                ", memory only"
            } else {
                ""
            }
        );
        let mut device = CudaDevice {
            ctx,
            stream,
            memory,
            host: HostBuffers::default(),
            fences: Fences::default(),
            compute,
            info,
            held,
            options,
            log,
            growth: None,
            uploads: Mutex::new(uploads),
        };
        if device.compute.is_some() {
            // On failure the device drops here, releasing its pool, handles and module.
            device.warm_up()?;
        }
        device.log.info(opened);
        if std::env::var(CHECK_GROWTH_ENV).is_ok_and(|value| value == "1") {
            let beyond = device.beyond_report()?;
            device.growth = Some(Mutex::new((beyond, "open".to_owned())));
        }
        Ok(device)
    }

    /// Runs each GEMM path once on small operands (cuBLASLt for f16, bf16 and TF32, with and
    /// without its bias and GELU epilogues; cuBLAS for f32; the plugin's epilogue kernel) and
    /// checks the 128-query attention kernels against the 64-query ones, then
    /// records what the device holds beyond that as a held item. cuBLAS and cuBLASLt allocate
    /// device state of their own on a handle's first computation (cuBLAS's default workspace
    /// pool, kernels loaded on first use): without this it would appear with the first
    /// request, after the host's post-start checkpoint, and a reset could never give it back.
    fn warm_up(&mut self) -> Result<(), CudaError> {
        let fail = |err: PluginError| {
            CudaError::Unavailable(format!(
                "the first computation through cuBLAS and cuBLASLt failed: {}",
                err.message
            ))
        };
        memory::wait(self.cu_stream())?;
        let before = used()?;
        let mut buffers = Vec::new();
        let mut ran = self.warm_up_gemms(&mut buffers).map_err(fail);
        // The 128-query attention kernels serve only once they have given the 64-query kernels'
        // bits on this device (which also loads both before the post-start checkpoint).
        let has_flash = self
            .compute
            .as_ref()
            .is_some_and(Compute::has_flash_attention);
        if ran.is_ok() && has_flash {
            match self.check_attention_kernels(&mut buffers) {
                Ok(checked) => {
                    if let Some(compute) = self.compute.as_mut() {
                        compute.q128 = checked;
                    }
                }
                Err(err) => {
                    ran = Err(CudaError::Unavailable(format!(
                        "the attention kernels' check failed: {}",
                        err.message
                    )))
                }
            }
        }
        // cuDNN's attention serves a head dim and type only once it has given the plugin
        // kernel's results on this device (which also loads its kernels before the post-start
        // checkpoint).
        let cudnn = self
            .compute
            .as_ref()
            .and_then(|compute| compute.sdpa.library());
        if ran.is_ok() && cudnn.is_some() {
            let started = std::time::Instant::now();
            match self.check_cudnn_attention(&mut buffers) {
                Ok((ready, failures)) => {
                    // Plans are built (and may be compiled by cuDNN) in the check: its time is
                    // part of every start.
                    let took = started.elapsed().as_millis();
                    self.log
                        .info(format!("cuDNN attention's check at open took {took} ms"));
                    if let Some(compute) = self.compute.as_mut() {
                        compute.sdpa.record_check(ready, &failures, took);
                    }
                }
                Err(err) => {
                    ran = Err(CudaError::Unavailable(format!(
                        "cuDNN attention's check failed: {}",
                        err.message
                    )))
                }
            }
        }
        // The elementwise kernels take four columns per thread only once both widths have
        // given the same results on this device (which also loads them before the post-start
        // checkpoint), and only where the options allow it.
        if ran.is_ok() {
            let checked = if self.options.elementwise_lanes < WIDE_LANES {
                Ok((1, "1 (elementwise_lanes = 1)".to_owned()))
            } else {
                self.check_elementwise_lanes(&mut buffers)
                    .map(|differing| lanes_verdict(&differing))
            };
            match checked {
                Ok((lanes, note)) => {
                    if let Some(compute) = self.compute.as_mut() {
                        compute.lanes_cap.store(lanes, Ordering::Release);
                        compute.lanes_note = note;
                    }
                }
                Err(err) => {
                    ran = Err(CudaError::Unavailable(format!(
                        "the elementwise kernels' check failed: {}",
                        err.message
                    )))
                }
            }
        }
        let mut freed = Ok(());
        for buf in buffers {
            if let Err(err) = self.memory.free(self.cu_stream(), buf) {
                freed = Err(err);
            }
        }
        self.synchronize_impl("open").map_err(fail)?;
        self.memory.refresh(self.cu_stream())?;
        ran?;
        freed?;
        let growth = used()?
            .saturating_sub(before)
            .saturating_sub(self.memory.pool_cached()?);
        let what = if cudnn.is_some() {
            "cuBLAS, cuBLASLt and cuDNN state from their first computation"
        } else {
            "cuBLAS and cuBLASLt state from their first computation"
        };
        push_held(&mut self.held, what, growth);
        if let Some(compute) = &self.compute {
            compute.sdpa.set_opened(&self.ctx);
        }
        Ok(())
    }

    /// A buffer of at least `bytes` for the checks and warm-ups of `open`, recorded in `buffers`
    /// for [`CudaDevice::warm_up`] to free.
    pub(crate) fn alloc_for_open(
        &self,
        buffers: &mut Vec<BufferHandle>,
        bytes: u64,
    ) -> Result<BufferHandle, PluginError> {
        let buf = self
            .memory
            .alloc(self.cu_stream(), bytes.max(1))
            .map_err(|err| err.into_plugin("open"))?;
        buffers.push(buf);
        Ok(buf)
    }

    /// The GEMMs of [`CudaDevice::warm_up`]; the buffers it allocates go into `buffers`.
    fn warm_up_gemms(&self, buffers: &mut Vec<BufferHandle>) -> Result<(), PluginError> {
        const ROWS: u64 = 8;
        const COLS: u64 = 32;
        let mut dtypes = vec![DType::F32, DType::F16];
        if self.info.cc >= BF16_COMPUTE_CAPABILITY {
            dtypes.push(DType::BF16);
        }
        let mut alloc = |bytes: u64| self.alloc_for_open(buffers, bytes);
        for dtype in dtypes {
            let size = dtype.size().unwrap_or(4);
            let matrix = |buf, rows| MatRef::contiguous(buf, 0, dtype, rows, COLS);
            let a = matrix(alloc(ROWS * COLS * size)?, ROWS);
            let w = matrix(alloc(COLS * COLS * size)?, COLS);
            let bias = matrix(alloc(COLS * size)?, 1);
            let out = matrix(alloc(ROWS * COLS * size)?, ROWS);
            for m in [a, w, bias, out] {
                self.fill_impl(&FillArgs {
                    dst: BufferSlice {
                        buf: m.buf,
                        offset: 0,
                        bytes: m.rows * COLS * size,
                    },
                    value: 0,
                    width: 1,
                })?;
            }
            // The plain product, the fused bias and GELU epilogues, and an activation the
            // libraries cannot fuse (an f32 product finished by the plugin's kernel).
            let cases = [
                (MatRef::NONE, Activation::NONE),
                (bias, Activation::GELU_TANH),
                (bias, Activation::SILU),
            ];
            for (bias, activation) in cases {
                let mut args = GemmArgs {
                    a,
                    w,
                    bias,
                    out,
                    activation,
                    accumulate: false,
                    w_transposed: false,
                    w_constant: true,
                    workspace: BufferSlice::EMPTY,
                };
                let bytes = self.gemm_workspace_impl(&args)?;
                if bytes > 0 {
                    args.workspace = BufferSlice {
                        buf: alloc(bytes)?,
                        offset: 0,
                        bytes,
                    };
                }
                self.gemm_impl(&args)?;
            }
        }
        Ok(())
    }

    /// The options the device was opened with.
    pub fn options(&self) -> &CudaOptions {
        &self.options
    }

    /// The queue.
    pub(crate) fn cu_stream(&self) -> CUstream {
        self.stream.cu_stream()
    }

    /// Binds the context to the calling thread; every entry point starts here.
    pub(crate) fn enter(&self, op: &str) -> Result<(), PluginError> {
        self.ctx
            .bind_to_thread()
            .map_err(|err| CudaError::driver("cuCtxSetCurrent", err).into_plugin(op))?;
        if let Some(growth) = &self.growth {
            self.check_growth(growth, op)
                .map_err(|err| err.into_plugin(op))?;
        }
        Ok(())
    }

    /// `op`'s error, or the queue's sticky error where there is one behind it. cuBLAS,
    /// cuBLASLt and cuDNN answer a call in a faulted context (an illegal address in an earlier
    /// kernel, say) with an execution failure of their own, an internal error; the caller must
    /// see instead that the device can no longer compute (`unavailable`, naming the driver's
    /// error), as a kernel launch or a synchronisation there reports.
    fn name_fault(&self, op: &str, err: PluginError) -> PluginError {
        if err.code != ErrorCode::INTERNAL {
            return err;
        }
        // SAFETY: the stream belongs to the context `enter` bound; a query runs nothing. Success
        // and "still running" are not among the codes that stop the device.
        match unsafe { sys::cuStreamQuery(self.cu_stream()) } {
            code if crate::error::unavailable(code) => {
                let message = err.message.as_str();
                let symptom = message
                    .strip_prefix(op)
                    .and_then(|rest| rest.strip_prefix(": "))
                    .unwrap_or(message);
                CudaError::Faulted {
                    code,
                    symptom: symptom.to_owned(),
                }
                .into_plugin(op)
            }
            _ => err,
        }
    }

    /// [`CHECK_GROWTH_ENV`]'s check, before `op` runs.
    fn check_growth(&self, growth: &Mutex<(i128, String)>, op: &str) -> Result<(), CudaError> {
        memory::wait(self.cu_stream())?;
        let beyond = self.beyond_report()?;
        let mut last = crate::ops::lock(growth);
        if beyond > last.0 {
            self.log.warn(format!(
                "device memory beyond the memory report grew by {} bytes (to {beyond}) during \
                 the calls since `{}`",
                beyond - last.0,
                last.1
            ));
        }
        *last = (beyond, op.to_owned());
        Ok(())
    }

    /// Device memory in use (as the driver reports it) minus what the memory report accounts
    /// for; negative where held items were estimated high.
    fn beyond_report(&self) -> Result<i128, CudaError> {
        self.memory.refresh(self.cu_stream())?;
        let (allocated, _) = self.memory.accounting();
        let held: u64 = self.held.iter().map(|item| item.bytes).sum();
        let accounted = allocated + held + self.memory.pool_cached()?;
        Ok(i128::from(used()?) - i128::from(accounted))
    }

    /// The bytes of a live buffer, or an invalid-argument error naming `op`.
    pub(crate) fn view(&self, op: &str, buf: BufferHandle) -> Result<DeviceView, PluginError> {
        self.memory.get(buf).ok_or_else(|| {
            PluginError::invalid_argument(format!("{op}: unknown buffer handle {}", buf.0))
        })
    }

    /// The compute state, or "unsupported" when the device was opened memory-only.
    pub(crate) fn compute(&self, op: &str) -> Result<&Compute, PluginError> {
        self.compute.as_ref().ok_or_else(|| {
            PluginError::unsupported(format!(
                "op `{op}` is not available: the device was opened with memory_only = true"
            ))
        })
    }

    /// A checker for `op` that looks buffers up in this device's table.
    pub(crate) fn with_checker<T>(
        &self,
        op: &str,
        f: impl FnOnce(&Checker<'_>) -> Result<T, PluginError>,
    ) -> Result<T, PluginError> {
        let lens = |buf: BufferHandle| self.memory.len(buf);
        let check = Checker::new(op, &lens);
        f(&check)
    }

    fn describe_impl(&self) -> DeviceDesc {
        let dtypes: Vec<DType> = DType::ALL
            .into_iter()
            .filter(|dtype| *dtype != DType::BF16 || self.info.cc >= BF16_COMPUTE_CAPABILITY)
            .collect();
        let ops = if self.compute.is_some() {
            crate::ops::SUPPORTED.to_vec()
        } else {
            Vec::new()
        };
        let mut properties = vec![
            Property::new(
                property::COMPUTE_CAPABILITY,
                format!("{}.{}", self.info.cc.0, self.info.cc.1),
            ),
            Property::new(
                property::DRIVER_VERSION,
                version_text(self.info.driver_version),
            ),
            Property::new(property::QUEUE, "async"),
            Property::new("cuda_api_version", version_text(DRIVER_API_VERSION)),
        ];
        if self.info.sms > 0 {
            properties.push(Property::new(property::COMPUTE_UNITS, self.info.sms));
        }
        if self.info.bandwidth > 0 {
            properties.push(Property::new(
                property::MEMORY_BANDWIDTH,
                self.info.bandwidth,
            ));
        }
        if let Some(peak) = peak_flops(&self.info) {
            properties.push(Property::new(property::PEAK_FLOPS, peak));
        }
        if let Some(compute) = &self.compute {
            properties.extend(compute.properties());
        }
        DeviceDesc {
            name: self.info.name.clone().into(),
            vendor: "NVIDIA".into(),
            total_memory: self.info.total_memory,
            dtypes: dtypes.into(),
            ops: ops.into(),
            properties: properties.into(),
        }
    }

    fn memory_report_impl(&self) -> Result<MemoryReport, CudaError> {
        self.memory.refresh(self.cu_stream())?;
        let (allocated, buffers) = self.memory.accounting();
        let mut held = self.held.clone();
        if let Some(compute) = &self.compute {
            push_held(
                &mut held,
                "cuDNN plans built after open",
                compute.sdpa.grown(),
            );
        }
        push_held(
            &mut held,
            "memory pool (freed, not yet released)",
            self.memory.pool_cached()?,
        );
        Ok(MemoryReport {
            allocated,
            buffers,
            held: held.into(),
        })
    }

    /// Waits for the queue and reports a bad gather index; errors name `op`, the ABI call that
    /// waited (`synchronize` or `read`).
    fn synchronize_impl(&self, op: &str) -> Result<(), PluginError> {
        let wait = || self.wait_queue(op);
        match &self.compute {
            Some(compute) => compute.synchronize_with_status(op, self.cu_stream(), wait),
            None => wait(),
        }
    }

    /// Waits for the queue without reading the kernels' status word, whose report belongs to
    /// the caller's next `synchronize` (or `read`).
    fn wait_queue(&self, op: &str) -> Result<(), PluginError> {
        // Only the frees enqueued before the wait are known to have run after it.
        let waited = self.memory.pending();
        memory::wait(self.cu_stream()).map_err(|err| err.into_plugin(op))?;
        self.memory.released(waited);
        Ok(())
    }

    fn copy_batch_impl(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
        self.with_checker("copy_batch", |check| validate::copy_batch(check, regions))?;
        let mut moves = Vec::with_capacity(regions.len());
        for region in regions.iter().filter(|region| region.bytes > 0) {
            let src = self.view("copy_batch", region.src)?;
            let dst = self.view("copy_batch", region.dst)?;
            moves.push((
                src.at(region.src_offset),
                dst.at(region.dst_offset),
                region.bytes,
            ));
        }
        // Large regions go to the copy engine; many small ones to one kernel.
        let (mut driver, small): (Vec<_>, Vec<_>) = moves
            .into_iter()
            .partition(|&(_, _, bytes)| bytes >= crate::ops::COPY_ENGINE_MIN_BYTES);
        match &self.compute {
            Some(compute) if small.len() > crate::ops::COPY_KERNEL_MIN_REGIONS => compute
                .copy_regions(self.cu_stream(), &small)
                .map_err(|err| err.into_plugin("copy_batch"))?,
            _ => driver.extend(small),
        }
        for (src, dst, bytes) in driver {
            // SAFETY: both ranges were checked against live buffers and do not overlap.
            unsafe { memory::copy_device(dst, src, bytes, self.cu_stream()) }
                .map_err(|err| err.into_plugin("copy_batch"))?;
        }
        Ok(())
    }

    fn fill_impl(&self, args: &FillArgs) -> Result<(), PluginError> {
        self.with_checker("fill", |check| validate::fill(check, args))?;
        if args.dst.bytes == 0 {
            return Ok(());
        }
        let ptr = self.view("fill", args.dst.buf)?.at(args.dst.offset);
        // SAFETY: the range was checked against a live buffer; offset and length are multiples
        // of the width, so the element-wide memsets are aligned.
        unsafe {
            memory::fill(
                ptr,
                args.width,
                args.value,
                args.dst.bytes,
                self.cu_stream(),
            )
        }
        .map_err(|err| err.into_plugin("fill"))
    }

    fn staged(&self, op: &str, copy: &StagedCopy) -> Result<(u64, *mut u8), PluginError> {
        self.with_checker(op, |check| {
            validate::range(check, "device", copy.device, copy.device_offset, copy.bytes)
        })?;
        let device = self.view(op, copy.device)?.at(copy.device_offset);
        let Some((ptr, len)) = self.host.get(copy.host) else {
            return Err(PluginError::invalid_argument(format!(
                "{op}: unknown host buffer {}",
                copy.host.0
            )));
        };
        let fits = copy
            .host_offset
            .checked_add(copy.bytes)
            .is_some_and(|end| end <= len as u64);
        if !fits {
            return Err(PluginError::invalid_argument(format!(
                "{op}: `host`: bytes [{}, {}+{}) lie outside the host buffer of {len} bytes",
                copy.host_offset, copy.host_offset, copy.bytes
            )));
        }
        Ok((device, (ptr + crate::usize_of(copy.host_offset)) as *mut u8))
    }
}

impl Backend for CudaDevice {
    fn describe(&self) -> DeviceDesc {
        self.describe_impl()
    }

    fn mem_info(&self) -> Result<MemInfo, PluginError> {
        self.enter("mem_info")?;
        let (free, total) = result::mem_get_info()
            .call("cuMemGetInfo")
            .map_err(|err| err.into_plugin("mem_info"))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn memory_report(&self) -> Result<MemoryReport, PluginError> {
        self.enter("memory_report")?;
        self.memory_report_impl()
            .map_err(|err| err.into_plugin("memory_report"))
    }

    fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
        self.enter("alloc")?;
        if bytes == 0 {
            return Err(PluginError::invalid_argument(
                "alloc: size must be greater than 0",
            ));
        }
        self.memory
            .alloc(self.cu_stream(), bytes)
            .map_err(|err| err.into_plugin("alloc"))
    }

    fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
        self.enter("free")?;
        self.memory
            .free(self.cu_stream(), buf)
            .map_err(|err| err.into_plugin("free"))
    }

    fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
        self.enter("write")?;
        self.with_checker("write", |check| {
            validate::range(check, "dst", dst, offset, src.len() as u64)
        })?;
        if src.is_empty() {
            return Ok(());
        }
        let ptr = self.view("write", dst)?.at(offset);
        memory::write_from_host(ptr, src, self.cu_stream()).map_err(|err| err.into_plugin("write"))
    }

    fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
        self.enter("read")?;
        self.with_checker("read", |check| {
            validate::range(check, "src", src, offset, dst.len() as u64)
        })?;
        if !dst.is_empty() {
            let ptr = self.view("read", src)?.at(offset);
            // SAFETY: the range was checked; `dst` stays borrowed until the stream has been
            // synchronised below.
            unsafe { memory::read_to_host(dst, ptr, self.cu_stream()) }
                .map_err(|err| err.into_plugin("read"))?;
        }
        self.synchronize_impl("read")
    }

    fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
        self.enter("copy_batch")?;
        self.copy_batch_impl(regions)
    }

    fn fill(&self, args: &FillArgs) -> Result<(), PluginError> {
        self.enter("fill")?;
        self.fill_impl(args)
    }

    fn synchronize(&self) -> Result<(), PluginError> {
        self.enter("synchronize")?;
        self.synchronize_impl("synchronize")
    }

    fn gemm_workspace(&self, args: &GemmArgs) -> Result<u64, PluginError> {
        self.enter("gemm_workspace")?;
        self.gemm_workspace_impl(args)
            .map_err(|err| self.name_fault("gemm_workspace", err))
    }

    fn gemm(&self, args: &GemmArgs) -> Result<(), PluginError> {
        self.enter("gemm")?;
        self.gemm_impl(args)
            .map_err(|err| self.name_fault("gemm", err))
    }

    fn layer_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.enter("layer_norm")?;
        self.norm_impl("layer_norm", args, false)
    }

    fn layer_norm_workspace(&self, args: &NormArgs) -> Result<u64, PluginError> {
        validate::norm(&Checker::shapes_only("layer_norm_workspace"), args, false).map(|_| 0)
    }

    fn rms_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.enter("rms_norm")?;
        self.norm_impl("rms_norm", args, true)
    }

    fn rms_norm_workspace(&self, args: &NormArgs) -> Result<u64, PluginError> {
        validate::norm(&Checker::shapes_only("rms_norm_workspace"), args, true).map(|_| 0)
    }

    fn activation(&self, args: &ActivationArgs) -> Result<(), PluginError> {
        self.enter("activation")?;
        self.activation_impl(args)
    }

    fn activation_workspace(&self, args: &ActivationArgs) -> Result<u64, PluginError> {
        validate::activation(&Checker::shapes_only("activation_workspace"), args).map(|_| 0)
    }

    fn binary(&self, args: &BinaryArgs) -> Result<(), PluginError> {
        self.enter("binary")?;
        self.binary_impl(args)
    }

    fn binary_workspace(&self, args: &BinaryArgs) -> Result<u64, PluginError> {
        validate::binary(&Checker::shapes_only("binary_workspace"), args).map(|_| 0)
    }

    fn rotary(&self, args: &RotaryArgs) -> Result<(), PluginError> {
        self.enter("rotary")?;
        self.rotary_impl(args)
    }

    fn rotary_workspace(&self, args: &RotaryArgs) -> Result<u64, PluginError> {
        validate::rotary(&Checker::shapes_only("rotary_workspace"), args).map(|_| 0)
    }

    fn attention(&self, args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        self.enter("attention")?;
        self.attention_impl(args)
            .map_err(|err| self.name_fault("attention", err))
    }

    fn attention_workspace(&self, args: &AttentionArgs<'_>) -> Result<u64, PluginError> {
        self.enter("attention_workspace")?;
        self.attention_workspace_impl(args)
            .map_err(|err| self.name_fault("attention_workspace", err))
    }

    fn gather_rows(&self, args: &GatherArgs) -> Result<(), PluginError> {
        self.enter("gather_rows")?;
        self.gather_impl(args)
    }

    fn gather_rows_workspace(&self, args: &GatherArgs) -> Result<u64, PluginError> {
        validate::gather_rows(&Checker::shapes_only("gather_rows_workspace"), args).map(|_| 0)
    }

    fn cast(&self, args: &CastArgs) -> Result<(), PluginError> {
        self.enter("cast")?;
        self.cast_impl(args)
    }

    fn cast_workspace(&self, args: &CastArgs) -> Result<u64, PluginError> {
        validate::cast(&Checker::shapes_only("cast_workspace"), args).map(|_| 0)
    }

    fn alloc_host(&self, bytes: u64) -> Result<HostAlloc, PluginError> {
        self.enter("alloc_host")?;
        if bytes == 0 {
            return Err(PluginError::invalid_argument(
                "alloc_host: size must be greater than 0",
            ));
        }
        self.host
            .alloc(bytes)
            .map_err(|err| err.into_plugin("alloc_host"))
    }

    fn free_host(&self, id: HostBufferId) -> Result<(), PluginError> {
        self.enter("free_host")?;
        let Some(ptr) = self.host.take(id) else {
            return Err(PluginError::invalid_argument(format!(
                "free_host: unknown host buffer {}",
                id.0
            )));
        };
        // Queue-ordered: uploads and downloads already enqueued may still use the buffer.
        let drained = memory::wait(self.cu_stream());
        // SAFETY: the buffer was taken from the table (freed once) and the queue has drained.
        let freed = unsafe { HostBuffers::free(ptr) };
        drained
            .and(freed)
            .map_err(|err| err.into_plugin("free_host"))
    }

    fn upload(&self, copy: &StagedCopy) -> Result<(), PluginError> {
        self.enter("upload")?;
        let (device, host) = self.staged("upload", copy)?;
        if copy.bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges were checked; the host keeps the pinned range unchanged until a
        // later fence completes (the ABI's rule for `upload`).
        unsafe { memory::upload(device, host, copy.bytes, self.cu_stream()) }
            .map_err(|err| err.into_plugin("upload"))
    }

    fn download(&self, copy: &StagedCopy) -> Result<(), PluginError> {
        self.enter("download")?;
        let (device, host) = self.staged("download", copy)?;
        if copy.bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges were checked; the host reads the pinned range only after a later
        // fence completes.
        unsafe { memory::download(host, device, copy.bytes, self.cu_stream()) }
            .map_err(|err| err.into_plugin("download"))
    }

    fn fence(&self) -> Result<u64, PluginError> {
        self.enter("fence")?;
        self.fences
            .record(self.cu_stream())
            .map_err(|err| err.into_plugin("fence"))
    }

    fn wait_fence(&self, value: u64) -> Result<(), PluginError> {
        self.enter("wait_fence")?;
        self.fences
            .wait(value)
            .map_err(|err| err.into_plugin("wait_fence"))
    }

    /// Gives back cuDNN's plans built after open (the memory their first executions took),
    /// measured after the queue's wait: the pool releases the blocks of frees the wait covers
    /// (its release threshold is 0), which are the host's, counted where it freed them.
    fn trim(&self) -> Result<u64, PluginError> {
        self.enter("trim")?;
        // A bad gather index is the step's error, reported by its own synchronisation: the
        // reset's trim must not take it.
        self.wait_queue("trim")?;
        let Some(compute) = &self.compute else {
            return Ok(0);
        };
        compute
            .sdpa
            .trim(self.cu_stream())
            .map_err(|err| err.into_plugin("trim"))
    }

    fn write_async(&self, write: &AsyncWrite) -> Result<(), PluginError> {
        self.enter("write_async")?;
        if self.options.staged_writes {
            return Err(PluginError::unsupported(
                "write_async: off (the device was opened with staged_writes = true)",
            ));
        }
        self.with_checker("write_async", |check| {
            validate::range(
                check,
                "device",
                write.device,
                write.device_offset,
                write.bytes,
            )
        })?;
        if write.bytes == 0 {
            return Ok(());
        }
        if write.host.is_null() {
            return Err(PluginError::invalid_argument(
                "write_async: the host source is a null pointer",
            ));
        }
        let dst = self
            .view("write_async", write.device)?
            .at(write.device_offset);
        // SAFETY: the device range was checked against a live buffer; the host keeps the
        // source valid and unchanged until a fence recorded after this call has completed
        // (the ABI's rule for `write_async`), and the slots' copies run before the queue
        // passes this write.
        unsafe {
            crate::ops::lock(&self.uploads).write(dst, write.host, write.bytes, self.cu_stream())
        }
        .map_err(|err| err.into_plugin("write_async"))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Err(err) = self.ctx.bind_to_thread() {
            self.log
                .warn(format!("close: cannot bind the context: {err:?}"));
        }
        let stream = self.cu_stream();
        if let Err(err) = memory::wait(stream) {
            self.log.warn(format!("close: queued work failed: {err}"));
        }
        // The queue has drained: handles, module, status word and descriptors go (their drops
        // ignore errors: the device is closing either way).
        drop(self.compute.take());
        for ptr in self.host.drain() {
            // SAFETY: the queue has drained and each buffer is freed once.
            if let Err(err) = unsafe { HostBuffers::free(ptr) } {
                self.log.warn(format!("close: {err}"));
            }
        }
        if let Err(err) = self.memory.release_all(stream) {
            self.log.warn(format!("close: {err}"));
        }
        self.fences.clear();
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool, PluginError> {
    match value.trim() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(invalid_option(key, value, "true or false")),
    }
}

fn invalid_option(key: &str, value: &str, expected: &str) -> PluginError {
    PluginError::invalid_argument(format!(
        "open: option `{key}`: expected {expected}, got `{value}`"
    ))
}

fn push_held(held: &mut Vec<HeldMemory>, what: &str, bytes: u64) {
    if bytes > 0 {
        held.push(HeldMemory {
            what: what.into(),
            bytes,
        });
    }
}

/// Device memory in use, `total - free`, as the driver reports it.
pub(crate) fn used() -> Result<u64, CudaError> {
    let (free, total) = result::mem_get_info().call("cuMemGetInfo")?;
    Ok(total.saturating_sub(free) as u64)
}

/// Adds a held item measured as growth of device memory in use since `before`.
pub(crate) fn push_growth(
    held: &mut Vec<HeldMemory>,
    what: &str,
    before: u64,
) -> Result<(), CudaError> {
    push_held(held, what, used()?.saturating_sub(before));
    Ok(())
}

/// `cuDriverGetVersion`, e.g. 12040 for CUDA 12.4.
pub fn driver_version() -> Result<i32, CudaError> {
    let mut version = 0;
    // SAFETY: the pointer is valid for writes.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .call("cuDriverGetVersion")?;
    Ok(version)
}

/// `12040` as `12.4`.
pub fn version_text(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

fn primary_context_active(device: sys::CUdevice) -> Result<bool, CudaError> {
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: both pointers are valid for writes; the device handle came from cuDeviceGet.
    unsafe { sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) }
        .result()
        .call("cuDevicePrimaryCtxGetState")?;
    Ok(active != 0)
}

fn attribute(ctx: &CudaContext, attr: sys::CUdevice_attribute) -> Result<i32, CudaError> {
    ctx.attribute(attr).call("cuDeviceGetAttribute")
}

/// Peak memory bandwidth: two transfers per memory clock (DDR) across the bus width.
fn bandwidth(ctx: &CudaContext) -> Result<u64, CudaError> {
    let clock_khz = attribute(
        ctx,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
    )?;
    let bus_bits = attribute(
        ctx,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
    )?;
    let (Ok(clock_khz), Ok(bus_bits)) = (u64::try_from(clock_khz), u64::try_from(bus_bits)) else {
        return Ok(0);
    };
    Ok(clock_khz * 1000 * 2 * (bus_bits / 8))
}

/// Dense FLOP per clock per SM of the architectures whose every part runs products at one
/// rate: tensor cores on f16 and bf16 with f32 accumulation, and the CUDA cores' f32 FMAs (f32
/// products run on them: TF32 only when asked). A100/A30 (sm_80) and H100/H200/H800/GH200
/// (sm_90). Of sm_86 and sm_89, GeForce parts accumulate f16 and bf16 products in f32 at half the
/// rate of the data-center parts of the same architecture, and the attributes cannot tell
/// them apart, so they get none (and a host gives the peak itself, as `iris bench
/// --peak-tflops`).
fn dense_flops_per_clock(cc: (i32, i32)) -> Option<(u64, u64)> {
    match cc {
        (8, 0) => Some((2048, 128)),
        (9, 0) => Some((4096, 256)),
        _ => None,
    }
}

/// The `peak_flops` property: SMs x the highest SM clock the driver reports x the
/// architecture's dense rate. An upper bound, as a datasheet's figure is: a product of the
/// largest sizes reaches about 80% of it (an H200 reports 132 SMs at 1980 MHz, 1070 TFLOPS
/// bf16; an 8192^3 bf16 product measured 758 to 790).
fn peak_flops(info: &Info) -> Option<String> {
    let (tensor, fma) = dense_flops_per_clock(info.cc)?;
    let (Ok(sms), Ok(khz)) = (u64::try_from(info.sms), u64::try_from(info.clock_khz)) else {
        return None;
    };
    if sms == 0 || khz == 0 {
        return None;
    }
    let per_second = |per_clock: u64| sms * khz * 1000 * per_clock;
    Some(format!(
        "f32={:e},f16={:e},bf16={:e}",
        per_second(fma),
        per_second(tensor),
        per_second(tensor)
    ))
}

/// Why `CUDA_VISIBLE_DEVICES` may explain seeing no device, for probe messages.
pub fn visible_devices_note() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(value) if value.trim().is_empty() => {
            " (CUDA_VISIBLE_DEVICES is set and empty, which hides every device)".to_owned()
        }
        Ok(value) => format!(" (CUDA_VISIBLE_DEVICES={value})"),
        Err(_) => String::new(),
    }
}

/// Why no device is visible when `CUDA_VISIBLE_DEVICES` is set and empty.
fn hidden_by_visible_devices() -> Option<String> {
    std::env::var("CUDA_VISIBLE_DEVICES")
        .is_ok_and(|value| value.trim().is_empty())
        .then(|| "CUDA_VISIBLE_DEVICES is set and empty, which hides every device".to_owned())
}

/// What the plugin's probe answers: the device count, or why there is none.
pub fn probe_devices() -> Result<u32, String> {
    if let Some(hidden) = hidden_by_visible_devices() {
        return Err(hidden);
    }
    if !loader::driver_present() {
        return Err(format!(
            "{} (is the NVIDIA driver installed?)",
            loader::driver_missing()
        ));
    }
    if let Err(err) = result::init() {
        return Err(format!(
            "cuInit failed: {}{}{}",
            crate::error::driver_name(err.0),
            crate::error::driver_hint(err.0),
            visible_devices_note()
        ));
    }
    let version = driver_version().map_err(|err| err.to_string())?;
    if version < MIN_DRIVER_VERSION {
        return Err(format!(
            "the driver supports CUDA {}, this plugin needs {} or newer",
            version_text(version),
            version_text(MIN_DRIVER_VERSION)
        ));
    }
    let count = result::device::get_count().map_err(|err| {
        format!(
            "cuDeviceGetCount failed: {}",
            crate::error::driver_name(err.0)
        )
    })?;
    match u32::try_from(count) {
        Ok(0) | Err(_) => Err(format!("no CUDA device found{}", visible_devices_note())),
        Ok(count) => Ok(count),
    }
}

/// The elementwise kernels' width after their check at open, and what `iris devices` says of
/// it: four columns per thread where no kernel differed, one (naming those that did) otherwise.
fn lanes_verdict(differing: &[String]) -> (u32, String) {
    if differing.is_empty() {
        (
            WIDE_LANES,
            "4 where the views are aligned (the same results as 1 at open)".to_owned(),
        )
    } else {
        (
            1,
            format!(
                "1: four columns per thread differed from one at open in {}",
                differing.join(", ")
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_flops_follows_the_architecture_sms_and_clock() {
        let info = |cc, sms, clock_khz| Info {
            name: "GPU".to_owned(),
            total_memory: 1 << 30,
            cc,
            sms,
            bandwidth: 0,
            clock_khz,
            driver_version: 13000,
        };
        // An H200 as its driver reports it: 132 SMs at 1980 MHz.
        let h200 = peak_flops(&info((9, 0), 132, 1_980_000)).expect("sm_90 has a peak");
        let bf16 = property::peak_flops(&h200, "bf16").expect("bf16");
        assert!((bf16 - 1.070_530_56e15).abs() < 1.0, "{h200}");
        assert_eq!(property::peak_flops(&h200, "f16"), Some(bf16));
        let f32 = property::peak_flops(&h200, "f32").expect("f32");
        assert!((f32 - 6.690_816e13).abs() < 1.0, "{h200}");
        // An A100 SXM: 108 SMs at 1410 MHz, 312 TFLOPS dense bf16 on its datasheet.
        let a100 = peak_flops(&info((8, 0), 108, 1_410_000)).expect("sm_80 has a peak");
        let bf16 = property::peak_flops(&a100, "bf16").expect("bf16");
        assert!((bf16 / 1e12 - 311.87).abs() < 0.01, "{a100}");
        // Architectures whose parts differ, and drivers that say nothing, give none.
        for (cc, sms, clock) in [((8, 6), 84, 1_740_000), ((8, 9), 142, 2_520_000)] {
            assert_eq!(peak_flops(&info(cc, sms, clock)), None, "{cc:?}");
        }
        assert_eq!(peak_flops(&info((9, 0), 0, 1_980_000)), None);
        assert_eq!(peak_flops(&info((9, 0), 132, 0)), None);
    }

    #[test]
    fn options_parse_and_unknown_keys_are_named() {
        let options = CudaOptions::parse(&[("tf32", "true"), ("kernel_cache", "off")]).unwrap();
        assert!(options.tf32 && !options.memory_only);
        assert_eq!(options.kernel_cache.as_deref(), Some("off"));
        let err = CudaOptions::parse(&[("tf23", "true")]).unwrap_err();
        assert!(err.message.contains("`tf23`"), "{}", err.message);
        let err = CudaOptions::parse(&[("memory_only", "maybe")]).unwrap_err();
        assert!(err.message.contains("memory_only"), "{}", err.message);
        assert_eq!(options.attention_queries, AttentionQueries::Auto);
        let options = CudaOptions::parse(&[("attention_queries", "128")]).unwrap();
        assert_eq!(options.attention_queries, AttentionQueries::Fixed(128));
        let err = CudaOptions::parse(&[("attention_queries", "96")]).unwrap_err();
        assert!(
            err.message.contains("attention_queries") && err.message.contains("`96`"),
            "{}",
            err.message
        );
        assert_eq!(CudaOptions::default().cudnn_plan_memory, 256 << 20);
        let options = CudaOptions::parse(&[("cudnn_plan_memory", "64")]).unwrap();
        assert_eq!(options.cudnn_plan_memory, 64 << 20);
        for bad in ["-1", "1.5", "lots", "99999999999999999"] {
            let err = CudaOptions::parse(&[("cudnn_plan_memory", bad)]).unwrap_err();
            assert!(
                err.message.contains("cudnn_plan_memory") && err.message.contains(bad),
                "{}",
                err.message
            );
        }
        assert_eq!(CudaOptions::default().elementwise_lanes, 4);
        let options = CudaOptions::parse(&[("elementwise_lanes", "1")]).unwrap();
        assert_eq!(options.elementwise_lanes, 1);
        let err = CudaOptions::parse(&[("elementwise_lanes", "8")]).unwrap_err();
        assert!(
            err.message.contains("elementwise_lanes") && err.message.contains("`8`"),
            "{}",
            err.message
        );
    }

    #[test]
    fn the_elementwise_width_follows_the_open_time_check() {
        let (lanes, note) = lanes_verdict(&[]);
        assert_eq!(lanes, 4);
        assert!(note.starts_with("4 where the views are aligned"), "{note}");
        let (lanes, note) = lanes_verdict(&["rotary_f16 (3 of 512 outputs differ)".to_owned()]);
        assert_eq!(lanes, 1);
        assert!(
            note.ends_with("in rotary_f16 (3 of 512 outputs differ)"),
            "{note}"
        );
    }

    #[test]
    fn driver_versions_read_as_cuda_releases() {
        assert_eq!(version_text(12040), "12.4");
        assert_eq!(version_text(12000), "12.0");
        assert_eq!(version_text(13010), "13.1");
    }
}
