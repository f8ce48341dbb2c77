//! The FFI-safe types that cross the plugin boundary.
//!
//! Everything here is `#[repr(C)]` and derives [`StableAbi`], so abi_stable can compare the
//! host's and the plugin's layouts when a library is loaded. Rules that keep the ABI stable:
//!
//! - Tables that will grow ([`IrisPlugin`], [`DeviceVTable`]) are prefix types: new fields are
//!   appended after the last one, never inserted, and the host reads them through the `Option`
//!   accessors abi_stable generates, so an older plugin still loads.
//! - Closed sets that may gain members (dtypes, op kinds, error codes, activations) are newtypes
//!   over integers with associated constants, not Rust enums: an unknown value is an error a
//!   plugin can report, not a layout change.
//! - Argument structs of ops never change once released; an op that needs new parameters gets a
//!   new function appended to the vtable.
//! - Host data crosses only as borrowed slices ([`RSlice`], [`RSliceMut`]) valid for one call.
//!   Device memory is opaque: a [`BufferHandle`] is an integer the plugin gave out.

use std::ffi::c_void;
use std::fmt;

use abi_stable::StableAbi;
use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RResult, RSlice, RSliceMut, RStr, RString, RVec};

/// iris's own ABI major version. A plugin loads only if its major equals the host's.
pub const ABI_MAJOR: u32 = 1;
/// iris's own ABI minor version, bumped whenever a field or function is appended.
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
#[sabi(missing_field(panic))]
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
    #[sabi(last_prefix_field)]
    pub open: extern "C" fn(
        ordinal: u32,
        options: RSlice<'_, PluginOption<'_>>,
    ) -> RResult<DeviceInstance, PluginError>,
}

impl RootModule for IrisPluginRef {
    abi_stable::declare_root_module_statics! {IrisPluginRef}
    const BASE_NAME: &'static str = "iris_device";
    const NAME: &'static str = "iris device plugin";
    // iris's own major/minor check runs before this one; abi_stable's version gate is pinned to
    // the ABI major so it never disagrees with ours.
    const VERSION_STRINGS: VersionStrings = VersionStrings::new("1.0.0");
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
/// synchronises its own state. The host never frees a buffer while an op that uses it is
/// running, and orders calls that touch the same buffer.
///
/// Errors: every function returns a [`PluginError`]; no function panics across the boundary
/// (plugins catch unwinding and report [`ErrorCode::INTERNAL`]).
///
/// Ops validate their arguments (known buffers, byte ranges inside them, shapes that agree,
/// supported dtypes) and report [`ErrorCode::INVALID_ARGUMENT`] naming the argument; an op the
/// device does not implement reports [`ErrorCode::UNSUPPORTED`], and must not be listed in
/// [`DeviceDesc::ops`].
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = DeviceVTableRef)))]
#[sabi(missing_field(panic))]
pub struct DeviceVTable {
    /// Name, vendor, memory, dtypes and ops of the device.
    pub describe: extern "C" fn(DeviceCtx) -> DeviceDesc,
    /// `(free, total)` bytes as the driver sees them.
    pub mem_info: extern "C" fn(DeviceCtx) -> RResult<MemInfo, PluginError>,
    /// Allocates `bytes` (> 0) of device memory; [`ErrorCode::OUT_OF_MEMORY`] when it cannot.
    pub alloc: extern "C" fn(DeviceCtx, bytes: u64) -> RResult<BufferHandle, PluginError>,
    /// Frees a buffer returned by `alloc`. Freeing an unknown handle is an invalid argument.
    pub free: extern "C" fn(DeviceCtx, BufferHandle) -> RResult<(), PluginError>,
    /// Host -> device: copies `src` into `dst` at byte `offset`.
    pub write: extern "C" fn(
        DeviceCtx,
        dst: BufferHandle,
        offset: u64,
        src: RSlice<'_, u8>,
    ) -> RResult<(), PluginError>,
    /// Device -> host: fills `dst` from `src` at byte `offset`. Completes before returning.
    pub read: extern "C" fn(
        DeviceCtx,
        src: BufferHandle,
        offset: u64,
        dst: RSliceMut<'_, u8>,
    ) -> RResult<(), PluginError>,
    /// Device -> device: copies `bytes` from `src` at `src_offset` to `dst` at `dst_offset`.
    /// Overlapping ranges within one buffer are an invalid argument.
    pub copy: extern "C" fn(
        DeviceCtx,
        dst: BufferHandle,
        dst_offset: u64,
        src: BufferHandle,
        src_offset: u64,
        bytes: u64,
    ) -> RResult<(), PluginError>,
    /// Batched device -> device copy of many regions from `src` to `dst` (may be the same
    /// buffer if no destination region overlaps any source region).
    pub copy_regions: extern "C" fn(
        DeviceCtx,
        dst: BufferHandle,
        src: BufferHandle,
        regions: RSlice<'_, CopyRegion>,
    ) -> RResult<(), PluginError>,
    /// Waits until all work submitted to the device has finished.
    pub synchronize: extern "C" fn(DeviceCtx) -> RResult<(), PluginError>,
    /// `out = act(a · Wᵀ + bias) (+ out if accumulate)`; see [`GemmArgs`].
    pub gemm: extern "C" fn(DeviceCtx, &GemmArgs) -> RResult<(), PluginError>,
    /// Layer normalisation over each row; see [`NormArgs`].
    pub layer_norm: extern "C" fn(DeviceCtx, &NormArgs) -> RResult<(), PluginError>,
    /// RMS normalisation over each row; see [`NormArgs`].
    pub rms_norm: extern "C" fn(DeviceCtx, &NormArgs) -> RResult<(), PluginError>,
    /// Elementwise activation; see [`ActivationArgs`].
    pub activation: extern "C" fn(DeviceCtx, &ActivationArgs) -> RResult<(), PluginError>,
    /// Elementwise add or multiply; see [`BinaryArgs`].
    pub binary: extern "C" fn(DeviceCtx, &BinaryArgs) -> RResult<(), PluginError>,
    /// 2-D rotary position embedding, in place; see [`Rope2dArgs`].
    pub rope_2d: extern "C" fn(DeviceCtx, &Rope2dArgs) -> RResult<(), PluginError>,
    /// Scratch bytes `attention` needs for these arguments. The answer depends only on shapes,
    /// dtypes, `heads`, `head_dim` and the device's own settings: buffer handles (and the
    /// `workspace` field) are not read and may be null, so a caller can size the workspace
    /// before any operand exists.
    pub attention_workspace: extern "C" fn(DeviceCtx, &AttentionArgs) -> RResult<u64, PluginError>,
    /// Variable-length, non-causal multi-head attention; see [`AttentionArgs`].
    pub attention: extern "C" fn(DeviceCtx, &AttentionArgs) -> RResult<(), PluginError>,
    /// Row gather; see [`GatherArgs`].
    pub gather_rows: extern "C" fn(DeviceCtx, &GatherArgs) -> RResult<(), PluginError>,
    /// Dtype conversion; see [`CastArgs`].
    pub cast: extern "C" fn(DeviceCtx, &CastArgs) -> RResult<(), PluginError>,
    /// Releases the device. Buffers still allocated are freed by the plugin; the host frees
    /// everything it allocated before closing, so this is a safety net, not a contract.
    #[sabi(last_prefix_field)]
    pub close: extern "C" fn(DeviceCtx),
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

/// Device memory as the driver reports it.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
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
    /// Storage dtypes the ops accept.
    pub dtypes: RVec<DType>,
    /// Ops implemented; the others return [`ErrorCode::UNSUPPORTED`].
    pub ops: RVec<OpKind>,
}

/// One region of a batched copy, in bytes.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRegion {
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Length in bytes.
    pub bytes: u64,
}

/// Element type of device data. Compute happens in f32 whatever the storage type.
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
    /// Every dtype this ABI version defines.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element, or `None` for a value this ABI version does not define.
    pub fn size(self) -> Option<u64> {
        match self {
            DType::F32 => Some(4),
            DType::F16 | DType::BF16 => Some(2),
            _ => None,
        }
    }

    /// Lower-case name (`f32`, `f16`, `bf16`), or `None` for an unknown value.
    pub fn name(self) -> Option<&'static str> {
        match self {
            DType::F32 => Some("f32"),
            DType::F16 => Some("f16"),
            DType::BF16 => Some("bf16"),
            _ => None,
        }
    }

    /// Parses a name as written by [`DType::name`] (also `float32`, `float16`, `bfloat16`).
    pub fn parse(name: &str) -> Option<DType> {
        match name {
            "f32" | "float32" => Some(DType::F32),
            "f16" | "float16" => Some(DType::F16),
            "bf16" | "bfloat16" => Some(DType::BF16),
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
    /// [`DeviceVTable::rope_2d`].
    pub const ROPE_2D: OpKind = OpKind(5);
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
        OpKind::ROPE_2D,
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
            OpKind::ROPE_2D => "rope_2d",
            OpKind::ATTENTION => "attention",
            OpKind::GATHER_ROWS => "gather_rows",
            OpKind::CAST => "cast",
            _ => return None,
        })
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
/// v parts of a fused qkv projection, say) without copying.
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

/// Arguments of [`DeviceVTable::gemm`].
///
/// Computes `out[m, n] = act(Σ_k a[m, k] · w[n, k] + bias[n])`, then, when `accumulate` is set,
/// adds the previous contents of `out` (a residual connection). With `w_transposed` set, `w` is
/// stored as `[k, n]` instead of `[n, k]` (PyTorch's `Linear.weight` is `[n, k]`).
///
/// Shapes: `a` is `[m, k]`; `w` is `[n, k]` (or `[k, n]`); `bias` is [`MatRef::NONE`] or
/// `[1, n]`; `out` is `[m, n]`. All operands share one dtype. `out` must not overlap `a`, `w`
/// or `bias`.
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
    /// The function.
    pub activation: Activation,
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
}

/// Arguments of [`DeviceVTable::rope_2d`], applied in place to `x`.
///
/// `x` is `[tokens, heads · head_dim]`; `positions` holds `(row, col)` for each token, so its
/// length is `2 · tokens`. `head_dim` is a multiple of 4. With `q = head_dim / 4` frequencies
/// `f_i = theta^(-i/q)`, channel `c < head_dim/2` of each head gets angle
/// `row · f_c` for `c < q` and `col · f_{c-q}` for `q <= c < 2q`; channels `c` and
/// `c + head_dim/2` rotate together: `x' = x · cos + rotate_half(x) · sin` with
/// `rotate_half([x1, x2]) = [-x2, x1]` (Qwen-VL's vision rotary). Angles are computed in f32.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct Rope2dArgs<'a> {
    /// Data, rotated in place.
    pub x: MatRef,
    /// Number of heads in a row of `x`.
    pub heads: u64,
    /// Channels per head.
    pub head_dim: u64,
    /// `(row, col)` per token.
    pub positions: RSlice<'a, u32>,
    /// Rotary base, 10000 for Qwen-VL.
    pub theta: f32,
}

/// Arguments of [`DeviceVTable::attention`].
///
/// `q`, `k`, `v` and `out` are `[tokens, heads · head_dim]` (views may have row strides, e.g.
/// into a fused qkv buffer). Tokens are split into independent segments by `cu_seqlens`
/// (`[0, s1, s1 + s2, ..., tokens]`, non-decreasing); within each segment every query attends to
/// every key of the segment (no mask), with `softmax(q·kᵀ · scale) · v` per head. `out` must not
/// overlap `q`, `k` or `v`. Scratch: [`DeviceVTable::attention_workspace`] bytes at
/// `workspace`, which the caller owns.
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
    /// Segment boundaries.
    pub cu_seqlens: RSlice<'a, u32>,
    /// Caller-owned scratch (`bytes` may be 0 when the query returned 0).
    pub workspace: BufferSlice,
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

/// Arguments of [`DeviceVTable::gather_rows`]: `out[i] = src[indices[i]]` for every `i`.
/// `out` is `[indices.len(), cols]`, `src` is `[rows, cols]`, one dtype; every index is below
/// `src.rows`; `out` must not overlap `src`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct GatherArgs<'a> {
    /// Source rows.
    pub src: MatRef,
    /// Destination.
    pub out: MatRef,
    /// Row index into `src` for each output row.
    pub indices: RSlice<'a, u32>,
}

/// Arguments of [`DeviceVTable::cast`]: `out = src` converted to `out.dtype` (round to
/// nearest even), same shape; `out` must not overlap `src` unless both are the same view of the
/// same dtype.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct CastArgs {
    /// Source.
    pub src: MatRef,
    /// Destination.
    pub out: MatRef,
}
