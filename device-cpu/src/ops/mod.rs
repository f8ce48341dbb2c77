//! The CPU device's ops: f32 compute on f32, f16 and bf16 storage, on the device's rayon pool.
//!
//! Every op validates all of its arguments before it touches memory: buffer handles are known,
//! each view's byte range lies inside its buffer, dtypes and shapes agree, and operands that the
//! contract says must not overlap do not. Validation turns each [`MatRef`] into a [`View`], the
//! only place where device memory becomes a pointer; the typed row accessors on [`View`] are the
//! crate's small unsafe surface for ops.
//!
//! - [`gemm`]: matrix products through the `gemm` crate, with bias, activation and accumulation.
//! - [`attention`]: tiled variable-length attention with an online softmax, scratch carved out
//!   of the caller's workspace.
//! - [`norm`]: layer and RMS normalisation.
//! - [`elementwise`]: activations, binary add/mul, row gather and cast.
//! - [`rope`]: Qwen-VL's 2-D rotary embedding.
//! - [`math`]: vectorised exp, activations and reductions shared by the ops.

pub mod attention;
pub mod elementwise;
pub mod gemm;
pub(crate) mod math;
pub mod norm;
pub mod rope;

use std::ops::Range;
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use iris_plugin::abi::{BufferHandle, DType, MatRef, OpKind, PluginError};
use rayon::prelude::*;

use crate::device::CpuDevice;
use crate::error::invalid;
use crate::memory::{Region, check_range};

/// Ops this device implements: all of them.
pub const SUPPORTED: &[OpKind] = &OpKind::ALL;

/// Elements a row-parallel task handles at least, so that small ops do not drown in scheduling.
const MIN_ELEMENTS_PER_TASK: usize = 16 * 1024;

/// A storage element type: how rows of it convert to and from f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// Converts `src` into `dst` (same length).
    fn load(src: &[Self], dst: &mut [f32]);
    /// Converts `src` into `dst` (same length), rounding to nearest even.
    fn store(src: &[f32], dst: &mut [Self]);
}

impl Elem for f32 {
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Elem for f16 {
    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Elem for bf16 {
    fn load(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`. The dtype must have been
/// validated (by [`View::new`]); an unknown one still yields an invalid-argument error.
macro_rules! with_elem {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            iris_plugin::abi::DType::F32 => {
                type $T = f32;
                $body
            }
            iris_plugin::abi::DType::F16 => {
                type $T = half::f16;
                $body
            }
            iris_plugin::abi::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            other => Err($crate::error::invalid(
                $op,
                format!("unknown dtype {other}"),
            )),
        }
    };
}
pub(crate) use with_elem;

/// A validated [`MatRef`]: its buffer is alive for as long as the view, and every element of
/// every row lies inside the buffer and is aligned for the dtype.
pub(crate) struct View {
    /// Keeps the buffer alive while an op runs, even if it is freed concurrently.
    _region: Arc<Region>,
    /// Address of element (0, 0).
    base: *mut u8,
    /// The buffer.
    pub buf: BufferHandle,
    /// Storage type.
    pub dtype: DType,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Elements between row starts.
    pub stride: usize,
    /// Byte offset of the view in its buffer.
    pub offset: u64,
    /// End of the touched byte range in the buffer.
    pub end: u64,
}

// SAFETY: a view is an address inside a region it keeps alive; which rows a thread reads or
// writes is governed by the ops (disjoint row ranges per task) and the ABI contract (the host
// orders calls that touch the same buffer).
unsafe impl Send for View {}
// SAFETY: as above.
unsafe impl Sync for View {}

impl View {
    /// Validates `m` (argument `name` of `op`) against the device's buffers.
    pub(crate) fn new(
        dev: &CpuDevice,
        op: &str,
        name: &str,
        m: &MatRef,
    ) -> Result<View, PluginError> {
        let region = dev
            .memory
            .region(op, m.buf)
            .map_err(|_| invalid(op, format!("`{name}`: unknown buffer handle {}", m.buf.0)))?;
        let Some(size) = m.dtype.size() else {
            return Err(invalid(op, format!("`{name}`: unknown dtype {}", m.dtype)));
        };
        if m.row_stride < m.cols {
            return Err(invalid(
                op,
                format!(
                    "`{name}`: row_stride {} is smaller than cols {}",
                    m.row_stride, m.cols
                ),
            ));
        }
        if m.row_stride > isize::MAX as u64 / size {
            return Err(invalid(
                op,
                format!("`{name}`: row_stride {} is too large", m.row_stride),
            ));
        }
        if !m.offset.is_multiple_of(size) {
            return Err(invalid(
                op,
                format!(
                    "`{name}`: offset {} is not a multiple of the {} element size {size}",
                    m.offset, m.dtype
                ),
            ));
        }
        let (start, end) = m.byte_range().ok_or_else(|| {
            invalid(
                op,
                format!(
                    "`{name}`: a [{}, {}] view with row_stride {} at offset {} overflows",
                    m.rows, m.cols, m.row_stride, m.offset
                ),
            )
        })?;
        let start = check_range(op, &format!("`{name}`"), &region, start, end - start)?;
        let to_usize = |value: u64| {
            usize::try_from(value)
                .map_err(|_| invalid(op, format!("`{name}`: {value} does not fit in memory")))
        };
        let (rows, cols, stride) = (
            to_usize(m.rows)?,
            to_usize(m.cols)?,
            to_usize(m.row_stride)?,
        );
        // SAFETY: `start` lies inside the region (checked above).
        let base = unsafe { region.ptr().add(start) };
        Ok(View {
            _region: region,
            base,
            buf: m.buf,
            dtype: m.dtype,
            rows,
            cols,
            stride,
            offset: m.offset,
            end,
        })
    }

    /// Checks that the view is `[rows, cols]`.
    pub(crate) fn expect_shape(
        &self,
        op: &str,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(), PluginError> {
        if self.rows == rows && self.cols == cols {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!(
                    "`{name}`: expected shape [{rows}, {cols}], got [{}, {}]",
                    self.rows, self.cols
                ),
            ))
        }
    }

    /// Checks that the view has `dtype` (the dtype of operand `other`).
    pub(crate) fn expect_dtype(
        &self,
        op: &str,
        name: &str,
        dtype: DType,
        other: &str,
    ) -> Result<(), PluginError> {
        if self.dtype == dtype {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!(
                    "`{name}`: dtype {} differs from `{other}`'s {dtype}",
                    self.dtype
                ),
            ))
        }
    }

    /// Whether the byte ranges of the two views intersect (empty views never do).
    pub(crate) fn overlaps(&self, other: &View) -> bool {
        self.buf == other.buf
            && self.offset < self.end
            && other.offset < other.end
            && self.offset < other.end
            && other.offset < self.end
    }

    /// Whether the two views are the same elements in the same layout.
    pub(crate) fn same_as(&self, other: &View) -> bool {
        self.buf == other.buf
            && self.offset == other.offset
            && self.dtype == other.dtype
            && self.rows == other.rows
            && self.cols == other.cols
            && (self.stride == other.stride || self.rows <= 1)
    }

    /// Address of element (0, 0) as a `T` pointer. `T` must be the view's dtype.
    pub(crate) fn ptr<T: Elem>(&self) -> *mut T {
        debug_assert_eq!(Some(size_of::<T>() as u64), self.dtype.size());
        self.base.cast::<T>()
    }

    /// Row `r` as a slice.
    ///
    /// # Safety
    /// `T` is the view's dtype, `r < rows`, and no thread writes the row while the slice lives.
    pub(crate) unsafe fn row<T: Elem>(&self, r: usize) -> &[T] {
        debug_assert!(r < self.rows);
        // SAFETY: validated in `new`: every element of row `r` is inside the live region and
        // aligned (offset and element size agree); the caller rules out concurrent writes.
        unsafe { std::slice::from_raw_parts(self.ptr::<T>().add(r * self.stride), self.cols) }
    }

    /// Row `r` as a mutable slice.
    ///
    /// # Safety
    /// `T` is the view's dtype, `r < rows`, and no other reference to the row's elements (from
    /// this view or any other) lives while the slice does.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn row_mut<T: Elem>(&self, r: usize) -> &mut [T] {
        debug_assert!(r < self.rows);
        // SAFETY: as in `row`; exclusivity is the caller's obligation.
        unsafe { std::slice::from_raw_parts_mut(self.ptr::<T>().add(r * self.stride), self.cols) }
    }

    /// Columns `c0..c0 + len` of row `r`.
    ///
    /// # Safety
    /// As for [`View::row`], and `c0 + len <= cols`.
    pub(crate) unsafe fn segment<T: Elem>(&self, r: usize, c0: usize, len: usize) -> &[T] {
        debug_assert!(r < self.rows && c0 + len <= self.cols);
        // SAFETY: a sub-range of row `r` (see `row`).
        unsafe { std::slice::from_raw_parts(self.ptr::<T>().add(r * self.stride + c0), len) }
    }

    /// Columns `c0..c0 + len` of row `r`, mutable.
    ///
    /// # Safety
    /// As for [`View::row_mut`] restricted to those columns, and `c0 + len <= cols`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn segment_mut<T: Elem>(&self, r: usize, c0: usize, len: usize) -> &mut [T] {
        debug_assert!(r < self.rows && c0 + len <= self.cols);
        // SAFETY: a sub-range of row `r` (see `row_mut`).
        unsafe { std::slice::from_raw_parts_mut(self.ptr::<T>().add(r * self.stride + c0), len) }
    }

    /// Converts row `r` into `dst` (length `cols`).
    ///
    /// # Safety
    /// As for [`View::row`].
    pub(crate) unsafe fn load_row<T: Elem>(&self, r: usize, dst: &mut [f32]) {
        // SAFETY: forwarded to the caller.
        T::load(unsafe { self.row::<T>(r) }, dst);
    }

    /// Stores `src` (length `cols`) into row `r`.
    ///
    /// # Safety
    /// As for [`View::row_mut`].
    pub(crate) unsafe fn store_row<T: Elem>(&self, r: usize, src: &[f32]) {
        // SAFETY: forwarded to the caller.
        T::store(src, unsafe { self.row_mut::<T>(r) });
    }
}

/// Fails unless `out` is exactly `x` or does not overlap it.
pub(crate) fn alias_or_disjoint(
    op: &str,
    out_name: &str,
    out: &View,
    x_name: &str,
    x: &View,
) -> Result<(), PluginError> {
    if out.same_as(x) || !out.overlaps(x) {
        Ok(())
    } else {
        Err(overlap_error(op, out_name, x_name, "unless it is exactly"))
    }
}

/// Fails if `out` overlaps `x`.
pub(crate) fn disjoint(
    op: &str,
    out_name: &str,
    out: &View,
    x_name: &str,
    x: &View,
) -> Result<(), PluginError> {
    if out.overlaps(x) {
        Err(overlap_error(op, out_name, x_name, "at all, even as"))
    } else {
        Ok(())
    }
}

fn overlap_error(op: &str, out_name: &str, x_name: &str, rule: &str) -> PluginError {
    invalid(
        op,
        format!("`{out_name}` overlaps `{x_name}`; it may not overlap it {rule} the same view"),
    )
}

impl CpuDevice {
    /// Runs `f` on the device's pool over row ranges covering `0..rows`, each with an f32
    /// scratch of `scratch_len` elements.
    pub(crate) fn par_rows(
        &self,
        rows: usize,
        cols: usize,
        scratch_len: usize,
        f: impl Fn(Range<usize>, &mut [f32]) + Sync,
    ) {
        if rows == 0 {
            return;
        }
        let per_task = (MIN_ELEMENTS_PER_TASK / cols.max(1)).max(1);
        let tasks = rows.div_ceil(per_task);
        if tasks == 1 || self.options.threads == 1 {
            let mut scratch = vec![0.0; scratch_len];
            f(0..rows, &mut scratch);
            return;
        }
        self.pool.install(|| {
            (0..tasks).into_par_iter().for_each_init(
                || vec![0.0; scratch_len],
                |scratch, task| {
                    let start = task * per_task;
                    f(start..(start + per_task).min(rows), scratch);
                },
            );
        });
    }
}
