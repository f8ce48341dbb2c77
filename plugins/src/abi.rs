//! The FFI-safe types that cross the plugin boundary: ABI 2.
//!
//! Everything here is `#[repr(C)]` and derives [`StableAbi`], so abi_stable can compare the
//! host's and the plugin's layouts when a library is loaded. Rules that keep the ABI stable:
//!
//! - Tables that will grow ([`IrisPlugin`], [`DeviceVTable`]) are prefix types: new fields are
//!   appended after the last one, never inserted, and the host reads every field appended after
//!   a table's first release through the `Option` accessors abi_stable generates, so a plugin
//!   built for an older minor still loads and the host falls back where a field is missing.
//! - Closed sets that may gain members (dtypes, op kinds, error codes, activations, log levels)
//!   are newtypes over integers with associated constants, not Rust enums: an unknown value is
//!   an error a plugin can report, not a layout change.
//! - Argument structs of ops never change once released; an op that needs new parameters gets a
//!   new function appended to the vtable. The device description grows through
//!   [`DeviceDesc::properties`], typed by key.
//! - Host data crosses only as borrowed slices ([`RSlice`], [`RSliceMut`]) valid for one call,
//!   or through host staging buffers the plugin allocated. Device memory is opaque: a
//!   [`BufferHandle`] is an integer the plugin gave out.
//!
//! # Execution model
//!
//! Each opened device has one in-order queue. Ops, copies, fills, writes and uploads are
//! *enqueued*: they may return before the work is done, and they run in the order they were
//! called. `read` and `synchronize` wait. A `write` returns once its host slice may be reused.
//! `free` is queue-ordered: freeing a buffer right after enqueueing work that uses it is safe,
//! and the plugin releases the memory once that work is done. A failure of enqueued work is
//! reported by a later call on the device (at the latest by `synchronize`), naming the failed
//! call as well as the device can. docs/WRITING_A_BACKEND.md has the contract op by op.

use std::ffi::c_void;
use std::fmt;

use abi_stable::StableAbi;
use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RResult, RSlice, RSliceMut, RStr, RString, RVec};

/// iris's own ABI major version. A plugin loads only if its major equals the host's.
pub const ABI_MAJOR: u32 = 2;
/// iris's own ABI minor version, bumped whenever a field or function is appended.
///
/// - 2.0: queue-ordered execution, memory report, batched copies, fill, integer dtypes,
///   workspaces for every op, rotary from tables, device-resident indices, log sink.
/// - 2.1: host staging (pinned host buffers, asynchronous upload and download, fences).
/// - 2.2: `write_async`, an enqueued write that reads the host's memory when it runs.
/// - 2.3: `trim`, which gives back device memory the plugin took after `open` to reuse.
#[cfg(not(feature = "abi-2-0"))]
pub const ABI_MINOR: u32 = 3;
/// iris's own ABI minor version (this build reproduces minor 0's tables for compatibility
/// tests; see the `abi-2-0` feature).
#[cfg(feature = "abi-2-0")]
pub const ABI_MINOR: u32 = 0;
/// The oldest plugin minor version this host accepts (the compatibility window).
pub const ABI_MIN_MINOR: u32 = 0;
/// Magic number at the start of [`AbiVersion`]: tells an iris plugin from any other library
/// that happens to export a symbol of the same name.
pub const ABI_MAGIC: u64 = 0x4952_4953_5f50_4c47; // "IRIS_PLG"
/// Name of the exported [`AbiVersion`] static, read before abi_stable's layout check so that a
/// version mismatch is reported as such and not as a layout error.
pub const ABI_VERSION_SYMBOL: &str = "iris_plugin_abi_version";

/// The version block every plugin exports as the static [`ABI_VERSION_SYMBOL`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbiVersion {
    /// Always [`ABI_MAGIC`].
    pub magic: u64,
    /// The plugin's ABI major version.
    pub major: u32,
    /// The plugin's ABI minor version.
    pub minor: u32,
}

impl AbiVersion {
    /// The version this crate implements.
    pub const CURRENT: AbiVersion = AbiVersion {
        magic: ABI_MAGIC,
        major: ABI_MAJOR,
        minor: ABI_MINOR,
    };
}

// ---------------------------------------------------------------------------------------------
// Root module
// ---------------------------------------------------------------------------------------------

/// The root module of a plugin library: its identity, the probe, and the entry to open devices.
///
/// A prefix type: fields after `open` may be appended in later minor versions.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = IrisPluginRef)))]
pub struct IrisPlugin {
    /// Short name, as used in config (`cpu`, `cuda`, `ascend`, or a vendor's own).
    pub name: RStr<'static>,
    /// The plugin's own version (its crate version), for display.
    pub version: RStr<'static>,
    /// How many devices this machine has for the plugin, or why there are none.
    /// Must not fail or panic when the hardware or vendor runtime is missing.
    pub probe: extern "C" fn() -> ProbeResult,
    /// Opens device `ordinal` with plugin-specific options (`key = value` pairs from the
    /// `[plugins.<name>]` table of the config). Unknown keys are an invalid-argument error.
    /// `log` carries the plugin's messages into the host's log; it stays valid until the
    /// device's `close` returns.
    #[sabi(last_prefix_field)]
    pub open: extern "C" fn(
        ordinal: u32,
        options: RSlice<'_, PluginOption<'_>>,
        log: LogSink,
    ) -> RResult<DeviceInstance, PluginError>,
}

impl RootModule for IrisPluginRef {
    abi_stable::declare_root_module_statics! {IrisPluginRef}
    const BASE_NAME: &'static str = "iris_device";
    const NAME: &'static str = "iris device plugin";
    // iris's own major/minor check runs before this one; abi_stable's version gate is pinned to
    // the ABI major so it never disagrees with ours.
    const VERSION_STRINGS: VersionStrings = VersionStrings::new("2.0.0");
}

/// The answer of [`IrisPlugin::probe`].
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct ProbeResult {
    /// Number of devices; 0 when the hardware or runtime is absent.
    pub device_count: u32,
    /// Why there are no devices (for example "libcuda.so not found"); empty when there are.
    pub reason: RString,
}

/// One plugin-specific option passed to [`IrisPlugin::open`].
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct PluginOption<'a> {
    /// Option name, e.g. `threads`.
    pub key: RStr<'a>,
    /// Option value as text, e.g. `2`.
    pub value: RStr<'a>,
}

/// Where a plugin's log messages go: the host's log, tagged with the plugin's name and the
/// device ordinal. `log` may be called from any thread until the device is closed.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct LogSink {
    /// The host's opaque state, passed back to `log`.
    pub ctx: HostCtx,
    /// Records one message.
    pub log: extern "C" fn(HostCtx, LogLevel, RStr<'_>),
}

/// The host's opaque state behind a [`LogSink`]. The plugin never dereferences it.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostCtx(pub *const c_void);

// SAFETY: the pointer is only handed back to the host, whose log target is immutable and
// shareable across threads.
unsafe impl Send for HostCtx {}
// SAFETY: as above.
unsafe impl Sync for HostCtx {}

/// Severity of a plugin log message.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogLevel(pub u32);

impl LogLevel {
    /// Something failed.
    pub const ERROR: LogLevel = LogLevel(1);
    /// Something is wrong but work goes on.
    pub const WARN: LogLevel = LogLevel(2);
    /// A fact worth knowing (a kernel compiled, a library loaded).
    pub const INFO: LogLevel = LogLevel(3);
    /// Detail for diagnosing problems.
    pub const DEBUG: LogLevel = LogLevel(4);
    /// Very detailed traces.
    pub const TRACE: LogLevel = LogLevel(5);
}

/// An opened device: the plugin's opaque state and the table of functions that act on it.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct DeviceInstance {
    /// Opaque state owned by the plugin, passed back as the first argument of every call.
    pub ctx: DeviceCtx,
    /// The functions of the device.
    pub vtable: DeviceVTableRef,
}

/// The plugin's opaque per-device state. The host never dereferences it.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCtx(pub *mut c_void);

// SAFETY: the pointer is only handed back to the plugin, whose device state is required by the
// ABI contract to be usable from any thread (see `DeviceVTable`).
unsafe impl Send for DeviceCtx {}
// SAFETY: as above; the plugin synchronises its own state.
unsafe impl Sync for DeviceCtx {}

// ---------------------------------------------------------------------------------------------
// Device vtable
// ---------------------------------------------------------------------------------------------

/// The functions of an opened device.
///
/// Threading: every function may be called from any thread, concurrently; the plugin
/// synchronises its own state. Calls from one thread enter the device's queue in call order.
///
/// Errors: every function returns a [`PluginError`]; no function panics across the boundary
/// (plugins catch unwinding and report [`ErrorCode::INTERNAL`]). Arguments are checked when a
/// call is made, with [`crate::validate`], and a bad one is reported by that call as
/// [`ErrorCode::INVALID_ARGUMENT`] naming the argument; nothing is enqueued then. An op the
/// device does not implement reports [`ErrorCode::UNSUPPORTED`] and must not be listed in
/// [`DeviceDesc::ops`].
///
/// Workspaces: every op has a `*_workspace` query that returns the scratch bytes the op needs
/// for given arguments. The answer depends only on shapes, dtypes, scalar arguments and host
/// slices, never on buffer contents; buffer handles (and the `workspace` field) are not read
/// and may be null, so a caller can size the workspace before any operand exists. The caller
/// allocates the workspace (so that it is accounted) and passes it in the op's arguments; it
/// may reuse it for later work as soon as the op is enqueued (the queue orders the uses).
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = DeviceVTableRef)))]
pub struct DeviceVTable {
    /// Name, vendor, memory, dtypes, ops and properties of the device.
    pub describe: extern "C" fn(DeviceCtx) -> DeviceDesc,
    /// `(free, total)` bytes of the whole device as the driver sees them. Memory released by
    /// queue-ordered frees may show only after `synchronize`.
    pub mem_info: extern "C" fn(DeviceCtx) -> RResult<MemInfo, PluginError>,
    /// The plugin's own accounting: bytes live through `alloc`, and memory it holds outside
    /// `alloc` (context, library handles, compiled kernels, caches).
    pub memory_report: extern "C" fn(DeviceCtx) -> RResult<MemoryReport, PluginError>,
    /// Allocates `bytes` (> 0) of device memory, usable by work enqueued after the call; its
    /// contents are undefined. [`ErrorCode::OUT_OF_MEMORY`] when it cannot.
    pub alloc: extern "C" fn(DeviceCtx, bytes: u64) -> RResult<BufferHandle, PluginError>,
    /// Frees a buffer returned by `alloc`, queue-ordered: the handle is invalid at once, the
    /// memory is released once work enqueued before the call is done. Freeing an unknown
    /// handle is an invalid argument.
    pub free: extern "C" fn(DeviceCtx, BufferHandle) -> RResult<(), PluginError>,
    /// Host -> device: enqueues a copy of `src` into `dst` at byte `offset`; returns once
    /// `src` may be reused.
    pub write: extern "C" fn(
        DeviceCtx,
        dst: BufferHandle,
        offset: u64,
        src: RSlice<'_, u8>,
    ) -> RResult<(), PluginError>,
    /// Device -> host: waits for the work enqueued before it, then fills `dst` from `src` at
    /// byte `offset`.
    pub read: extern "C" fn(
        DeviceCtx,
        src: BufferHandle,
        offset: u64,
        dst: RSliceMut<'_, u8>,
    ) -> RResult<(), PluginError>,
    /// Device -> device: enqueues a copy of every region (see [`CopyRegion`]). No destination
    /// range may overlap another region's destination or any region's source.
    pub copy_batch: extern "C" fn(DeviceCtx, RSlice<'_, CopyRegion>) -> RResult<(), PluginError>,
    /// Enqueues a fill of a byte range with a repeated value; see [`FillArgs`].
    pub fill: extern "C" fn(DeviceCtx, &FillArgs) -> RResult<(), PluginError>,
    /// Waits until all enqueued work has finished; reports a failure of that work.
    pub synchronize: extern "C" fn(DeviceCtx) -> RResult<(), PluginError>,
    /// Scratch bytes `gemm` needs for these arguments.
    pub gemm_workspace: extern "C" fn(DeviceCtx, &GemmArgs) -> RResult<u64, PluginError>,
    /// `out = act(a · Wᵀ + bias) (+ out if accumulate)`; see [`GemmArgs`].
    pub gemm: extern "C" fn(DeviceCtx, &GemmArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `layer_norm` needs.
    pub layer_norm_workspace: extern "C" fn(DeviceCtx, &NormArgs) -> RResult<u64, PluginError>,
    /// Layer normalisation over each row; see [`NormArgs`].
    pub layer_norm: extern "C" fn(DeviceCtx, &NormArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `rms_norm` needs.
    pub rms_norm_workspace: extern "C" fn(DeviceCtx, &NormArgs) -> RResult<u64, PluginError>,
    /// RMS normalisation over each row; see [`NormArgs`].
    pub rms_norm: extern "C" fn(DeviceCtx, &NormArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `activation` needs.
    pub activation_workspace:
        extern "C" fn(DeviceCtx, &ActivationArgs) -> RResult<u64, PluginError>,
    /// Elementwise activation; see [`ActivationArgs`].
    pub activation: extern "C" fn(DeviceCtx, &ActivationArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `binary` needs.
    pub binary_workspace: extern "C" fn(DeviceCtx, &BinaryArgs) -> RResult<u64, PluginError>,
    /// Elementwise add or multiply; see [`BinaryArgs`].
    pub binary: extern "C" fn(DeviceCtx, &BinaryArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `rotary` needs.
    pub rotary_workspace: extern "C" fn(DeviceCtx, &RotaryArgs) -> RResult<u64, PluginError>,
    /// Rotary position embedding from cos/sin tables, in place; see [`RotaryArgs`].
    pub rotary: extern "C" fn(DeviceCtx, &RotaryArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `attention` needs (it also validates `cu_seqlens`).
    pub attention_workspace:
        extern "C" fn(DeviceCtx, &AttentionArgs<'_>) -> RResult<u64, PluginError>,
    /// Variable-length, non-causal multi-head attention; see [`AttentionArgs`].
    pub attention: extern "C" fn(DeviceCtx, &AttentionArgs<'_>) -> RResult<(), PluginError>,
    /// Scratch bytes `gather_rows` needs.
    pub gather_rows_workspace: extern "C" fn(DeviceCtx, &GatherArgs) -> RResult<u64, PluginError>,
    /// Row gather by device-resident indices; see [`GatherArgs`].
    pub gather_rows: extern "C" fn(DeviceCtx, &GatherArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `cast` needs.
    pub cast_workspace: extern "C" fn(DeviceCtx, &CastArgs) -> RResult<u64, PluginError>,
    /// Dtype conversion; see [`CastArgs`].
    pub cast: extern "C" fn(DeviceCtx, &CastArgs) -> RResult<(), PluginError>,
    /// Waits for enqueued work and releases the device. Buffers still allocated are freed by
    /// the plugin; the host frees everything it allocated before closing, so this is a safety
    /// net, not a contract. The log sink may not be used after `close` returns.
    #[sabi(last_prefix_field)]
    pub close: extern "C" fn(DeviceCtx),

    // --- 2.1: host staging. A 2.0 plugin lacks these; the host then stages through ordinary
    // memory with `write` and `read`. ---
    /// Allocates `bytes` (> 0) of host memory the device transfers from and to efficiently
    /// (page-locked on accelerators; ordinary memory on the CPU device). Not device memory:
    /// it does not count in `mem_info` or in the memory report's `allocated`.
    #[cfg(not(feature = "abi-2-0"))]
    pub alloc_host: extern "C" fn(DeviceCtx, bytes: u64) -> RResult<HostAlloc, PluginError>,
    /// Frees a host staging buffer, queue-ordered like `free`.
    #[cfg(not(feature = "abi-2-0"))]
    pub free_host: extern "C" fn(DeviceCtx, HostBufferId) -> RResult<(), PluginError>,
    /// Enqueues a copy of `bytes` from a host staging buffer into device memory. The host must
    /// not modify the source range until a fence recorded after this call has completed.
    #[cfg(not(feature = "abi-2-0"))]
    pub upload: extern "C" fn(DeviceCtx, &StagedCopy) -> RResult<(), PluginError>,
    /// Enqueues a copy of `bytes` from device memory into a host staging buffer. The host may
    /// read the destination range once a fence recorded after this call has completed.
    #[cfg(not(feature = "abi-2-0"))]
    pub download: extern "C" fn(DeviceCtx, &StagedCopy) -> RResult<(), PluginError>,
    /// Records a fence after all work enqueued so far and returns its value. Values increase
    /// with every call; a fence is complete when all work before it is done.
    #[cfg(not(feature = "abi-2-0"))]
    pub fence: extern "C" fn(DeviceCtx) -> RResult<u64, PluginError>,
    /// Waits until fence `value` is complete; reports a failure of the work before it.
    #[cfg(not(feature = "abi-2-0"))]
    pub wait_fence: extern "C" fn(DeviceCtx, value: u64) -> RResult<(), PluginError>,

    // --- 2.2 ---
    /// Enqueues a copy of `bytes` from ordinary host memory into device memory, read when the
    /// copy runs rather than before the call returns: the host keeps the source unchanged
    /// until a fence recorded after this call has completed. A device whose queue can read
    /// host memory (the CPU device) copies once, with no staging and no work on the calling
    /// thread. Optional: "unsupported" (the default) sends the host to staging buffers.
    #[cfg(not(feature = "abi-2-0"))]
    pub write_async: extern "C" fn(DeviceCtx, &AsyncWrite) -> RResult<(), PluginError>,

    // --- 2.3 ---
    /// Waits for the queue, then gives back the device memory the plugin took after `open`
    /// for things it keeps to reuse and can make again when next needed (a library's plans
    /// and the kernels it loaded for them), and returns the bytes the device's used memory fell
    /// by after that wait. Buffers from `alloc` and what `open` made (and reports as
    /// held) stay. The host calls it when it resets, after returning its own cached blocks,
    /// so that device memory comes back to where it stood after start-up. Optional:
    /// "unsupported" (the default) says the plugin keeps nothing of the kind.
    #[cfg(not(feature = "abi-2-0"))]
    pub trim: extern "C" fn(DeviceCtx) -> RResult<u64, PluginError>,
}

// ---------------------------------------------------------------------------------------------
// Plain values
// ---------------------------------------------------------------------------------------------

/// An opaque handle to device memory; `0` is never a valid buffer.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferHandle(pub u64);

impl BufferHandle {
    /// The null handle, used for absent optional operands.
    pub const NULL: BufferHandle = BufferHandle(0);

    /// Whether this is [`BufferHandle::NULL`].
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

/// An opaque handle to a host staging buffer; `0` is never valid.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostBufferId(pub u64);

/// A host staging buffer: its handle and where it lies in the host's address space.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostAlloc {
    /// The handle for `upload`, `download` and `free_host`.
    pub id: HostBufferId,
    /// First byte, aligned to at least 64 bytes; valid until `free_host` takes effect.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: u64,
}

// SAFETY: the address names plain host memory the host may use from any thread; the ordering
// of its uses against the device is the host's obligation (fences).
unsafe impl Send for HostAlloc {}
// SAFETY: as above.
unsafe impl Sync for HostAlloc {}

/// A copy between a host staging buffer and device memory (see `upload` and `download`).
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedCopy {
    /// The device buffer.
    pub device: BufferHandle,
    /// Byte offset in the device buffer.
    pub device_offset: u64,
    /// The host staging buffer.
    pub host: HostBufferId,
    /// Byte offset in the host staging buffer.
    pub host_offset: u64,
    /// Length in bytes.
    pub bytes: u64,
}

/// A write whose host source is read when the copy runs (see `write_async`).
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncWrite {
    /// The device buffer.
    pub device: BufferHandle,
    /// Byte offset in the device buffer.
    pub device_offset: u64,
    /// First host byte: ordinary memory, valid and unchanged until a fence recorded after the
    /// call has completed.
    pub host: *const u8,
    /// Length in bytes.
    pub bytes: u64,
}

// SAFETY: the address names host memory the host lends until a fence completes; which thread
// reads it is the plugin's choice, and the host's obligation is only to keep it alive.
unsafe impl Send for AsyncWrite {}
// SAFETY: as above.
unsafe impl Sync for AsyncWrite {}

/// Device memory as the driver reports it.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

/// The plugin's own accounting of the device memory it holds.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Default)]
pub struct MemoryReport {
    /// Bytes of the buffers live through `alloc`, as requested (not rounded), counting a
    /// freed buffer until its release has taken effect.
    pub allocated: u64,
    /// Number of live buffers.
    pub buffers: u64,
    /// Device memory the plugin holds outside `alloc`, by what it is for.
    pub held: RVec<HeldMemory>,
}

impl MemoryReport {
    /// Total bytes held outside `alloc`.
    pub fn held_bytes(&self) -> u64 {
        self.held
            .iter()
            .fold(0u64, |sum, item| sum.saturating_add(item.bytes))
    }
}

/// One item of memory a plugin holds outside `alloc`.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct HeldMemory {
    /// What it is, e.g. `context`, `cublas workspace`, `kernels`, `packed weights`.
    pub what: RString,
    /// Bytes.
    pub bytes: u64,
}

/// What a device is and what it can do.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct DeviceDesc {
    /// Device name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: RString,
    /// Vendor, e.g. "NVIDIA".
    pub vendor: RString,
    /// Total device memory in bytes.
    pub total_memory: u64,
    /// Storage dtypes the device accepts. Must include `f32` and `i32`.
    pub dtypes: RVec<DType>,
    /// Ops implemented; the others return [`ErrorCode::UNSUPPORTED`].
    pub ops: RVec<OpKind>,
    /// Further facts, typed by key (see [`property`] for the keys iris knows).
    pub properties: RVec<Property>,
}

/// One key/value fact of a [`DeviceDesc`]. The value is text; each key documented in
/// [`property`] says how its value reads.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct Property {
    /// Snake-case key.
    pub key: RString,
    /// The value as text.
    pub value: RString,
}

impl Property {
    /// A property from a key and a displayable value.
    pub fn new(key: &str, value: impl fmt::Display) -> Property {
        Property {
            key: key.into(),
            value: value.to_string().into(),
        }
    }
}

/// Keys of [`DeviceDesc::properties`] that iris knows, with the form of their values. A plugin
/// may add keys of its own.
pub mod property {
    /// `major.minor`, e.g. `9.0` (CUDA compute capability).
    pub const COMPUTE_CAPABILITY: &str = "compute_capability";
    /// Peak memory bandwidth in bytes per second, a decimal integer.
    pub const MEMORY_BANDWIDTH: &str = "memory_bandwidth";
    /// The vendor driver's version, as the driver writes it.
    pub const DRIVER_VERSION: &str = "driver_version";
    /// The vendor runtime's version, as the runtime writes it.
    pub const RUNTIME_VERSION: &str = "runtime_version";
    /// The kernel tier in use, e.g. `avx512bf16` on the CPU device.
    pub const KERNEL_TIER: &str = "kernel_tier";
    /// How calls complete: `async` (an in-order queue) or `sync` (every call completes before
    /// it returns).
    pub const QUEUE: &str = "queue";
    /// Number of compute units (streaming multiprocessors, AI cores, CPU threads).
    pub const COMPUTE_UNITS: &str = "compute_units";
    /// The chip or part, e.g. `Ascend910B3`.
    pub const SOC: &str = "soc";
    /// What a host should run before serving. `step_sizes`: the device chooses kernels by
    /// problem size and loads them (or state for them) on first use, as cuBLASLt's heuristics
    /// and lazily loaded libraries do, so the first step of each new size is slower and may
    /// grow the device memory the driver holds; a host runs its tower once at a range of step
    /// sizes before it takes its post-start memory checkpoint. Absent: nothing is needed.
    pub const WARM_UP: &str = "warm_up";
    /// [`WARM_UP`]'s value asking for steps of a range of sizes.
    pub const WARM_UP_STEP_SIZES: &str = "step_sizes";
    /// The dense matrix-product FLOP/s the device can reach per storage dtype, as
    /// `dtype=flops` pairs separated by commas (`f32=1.9e11,bf16=3.8e11`): what a host holds a
    /// step's achieved FLOP/s against. How the device knows it is its own (the CPU device times
    /// its FMA roof at open); absent when it does not.
    pub const PEAK_FLOPS: &str = "peak_flops";

    /// The FLOP/s a [`PEAK_FLOPS`] value gives `dtype` (e.g. `bf16`); `None` when the value
    /// names no positive finite figure for it.
    pub fn peak_flops(value: &str, dtype: &str) -> Option<f64> {
        value.split(',').find_map(|pair| {
            let (name, flops) = pair.split_once('=')?;
            let flops: f64 = flops.trim().parse().ok()?;
            (name.trim() == dtype && flops.is_finite() && flops > 0.0).then_some(flops)
        })
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn peak_flops_reads_the_dtypes_figure() {
            let value = "f32=1.5e11, bf16 = 3e11,f16=x,i32=-1";
            assert_eq!(super::peak_flops(value, "f32"), Some(1.5e11));
            assert_eq!(super::peak_flops(value, "bf16"), Some(3e11));
            assert_eq!(super::peak_flops(value, "f16"), None);
            assert_eq!(super::peak_flops(value, "i32"), None);
            assert_eq!(super::peak_flops(value, "f64"), None);
            assert_eq!(super::peak_flops("", "f32"), None);
        }
    }
}

/// One region of a batched device-to-device copy, in bytes; each region names its own source
/// and destination buffers.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRegion {
    /// Source buffer.
    pub src: BufferHandle,
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Destination buffer.
    pub dst: BufferHandle,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Length in bytes.
    pub bytes: u64,
}

/// Arguments of [`DeviceVTable::fill`]: every `width`-byte element of `dst` becomes the low
/// `width` bytes of `value`, little-endian. `width` is 1, 2 or 4; `dst.offset` and
/// `dst.bytes` are multiples of it. Zero, `f32` 1.0 (`0x3f80_0000`, width 4) or a bf16 NaN
/// (`0x7fc0`, width 2) are all fills.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct FillArgs {
    /// The range to fill.
    pub dst: BufferSlice,
    /// The value, in its low `width` bytes.
    pub value: u32,
    /// Bytes per element: 1, 2 or 4.
    pub width: u32,
}

/// Element type of device data. Float compute happens in f32 whatever the storage type;
/// integer types carry indices and segment boundaries.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DType(pub u32);

impl DType {
    /// 32-bit IEEE float.
    pub const F32: DType = DType(0);
    /// 16-bit IEEE float.
    pub const F16: DType = DType(1);
    /// bfloat16.
    pub const BF16: DType = DType(2);
    /// 32-bit signed integer (indices, positions, segment boundaries).
    pub const I32: DType = DType(3);
    /// 8-bit unsigned integer (masks, raw bytes).
    pub const U8: DType = DType(4);
    /// Every dtype this ABI version defines.
    pub const ALL: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::U8];
    /// The floating-point dtypes, which the compute ops take.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element, or `None` for a value this ABI version does not define.
    pub fn size(self) -> Option<u64> {
        match self {
            DType::F32 | DType::I32 => Some(4),
            DType::F16 | DType::BF16 => Some(2),
            DType::U8 => Some(1),
            _ => None,
        }
    }

    /// Whether this is one of [`DType::FLOATS`].
    pub fn is_float(self) -> bool {
        DType::FLOATS.contains(&self)
    }

    /// Lower-case name (`f32`, `f16`, `bf16`, `i32`, `u8`), or `None` for an unknown value.
    pub fn name(self) -> Option<&'static str> {
        match self {
            DType::F32 => Some("f32"),
            DType::F16 => Some("f16"),
            DType::BF16 => Some("bf16"),
            DType::I32 => Some("i32"),
            DType::U8 => Some("u8"),
            _ => None,
        }
    }

    /// Parses a name as written by [`DType::name`] (also `float32`, `float16`, `bfloat16`,
    /// `int32`, `uint8`).
    pub fn parse(name: &str) -> Option<DType> {
        match name {
            "f32" | "float32" => Some(DType::F32),
            "f16" | "float16" => Some(DType::F16),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "i32" | "int32" => Some(DType::I32),
            "u8" | "uint8" => Some(DType::U8),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "dtype#{}", self.0),
        }
    }
}

/// Identifies an op in [`DeviceDesc::ops`] and in conformance reports.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpKind(pub u32);

impl OpKind {
    /// [`DeviceVTable::gemm`].
    pub const GEMM: OpKind = OpKind(0);
    /// [`DeviceVTable::layer_norm`].
    pub const LAYER_NORM: OpKind = OpKind(1);
    /// [`DeviceVTable::rms_norm`].
    pub const RMS_NORM: OpKind = OpKind(2);
    /// [`DeviceVTable::activation`].
    pub const ACTIVATION: OpKind = OpKind(3);
    /// [`DeviceVTable::binary`].
    pub const BINARY: OpKind = OpKind(4);
    /// [`DeviceVTable::rotary`].
    pub const ROTARY: OpKind = OpKind(5);
    /// [`DeviceVTable::attention`] (and its workspace query).
    pub const ATTENTION: OpKind = OpKind(6);
    /// [`DeviceVTable::gather_rows`].
    pub const GATHER_ROWS: OpKind = OpKind(7);
    /// [`DeviceVTable::cast`].
    pub const CAST: OpKind = OpKind(8);
    /// Every op this ABI version defines.
    pub const ALL: [OpKind; 9] = [
        OpKind::GEMM,
        OpKind::LAYER_NORM,
        OpKind::RMS_NORM,
        OpKind::ACTIVATION,
        OpKind::BINARY,
        OpKind::ROTARY,
        OpKind::ATTENTION,
        OpKind::GATHER_ROWS,
        OpKind::CAST,
    ];

    /// Snake-case name, or `None` for an unknown value.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            OpKind::GEMM => "gemm",
            OpKind::LAYER_NORM => "layer_norm",
            OpKind::RMS_NORM => "rms_norm",
            OpKind::ACTIVATION => "activation",
            OpKind::BINARY => "binary",
            OpKind::ROTARY => "rotary",
            OpKind::ATTENTION => "attention",
            OpKind::GATHER_ROWS => "gather_rows",
            OpKind::CAST => "cast",
            _ => return None,
        })
    }

    /// Parses a name as written by [`OpKind::name`].
    pub fn parse(name: &str) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|op| op.name() == Some(name))
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "op#{}", self.0),
        }
    }
}

/// Elementwise activation functions.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Activation(pub u32);

impl Activation {
    /// Identity (used by [`GemmArgs`] for "no activation").
    pub const NONE: Activation = Activation(0);
    /// `x · Φ(x)` with the exact error function (PyTorch `gelu`).
    pub const GELU_ERF: Activation = Activation(1);
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (PyTorch `gelu(approximate="tanh")`).
    pub const GELU_TANH: Activation = Activation(2);
    /// `x · sigmoid(1.702·x)` (CLIP's quick gelu).
    pub const QUICK_GELU: Activation = Activation(3);
    /// `x · sigmoid(x)`.
    pub const SILU: Activation = Activation(4);
    /// Every activation this ABI version defines.
    pub const ALL: [Activation; 5] = [
        Activation::NONE,
        Activation::GELU_ERF,
        Activation::GELU_TANH,
        Activation::QUICK_GELU,
        Activation::SILU,
    ];

    /// Snake-case name, or `None` for an unknown value.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Activation::NONE => "none",
            Activation::GELU_ERF => "gelu_erf",
            Activation::GELU_TANH => "gelu_tanh",
            Activation::QUICK_GELU => "quick_gelu",
            Activation::SILU => "silu",
            _ => return None,
        })
    }
}

/// Elementwise binary operations.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BinaryOp(pub u32);

impl BinaryOp {
    /// `a + b`.
    pub const ADD: BinaryOp = BinaryOp(0);
    /// `a · b`.
    pub const MUL: BinaryOp = BinaryOp(1);

    /// `add` or `mul`, or `None` for an unknown value.
    pub fn name(self) -> Option<&'static str> {
        match self {
            BinaryOp::ADD => Some("add"),
            BinaryOp::MUL => Some("mul"),
            _ => None,
        }
    }
}

/// Error categories. Out of memory is separate so the host can evict and retry.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u32);

impl ErrorCode {
    /// The device cannot satisfy an allocation.
    pub const OUT_OF_MEMORY: ErrorCode = ErrorCode(1);
    /// An argument is wrong (unknown buffer, range outside a buffer, shapes that disagree).
    pub const INVALID_ARGUMENT: ErrorCode = ErrorCode(2);
    /// The device does not implement this op or dtype.
    pub const UNSUPPORTED: ErrorCode = ErrorCode(3);
    /// The device or its runtime is not available (missing driver, device lost).
    pub const UNAVAILABLE: ErrorCode = ErrorCode(4);
    /// A fault inside the plugin, including a caught panic.
    pub const INTERNAL: ErrorCode = ErrorCode(5);

    /// Snake-case name; unknown codes read as `internal`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::OUT_OF_MEMORY => "out_of_memory",
            ErrorCode::INVALID_ARGUMENT => "invalid_argument",
            ErrorCode::UNSUPPORTED => "unsupported",
            ErrorCode::UNAVAILABLE => "unavailable",
            _ => "internal",
        }
    }
}

/// An error value returned by a plugin function.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct PluginError {
    /// The category.
    pub code: ErrorCode,
    /// A message for people, naming the argument or resource at fault.
    pub message: RString,
}

impl PluginError {
    /// An error with a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        PluginError {
            code,
            message: RString::from(message.into()),
        }
    }

    /// [`ErrorCode::OUT_OF_MEMORY`].
    pub fn out_of_memory(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::OUT_OF_MEMORY, message)
    }

    /// [`ErrorCode::INVALID_ARGUMENT`].
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::INVALID_ARGUMENT, message)
    }

    /// [`ErrorCode::UNSUPPORTED`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::UNSUPPORTED, message)
    }

    /// [`ErrorCode::UNAVAILABLE`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::UNAVAILABLE, message)
    }

    /// [`ErrorCode::INTERNAL`].
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::INTERNAL, message)
    }
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.message)
    }
}

impl std::error::Error for PluginError {}

// ---------------------------------------------------------------------------------------------
// Operand views and op arguments
// ---------------------------------------------------------------------------------------------

/// A row-major matrix view into a device buffer.
///
/// Element `(r, c)` lives at byte `offset + (r * row_stride + c) * dtype.size()`. Columns are
/// contiguous; `row_stride >= cols` lets a view select columns of a wider matrix (the q, k and
/// v parts of a fused qkv projection, say) without copying. A vector (indices, segment
/// boundaries) is a `[1, len]` view.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatRef {
    /// The buffer.
    pub buf: BufferHandle,
    /// Byte offset of element (0, 0).
    pub offset: u64,
    /// Element type.
    pub dtype: DType,
    /// Number of rows.
    pub rows: u64,
    /// Number of columns.
    pub cols: u64,
    /// Elements between the starts of consecutive rows.
    pub row_stride: u64,
}

impl MatRef {
    /// A contiguous `rows x cols` matrix at `offset` in `buf`.
    pub fn contiguous(buf: BufferHandle, offset: u64, dtype: DType, rows: u64, cols: u64) -> Self {
        MatRef {
            buf,
            offset,
            dtype,
            rows,
            cols,
            row_stride: cols,
        }
    }

    /// A `[1, len]` vector at `offset` in `buf`.
    pub fn vector(buf: BufferHandle, offset: u64, dtype: DType, len: u64) -> Self {
        Self::contiguous(buf, offset, dtype, 1, len)
    }

    /// An absent operand (a null buffer).
    pub const NONE: MatRef = MatRef {
        buf: BufferHandle::NULL,
        offset: 0,
        dtype: DType::F32,
        rows: 0,
        cols: 0,
        row_stride: 0,
    };

    /// Whether this view is [`MatRef::NONE`] (null buffer).
    pub fn is_none(&self) -> bool {
        self.buf.is_null()
    }

    /// Number of elements (`rows · cols`), or `None` on overflow.
    pub fn len(&self) -> Option<u64> {
        self.rows.checked_mul(self.cols)
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.rows == 0 || self.cols == 0
    }

    /// The half-open byte range `[start, end)` the view touches, or `None` on overflow or an
    /// unknown dtype. An empty view touches `[offset, offset)`.
    pub fn byte_range(&self) -> Option<(u64, u64)> {
        let size = self.dtype.size()?;
        if self.rows == 0 || self.cols == 0 {
            return Some((self.offset, self.offset));
        }
        let last = (self.rows - 1)
            .checked_mul(self.row_stride)?
            .checked_add(self.cols)?;
        let end = self.offset.checked_add(last.checked_mul(size)?)?;
        Some((self.offset, end))
    }
}

/// A byte range of a buffer.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferSlice {
    /// The buffer (may be [`BufferHandle::NULL`] when `bytes` is 0).
    pub buf: BufferHandle,
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub bytes: u64,
}

impl BufferSlice {
    /// An empty slice.
    pub const EMPTY: BufferSlice = BufferSlice {
        buf: BufferHandle::NULL,
        offset: 0,
        bytes: 0,
    };
}

/// Arguments of [`DeviceVTable::gemm`].
///
/// Computes `out[m, n] = act(Σ_k a[m, k] · w[n, k] + bias[n])`, then, when `accumulate` is set,
/// adds the previous contents of `out` (a residual connection). With `w_transposed` set, `w` is
/// stored as `[k, n]` instead of `[n, k]` (PyTorch's `Linear.weight` is `[n, k]`).
///
/// Shapes: `a` is `[m, k]`; `w` is `[n, k]` (or `[k, n]`); `bias` is [`MatRef::NONE`] or
/// `[1, n]`; `out` is `[m, n]`. All operands share one float dtype. `out` must not overlap
/// `a`, `w` or `bias`.
///
/// `w_constant` promises that the bytes of `w` will not change until its buffer is freed
/// (model weights): the device may then keep a copy of `w` transformed into the layout its
/// kernels prefer, keyed by buffer, offset and shape, and must count that copy in its memory
/// report and drop it when the buffer is freed.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct GemmArgs {
    /// Left operand `[m, k]`.
    pub a: MatRef,
    /// Weight `[n, k]`, or `[k, n]` when `w_transposed`.
    pub w: MatRef,
    /// Optional bias `[1, n]`.
    pub bias: MatRef,
    /// Output `[m, n]`.
    pub out: MatRef,
    /// Activation applied after the bias.
    pub activation: Activation,
    /// Add the result to `out` instead of overwriting it.
    pub accumulate: bool,
    /// `w` is stored `[k, n]`.
    pub w_transposed: bool,
    /// `w` does not change until its buffer is freed.
    pub w_constant: bool,
    /// Caller-owned scratch of at least `gemm_workspace` bytes.
    pub workspace: BufferSlice,
}

/// Arguments of [`DeviceVTable::layer_norm`] and [`DeviceVTable::rms_norm`].
///
/// Per row of `x` (`[rows, cols]`):
/// layer norm: `out = (x - mean) / sqrt(var + eps) · weight + bias` (biased variance);
/// RMS norm: `out = x / sqrt(mean(x²) + eps) · weight` (`bias` must be [`MatRef::NONE`]).
/// `weight` and `bias` are `[1, cols]`. `out` has `x`'s shape and dtype and may be exactly `x`
/// (in place) but must not otherwise overlap it.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct NormArgs {
    /// Input `[rows, cols]`.
    pub x: MatRef,
    /// Scale `[1, cols]`.
    pub weight: MatRef,
    /// Shift `[1, cols]` (layer norm only; may be absent).
    pub bias: MatRef,
    /// Output `[rows, cols]`.
    pub out: MatRef,
    /// Added to the variance before the square root.
    pub eps: f32,
    /// Caller-owned scratch.
    pub workspace: BufferSlice,
}

/// Arguments of [`DeviceVTable::activation`]: `out = act(x)`, same shape and dtype; `out` may
/// be exactly `x`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct ActivationArgs {
    /// Input.
    pub x: MatRef,
    /// Output.
    pub out: MatRef,
    /// The function (not [`Activation::NONE`]).
    pub activation: Activation,
    /// Caller-owned scratch.
    pub workspace: BufferSlice,
}

/// Arguments of [`DeviceVTable::binary`]: `out = a ∘ b` elementwise, where `b` either has
/// `a`'s shape or is a single row broadcast over every row of `a`. One dtype for all three;
/// `out` may be exactly `a` or exactly `b`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct BinaryArgs {
    /// Left operand `[rows, cols]`.
    pub a: MatRef,
    /// Right operand `[rows, cols]` or `[1, cols]`.
    pub b: MatRef,
    /// Output `[rows, cols]`.
    pub out: MatRef,
    /// Add or multiply.
    pub op: BinaryOp,
    /// Caller-owned scratch.
    pub workspace: BufferSlice,
}

/// Arguments of [`DeviceVTable::rotary`], applied in place to `x`.
///
/// `x` is `[tokens, heads · head_dim]`; `cos` and `sin` are f32 `[tokens, head_dim]` tables
/// (the same for every head). Each head `h` of token `t` becomes
/// `h · cos[t] + rotate_half(h) · sin[t]` with `rotate_half([h1, h2]) = [-h2, h1]` (halves of
/// `head_dim / 2`), computed in f32 and stored in `x`'s dtype. This is the rotary of
/// transformers' `apply_rotary_pos_emb_vision`; the caller computes the tables once per step
/// (Qwen-VL's 2-D positions give `cos = cos(cat(θ, θ))` with `θ` from the row and column
/// frequencies) and reuses them in every layer. `head_dim` is even; the tables must not
/// overlap `x`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct RotaryArgs {
    /// Data, rotated in place.
    pub x: MatRef,
    /// Number of heads in a row of `x`.
    pub heads: u64,
    /// Channels per head.
    pub head_dim: u64,
    /// f32 cosines `[tokens, head_dim]`.
    pub cos: MatRef,
    /// f32 sines `[tokens, head_dim]`.
    pub sin: MatRef,
    /// Caller-owned scratch.
    pub workspace: BufferSlice,
}

/// Arguments of [`DeviceVTable::attention`].
///
/// `q`, `k`, `v` and `out` are `[tokens, heads · head_dim]` (views may have row strides, e.g.
/// into a fused qkv buffer). Tokens are split into independent segments by the segment
/// boundaries `[0, s1, s1 + s2, ..., tokens]` (non-decreasing); within each segment every query
/// attends to every key of the segment (no mask), with `softmax(q·kᵀ · scale) · v` per head.
/// `out` must not overlap `q`, `k` or `v`.
///
/// The boundaries come twice, with the same values: `cu_seqlens` on the host (what aclnn's
/// attention takes, and what the workspace query and the checks read) and
/// `cu_seqlens_device`, an i32 `[1, segments + 1]` vector on the device (what CUDA varlen
/// kernels take), uploaded once per step and reused by every layer. `max_seqlen` is the
/// longest segment.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct AttentionArgs<'a> {
    /// Queries.
    pub q: MatRef,
    /// Keys.
    pub k: MatRef,
    /// Values.
    pub v: MatRef,
    /// Output.
    pub out: MatRef,
    /// Number of heads.
    pub heads: u64,
    /// Channels per head.
    pub head_dim: u64,
    /// Score scale, usually `head_dim^-0.5`.
    pub scale: f32,
    /// Segment boundaries on the host.
    pub cu_seqlens: RSlice<'a, u32>,
    /// The same boundaries on the device, i32.
    pub cu_seqlens_device: MatRef,
    /// Length of the longest segment.
    pub max_seqlen: u64,
    /// Caller-owned scratch of at least `attention_workspace` bytes.
    pub workspace: BufferSlice,
}

/// Arguments of [`DeviceVTable::gather_rows`]: `out[i] = src[indices[i]]` for every `i`.
/// `out` is `[len, cols]`, `src` is `[rows, cols]`, one dtype; `indices` is an i32 `[1, len]`
/// vector on the device; `out` must not overlap `src` or `indices`.
///
/// Indices are device data, so they are not checked when the call is made: the caller
/// guarantees `0 <= indices[i] < src.rows`. A device must never read outside `src` for a bad
/// index; it writes zeros for that row and reports an invalid-argument error where it can
/// detect one.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct GatherArgs {
    /// Source rows.
    pub src: MatRef,
    /// Destination.
    pub out: MatRef,
    /// Row index into `src` for each output row, i32 `[1, len]`.
    pub indices: MatRef,
    /// Caller-owned scratch.
    pub workspace: BufferSlice,
}

/// Arguments of [`DeviceVTable::cast`]: `out = src` converted to `out.dtype` (round to
/// nearest even), same shape; both float dtypes; `out` must not overlap `src` unless both are
/// the same view of the same dtype.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct CastArgs {
    /// Source.
    pub src: MatRef,
    /// Destination.
    pub out: MatRef,
    /// Caller-owned scratch.
    pub workspace: BufferSlice,
}
