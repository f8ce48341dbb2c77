//! The Ascend device: description, memory, transfers, the queue, and the entry of every op.
//! Ops live in [`crate::ops`], buffers in [`crate::memory`], the options in
//! [`crate::options`], the SoC families' rules in [`crate::soc`], the op-support table in
//! [`crate::support`] and the description's properties in [`crate::properties`].
//!
//! Every entry point takes the device's lock and makes its context current on the calling
//! thread (the host may call from any thread; AscendCL binds contexts to threads), then checks
//! its arguments with [`iris_plugin::validate`] before enqueueing anything.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use iris_plugin::Logger;
use iris_plugin::abi::{
    ActivationArgs, AttentionArgs, BinaryArgs, BufferHandle, BufferSlice, CastArgs, CopyRegion,
    DType, DeviceDesc, FillArgs, GatherArgs, GemmArgs, HeldMemory, HostAlloc, HostBufferId, MatRef,
    MemInfo, MemoryReport, NormArgs, OpKind, PluginError, Property, RotaryArgs, StagedCopy,
};
use iris_plugin::validate::{self, Checker, Mat};

use crate::error::AscendError;
use crate::memory::{DeviceBlock, DeviceMalloc, MemKind, Memory, mem_info};
use crate::ops::attention::Path;
use crate::ops::elementwise::ByteCopy;
use crate::ops::{self, Exec, Requirement, elementwise};
use crate::options::{AscendOptions, AttentionMode};
use crate::properties::properties;
use crate::runtime::Runtime;
use crate::soc::Family;
use crate::stream::{Context, DeviceBinding, Event, Stream, offset_ptr};
use crate::support::supported_ops;
use crate::sys;

/// Workspace requirements remembered per call shape; beyond this many the memo starts over.
const REQUIREMENT_MEMO: usize = 4096;
/// Size of the block descriptors point at while a workspace is sized.
const SIZING_BYTES: u64 = 512;
/// `aclrtMemcpyAsync` between device addresses wants both 64-byte aligned (`acl_rt.h`).
const D2D_ALIGN: usize = 64;

struct State {
    memory: Memory,
    fences: std::collections::BTreeMap<u64, Event>,
    next_fence: u64,
    /// An error of queued work seen outside `synchronize` (while waiting to retry an
    /// allocation), reported by the next `synchronize` or `read`.
    deferred: Option<AscendError>,
    requirements: HashMap<String, (Requirement, Path)>,
    /// Why the device cannot be used any more (its stream could not be rebuilt after a task
    /// fault); every later call fails with it.
    lost: Option<String>,
}

/// One opened NPU.
pub struct AscendDevice {
    rt: &'static Runtime,
    ordinal: u32,
    soc: String,
    family: Family,
    options: AscendOptions,
    total: u64,
    held: Vec<HeldMemory>,
    dtypes: Vec<DType>,
    ops: Vec<OpKind>,
    unsupported: HashMap<OpKind, String>,
    properties: Vec<Property>,
    log: Logger,
    // Drop order is CANN's teardown order: buffers and events, the stream, the context, the
    // device binding.
    /// The address every descriptor points at while a workspace is sized (see `ops`).
    sizing: DeviceBlock,
    state: Mutex<State>,
    stream: Stream,
    context: Context,
    binding: DeviceBinding,
}

impl AscendDevice {
    /// Opens device `ordinal` (an index among the NPUs the runtime shows).
    pub fn open(
        rt: &'static Runtime,
        ordinal: u32,
        options: AscendOptions,
        log: Logger,
    ) -> Result<AscendDevice, AscendError> {
        let id = i32::try_from(ordinal)
            .map_err(|_| AscendError::Internal(format!("ordinal {ordinal} is too large")))?;
        let binding = DeviceBinding::acquire(rt, id)?;
        let kind = MemKind::detect(rt)?;
        let before = mem_info(rt, kind)?;
        let context = Context::create(rt, &binding)?;
        let stream = Stream::create(rt, &context)?;
        let opened = mem_info(rt, kind)?;
        let mut memory = Memory::new(rt, kind);
        // Nothing is queued yet: no wait, and no failure of earlier work to keep.
        let sizing = memory.transient(SIZING_BYTES, &stream, &mut None)?;
        let after = mem_info(rt, kind)?;
        let soc = rt.soc_name().unwrap_or_else(|| "Ascend NPU".to_owned());
        let family = Family::of(&soc);
        // Asked for by name on a part documented without them, the fused kernels would fail
        // at every attention call with ACL's error, which does not name the option. (An
        // unknown part may have them: `Other` is let through.)
        if options.attention == AttentionMode::Fused
            && matches!(family, Family::Training910 | Family::Inference310P)
        {
            return Err(AscendError::Unsupported {
                op: "open",
                reason: format!(
                    "option `attention = \"fused\"`: {soc} has no fused attention kernels (aclnnFlashAttentionVarLenScore is documented for Atlas A2 and A3); use `auto` or `composed`"
                ),
            });
        }
        let (ops, unsupported) = supported_ops(rt, family);
        let mut dtypes = vec![DType::F32, DType::F16];
        if family.bf16() {
            dtypes.push(DType::BF16);
        }
        dtypes.extend([DType::I32, DType::U8]);
        // Other processes may allocate meanwhile: these are the device's own figures, as near
        // as the driver lets the plugin measure them.
        let held_context = before.free.saturating_sub(opened.free);
        let held_sizing = opened.free.saturating_sub(after.free);
        let held = vec![
            HeldMemory {
                what: "context and stream".into(),
                bytes: held_context,
            },
            HeldMemory {
                what: "workspace sizing address".into(),
                bytes: held_sizing,
            },
        ];
        let properties = properties(rt, &soc, kind, memory.device_malloc(), &options);
        log.info(format!(
            "opened NPU {ordinal} ({soc}): {} of {} bytes of {} free; runtime {}; context and stream hold {held_context} bytes; device blocks from {}",
            after.free,
            after.total,
            kind.name(),
            rt.acl_path().display(),
            memory.device_malloc().name()
        ));
        if !rt.skipped().is_empty() {
            log.warn(format!(
                "skipped CANN's link stubs (100039 from aclInit) before the runtime {}: {}",
                rt.acl_path().display(),
                rt.skipped().join(", ")
            ));
        }
        if memory.device_malloc() == DeviceMalloc::Padded {
            log.warn(
                "the runtime has no aclrtMallocAlign32: aclrtMalloc pads every block with 32 bytes, so each allocator segment of whole huge pages takes one more huge page (reported as held memory)",
            );
        }
        for (op, reason) in &unsupported {
            log.debug(format!("{op} unsupported: {reason}"));
        }
        Ok(AscendDevice {
            rt,
            ordinal,
            soc,
            family,
            options,
            total: after.total,
            held,
            dtypes,
            ops,
            unsupported,
            properties,
            log,
            sizing,
            state: Mutex::new(State {
                memory,
                fences: std::collections::BTreeMap::new(),
                next_fence: 1,
                deferred: None,
                requirements: HashMap::new(),
                lost: None,
            }),
            stream,
            context,
            binding,
        })
    }

    /// The part's family.
    pub fn family(&self) -> Family {
        self.family
    }

    /// Takes the device's lock and makes its context current on this thread. A task fault
    /// met since the last call is recovered from first (see [`AscendDevice::recover`]) and
    /// kept for the next `synchronize`, which reports it once.
    fn lock(&self) -> Result<MutexGuard<'_, State>, PluginError> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| PluginError::internal("the device's lock is poisoned"))?;
        if let Some(reason) = &state.lost {
            return Err(PluginError::unavailable(reason.clone()));
        }
        self.context.make_current()?;
        if let Some(fault) = self.stream.take_fault() {
            self.recover(&mut state, &fault)?;
            state.deferred.get_or_insert(fault);
        }
        Ok(state)
    }

    /// The outcome of a wait on the stream: a task fault met by it (or noted since the last
    /// call) is recovered from at once and is this call's error, reported once.
    fn settle(
        &self,
        state: &mut State,
        waited: Result<(), AscendError>,
    ) -> Result<(), PluginError> {
        if let Some(fault) = self.stream.take_fault() {
            self.recover(state, &fault)?;
            if state.deferred.as_ref() == Some(&fault) {
                state.deferred = None;
            }
            return Err(fault.into());
        }
        Ok(waited?)
    }

    /// After a task fault: the stream stays in error on the NPU, so it is replaced, which
    /// drops the work queued on it; the blocks waiting for that work are released and the
    /// fences recorded on it are done. When no new stream can be made, the device is marked
    /// lost and every later call fails with the reason.
    fn recover(&self, state: &mut State, fault: &AscendError) -> Result<(), PluginError> {
        state.fences.clear();
        match self.stream.rebuild(&self.context) {
            Ok(not_destroyed) => {
                if let Some(err) = not_destroyed {
                    self.log.warn(format!(
                        "NPU {}: the stream in error could not be destroyed ({err}); a new one serves, and the old one is destroyed again at close",
                        self.ordinal
                    ));
                }
                state.memory.reap_all();
                self.log.warn(format!(
                    "NPU {}: a kernel fault left the stream in error ({fault}); the stream was rebuilt and the work queued on it dropped",
                    self.ordinal
                ));
                Ok(())
            }
            Err(err) => {
                let reason = format!(
                    "NPU {} is unusable: after a kernel fault ({fault}) its stream could not be rebuilt: {err}",
                    self.ordinal
                );
                self.log.warn(&reason);
                state.lost = Some(reason.clone());
                Err(PluginError::unavailable(reason))
            }
        }
    }

    fn require(&self, op: OpKind) -> Result<(), PluginError> {
        match self.unsupported.get(&op) {
            Some(reason) => Err(PluginError::unsupported(format!("{op}: {reason}"))),
            None => Ok(()),
        }
    }

    fn require_dtype(&self, op: &str, dtype: DType) -> Result<(), PluginError> {
        if self.dtypes.contains(&dtype) {
            Ok(())
        } else {
            Err(PluginError::unsupported(format!(
                "{op}: dtype {dtype} is not supported on {}",
                self.soc
            )))
        }
    }

    /// The workspace an op needs, measured once per call shape. Measured twice: with the
    /// caller's handles and with distinct ones, so that the answer holds whichever operands
    /// alias when the op runs.
    fn requirement<A: Handles, C>(
        &self,
        state: &mut State,
        name: &'static str,
        args: &A,
        check: &dyn Fn(&Checker<'_>, &A) -> Result<C, PluginError>,
        paths: &dyn Fn(&C) -> Vec<Path>,
        body: &dyn Fn(&mut Exec<'_>, &C, Path) -> Result<(), AscendError>,
    ) -> Result<(Requirement, Path), PluginError> {
        let key = requirement_key(name, args);
        if let Some(found) = state.requirements.get(&key) {
            return Ok(*found);
        }
        let shapes = Checker::shapes_only(name);
        let given = check(&shapes, args)?;
        let mut next = 0u64;
        let distinct_args = args.map_mats(&mut |m| {
            let buf = if m.buf.0 == 0 {
                0
            } else {
                next += 1;
                next
            };
            MatRef {
                buf: BufferHandle(buf),
                ..*m
            }
        });
        let distinct = check(&shapes, &distinct_args)?;
        let candidates = paths(&given);
        let mut last = None;
        for path in candidates {
            let mut a = Exec::measure(self.rt, self.sizing.ptr());
            let mut b = Exec::measure(self.rt, self.sizing.ptr());
            let measured = body(&mut a, &given, path).and_then(|()| body(&mut b, &distinct, path));
            match measured {
                Ok(()) => {
                    let (ra, rb) = (a.requirement(), b.requirement());
                    let req = Requirement {
                        scratch: ra.scratch.max(rb.scratch),
                        aclnn: ra.aclnn.max(rb.aclnn),
                    };
                    if state.requirements.len() >= REQUIREMENT_MEMO {
                        state.requirements.clear();
                    }
                    state.requirements.insert(key, (req, path));
                    return Ok((req, path));
                }
                Err(err) => {
                    self.log
                        .debug(format!("{name}: {path:?} cannot run this call: {err}"));
                    last = Some(err);
                }
            }
        }
        Err(last.map_or_else(
            || PluginError::unsupported(format!("{name}: no implementation for this call")),
            PluginError::from,
        ))
    }

    /// The common path of every op: support, arguments, workspace, run (or, without a
    /// workspace, the query's answer).
    #[allow(clippy::too_many_arguments)]
    fn op<A: Handles, C>(
        &self,
        kind: OpKind,
        name: &'static str,
        args: &A,
        workspace: Option<&BufferSlice>,
        check: &dyn Fn(&Checker<'_>, &A) -> Result<C, PluginError>,
        dtype: &dyn Fn(&C) -> DType,
        operands: &dyn Fn(&C) -> Vec<(&'static str, Mat)>,
        paths: &dyn Fn(&C) -> Vec<Path>,
        body: &dyn Fn(&mut Exec<'_>, &C, Path) -> Result<(), AscendError>,
    ) -> Result<u64, PluginError> {
        self.require(kind)?;
        let mut state = self.lock()?;
        let checked = match workspace {
            None => check(&Checker::shapes_only(name), args)?,
            Some(_) => {
                let lens = |buf: BufferHandle| state.memory.len_of(buf);
                check(&Checker::new(name, &lens), args)?
            }
        };
        self.require_dtype(name, dtype(&checked))?;
        let (req, path) = self.requirement(&mut state, name, args, check, paths, body)?;
        let Some(ws) = workspace else {
            return Ok(req.total());
        };
        let lens = |buf: BufferHandle| state.memory.len_of(buf);
        let named = operands(&checked);
        let refs: Vec<(&str, &Mat)> = named.iter().map(|(n, m)| (*n, m)).collect();
        Checker::new(name, &lens).workspace(ws, req.total(), &refs)?;
        let base: *mut c_void = if req.total() == 0 {
            std::ptr::null_mut()
        } else {
            offset_ptr(state.memory.base(ws.buf), ws.offset)
        };
        let mut exec = Exec::run(self.rt, &state.memory, self.stream.raw(), base, req);
        body(&mut exec, &checked, path)?;
        Ok(0)
    }

    /// Runs an op outside the caller's workspace (copies, fills): its workspace, if any, is
    /// a transient block released once the op is done.
    fn scratch_op(
        &self,
        state: &mut State,
        body: &dyn Fn(&mut Exec<'_>) -> Result<(), AscendError>,
    ) -> Result<(), PluginError> {
        let mut measure = Exec::measure(self.rt, self.sizing.ptr());
        body(&mut measure)?;
        let req = measure.requirement();
        let scratch = if req.total() > 0 {
            let State {
                memory, deferred, ..
            } = &mut *state;
            Some(memory.transient(req.total(), &self.stream, deferred)?)
        } else {
            None
        };
        let base = scratch
            .as_ref()
            .map_or(std::ptr::null_mut(), DeviceBlock::ptr);
        let result = {
            let mut exec = Exec::run(self.rt, &state.memory, self.stream.raw(), base, req);
            body(&mut exec)
        };
        if let Some(block) = scratch {
            state.memory.retire(block, &self.stream)?;
        }
        Ok(result?)
    }

    fn attention_paths(&self, a: &validate::Attention) -> Vec<Path> {
        let fused_ok =
            self.family.fused_transformer_ops() && matches!(a.q.dtype, DType::F16 | DType::BF16);
        match self.options.attention {
            AttentionMode::Fused => vec![Path::Fused],
            AttentionMode::Composed => vec![Path::Composed],
            AttentionMode::Auto if fused_ok => vec![Path::Fused, Path::Composed],
            AttentionMode::Auto => vec![Path::Composed],
        }
    }

    fn rotary_paths(&self) -> Vec<Path> {
        // The fused op's first phase reports a missing symbol or a refused shape; the
        // composed path then runs.
        if !self.family.fused_transformer_ops() {
            vec![Path::Composed]
        } else {
            vec![Path::Fused, Path::Composed]
        }
    }

    fn device_range(
        &self,
        state: &State,
        op: &'static str,
        name: &str,
        buf: BufferHandle,
        offset: u64,
        len: u64,
    ) -> Result<(), PluginError> {
        let lens = |b: BufferHandle| state.memory.len_of(b);
        validate::range(&Checker::new(op, &lens), name, buf, offset, len)
    }

    fn host_range(
        state: &State,
        op: &'static str,
        id: HostBufferId,
        offset: u64,
        bytes: u64,
    ) -> Result<*mut c_void, PluginError> {
        let Some((ptr, len)) = state.memory.host(id) else {
            return Err(PluginError::invalid_argument(format!(
                "{op}: unknown host buffer {}",
                id.0
            )));
        };
        match offset.checked_add(bytes) {
            Some(end) if end <= len => Ok(offset_ptr(ptr, offset)),
            _ => Err(PluginError::invalid_argument(format!(
                "{op}: host bytes [{offset}, {offset}+{bytes}) lie outside the host buffer of {len} bytes"
            ))),
        }
    }
}

impl iris_plugin::Backend for AscendDevice {
    fn describe(&self) -> DeviceDesc {
        DeviceDesc {
            name: self.soc.clone().into(),
            vendor: "Huawei".into(),
            total_memory: self.total,
            dtypes: self.dtypes.clone().into(),
            ops: self.ops.clone().into(),
            properties: self.properties.clone().into(),
        }
    }

    fn mem_info(&self) -> Result<MemInfo, PluginError> {
        let mut state = self.lock()?;
        Ok(state.memory.mem_info()?)
    }

    fn memory_report(&self) -> Result<MemoryReport, PluginError> {
        let mut state = self.lock()?;
        state.memory.reap()?;
        let (allocated, buffers) = state.memory.usage();
        let mut held = self.held.clone();
        // Beyond the bytes `alloc` counts, the device charges huge-page rounding and, with
        // `aclrtMalloc`, 32 bytes of padding per buffer: device used minus allocator reserved
        // includes it.
        held.push(HeldMemory {
            what: format!(
                "{} padding and page rounding of buffers",
                state.memory.device_malloc().name()
            )
            .into(),
            bytes: state.memory.overhead(),
        });
        // `copy_batch` has no workspace argument: a copy the copy engine cannot take runs as
        // an op whose scratch the plugin takes itself, until the queue passes it.
        held.push(HeldMemory {
            what: "scratch of queued copies between unaligned or strided regions".into(),
            bytes: state.memory.queued_scratch(),
        });
        Ok(MemoryReport {
            allocated,
            buffers,
            held: held.into(),
        })
    }

    fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
        if bytes == 0 {
            return Err(PluginError::invalid_argument("alloc: 0 bytes"));
        }
        let mut state = self.lock()?;
        let State {
            memory, deferred, ..
        } = &mut *state;
        let result = memory.alloc(bytes, &self.stream, deferred);
        if let Err(AscendError::OutOfMemory { .. }) = &result {
            self.log
                .debug(format!("alloc of {bytes} bytes: out of memory"));
        }
        Ok(result?)
    }

    fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        if state.memory.len_of(buf).is_none() {
            return Err(PluginError::invalid_argument(format!(
                "free: unknown buffer handle {}",
                buf.0
            )));
        }
        Ok(state.memory.free(buf, &self.stream)?)
    }

    fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        self.device_range(&state, "write", "dst", dst, offset, src.len() as u64)?;
        if src.is_empty() {
            return Ok(());
        }
        Ok(state.memory.write(dst, offset, src, &self.stream)?)
    }

    fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        self.device_range(&state, "read", "src", src, offset, dst.len() as u64)?;
        let synced = self.stream.synchronize();
        self.settle(&mut state, synced)?;
        state.memory.reap_all();
        if let Some(err) = state.deferred.take() {
            return Err(err.into());
        }
        Ok(state.memory.read_synchronized(src, offset, dst)?)
    }

    fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        {
            let lens = |b: BufferHandle| state.memory.len_of(b);
            validate::copy_batch(&Checker::new("copy_batch", &lens), regions)?;
        }
        // No destination overlaps a source or another destination (validated), so regions
        // may be merged and run in any order.
        for run in byte_copies(regions) {
            let src = offset_ptr(state.memory.base(run.src.0), run.src.1);
            let dst = offset_ptr(state.memory.base(run.dst.0), run.dst.1);
            let aligned = |p: *mut c_void| (p as usize).is_multiple_of(D2D_ALIGN);
            if run.rows == 1 && aligned(src) && aligned(dst) {
                // SAFETY: both ranges validated inside their buffers; frees are queue-ordered.
                unsafe {
                    state.memory.copy_async(
                        dst,
                        src,
                        run.width,
                        sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE,
                        &self.stream,
                    )
                }?;
            } else {
                self.scratch_op(&mut state, &|x| elementwise::copy_bytes(x, &run))?;
            }
        }
        Ok(())
    }

    fn fill(&self, args: &FillArgs) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        {
            let lens = |b: BufferHandle| state.memory.len_of(b);
            validate::fill(&Checker::new("fill", &lens), args)?;
        }
        let dst = args.dst;
        if dst.bytes == 0 {
            return Ok(());
        }
        let pattern = args.value.to_le_bytes();
        let width = usize::try_from(args.width).unwrap_or(4);
        if pattern[..width].iter().all(|b| *b == pattern[0]) {
            let ptr = offset_ptr(state.memory.base(dst.buf), dst.offset);
            // SAFETY: the range is validated inside its buffer.
            return Ok(unsafe {
                state
                    .memory
                    .memset_async(ptr, dst.bytes, pattern[0], &self.stream)
            }?);
        }
        // Written from pinned host staging rather than by an op: an op's workspace would be
        // device memory outside the host allocator (the ABI's fill has no workspace).
        Ok(state.memory.fill_pattern(
            dst.buf,
            dst.offset,
            dst.bytes,
            &pattern[..width],
            &self.stream,
        )?)
    }

    fn synchronize(&self) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        let synced = self.stream.synchronize();
        self.settle(&mut state, synced)?;
        state.memory.reap_all();
        match state.deferred.take() {
            Some(err) => Err(err.into()),
            None => Ok(()),
        }
    }

    fn gemm_workspace(&self, args: &GemmArgs) -> Result<u64, PluginError> {
        self.gemm_call(args, None)
    }

    fn gemm(&self, args: &GemmArgs) -> Result<(), PluginError> {
        self.gemm_call(args, Some(&args.workspace)).map(drop)
    }

    fn layer_norm_workspace(&self, args: &NormArgs) -> Result<u64, PluginError> {
        self.norm_call(args, None, false)
    }

    fn layer_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.norm_call(args, Some(&args.workspace), false).map(drop)
    }

    fn rms_norm_workspace(&self, args: &NormArgs) -> Result<u64, PluginError> {
        self.norm_call(args, None, true)
    }

    fn rms_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.norm_call(args, Some(&args.workspace), true).map(drop)
    }

    fn activation_workspace(&self, args: &ActivationArgs) -> Result<u64, PluginError> {
        self.activation_call(args, None)
    }

    fn activation(&self, args: &ActivationArgs) -> Result<(), PluginError> {
        self.activation_call(args, Some(&args.workspace)).map(drop)
    }

    fn binary_workspace(&self, args: &BinaryArgs) -> Result<u64, PluginError> {
        self.binary_call(args, None)
    }

    fn binary(&self, args: &BinaryArgs) -> Result<(), PluginError> {
        self.binary_call(args, Some(&args.workspace)).map(drop)
    }

    fn rotary_workspace(&self, args: &RotaryArgs) -> Result<u64, PluginError> {
        self.rotary_call(args, None)
    }

    fn rotary(&self, args: &RotaryArgs) -> Result<(), PluginError> {
        self.rotary_call(args, Some(&args.workspace)).map(drop)
    }

    fn attention_workspace(&self, args: &AttentionArgs<'_>) -> Result<u64, PluginError> {
        self.attention_call(args, None)
    }

    fn attention(&self, args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        self.attention_call(args, Some(&args.workspace)).map(drop)
    }

    fn gather_rows_workspace(&self, args: &GatherArgs) -> Result<u64, PluginError> {
        self.gather_call(args, None)
    }

    fn gather_rows(&self, args: &GatherArgs) -> Result<(), PluginError> {
        self.gather_call(args, Some(&args.workspace)).map(drop)
    }

    fn cast_workspace(&self, args: &CastArgs) -> Result<u64, PluginError> {
        self.cast_call(args, None)
    }

    fn cast(&self, args: &CastArgs) -> Result<(), PluginError> {
        self.cast_call(args, Some(&args.workspace)).map(drop)
    }

    fn alloc_host(&self, bytes: u64) -> Result<HostAlloc, PluginError> {
        if bytes == 0 {
            return Err(PluginError::invalid_argument("alloc_host: 0 bytes"));
        }
        let mut state = self.lock()?;
        let (id, ptr, len) = state.memory.alloc_host(bytes)?;
        Ok(HostAlloc { id, ptr, len })
    }

    fn free_host(&self, id: HostBufferId) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        if state.memory.free_host(id, &self.stream)? {
            Ok(())
        } else {
            Err(PluginError::invalid_argument(format!(
                "free_host: unknown host buffer {}",
                id.0
            )))
        }
    }

    fn upload(&self, copy: &StagedCopy) -> Result<(), PluginError> {
        const OP: &str = "upload";
        let state = self.lock()?;
        let host = Self::host_range(&state, OP, copy.host, copy.host_offset, copy.bytes)?;
        self.device_range(
            &state,
            OP,
            "device",
            copy.device,
            copy.device_offset,
            copy.bytes,
        )?;
        let device = offset_ptr(state.memory.base(copy.device), copy.device_offset);
        // SAFETY: both ranges validated inside their buffers; frees of either are
        // queue-ordered.
        Ok(unsafe {
            state.memory.copy_async(
                device,
                host,
                copy.bytes,
                sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                &self.stream,
            )
        }?)
    }

    fn download(&self, copy: &StagedCopy) -> Result<(), PluginError> {
        const OP: &str = "download";
        let state = self.lock()?;
        let host = Self::host_range(&state, OP, copy.host, copy.host_offset, copy.bytes)?;
        self.device_range(
            &state,
            OP,
            "device",
            copy.device,
            copy.device_offset,
            copy.bytes,
        )?;
        let device = offset_ptr(state.memory.base(copy.device), copy.device_offset);
        // SAFETY: both ranges validated inside their buffers; frees of either are
        // queue-ordered.
        Ok(unsafe {
            state.memory.copy_async(
                host,
                device,
                copy.bytes,
                sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
                &self.stream,
            )
        }?)
    }

    fn fence(&self) -> Result<u64, PluginError> {
        let mut state = self.lock()?;
        // Fences the host never waits for would pile up: complete ones are forgotten (waiting
        // for a forgotten fence returns at once).
        while let Some(entry) = state.fences.first_entry() {
            if !entry.get().is_complete()? {
                break;
            }
            entry.remove();
        }
        let event = match Event::record(self.rt, &self.stream) {
            Ok(event) => Some(event),
            // The stream noted the fault and dropped the work before this fence: waiting for
            // it reports the fault (as the wait for a fence no longer held does).
            Err(err) if err.is_task_fault() => None,
            Err(err) => return Err(err.into()),
        };
        let value = state.next_fence;
        state.next_fence += 1;
        if let Some(event) = event {
            state.fences.insert(value, event);
        }
        Ok(value)
    }

    fn wait_fence(&self, value: u64) -> Result<(), PluginError> {
        let mut state = self.lock()?;
        if value == 0 || value >= state.next_fence {
            return Err(PluginError::invalid_argument(format!(
                "wait_fence: fence {value} was never recorded (the last is {})",
                state.next_fence - 1
            )));
        }
        // A fence no longer held was waited for already, or an earlier wait covered it, or a
        // task fault dropped its work (then kept in `deferred`, and reported here).
        let waited = match state.fences.get(&value) {
            Some(event) => event.synchronize(),
            None => state.deferred.take().map_or(Ok(()), Err),
        };
        let later = state.fences.split_off(&(value + 1));
        state.fences = later;
        self.settle(&mut state, waited)?;
        Ok(state.memory.reap()?)
    }
}

impl AscendDevice {
    fn gemm_call(&self, args: &GemmArgs, ws: Option<&BufferSlice>) -> Result<u64, PluginError> {
        let (act, acc, tr) = (args.activation, args.accumulate, args.w_transposed);
        let family = self.family;
        self.op(
            OpKind::GEMM,
            "gemm",
            args,
            ws,
            &|check, a| validate::gemm(check, a),
            &|g| g.out.dtype,
            &|g| {
                let mut list = vec![("a", g.a), ("w", g.w), ("out", g.out)];
                list.extend(g.bias.map(|b| ("bias", b)));
                list
            },
            &|_| vec![Path::Composed],
            &|x, g, _| ops::gemm::gemm(x, g, act, acc, tr, family.cube_math(g.out.dtype)),
        )
    }

    fn norm_call(
        &self,
        args: &NormArgs,
        ws: Option<&BufferSlice>,
        rms: bool,
    ) -> Result<u64, PluginError> {
        let (kind, name) = if rms {
            (OpKind::RMS_NORM, "rms_norm")
        } else {
            (OpKind::LAYER_NORM, "layer_norm")
        };
        let eps = args.eps;
        self.op(
            kind,
            name,
            args,
            ws,
            &|check, a| validate::norm(check, a, rms),
            &|n| n.x.dtype,
            &|n| {
                let mut list = vec![("x", n.x), ("weight", n.weight), ("out", n.out)];
                list.extend(n.bias.map(|b| ("bias", b)));
                list
            },
            &|_| vec![Path::Composed],
            &|x, n, _| ops::norm::norm(x, n, eps, rms),
        )
    }

    fn activation_call(
        &self,
        args: &ActivationArgs,
        ws: Option<&BufferSlice>,
    ) -> Result<u64, PluginError> {
        let act = args.activation;
        self.op(
            OpKind::ACTIVATION,
            "activation",
            args,
            ws,
            &|check, a| {
                let (x, out) = validate::activation(check, a)?;
                Ok((x, out))
            },
            &|(x, _)| x.dtype,
            &|(x, out)| vec![("x", *x), ("out", *out)],
            &|_| vec![Path::Composed],
            &|x, (input, out), _| elementwise::activation(x, input, out, act),
        )
    }

    fn binary_call(&self, args: &BinaryArgs, ws: Option<&BufferSlice>) -> Result<u64, PluginError> {
        let op = args.op;
        self.op(
            OpKind::BINARY,
            "binary",
            args,
            ws,
            &|check, a| validate::binary(check, a),
            &|b| b.a.dtype,
            &|b| vec![("a", b.a), ("b", b.b), ("out", b.out)],
            &|_| vec![Path::Composed],
            &|x, b, _| elementwise::binary(x, op, &b.a, &b.b, &b.out),
        )
    }

    fn rotary_call(&self, args: &RotaryArgs, ws: Option<&BufferSlice>) -> Result<u64, PluginError> {
        self.op(
            OpKind::ROTARY,
            "rotary",
            args,
            ws,
            &|check, a| validate::rotary(check, a),
            &|r| r.x.dtype,
            &|r| vec![("x", r.x), ("cos", r.cos), ("sin", r.sin)],
            &|_| self.rotary_paths(),
            &|x, r, path| ops::rotary::rotary(x, r, path),
        )
    }

    fn attention_call(
        &self,
        args: &AttentionArgs<'_>,
        ws: Option<&BufferSlice>,
    ) -> Result<u64, PluginError> {
        let scale = args.scale;
        let cu: Vec<u32> = args.cu_seqlens.as_slice().to_vec();
        let family = self.family;
        self.op(
            OpKind::ATTENTION,
            "attention",
            args,
            ws,
            &|check, a| validate::attention(check, a),
            &|a| a.q.dtype,
            &|a| {
                vec![
                    ("q", a.q),
                    ("k", a.k),
                    ("v", a.v),
                    ("out", a.out),
                    ("cu_seqlens_device", a.cu_seqlens_device),
                ]
            },
            &|a| self.attention_paths(a),
            &|x, a, path| {
                ops::attention::attention(x, a, scale, &cu, path, family.cube_math(a.q.dtype))
            },
        )
    }

    fn gather_call(&self, args: &GatherArgs, ws: Option<&BufferSlice>) -> Result<u64, PluginError> {
        self.op(
            OpKind::GATHER_ROWS,
            "gather_rows",
            args,
            ws,
            &|check, a| validate::gather_rows(check, a),
            &|(src, _, _)| {
                if src.dtype.is_float() {
                    src.dtype
                } else {
                    DType::F32
                }
            },
            &|(src, out, indices)| vec![("src", *src), ("out", *out), ("indices", *indices)],
            &|_| vec![Path::Composed],
            &|x, (src, out, indices), _| elementwise::gather_rows(x, src, out, indices),
        )
    }

    fn cast_call(&self, args: &CastArgs, ws: Option<&BufferSlice>) -> Result<u64, PluginError> {
        let dtypes = self.dtypes.clone();
        let soc = self.soc.clone();
        self.op(
            OpKind::CAST,
            "cast",
            args,
            ws,
            &|check, a| {
                let (src, out) = validate::cast(check, a)?;
                if !dtypes.contains(&out.dtype) {
                    return Err(PluginError::unsupported(format!(
                        "cast: dtype {} is not supported on {soc}",
                        out.dtype
                    )));
                }
                Ok((src, out))
            },
            &|(src, _)| src.dtype,
            &|(src, out)| vec![("src", *src), ("out", *out)],
            &|_| vec![Path::Composed],
            &|x, (src, out), _| elementwise::cast(x, src, out),
        )
    }
}

impl Drop for AscendDevice {
    fn drop(&mut self) {
        // Teardown needs the context current on this thread and the queue idle; buffers the
        // host did not free are released here (a safety net: the host frees first). A panic
        // while the lock was held poisons it but leaves the state whole (every change to it
        // completes before anything that can panic), so the same shutdown runs on it.
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(err) = self.context.make_current() {
            self.log.warn(format!("closing: {err}"));
        }
        if let Err(err) = self.stream.synchronize() {
            self.log.warn(format!("closing: queued work failed: {err}"));
        }
        state.fences.clear();
        state.memory.clear();
        self.log.debug(format!(
            "closing NPU {} (device {})",
            self.ordinal,
            self.binding.id()
        ));
    }
}

/// Operands of an op's arguments, rewritten: for the workspace memo's key (see
/// [`requirement_key`]) and for measuring without aliasing (every handle distinct).
trait Handles: Sized + std::fmt::Debug {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self;
}

impl Handles for GemmArgs {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        GemmArgs {
            a: f(&self.a),
            w: f(&self.w),
            bias: f(&self.bias),
            out: f(&self.out),
            workspace: BufferSlice::EMPTY,
            ..*self
        }
    }
}

impl Handles for NormArgs {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        NormArgs {
            x: f(&self.x),
            weight: f(&self.weight),
            bias: f(&self.bias),
            out: f(&self.out),
            workspace: BufferSlice::EMPTY,
            ..*self
        }
    }
}

impl Handles for ActivationArgs {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        ActivationArgs {
            x: f(&self.x),
            out: f(&self.out),
            workspace: BufferSlice::EMPTY,
            ..*self
        }
    }
}

impl Handles for BinaryArgs {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        BinaryArgs {
            a: f(&self.a),
            b: f(&self.b),
            out: f(&self.out),
            workspace: BufferSlice::EMPTY,
            ..*self
        }
    }
}

impl Handles for RotaryArgs {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        RotaryArgs {
            x: f(&self.x),
            cos: f(&self.cos),
            sin: f(&self.sin),
            workspace: BufferSlice::EMPTY,
            ..*self
        }
    }
}

impl<'a> Handles for AttentionArgs<'a> {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        AttentionArgs {
            q: f(&self.q),
            k: f(&self.k),
            v: f(&self.v),
            out: f(&self.out),
            cu_seqlens_device: f(&self.cu_seqlens_device),
            workspace: BufferSlice::EMPTY,
            ..*self
        }
    }
}

impl Handles for GatherArgs {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        GatherArgs {
            src: f(&self.src),
            out: f(&self.out),
            indices: f(&self.indices),
            workspace: BufferSlice::EMPTY,
        }
    }
}

impl Handles for CastArgs {
    fn map_mats(&self, f: &mut dyn FnMut(&MatRef) -> MatRef) -> Self {
        CastArgs {
            src: f(&self.src),
            out: f(&self.out),
            workspace: BufferSlice::EMPTY,
        }
    }
}

/// The workspace memo's key of a call: its shapes, strides, dtypes and other arguments, and
/// which operands share a buffer, but not the buffers themselves nor the offsets in them, on
/// which no workspace depends; so a call at a new offset reuses the measurement.
fn requirement_key<A: Handles>(name: &str, args: &A) -> String {
    let mut seen: Vec<BufferHandle> = Vec::new();
    let keyed = args.map_mats(&mut |m| {
        let label = if m.buf.0 == 0 {
            0
        } else if let Some(at) = seen.iter().position(|b| *b == m.buf) {
            at as u64 + 1
        } else {
            seen.push(m.buf);
            seen.len() as u64
        };
        MatRef {
            buf: BufferHandle(label),
            offset: 0,
            ..*m
        }
    });
    format!("{name}:{keyed:?}")
}

/// Groups copy regions into strided copies: regions between the same two buffers (taken in
/// their order), of the same length, whose offsets advance by the same strides (the engine's
/// per-row copies) become one copy of many rows. The caller's regions are independent.
fn byte_copies(regions: &[CopyRegion]) -> Vec<ByteCopy> {
    let mut sorted: Vec<&CopyRegion> = regions.iter().filter(|r| r.bytes > 0).collect();
    sorted.sort_by_key(|r| (r.src.0, r.dst.0));
    let mut runs: Vec<ByteCopy> = Vec::new();
    for r in sorted {
        if let Some(run) = runs.last_mut()
            && run.src.0 == r.src
            && run.dst.0 == r.dst
            && run.width == r.bytes
            && let Some(src_step) = r.src_offset.checked_sub(run.src.1)
            && let Some(dst_step) = r.dst_offset.checked_sub(run.dst.1)
        {
            // The next row of a run starts one stride after the previous one; the second row
            // sets the strides. Rows apart by less than their width would overlap.
            let (src_stride, dst_stride) = if run.rows == 1 {
                (src_step, dst_step)
            } else {
                (run.src.2, run.dst.2)
            };
            if src_stride >= r.bytes
                && dst_stride >= r.bytes
                && src_step == src_stride * run.rows
                && dst_step == dst_stride * run.rows
            {
                run.src.2 = src_stride;
                run.dst.2 = dst_stride;
                run.rows += 1;
                continue;
            }
        }
        runs.push(ByteCopy {
            src: (r.src, r.src_offset, r.bytes),
            dst: (r.dst, r.dst_offset, r.bytes),
            rows: 1,
            width: r.bytes,
        });
    }
    runs
}
