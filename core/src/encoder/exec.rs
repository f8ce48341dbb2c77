//! Tensors and the op runner the vision towers are written against.
//!
//! A [`Runner`] executes ABI ops on a device, allocating every intermediate through the caching
//! allocator; dropping a [`Tensor`] returns its block to the pool, so a tower's live set, and
//! with it the peak, follows the graph. The same tower code runs in *planning* mode
//! ([`Runner::planner`]): no op executes and no device memory is touched, but every allocation is
//! sized and rounded as the allocator rounds requests, which yields the peak activation memory of
//! a batch before running it. The measured peak can exceed the plan only by the remainders the
//! allocator leaves unsplit when it reuses a larger cached block (under 1 MiB per block).
//!
//! A *dry run* ([`Runner::dry_run`]) closes that gap: ops are skipped as when planning, but
//! every tensor is allocated and freed through a [`CachingAllocator::dry_run`] copy of the
//! allocator, which takes the real allocator's decisions on virtual memory, so its peaks
//! (allocated and reserved) are exactly those of the same run executed.
//!
//! A *step* ([`Runner::step`]) follows a [`StepPlan`] made by [`Runner::plan_step`]: its
//! tensors take their planned places in one arena block, its outputs blocks of their own
//! (see [`super::plan`]). Executing, planning and dry runs all take steps.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use abi_stable::std_types::RSlice;
use iris_plugin::abi::{
    AttentionArgs, BinaryArgs, BufferSlice, CastArgs, CopyRegion, GatherArgs, GemmArgs, NormArgs,
    RotaryArgs,
};
use iris_plugin::host::HostBuffer;
use iris_plugin::{
    Activation, AsyncWrites, BinaryOp, BufferHandle, DType, Device, DeviceError, MatRef, OpKind,
};

use crate::encoder::EncoderError;
use crate::encoder::plan::{Slot, StepPlan, TraceEvent};
use crate::memory::allocator::round_size;
use crate::memory::{CachingAllocator, DeviceBuffer};

/// A row-major matrix on the device (or, when planning, a sized placeholder).
///
/// Views ([`Tensor::cols`], [`Tensor::rows`]) share the storage of the tensor they come from;
/// the storage returns to the allocator when the last view is dropped.
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    dtype: DType,
    rows: u64,
    cols: u64,
    row_stride: u64,
    /// Byte offset of element (0, 0) from the start of the storage.
    offset: u64,
}

enum Storage {
    Device(DeviceBuffer),
    /// A block of a dry-run allocator: accounted, with no memory behind it.
    Dry(#[allow(dead_code)] DeviceBuffer),
    /// Held only for its `Drop`, which returns the planned bytes.
    Planned(#[allow(dead_code)] PlannedBlock),
    /// A planned place in a step's arena (with no memory behind it in a dry run).
    Arena(ArenaSlot),
}

impl Storage {
    /// The device buffer and byte offset the storage starts at; `None` without memory.
    fn place(&self) -> Option<(BufferHandle, u64)> {
        match self {
            Storage::Device(buffer) => Some((buffer.handle(), buffer.offset())),
            Storage::Arena(slot) if !slot.arena.allocator().is_dry_run() => {
                Some((slot.arena.handle(), slot.arena.offset() + slot.offset))
            }
            Storage::Arena(_) | Storage::Dry(_) | Storage::Planned(_) => None,
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor[{}x{} {} stride {}]",
            self.rows, self.cols, self.dtype, self.row_stride
        )
    }
}

impl Tensor {
    /// Number of rows.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> u64 {
        self.cols
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether rows are packed without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.row_stride == self.cols
    }

    /// Bytes of storage the tensor's elements span (rows x cols x dtype size).
    pub fn bytes(&self) -> u64 {
        self.rows * self.cols * dtype_size(self.dtype)
    }

    /// The ABI view of this tensor.
    pub fn mat(&self) -> MatRef {
        let (buf, base) = self
            .storage
            .place()
            .unwrap_or((iris_plugin::BufferHandle::NULL, 0));
        MatRef {
            buf,
            offset: base + self.offset,
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            row_stride: self.row_stride,
        }
    }

    /// Columns `[start, start + len)` of every row, sharing storage.
    pub fn col_range(&self, start: u64, len: u64) -> Result<Tensor, EncoderError> {
        if start + len > self.cols {
            return Err(EncoderError::Shape(format!(
                "column range {start}..{} outside a {}-column tensor",
                start + len,
                self.cols
            )));
        }
        let offset = self.offset + start * dtype_size(self.dtype);
        Ok(self.view(self.rows, len, self.row_stride, offset))
    }

    /// Rows `[start, start + len)`, sharing storage.
    pub fn row_range(&self, start: u64, len: u64) -> Result<Tensor, EncoderError> {
        if start + len > self.rows {
            return Err(EncoderError::Shape(format!(
                "row range {start}..{} outside a {}-row tensor",
                start + len,
                self.rows
            )));
        }
        let offset = self.offset + start * self.row_stride * dtype_size(self.dtype);
        Ok(self.view(len, self.cols, self.row_stride, offset))
    }

    /// The same contiguous elements viewed as `rows x cols` (e.g. merging groups of rows).
    pub fn reshape(&self, rows: u64, cols: u64) -> Result<Tensor, EncoderError> {
        if !self.is_contiguous() || rows * cols != self.rows * self.cols {
            return Err(EncoderError::Shape(format!(
                "cannot view a {}x{} tensor (stride {}) as {rows}x{cols}",
                self.rows, self.cols, self.row_stride
            )));
        }
        Ok(self.view(rows, cols, cols, self.offset))
    }

    /// The whole device buffer behind this tensor, when the tensor is the only reference to it
    /// and covers it from its start contiguously; otherwise the tensor back.
    pub fn into_buffer(self) -> Result<DeviceBuffer, Tensor> {
        if self.offset != 0 || !self.is_contiguous() {
            return Err(self);
        }
        let Tensor {
            storage,
            dtype,
            rows,
            cols,
            row_stride,
            offset,
        } = self;
        let back = |storage| Tensor {
            storage,
            dtype,
            rows,
            cols,
            row_stride,
            offset,
        };
        match Arc::try_unwrap(storage) {
            Ok(Storage::Device(buffer)) => Ok(buffer),
            Ok(planned) => Err(back(Arc::new(planned))),
            Err(shared) => Err(back(shared)),
        }
    }

    /// A view of the same storage.
    fn view(&self, rows: u64, cols: u64, row_stride: u64, offset: u64) -> Tensor {
        Tensor {
            storage: Arc::clone(&self.storage),
            dtype: self.dtype,
            rows,
            cols,
            row_stride,
            offset,
        }
    }
}

/// Executes ops on a device, or plans them.
#[derive(Clone)]
pub struct Runner {
    device: Arc<Device>,
    allocator: Arc<CachingAllocator>,
    plan: Option<Arc<Mutex<PlanState>>>,
    /// Ops are skipped and tensors come from a dry-run allocator.
    dry: bool,
    /// The step being run to a plan, if any.
    step: Option<Arc<Mutex<StepState>>>,
    staging: Arc<Mutex<StagingRing>>,
}

#[derive(Default)]
struct PlanState {
    live: u64,
    peak: u64,
    /// The allocations and frees so far, when recording a step's trace.
    trace: Option<Vec<TraceEvent>>,
    allocations: usize,
}

struct PlannedBlock {
    bytes: u64,
    index: usize,
    state: Arc<Mutex<PlanState>>,
}

impl Drop for PlannedBlock {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.live = state.live.saturating_sub(self.bytes);
        let index = self.index;
        if let Some(trace) = &mut state.trace {
            trace.push(TraceEvent::Free(index));
        }
    }
}

/// A step run to its plan: the arena, which slots are live, and what was measured.
struct StepState {
    plan: Arc<StepPlan>,
    /// Allocations made so far.
    next: usize,
    /// Allocated with the first arena slot; kept until the step's runner is gone.
    arena: Option<Arc<DeviceBuffer>>,
    /// Live arena slots: `(index, offset, end)`.
    live: Vec<(usize, u64, u64)>,
    live_bytes: u64,
    report: StepReport,
}

/// What a step run to its plan took ([`Runner::step_report`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Bytes of the arena block (0 until the first arena tensor).
    pub arena_bytes: u64,
    /// The most bytes of arena tensors live at once, as they came and went.
    pub live_peak: u64,
    /// Allocations made on their own as outputs, in bytes asked for.
    pub output_bytes: u64,
    /// Allocations within the plan that departed from it (another size, or their place
    /// still held) and were made on their own instead. Allocations after the planned ones
    /// (reading outputs back) are blocks of their own and not counted.
    pub departures: u64,
}

/// A tensor's place in a step's arena; dropping it frees the place.
struct ArenaSlot {
    arena: Arc<DeviceBuffer>,
    offset: u64,
    bytes: u64,
    index: usize,
    state: Arc<Mutex<StepState>>,
}

impl Drop for ArenaSlot {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let index = self.index;
        state.live.retain(|&(i, ..)| i != index);
        state.live_bytes -= self.bytes;
    }
}

impl Runner {
    /// A runner that executes on the allocator's device.
    pub fn new(allocator: Arc<CachingAllocator>) -> Runner {
        Runner {
            device: Arc::clone(allocator.device()),
            allocator,
            plan: None,
            dry: false,
            step: None,
            staging: Arc::default(),
        }
    }

    /// A runner that executes nothing and records the peak of live allocator bytes.
    pub fn planner(allocator: Arc<CachingAllocator>) -> Runner {
        Runner {
            device: Arc::clone(allocator.device()),
            allocator,
            plan: Some(Arc::new(Mutex::new(PlanState::default()))),
            dry: false,
            step: None,
            staging: Arc::default(),
        }
    }

    /// A runner that executes nothing but allocates and frees every tensor, in the order a
    /// real run would, through a [`CachingAllocator::dry_run`] copy of `allocator` taken now.
    /// The copy's [`CachingAllocator::stats`] then hold the peaks the run would reach on
    /// `allocator`, block rounding, unsplit remainders and segment sizes included.
    ///
    /// # Errors
    /// The device's error when it cannot report its free memory.
    pub fn dry_run(allocator: &CachingAllocator) -> Result<Runner, EncoderError> {
        let copy = allocator.dry_run()?;
        Ok(Runner {
            device: Arc::clone(copy.device()),
            allocator: copy,
            plan: None,
            dry: true,
            step: None,
            staging: Arc::default(),
        })
    }

    /// Plans a step: runs `work` on a planning runner that records every allocation and
    /// free, and places them (see [`StepPlan`]). What `work` returns is held while the plan is
    /// made, so the tensors in it are the step's outputs; `work` must allocate exactly as the
    /// step that follows the plan will, in the same order.
    ///
    /// # Errors
    /// What `work` returns.
    pub fn plan_step<T>(
        allocator: &Arc<CachingAllocator>,
        work: impl FnOnce(&Runner) -> Result<T, EncoderError>,
    ) -> Result<StepPlan, EncoderError> {
        let planner = Runner::planner(Arc::clone(allocator));
        let state = planner
            .plan
            .clone()
            .ok_or_else(|| shape_error("planner state"))?;
        state.lock().unwrap_or_else(PoisonError::into_inner).trace = Some(Vec::new());
        let outputs = work(&planner)?;
        let trace = state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .trace
            .take()
            .unwrap_or_default();
        drop(outputs);
        Ok(StepPlan::new(&trace))
    }

    /// A runner for one step that follows `plan`: on the same device, allocator and mode
    /// (executing or dry), with each tensor in its planned place (see [`StepPlan`]). The
    /// arena goes back to the allocator when this runner and every tensor in it are gone.
    pub fn step(&self, plan: Arc<StepPlan>) -> Runner {
        Runner {
            device: Arc::clone(&self.device),
            allocator: Arc::clone(&self.allocator),
            plan: None,
            dry: self.dry,
            step: Some(Arc::new(Mutex::new(StepState {
                plan,
                next: 0,
                arena: None,
                live: Vec::new(),
                live_bytes: 0,
                report: StepReport::default(),
            }))),
            staging: Arc::clone(&self.staging),
        }
    }

    /// What this step runner's step took so far (`None` for a runner not made by
    /// [`Runner::step`]).
    pub fn step_report(&self) -> Option<StepReport> {
        self.step
            .as_ref()
            .map(|step| step.lock().unwrap_or_else(PoisonError::into_inner).report)
    }

    /// Peak live bytes seen so far in planning mode (0 when executing).
    pub fn planned_peak(&self) -> u64 {
        self.plan.as_ref().map_or(0, |state| {
            state.lock().unwrap_or_else(PoisonError::into_inner).peak
        })
    }

    /// Whether ops are skipped (planning or a dry run): uploads may then pass no values.
    pub fn is_planning(&self) -> bool {
        self.plan.is_some() || self.dry
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The allocator.
    pub fn allocator(&self) -> &Arc<CachingAllocator> {
        &self.allocator
    }

    /// An uninitialised `rows x cols` tensor.
    pub fn tensor(&self, dtype: DType, rows: u64, cols: u64) -> Result<Tensor, EncoderError> {
        // Sizes come from plugins too (op workspaces), which the host does not trust: a size
        // past u64 is an error, and the plan's sums saturate (an allocation of them then fails
        // with the numbers) rather than wrap.
        let bytes = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(dtype_size(dtype)))
            .ok_or_else(|| {
                EncoderError::Shape(format!(
                    "a {rows} x {cols} {dtype} tensor has more bytes than a 64-bit size holds"
                ))
            })?
            .max(1);
        let storage = match (&self.plan, &self.step) {
            (Some(state), _) => {
                let rounded = round_size(bytes).unwrap_or(bytes);
                let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
                guard.live = guard.live.saturating_add(rounded);
                guard.peak = guard.peak.max(guard.live);
                let index = guard.allocations;
                guard.allocations += 1;
                if let Some(trace) = &mut guard.trace {
                    trace.push(TraceEvent::Alloc(bytes));
                }
                Storage::Planned(PlannedBlock {
                    bytes: rounded,
                    index,
                    state: Arc::clone(state),
                })
            }
            (None, Some(step)) => self.step_storage(step, bytes)?,
            (None, None) => self.own_storage(bytes)?,
        };
        Ok(Tensor {
            storage: Arc::new(storage),
            dtype,
            rows,
            cols,
            row_stride: cols,
            offset: 0,
        })
    }

    /// A block of its own from the allocator (on paper in a dry run).
    fn own_storage(&self, bytes: u64) -> Result<Storage, EncoderError> {
        let buffer = self.allocator.alloc(bytes)?;
        Ok(if self.dry {
            Storage::Dry(buffer)
        } else {
            Storage::Device(buffer)
        })
    }

    /// The next allocation of a step: its planned place in the arena, or a block of its own
    /// for an output or where the run departs from the plan.
    fn step_storage(
        &self,
        step: &Arc<Mutex<StepState>>,
        bytes: u64,
    ) -> Result<Storage, EncoderError> {
        let mut state = step.lock().unwrap_or_else(PoisonError::into_inner);
        let index = state.next;
        state.next += 1;
        let (offset, size) = match state.plan.slot(index, bytes) {
            Some(Slot::Arena {
                offset,
                bytes: size,
            }) if !state
                .live
                .iter()
                .any(|&(_, start, end)| start < offset + size && offset < end) =>
            {
                (offset, size)
            }
            Some(Slot::Own { .. }) => {
                state.report.output_bytes += bytes;
                drop(state);
                return self.own_storage(bytes);
            }
            // Past the planned work (reading outputs back): blocks of their own.
            _ if index >= state.plan.len() => {
                drop(state);
                return self.own_storage(bytes);
            }
            _ => {
                state.report.departures += 1;
                tracing::debug!(index, bytes, "a step allocation departs from its plan");
                drop(state);
                return self.own_storage(bytes);
            }
        };
        let arena = match &state.arena {
            Some(arena) => Arc::clone(arena),
            None => {
                let arena = Arc::new(self.allocator.alloc_whole(state.plan.arena_bytes())?);
                state.report.arena_bytes = arena.capacity();
                state.arena = Some(Arc::clone(&arena));
                arena
            }
        };
        state.live.push((index, offset, offset + size));
        state.live_bytes += size;
        state.report.live_peak = state.report.live_peak.max(state.live_bytes);
        Ok(Storage::Arena(ArenaSlot {
            arena,
            offset,
            bytes: size,
            index,
            state: Arc::clone(step),
        }))
    }

    /// Uploads host f32 data as a `rows x cols` tensor of `dtype` (converted on the host).
    pub fn upload_f32(
        &self,
        data: &[f32],
        dtype: DType,
        rows: u64,
        cols: u64,
    ) -> Result<Tensor, EncoderError> {
        if data.is_empty() && self.is_planning() {
            // Sizing only: the values are not needed (see `Runner::is_planning`).
            return self.tensor(dtype, rows, cols);
        }
        if data.len() as u64 != rows * cols {
            return Err(EncoderError::Shape(format!(
                "upload of {} values into a {rows}x{cols} tensor",
                data.len()
            )));
        }
        self.upload_f32_parts(&[data], dtype, rows, cols)
    }

    /// Uploads host f32 slices, concatenated in order, as one `rows x cols` tensor of `dtype`.
    ///
    /// Values are converted chunk by chunk into the runner's two staging buffers (page-locked
    /// memory from the plugin where it offers it) and uploaded from there, so the conversion
    /// of one chunk overlaps the transfer of the previous one, and a batch of images is never
    /// copied whole on the host.
    pub fn upload_f32_parts(
        &self,
        parts: &[&[f32]],
        dtype: DType,
        rows: u64,
        cols: u64,
    ) -> Result<Tensor, EncoderError> {
        let tensor = self.parts_tensor(parts, dtype, rows, cols)?;
        if let Some((handle, offset)) = self.target(&tensor) {
            self.stage_f32(handle, offset, parts, dtype)?;
        }
        Ok(tensor)
    }

    /// The `rows x cols` tensor of `dtype` that `parts`, concatenated, fill exactly.
    fn parts_tensor(
        &self,
        parts: &[&[f32]],
        dtype: DType,
        rows: u64,
        cols: u64,
    ) -> Result<Tensor, EncoderError> {
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if total != rows * cols {
            return Err(EncoderError::Shape(format!(
                "upload of {total} values into a {rows}x{cols} tensor"
            )));
        }
        self.tensor(dtype, rows, cols)
    }

    /// Converts `parts` to `dtype` chunk by chunk through the staging ring and uploads them,
    /// concatenated, into `buffer` from byte `offset`.
    fn stage_f32(
        &self,
        buffer: BufferHandle,
        mut offset: u64,
        parts: &[&[f32]],
        dtype: DType,
    ) -> Result<(), EncoderError> {
        let size = usize::try_from(dtype_size(dtype)).map_err(|_| too_big())?;
        let mut staging = self.staging()?;
        let chunks = parts.iter().flat_map(|p| p.chunks(STAGING_BYTES / size));
        for (i, chunk) in chunks.enumerate() {
            // Waits until the upload that last used this slot has read it.
            let slot = &mut staging.slots[i % STAGING_SLOTS];
            let bytes = slot.as_mut_slice()?;
            let len = chunk.len() * size;
            encode_f32_to(chunk, dtype, &mut bytes[..len]);
            self.device.upload(buffer, offset, slot, 0, len as u64)?;
            offset += len as u64;
        }
        Ok(())
    }

    /// [`Runner::upload_f32_parts`] without a copy on this thread where the device allows it.
    ///
    /// When the device's queue reads host memory as it runs (ABI 2.2's `write_async`: the CPU
    /// device, and the CUDA device through page-locked slots filled off this thread), each
    /// part is enqueued where it lies: the device copies it in queue order, with no staging
    /// and no work here, and `writes` keeps the parts borrowed until the device has run the
    /// copies (`Device::with_async_writes` waits for them). A tensor of another dtype is written as
    /// f32 and cast on the device, which rounds as the host's conversion does (to nearest,
    /// ties to even), so the conversion leaves this thread too. Otherwise (a device without
    /// such writes) the parts go through the staging buffers as with `upload_f32_parts`.
    pub fn upload_f32_parts_lent<'a>(
        &self,
        parts: &[&'a [f32]],
        dtype: DType,
        rows: u64,
        cols: u64,
        writes: &mut AsyncWrites<'a>,
    ) -> Result<Tensor, EncoderError> {
        if self.casts_uploads(dtype) {
            let values = self.upload_f32_parts_lent(parts, DType::F32, rows, cols, writes)?;
            return self.cast_upload(&values, dtype);
        }
        if !self.writes_uploads() {
            return self.upload_f32_parts(parts, dtype, rows, cols);
        }
        let tensor = self.parts_tensor(parts, dtype, rows, cols)?;
        if let Some((handle, mut offset)) = self.target(&tensor) {
            for part in parts {
                let bytes = f32_bytes(part);
                if !writes.write(handle, offset, bytes)? {
                    // The plugin turned such writes down after all: stage this part.
                    self.stage_f32(handle, offset, &[part], dtype)?;
                }
                offset += bytes.len() as u64;
            }
        }
        Ok(tensor)
    }

    /// A `rows x cols` tensor of `dtype` allocated as [`Runner::upload_f32_parts_lent`]
    /// allocates one, in the same order, with no values written: what sizes and plans a step
    /// whose input is uploaded that way. Its elements are unspecified.
    pub fn upload_placeholder(
        &self,
        dtype: DType,
        rows: u64,
        cols: u64,
    ) -> Result<Tensor, EncoderError> {
        if self.casts_uploads(dtype) {
            let values = self.tensor(DType::F32, rows, cols)?;
            return self.cast_upload(&values, dtype);
        }
        self.tensor(dtype, rows, cols)
    }

    /// Whether uploads are written by the device's queue from host memory (see
    /// [`Runner::upload_f32_parts_lent`]).
    fn writes_uploads(&self) -> bool {
        // The device reads the values' bytes as they lie in memory: little-endian f32.
        cfg!(target_endian = "little") && self.device.has_async_write()
    }

    /// Whether an upload of `dtype` is written as f32 and cast on the device.
    fn casts_uploads(&self, dtype: DType) -> bool {
        dtype != DType::F32 && self.writes_uploads() && self.device.supports(OpKind::CAST)
    }

    /// `values` (f32) cast on the device into a new tensor of `dtype`.
    fn cast_upload(&self, values: &Tensor, dtype: DType) -> Result<Tensor, EncoderError> {
        let out = self.tensor(dtype, values.rows, values.cols)?;
        self.op(
            |ws| CastArgs {
                src: values.mat(),
                out: out.mat(),
                workspace: ws,
            },
            Device::cast_workspace,
            Device::cast,
        )?;
        Ok(out)
    }

    /// Uploads raw little-endian bytes of `dtype`.
    pub fn upload_bytes(
        &self,
        bytes: &[u8],
        dtype: DType,
        rows: u64,
        cols: u64,
    ) -> Result<Tensor, EncoderError> {
        let tensor = self.tensor(dtype, rows, cols)?;
        match tensor.storage.as_ref() {
            Storage::Device(buffer) => buffer.write(0, bytes)?,
            Storage::Arena(slot) if !self.is_planning() => slot.arena.write(slot.offset, bytes)?,
            _ => {}
        }
        Ok(tensor)
    }

    /// Uploads i32 values as a `[1, len]` vector: indices and segment boundaries, which ops
    /// take on the device so that a step uploads them once for every layer.
    pub fn upload_i32(&self, values: &[i32]) -> Result<Tensor, EncoderError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.upload_bytes(&bytes, DType::I32, 1, values.len() as u64)
    }

    /// Attention segments for one forward pass: the boundaries on the host and, uploaded once,
    /// on the device.
    pub fn segments(&self, cu_seqlens: Vec<u32>) -> Result<Segments, EncoderError> {
        let device: Vec<i32> = cu_seqlens
            .iter()
            .map(|&c| i32::try_from(c).map_err(|_| shape_error("segment boundary")))
            .collect::<Result<_, _>>()?;
        let max_seqlen = cu_seqlens
            .windows(2)
            .map(|w| u64::from(w[1].saturating_sub(w[0])))
            .max()
            .unwrap_or(0);
        Ok(Segments {
            device: self.upload_i32(&device)?,
            host: cu_seqlens,
            max_seqlen,
        })
    }

    /// Row indices for [`Runner::gather_rows`], uploaded once.
    pub fn indices(&self, rows: &[u32]) -> Result<Tensor, EncoderError> {
        let values: Vec<i32> = rows
            .iter()
            .map(|&r| i32::try_from(r).map_err(|_| shape_error("row index")))
            .collect::<Result<_, _>>()?;
        self.upload_i32(&values)
    }

    /// A device buffer of its own holding `tensor`'s elements contiguously: the tensor's own
    /// buffer when nothing else shares it, a copy otherwise. What a cache keeps beyond a run.
    pub fn into_owned_buffer(&self, tensor: Tensor) -> Result<DeviceBuffer, EncoderError> {
        match tensor.into_buffer() {
            Ok(buffer) => Ok(buffer),
            Err(view) => {
                let out = self.tensor(view.dtype, view.rows, view.cols)?;
                self.copy_rows(&view, &out)?;
                drop(view);
                out.into_buffer().map_err(|_| {
                    EncoderError::Shape("a fresh tensor has no buffer of its own".to_owned())
                })
            }
        }
    }

    /// Reads a contiguous tensor back as raw little-endian bytes of its dtype.
    pub fn download_bytes(&self, tensor: &Tensor) -> Result<Vec<u8>, EncoderError> {
        if !tensor.is_contiguous() {
            return Err(EncoderError::Shape(format!(
                "raw download of a strided {tensor:?}"
            )));
        }
        if self.is_planning() {
            return Ok(Vec::new());
        }
        let mut bytes = vec![0u8; usize::try_from(tensor.bytes()).map_err(|_| too_big())?];
        let mat = tensor.mat();
        let mut staging = self.staging()?;
        let chunks: Vec<(usize, usize)> = (0..bytes.len())
            .step_by(STAGING_BYTES)
            .map(|at| (at, STAGING_BYTES.min(bytes.len() - at)))
            .collect();
        // Chunk i goes through slot i % 2: while the host copies chunk i - 1 out, chunk i is
        // already on its way.
        for i in 0..=chunks.len() {
            if let Some(&(at, len)) = chunks.get(i) {
                let slot = &mut staging.slots[i % STAGING_SLOTS];
                self.device
                    .download(mat.buf, mat.offset + at as u64, slot, 0, len as u64)?;
            }
            if let Some(&(at, len)) = i.checked_sub(1).and_then(|j| chunks.get(j)) {
                let slot = &mut staging.slots[(i - 1) % STAGING_SLOTS];
                bytes[at..at + len].copy_from_slice(&slot.as_slice()?[..len]);
            }
        }
        Ok(bytes)
    }

    /// Reads a tensor back as f32 (casting on the device first when stored in another dtype).
    pub fn download_f32(&self, tensor: &Tensor) -> Result<Vec<f32>, EncoderError> {
        if self.is_planning() {
            return Ok(Vec::new());
        }
        let source = if tensor.dtype == DType::F32 && tensor.is_contiguous() {
            tensor.clone()
        } else {
            let out = self.tensor(DType::F32, tensor.rows, tensor.cols)?;
            if tensor.dtype == DType::F32 {
                self.copy_rows(tensor, &out)?;
            } else {
                self.op(
                    |ws| CastArgs {
                        src: tensor.mat(),
                        out: out.mat(),
                        workspace: ws,
                    },
                    Device::cast_workspace,
                    Device::cast,
                )?;
            }
            out
        };
        Ok(self
            .download_bytes(&source)?
            .chunks_exact(4)
            .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
            .collect())
    }

    /// `act(x · wᵀ + bias)` into a new tensor. `weight` is a model weight: it does not change
    /// while it lives, so a device may keep it in the layout its kernels prefer.
    pub fn linear(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        activation: Activation,
    ) -> Result<Tensor, EncoderError> {
        let out = self.tensor(x.dtype, x.rows, weight.rows)?;
        self.gemm(x, weight, bias, activation, &out, false)?;
        Ok(out)
    }

    /// `out += x · wᵀ + bias` (a residual connection); `weight` as in [`Runner::linear`].
    pub fn linear_accumulate(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        out: &Tensor,
    ) -> Result<(), EncoderError> {
        self.gemm(x, weight, bias, Activation::NONE, out, true)
    }

    fn gemm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        activation: Activation,
        out: &Tensor,
        accumulate: bool,
    ) -> Result<(), EncoderError> {
        self.op(
            |workspace| GemmArgs {
                a: x.mat(),
                w: weight.mat(),
                bias: bias.map_or(MatRef::NONE, Tensor::mat),
                out: out.mat(),
                activation,
                accumulate,
                w_transposed: false,
                w_constant: true,
                workspace,
            },
            Device::gemm_workspace,
            Device::gemm,
        )
    }

    /// Layer norm of each row into a new tensor.
    pub fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor, EncoderError> {
        let out = self.tensor(x.dtype, x.rows, x.cols)?;
        self.op(
            |workspace| NormArgs {
                x: x.mat(),
                weight: weight.mat(),
                bias: bias.map_or(MatRef::NONE, Tensor::mat),
                out: out.mat(),
                eps,
                workspace,
            },
            Device::layer_norm_workspace,
            Device::layer_norm,
        )?;
        Ok(out)
    }

    /// RMS norm of each row into a new tensor.
    pub fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor, EncoderError> {
        let out = self.tensor(x.dtype, x.rows, x.cols)?;
        self.op(
            |workspace| NormArgs {
                x: x.mat(),
                weight: weight.mat(),
                bias: MatRef::NONE,
                out: out.mat(),
                eps,
                workspace,
            },
            Device::rms_norm_workspace,
            Device::rms_norm,
        )?;
        Ok(out)
    }

    /// `a ∘= b` in place (b full-shape or one broadcast row).
    pub fn binary_in_place(
        &self,
        a: &Tensor,
        b: &Tensor,
        op: BinaryOp,
    ) -> Result<(), EncoderError> {
        self.op(
            |workspace| BinaryArgs {
                a: a.mat(),
                b: b.mat(),
                out: a.mat(),
                op,
                workspace,
            },
            Device::binary_workspace,
            Device::binary,
        )
    }

    /// Rotary embedding in place on `x` (`[tokens, heads * head_dim]`) from f32 `cos` and
    /// `sin` tables (`[tokens, head_dim]`), uploaded once per forward pass.
    pub fn rotary(
        &self,
        x: &Tensor,
        heads: u64,
        head_dim: u64,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(), EncoderError> {
        self.op(
            |workspace| RotaryArgs {
                x: x.mat(),
                heads,
                head_dim,
                cos: cos.mat(),
                sin: sin.mat(),
                workspace,
            },
            Device::rotary_workspace,
            Device::rotary,
        )
    }

    /// Variable-length attention over `segments` into a new tensor; the workspace is
    /// allocated (and released) through the allocator.
    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        heads: u64,
        head_dim: u64,
        segments: &Segments,
    ) -> Result<Tensor, EncoderError> {
        let out = self.tensor(q.dtype, q.rows, q.cols)?;
        let scale = attention_scale(head_dim);
        self.op(
            |workspace| AttentionArgs {
                q: q.mat(),
                k: k.mat(),
                v: v.mat(),
                out: out.mat(),
                heads,
                head_dim,
                scale,
                cu_seqlens: RSlice::from_slice(&segments.host),
                cu_seqlens_device: segments.device.mat(),
                max_seqlen: segments.max_seqlen,
                workspace,
            },
            Device::attention_workspace,
            Device::attention,
        )?;
        Ok(out)
    }

    /// `out[i] = src[indices[i]]` into a new tensor; `indices` from [`Runner::indices`].
    pub fn gather_rows(&self, src: &Tensor, indices: &Tensor) -> Result<Tensor, EncoderError> {
        let out = self.tensor(src.dtype, indices.cols, src.cols)?;
        self.op(
            |workspace| GatherArgs {
                src: src.mat(),
                out: out.mat(),
                indices: indices.mat(),
                workspace,
            },
            Device::gather_rows_workspace,
            Device::gather_rows,
        )?;
        Ok(out)
    }

    /// Copies `src` into `out` row by row (same shape and dtype), in one batched copy.
    pub fn copy_rows(&self, src: &Tensor, out: &Tensor) -> Result<(), EncoderError> {
        if src.rows != out.rows || src.cols != out.cols || src.dtype != out.dtype {
            return Err(EncoderError::Shape(format!("copy of {src:?} into {out:?}")));
        }
        if self.is_planning() {
            return Ok(());
        }
        let (s, d) = (src.mat(), out.mat());
        let size = dtype_size(src.dtype);
        let regions: Vec<CopyRegion> = if src.is_contiguous() && out.is_contiguous() {
            vec![CopyRegion {
                src: s.buf,
                src_offset: s.offset,
                dst: d.buf,
                dst_offset: d.offset,
                bytes: src.bytes(),
            }]
        } else {
            (0..src.rows)
                .map(|row| CopyRegion {
                    src: s.buf,
                    src_offset: s.offset + row * s.row_stride * size,
                    dst: d.buf,
                    dst_offset: d.offset + row * d.row_stride * size,
                    bytes: src.cols * size,
                })
                .collect()
        };
        self.device.copy_batch(&regions)?;
        Ok(())
    }

    /// Runs one op: asks the device for the op's workspace, allocates it through the allocator
    /// (so that it is accounted, and counted in a plan), enqueues the op, and returns the
    /// workspace's block at once (the queue orders its later uses).
    fn op<A>(
        &self,
        args: impl Fn(BufferSlice) -> A,
        workspace: fn(&Device, &A) -> Result<u64, DeviceError>,
        run: fn(&Device, &A) -> Result<(), DeviceError>,
    ) -> Result<(), EncoderError> {
        let bytes = workspace(&self.device, &args(BufferSlice::EMPTY))?;
        let scratch = if bytes > 0 {
            Some(self.tensor(DType::U8, 1, bytes)?)
        } else {
            None
        };
        if self.is_planning() {
            return Ok(());
        }
        let slice = scratch.as_ref().map_or(BufferSlice::EMPTY, |ws| {
            let mat = ws.mat();
            BufferSlice {
                buf: mat.buf,
                offset: mat.offset,
                bytes,
            }
        });
        run(&self.device, &args(slice))?;
        Ok(())
    }

    /// Where `tensor`'s elements start on the device, when ops run and it has memory.
    fn target(&self, tensor: &Tensor) -> Option<(BufferHandle, u64)> {
        if self.is_planning() {
            return None;
        }
        let (handle, base) = tensor.storage.place()?;
        Some((handle, base + tensor.offset))
    }

    /// The runner's staging buffers, allocated on first use.
    fn staging(&self) -> Result<MutexGuard<'_, StagingRing>, EncoderError> {
        let mut guard = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.slots.is_empty() {
            for _ in 0..STAGING_SLOTS {
                guard
                    .slots
                    .push(self.device.host_buffer(STAGING_BYTES as u64)?);
            }
        }
        Ok(guard)
    }
}

/// Bytes per staging buffer: large enough that a transfer's fixed cost is small, small enough
/// that two of them stay in the caches of the CPU converting into them.
const STAGING_BYTES: usize = 1 << 20;
/// Staging buffers per runner: one filling while the other transfers.
const STAGING_SLOTS: usize = 2;

/// Host staging buffers used in turn (chunk `i` of a transfer through slot `i % 2`).
#[derive(Default)]
struct StagingRing {
    slots: Vec<HostBuffer>,
}

/// Attention segments of one forward pass (see [`Runner::segments`]).
pub struct Segments {
    /// Boundaries on the host.
    pub host: Vec<u32>,
    /// The same boundaries on the device, i32 `[1, len]`.
    pub device: Tensor,
    /// Length of the longest segment.
    pub max_seqlen: u64,
}

/// `head_dim^-0.5`, the attention score scale of every Qwen-VL tower.
pub fn attention_scale(head_dim: u64) -> f32 {
    // Head dims are small integers, exactly representable in f32.
    #[allow(clippy::cast_precision_loss)]
    let dim = head_dim as f32;
    1.0 / dim.sqrt()
}

/// Bytes per element of a dtype this ABI version defines (4 for unknown values, which the
/// device rejects before anything is read).
pub fn dtype_size(dtype: DType) -> u64 {
    dtype.size().unwrap_or(4)
}

/// Host f32 values as little-endian bytes of `dtype` (round to nearest even).
pub fn encode_f32(data: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::new();
    encode_f32_into(data, dtype, &mut out);
    out
}

/// [`encode_f32`] into a reused buffer (cleared first).
pub fn encode_f32_into(data: &[f32], dtype: DType, out: &mut Vec<u8>) {
    let size = usize::try_from(dtype_size(dtype)).unwrap_or(4);
    out.clear();
    out.resize(data.len() * size, 0);
    encode_f32_to(data, dtype, out);
}

/// The bytes of `values` as they lie in memory.
fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: any initialised f32 is four initialised bytes; u8 has no alignment needs and the
    // length covers exactly the slice.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// Host f32 values into `out`, exactly `data.len()` elements of `dtype`. Writing fixed-size
/// chunks of a sized buffer, rather than collecting a byte iterator, lets the compiler
/// vectorise the loop.
fn encode_f32_to(data: &[f32], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::F16 => {
            for (dst, v) in out.chunks_exact_mut(2).zip(data) {
                dst.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (dst, v) in out.chunks_exact_mut(2).zip(data) {
                dst.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        _ => {
            for (dst, v) in out.chunks_exact_mut(4).zip(data) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

fn shape_error(what: &str) -> EncoderError {
    EncoderError::Shape(format!("{what} does not fit in an i32"))
}

fn too_big() -> EncoderError {
    EncoderError::Shape("tensor larger than host memory can address".to_owned())
}
