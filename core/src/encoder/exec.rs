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
        let (buf, base) = match self.storage.as_ref() {
            Storage::Device(buffer) => (buffer.handle(), buffer.offset()),
            Storage::Planned(_) | Storage::Dry(_) => (iris_plugin::BufferHandle::NULL, 0),
        };
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
    staging: Arc<Mutex<StagingRing>>,
}

#[derive(Default)]
struct PlanState {
    live: u64,
    peak: u64,
}

struct PlannedBlock {
    bytes: u64,
    state: Arc<Mutex<PlanState>>,
}

impl Drop for PlannedBlock {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.live -= self.bytes;
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
            staging: Arc::default(),
        })
    }

    /// Peak live bytes seen so far in planning mode (0 when executing).
    pub fn planned_peak(&self) -> u64 {
        self.plan.as_ref().map_or(0, |state| {
            state.lock().unwrap_or_else(PoisonError::into_inner).peak
        })
    }

    /// Whether ops are skipped (planning or a dry run).
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
        let bytes = (rows * cols * dtype_size(dtype)).max(1);
        let storage = match &self.plan {
            Some(state) => {
                let rounded = round_size(bytes).unwrap_or(bytes);
                let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
                guard.live += rounded;
                guard.peak = guard.peak.max(guard.live);
                Storage::Planned(PlannedBlock {
                    bytes: rounded,
                    state: Arc::clone(state),
                })
            }
            None if self.dry => Storage::Dry(self.allocator.alloc(bytes)?),
            None => Storage::Device(self.allocator.alloc(bytes)?),
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

    /// Uploads host f32 data as a `rows x cols` tensor of `dtype` (converted on the host).
    pub fn upload_f32(
        &self,
        data: &[f32],
        dtype: DType,
        rows: u64,
        cols: u64,
    ) -> Result<Tensor, EncoderError> {
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
        if let Storage::Device(buffer) = tensor.storage.as_ref() {
            self.stage_f32(buffer.handle(), buffer.offset(), parts, dtype)?;
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
    /// copies (its `finish` or drop waits for them). A tensor of another dtype is written as
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
        // The device reads the values' bytes as they lie in memory: little-endian f32.
        if cfg!(target_endian = "big") || !self.device.has_async_write() {
            return self.upload_f32_parts(parts, dtype, rows, cols);
        }
        if dtype != DType::F32 {
            if self.is_planning() || !self.device.supports(OpKind::CAST) {
                return self.upload_f32_parts(parts, dtype, rows, cols);
            }
            let values = self.upload_f32_parts_lent(parts, DType::F32, rows, cols, writes)?;
            let out = self.tensor(dtype, rows, cols)?;
            self.op(
                |ws| CastArgs {
                    src: values.mat(),
                    out: out.mat(),
                    workspace: ws,
                },
                Device::cast_workspace,
                Device::cast,
            )?;
            return Ok(out);
        }
        let tensor = self.parts_tensor(parts, dtype, rows, cols)?;
        if let Storage::Device(buffer) = tensor.storage.as_ref() {
            let mut offset = buffer.offset();
            for part in parts {
                let bytes = f32_bytes(part);
                if !writes.write(buffer.handle(), offset, bytes)? {
                    // The plugin turned such writes down after all: stage this part.
                    self.stage_f32(buffer.handle(), offset, &[part], dtype)?;
                }
                offset += bytes.len() as u64;
            }
        }
        Ok(tensor)
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
        if let Storage::Device(buffer) = tensor.storage.as_ref() {
            buffer.write(0, bytes)?;
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
