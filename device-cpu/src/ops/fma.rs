//! bf16 products on f32 fused multiply-adds: the micro-kernels behind [`Kernel::FmaAvx512`]
//! and [`Kernel::FmaAvx2`], for CPUs without a bf16 dot product, or with one slower than their
//! f32 FMAs.
//!
//! They read the weight packed as the dot-product and AMX kernels read it ([`PackedB`]: panels
//! of [`NR`] columns, each panel row one 32-bit word per column holding the bf16 pair
//! `(w[j, 2i], w[j, 2i + 1])`), so a model's weights are packed once and kept once, in bf16,
//! whichever kernel runs them. The pairs are widened in registers: a bf16 is the high half of
//! its f32, so the word shifted left by 16 bits is the even position's f32 and the word with
//! its low 16 bits cleared the odd position's. Two loads and four integer operations per panel
//! row (per half panel on AVX2) feed `4 x R` FMAs. The path this replaces converted the whole
//! weight to f32 in memory for every product and had the `gemm` crate pack that copy again.
//!
//! The left operand is packed per task already widened, `[pairs][R][2]` f32 per block of `R`
//! rows (the bits of each bf16 shifted into an f32), so each broadcast is one load.
//!
//! - AVX-512 (`Avx512`): blocks of 12 rows against the whole 32-column panel, 24
//!   accumulators; with the four widened weight vectors and the mask, 29 of the 32 vector
//!   registers are live.
//! - AVX2 (`Avx2`): blocks of 4 rows against each 16-column half of the panel in turn, 8
//!   accumulators, four widened weight vectors, the mask and the broadcast: 14 of 16 registers.
//!
//! [`Kernel::FmaAvx512`]: super::native::Kernel::FmaAvx512
//! [`Kernel::FmaAvx2`]: super::native::Kernel::FmaAvx2
//! [`PackedB`]: super::native::PackedB

use super::native::{Bf16Mat, Micro, NR, TileOut};

/// Rows per AVX-512 micro-kernel call.
pub const BLOCK_AVX512: usize = 12;
/// Rows per AVX2 micro-kernel call.
pub const BLOCK_AVX2: usize = 4;

/// The AVX-512F micro-kernel: blocks of [`BLOCK_AVX512`] rows against a panel.
#[derive(Default)]
pub(crate) struct Avx512;

/// The AVX2 micro-kernel: blocks of [`BLOCK_AVX2`] rows against a panel, a half at a time.
#[derive(Default)]
pub(crate) struct Avx2;

/// Packs rows `m0..m0 + rows` of `a` into `[pairs][height][2]` f32 bits per block of up to
/// `block` rows, so block `r0` starts at word `2 * r0 * pairs`; a missing odd position past
/// `k` is zero.
///
/// # Safety
/// The rows lie in live memory that nothing writes during the call.
unsafe fn pack_widened(
    a: Bf16Mat,
    m0: usize,
    rows: usize,
    k: usize,
    pairs: usize,
    block: usize,
    dst: &mut Vec<u32>,
) {
    debug_assert_eq!(pairs, k.div_ceil(2));
    dst.clear();
    dst.resize(2 * rows * pairs, 0);
    for r0 in (0..rows).step_by(block) {
        let height = block.min(rows - r0);
        let packed = &mut dst[2 * r0 * pairs..2 * (r0 + height) * pairs];
        for r in 0..height {
            // SAFETY: row `m0 + r0 + r` of `a` holds `k` values (caller's contract).
            let row = unsafe { a.ptr.add((m0 + r0 + r) * a.stride) };
            // A pair is one 32-bit word, the even position in its low half (little-endian):
            // one unaligned load gives both values, one shift and one mask widen them.
            for i in 0..k / 2 {
                // SAFETY: values `2i` and `2i + 1 < k` of the row.
                let word = unsafe { row.add(2 * i).cast::<u32>().read_unaligned() };
                let at = 2 * (i * height + r);
                packed[at] = word << 16;
                packed[at + 1] = word & 0xffff_0000;
            }
            if k % 2 == 1 {
                // SAFETY: the row's last value.
                packed[2 * ((pairs - 1) * height + r)] =
                    u32::from(unsafe { *row.add(k - 1) }) << 16;
            }
        }
    }
}

/// Defines a [`Micro`] over one kernel function: the packing above, and `block` dispatching
/// the tile height to the kernel's const parameter.
macro_rules! fma_micro {
    ($unit:ty, $block:expr, $kernel:ident, $($h:literal)*) => {
        impl Micro for $unit {
            const BLOCK: usize = $block;
            const TASK_ROWS: usize = $block * (96 / $block);
            const GRANULE: usize = 1;

            unsafe fn pack_rows(
                a: Bf16Mat,
                m0: usize,
                rows: usize,
                k: usize,
                pairs: usize,
                dst: &mut Vec<u32>,
            ) {
                // SAFETY: forwarded to the caller.
                unsafe { pack_widened(a, m0, rows, k, pairs, $block, dst) }
            }

            unsafe fn block(
                &mut self,
                packed: &[u32],
                r0: usize,
                height: usize,
                pairs: usize,
                panel: &[u32],
                out: TileOut,
            ) {
                let lhs = &packed[2 * r0 * pairs..2 * (r0 + height) * pairs];
                debug_assert!(panel.len() == pairs * NR);
                match height {
                    // SAFETY: the CPU has the kernel's features and `out` holds `height` rows
                    // (caller's contract); `lhs` holds `2 * pairs * height` f32 and `panel`
                    // `pairs * NR` words.
                    $($h => unsafe {
                        $kernel::<$h>(lhs.as_ptr().cast::<f32>(), panel.as_ptr(), pairs, out)
                    },)*
                    _ => unreachable!("tile height {height} outside 1..={}", $block),
                }
            }
        }
    };
}

fma_micro!(Avx512, BLOCK_AVX512, kernel_avx512, 1 2 3 4 5 6 7 8 9 10 11 12);
fma_micro!(Avx2, BLOCK_AVX2, kernel_avx2, 1 2 3 4);

/// Whether this CPU runs the AVX-512 kernel and the vector bf16 conversions beside it
/// (AVX-512F/BW).
pub(crate) fn available_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::isa::has_avx512() && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU runs the AVX2 kernel and its conversions (AVX2 and FMA).
pub(crate) fn available_avx2() -> bool {
    crate::isa::has_avx2_fma()
}

/// The AVX-512 micro-kernel: an `R x NR` f32 tile in registers over all `pairs` panel rows.
///
/// # Safety
/// The CPU has AVX-512F; `lhs` holds `2 * pairs * R` f32, `panel` `pairs * NR` words, and
/// `out` `R` rows of [`NR`] f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel_avx512<const R: usize>(
    lhs: *const f32,
    panel: *const u32,
    pairs: usize,
    out: TileOut,
) {
    use std::arch::x86_64::{
        _mm512_and_si512, _mm512_castps_si512, _mm512_castsi512_ps, _mm512_fmadd_ps,
        _mm512_loadu_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps, _mm512_slli_epi32,
        _mm512_storeu_ps,
    };
    // SAFETY (whole body): reads stay inside `lhs` (`2 * pairs * R` f32) and `panel`
    // (`pairs * NR` words) per the caller; writes inside `out`'s `R` rows of `NR` f32.
    unsafe {
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        // The high half of each word: the odd position's bf16 as an f32.
        let odd = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        let (mut a, mut b) = (lhs, panel);
        for _ in 0..pairs {
            let w0 = _mm512_castps_si512(_mm512_loadu_ps(b.cast::<f32>()));
            let w1 = _mm512_castps_si512(_mm512_loadu_ps(b.add(16).cast::<f32>()));
            let even0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w0));
            let odd0 = _mm512_castsi512_ps(_mm512_and_si512(w0, odd));
            let even1 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w1));
            let odd1 = _mm512_castsi512_ps(_mm512_and_si512(w1, odd));
            for r in 0..R {
                let x = _mm512_set1_ps(*a.add(2 * r));
                lo[r] = _mm512_fmadd_ps(x, even0, lo[r]);
                hi[r] = _mm512_fmadd_ps(x, even1, hi[r]);
                let y = _mm512_set1_ps(*a.add(2 * r + 1));
                lo[r] = _mm512_fmadd_ps(y, odd0, lo[r]);
                hi[r] = _mm512_fmadd_ps(y, odd1, hi[r]);
            }
            a = a.add(2 * R);
            b = b.add(NR);
        }
        for r in 0..R {
            let row = out.ptr.add(r * out.stride);
            _mm512_storeu_ps(row, lo[r]);
            _mm512_storeu_ps(row.add(16), hi[r]);
        }
    }
}

/// The AVX2 micro-kernel: an `R x 16` f32 tile in registers over all `pairs` panel rows, for
/// each half of the panel in turn.
///
/// # Safety
/// The CPU has AVX2 and FMA; `lhs` holds `2 * pairs * R` f32, `panel` `pairs * NR` words, and
/// `out` `R` rows of [`NR`] f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2<const R: usize>(
    lhs: *const f32,
    panel: *const u32,
    pairs: usize,
    out: TileOut,
) {
    use std::arch::x86_64::{
        _mm256_and_si256, _mm256_castps_si256, _mm256_castsi256_ps, _mm256_fmadd_ps,
        _mm256_loadu_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_ps, _mm256_slli_epi32,
        _mm256_storeu_ps,
    };
    // SAFETY (whole body): as for `kernel_avx512`.
    unsafe {
        let odd = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        for half in [0, NR / 2] {
            let mut lo = [_mm256_setzero_ps(); R];
            let mut hi = [_mm256_setzero_ps(); R];
            let (mut a, mut b) = (lhs, panel.add(half));
            for _ in 0..pairs {
                let w0 = _mm256_castps_si256(_mm256_loadu_ps(b.cast::<f32>()));
                let w1 = _mm256_castps_si256(_mm256_loadu_ps(b.add(8).cast::<f32>()));
                let even0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w0));
                let odd0 = _mm256_castsi256_ps(_mm256_and_si256(w0, odd));
                let even1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w1));
                let odd1 = _mm256_castsi256_ps(_mm256_and_si256(w1, odd));
                for r in 0..R {
                    let x = _mm256_set1_ps(*a.add(2 * r));
                    lo[r] = _mm256_fmadd_ps(x, even0, lo[r]);
                    hi[r] = _mm256_fmadd_ps(x, even1, hi[r]);
                    let y = _mm256_set1_ps(*a.add(2 * r + 1));
                    lo[r] = _mm256_fmadd_ps(y, odd0, lo[r]);
                    hi[r] = _mm256_fmadd_ps(y, odd1, hi[r]);
                }
                a = a.add(2 * R);
                b = b.add(NR);
            }
            for r in 0..R {
                let row = out.ptr.add(r * out.stride + half);
                _mm256_storeu_ps(row, lo[r]);
                _mm256_storeu_ps(row.add(8), hi[r]);
            }
        }
    }
}

/// Portable stand-ins so that the crate builds elsewhere; never called (the kernels are not
/// available there).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel_avx512<const R: usize>(
    _lhs: *const f32,
    _panel: *const u32,
    _pairs: usize,
    _out: TileOut,
) {
    unreachable!("the bf16 kernels need x86-64")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel_avx2<const R: usize>(
    _lhs: *const f32,
    _panel: *const u32,
    _pairs: usize,
    _out: TileOut,
) {
    unreachable!("the bf16 kernels need x86-64")
}
