//! Moving bf16 operands into the layouts the native kernels read, with AVX-512 where the CPU
//! has it and plain loops elsewhere.
//!
//! Both layouts are built from 32-bit *words*, each a pair of consecutive bf16 along `k`
//! (little-endian: the first value in the low half). A row-major bf16 row is therefore already a
//! row of words, and packing is one of two moves:
//!
//! - [`transpose_words`]: up to 16 rows of words into columns, for the dot-product kernel's
//!   packed rows (`[pairs][rows]`) and for weights stored `[n, k]` (`[pairs][NR]` panels). The
//!   vector path loads 16 words from each row, transposes the 16 x 16 block in registers (64
//!   shuffles) and stores each column with one masked store.
//! - [`interleave_rows`]: two rows of bf16 (`k = 2i` and `2i + 1`) into one row of words, for
//!   weights stored `[k, n]` (attention's values): each half widened to 32 bits, the second
//!   shifted into the high half.
//!
//! Packing runs for every attention block and every task's rows, so it is on the hot path: the
//! scalar loops cost about as much as the products they feed at attention's small `k`.

/// Word `i` of `rows` rows into `dst[i * dst_stride + r]`, for rows `r < rows ≤ 16` whose words
/// start at `src(r)` (any alignment), and words `i < words`.
///
/// # Safety
/// Each row holds `words` words of live memory, `dst` holds `(words - 1) * dst_stride + rows`
/// words nothing else touches, and the two do not overlap.
pub(crate) unsafe fn transpose_words(
    rows: usize,
    words: usize,
    src: impl Fn(usize) -> *const u32,
    dst: *mut u32,
    dst_stride: usize,
) {
    debug_assert!(rows <= 16);
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512F; the rest is forwarded to the caller.
        unsafe { transpose_words_avx512(rows, words, &src, dst, dst_stride) };
        return;
    }
    // SAFETY: forwarded to the caller.
    unsafe { transpose_words_scalar(rows, words, &src, dst, dst_stride) };
}

/// `dst[j] = lo[j] | hi[j] << 16` for `j < cols`, with `hi` zero when absent.
///
/// # Safety
/// `lo` (and `hi`) hold `cols` live bf16, `dst` holds `cols` words nothing else touches.
pub(crate) unsafe fn interleave_rows(
    lo: *const u16,
    hi: Option<*const u16>,
    cols: usize,
    dst: *mut u32,
) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512F/BW/VL; the rest is forwarded to the caller.
        unsafe { interleave_rows_avx512(lo, hi, cols, dst) };
        return;
    }
    // SAFETY: forwarded to the caller.
    unsafe { interleave_rows_scalar(lo, hi, cols, dst) };
}

/// Whether the vector paths run: AVX-512F and BW (cached by the standard library).
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

/// [`transpose_words`] one word at a time.
///
/// # Safety
/// As for [`transpose_words`].
unsafe fn transpose_words_scalar(
    rows: usize,
    words: usize,
    src: &impl Fn(usize) -> *const u32,
    dst: *mut u32,
    dst_stride: usize,
) {
    for r in 0..rows {
        let row = src(r);
        for i in 0..words {
            // SAFETY: inside the row and `dst` (caller's contract).
            unsafe { *dst.add(i * dst_stride + r) = row.add(i).read_unaligned() };
        }
    }
}

/// [`interleave_rows`] one word at a time.
///
/// # Safety
/// As for [`interleave_rows`].
unsafe fn interleave_rows_scalar(
    lo: *const u16,
    hi: Option<*const u16>,
    cols: usize,
    dst: *mut u32,
) {
    for j in 0..cols {
        // SAFETY: inside the rows and `dst` (caller's contract).
        unsafe {
            let high = hi.map_or(0, |hi| u32::from(*hi.add(j)));
            *dst.add(j) = u32::from(*lo.add(j)) | high << 16;
        }
    }
}

/// [`transpose_words`] 16 words of 16 rows at a time.
///
/// # Safety
/// As for [`transpose_words`], on a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_words_avx512(
    rows: usize,
    words: usize,
    src: &impl Fn(usize) -> *const u32,
    dst: *mut u32,
    dst_stride: usize,
) {
    use std::arch::x86_64::{
        _mm512_mask_storeu_epi32, _mm512_maskz_loadu_epi32, _mm512_setzero_si512,
    };
    let starts: [*const u32; 16] =
        std::array::from_fn(|r| if r < rows { src(r) } else { std::ptr::null() });
    // Rows past `rows` stay zero; only the first `rows` lanes of each column are stored.
    let store_mask = low_lanes(rows);
    for i0 in (0..words).step_by(16) {
        let count = 16.min(words - i0);
        let load_mask = low_lanes(count);
        let mut block = [_mm512_setzero_si512(); 16];
        for (r, lane) in block.iter_mut().take(rows).enumerate() {
            // SAFETY: words `i0..i0 + count` of row `r` are live (caller's contract); masked
            // lanes are not read.
            *lane = unsafe { _mm512_maskz_loadu_epi32(load_mask, starts[r].add(i0).cast()) };
        }
        transpose16(&mut block);
        for (i, column) in block.iter().take(count).enumerate() {
            // SAFETY: `rows` words at `(i0 + i) * dst_stride` are inside `dst` (caller's
            // contract); masked lanes are not written.
            unsafe {
                _mm512_mask_storeu_epi32(dst.add((i0 + i) * dst_stride).cast(), store_mask, *column)
            };
        }
    }
}

/// A mask of the low `lanes` of 16.
#[cfg(target_arch = "x86_64")]
fn low_lanes(lanes: usize) -> u16 {
    debug_assert!(lanes <= 16);
    u16::try_from((1u32 << lanes) - 1).expect("at most 16 lanes")
}

/// Transposes a 16 x 16 block of 32-bit lanes in place: 32-bit, then 64-bit interleaves
/// within 128-bit lanes, then two rounds of 128-bit lane shuffles.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(m: &mut [std::arch::x86_64::__m512i; 16]) {
    use std::arch::x86_64::{
        _mm512_shuffle_i32x4, _mm512_unpackhi_epi32, _mm512_unpackhi_epi64, _mm512_unpacklo_epi32,
        _mm512_unpacklo_epi64,
    };
    // Pairs of rows interleaved: per 128-bit lane L, b[2k] holds columns 4L, 4L+1 and b[2k+1]
    // columns 4L+2, 4L+3 of rows 2k and 2k+1.
    let mut b = *m;
    for k in 0..8 {
        b[2 * k] = _mm512_unpacklo_epi32(m[2 * k], m[2 * k + 1]);
        b[2 * k + 1] = _mm512_unpackhi_epi32(m[2 * k], m[2 * k + 1]);
    }
    // Groups of four rows: c[4g + j] holds, in lane L, column 4L + j of rows 4g..4g+3.
    let mut c = b;
    for g in 0..4 {
        let r = 4 * g;
        c[r] = _mm512_unpacklo_epi64(b[r], b[r + 2]);
        c[r + 1] = _mm512_unpackhi_epi64(b[r], b[r + 2]);
        c[r + 2] = _mm512_unpacklo_epi64(b[r + 1], b[r + 3]);
        c[r + 3] = _mm512_unpackhi_epi64(b[r + 1], b[r + 3]);
    }
    // Column 4L + j gathers lane L of c[j], c[4 + j], c[8 + j], c[12 + j]: lanes 0 and 2 (and
    // 1 and 3) of two sources first, then of the results.
    for j in 0..4 {
        let d = _mm512_shuffle_i32x4::<0x88>(c[j], c[4 + j]);
        let e = _mm512_shuffle_i32x4::<0xdd>(c[j], c[4 + j]);
        let f = _mm512_shuffle_i32x4::<0x88>(c[8 + j], c[12 + j]);
        let g = _mm512_shuffle_i32x4::<0xdd>(c[8 + j], c[12 + j]);
        m[j] = _mm512_shuffle_i32x4::<0x88>(d, f);
        m[8 + j] = _mm512_shuffle_i32x4::<0xdd>(d, f);
        m[4 + j] = _mm512_shuffle_i32x4::<0x88>(e, g);
        m[12 + j] = _mm512_shuffle_i32x4::<0xdd>(e, g);
    }
}

/// [`interleave_rows`] 16 columns at a time.
///
/// # Safety
/// As for [`interleave_rows`], on a CPU with AVX-512F/BW/VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn interleave_rows_avx512(
    lo: *const u16,
    hi: Option<*const u16>,
    cols: usize,
    dst: *mut u32,
) {
    use std::arch::x86_64::{
        _mm256_maskz_loadu_epi16, _mm256_setzero_si256, _mm512_cvtepu16_epi32,
        _mm512_mask_storeu_epi32, _mm512_or_si512, _mm512_slli_epi32,
    };
    for j0 in (0..cols).step_by(16) {
        let mask = low_lanes(16.min(cols - j0));
        // SAFETY: columns `j0..j0 + count` of both rows and of `dst` are live (caller's
        // contract); masked lanes are neither read nor written.
        unsafe {
            let low = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo.add(j0).cast()));
            let high = match hi {
                Some(hi) => _mm256_maskz_loadu_epi16(mask, hi.add(j0).cast()),
                None => _mm256_setzero_si256(),
            };
            let high = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(high));
            _mm512_mask_storeu_epi32(dst.add(j0).cast(), mask, _mm512_or_si512(low, high));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of words that say where they came from: row in the top byte, word below.
    fn words(rows: usize, len: usize) -> Vec<Vec<u32>> {
        let (rows, len) = (u32::try_from(rows).unwrap(), u32::try_from(len).unwrap());
        (0..rows)
            .map(|r| (0..len).map(|i| r << 24 | i << 4 | 0x5).collect())
            .collect()
    }

    /// Every row count and ragged word counts, against the scalar loop, with a stride wider
    /// than the rows (untouched words must stay as they were).
    #[test]
    fn transposes_match_the_scalar_loop() {
        for rows in 0..=16usize {
            for count in [0, 1, 15, 16, 17, 40, 47usize] {
                let src = words(rows, count);
                let stride = rows + 3;
                let len = count * stride + 16;
                let mut fast = vec![u32::MAX; len];
                let mut slow = vec![u32::MAX; len];
                let row = |r: usize| src[r].as_ptr();
                // SAFETY: every row holds `count` words; both outputs hold
                // `(count - 1) * stride + rows` words.
                unsafe {
                    transpose_words(rows, count, row, fast.as_mut_ptr(), stride);
                    transpose_words_scalar(rows, count, &row, slow.as_mut_ptr(), stride);
                }
                assert_eq!(fast, slow, "{rows} rows x {count} words");
                for (i, r) in (0..count).flat_map(|i| (0..rows).map(move |r| (i, r))) {
                    assert_eq!(slow[i * stride + r], src[r][i]);
                }
            }
        }
    }

    #[test]
    fn interleaving_matches_the_scalar_loop() {
        for cols in [0u16, 1, 15, 16, 17, 32, 45] {
            let lo: Vec<u16> = (0..cols).map(|j| j | 0x100).collect();
            let hi: Vec<u16> = (0..cols).map(|j| j | 0x8000).collect();
            let cols = usize::from(cols);
            for high in [Some(hi.as_ptr()), None] {
                let mut fast = vec![u32::MAX; cols + 16];
                let mut slow = vec![u32::MAX; cols + 16];
                // SAFETY: the rows and outputs hold `cols` values.
                unsafe {
                    interleave_rows(lo.as_ptr(), high, cols, fast.as_mut_ptr());
                    interleave_rows_scalar(lo.as_ptr(), high, cols, slow.as_mut_ptr());
                }
                assert_eq!(fast, slow, "{cols} columns");
                for j in 0..cols {
                    let want = u32::from(lo[j]) | high.map_or(0, |_| u32::from(hi[j]) << 16);
                    assert_eq!(slow[j], want);
                }
            }
        }
    }
}
