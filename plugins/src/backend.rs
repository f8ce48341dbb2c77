//! The plugin author's side: implement [`Backend`] in safe Rust, export it with
//! [`export_plugin!`](crate::export_plugin), and the ABI shims are generated for you.
//!
//! Every shim catches panics (a panic must never unwind into the host) and turns them into
//! [`ErrorCode::INTERNAL`](crate::abi::ErrorCode::INTERNAL) errors. Ops have default
//! implementations that report "unsupported" and workspace queries default to 0 bytes, so a
//! new backend can start with memory and transfers and add ops one at a time. Argument checks
//! every backend needs are in [`crate::validate`].

use std::any::Any;
use std::ffi::c_void;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};

use abi_stable::prefix_type::{PrefixRef, WithMetadata};
use abi_stable::std_types::{RResult, RSlice, RSliceMut, RStr, RString};

use crate::abi::{
    ActivationArgs, AttentionArgs, BinaryArgs, BufferHandle, CastArgs, CopyRegion, DeviceCtx,
    DeviceDesc, DeviceInstance, DeviceVTable, DeviceVTableRef, FillArgs, GatherArgs, GemmArgs,
    HostCtx, LogLevel, LogSink, MemInfo, MemoryReport, NormArgs, PluginError, PluginOption,
    ProbeResult, RotaryArgs,
};
#[cfg(not(feature = "abi-2-0"))]
use crate::abi::{AsyncWrite, HostAlloc, HostBufferId, StagedCopy};

/// A device implementation. One value per opened device; it must be usable from any thread.
///
/// Memory, transfers, fill, synchronisation and the description are required; each op
/// defaults to "unsupported", which the conformance suite reports as such rather than as a
/// failure, and each workspace query to 0 bytes. Dropping the value closes the device: it must
/// wait for queued work and release everything.
pub trait Backend: Send + Sync + 'static {
    /// Name, vendor, memory, dtypes, implemented ops and properties.
    fn describe(&self) -> DeviceDesc;
    /// `(free, total)` device memory in bytes.
    fn mem_info(&self) -> Result<MemInfo, PluginError>;
    /// The plugin's own accounting (see [`MemoryReport`]).
    fn memory_report(&self) -> Result<MemoryReport, PluginError>;
    /// Allocates `bytes` of device memory.
    fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError>;
    /// Frees a buffer, queue-ordered.
    fn free(&self, buf: BufferHandle) -> Result<(), PluginError>;
    /// Host -> device; returns once `src` may be reused.
    fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError>;
    /// Device -> host, after the work enqueued before it.
    fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError>;
    /// Batched device -> device copy.
    fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError>;
    /// Fills a byte range with a repeated value.
    fn fill(&self, args: &FillArgs) -> Result<(), PluginError>;
    /// Waits for all enqueued work and reports its failure, if any.
    fn synchronize(&self) -> Result<(), PluginError>;

    /// See [`GemmArgs`].
    fn gemm(&self, _args: &GemmArgs) -> Result<(), PluginError> {
        Err(unsupported("gemm"))
    }
    /// Scratch bytes for [`Backend::gemm`].
    fn gemm_workspace(&self, _args: &GemmArgs) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`NormArgs`].
    fn layer_norm(&self, _args: &NormArgs) -> Result<(), PluginError> {
        Err(unsupported("layer_norm"))
    }
    /// Scratch bytes for [`Backend::layer_norm`].
    fn layer_norm_workspace(&self, _args: &NormArgs) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`NormArgs`].
    fn rms_norm(&self, _args: &NormArgs) -> Result<(), PluginError> {
        Err(unsupported("rms_norm"))
    }
    /// Scratch bytes for [`Backend::rms_norm`].
    fn rms_norm_workspace(&self, _args: &NormArgs) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`ActivationArgs`].
    fn activation(&self, _args: &ActivationArgs) -> Result<(), PluginError> {
        Err(unsupported("activation"))
    }
    /// Scratch bytes for [`Backend::activation`].
    fn activation_workspace(&self, _args: &ActivationArgs) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`BinaryArgs`].
    fn binary(&self, _args: &BinaryArgs) -> Result<(), PluginError> {
        Err(unsupported("binary"))
    }
    /// Scratch bytes for [`Backend::binary`].
    fn binary_workspace(&self, _args: &BinaryArgs) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`RotaryArgs`].
    fn rotary(&self, _args: &RotaryArgs) -> Result<(), PluginError> {
        Err(unsupported("rotary"))
    }
    /// Scratch bytes for [`Backend::rotary`].
    fn rotary_workspace(&self, _args: &RotaryArgs) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`AttentionArgs`].
    fn attention(&self, _args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        Err(unsupported("attention"))
    }
    /// Scratch bytes for [`Backend::attention`].
    fn attention_workspace(&self, _args: &AttentionArgs<'_>) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`GatherArgs`].
    fn gather_rows(&self, _args: &GatherArgs) -> Result<(), PluginError> {
        Err(unsupported("gather_rows"))
    }
    /// Scratch bytes for [`Backend::gather_rows`].
    fn gather_rows_workspace(&self, _args: &GatherArgs) -> Result<u64, PluginError> {
        Ok(0)
    }
    /// See [`CastArgs`].
    fn cast(&self, _args: &CastArgs) -> Result<(), PluginError> {
        Err(unsupported("cast"))
    }
    /// Scratch bytes for [`Backend::cast`].
    fn cast_workspace(&self, _args: &CastArgs) -> Result<u64, PluginError> {
        Ok(0)
    }

    /// A host staging buffer (ABI 2.1). The default reports "unsupported"; the host then
    /// stages through ordinary memory with `write` and `read`.
    #[cfg(not(feature = "abi-2-0"))]
    fn alloc_host(&self, _bytes: u64) -> Result<HostAlloc, PluginError> {
        Err(unsupported("alloc_host"))
    }
    /// Frees a host staging buffer, queue-ordered.
    #[cfg(not(feature = "abi-2-0"))]
    fn free_host(&self, _id: HostBufferId) -> Result<(), PluginError> {
        Err(unsupported("free_host"))
    }
    /// Enqueues a copy from a host staging buffer to the device.
    #[cfg(not(feature = "abi-2-0"))]
    fn upload(&self, _copy: &StagedCopy) -> Result<(), PluginError> {
        Err(unsupported("upload"))
    }
    /// Enqueues a copy from the device to a host staging buffer.
    #[cfg(not(feature = "abi-2-0"))]
    fn download(&self, _copy: &StagedCopy) -> Result<(), PluginError> {
        Err(unsupported("download"))
    }
    /// Records a fence after the work enqueued so far.
    #[cfg(not(feature = "abi-2-0"))]
    fn fence(&self) -> Result<u64, PluginError> {
        Err(unsupported("fence"))
    }
    /// Waits for a fence.
    #[cfg(not(feature = "abi-2-0"))]
    fn wait_fence(&self, _value: u64) -> Result<(), PluginError> {
        Err(unsupported("wait_fence"))
    }
    /// Enqueues a write that reads the host's memory when it runs (ABI 2.2). The default
    /// reports "unsupported"; the host then stages the bytes.
    #[cfg(not(feature = "abi-2-0"))]
    fn write_async(&self, _write: &AsyncWrite) -> Result<(), PluginError> {
        Err(unsupported("write_async"))
    }
    /// Gives back device memory kept after open for reuse, returning the bytes (ABI 2.3). The
    /// default reports "unsupported": nothing of the kind is kept.
    #[cfg(not(feature = "abi-2-0"))]
    fn trim(&self) -> Result<u64, PluginError> {
        Err(unsupported("trim"))
    }
}

/// A plugin's handle on the host's log: messages arrive in the host's `tracing` output tagged
/// with the plugin's name and the device ordinal. Cheap to clone; usable from any thread until
/// the device is closed (drop clones held by worker threads before the backend finishes
/// dropping).
#[derive(Clone, Copy)]
pub struct Logger {
    sink: Option<LogSink>,
}

impl fmt::Debug for Logger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logger")
            .field("connected", &self.sink.is_some())
            .finish()
    }
}

impl Logger {
    /// A logger that drops every message (for backends opened without a host, e.g. in a
    /// plugin's own unit tests).
    pub fn discard() -> Logger {
        Logger { sink: None }
    }

    /// A logger writing to the host's sink.
    pub fn new(sink: LogSink) -> Logger {
        Logger { sink: Some(sink) }
    }

    /// Records a message at `level`.
    pub fn log(&self, level: LogLevel, message: impl fmt::Display) {
        if let Some(sink) = self.sink {
            let text = message.to_string();
            (sink.log)(sink.ctx, level, RStr::from_str(&text));
        }
    }

    /// [`LogLevel::ERROR`].
    pub fn error(&self, message: impl fmt::Display) {
        self.log(LogLevel::ERROR, message);
    }

    /// [`LogLevel::WARN`].
    pub fn warn(&self, message: impl fmt::Display) {
        self.log(LogLevel::WARN, message);
    }

    /// [`LogLevel::INFO`].
    pub fn info(&self, message: impl fmt::Display) {
        self.log(LogLevel::INFO, message);
    }

    /// [`LogLevel::DEBUG`].
    pub fn debug(&self, message: impl fmt::Display) {
        self.log(LogLevel::DEBUG, message);
    }
}

// SAFETY: the sink's context is valid from any thread until close (ABI contract on `LogSink`).
unsafe impl Send for Logger {}
// SAFETY: as above.
unsafe impl Sync for Logger {}

/// A log sink whose context is null and whose function drops the message: what
/// [`Logger::discard`] stands for when a sink value is needed.
pub fn discard_sink() -> LogSink {
    extern "C" fn drop_message(_: HostCtx, _: LogLevel, _: RStr<'_>) {}
    LogSink {
        ctx: HostCtx(std::ptr::null()),
        log: drop_message,
    }
}

/// Options passed to `open`, borrowed as plain Rust string pairs.
pub fn options_as_pairs<'a>(options: RSlice<'a, PluginOption<'a>>) -> Vec<(&'a str, &'a str)> {
    options
        .iter()
        .map(|option| (option.key.as_str(), option.value.as_str()))
        .collect()
}

/// Wraps a backend into the [`DeviceInstance`] that `open` returns.
pub fn device_instance<B: Backend>(backend: B) -> DeviceInstance {
    let ctx = DeviceCtx(Box::into_raw(Box::new(backend)).cast::<c_void>());
    DeviceInstance {
        ctx,
        vtable: VTableFor::<B>::VTABLE,
    }
}

thread_local! {
    /// How many [`catch_panic`] calls are running on this thread.
    static CATCHING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` under `catch_unwind`, telling panic hooks on this thread meanwhile that a panic of
/// `f` is caught here ([`catches_panics`]). A host's hook that marks a thread's work dead on a
/// panic (iris's engine core does) must not do so for a panic a plugin turns into an error:
/// that fault is contained, and the call fails as any other error.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    CATCHING.with(|depth| depth.set(depth.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(f));
    CATCHING.with(|depth| depth.set(depth.get() - 1));
    result
}

/// Whether a panic raised on this thread now is caught by a [`catch_panic`] (a plugin
/// boundary). Only plugins linked into the host binary share this with the host: a plugin
/// library has its own copy of the standard library and of its panic hook.
#[must_use]
pub fn catches_panics() -> bool {
    CATCHING.with(|depth| depth.get() > 0)
}

/// Runs `f`, turning a panic into an [`ErrorCode::INTERNAL`](crate::abi::ErrorCode::INTERNAL)
/// error. Use it in every hand-written `extern "C"` function of a plugin.
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, PluginError>) -> RResult<T, PluginError> {
    match catch_panic(f) {
        Ok(Ok(value)) => RResult::ROk(value),
        Ok(Err(err)) => RResult::RErr(err),
        Err(payload) => RResult::RErr(PluginError::internal(format!(
            "{what} panicked: {}",
            panic_message(payload.as_ref())
        ))),
    }
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// A [`ProbeResult`] for `count` devices, or none with `reason`.
pub fn probe_result(count: u32, reason: impl Into<String>) -> ProbeResult {
    ProbeResult {
        device_count: count,
        reason: if count == 0 {
            RString::from(reason.into())
        } else {
            RString::new()
        },
    }
}

/// The error an op returns when the device does not implement it.
pub fn unsupported(op: &str) -> PluginError {
    PluginError::unsupported(format!("op `{op}` is not implemented by this device"))
}

/// # Safety
/// `ctx` must come from [`device_instance::<B>`] and not have been closed.
unsafe fn backend<'a, B: Backend>(ctx: DeviceCtx) -> &'a B {
    // SAFETY: by the caller's contract `ctx.0` is a live `Box<B>` leaked by `device_instance`.
    unsafe { &*ctx.0.cast::<B>() }
}

struct VTableFor<B>(std::marker::PhantomData<B>);

/// Defines shims that recover the backend and forward one argument reference under `guard`.
macro_rules! forward {
    ($($name:ident($args:ty) -> $ret:ty;)*) => {
        $(
            extern "C" fn $name(ctx: DeviceCtx, args: &$args) -> RResult<$ret, PluginError> {
                // SAFETY: see the impl comment.
                guard(stringify!($name), || unsafe { backend::<B>(ctx) }.$name(args))
            }
        )*
    };
}

// Each shim recovers the backend and forwards under `guard`. The host only calls these with a
// `ctx` produced by `device_instance::<B>` for the same `B` (it travels with this vtable), and
// never after `close`.
impl<B: Backend> VTableFor<B> {
    const WM: &'static WithMetadata<DeviceVTable> = &WithMetadata::new(DeviceVTable {
        describe: Self::describe,
        mem_info: Self::mem_info,
        memory_report: Self::memory_report,
        alloc: Self::alloc,
        free: Self::free,
        write: Self::write,
        read: Self::read,
        copy_batch: Self::copy_batch,
        fill: Self::fill,
        synchronize: Self::synchronize,
        gemm_workspace: Self::gemm_workspace,
        gemm: Self::gemm,
        layer_norm_workspace: Self::layer_norm_workspace,
        layer_norm: Self::layer_norm,
        rms_norm_workspace: Self::rms_norm_workspace,
        rms_norm: Self::rms_norm,
        activation_workspace: Self::activation_workspace,
        activation: Self::activation,
        binary_workspace: Self::binary_workspace,
        binary: Self::binary,
        rotary_workspace: Self::rotary_workspace,
        rotary: Self::rotary,
        attention_workspace: Self::attention_workspace,
        attention: Self::attention,
        gather_rows_workspace: Self::gather_rows_workspace,
        gather_rows: Self::gather_rows,
        cast_workspace: Self::cast_workspace,
        cast: Self::cast,
        close: Self::close,
        #[cfg(not(feature = "abi-2-0"))]
        alloc_host: Self::alloc_host,
        #[cfg(not(feature = "abi-2-0"))]
        free_host: Self::free_host,
        #[cfg(not(feature = "abi-2-0"))]
        upload: Self::upload,
        #[cfg(not(feature = "abi-2-0"))]
        download: Self::download,
        #[cfg(not(feature = "abi-2-0"))]
        fence: Self::fence,
        #[cfg(not(feature = "abi-2-0"))]
        wait_fence: Self::wait_fence,
        #[cfg(not(feature = "abi-2-0"))]
        write_async: Self::write_async,
        #[cfg(not(feature = "abi-2-0"))]
        trim: Self::trim,
    });

    const VTABLE: DeviceVTableRef = DeviceVTableRef(PrefixRef::from_ref(Self::WM));

    extern "C" fn describe(ctx: DeviceCtx) -> DeviceDesc {
        // SAFETY: see the impl comment.
        let dev = unsafe { backend::<B>(ctx) };
        match catch_panic(|| dev.describe()) {
            Ok(desc) => desc,
            Err(payload) => DeviceDesc {
                name: RString::from(format!(
                    "describe panicked: {}",
                    panic_message(payload.as_ref())
                )),
                vendor: RString::new(),
                total_memory: 0,
                dtypes: Default::default(),
                ops: Default::default(),
                properties: Default::default(),
            },
        }
    }

    extern "C" fn mem_info(ctx: DeviceCtx) -> RResult<MemInfo, PluginError> {
        // SAFETY: see the impl comment.
        guard("mem_info", || unsafe { backend::<B>(ctx) }.mem_info())
    }

    extern "C" fn memory_report(ctx: DeviceCtx) -> RResult<MemoryReport, PluginError> {
        // SAFETY: see the impl comment.
        guard("memory_report", || {
            unsafe { backend::<B>(ctx) }.memory_report()
        })
    }

    extern "C" fn alloc(ctx: DeviceCtx, bytes: u64) -> RResult<BufferHandle, PluginError> {
        // SAFETY: see the impl comment.
        guard("alloc", || unsafe { backend::<B>(ctx) }.alloc(bytes))
    }

    extern "C" fn free(ctx: DeviceCtx, buf: BufferHandle) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("free", || unsafe { backend::<B>(ctx) }.free(buf))
    }

    extern "C" fn write(
        ctx: DeviceCtx,
        dst: BufferHandle,
        offset: u64,
        src: RSlice<'_, u8>,
    ) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("write", || {
            unsafe { backend::<B>(ctx) }.write(dst, offset, src.as_slice())
        })
    }

    extern "C" fn read(
        ctx: DeviceCtx,
        src: BufferHandle,
        offset: u64,
        mut dst: RSliceMut<'_, u8>,
    ) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("read", || {
            unsafe { backend::<B>(ctx) }.read(src, offset, dst.as_mut_slice())
        })
    }

    extern "C" fn copy_batch(
        ctx: DeviceCtx,
        regions: RSlice<'_, CopyRegion>,
    ) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("copy_batch", || {
            unsafe { backend::<B>(ctx) }.copy_batch(regions.as_slice())
        })
    }

    extern "C" fn synchronize(ctx: DeviceCtx) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("synchronize", || unsafe { backend::<B>(ctx) }.synchronize())
    }

    forward! {
        fill(FillArgs) -> ();
        gemm_workspace(GemmArgs) -> u64;
        gemm(GemmArgs) -> ();
        layer_norm_workspace(NormArgs) -> u64;
        layer_norm(NormArgs) -> ();
        rms_norm_workspace(NormArgs) -> u64;
        rms_norm(NormArgs) -> ();
        activation_workspace(ActivationArgs) -> u64;
        activation(ActivationArgs) -> ();
        binary_workspace(BinaryArgs) -> u64;
        binary(BinaryArgs) -> ();
        rotary_workspace(RotaryArgs) -> u64;
        rotary(RotaryArgs) -> ();
        attention_workspace(AttentionArgs<'_>) -> u64;
        attention(AttentionArgs<'_>) -> ();
        gather_rows_workspace(GatherArgs) -> u64;
        gather_rows(GatherArgs) -> ();
        cast_workspace(CastArgs) -> u64;
        cast(CastArgs) -> ();
    }

    #[cfg(not(feature = "abi-2-0"))]
    forward! {
        upload(StagedCopy) -> ();
        download(StagedCopy) -> ();
        write_async(AsyncWrite) -> ();
    }

    #[cfg(not(feature = "abi-2-0"))]
    extern "C" fn alloc_host(ctx: DeviceCtx, bytes: u64) -> RResult<HostAlloc, PluginError> {
        // SAFETY: see the impl comment.
        guard("alloc_host", || {
            unsafe { backend::<B>(ctx) }.alloc_host(bytes)
        })
    }

    #[cfg(not(feature = "abi-2-0"))]
    extern "C" fn free_host(ctx: DeviceCtx, id: HostBufferId) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("free_host", || unsafe { backend::<B>(ctx) }.free_host(id))
    }

    #[cfg(not(feature = "abi-2-0"))]
    extern "C" fn trim(ctx: DeviceCtx) -> RResult<u64, PluginError> {
        // SAFETY: see the impl comment.
        guard("trim", || unsafe { backend::<B>(ctx) }.trim())
    }

    #[cfg(not(feature = "abi-2-0"))]
    extern "C" fn fence(ctx: DeviceCtx) -> RResult<u64, PluginError> {
        // SAFETY: see the impl comment.
        guard("fence", || unsafe { backend::<B>(ctx) }.fence())
    }

    #[cfg(not(feature = "abi-2-0"))]
    extern "C" fn wait_fence(ctx: DeviceCtx, value: u64) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("wait_fence", || {
            unsafe { backend::<B>(ctx) }.wait_fence(value)
        })
    }

    extern "C" fn close(ctx: DeviceCtx) {
        // SAFETY: `ctx` is the `Box<B>` leaked by `device_instance`; the host calls `close`
        // exactly once and never uses `ctx` afterwards.
        let boxed = unsafe { Box::from_raw(ctx.0.cast::<B>()) };
        // A panicking destructor must not unwind into the host; the state is gone either way.
        let _ = catch_panic(move || drop(boxed));
    }
}
