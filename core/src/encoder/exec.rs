//! Tensors and the op runner the vision towers are written against.
//!
//! A [`Runner`] executes ABI ops on a device, allocating every intermediate through the caching
//! allocator; dropping a [`Tensor`] returns its block to the pool, so a tower's live set, and
//! with it the peak, follows the graph. The same tower code runs in *planning* mode
//! ([`Runner::planner`]): no op executes and no device memory is touched, but every allocation is
//! sized and rounded as the allocator rounds requests, which yields the peak activation memory of
//! a batch before running it. The measured peak can exceed the plan only by the remainders the
//! allocator leaves unsplit when it reuses a larger cached block (under 1 MiB per block).

use std::sync::{Arc, Mutex, PoisonError};

use abi_stable::std_types::RSlice;
use iris_plugin::abi::{
    AttentionArgs, BinaryArgs, BufferSlice, CastArgs, GatherArgs, GemmArgs, NormArgs, Rope2dArgs,
};
use iris_plugin::{Activation, BinaryOp, DType, Device, MatRef};

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
            Storage::Planned(_) => (iris_plugin::BufferHandle::NULL, 0),
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
        }
    }

    /// A runner that executes nothing and records the peak of live allocator bytes.
    pub fn planner(allocator: Arc<CachingAllocator>) -> Runner {
        Runner {
            device: Arc::clone(allocator.device()),
            allocator,
            plan: Some(Arc::new(Mutex::new(PlanState::default()))),
        }
    }

    /// Peak live bytes seen so far in planning mode (0 when executing).
    pub fn planned_peak(&self) -> u64 {
        self.plan.as_ref().map_or(0, |state| {
            state.lock().unwrap_or_else(PoisonError::into_inner).peak
        })
    }

    /// Whether ops execute.
    pub fn is_planning(&self) -> bool {
        self.plan.is_some()
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
    /// Conversion goes through a staging buffer of bounded size, so a batch of images is never
    /// copied whole on the host.
    pub fn upload_f32_parts(
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
        /// Elements converted per device write: 1 MiB of f32.
        const STAGING_ELEMENTS: usize = 1 << 18;
        let tensor = self.tensor(dtype, rows, cols)?;
        if let Storage::Device(buffer) = tensor.storage.as_ref() {
            let mut staging = Vec::new();
            let mut offset = 0;
            for chunk in parts.iter().flat_map(|p| p.chunks(STAGING_ELEMENTS)) {
                encode_f32_into(chunk, dtype, &mut staging);
                buffer.write(offset, &staging)?;
                offset += staging.len() as u64;
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
        self.device.read(mat.buf, mat.offset, &mut bytes)?;
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
                self.device.cast(&CastArgs {
                    src: tensor.mat(),
                    out: out.mat(),
                })?;
            }
            out
        };
        let mut bytes = vec![0u8; usize::try_from(source.bytes()).map_err(|_| too_big())?];
        let mat = source.mat();
        self.device.read(mat.buf, mat.offset, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
            .collect())
    }

    /// `act(x · wᵀ + bias)` into a new tensor.
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

    /// `out += x · wᵀ + bias` (a residual connection).
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
        if self.is_planning() {
            return Ok(());
        }
        self.device.gemm(&GemmArgs {
            a: x.mat(),
            w: weight.mat(),
            bias: bias.map_or(MatRef::NONE, Tensor::mat),
            out: out.mat(),
            activation,
            accumulate,
            w_transposed: false,
        })?;
        Ok(())
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
        if !self.is_planning() {
            self.device.layer_norm(&NormArgs {
                x: x.mat(),
                weight: weight.mat(),
                bias: bias.map_or(MatRef::NONE, Tensor::mat),
                out: out.mat(),
                eps,
            })?;
        }
        Ok(out)
    }

    /// RMS norm of each row into a new tensor.
    pub fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor, EncoderError> {
        let out = self.tensor(x.dtype, x.rows, x.cols)?;
        if !self.is_planning() {
            self.device.rms_norm(&NormArgs {
                x: x.mat(),
                weight: weight.mat(),
                bias: MatRef::NONE,
                out: out.mat(),
                eps,
            })?;
        }
        Ok(out)
    }

    /// `a ∘= b` in place (b full-shape or one broadcast row).
    pub fn binary_in_place(
        &self,
        a: &Tensor,
        b: &Tensor,
        op: BinaryOp,
    ) -> Result<(), EncoderError> {
        if self.is_planning() {
            return Ok(());
        }
        self.device.binary(&BinaryArgs {
            a: a.mat(),
            b: b.mat(),
            out: a.mat(),
            op,
        })?;
        Ok(())
    }

    /// 2-D rotary embedding in place on `x` (`[tokens, heads * head_dim]`).
    pub fn rope_2d(
        &self,
        x: &Tensor,
        heads: u64,
        head_dim: u64,
        positions: &[u32],
        theta: f32,
    ) -> Result<(), EncoderError> {
        if self.is_planning() {
            return Ok(());
        }
        self.device.rope_2d(&Rope2dArgs {
            x: x.mat(),
            heads,
            head_dim,
            positions: RSlice::from_slice(positions),
            theta,
        })?;
        Ok(())
    }

    /// Variable-length attention over `cu_seqlens` segments into a new tensor; the workspace is
    /// allocated (and released) through the allocator.
    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        heads: u64,
        head_dim: u64,
        cu_seqlens: &[u32],
    ) -> Result<Tensor, EncoderError> {
        let out = self.tensor(q.dtype, q.rows, q.cols)?;
        let scale = attention_scale(head_dim);
        let mut args = AttentionArgs {
            q: q.mat(),
            k: k.mat(),
            v: v.mat(),
            out: out.mat(),
            heads,
            head_dim,
            scale,
            cu_seqlens: RSlice::from_slice(cu_seqlens),
            workspace: BufferSlice::EMPTY,
        };
        let workspace_bytes = self.device.attention_workspace(&args)?;
        let workspace = if workspace_bytes > 0 {
            Some(self.tensor(DType::F32, 1, workspace_bytes.div_ceil(4))?)
        } else {
            None
        };
        if let Some(workspace) = &workspace {
            let mat = workspace.mat();
            args.workspace = BufferSlice {
                buf: mat.buf,
                offset: mat.offset,
                bytes: workspace_bytes,
            };
        }
        if !self.is_planning() {
            self.device.attention(&args)?;
        }
        drop(workspace);
        Ok(out)
    }

    /// `out[i] = src[indices[i]]` into a new tensor.
    pub fn gather_rows(&self, src: &Tensor, indices: &[u32]) -> Result<Tensor, EncoderError> {
        let out = self.tensor(src.dtype, indices.len() as u64, src.cols)?;
        if !self.is_planning() {
            self.device.gather_rows(&GatherArgs {
                src: src.mat(),
                out: out.mat(),
                indices: RSlice::from_slice(indices),
            })?;
        }
        Ok(out)
    }

    /// Copies `src` into `out` row by row (same shape and dtype).
    pub fn copy_rows(&self, src: &Tensor, out: &Tensor) -> Result<(), EncoderError> {
        if src.rows != out.rows || src.cols != out.cols || src.dtype != out.dtype {
            return Err(EncoderError::Shape(format!("copy of {src:?} into {out:?}")));
        }
        if self.is_planning() {
            return Ok(());
        }
        let (s, d) = (src.mat(), out.mat());
        let size = dtype_size(src.dtype);
        if src.is_contiguous() && out.is_contiguous() {
            self.device
                .copy(d.buf, d.offset, s.buf, s.offset, src.bytes())?;
            return Ok(());
        }
        let regions: Vec<_> = (0..src.rows)
            .map(|row| iris_plugin::CopyRegion {
                src_offset: s.offset + row * s.row_stride * size,
                dst_offset: d.offset + row * d.row_stride * size,
                bytes: src.cols * size,
            })
            .collect();
        self.device.copy_regions(d.buf, s.buf, &regions)?;
        Ok(())
    }
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

/// [`encode_f32`] into a reused buffer (cleared first). Writing fixed-size chunks of a sized
/// buffer, rather than collecting a byte iterator, lets the compiler vectorise the loop.
pub fn encode_f32_into(data: &[f32], dtype: DType, out: &mut Vec<u8>) {
    let size = usize::try_from(dtype_size(dtype)).unwrap_or(4);
    out.clear();
    out.resize(data.len() * size, 0);
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

fn too_big() -> EncoderError {
    EncoderError::Shape("tensor larger than host memory can address".to_owned())
}
