//! The plugin author's side: implement [`Backend`] in safe Rust, export it with
//! [`export_plugin!`](crate::export_plugin), and the ABI shims are generated for you.
//!
//! Every shim catches panics (a panic must never unwind into the host) and turns them into
//! [`ErrorCode::INTERNAL`](crate::abi::ErrorCode::INTERNAL) errors. Ops have default
//! implementations that report "unsupported", so a new backend can start with memory and
//! transfers and add ops one at a time.

use std::any::Any;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};

use abi_stable::prefix_type::{PrefixRef, WithMetadata};
use abi_stable::std_types::{RResult, RSlice, RSliceMut, RString};

use crate::abi::{
    ActivationArgs, AttentionArgs, BinaryArgs, BufferHandle, CastArgs, CopyRegion, DeviceCtx,
    DeviceDesc, DeviceInstance, DeviceVTable, DeviceVTableRef, GatherArgs, GemmArgs, MemInfo,
    NormArgs, PluginError, PluginOption, ProbeResult, Rope2dArgs,
};

/// A device implementation. One value per opened device; it must be usable from any thread.
///
/// Only memory, transfers and the description are required; each op defaults to
/// "unsupported", which the conformance suite reports as such rather than as a failure.
pub trait Backend: Send + Sync + 'static {
    /// Name, vendor, memory, dtypes and implemented ops.
    fn describe(&self) -> DeviceDesc;
    /// `(free, total)` device memory in bytes.
    fn mem_info(&self) -> Result<MemInfo, PluginError>;
    /// Allocates `bytes` of device memory.
    fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError>;
    /// Frees a buffer.
    fn free(&self, buf: BufferHandle) -> Result<(), PluginError>;
    /// Host -> device.
    fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError>;
    /// Device -> host.
    fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError>;
    /// Device -> device.
    fn copy(
        &self,
        dst: BufferHandle,
        dst_offset: u64,
        src: BufferHandle,
        src_offset: u64,
        bytes: u64,
    ) -> Result<(), PluginError>;
    /// Batched device -> device copy. The default issues one [`Backend::copy`] per region.
    fn copy_regions(
        &self,
        dst: BufferHandle,
        src: BufferHandle,
        regions: &[CopyRegion],
    ) -> Result<(), PluginError> {
        for region in regions {
            self.copy(dst, region.dst_offset, src, region.src_offset, region.bytes)?;
        }
        Ok(())
    }
    /// Waits for all submitted work.
    fn synchronize(&self) -> Result<(), PluginError>;

    /// See [`GemmArgs`].
    fn gemm(&self, _args: &GemmArgs) -> Result<(), PluginError> {
        Err(unsupported("gemm"))
    }
    /// See [`NormArgs`].
    fn layer_norm(&self, _args: &NormArgs) -> Result<(), PluginError> {
        Err(unsupported("layer_norm"))
    }
    /// See [`NormArgs`].
    fn rms_norm(&self, _args: &NormArgs) -> Result<(), PluginError> {
        Err(unsupported("rms_norm"))
    }
    /// See [`ActivationArgs`].
    fn activation(&self, _args: &ActivationArgs) -> Result<(), PluginError> {
        Err(unsupported("activation"))
    }
    /// See [`BinaryArgs`].
    fn binary(&self, _args: &BinaryArgs) -> Result<(), PluginError> {
        Err(unsupported("binary"))
    }
    /// See [`Rope2dArgs`].
    fn rope_2d(&self, _args: &Rope2dArgs<'_>) -> Result<(), PluginError> {
        Err(unsupported("rope_2d"))
    }
    /// Scratch bytes for [`Backend::attention`].
    fn attention_workspace(&self, _args: &AttentionArgs<'_>) -> Result<u64, PluginError> {
        Err(unsupported("attention"))
    }
    /// See [`AttentionArgs`].
    fn attention(&self, _args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        Err(unsupported("attention"))
    }
    /// See [`GatherArgs`].
    fn gather_rows(&self, _args: &GatherArgs<'_>) -> Result<(), PluginError> {
        Err(unsupported("gather_rows"))
    }
    /// See [`CastArgs`].
    fn cast(&self, _args: &CastArgs) -> Result<(), PluginError> {
        Err(unsupported("cast"))
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

/// Runs `f`, turning a panic into an [`ErrorCode::INTERNAL`](crate::abi::ErrorCode::INTERNAL)
/// error. Use it in every hand-written `extern "C"` function of a plugin.
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, PluginError>) -> RResult<T, PluginError> {
    match catch_unwind(AssertUnwindSafe(f)) {
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

fn unsupported(op: &str) -> PluginError {
    PluginError::unsupported(format!("op `{op}` is not implemented by this device"))
}

/// # Safety
/// `ctx` must come from [`device_instance::<B>`] and not have been closed.
unsafe fn backend<'a, B: Backend>(ctx: DeviceCtx) -> &'a B {
    // SAFETY: by the caller's contract `ctx.0` is a live `Box<B>` leaked by `device_instance`.
    unsafe { &*ctx.0.cast::<B>() }
}

struct VTableFor<B>(std::marker::PhantomData<B>);

// Each shim recovers the backend and forwards under `guard`. The host only calls these with a
// `ctx` produced by `device_instance::<B>` for the same `B` (it travels with this vtable), and
// never after `close`.
impl<B: Backend> VTableFor<B> {
    const WM: &'static WithMetadata<DeviceVTable> = &WithMetadata::new(DeviceVTable {
        describe: Self::describe,
        mem_info: Self::mem_info,
        alloc: Self::alloc,
        free: Self::free,
        write: Self::write,
        read: Self::read,
        copy: Self::copy,
        copy_regions: Self::copy_regions,
        synchronize: Self::synchronize,
        gemm: Self::gemm,
        layer_norm: Self::layer_norm,
        rms_norm: Self::rms_norm,
        activation: Self::activation,
        binary: Self::binary,
        rope_2d: Self::rope_2d,
        attention_workspace: Self::attention_workspace,
        attention: Self::attention,
        gather_rows: Self::gather_rows,
        cast: Self::cast,
        close: Self::close,
    });

    const VTABLE: DeviceVTableRef = DeviceVTableRef(PrefixRef::from_ref(Self::WM));

    extern "C" fn describe(ctx: DeviceCtx) -> DeviceDesc {
        // SAFETY: see the impl comment.
        let dev = unsafe { backend::<B>(ctx) };
        match catch_unwind(AssertUnwindSafe(|| dev.describe())) {
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
            },
        }
    }

    extern "C" fn mem_info(ctx: DeviceCtx) -> RResult<MemInfo, PluginError> {
        // SAFETY: see the impl comment.
        guard("mem_info", || unsafe { backend::<B>(ctx) }.mem_info())
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

    extern "C" fn copy(
        ctx: DeviceCtx,
        dst: BufferHandle,
        dst_offset: u64,
        src: BufferHandle,
        src_offset: u64,
        bytes: u64,
    ) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("copy", || {
            unsafe { backend::<B>(ctx) }.copy(dst, dst_offset, src, src_offset, bytes)
        })
    }

    extern "C" fn copy_regions(
        ctx: DeviceCtx,
        dst: BufferHandle,
        src: BufferHandle,
        regions: RSlice<'_, CopyRegion>,
    ) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("copy_regions", || {
            unsafe { backend::<B>(ctx) }.copy_regions(dst, src, regions.as_slice())
        })
    }

    extern "C" fn synchronize(ctx: DeviceCtx) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("synchronize", || unsafe { backend::<B>(ctx) }.synchronize())
    }

    extern "C" fn gemm(ctx: DeviceCtx, args: &GemmArgs) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("gemm", || unsafe { backend::<B>(ctx) }.gemm(args))
    }

    extern "C" fn layer_norm(ctx: DeviceCtx, args: &NormArgs) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("layer_norm", || {
            unsafe { backend::<B>(ctx) }.layer_norm(args)
        })
    }

    extern "C" fn rms_norm(ctx: DeviceCtx, args: &NormArgs) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("rms_norm", || unsafe { backend::<B>(ctx) }.rms_norm(args))
    }

    extern "C" fn activation(ctx: DeviceCtx, args: &ActivationArgs) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("activation", || {
            unsafe { backend::<B>(ctx) }.activation(args)
        })
    }

    extern "C" fn binary(ctx: DeviceCtx, args: &BinaryArgs) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("binary", || unsafe { backend::<B>(ctx) }.binary(args))
    }

    extern "C" fn rope_2d(ctx: DeviceCtx, args: &Rope2dArgs<'_>) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("rope_2d", || unsafe { backend::<B>(ctx) }.rope_2d(args))
    }

    extern "C" fn attention_workspace(
        ctx: DeviceCtx,
        args: &AttentionArgs<'_>,
    ) -> RResult<u64, PluginError> {
        // SAFETY: see the impl comment.
        guard("attention_workspace", || {
            unsafe { backend::<B>(ctx) }.attention_workspace(args)
        })
    }

    extern "C" fn attention(ctx: DeviceCtx, args: &AttentionArgs<'_>) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("attention", || unsafe { backend::<B>(ctx) }.attention(args))
    }

    extern "C" fn gather_rows(ctx: DeviceCtx, args: &GatherArgs<'_>) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("gather_rows", || {
            unsafe { backend::<B>(ctx) }.gather_rows(args)
        })
    }

    extern "C" fn cast(ctx: DeviceCtx, args: &CastArgs) -> RResult<(), PluginError> {
        // SAFETY: see the impl comment.
        guard("cast", || unsafe { backend::<B>(ctx) }.cast(args))
    }

    extern "C" fn close(ctx: DeviceCtx) {
        // SAFETY: `ctx` is the `Box<B>` leaked by `device_instance`; the host calls `close`
        // exactly once and never uses `ctx` afterwards.
        let boxed = unsafe { Box::from_raw(ctx.0.cast::<B>()) };
        // A panicking destructor must not unwind into the host; the state is gone either way.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(boxed)));
    }
}
