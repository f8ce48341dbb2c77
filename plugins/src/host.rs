//! The host's side of the ABI: a loaded [`Plugin`] and an opened [`Device`], with every call
//! returning a Rust `Result`.
//!
//! Whether a plugin was linked in (the built-in CPU device) or loaded from a library, the host
//! talks to it through the same [`IrisPluginRef`] root module and [`DeviceVTableRef`](crate::abi::DeviceVTableRef) table.

use std::fmt;
use std::path::{Path, PathBuf};

use abi_stable::std_types::{RResult, RSlice, RSliceMut, RStr};
use thiserror::Error;

use crate::abi::{
    ABI_MAJOR, ABI_MINOR, ActivationArgs, AttentionArgs, BinaryArgs, BufferHandle, CastArgs,
    CopyRegion, DType, DeviceInstance, ErrorCode, GatherArgs, GemmArgs, IrisPluginRef, MemInfo,
    NormArgs, OpKind, PluginError, PluginOption, Rope2dArgs,
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

    /// How many devices the plugin sees, or why it sees none.
    pub fn probe(&self) -> Probe {
        let probe = (self.module.probe())();
        Probe {
            device_count: probe.device_count,
            reason: probe.reason.into_string(),
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
        match (self.module.open())(ordinal, RSlice::from_slice(&raw)) {
            RResult::ROk(instance) => Ok(Device::new(self.clone(), ordinal, instance)),
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

/// An opened device. Closing happens on drop.
pub struct Device {
    plugin: Plugin,
    ordinal: u32,
    instance: DeviceInstance,
    description: Description,
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
    ($(#[$doc:meta])* $method:ident, $args:ty) => {
        $(#[$doc])*
        pub fn $method(&self, args: &$args) -> Result<(), DeviceError> {
            let result = (self.instance.vtable.$method())(self.instance.ctx, args);
            self.check(stringify!($method), result)
        }
    };
}

impl Device {
    fn new(plugin: Plugin, ordinal: u32, instance: DeviceInstance) -> Device {
        let desc = (instance.vtable.describe())(instance.ctx);
        let description = Description {
            name: desc.name.into_string(),
            vendor: desc.vendor.into_string(),
            total_memory: desc.total_memory,
            dtypes: desc.dtypes.into_iter().collect(),
            ops: desc.ops.into_iter().collect(),
        };
        Device {
            plugin,
            ordinal,
            instance,
            description,
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

    /// `(free, total)` device memory.
    pub fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        let result = (self.instance.vtable.mem_info())(self.instance.ctx);
        self.check("mem_info", result)
    }

    /// Raw device allocation. Core code allocates through its caching allocator instead.
    pub fn alloc(&self, bytes: u64) -> Result<BufferHandle, DeviceError> {
        let result = (self.instance.vtable.alloc())(self.instance.ctx, bytes);
        self.check("alloc", result)
    }

    /// Raw device free.
    pub fn free(&self, buf: BufferHandle) -> Result<(), DeviceError> {
        let result = (self.instance.vtable.free())(self.instance.ctx, buf);
        self.check("free", result)
    }

    /// Host -> device copy of `src` to `dst` at byte `offset`.
    pub fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        let result =
            (self.instance.vtable.write())(self.instance.ctx, dst, offset, RSlice::from_slice(src));
        self.check("write", result)
    }

    /// Device -> host copy into `dst` from `src` at byte `offset`.
    pub fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        let result = (self.instance.vtable.read())(
            self.instance.ctx,
            src,
            offset,
            RSliceMut::from_mut_slice(dst),
        );
        self.check("read", result)
    }

    /// Device -> device copy.
    pub fn copy(
        &self,
        dst: BufferHandle,
        dst_offset: u64,
        src: BufferHandle,
        src_offset: u64,
        bytes: u64,
    ) -> Result<(), DeviceError> {
        let result = (self.instance.vtable.copy())(
            self.instance.ctx,
            dst,
            dst_offset,
            src,
            src_offset,
            bytes,
        );
        self.check("copy", result)
    }

    /// Batched device -> device copy.
    pub fn copy_regions(
        &self,
        dst: BufferHandle,
        src: BufferHandle,
        regions: &[CopyRegion],
    ) -> Result<(), DeviceError> {
        let result = (self.instance.vtable.copy_regions())(
            self.instance.ctx,
            dst,
            src,
            RSlice::from_slice(regions),
        );
        self.check("copy_regions", result)
    }

    /// Waits for all submitted work.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let result = (self.instance.vtable.synchronize())(self.instance.ctx);
        self.check("synchronize", result)
    }

    forward_op!(
        /// See [`GemmArgs`].
        gemm, GemmArgs
    );
    forward_op!(
        /// See [`NormArgs`].
        layer_norm, NormArgs
    );
    forward_op!(
        /// See [`NormArgs`].
        rms_norm, NormArgs
    );
    forward_op!(
        /// See [`ActivationArgs`].
        activation, ActivationArgs
    );
    forward_op!(
        /// See [`BinaryArgs`].
        binary, BinaryArgs
    );
    forward_op!(
        /// See [`Rope2dArgs`].
        rope_2d, Rope2dArgs<'_>
    );
    forward_op!(
        /// See [`AttentionArgs`]; pass a workspace of [`Device::attention_workspace`] bytes.
        attention, AttentionArgs<'_>
    );
    forward_op!(
        /// See [`GatherArgs`].
        gather_rows, GatherArgs<'_>
    );
    forward_op!(
        /// See [`CastArgs`].
        cast, CastArgs
    );

    /// Scratch bytes [`Device::attention`] needs for `args`.
    pub fn attention_workspace(&self, args: &AttentionArgs<'_>) -> Result<u64, DeviceError> {
        let result = (self.instance.vtable.attention_workspace())(self.instance.ctx, args);
        self.check("attention_workspace", result)
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

impl Drop for Device {
    fn drop(&mut self) {
        (self.instance.vtable.close())(self.instance.ctx);
    }
}
