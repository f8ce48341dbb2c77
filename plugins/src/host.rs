//! The host's side of the ABI: a loaded [`Plugin`] and an opened [`Device`], with every call
//! returning a Rust `Result`.
//!
//! Whether a plugin was linked in (the built-in CPU device) or loaded from a library, the host
//! talks to it through the same [`IrisPluginRef`] root module and
//! [`DeviceVTableRef`](crate::abi::DeviceVTableRef) table. [`Device`] also:
//!
//! - counts what crosses the boundary ([`Device::counters`]): bytes host -> device and back,
//!   batched copies, fills, ops, synchronisations; tests use the counts to prove that per-step
//!   traffic does not grow with a model's depth;
//! - offers host staging buffers ([`Device::host_buffer`]) whose transfers are asynchronous on
//!   a plugin with ABI 2.1's staging functions, and plain memory with `write`/`read` on a
//!   plugin built for 2.0 or one that does not offer them;
//! - routes the plugin's log messages into `tracing` under the target `iris::plugin`, with the
//!   plugin's name and the device ordinal as fields.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use abi_stable::std_types::{RResult, RSlice, RSliceMut, RStr};
use thiserror::Error;

use crate::abi::{
    ABI_MAJOR, ABI_MINOR, ActivationArgs, AsyncWrite, AttentionArgs, BinaryArgs, BufferHandle,
    BufferSlice, CastArgs, CopyRegion, DType, DeviceCtx, DeviceInstance, ErrorCode, FillArgs,
    GatherArgs, GemmArgs, HostAlloc, HostBufferId, HostCtx, IrisPluginRef, LogLevel, LogSink,
    MemInfo, MemoryReport, NormArgs, OpKind, PluginError, PluginOption, RotaryArgs, StagedCopy,
};

/// An error returned by a device call, with the call that failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{plugin} device: {op} failed ({code}): {message}", code = code.name())]
#[non_exhaustive]
pub struct DeviceError {
    /// The plugin's name.
    pub plugin: String,
    /// The function that failed (`alloc`, `gemm`, ...).
    pub op: &'static str,
    /// The plugin's error code.
    pub code: ErrorCode,
    /// The plugin's message.
    pub message: String,
}

impl DeviceError {
    /// Whether the device ran out of memory (the caller may free memory and retry).
    pub fn is_out_of_memory(&self) -> bool {
        self.code == ErrorCode::OUT_OF_MEMORY
    }
}

/// The most devices a plugin's probe may report: hosts list and check each one.
pub const MAX_DEVICES: u32 = 1024;

/// What a plugin's probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Number of devices.
    pub device_count: u32,
    /// Why there are none (empty when there are devices).
    pub reason: String,
}

/// A plugin, linked in or loaded from a library, ready to probe and open devices.
#[derive(Clone)]
pub struct Plugin {
    name: String,
    version: String,
    path: Option<PathBuf>,
    abi_major: u32,
    abi_minor: u32,
    module: IrisPluginRef,
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("path", &self.path)
            .field("abi", &(self.abi_major, self.abi_minor))
            .finish()
    }
}

impl Plugin {
    /// A plugin linked into the running binary (no library file); its ABI version is this
    /// crate's.
    pub fn builtin(module: IrisPluginRef) -> Plugin {
        Self::from_module(module, None, ABI_MAJOR, ABI_MINOR)
    }

    pub(crate) fn from_module(
        module: IrisPluginRef,
        path: Option<PathBuf>,
        abi_major: u32,
        abi_minor: u32,
    ) -> Plugin {
        Plugin {
            name: module.name().as_str().to_owned(),
            version: module.version().as_str().to_owned(),
            path,
            abi_major,
            abi_minor,
            module,
        }
    }

    /// The plugin's short name (`cpu`, `cuda`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The plugin's own version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The library file, or `None` for a built-in plugin.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// ABI major version the plugin was built against.
    pub fn abi_major(&self) -> u32 {
        self.abi_major
    }

    /// ABI minor version the plugin was built against.
    pub fn abi_minor(&self) -> u32 {
        self.abi_minor
    }

    /// How many devices the plugin sees, or why it sees none. A count above [`MAX_DEVICES`]
    /// (a C plugin returning -1, say) is an answer no host can act on, not that many devices:
    /// it reads as none, with the plugin's count in the reason.
    pub fn probe(&self) -> Probe {
        let probe = (self.module.probe())();
        let reason = probe.reason.into_string();
        if probe.device_count > MAX_DEVICES {
            return Probe {
                device_count: 0,
                reason: format!(
                    "the plugin reported {} devices, more than the {MAX_DEVICES} a host takes ({reason})",
                    probe.device_count
                ),
            };
        }
        Probe {
            device_count: probe.device_count,
            reason,
        }
    }

    /// Opens device `ordinal` with plugin options (`key`, `value`).
    pub fn open(&self, ordinal: u32, options: &[(String, String)]) -> Result<Device, DeviceError> {
        let raw: Vec<PluginOption<'_>> = options
            .iter()
            .map(|(key, value)| PluginOption {
                key: RStr::from_str(key),
                value: RStr::from_str(value),
            })
            .collect();
        let target = Box::new(LogTarget {
            plugin: self.name.clone(),
            ordinal,
        });
        let sink = LogSink {
            ctx: HostCtx(std::ptr::from_ref::<LogTarget>(&target).cast::<c_void>()),
            log: host_log,
        };
        match (self.module.open())(ordinal, RSlice::from_slice(&raw), sink) {
            RResult::ROk(instance) => Ok(Device::new(self.clone(), ordinal, instance, target)),
            RResult::RErr(err) => Err(self.error("open", err)),
        }
    }

    fn error(&self, op: &'static str, err: PluginError) -> DeviceError {
        DeviceError {
            plugin: self.name.clone(),
            op,
            code: err.code,
            message: err.message.into_string(),
        }
    }
}

/// A device description as plain Rust values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Description {
    /// Device name.
    pub name: String,
    /// Vendor.
    pub vendor: String,
    /// Total memory in bytes.
    pub total_memory: u64,
    /// Supported storage dtypes.
    pub dtypes: Vec<DType>,
    /// Implemented ops.
    pub ops: Vec<OpKind>,
    /// Further facts by key (see [`crate::abi::property`]).
    pub properties: Vec<(String, String)>,
}

impl Description {
    /// The value of property `key`, if the device gave one.
    pub fn property(&self, key: &str) -> Option<&str> {
        self.properties
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Property `key` read as an integer.
    pub fn property_u64(&self, key: &str) -> Option<u64> {
        self.property(key)?.trim().parse().ok()
    }
}

/// The plugin's own accounting of a device's memory (see [`MemoryReport`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginMemory {
    /// Bytes live through `alloc`.
    pub allocated: u64,
    /// Number of live buffers.
    pub buffers: u64,
    /// Memory held outside `alloc`, by what it is for.
    pub held: Vec<(String, u64)>,
}

impl PluginMemory {
    /// Total bytes held outside `alloc`.
    pub fn held_bytes(&self) -> u64 {
        self.held
            .iter()
            .fold(0u64, |sum, (_, bytes)| sum.saturating_add(*bytes))
    }
}

impl From<MemoryReport> for PluginMemory {
    fn from(report: MemoryReport) -> Self {
        PluginMemory {
            allocated: report.allocated,
            buffers: report.buffers,
            held: report
                .held
                .into_iter()
                .map(|item| (item.what.into_string(), item.bytes))
                .collect(),
        }
    }
}

/// What has crossed the boundary of one device since it was opened (see [`Device::counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes moved host -> device (`write` and `upload`).
    pub host_to_device_bytes: u64,
    /// Host -> device calls.
    pub host_to_device_calls: u64,
    /// Bytes moved device -> host (`read` and `download`).
    pub device_to_host_bytes: u64,
    /// Device -> host calls.
    pub device_to_host_calls: u64,
    /// `copy_batch` calls.
    pub copy_batches: u64,
    /// Regions copied by them.
    pub copy_regions: u64,
    /// `fill` calls.
    pub fills: u64,
    /// Op calls (not counting workspace queries).
    pub ops: u64,
    /// `synchronize` calls.
    pub synchronizes: u64,
}

impl Counters {
    /// The counts since `earlier`.
    pub fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            host_to_device_bytes: self.host_to_device_bytes - earlier.host_to_device_bytes,
            host_to_device_calls: self.host_to_device_calls - earlier.host_to_device_calls,
            device_to_host_bytes: self.device_to_host_bytes - earlier.device_to_host_bytes,
            device_to_host_calls: self.device_to_host_calls - earlier.device_to_host_calls,
            copy_batches: self.copy_batches - earlier.copy_batches,
            copy_regions: self.copy_regions - earlier.copy_regions,
            fills: self.fills - earlier.fills,
            ops: self.ops - earlier.ops,
            synchronizes: self.synchronizes - earlier.synchronizes,
        }
    }
}

#[derive(Default)]
struct AtomicCounters {
    h2d_bytes: AtomicU64,
    h2d_calls: AtomicU64,
    d2h_bytes: AtomicU64,
    d2h_calls: AtomicU64,
    copy_batches: AtomicU64,
    copy_regions: AtomicU64,
    fills: AtomicU64,
    ops: AtomicU64,
    synchronizes: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// An opened device. Closing happens on drop.
pub struct Device {
    plugin: Plugin,
    ordinal: u32,
    instance: DeviceInstance,
    description: Description,
    counters: AtomicCounters,
    /// Set once the plugin answered `write_async` with "unsupported" (or predates it), so
    /// that later writes go straight to staging.
    no_async_write: AtomicBool,
    /// Where the plugin's log messages are attributed; the sink points at it until `close`.
    _log_target: Box<LogTarget>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("plugin", &self.plugin.name)
            .field("ordinal", &self.ordinal)
            .field("name", &self.description.name)
            .finish()
    }
}

macro_rules! forward_op {
    ($(#[$doc:meta])* $method:ident, $query:ident, $args:ty) => {
        $(#[$doc])*
        pub fn $method(&self, args: &$args) -> Result<(), DeviceError> {
            bump(&self.counters.ops, 1);
            let result = (self.instance.vtable.$method())(self.instance.ctx, args);
            self.check(stringify!($method), result)
        }

        #[doc = concat!("Scratch bytes [`Device::", stringify!($method), "`] needs for `args`.")]
        pub fn $query(&self, args: &$args) -> Result<u64, DeviceError> {
            let result = (self.instance.vtable.$query())(self.instance.ctx, args);
            self.check(stringify!($query), result)
        }
    };
}

impl Device {
    fn new(
        plugin: Plugin,
        ordinal: u32,
        instance: DeviceInstance,
        log_target: Box<LogTarget>,
    ) -> Device {
        let desc = (instance.vtable.describe())(instance.ctx);
        let description = Description {
            name: desc.name.into_string(),
            vendor: desc.vendor.into_string(),
            total_memory: desc.total_memory,
            dtypes: desc.dtypes.into_iter().collect(),
            ops: desc.ops.into_iter().collect(),
            properties: desc
                .properties
                .into_iter()
                .map(|p| (p.key.into_string(), p.value.into_string()))
                .collect(),
        };
        Device {
            plugin,
            ordinal,
            instance,
            description,
            counters: AtomicCounters::default(),
            no_async_write: AtomicBool::new(false),
            _log_target: log_target,
        }
    }

    /// The plugin this device belongs to.
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// The device ordinal within its plugin.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's description, read once at open.
    pub fn description(&self) -> &Description {
        &self.description
    }

    /// Whether the device implements `op`.
    pub fn supports(&self, op: OpKind) -> bool {
        self.description.ops.contains(&op)
    }

    /// What has crossed the boundary since the device was opened.
    pub fn counters(&self) -> Counters {
        let c = &self.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Counters {
            host_to_device_bytes: load(&c.h2d_bytes),
            host_to_device_calls: load(&c.h2d_calls),
            device_to_host_bytes: load(&c.d2h_bytes),
            device_to_host_calls: load(&c.d2h_calls),
            copy_batches: load(&c.copy_batches),
            copy_regions: load(&c.copy_regions),
            fills: load(&c.fills),
            ops: load(&c.ops),
            synchronizes: load(&c.synchronizes),
        }
    }

    /// `(free, total)` device memory. Queue-ordered frees may show only after
    /// [`Device::synchronize`].
    pub fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        let result = (self.instance.vtable.mem_info())(self.instance.ctx);
        self.check("mem_info", result)
    }

    /// The plugin's own accounting: bytes live through `alloc`, and what it holds outside it.
    pub fn memory_report(&self) -> Result<PluginMemory, DeviceError> {
        let result = (self.instance.vtable.memory_report())(self.instance.ctx);
        self.check("memory_report", result).map(PluginMemory::from)
    }

    /// Waits for the queue and has the plugin give back the device memory it took after
    /// open to reuse (ABI 2.3's `trim`): the bytes, or `None` from a plugin that keeps nothing
    /// of the kind (built for an older minor, or answering "unsupported").
    pub fn trim(&self) -> Result<Option<u64>, DeviceError> {
        let Some(trim) = self.vtable_trim() else {
            return Ok(None);
        };
        match trim(self.instance.ctx).into_result() {
            Ok(bytes) => Ok(Some(bytes)),
            Err(err) if err.code == ErrorCode::UNSUPPORTED => Ok(None),
            Err(err) => Err(self.plugin.error("trim", err)),
        }
    }

    /// Raw device allocation. Core code allocates through its caching allocator instead.
    pub fn alloc(&self, bytes: u64) -> Result<BufferHandle, DeviceError> {
        let result = (self.instance.vtable.alloc())(self.instance.ctx, bytes);
        self.check("alloc", result)
    }

    /// Raw device free, queue-ordered.
    pub fn free(&self, buf: BufferHandle) -> Result<(), DeviceError> {
        let result = (self.instance.vtable.free())(self.instance.ctx, buf);
        self.check("free", result)
    }

    /// Host -> device copy of `src` to `dst` at byte `offset`; `src` may be reused on return.
    pub fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        bump(&self.counters.h2d_calls, 1);
        bump(&self.counters.h2d_bytes, src.len() as u64);
        let result =
            (self.instance.vtable.write())(self.instance.ctx, dst, offset, RSlice::from_slice(src));
        self.check("write", result)
    }

    /// Device -> host copy into `dst` from `src` at byte `offset`, after the work enqueued
    /// before it.
    pub fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        bump(&self.counters.d2h_calls, 1);
        bump(&self.counters.d2h_bytes, dst.len() as u64);
        let result = (self.instance.vtable.read())(
            self.instance.ctx,
            src,
            offset,
            RSliceMut::from_mut_slice(dst),
        );
        self.check("read", result)
    }

    /// Device -> device copy of one range.
    pub fn copy(
        &self,
        dst: BufferHandle,
        dst_offset: u64,
        src: BufferHandle,
        src_offset: u64,
        bytes: u64,
    ) -> Result<(), DeviceError> {
        self.copy_batch(&[CopyRegion {
            src,
            src_offset,
            dst,
            dst_offset,
            bytes,
        }])
    }

    /// Batched device -> device copy; each region names its own buffers.
    pub fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), DeviceError> {
        bump(&self.counters.copy_batches, 1);
        bump(&self.counters.copy_regions, regions.len() as u64);
        let result =
            (self.instance.vtable.copy_batch())(self.instance.ctx, RSlice::from_slice(regions));
        self.check("copy_batch", result)
    }

    /// Fills a byte range with a repeated value (see [`FillArgs`]).
    pub fn fill(&self, args: &FillArgs) -> Result<(), DeviceError> {
        bump(&self.counters.fills, 1);
        let result = (self.instance.vtable.fill())(self.instance.ctx, args);
        self.check("fill", result)
    }

    /// Zeroes `bytes` bytes of `buf` at `offset`.
    pub fn zero(&self, buf: BufferHandle, offset: u64, bytes: u64) -> Result<(), DeviceError> {
        self.fill(&FillArgs {
            dst: BufferSlice { buf, offset, bytes },
            value: 0,
            width: 1,
        })
    }

    /// Waits for all enqueued work and reports its failure, if any.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        bump(&self.counters.synchronizes, 1);
        let result = (self.instance.vtable.synchronize())(self.instance.ctx);
        self.check("synchronize", result)
    }

    forward_op!(
        /// See [`GemmArgs`].
        gemm, gemm_workspace, GemmArgs
    );
    forward_op!(
        /// See [`NormArgs`].
        layer_norm, layer_norm_workspace, NormArgs
    );
    forward_op!(
        /// See [`NormArgs`].
        rms_norm, rms_norm_workspace, NormArgs
    );
    forward_op!(
        /// See [`ActivationArgs`].
        activation, activation_workspace, ActivationArgs
    );
    forward_op!(
        /// See [`BinaryArgs`].
        binary, binary_workspace, BinaryArgs
    );
    forward_op!(
        /// See [`RotaryArgs`].
        rotary, rotary_workspace, RotaryArgs
    );
    forward_op!(
        /// See [`AttentionArgs`].
        attention, attention_workspace, AttentionArgs<'_>
    );
    forward_op!(
        /// See [`GatherArgs`].
        gather_rows, gather_rows_workspace, GatherArgs
    );
    forward_op!(
        /// See [`CastArgs`].
        cast, cast_workspace, CastArgs
    );

    /// Whether the plugin offers host staging buffers (ABI 2.1's `alloc_host` is present).
    /// Without them, [`Device::host_buffer`] hands out ordinary memory and transfers complete
    /// before they return.
    pub fn has_staging(&self) -> bool {
        self.vtable_alloc_host().is_some()
    }

    /// A host staging buffer of `bytes` (> 0): page-locked memory from the plugin when it
    /// offers it, ordinary memory otherwise.
    pub fn host_buffer(self: &Arc<Self>, bytes: u64) -> Result<HostBuffer, DeviceError> {
        let len = usize::try_from(bytes).map_err(|_| DeviceError {
            plugin: self.plugin.name.clone(),
            op: "alloc_host",
            code: ErrorCode::OUT_OF_MEMORY,
            message: format!("{bytes} bytes do not fit in this host's address space"),
        })?;
        if let Some(alloc_host) = self.vtable_alloc_host() {
            match alloc_host(self.instance.ctx, bytes).into_result() {
                // The host reads and writes through the plugin's pointer: an answer that does
                // not cover what was asked for is refused (and given back), never used.
                Ok(alloc) if alloc.ptr.is_null() || alloc.len < bytes => {
                    if let Some(free_host) = self.vtable_free_host() {
                        let _ = free_host(self.instance.ctx, alloc.id);
                    }
                    return Err(DeviceError {
                        plugin: self.plugin.name.clone(),
                        op: "alloc_host",
                        code: ErrorCode::INTERNAL,
                        message: format!(
                            "asked for {bytes} bytes, the plugin answered {} bytes at {:p}",
                            alloc.len, alloc.ptr
                        ),
                    });
                }
                Ok(alloc) => {
                    return Ok(HostBuffer {
                        device: Arc::clone(self),
                        memory: Staging::Pinned { alloc, len },
                        pending: None,
                    });
                }
                // A plugin may list the function and still not offer the memory.
                Err(err) if err.code == ErrorCode::UNSUPPORTED => {}
                Err(err) => return Err(self.plugin.error("alloc_host", err)),
            }
        }
        Ok(HostBuffer {
            device: Arc::clone(self),
            memory: Staging::Plain(vec![0; len]),
            pending: None,
        })
    }

    /// Copies `bytes` from `src` at `src_offset` into `dst` at `dst_offset`: enqueued from
    /// page-locked memory, or a `write` from ordinary memory. `src` cannot be touched again
    /// until the copy has been consumed ([`HostBuffer::as_mut_slice`] waits for it).
    pub fn upload(
        &self,
        dst: BufferHandle,
        dst_offset: u64,
        src: &mut HostBuffer,
        src_offset: u64,
        bytes: u64,
    ) -> Result<(), DeviceError> {
        self.staged("upload", src, src_offset, bytes)?;
        match &src.memory {
            Staging::Plain(data) => {
                let range = host_range(src_offset, bytes);
                self.write(dst, dst_offset, &data[range])
            }
            Staging::Pinned { alloc, .. } => {
                bump(&self.counters.h2d_calls, 1);
                bump(&self.counters.h2d_bytes, bytes);
                let copy = StagedCopy {
                    device: dst,
                    device_offset: dst_offset,
                    host: alloc.id,
                    host_offset: src_offset,
                    bytes,
                };
                src.pending = Some(self.enqueue_staged("upload", self.vtable_upload(), &copy)?);
                Ok(())
            }
        }
    }

    /// Copies `bytes` from `src` at `src_offset` into `dst` at `dst_offset`: enqueued into
    /// page-locked memory (the data is there once [`HostBuffer::as_slice`] returns), or a
    /// `read` into ordinary memory.
    pub fn download(
        &self,
        src: BufferHandle,
        src_offset: u64,
        dst: &mut HostBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), DeviceError> {
        self.staged("download", dst, dst_offset, bytes)?;
        match &mut dst.memory {
            Staging::Plain(data) => {
                let range = host_range(dst_offset, bytes);
                self.read(src, src_offset, &mut data[range])
            }
            Staging::Pinned { alloc, .. } => {
                bump(&self.counters.d2h_calls, 1);
                bump(&self.counters.d2h_bytes, bytes);
                let copy = StagedCopy {
                    device: src,
                    device_offset: src_offset,
                    host: alloc.id,
                    host_offset: dst_offset,
                    bytes,
                };
                dst.pending =
                    Some(self.enqueue_staged("download", self.vtable_download(), &copy)?);
                Ok(())
            }
        }
    }

    /// Enqueues a staged copy with `transfer` (`upload` or `download`) and returns the fence
    /// that orders the host buffer's next use after it.
    fn enqueue_staged(
        &self,
        op: &'static str,
        transfer: Option<StagedFn>,
        copy: &StagedCopy,
    ) -> Result<u64, DeviceError> {
        let transfer = self.staging_fn(op, transfer)?;
        self.check(op, transfer(self.instance.ctx, copy))?;
        self.fence().inspect_err(|_| {
            // The transfer is queued and the buffer would read as idle with no fence to wait
            // for: wait for the whole queue instead, so that the host neither overwrites an
            // upload's source nor reads a download that has not arrived.
            let _ = self.synchronize();
        })
    }

    fn fence(&self) -> Result<u64, DeviceError> {
        let fence = self.staging_fn("fence", self.vtable_fence())?;
        self.check("fence", fence(self.instance.ctx))
    }

    fn wait_fence(&self, value: u64) -> Result<(), DeviceError> {
        let wait = self.staging_fn("wait_fence", self.vtable_wait_fence())?;
        self.check("wait_fence", wait(self.instance.ctx, value))
    }

    /// Runs `f` with writes that read the host's memory when they run (ABI 2.2), for sources
    /// that live at least as long as `'a` (which outlives this call), then waits until the
    /// device has run every write `f` enqueued: the sources are free again when this returns,
    /// whatever `f` did. Returns `f`'s answer and the outcome of that wait (a failure of the
    /// work the wait covers). See [`AsyncWrites`].
    ///
    /// The writes are lent to `f` rather than handed out, so that no caller can end the
    /// sources' borrow without the wait (a value could be leaked with `mem::forget`, and its
    /// drop never run, while the device still reads the sources).
    pub fn with_async_writes<'a, R>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut AsyncWrites<'a>) -> R,
    ) -> (R, Result<(), DeviceError>) {
        let mut writes = AsyncWrites {
            device: Arc::clone(self),
            pending: false,
            _sources: PhantomData,
        };
        // A panic in `f` unwinds through `writes`, whose drop waits.
        let answer = f(&mut writes);
        let waited = writes.wait();
        (answer, waited)
    }

    /// Whether [`AsyncWrites::write`] may still enqueue: the plugin has `write_async` and has
    /// not refused it.
    pub fn has_async_write(&self) -> bool {
        self.async_write_fn().is_some()
    }

    /// The plugin's `write_async`, unless it lacks one or has refused it.
    fn async_write_fn(
        &self,
    ) -> Option<extern "C" fn(DeviceCtx, &AsyncWrite) -> RResult<(), PluginError>> {
        self.vtable_write_async()
            .filter(|_| !self.no_async_write.load(Ordering::Relaxed))
    }

    /// Checks a staged transfer's host range and that the buffer belongs to this device.
    fn staged(
        &self,
        op: &'static str,
        buffer: &HostBuffer,
        offset: u64,
        bytes: u64,
    ) -> Result<(), DeviceError> {
        let invalid = |message: String| DeviceError {
            plugin: self.plugin.name.clone(),
            op,
            code: ErrorCode::INVALID_ARGUMENT,
            message,
        };
        if !std::ptr::eq(Arc::as_ptr(&buffer.device), self) {
            return Err(invalid(
                "the host buffer belongs to another device".to_owned(),
            ));
        }
        match offset.checked_add(bytes) {
            Some(end) if end <= buffer.len() as u64 => Ok(()),
            _ => Err(invalid(format!(
                "host bytes [{offset}, {offset}+{bytes}) lie outside the host buffer of {} bytes",
                buffer.len()
            ))),
        }
    }

    fn staging_fn<F>(&self, op: &'static str, f: Option<F>) -> Result<F, DeviceError> {
        f.ok_or_else(|| DeviceError {
            plugin: self.plugin.name.clone(),
            op,
            code: ErrorCode::UNSUPPORTED,
            message: format!(
                "the plugin was built for ABI {}.{}, which has no host staging",
                self.plugin.abi_major, self.plugin.abi_minor
            ),
        })
    }

    fn check<T>(
        &self,
        op: &'static str,
        result: RResult<T, PluginError>,
    ) -> Result<T, DeviceError> {
        result
            .into_result()
            .map_err(|err| self.plugin.error(op, err))
    }
}

/// The functions appended after ABI 2.0 (2.1's staging, 2.2's asynchronous write, 2.3's trim),
/// read through accessors that return `None` for a plugin built for an older minor (and always
/// `None` when this crate is built with minor 0's tables).
macro_rules! optional_accessors {
    ($($name:ident: $field:ident($($arg:ty),*) -> $ret:ty;)*) => {
        impl Device {
            $(
                fn $name(&self) -> Option<extern "C" fn(DeviceCtx, $($arg),*) -> RResult<$ret, PluginError>> {
                    #[cfg(not(feature = "abi-2-0"))]
                    {
                        self.instance.vtable.$field()
                    }
                    #[cfg(feature = "abi-2-0")]
                    {
                        None
                    }
                }
            )*
        }
    };
}

optional_accessors! {
    vtable_alloc_host: alloc_host(u64) -> HostAlloc;
    vtable_free_host: free_host(HostBufferId) -> ();
    vtable_upload: upload(&StagedCopy) -> ();
    vtable_download: download(&StagedCopy) -> ();
    vtable_fence: fence() -> u64;
    vtable_wait_fence: wait_fence(u64) -> ();
    vtable_write_async: write_async(&AsyncWrite) -> ();
    vtable_trim: trim() -> u64;
}

/// Writes enqueued on one device whose host sources stay borrowed until the device has run
/// them, lent by [`Device::with_async_writes`].
///
/// The borrow checker keeps every source alive and unchanged for `'a`, which outlives the
/// call that lent the writes; that call (or [`AsyncWrites::wait`] before it) waits for a fence
/// recorded after the last write, so the sources are free again only once the device no
/// longer reads them.
pub struct AsyncWrites<'a> {
    device: Arc<Device>,
    /// Whether a write was enqueued since the last wait.
    pending: bool,
    _sources: PhantomData<&'a [u8]>,
}

impl<'a> AsyncWrites<'a> {
    /// Enqueues a copy of `src` into `dst` at byte `offset`. Returns `false`, enqueueing
    /// nothing, when the plugin does not offer such writes (built before ABI 2.2, or it
    /// answers "unsupported"): the caller then stages the bytes itself.
    ///
    /// # Errors
    /// The plugin's error for a bad range or a failed enqueue.
    pub fn write(
        &mut self,
        dst: BufferHandle,
        offset: u64,
        src: &'a [u8],
    ) -> Result<bool, DeviceError> {
        let device = &*self.device;
        let Some(write_async) = device.async_write_fn() else {
            return Ok(false);
        };
        let write = AsyncWrite {
            device: dst,
            device_offset: offset,
            host: src.as_ptr(),
            bytes: src.len() as u64,
        };
        match write_async(device.instance.ctx, &write).into_result() {
            Ok(()) => {
                self.pending = true;
                bump(&device.counters.h2d_calls, 1);
                bump(&device.counters.h2d_bytes, src.len() as u64);
                Ok(true)
            }
            Err(err) if err.code == ErrorCode::UNSUPPORTED => {
                device.no_async_write.store(true, Ordering::Relaxed);
                Ok(false)
            }
            Err(err) => {
                // A plugin may have queued part of the copy before it failed: the sources stay
                // borrowed until the wait that ends `with_async_writes`.
                self.pending = true;
                Err(device.plugin.error("write_async", err))
            }
        }
    }

    /// Waits until the device has run every write enqueued so far (and the work before them).
    ///
    /// # Errors
    /// A failure of the work the fence covers. The sources are no longer read either way.
    pub fn wait(&mut self) -> Result<(), DeviceError> {
        if !std::mem::take(&mut self.pending) {
            return Ok(());
        }
        let device = &*self.device;
        let waited = device.fence().and_then(|fence| device.wait_fence(fence));
        if waited.is_err() {
            // A fence that could not be recorded or waited for says nothing about the
            // writes: drain the whole queue before the sources may go.
            device.synchronize()?;
        }
        waited
    }
}

impl Drop for AsyncWrites<'_> {
    fn drop(&mut self) {
        // Reached with writes pending only while the closure that had them unwinds: the
        // sources may be freed right after this returns, so it waits. Its error has no caller
        // to go to (a device may report a failure once, to this wait), so it is logged rather
        // than dropped unseen.
        if let Err(err) = self.wait() {
            tracing::error!(
                target: "iris::plugin",
                plugin = %err.plugin,
                "waiting for async writes while unwinding: {err}"
            );
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        (self.instance.vtable.close())(self.instance.ctx);
    }
}

/// A host staging buffer of one device (see [`Device::host_buffer`]).
///
/// Transfers through it are ordered by the buffer itself: after an asynchronous upload or
/// download, [`HostBuffer::as_slice`] and [`HostBuffer::as_mut_slice`] first wait until the
/// device has finished with it, so the host never reads data that has not arrived or
/// overwrites data not yet sent.
pub struct HostBuffer {
    device: Arc<Device>,
    memory: Staging,
    /// Fence after the last asynchronous transfer through this buffer.
    pending: Option<u64>,
}

enum Staging {
    Plain(Vec<u8>),
    /// The plugin's memory, of at least `len` bytes: the length asked for, which the host
    /// uses (a plugin may round its allocation up).
    Pinned {
        alloc: HostAlloc,
        len: usize,
    },
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len())
            .field("pinned", &self.is_pinned())
            .field("pending", &self.pending)
            .finish()
    }
}

impl HostBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.memory {
            Staging::Plain(data) => data.len(),
            Staging::Pinned { len, .. } => *len,
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the memory came from the plugin (page-locked) rather than the host's heap.
    pub fn is_pinned(&self) -> bool {
        matches!(self.memory, Staging::Pinned { .. })
    }

    /// The contents, once every transfer through the buffer has completed.
    pub fn as_slice(&mut self) -> Result<&[u8], DeviceError> {
        self.settle()?;
        Ok(match &self.memory {
            Staging::Plain(data) => data,
            // SAFETY: the plugin gave out at least `len` bytes at `ptr`, not null (checked in
            // `host_buffer`), that stay valid until `free_host`, which only `drop` calls; no
            // transfer is in flight (settled above) and `&mut self` rules out other references.
            Staging::Pinned { alloc, len } => unsafe {
                std::slice::from_raw_parts(alloc.ptr, *len)
            },
        })
    }

    /// The contents for writing, once every transfer through the buffer has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], DeviceError> {
        self.settle()?;
        Ok(match &mut self.memory {
            Staging::Plain(data) => data,
            // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
            Staging::Pinned { alloc, len } => unsafe {
                std::slice::from_raw_parts_mut(alloc.ptr, *len)
            },
        })
    }

    fn settle(&mut self) -> Result<(), DeviceError> {
        if let Some(fence) = self.pending {
            self.device.wait_fence(fence)?;
            self.pending = None;
        }
        Ok(())
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Staging::Pinned { alloc, .. } = &self.memory
            && let Some(free_host) = self.device.vtable_free_host()
        {
            // Queue-ordered: safe with transfers still in flight. A refusal leaves the memory
            // to the plugin, which releases it when the device closes.
            let _ = free_host(self.device.instance.ctx, alloc.id);
        }
    }
}

fn host_range(offset: u64, bytes: u64) -> std::ops::Range<usize> {
    // Checked against the buffer's length (a usize) in `Device::staged`.
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let len = usize::try_from(bytes).unwrap_or(0);
    start..start + len
}

/// The signature of `upload` and `download`.
type StagedFn = extern "C" fn(DeviceCtx, &StagedCopy) -> RResult<(), PluginError>;

/// Whom a plugin's log messages are attributed to.
struct LogTarget {
    plugin: String,
    ordinal: u32,
}

extern "C" fn host_log(ctx: HostCtx, level: LogLevel, message: RStr<'_>) {
    // A tracing subscriber that panics must not unwind into the plugin.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: `ctx` is the `LogTarget` boxed in `Plugin::open`, which the `Device` keeps
        // until after `close`; the ABI forbids logging after that.
        let Some(target) = (unsafe { ctx.0.cast::<LogTarget>().as_ref() }) else {
            return;
        };
        let (plugin, device, message) = (&target.plugin, target.ordinal, message.as_str());
        match level {
            LogLevel::ERROR => {
                tracing::error!(target: "iris::plugin", plugin = %plugin, device, "{message}");
            }
            LogLevel::WARN => {
                tracing::warn!(target: "iris::plugin", plugin = %plugin, device, "{message}");
            }
            LogLevel::INFO => {
                tracing::info!(target: "iris::plugin", plugin = %plugin, device, "{message}");
            }
            LogLevel::DEBUG => {
                tracing::debug!(target: "iris::plugin", plugin = %plugin, device, "{message}");
            }
            _ => tracing::trace!(target: "iris::plugin", plugin = %plugin, device, "{message}"),
        }
    });
}
