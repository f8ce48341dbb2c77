//! `out = act(a · Wᵀ + bias) (+ out)` through the `gemm` crate's kernels, on the instruction set
//! of the device's kernel tier (`run_gemm`).
//!
//! f32 operands go to the kernel in place: a weight stored `[n, k]` is read as `Wᵀ` through its
//! strides, never copied. Bias is written into `out` first and the kernel accumulates onto it
//! (`read_dst`), so bias costs one pass over `out` and no extra memory; accumulation without an
//! activation is `read_dst` as well. An activation runs as a parallel pass over `out` after the
//! product; with both an activation and accumulation the product goes through a row-blocked f32
//! temporary, since the activation must apply before the old contents are added.
//!
//! bf16 operands run on the kernels of [`super::native`] on every tier but `generic` (bf16 dot
//! products or tiles, or f32 FMAs on bf16 widened in registers, [`super::fma`]); a constant
//! weight (`w_constant`) is packed once and kept in the device's [`super::native::PackCache`],
//! any other weight is packed for the call.
//!
//! Otherwise (f16 on every tier, bf16 on `generic`) operands are converted to f32 first: `a` once, the weight in blocks of
//! [`HALF_N_BLOCK`] output columns, each block's product landing in an f32 tile that the
//! epilogue converts into `out`.

use std::sync::Arc;

use gemm::Parallelism;
use iris_plugin::abi::{Activation, GemmArgs, PluginError};
use iris_plugin::validate::{self, Checker};
use rayon::prelude::*;

use super::native::{
    self as native, Bf16Mat, Epilogue, Kernel, OutMat, PackCache, PackKey, PackedB,
};
use super::{Elem, Touch, Touches, View, math, with_elem};
use crate::device::CpuDevice;
use crate::error::invalid;
use crate::memory::Memory;
use crate::queue::Exec;

/// Output columns per weight block on the f16/bf16 path: a `[512, 1280]` f32 block is 2.5 MiB.
pub const HALF_N_BLOCK: usize = 512;
/// Rows per block when an activation and accumulation are combined on the f32 path.
pub const ACCUMULATE_M_BLOCK: usize = 256;

/// A matrix for the kernel: pointer and strides in elements.
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub(crate) ptr: *const f32,
    pub(crate) col_stride: isize,
    pub(crate) row_stride: isize,
}

/// The kernel's row-major output: pointer and row stride in elements.
#[derive(Clone, Copy)]
pub(crate) struct Dst {
    pub(crate) ptr: *mut f32,
    pub(crate) row_stride: isize,
}

// SAFETY: operands and outputs are addresses of validated views or owned scratch that outlive
// the kernel call they are sent into; the kernel's threads write disjoint parts of `Dst`.
unsafe impl Send for Operand {}
// SAFETY: as above.
unsafe impl Sync for Operand {}
// SAFETY: as above.
unsafe impl Send for Dst {}
// SAFETY: as above.
unsafe impl Sync for Dst {}

impl CpuDevice {
    /// Checks [`GemmArgs`] and resolves the operands: the job to queue.
    pub(crate) fn prepare_gemm(&self, args: &GemmArgs) -> Result<GemmJob, PluginError> {
        const OP: &str = "gemm";
        let lens = self.lens();
        let checked = validate::gemm(&Checker::new(OP, &lens), args)?;
        // Only the native bf16 kernels read a packed copy; other paths read the weight itself.
        // A kept copy gives the weight's pages back to the OS, so a call that also reads those
        // bytes as `a` or `bias` would read zeros: such a call packs for itself, as for a
        // weight that is not constant.
        let w = &checked.w;
        let reads_w = |m: &validate::Mat| m.buf == w.buf && m.offset < w.end && w.offset < m.end;
        let packed = args.w_constant
            && w.dtype == iris_plugin::abi::DType::BF16
            && !reads_w(&checked.a)
            && !checked.bias.as_ref().is_some_and(reads_w)
            && Kernel::for_tier(self.tier()).is_some_and(Kernel::available);
        let cache = packed.then(|| WeightCache {
            packs: Arc::clone(&self.packs),
            memory: Arc::clone(&self.memory),
            key: PackKey {
                buf: checked.w.buf,
                offset: checked.w.offset,
                rows: checked.w.rows,
                cols: checked.w.cols,
                stride: checked.w.stride,
                transposed: args.w_transposed,
            },
        });
        Ok(GemmJob {
            a: View::new(self, OP, "a", &checked.a)?,
            w: View::new(self, OP, "w", &checked.w)?,
            bias: View::optional(self, OP, "bias", checked.bias.as_ref())?,
            out: View::new(self, OP, "out", &checked.out)?,
            m: checked.m,
            n: checked.n,
            k: checked.k,
            transposed: args.w_transposed,
            act: args.activation,
            accumulate: args.accumulate,
            cache,
        })
    }
}

impl GemmJob {
    /// Runs the product on `exec`'s pool.
    pub(crate) fn run(&self, exec: &Exec) -> Result<(), PluginError> {
        if self.m == 0 || self.n == 0 {
            return Ok(());
        }
        match self.a.dtype {
            iris_plugin::abi::DType::F32 => exec.gemm_f32(self),
            iris_plugin::abi::DType::BF16 => match exec.bf16_kernel() {
                Some(kernel) => exec.gemm_bf16(self, kernel),
                None => exec.gemm_half::<half::bf16>(self),
            },
            dtype => with_elem!("gemm", dtype, T => exec.gemm_half::<T>(self)),
        }
    }
}

impl Exec {
    fn gemm_f32(&self, job: &GemmJob) -> Result<(), PluginError> {
        let GemmJob { m, n, k, .. } = *job;
        let out = &job.out;
        let mut bias = vec![0.0f32; if job.bias.is_some() { n } else { 0 }];
        if let Some(view) = &job.bias {
            // SAFETY: `bias` is disjoint from `out` (checked), so nothing writes it.
            unsafe { view.load_row::<f32>(0, &mut bias) };
        }
        let bias = job.bias.as_ref().map(|_| bias.as_slice());
        let lhs = matrix(job.a.ptr::<f32>(), job.a.stride);
        let rhs = weight_operand(job.w.ptr::<f32>(), job.w.stride, job.transposed);
        let dst = Dst {
            ptr: out.ptr::<f32>(),
            row_stride: to_isize(out.stride)?,
        };
        if job.act == Activation::NONE || !job.accumulate {
            // Prefill: bias onto (accumulate) or into (overwrite) `out`.
            if let Some(bias) = bias {
                let accumulate = job.accumulate;
                self.par_rows(m, n, 0, |rows, _| {
                    for r in rows {
                        // SAFETY: each task owns its rows of `out`.
                        let row = unsafe { out.row_mut::<f32>(r) };
                        if accumulate {
                            math::add_assign(row, bias);
                        } else {
                            row.copy_from_slice(bias);
                        }
                    }
                });
            }
            let read_dst = bias.is_some() || job.accumulate;
            self.pool.install(|| {
                // SAFETY: `out` is a validated `[m, n]` view disjoint from `a` and `w`, whose
                // validated views cover `[m, k]` and the weight's `[n, k]` (or `[k, n]`) with
                // the strides passed; nothing else touches them during the call.
                unsafe { run_gemm(m, n, k, dst, read_dst, lhs, rhs, self.parallelism()) };
            });
            if job.act != Activation::NONE {
                let act = job.act;
                self.par_rows(m, n, 0, |rows, _| {
                    for r in rows {
                        // SAFETY: each task owns its rows of `out`.
                        math::activate_slice(act, unsafe { out.row_mut::<f32>(r) });
                    }
                });
            }
            return Ok(());
        }
        // Activation and accumulation: act(a·Wᵀ + bias) into a temporary, then add to `out`.
        let block = ACCUMULATE_M_BLOCK.min(m);
        let mut tmp = vec![0.0f32; block * n];
        for m0 in (0..m).step_by(block) {
            let mb = block.min(m - m0);
            let tile = &mut tmp[..mb * n];
            if let Some(bias) = bias {
                tile.chunks_exact_mut(n)
                    .for_each(|row| row.copy_from_slice(bias));
            }
            let lhs_block = Operand {
                // SAFETY: row `m0 < m` of the validated `a` view.
                ptr: unsafe { lhs.ptr.offset(to_isize(m0)? * lhs.row_stride) },
                ..lhs
            };
            let dst = Dst {
                ptr: tile.as_mut_ptr(),
                row_stride: to_isize(n)?,
            };
            self.pool.install(|| {
                // SAFETY: `tile` is an owned `[mb, n]` buffer; the operands are as above.
                unsafe {
                    run_gemm(
                        mb,
                        n,
                        k,
                        dst,
                        bias.is_some(),
                        lhs_block,
                        rhs,
                        self.parallelism(),
                    )
                };
            });
            let act = job.act;
            let tile = &tmp[..mb * n];
            self.par_rows(mb, n, n, |rows, scratch| {
                for r in rows {
                    scratch.copy_from_slice(&tile[r * n..(r + 1) * n]);
                    math::activate_slice(act, scratch);
                    // SAFETY: each task owns its rows of `out`.
                    math::add_assign(unsafe { out.row_mut::<f32>(m0 + r) }, scratch);
                }
            });
        }
        Ok(())
    }

    fn gemm_bf16(&self, job: &GemmJob, kernel: Kernel) -> Result<(), PluginError> {
        let GemmJob { m, n, k, .. } = *job;
        let w = Bf16Mat {
            ptr: job.w.ptr::<half::bf16>().cast::<u16>(),
            stride: job.w.stride,
        };
        // SAFETY: the validated weight view covers `[n, k]` (or `[k, n]`) and nothing writes
        // it while the op runs (it is disjoint from `out`).
        let pack = || unsafe { PackedB::pack(w, n, k, job.transposed, true, kernel) };
        let packed = self.pool.install(|| match &job.cache {
            // SAFETY: in queue order; the key is the validated bf16 weight view of `job.w`'s
            // region, which other work reaches only after `PackCache::touch` (see `touches`).
            Some(cache) => unsafe {
                cache.packs.get_or_pack(
                    cache.key,
                    job.w.region(),
                    || cache.memory.len_of(cache.key.buf).is_some(),
                    pack,
                )
            },
            None => Arc::new(pack()),
        });
        let mut bias = vec![0.0f32; if job.bias.is_some() { n } else { 0 }];
        if let Some(view) = &job.bias {
            // SAFETY: `bias` is disjoint from `out` (checked), so nothing writes it.
            unsafe { view.load_row::<half::bf16>(0, &mut bias) };
        }
        let epilogue = Epilogue {
            bias: job.bias.as_ref().map(|_| bias.as_slice()),
            act: job.act,
            accumulate: job.accumulate,
        };
        let a = Bf16Mat {
            ptr: job.a.ptr::<half::bf16>().cast::<u16>(),
            stride: job.a.stride,
        };
        let out = OutMat {
            ptr: job.out.ptr::<half::bf16>(),
            stride: job.out.stride,
        };
        // SAFETY: the CPU runs the kernel (checked by the caller); the views are validated
        // `[m, k]` and `[m, n]`, `out` overlaps neither `a`, `w` nor `bias`; `packed` is this
        // weight's `[n, k]` packing.
        unsafe {
            native::matmul(
                Some((&self.pool, self.threads)),
                m,
                n,
                k,
                a,
                &packed,
                out,
                epilogue,
            );
        }
        Ok(())
    }

    fn gemm_half<T: Elem>(&self, job: &GemmJob) -> Result<(), PluginError> {
        let GemmJob { m, n, k, .. } = *job;
        let out = &job.out;
        // `a` in f32, contiguous.
        let mut a32 = vec![0.0f32; m * k];
        self.convert_rows::<T>(&job.a, 0, k, &mut a32);
        let mut bias = vec![0.0f32; if job.bias.is_some() { n } else { 0 }];
        if let Some(view) = &job.bias {
            // SAFETY: `bias` is disjoint from `out` (checked), so nothing writes it.
            unsafe { view.load_row::<T>(0, &mut bias) };
        }
        let nb_max = HALF_N_BLOCK.min(n);
        let mut w32 = vec![0.0f32; nb_max * k];
        let mut o32 = vec![0.0f32; m * nb_max];
        let lhs = matrix(a32.as_ptr(), k);
        for j0 in (0..n).step_by(nb_max) {
            let nb = nb_max.min(n - j0);
            // The weight block in f32: `[nb, k]` rows, or `[k, nb]` column slices.
            let rhs = if job.transposed {
                self.convert_rows::<T>(&job.w, j0, nb, &mut w32[..k * nb]);
                weight_operand(w32.as_ptr(), nb, true)
            } else {
                let block = &mut w32[..nb * k];
                self.convert_row_range::<T>(&job.w, j0..j0 + nb, block);
                weight_operand(w32.as_ptr(), k, false)
            };
            let tile = &mut o32[..m * nb];
            if job.bias.is_some() {
                let bias = &bias[j0..j0 + nb];
                tile.chunks_exact_mut(nb)
                    .for_each(|row| row.copy_from_slice(bias));
            }
            let dst = Dst {
                ptr: tile.as_mut_ptr(),
                row_stride: to_isize(nb)?,
            };
            let read_dst = job.bias.is_some();
            self.pool.install(|| {
                // SAFETY: `tile` is an owned `[m, nb]` buffer; `a32` is `[m, k]` and the weight
                // block `[nb, k]` (or `[k, nb]`) as described by the operands.
                unsafe { run_gemm(m, nb, k, dst, read_dst, lhs, rhs, self.parallelism()) };
            });
            let tile = &o32[..m * nb];
            let (act, accumulate) = (job.act, job.accumulate);
            self.par_rows(m, nb, 2 * nb, |rows, scratch| {
                let (row, old) = scratch.split_at_mut(nb);
                for r in rows {
                    row.copy_from_slice(&tile[r * nb..(r + 1) * nb]);
                    math::activate_slice(act, row);
                    // SAFETY: each task owns its rows of `out`.
                    let dst = &mut unsafe { out.row_mut::<T>(r) }[j0..j0 + nb];
                    if accumulate {
                        T::load(dst, old);
                        math::add_assign(row, old);
                    }
                    T::store(row, dst);
                }
            });
        }
        Ok(())
    }

    /// Converts columns `c0..c0 + width` of every row of `view` into `dst` (`[rows, width]`).
    fn convert_rows<T: Elem>(&self, view: &View, c0: usize, width: usize, dst: &mut [f32]) {
        if width == 0 {
            return;
        }
        self.pool.install(|| {
            dst.par_chunks_mut(width)
                .with_min_len(64)
                .enumerate()
                .for_each(|(r, d)| {
                    // SAFETY: `view` is an operand disjoint from the op's output.
                    T::load(&unsafe { view.row::<T>(r) }[c0..c0 + width], d);
                });
        });
    }

    /// Converts rows `rows` of `view` into `dst` (`[rows.len(), cols]`).
    fn convert_row_range<T: Elem>(
        &self,
        view: &View,
        rows: std::ops::Range<usize>,
        dst: &mut [f32],
    ) {
        if view.cols == 0 {
            return;
        }
        self.pool.install(|| {
            dst.par_chunks_mut(view.cols)
                .with_min_len(64)
                .enumerate()
                .for_each(|(i, d)| {
                    // SAFETY: `view` is an operand disjoint from the op's output.
                    T::load(unsafe { view.row::<T>(rows.start + i) }, d);
                });
        });
    }
}

/// A checked gemm: operands, sizes and flags.
pub(crate) struct GemmJob {
    a: View,
    w: View,
    bias: Option<View>,
    out: View,
    m: usize,
    n: usize,
    k: usize,
    transposed: bool,
    act: Activation,
    accumulate: bool,
    /// Where a constant weight's packed copy is kept.
    cache: Option<WeightCache>,
}

impl Touches for GemmJob {
    fn touches(&self) -> Vec<Touch> {
        let mut touched = vec![self.a.touch(), self.out.touch()];
        touched.extend(self.bias.as_ref().map(View::touch));
        if self.cache.is_none() {
            touched.push(self.w.touch());
        }
        touched
    }
}

/// The device's cache of packed weights and what to look a weight up by.
struct WeightCache {
    packs: Arc<PackCache>,
    memory: Arc<Memory>,
    key: PackKey,
}

/// A row-major matrix operand with `row_stride` elements between rows. Strides come from
/// validated views (at most `isize::MAX` bytes, see `View::new`) or from scratch sizes.
pub(crate) fn matrix(ptr: *const f32, row_stride: usize) -> Operand {
    Operand {
        ptr,
        col_stride: 1,
        row_stride: row_stride as isize,
    }
}

/// The kernel's right operand `[k, n]` for a weight stored `[n, k]` (read as its transpose
/// through the strides) or, when `transposed`, stored `[k, n]`.
fn weight_operand(ptr: *const f32, stride: usize, transposed: bool) -> Operand {
    // See `matrix` for why the stride fits.
    let stride = stride as isize;
    if transposed {
        Operand {
            ptr,
            col_stride: 1,
            row_stride: stride,
        }
    } else {
        Operand {
            ptr,
            col_stride: stride,
            row_stride: 1,
        }
    }
}

fn to_isize(value: usize) -> Result<isize, PluginError> {
    isize::try_from(value).map_err(|_| invalid("gemm", format!("stride {value} is too large")))
}

/// `dst[m, n] = lhs[m, k] · rhs[k, n] (+ dst when read_dst)`, with `dst` row-major.
///
/// # Safety
/// The three matrices, with their strides and sizes, lie in live memory; `dst` is writable
/// and overlaps neither operand; no other thread touches `dst` during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run_gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: Dst,
    read_dst: bool,
    lhs: Operand,
    rhs: Operand,
    parallelism: Parallelism,
) {
    if k == 0 {
        if !read_dst {
            for r in 0..m {
                // SAFETY: row `r < m` of `dst` holds `n` writable elements (caller's contract).
                unsafe {
                    std::slice::from_raw_parts_mut(dst.ptr.offset(r as isize * dst.row_stride), n)
                }
                .fill(0.0);
            }
        }
        return;
    }
    let kernel = kernel_for(crate::isa::active());
    // The microkernels write columns of `dst`: like the `gemm` crate's own entry point, compute
    // a row-major product as its transpose, `dstᵀ = rhsᵀ · lhsᵀ`, whose `dst` is column-major.
    // Without this turn the kernels run at about half speed on the tower's shapes.
    let call = if dst.row_stride.abs() > 1 {
        GemmCall {
            m: n,
            n: m,
            k,
            dst: dst.ptr,
            dst_cs: dst.row_stride,
            dst_rs: 1,
            read_dst,
            lhs: rhs.ptr,
            lhs_cs: rhs.row_stride,
            lhs_rs: rhs.col_stride,
            rhs: lhs.ptr,
            rhs_cs: lhs.row_stride,
            rhs_rs: lhs.col_stride,
            parallelism,
        }
    } else {
        GemmCall {
            m,
            n,
            k,
            dst: dst.ptr,
            dst_cs: 1,
            dst_rs: dst.row_stride,
            read_dst,
            lhs: lhs.ptr,
            lhs_cs: lhs.col_stride,
            lhs_rs: lhs.row_stride,
            rhs: rhs.ptr,
            rhs_cs: rhs.col_stride,
            rhs_rs: rhs.row_stride,
            parallelism,
        }
    };
    // SAFETY: forwarded to the caller; the call describes the same product.
    unsafe { kernel(&call) };
}

/// One product in the `gemm` crate's terms: `dst[i, j]` at `i * dst_rs + j * dst_cs`, and so
/// on; every stride comes from a validated view or scratch size and is positive.
struct GemmCall {
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_cs: isize,
    dst_rs: isize,
    read_dst: bool,
    lhs: *const f32,
    lhs_cs: isize,
    lhs_rs: isize,
    rhs: *const f32,
    rhs_cs: isize,
    rhs_rs: isize,
    parallelism: Parallelism,
}

/// The signature of [`run_gemm`]'s per-instruction-set instantiations.
type GemmFn = unsafe fn(&GemmCall);

/// The `gemm` crate's f32 product on `simd`'s kernels (which the CPU runs: [`crate::isa`]
/// clamps the level to what it has). The crate's own entry point would pick AVX-512 wherever
/// the CPU has it, whatever the device's tier.
fn kernel_for(simd: crate::isa::Simd) -> GemmFn {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Simd;
        match simd {
            Simd::Avx512 => gemm_avx512,
            Simd::Avx2 => gemm_avx2,
            Simd::Baseline => gemm_scalar,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = simd;
        gemm_own_choice
    }
}

/// Instantiates the `gemm` crate's generic driver on one of its f32 microkernel sets, as its own
/// `gemm_def!` does per instruction set: `$lanes` f32 per register, `$simd` the matching
/// `gemm_common::simd` type. alpha = 1 keeps `dst` when `read_dst`, beta = 1 adds the product
/// unscaled.
#[cfg(target_arch = "x86_64")]
macro_rules! gemm_instance {
    ($(#[$meta:meta])* $name:ident, $kernels:path, $simd:ty, $lanes:expr) => {
        $(#[$meta])*
        ///
        /// # Safety
        /// As for [`run_gemm`], for the product `call` describes.
        #[inline(never)]
        unsafe fn $name(call: &GemmCall) {
            use gemm_common::simd::MixedSimd;
            use $kernels as kernels;
            let Some(simd) = <$simd as MixedSimd<f32, f32, f32, f32>>::try_new() else {
                // Unreachable while the tier is resolved against this CPU; the crate's own
                // choice is still a correct product.
                // SAFETY: forwarded to the caller.
                return unsafe { gemm_own_choice(call) };
            };
            // SAFETY: forwarded to the caller; the microkernels match `simd`'s instruction set
            // and `$lanes`, as in the crate's own instantiation.
            unsafe {
                gemm_common::gemm::gemm_basic_generic::<
                    _,
                    f32,
                    { $lanes },
                    { kernels::MR_DIV_N * $lanes },
                    { kernels::NR },
                    { kernels::MR_DIV_N },
                    { kernels::H_M },
                    { kernels::H_N },
                >(
                    simd,
                    call.m,
                    call.n,
                    call.k,
                    call.dst,
                    call.dst_cs,
                    call.dst_rs,
                    call.read_dst,
                    call.lhs,
                    call.lhs_cs,
                    call.lhs_rs,
                    call.rhs,
                    call.rhs_cs,
                    call.rhs_rs,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    |a, b, c| a * b + c,
                    &kernels::UKR,
                    &kernels::H_UKR,
                    false,
                    call.parallelism,
                );
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
gemm_instance!(
    /// The product on the `gemm` crate's AVX-512F microkernels (16 lanes).
    gemm_avx512,
    gemm_f32::microkernel::avx512f::f32,
    gemm_common::simd::V4,
    16
);
#[cfg(target_arch = "x86_64")]
gemm_instance!(
    /// The product on the `gemm` crate's AVX2+FMA microkernels (8 lanes).
    gemm_avx2,
    gemm_f32::microkernel::fma::f32,
    gemm_common::simd::V3,
    8
);
#[cfg(target_arch = "x86_64")]
gemm_instance!(
    /// The product on the `gemm` crate's scalar microkernels.
    gemm_scalar,
    gemm_f32::microkernel::scalar::f32,
    gemm_common::simd::Scalar,
    1
);

/// The product on the kernels the `gemm` crate picks at run time.
///
/// # Safety
/// As for [`run_gemm`], for the product `call` describes.
unsafe fn gemm_own_choice(call: &GemmCall) {
    // SAFETY: forwarded to the caller; alpha = 1 keeps `dst` when `read_dst`, beta = 1 adds
    // the product unscaled.
    unsafe {
        gemm::gemm(
            call.m,
            call.n,
            call.k,
            call.dst,
            call.dst_cs,
            call.dst_rs,
            call.read_dst,
            call.lhs,
            call.lhs_cs,
            call.lhs_rs,
            call.rhs,
            call.rhs_cs,
            call.rhs_rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            call.parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::{Simd, with_simd};

    /// `dst (+)= lhs · rhs` in f64, element by element through the same strides.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        lhs: &[f32],
        lhs_strides: (usize, usize),
        rhs: &[f32],
        rhs_strides: (usize, usize),
        dst: &[f32],
        dst_stride: usize,
        read_dst: bool,
    ) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = if read_dst {
                    f64::from(dst[i * dst_stride + j])
                } else {
                    0.0
                };
                for p in 0..k {
                    acc += f64::from(lhs[i * lhs_strides.0 + p * lhs_strides.1])
                        * f64::from(rhs[p * rhs_strides.0 + j * rhs_strides.1]);
                }
                out[i * n + j] = acc;
            }
        }
        out
    }

    /// Every instruction set this CPU runs computes the same products as the plain reference:
    /// row-major and one-column outputs (turned and not turned), a weight read as its
    /// transpose, padded rows, accumulation, sizes off every kernel's tile.
    #[test]
    fn each_instruction_set_matches_the_reference() {
        let sets: Vec<Simd> = [Simd::Baseline, Simd::Avx2, Simd::Avx512]
            .into_iter()
            .filter(|simd| {
                let ok = simd.supported();
                if !ok {
                    eprintln!("skipping {}: this CPU lacks it", simd.name());
                }
                ok
            })
            .collect();
        let shapes = [
            (1, 1, 1),
            (37, 1, 19),
            (1, 29, 23),
            (53, 47, 131),
            (130, 70, 64),
        ];
        for simd in sets {
            for (case, &(m, n, k)) in shapes.iter().enumerate() {
                for transposed_weight in [false, true] {
                    for read_dst in [false, true] {
                        let pad = case % 3;
                        let value = |i: usize| ((i * 7919 + case) % 97) as f32 / 97.0 - 0.5;
                        let lhs_stride = k + pad;
                        let lhs: Vec<f32> = (0..m * lhs_stride).map(value).collect();
                        // `[n, k]` read as its transpose, or `[k, n]` as is.
                        let (w_len, rhs_strides) = if transposed_weight {
                            (k * (n + pad), (n + pad, 1))
                        } else {
                            (n * (k + pad), (1, k + pad))
                        };
                        let w: Vec<f32> = (0..w_len).map(|i| value(i + 3)).collect();
                        let dst_stride = n + pad;
                        let mut dst: Vec<f32> = (0..m * dst_stride).map(|i| value(i + 5)).collect();
                        let want = reference(
                            m,
                            n,
                            k,
                            &lhs,
                            (lhs_stride, 1),
                            &w,
                            rhs_strides,
                            &dst,
                            dst_stride,
                            read_dst,
                        );
                        let rhs = Operand {
                            ptr: w.as_ptr(),
                            col_stride: rhs_strides.1 as isize,
                            row_stride: rhs_strides.0 as isize,
                        };
                        let out = Dst {
                            ptr: dst.as_mut_ptr(),
                            row_stride: dst_stride as isize,
                        };
                        with_simd(simd, || {
                            // SAFETY: owned vectors of the sizes the strides describe.
                            unsafe {
                                run_gemm(
                                    m,
                                    n,
                                    k,
                                    out,
                                    read_dst,
                                    matrix(lhs.as_ptr(), lhs_stride),
                                    rhs,
                                    Parallelism::None,
                                )
                            };
                        });
                        let tol = 1e-5 * (k as f64 + 1.0);
                        for i in 0..m {
                            for j in 0..n {
                                let got = f64::from(dst[i * dst_stride + j]);
                                let err = (got - want[i * n + j]).abs();
                                // `err <= tol` is false for NaN.
                                assert!(
                                    err <= tol,
                                    "{}: {m}x{n}x{k}, weight transposed {transposed_weight}, \
                                     read_dst {read_dst}: ({i}, {j}) off by {err}",
                                    simd.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
