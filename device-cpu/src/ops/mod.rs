//! The CPU device's ops: f32 compute on f32, f16 and bf16 storage, on the device's rayon pool.
//!
//! Every op is split in two. Its `prepare_*` function runs when the call is made: it checks
//! every argument with [`iris_plugin::validate`] (buffer handles known, byte ranges inside
//! their buffers, dtypes and shapes that agree, no forbidden overlaps) and turns each checked
//! operand into a `View`, the only place where device memory becomes a pointer and which
//! keeps its buffer alive. The prepared job then runs on the device's queue (see
//! [`crate::queue`]). The typed row accessors on `View` are the crate's small unsafe surface
//! for ops.
//!
//! - [`gemm`]: matrix products through the `gemm` crate, with bias, activation and accumulation;
//!   bf16 products on the native kernels of [`native`] when the kernel tier has them.
//! - [`native`]: native bf16 matrix products on packed weights, and the cache of packed weights.
//! - [`amx`]: the AMX-BF16 tile micro-kernel of [`native`]; `pack` moves bf16 operands into
//!   the layouts both kernels read.
//! - [`attention`]: tiled variable-length attention with an online softmax, scratch carved out
//!   of the caller's workspace.
//! - [`norm`]: layer and RMS normalisation.
//! - [`elementwise`]: activations, binary add/mul, row gather and cast.
//! - [`rotary`]: rotary position embedding from cos/sin tables.
//! - `math`: vectorised exp, activations and reductions shared by the ops.

pub mod amx;
pub mod attention;
pub mod elementwise;
pub mod fma;
pub mod gemm;
pub(crate) mod math;
pub mod native;
pub mod norm;
pub(crate) mod pack;
pub mod rotary;

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use iris_plugin::abi::{BufferHandle, DType, OpKind, PluginError};
use iris_plugin::validate::Mat;

use crate::device::CpuDevice;
use crate::error::invalid;
use crate::memory::Region;

/// Ops this device implements: all of them.
pub const SUPPORTED: &[OpKind] = &OpKind::ALL;

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

/// Bytes of a buffer an op's work reads or writes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Touch {
    pub(crate) buf: BufferHandle,
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// A prepared op: the bytes it touches, so that packed weights over them are put back first.
pub(crate) trait Touches {
    /// Every view the op reads or writes, except a weight it reads through its packed copy.
    fn touches(&self) -> Vec<Touch>;
}

/// A checked operand ([`Mat`]) resolved to memory: its buffer is alive for as long as the view, and every element of
/// every row lies inside the buffer and is aligned for the dtype.
pub(crate) struct View {
    /// Keeps the buffer alive while an op runs, even if it is freed concurrently.
    region: Arc<Region>,
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
    /// Bytes `[start, end)` of the buffer the view covers.
    pub start: u64,
    /// See `start`.
    pub end: u64,
}

// SAFETY: a view is an address inside a region it keeps alive; which rows a thread reads or
// writes is governed by the ops (disjoint row ranges per task) and the ABI contract (the host
// orders calls that touch the same buffer).
unsafe impl Send for View {}
// SAFETY: as above.
unsafe impl Sync for View {}

impl View {
    /// The view of a checked operand `m` (argument `name` of `op`): looks its buffer up and
    /// keeps it alive. [`iris_plugin::validate`] has checked the range and alignment against
    /// the buffer's length, which cannot change while the handle is known.
    pub(crate) fn new(dev: &CpuDevice, op: &str, name: &str, m: &Mat) -> Result<View, PluginError> {
        let region = dev
            .memory
            .region(op, m.buf)
            .map_err(|_| invalid(op, format!("`{name}`: unknown buffer handle {}", m.buf.0)))?;
        if m.end > region.len() as u64 {
            return Err(invalid(
                op,
                format!(
                    "`{name}`: bytes up to {} lie outside the buffer of {} bytes",
                    m.end,
                    region.len()
                ),
            ));
        }
        let start = usize::try_from(m.offset).map_err(|_| {
            invalid(
                op,
                format!("`{name}`: offset {} does not fit in memory", m.offset),
            )
        })?;
        // SAFETY: `start <= end <= len` (checked above), so the address is inside the region.
        let base = unsafe { region.ptr().add(start) };
        Ok(View {
            region,
            base,
            buf: m.buf,
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
            stride: m.stride,
            start: m.offset,
            end: m.end,
        })
    }

    /// The buffer's region.
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// What [`crate::ops::native::PackCache::touch`] needs before an op reads or writes the
    /// view's bytes.
    pub(crate) fn touch(&self) -> Touch {
        Touch {
            buf: self.buf,
            start: self.start,
            end: self.end,
        }
    }

    /// The view of an optional checked operand.
    pub(crate) fn optional(
        dev: &CpuDevice,
        op: &str,
        name: &str,
        m: Option<&Mat>,
    ) -> Result<Option<View>, PluginError> {
        m.map(|m| View::new(dev, op, name, m)).transpose()
    }

    /// Address of element (0, 0).
    pub(crate) fn addr(&self) -> *mut u8 {
        self.base
    }

    /// Row 0 of an i32 vector (indices, segment boundaries).
    ///
    /// # Safety
    /// The view's dtype is i32, it has at least one row, and no thread writes the row while the
    /// slice lives.
    pub(crate) unsafe fn i32_row(&self) -> &[i32] {
        debug_assert!(self.dtype == DType::I32 && self.rows >= 1);
        // SAFETY: validated: the row lies inside the live region, aligned for i32 (offset a
        // multiple of 4 and buffers 64-byte aligned); the caller rules out concurrent writes.
        unsafe { std::slice::from_raw_parts(self.base.cast::<i32>(), self.cols) }
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
