//! Variable-length attention, the segment bounds read from `cu_seqlens` on the device.
//!
//! f16 and bf16 at head dims 64, 72, 80, 96 and 128 with a positive scale, on sm_80 and later,
//! run a tensor-core kernel (`mma.sync` and `ldmatrix`, K and V tiles double-buffered by
//! `cp.async` in dynamic shared memory): `flash_attention_<dtype>_<head dim>` with 64 queries of
//! one head of one segment per block, or `flash_attention_q128_<dtype>_<head dim>` with 128,
//! which reads each K and V fragment from shared memory once for twice the MMAs. Both give the
//! same bits; the 128-query kernel serves once the device's open has checked that on the device,
//! and (option `attention_queries = auto`) where its blocks fill every SM at least twice, since
//! a launch of fewer, longer blocks leaves SMs idle (one 448x448 image's 16 heads of 784 tokens
//! make 112 such blocks, fewer than an H200's 132 SMs), and where the segments fill at least
//! three quarters of the blocks' query rows (not Qwen2.5-VL's 64-token windows). Everything
//! else runs `attention_<dtype>_<size>` (32 queries per block, f32 compute).

use iris_plugin::Backend;
use iris_plugin::abi::{AttentionArgs, BufferHandle, BufferSlice, DType, MatRef, PluginError};
use iris_plugin::validate;

use super::{
    ATTENTION_QUERIES, ATTENTION_THREADS, Compute, GRID_YZ, WideAttention, addr, dim, dtype_name,
    grid, kernel_args,
};
use crate::device::{AttentionQueries, CudaDevice};
use crate::kernels::{
    ATTENTION_SIZES, FLASH_ATTENTION_Q128_SIZES, FLASH_ATTENTION_QUERIES, FLASH_ATTENTION_SIZES,
    flash_attention_name, flash_attention_shared_bytes,
};

kernel_args! {
    /// `attention_<dtype>_<size>(q, qs, k, ks, v, vs, out, os, cu_seqlens, head_dim, scale)`
    /// and `flash_attention_<dtype>_<head dim>` with the same parameters.
    struct AttentionKernel {
        q: u64, qs: i64, k: u64, ks: i64, v: u64, vs: i64, out: u64, os: i64, cu_seqlens: u64,
        head_dim: i32, scale: f32,
    }
}

/// A 128-query launch is chosen (`auto`) when its blocks are at least this many times the SMs,
const Q128_BLOCKS_PER_SM: u64 = 2;
/// and its blocks' query rows at least this share used (`Q128_FILL.0 / Q128_FILL.1`): a
/// block whose segment ends early leaves warps without queries, which a 64-query block would
/// have spread over all four (Qwen2.5-VL's 64-token windows fill half a 128-query block).
const Q128_FILL: (u64, u64) = (3, 4);

impl Compute {
    /// Queries per block of the tensor-core kernel for a launch at `head_dim` over `segments`
    /// (`(start, length)`) and `heads`: 128 where that kernel passed its check at open and the
    /// `attention_queries` option asks for it, or (`auto`) the launch fills every SM twice with
    /// 128-query blocks whose rows its segments mostly use; else 64.
    fn flash_queries(&self, head_dim: u64, segments: &[(usize, usize)], heads: u64) -> u64 {
        let [narrow, wide] = FLASH_ATTENTION_QUERIES;
        let choose = match self.attention_queries {
            AttentionQueries::Fixed(queries) => queries == wide,
            AttentionQueries::Auto => {
                let per_head: u64 = segments
                    .iter()
                    .map(|&(_, length)| (length as u64).div_ceil(wide))
                    .sum();
                let queries: u64 = segments.iter().map(|&(_, length)| length as u64).sum();
                let filled = queries * Q128_FILL.1 >= per_head * wide * Q128_FILL.0;
                filled && per_head * heads >= Q128_BLOCKS_PER_SM * self.sms
            }
        };
        if choose && self.q128.ready.contains(&head_dim) {
            wide
        } else {
            narrow
        }
    }
}

impl CudaDevice {
    pub(crate) fn attention_impl(&self, args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        self.attention_with(args, None)
    }

    /// Attention with the tensor-core kernel of `queries` per block where given (the check at
    /// open), else as the device's options and the launch's size choose.
    pub(crate) fn attention_with(
        &self,
        args: &AttentionArgs<'_>,
        queries: Option<u64>,
    ) -> Result<(), PluginError> {
        let op = "attention";
        let att = self.with_checker(op, |check| validate::attention(check, args))?;
        let compute = self.compute(op)?;
        let head_dim = att.head_dim as u64;
        let Some(size) = ATTENTION_SIZES
            .iter()
            .copied()
            .find(|size| *size >= head_dim)
        else {
            return Err(PluginError::unsupported(format!(
                "attention: head_dim {head_dim} is larger than the largest kernel ({})",
                ATTENTION_SIZES[ATTENTION_SIZES.len() - 1]
            )));
        };
        let segments = att.segments.len() as u64;
        let heads = att.heads as u64;
        if heads > GRID_YZ || segments > GRID_YZ {
            return Err(PluginError::unsupported(format!(
                "attention: {heads} heads and {segments} segments; at most {GRID_YZ} of each"
            )));
        }
        if att.tokens == 0 || segments == 0 || args.max_seqlen == 0 {
            return Ok(());
        }
        let mut launch = AttentionKernel {
            q: addr(self, op, &att.q)?,
            qs: dim(att.q.stride),
            k: addr(self, op, &att.k)?,
            ks: dim(att.k.stride),
            v: addr(self, op, &att.v)?,
            vs: dim(att.v.stride),
            out: addr(self, op, &att.out)?,
            os: dim(att.out.stride),
            cu_seqlens: addr(self, op, &att.cu_seqlens_device)?,
            // At most the largest kernel size (checked above).
            head_dim: i32::try_from(head_dim).unwrap_or(i32::MAX),
            scale: args.scale,
        };
        let dtype = dtype_name(att.q.dtype);
        let flash = matches!(att.q.dtype, DType::F16 | DType::BF16)
            && FLASH_ATTENTION_SIZES.contains(&head_dim)
            // The kernel takes the row maximum before scaling (validation rules out NaN).
            && args.scale > 0.0
            && compute.has_flash_attention();
        let (name, queries, shared) = if flash {
            let queries =
                queries.unwrap_or_else(|| compute.flash_queries(head_dim, &att.segments, heads));
            (
                flash_attention_name(dtype, head_dim, queries),
                queries,
                flash_attention_shared_bytes(head_dim, queries),
            )
        } else {
            (format!("attention_{dtype}_{size}"), ATTENTION_QUERIES, 0)
        };
        let tiles = args.max_seqlen.div_ceil(queries);
        let grid_dims = (
            grid(tiles, i32::MAX as u64),
            grid(heads, GRID_YZ),
            grid(segments, GRID_YZ),
        );
        compute
            .launch_with_shared(
                self.cu_stream(),
                &name,
                grid_dims,
                ATTENTION_THREADS,
                shared,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }
}

/// Segment bounds of the open-time check: a 130-token segment (two 128-query blocks, the second
/// with one active warp; three key tiles, the last partial) and a one-token one.
const CHECK_SEGMENTS: [u32; 3] = [0, 130, 131];
/// Heads of the open-time check: one (every block runs alone; the tests cover more heads).
const CHECK_HEADS: u64 = 1;

impl CudaDevice {
    /// Runs each 128-query attention kernel the device can load against the 64-query kernel of
    /// its head dim and type on the same inputs, and keeps those whose outputs are the same bits
    /// (they compute every row alike), with a note saying what was found for `iris devices`.
    /// A 128-query launch the driver refuses (resources) counts as a difference; any other
    /// failure fails the check (and a fault of a kernel, sticky in CUDA, the open). Buffers it
    /// allocates go into `buffers`.
    pub(crate) fn check_attention_kernels(
        &self,
        buffers: &mut Vec<BufferHandle>,
    ) -> Result<WideAttention, PluginError> {
        let op = "open";
        let compute = self.compute(op)?;
        let mut checked = WideAttention {
            loadable: compute.q128.loadable.clone(),
            ..WideAttention::default()
        };
        let mut failures = Vec::new();
        let tokens = u64::from(CHECK_SEGMENTS[CHECK_SEGMENTS.len() - 1]);
        let mut alloc = |bytes: u64| self.alloc_for_open(buffers, bytes);
        let bounds: Vec<u8> = CHECK_SEGMENTS
            .iter()
            .flat_map(|&b| (b as i32).to_le_bytes())
            .collect();
        let check_max_seqlen = CHECK_SEGMENTS
            .windows(2)
            .map(|pair| u64::from(pair[1] - pair[0]))
            .max()
            .unwrap_or(0);
        let cu_device = alloc(bounds.len() as u64)?;
        self.write(cu_device, 0, &bounds)?;
        for head_dim in compute.q128.loadable.clone() {
            let width = CHECK_HEADS * head_dim;
            let qkv = alloc(tokens * 3 * width * 2)?;
            let outs = [alloc(tokens * width * 2)?, alloc(tokens * width * 2)?];
            let mut same = true;
            for (dtype, name) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
                self.write(qkv, 0, &check_values(dtype, tokens * 3 * width, head_dim))?;
                // q, k and v: column blocks of one fused buffer, as the towers pass them.
                let part = |index: u64| MatRef {
                    buf: qkv,
                    offset: index * width * 2,
                    dtype,
                    rows: tokens,
                    cols: width,
                    row_stride: 3 * width,
                };
                let mut results = Vec::new();
                // Each output starts with its own pattern, so that rows a kernel leaves
                // unwritten differ too.
                let patterns = [0x00, 0xff];
                for ((queries, out), pattern) in
                    FLASH_ATTENTION_QUERIES.into_iter().zip(outs).zip(patterns)
                {
                    let size = usize::try_from(tokens * width * 2).unwrap_or(0);
                    self.write(out, 0, &vec![pattern; size])?;
                    let args = AttentionArgs {
                        q: part(0),
                        k: part(1),
                        v: part(2),
                        out: MatRef::contiguous(out, 0, dtype, tokens, width),
                        heads: CHECK_HEADS,
                        head_dim,
                        scale: 1.0 / (head_dim as f32).sqrt(),
                        cu_seqlens: CHECK_SEGMENTS[..].into(),
                        cu_seqlens_device: MatRef::vector(
                            cu_device,
                            0,
                            DType::I32,
                            CHECK_SEGMENTS.len() as u64,
                        ),
                        max_seqlen: check_max_seqlen,
                        workspace: BufferSlice::EMPTY,
                    };
                    match self.attention_with(&args, Some(queries)) {
                        Ok(()) => {}
                        Err(err) if queries > FLASH_ATTENTION_QUERIES[0] => {
                            failures.push(format!("{name} {head_dim}: {}", err.message));
                            same = false;
                            break;
                        }
                        Err(err) => return Err(err),
                    }
                    let mut bytes = vec![0u8; size];
                    self.read(out, 0, &mut bytes)?;
                    results.push(bytes);
                }
                if let [narrow, wide] = &results[..] {
                    let differing = narrow
                        .chunks_exact(2)
                        .zip(wide.chunks_exact(2))
                        .filter(|(a, b)| a != b)
                        .count();
                    if differing > 0 {
                        failures.push(format!(
                            "{name} {head_dim}: {differing} of {} outputs differ from the \
                             64-query kernel's",
                            tokens * width
                        ));
                        same = false;
                    }
                }
            }
            if same {
                checked.ready.push(head_dim);
            }
        }
        let list = |dims: &[u64]| {
            dims.iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut note = if checked.ready.is_empty() {
            "none".to_owned()
        } else {
            format!(
                "head dims {} (the same bits as the 64-query kernel at open)",
                list(&checked.ready)
            )
        };
        if !failures.is_empty() {
            note.push_str(&format!("; 64 queries instead for {}", failures.join("; ")));
        }
        if checked.loadable.is_empty() {
            note.clone_from(&compute.q128.note);
        } else if checked.loadable.len() < FLASH_ATTENTION_Q128_SIZES.len() {
            note.push_str(&format!("; not loaded: {}", compute.q128.note));
        }
        checked.note = note;
        Ok(checked)
    }
}

/// `count` 16-bit values of `dtype` with random signs and mantissas and magnitudes from 1/8 to
/// 4 (so that scores differ and no exponent overflows), from a fixed seed. (Every pattern fits
/// 16 bits: sign bit 15, exponent and mantissa below it.)
pub(crate) fn check_values(dtype: DType, count: u64, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let (bias, mantissa_bits) = if dtype == DType::BF16 {
        (127, 7)
    } else {
        (15, 10)
    };
    (0..count)
        .flat_map(|_| {
            // xorshift64*
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let r = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32;
            let sign = (r & 1) << 15;
            let exponent = (bias - 3 + (r >> 1) % 5) << mantissa_bits;
            let mantissa = (r >> 4) & ((1 << mantissa_bits) - 1);
            u16::try_from(sign | exponent | mantissa)
                .unwrap_or(0)
                .to_le_bytes()
        })
        .collect()
}
