//! Variable-length, non-causal multi-head attention over segments.
//!
//! Two paths, chosen per call shape by the device (see `device.rs`):
//!
//! - **fused**: `aclnnFlashAttentionVarLenScore` with the TND layout: `q`, `k`, `v` and the
//!   output as `[tokens, heads, head_dim]` views (the caller's row strides are kept), the
//!   cumulative segment lengths *without* the leading 0 as host int arrays for both queries
//!   and keys, no mask (`sparseMode` 0, pre/next tokens at their maximum), and the op's
//!   required f32 softmax statistics `[tokens, heads, 8]` in the workspace. aclnn offers it on
//!   Atlas A2 training parts.
//! - **composed**, everywhere: runs of equal-length segments are batched; for each chunk the
//!   queries, keys and values are packed into `[segments · heads, len, head_dim]`
//!   (`aclnnInplaceCopy` from strided views), then `aclnnInplaceMuls(Q, scale)`,
//!   `S = aclnnBatchMatMul(Q, Kᵀ)`, `P = aclnnSoftmax(S, dim = -1)`, `O = aclnnBatchMatMul(P,
//!   V)`, and `O` is copied into the output's rows. Chunks bound the score matrices to
//!   [`SCORES_BUDGET`] bytes: by segments, then by heads, then by query rows for very long
//!   segments, so a 16384-token image does not need a 16 GiB score matrix.

use iris_plugin::validate::Attention;

use super::elementwise::{Place, copy};
use super::{Exec, bytes, dim, elem};
use crate::error::AscendError;
use crate::runtime::aclnn;
use crate::sys;
use crate::tensor::{Desc, IntArray, Scalar, acl_dtype};

/// Bytes of the score and probability matrices of one composed chunk together.
pub const SCORES_BUDGET: u64 = 256 << 20;
/// Values of the softmax statistics the fused op keeps per token and head.
const STATS_WIDTH: usize = 8;
/// "No limit" for the fused op's band (`preTokens`, `nextTokens`): full attention.
const NO_BAND: i64 = i32::MAX as i64;

/// Which implementation of an op with a fused aclnn op runs (attention, rotary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// The fused op (`aclnnFlashAttentionVarLenScore`, `aclnnRotaryPositionEmbedding`).
    Fused,
    /// A composition of basic ops (for attention: batched matmul, softmax, batched matmul).
    Composed,
}

/// Runs (or measures) an attention call.
pub fn attention(
    x: &mut Exec<'_>,
    a: &Attention,
    scale: f32,
    cu_seqlens: &[u32],
    path: Path,
    cube_math: i8,
) -> Result<(), AscendError> {
    if a.tokens == 0 {
        return Ok(());
    }
    match path {
        Path::Fused => fused(x, a, scale, cu_seqlens),
        Path::Composed => composed(x, a, scale, cube_math),
    }
}

fn fused(
    x: &mut Exec<'_>,
    a: &Attention,
    scale: f32,
    cu_seqlens: &[u32],
) -> Result<(), AscendError> {
    let rt = x.rt();
    let dtype = a.q.dtype;
    let acl = acl_dtype(dtype)?;
    let (t, n, d) = (a.tokens, a.heads, a.head_dim);
    let stats_bytes = bytes(t * n * STATS_WIDTH, iris_plugin::abi::DType::F32);
    let smax = x.temp(stats_bytes)?;
    let ssum = x.temp(stats_bytes)?;
    let staged = !a.out.is_contiguous();
    let out_tmp = if staged {
        Some(x.temp(bytes(t * n * d, dtype))?)
    } else {
        None
    };
    let tnd = |m: &iris_plugin::validate::Mat| Desc {
        dtype: acl,
        dims: vec![dim(t), dim(n), dim(d)],
        strides: vec![dim(m.stride), dim(d), 1],
        offset: i64::try_from(m.offset / elem(dtype)).unwrap_or(i64::MAX),
    };
    let q_t = x.tensor(&tnd(&a.q), a.q.buf)?;
    let k_t = x.tensor(&tnd(&a.k), a.k.buf)?;
    let v_t = x.tensor(&tnd(&a.v), a.v.buf)?;
    let out_t = x.tensor(&tnd(&a.out), a.out.buf)?;
    let flat = Desc::contiguous(acl, &[dim(t), dim(n), dim(d)]);
    let tmp_t = match out_tmp {
        Some(ptr) => Some(x.at(&flat, Place::Temp(ptr))?),
        None => None,
    };
    let target = tmp_t.as_ref().unwrap_or(&out_t);
    let stats = Desc::contiguous(
        sys::aclDataType::ACL_FLOAT,
        &[dim(t), dim(n), dim(STATS_WIDTH)],
    );
    let smax_t = x.at(&stats, Place::Temp(smax))?;
    let ssum_t = x.at(&stats, Place::Temp(ssum))?;
    // Cumulative lengths without the leading 0 (a leading 0 reads as an empty first batch).
    let ends: Vec<i64> = cu_seqlens
        .iter()
        .skip(1)
        .map(|&end| i64::from(end))
        .collect();
    let seq = IntArray::new(rt, &ends)?;
    let mut layout = *b"TND\0";
    let (q, k, v, o) = (q_t.raw(), k_t.raw(), v_t.raw(), target.raw());
    let (mx, sm, sr) = (smax_t.raw(), ssum_t.raw(), seq.raw());
    let layout_ptr = layout.as_mut_ptr().cast::<std::ffi::c_char>();
    let heads = dim(n);
    let op = aclnn!(
        rt,
        aclnnFlashAttentionVarLenScoreGetWorkspaceSize,
        aclnnFlashAttentionVarLenScore
    )?;
    let null = std::ptr::null_mut;
    // SAFETY: live descriptors and arrays; optional inputs (shift, dropout and padding masks,
    // attention mask, prefix) and the softmax output may be null; `layout` is a NUL-terminated
    // string that outlives the call; out-pointers from `call`.
    x.call(op, |f, ws, ex| unsafe {
        f(
            q,
            k,
            v,
            null(),
            null(),
            null(),
            null(),
            std::ptr::null(),
            sr,
            sr,
            f64::from(scale),
            1.0,
            NO_BAND,
            NO_BAND,
            heads,
            layout_ptr,
            0,
            0,
            mx,
            sm,
            null(),
            o,
            ws,
            ex,
        )
    })?;
    match &tmp_t {
        Some(tmp) => copy(x, &out_t, tmp),
        None => Ok(()),
    }
}

/// One composed chunk: `segments` consecutive segments of `len` tokens starting at token
/// `start`, heads `head0..head0 + heads`, query rows `row0..row0 + rows` of each segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// First token of the first segment.
    pub start: usize,
    /// Number of segments.
    pub segments: usize,
    /// Tokens per segment.
    pub len: usize,
    /// First head.
    pub head0: usize,
    /// Number of heads.
    pub heads: usize,
    /// First query row within each segment.
    pub row0: usize,
    /// Number of query rows.
    pub rows: usize,
}

/// Splits `segments` (`(start, len)`) into chunks whose score and probability matrices of
/// `elem` bytes per value fit in `budget` bytes (or hold a single query row when even that
/// does not fit).
pub fn plan(segments: &[(usize, usize)], heads: usize, elem: u64, budget: u64) -> Vec<Chunk> {
    let mut chunks = Vec::new();
    let mut i = 0;
    while i < segments.len() {
        let (start, len) = segments[i];
        let mut count = 1;
        while i + count < segments.len() && segments[i + count].1 == len {
            count += 1;
        }
        i += count;
        if len == 0 {
            continue;
        }
        let l = len as u64;
        let per_head = 2 * l * l * elem;
        let per_segment = per_head * heads as u64;
        let (seg_step, head_step, row_step) = if per_segment <= budget {
            (
                usize::try_from(budget / per_segment)
                    .unwrap_or(1)
                    .clamp(1, count),
                heads,
                len,
            )
        } else if per_head <= budget {
            (
                1,
                usize::try_from(budget / per_head)
                    .unwrap_or(1)
                    .clamp(1, heads),
                len,
            )
        } else {
            let rows = budget / (2 * l * elem);
            (1, 1, usize::try_from(rows).unwrap_or(1).clamp(1, len))
        };
        for s in (0..count).step_by(seg_step) {
            for h in (0..heads).step_by(head_step) {
                for r in (0..len).step_by(row_step) {
                    chunks.push(Chunk {
                        start: start + s * len,
                        segments: seg_step.min(count - s),
                        len,
                        head0: h,
                        heads: head_step.min(heads - h),
                        row0: r,
                        rows: row_step.min(len - r),
                    });
                }
            }
        }
    }
    chunks
}

fn composed(x: &mut Exec<'_>, a: &Attention, scale: f32, cube_math: i8) -> Result<(), AscendError> {
    let rt = x.rt();
    let dtype = a.q.dtype;
    let acl = acl_dtype(dtype)?;
    let size = elem(dtype);
    let d = a.head_dim;
    let chunks = plan(&a.segments, a.heads, size, SCORES_BUDGET);
    let kv_len = chunks
        .iter()
        .map(|c| c.segments * c.heads * c.len * d)
        .max()
        .unwrap_or(0);
    let q_len = chunks
        .iter()
        .map(|c| c.segments * c.heads * c.rows * d)
        .max()
        .unwrap_or(0);
    let s_len = chunks
        .iter()
        .map(|c| c.segments * c.heads * c.rows * c.len)
        .max()
        .unwrap_or(0);
    let k_p = x.temp(bytes(kv_len, dtype))?;
    let v_p = x.temp(bytes(kv_len, dtype))?;
    let q_p = x.temp(bytes(q_len, dtype))?;
    let s_p = x.temp(bytes(s_len, dtype))?;
    let p_p = x.temp(bytes(s_len, dtype))?;
    let factor = Scalar::f32(rt, scale)?;

    // A view of rows `[first, first + rows)` of each of `chunk.segments` segments, heads
    // `head0..`, as `[segments, heads, rows, head_dim]`.
    let view = |m: &iris_plugin::validate::Mat, c: &Chunk, first: usize, rows: usize| Desc {
        dtype: acl,
        dims: vec![dim(c.segments), dim(c.heads), dim(rows), dim(d)],
        strides: vec![dim(c.len * m.stride), dim(d), dim(m.stride), 1],
        offset: i64::try_from(m.offset / size).unwrap_or(i64::MAX)
            + dim((c.start + first) * m.stride + c.head0 * d),
    };
    for c in &chunks {
        let b = dim(c.segments * c.heads);
        let (len, rows) = (dim(c.len), dim(c.rows));
        let packed_kv = Desc::contiguous(acl, &[dim(c.segments), dim(c.heads), len, dim(d)]);
        let k_t = x.at(&packed_kv, Place::Temp(k_p))?;
        let v_t = x.at(&packed_kv, Place::Temp(v_p))?;
        if c.row0 == 0 {
            // Keys and values are packed once per segment and head block; row chunks of the
            // same block follow it directly.
            let k_src = x.tensor(&view(&a.k, c, 0, c.len), a.k.buf)?;
            let v_src = x.tensor(&view(&a.v, c, 0, c.len), a.v.buf)?;
            copy(x, &k_t, &k_src)?;
            copy(x, &v_t, &v_src)?;
        }
        let packed_q = Desc::contiguous(acl, &[dim(c.segments), dim(c.heads), rows, dim(d)]);
        let q_t = x.at(&packed_q, Place::Temp(q_p))?;
        let q_src = x.tensor(&view(&a.q, c, c.row0, c.rows), a.q.buf)?;
        copy(x, &q_t, &q_src)?;

        let q3 = x.at(&Desc::contiguous(acl, &[b, rows, dim(d)]), Place::Temp(q_p))?;
        let kt = x.at(
            &Desc {
                dtype: acl,
                dims: vec![b, dim(d), len],
                strides: vec![len * dim(d), 1, dim(d)],
                offset: 0,
            },
            Place::Temp(k_p),
        )?;
        let v3 = x.at(&Desc::contiguous(acl, &[b, len, dim(d)]), Place::Temp(v_p))?;
        let scores = Desc::contiguous(acl, &[b, rows, len]);
        let s_t = x.at(&scores, Place::Temp(s_p))?;
        let p_t = x.at(&scores, Place::Temp(p_p))?;
        let (qr, kr, vr, sr, pr, fr) = (
            q3.raw(),
            kt.raw(),
            v3.raw(),
            s_t.raw(),
            p_t.raw(),
            factor.raw(),
        );
        // The queries are scaled before the product, not the scores after it: in f16 the
        // unscaled products of large queries and keys overflow to infinity (and the softmax
        // then gives NaN) where the scaled ones fit.
        let muls = aclnn!(rt, aclnnInplaceMulsGetWorkspaceSize, aclnnInplaceMuls)?;
        // SAFETY: live descriptors; out-pointers from `call`.
        x.call(muls, |f, ws, ex| unsafe { f(qr, fr, ws, ex) })?;
        let bmm = aclnn!(rt, aclnnBatchMatMulGetWorkspaceSize, aclnnBatchMatMul)?;
        // SAFETY: as above.
        x.call(bmm, |f, ws, ex| unsafe { f(qr, kr, sr, cube_math, ws, ex) })?;
        let softmax = aclnn!(rt, aclnnSoftmaxGetWorkspaceSize, aclnnSoftmax)?;
        // SAFETY: as above; dim -1 is the key axis.
        x.call(softmax, |f, ws, ex| unsafe { f(sr, -1, pr, ws, ex) })?;
        // The packed queries are spent: their memory takes the output.
        let bmm = aclnn!(rt, aclnnBatchMatMulGetWorkspaceSize, aclnnBatchMatMul)?;
        // SAFETY: as above.
        x.call(bmm, |f, ws, ex| unsafe { f(pr, vr, qr, cube_math, ws, ex) })?;
        let out_view = x.tensor(&view(&a.out, c, c.row0, c.rows), a.out.buf)?;
        copy(x, &out_view, &q_t)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_segments_batch_and_long_ones_split() {
        // Two windows of 64, one of 1, one empty: the windows share a chunk.
        let segments = [(0, 64), (64, 64), (128, 1), (129, 0)];
        let chunks = plan(&segments, 16, 4, SCORES_BUDGET);
        assert_eq!(chunks.len(), 2);
        assert_eq!(
            (chunks[0].segments, chunks[0].heads, chunks[0].rows),
            (2, 16, 64)
        );
        assert_eq!((chunks[1].start, chunks[1].len), (128, 1));

        // A 16384-token image with 16 heads in f32: 2 GiB of scores per head, so rows split.
        let chunks = plan(&[(0, 16_384)], 16, 4, SCORES_BUDGET);
        assert!(chunks.iter().all(|c| c.heads == 1 && c.segments == 1));
        let per_chunk = |c: &Chunk| 2 * (c.rows * c.len) as u64 * 4;
        assert!(chunks.iter().all(|c| per_chunk(c) <= SCORES_BUDGET));
        let rows: usize = chunks.iter().filter(|c| c.head0 == 3).map(|c| c.rows).sum();
        assert_eq!(rows, 16_384);
    }
}
