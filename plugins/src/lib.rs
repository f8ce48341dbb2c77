//! iris-plugin: the stable ABI between iris and its device plugins.
//!
//! A device plugin is a shared library (`libiris_device_<name>.so`) that iris loads at run time.
//! This crate is everything on both sides of that boundary, and the only crate a plugin author
//! needs (together with `abi_stable`, whose attribute macro exports the root module):
//!
//! - [`abi`]: the FFI-safe types: the root module [`abi::IrisPlugin`], the device function table
//!   [`abi::DeviceVTable`], op argument structs with their contracts, error values with codes,
//!   and the execution model (one in-order queue per device).
//! - [`backend`]: the plugin author's side: implement [`backend::Backend`] in safe Rust and export
//!   it with [`export_plugin!`]; panics are caught at every exported function.
//! - [`validate`]: the argument checks every backend runs before it enqueues work, shared so
//!   that no backend re-implements them.
//! - [`host`]: the host's side: [`host::Plugin`] and [`host::Device`] wrap the tables in calls
//!   that return `Result`, count transfers, and fall back where an older plugin lacks a field.
//! - [`loader`]: finding (`IRIS_PLUGIN_PATH`, config folders, the executable's folder) and loading
//!   libraries, with a typed [`loader::LoadError`] for each failure.
//! - [`conformance`]: one suite of checks run against any device.
//!
//! Versioning: iris's own `major.minor` ([`abi::ABI_MAJOR`], [`abi::ABI_MINOR`]) is checked before
//! abi_stable's recursive layout check. A plugin loads when its major equals the host's and its
//! minor is at least [`abi::ABI_MIN_MINOR`]. Tables grow by appending fields (prefix types).
//!
//! The `abi-2-0` feature builds this crate with minor 0's tables (without the fields minor 1
//! appended). It exists so that tests can build a plugin exactly as one built for 2.0 would be
//! and show that a newer host loads it; never enable it otherwise.

pub mod abi;
pub mod backend;
pub mod conformance;
pub mod host;
pub mod loader;
pub mod validate;

pub use abi::{
    Activation, BinaryOp, BufferHandle, BufferSlice, CopyRegion, DType, ErrorCode, FillArgs,
    MatRef, MemInfo, MemoryReport, OpKind, PluginError,
};
pub use backend::{Backend, Logger};
pub use host::{AsyncWrites, Description, Device, DeviceError, Plugin, Probe};
pub use loader::{LoadError, SearchPath, load_library};

/// Re-exports the generated code of [`export_plugin!`] refers to.
#[doc(hidden)]
pub mod __private {
    pub use abi_stable;
}

/// Exports a plugin from a `cdylib` crate: the ABI version block and the abi_stable root module.
///
/// `probe` is a `fn() -> ProbeResult`; `open` is a
/// `fn(u32, &[(&str, &str)], Logger) -> Result<B, PluginError>` for some [`Backend`] `B`. Both
/// are wrapped so that panics become errors. The macro also defines `pub fn plugin_root()`,
/// which a binary that links the crate uses to register the same plugin without loading a
/// library.
///
/// The plugin crate must depend on `abi_stable` (the root-module attribute refers to it by name).
///
/// ```no_run
/// use iris_plugin::{Backend, Logger};
/// use iris_plugin::abi::{
///     BufferHandle, CopyRegion, DType, DeviceDesc, FillArgs, MemInfo, MemoryReport, PluginError,
///     ProbeResult,
/// };
///
/// /// A device with no memory and no ops: just enough to show the shape of a plugin.
/// struct MyDevice;
///
/// fn no_buffer(op: &str, buf: BufferHandle) -> PluginError {
///     PluginError::invalid_argument(format!("{op}: unknown buffer handle {}", buf.0))
/// }
///
/// impl Backend for MyDevice {
///     fn describe(&self) -> DeviceDesc {
///         DeviceDesc {
///             name: "my device".into(),
///             vendor: "me".into(),
///             total_memory: 0,
///             dtypes: vec![DType::F32, DType::I32].into(),
///             ops: Vec::new().into(),
///             properties: Vec::new().into(),
///         }
///     }
///     fn mem_info(&self) -> Result<MemInfo, PluginError> {
///         Ok(MemInfo { free: 0, total: 0 })
///     }
///     fn memory_report(&self) -> Result<MemoryReport, PluginError> {
///         Ok(MemoryReport::default())
///     }
///     fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
///         Err(PluginError::out_of_memory(format!("alloc: {bytes} bytes, 0 free")))
///     }
///     fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
///         Err(no_buffer("free", buf))
///     }
///     fn write(&self, dst: BufferHandle, _: u64, _: &[u8]) -> Result<(), PluginError> {
///         Err(no_buffer("write", dst))
///     }
///     fn read(&self, src: BufferHandle, _: u64, _: &mut [u8]) -> Result<(), PluginError> {
///         Err(no_buffer("read", src))
///     }
///     fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
///         match regions.first() {
///             Some(region) => Err(no_buffer("copy_batch", region.src)),
///             None => Ok(()),
///         }
///     }
///     fn fill(&self, args: &FillArgs) -> Result<(), PluginError> {
///         Err(no_buffer("fill", args.dst.buf))
///     }
///     fn synchronize(&self) -> Result<(), PluginError> {
///         Ok(())
///     }
/// }
///
/// fn probe() -> ProbeResult {
///     iris_plugin::backend::probe_result(1, "")
/// }
///
/// fn open(_ordinal: u32, _options: &[(&str, &str)], log: Logger) -> Result<MyDevice, PluginError> {
///     log.info("opened");
///     Ok(MyDevice)
/// }
///
/// iris_plugin::export_plugin! {
///     name: "mydev",
///     version: env!("CARGO_PKG_VERSION"),
///     probe: probe,
///     open: open,
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! export_plugin {
    (name: $name:expr, version: $version:expr, probe: $probe:path, open: $open:path $(,)?) => {
        /// iris's ABI version block, read by the host before abi_stable's layout check.
        #[unsafe(no_mangle)]
        #[allow(non_upper_case_globals)]
        pub static iris_plugin_abi_version: $crate::abi::AbiVersion =
            $crate::abi::AbiVersion::CURRENT;

        /// The plugin's root module, for linking the plugin into a binary directly.
        pub fn plugin_root() -> $crate::abi::IrisPluginRef {
            use $crate::__private::abi_stable::prefix_type::WithMetadata;

            extern "C" fn probe_shim() -> $crate::abi::ProbeResult {
                match $crate::backend::catch_panic($probe) {
                    Ok(result) => result,
                    Err(payload) => $crate::backend::probe_result(
                        0,
                        format!(
                            "probe panicked: {}",
                            $crate::backend::panic_message(payload.as_ref())
                        ),
                    ),
                }
            }

            extern "C" fn open_shim(
                ordinal: u32,
                options: $crate::__private::abi_stable::std_types::RSlice<
                    '_,
                    $crate::abi::PluginOption<'_>,
                >,
                log: $crate::abi::LogSink,
            ) -> $crate::__private::abi_stable::std_types::RResult<
                $crate::abi::DeviceInstance,
                $crate::abi::PluginError,
            > {
                $crate::backend::guard("open", || {
                    let pairs = $crate::backend::options_as_pairs(options);
                    $open(ordinal, &pairs, $crate::backend::Logger::new(log))
                        .map($crate::backend::device_instance)
                })
            }

            const MODULE: &WithMetadata<$crate::abi::IrisPlugin> =
                &WithMetadata::new($crate::abi::IrisPlugin {
                    name: $crate::__private::abi_stable::std_types::RStr::from_str($name),
                    version: $crate::__private::abi_stable::std_types::RStr::from_str($version),
                    probe: probe_shim,
                    open: open_shim,
                });
            $crate::abi::IrisPluginRef(
                $crate::__private::abi_stable::prefix_type::PrefixRef::from_ref(MODULE),
            )
        }

        #[::abi_stable::export_root_module]
        fn __iris_export_root_module() -> $crate::abi::IrisPluginRef {
            plugin_root()
        }
    };
}
