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
//!
//! Where cuDNN serves a call's head dim and type (`sdpa`: option `attention_engine`, and its
//! check at open here), each run of equal-length segments goes to cuDNN's fused attention, and
//! any run it has no plan for, or whose plan fails to execute, to the kernels above, in the same
//! call.

use std::cmp::Ordering;
use std::ops::Range;

use iris_plugin::Backend;
use iris_plugin::abi::{AttentionArgs, BufferHandle, BufferSlice, DType, MatRef, PluginError};
use iris_plugin::conformance::decode;
use iris_plugin::validate::{self, Checker, Mat};

use super::elementwise::unit;
use super::gemm::WORKSPACE_ALIGNMENT;
use super::sdpa;
use super::{
    ATTENTION_QUERIES, ATTENTION_THREADS, Compute, GRID_YZ, WideAttention, addr, dim, dtype_name,
    grid, kernel_args,
};
use crate::cudnn::{SdpaOperands, SdpaShape};
use crate::device::{AttentionQueries, CudaDevice};
use crate::kernels::{
    ATTENTION_SIZES, FLASH_ATTENTION_Q128_SIZES, FLASH_ATTENTION_QUERIES, FLASH_ATTENTION_SIZES,
    flash_attention_name, flash_attention_shared_bytes,
};

kernel_args! {
    /// `attention_<dtype>_<size>(q, qs, k, ks, v, vs, out, os, cu_seqlens, head_dim, scale,
    /// rows, status)` and `flash_attention_<dtype>_<head dim>` with the same parameters: `rows`
    /// the call's tokens, which no segment of the device's `cu_seqlens` may reach past, and
    /// `status` the word a segment that does sets.
    struct AttentionKernel {
        q: u64, qs: i64, k: u64, ks: i64, v: u64, vs: i64, out: u64, os: i64, cu_seqlens: u64,
        head_dim: i32, scale: f32, rows: i64, status: u64,
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

/// How one attention call is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttentionPath {
    /// As the device's options and its checks at open chose.
    Chosen,
    /// The plugin's kernels only, the tensor-core kernel with this many queries per block (the
    /// checks at open).
    Kernel(u64),
    /// cuDNN for every run of segments it has a plan for, the plugin's kernels for the rest,
    /// whatever the check said (the check at open).
    Cudnn,
}

impl CudaDevice {
    pub(crate) fn attention_impl(&self, args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        self.attention_with(args, AttentionPath::Chosen).map(|_| ())
    }

    /// The workspace of an attention call: where cuDNN would take it, what its plans need
    /// (during open, building them; after it, the fixed size every call gets), else none.
    pub(crate) fn attention_workspace_impl(
        &self,
        args: &AttentionArgs<'_>,
    ) -> Result<u64, PluginError> {
        let op = "attention_workspace";
        let att = validate::attention(&Checker::shapes_only(op), args)?;
        let Some(compute) = self.compute.as_ref() else {
            return Ok(0);
        };
        if !compute.sdpa.serves(att.q.dtype, att.head_dim as u64) {
            return Ok(0);
        }
        Ok(sdpa_workspace(compute, &att))
    }

    /// Attention along `path`; returns how many runs of segments cuDNN computed.
    pub(crate) fn attention_with(
        &self,
        args: &AttentionArgs<'_>,
        path: AttentionPath,
    ) -> Result<usize, PluginError> {
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
            return Ok(0);
        }
        let operands = [
            (addr(self, op, &att.q)?, &att.q),
            (addr(self, op, &att.k)?, &att.k),
            (addr(self, op, &att.v)?, &att.v),
            (addr(self, op, &att.out)?, &att.out),
        ];
        let cudnn = match path {
            AttentionPath::Chosen => compute.sdpa.serves(att.q.dtype, head_dim),
            AttentionPath::Kernel(_) => false,
            AttentionPath::Cudnn => compute.sdpa.library().is_some(),
        } && sdpa::aligned(&operands);
        let queries = match path {
            AttentionPath::Kernel(queries) => Some(queries),
            _ => None,
        };
        let launch = KernelLaunch {
            att: &att,
            operands: [operands[0].0, operands[1].0, operands[2].0, operands[3].0],
            cu_seqlens: addr(self, op, &att.cu_seqlens_device)?,
            size,
            scale: args.scale,
            queries,
        };
        if !cudnn {
            return self.launch_attention(compute, &launch, 0..att.segments.len());
        }
        let workspace = if args.workspace.bytes == 0 {
            (0, 0)
        } else {
            self.with_checker(op, |check| {
                check.workspace(
                    &args.workspace,
                    args.workspace.bytes,
                    &[
                        ("q", &att.q),
                        ("k", &att.k),
                        ("v", &att.v),
                        ("out", &att.out),
                        ("cu_seqlens_device", &att.cu_seqlens_device),
                    ],
                )
            })?;
            let start = self.view(op, args.workspace.buf)?.at(args.workspace.offset);
            let aligned = start.next_multiple_of(WORKSPACE_ALIGNMENT);
            (
                aligned,
                args.workspace.bytes.saturating_sub(aligned - start),
            )
        };
        let element = att.q.dtype.size().unwrap_or(2);
        let offset = |(address, mat): (u64, &Mat), token: usize| {
            address + token as u64 * mat.stride as u64 * element
        };
        let mut ran = 0;
        let runs = sdpa::runs(&att.segments);
        if runs.len() > sdpa::MAX_RUNS {
            return self.launch_attention(compute, &launch, 0..att.segments.len());
        }
        for run in runs {
            let call = SdpaOperands {
                q: offset(operands[0], run.start),
                k: offset(operands[1], run.start),
                v: offset(operands[2], run.start),
                out: offset(operands[3], run.start),
                workspace: workspace.0,
            };
            let shape = sdpa_shape(&att, &run);
            let took = compute
                .sdpa
                .run(&shape, &call, workspace.1, args.scale, self.cu_stream())
                .map_err(|err| err.into_plugin(op))?;
            if took {
                ran += 1;
            } else {
                self.launch_attention(compute, &launch, run.first..run.first + run.batch)?;
            }
        }
        Ok(ran)
    }

    /// Launches the plugin's attention kernel over segments `range` of `launch`'s call (its
    /// boundaries read from the device copy of `cu_seqlens` from the range's first on).
    fn launch_attention(
        &self,
        compute: &Compute,
        launch: &KernelLaunch<'_>,
        range: Range<usize>,
    ) -> Result<usize, PluginError> {
        let op = "attention";
        let att = launch.att;
        let head_dim = att.head_dim as u64;
        let heads = att.heads as u64;
        let segments = &att.segments[range.clone()];
        let max_seqlen = segments.iter().map(|s| s.1 as u64).max().unwrap_or(0);
        if max_seqlen == 0 {
            return Ok(0);
        }
        let [q, k, v, out] = launch.operands;
        let mut kernel = AttentionKernel {
            q,
            qs: dim(att.q.stride),
            k,
            ks: dim(att.k.stride),
            v,
            vs: dim(att.v.stride),
            out,
            os: dim(att.out.stride),
            cu_seqlens: launch.cu_seqlens + range.start as u64 * 4,
            // At most the largest kernel size (checked by the caller).
            head_dim: i32::try_from(head_dim).unwrap_or(i32::MAX),
            scale: launch.scale,
            rows: dim(att.tokens),
            status: compute.status.ptr,
        };
        let dtype = dtype_name(att.q.dtype);
        let flash = matches!(att.q.dtype, DType::F16 | DType::BF16)
            && FLASH_ATTENTION_SIZES.contains(&head_dim)
            // The kernel takes the row maximum before scaling (validation rules out NaN).
            && launch.scale > 0.0
            && compute.has_flash_attention();
        let (name, queries, shared) = if flash {
            let queries = launch
                .queries
                .unwrap_or_else(|| compute.flash_queries(head_dim, segments, heads));
            (
                flash_attention_name(dtype, head_dim, queries),
                queries,
                flash_attention_shared_bytes(head_dim, queries),
            )
        } else {
            (
                format!("attention_{dtype}_{}", launch.size),
                ATTENTION_QUERIES,
                0,
            )
        };
        let tiles = max_seqlen.div_ceil(queries);
        let grid_dims = (
            grid(tiles, i32::MAX as u64),
            grid(heads, GRID_YZ),
            grid(segments.len() as u64, GRID_YZ),
        );
        compute
            .launch_with_shared(
                self.cu_stream(),
                &name,
                grid_dims,
                ATTENTION_THREADS,
                shared,
                &mut kernel,
            )
            .map_err(|err| err.into_plugin(op))?;
        compute.status_may_change();
        Ok(0)
    }
}

/// What the kernel launches of one attention call share.
struct KernelLaunch<'a> {
    att: &'a validate::Attention,
    /// Addresses of q, k, v and out.
    operands: [u64; 4],
    /// Address of the device copy of `cu_seqlens`.
    cu_seqlens: u64,
    /// The f32 kernel's padded head dim.
    size: u64,
    scale: f32,
    /// Queries per tensor-core block, where the caller fixed them.
    queries: Option<u64>,
}

/// The shape of cuDNN's call for `run` of `att`.
fn sdpa_shape(att: &validate::Attention, run: &sdpa::Run) -> SdpaShape {
    SdpaShape {
        bf16: att.q.dtype == DType::BF16,
        heads: att.heads as u64,
        head_dim: att.head_dim as u64,
        tokens: run.tokens as u64,
        batch: run.batch as u64,
        strides: [att.q.stride, att.k.stride, att.v.stride, att.out.stride].map(|s| s as u64),
    }
}

/// The inputs of an open-time attention check: segment bounds (on the host and, uploaded, on
/// the device), and for each head dim a fused QKV buffer of 16-bit values, as the towers pass
/// them (q, k and v column blocks of one buffer).
struct CheckInputs {
    bounds: &'static [u32],
    bounds_device: BufferHandle,
    tokens: u64,
    max_seqlen: u64,
    heads: u64,
}

impl CheckInputs {
    /// Uploads `bounds` into a buffer recorded in `buffers`.
    fn new(
        device: &CudaDevice,
        bounds: &'static [u32],
        heads: u64,
        buffers: &mut Vec<BufferHandle>,
    ) -> Result<CheckInputs, PluginError> {
        let bytes: Vec<u8> = bounds
            .iter()
            .flat_map(|&b| (b as i32).to_le_bytes())
            .collect();
        let bounds_device = device.alloc_for_open(buffers, bytes.len() as u64)?;
        device.write(bounds_device, 0, &bytes)?;
        Ok(CheckInputs {
            bounds,
            bounds_device,
            tokens: u64::from(bounds.last().copied().unwrap_or(0)),
            max_seqlen: bounds
                .windows(2)
                .map(|pair| u64::from(pair[1] - pair[0]))
                .max()
                .unwrap_or(0),
            heads,
        })
    }

    /// Attention over the fused buffer `qkv` of `dtype` into `out`, at `head_dim`.
    fn args(
        &self,
        qkv: BufferHandle,
        out: BufferHandle,
        dtype: DType,
        head_dim: u64,
    ) -> AttentionArgs<'static> {
        let width = self.heads * head_dim;
        let part = |index: u64| MatRef {
            buf: qkv,
            offset: index * width * 2,
            dtype,
            rows: self.tokens,
            cols: width,
            row_stride: 3 * width,
        };
        AttentionArgs {
            q: part(0),
            k: part(1),
            v: part(2),
            out: MatRef::contiguous(out, 0, dtype, self.tokens, width),
            heads: self.heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            cu_seqlens: self.bounds.into(),
            cu_seqlens_device: MatRef::vector(
                self.bounds_device,
                0,
                DType::I32,
                self.bounds.len() as u64,
            ),
            max_seqlen: self.max_seqlen,
            workspace: BufferSlice::EMPTY,
        }
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
        let inputs = CheckInputs::new(self, &CHECK_SEGMENTS, CHECK_HEADS, buffers)?;
        let tokens = inputs.tokens;
        let mut alloc = |bytes: u64| self.alloc_for_open(buffers, bytes);
        for head_dim in compute.q128.loadable.clone() {
            let width = CHECK_HEADS * head_dim;
            let qkv = alloc(tokens * 3 * width * 2)?;
            let outs = [alloc(tokens * width * 2)?, alloc(tokens * width * 2)?];
            let mut same = true;
            for (dtype, name) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
                self.write(qkv, 0, &check_values(dtype, tokens * 3 * width, head_dim))?;
                let mut results = Vec::new();
                // Each output starts with its own pattern, so that rows a kernel leaves
                // unwritten differ too.
                let patterns = [0x00, 0xff];
                for ((queries, out), pattern) in
                    FLASH_ATTENTION_QUERIES.into_iter().zip(outs).zip(patterns)
                {
                    let size = usize::try_from(tokens * width * 2).unwrap_or(0);
                    self.write(out, 0, &vec![pattern; size])?;
                    let args = inputs.args(qkv, out, dtype, head_dim);
                    match self.attention_with(&args, AttentionPath::Kernel(queries)) {
                        Ok(_) => {}
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

/// Segment bounds of cuDNN's check at open: two segments of 130 tokens (one cuDNN call of
/// batch 2, so batch and head strides are both exercised; the key tiles end partly) and a
/// one-token segment (a second call, or the plugin's kernel where no engine takes it).
const CUDNN_CHECK_SEGMENTS: [u32; 4] = [0, 130, 260, 261];
/// What cuDNN's check at open found: the `(dtype, head dim)` pairs that passed, and why each
/// other did not.
pub(crate) type CudnnChecked = (Vec<(DType, u64)>, Vec<String>);

/// Heads of cuDNN's check.
const CUDNN_CHECK_HEADS: u64 = 2;
/// How far cuDNN's outputs may lie from the plugin kernel's in the check, in units in the last
/// place of the larger of the value and 1: both sum in f32 and round once, but their softmax
/// visits keys in other tiles and orders (so the probabilities rounded for the second product
/// differ), while a wrong layout or scale is off by whole values.
const CUDNN_CHECK_UNITS: f32 = 4.0;

impl CudaDevice {
    /// Runs cuDNN's attention against the plugin's 64-query tensor-core kernel on the same
    /// inputs, in bf16 and f16 at every head dim that kernel has, and returns the pairs whose
    /// outputs agree (within [`CUDNN_CHECK_UNITS`]) with a note for `iris devices`. A cuDNN
    /// error, or a shape no cuDNN engine takes, counts as a difference. Buffers it allocates
    /// go into `buffers`.
    pub(crate) fn check_cudnn_attention(
        &self,
        buffers: &mut Vec<BufferHandle>,
    ) -> Result<CudnnChecked, PluginError> {
        let inputs = CheckInputs::new(self, &CUDNN_CHECK_SEGMENTS, CUDNN_CHECK_HEADS, buffers)?;
        let tokens = inputs.tokens;
        let mut alloc = |bytes: u64| self.alloc_for_open(buffers, bytes);
        let mut ready = Vec::new();
        let mut failures = Vec::new();
        for head_dim in FLASH_ATTENTION_SIZES {
            let width = CUDNN_CHECK_HEADS * head_dim;
            let qkv = alloc(tokens * 3 * width * 2)?;
            let outs = [alloc(tokens * width * 2)?, alloc(tokens * width * 2)?];
            for dtype in [DType::BF16, DType::F16] {
                let name = format!("{} {head_dim}", dtype_name(dtype));
                self.write(
                    qkv,
                    0,
                    &check_values(dtype, tokens * 3 * width, head_dim + 7),
                )?;
                let mut args = inputs.args(qkv, outs[0], dtype, head_dim);
                let size = usize::try_from(tokens * width * 2).unwrap_or(0);
                self.write(outs[0], 0, &vec![0x00; size])?;
                self.attention_with(&args, AttentionPath::Kernel(FLASH_ATTENTION_QUERIES[0]))?;
                let att = validate::attention(&Checker::shapes_only("open"), &args)?;
                let bytes = sdpa_workspace(self.compute("open")?, &att);
                if bytes > 0 {
                    args.workspace = BufferSlice {
                        buf: alloc(bytes)?,
                        offset: 0,
                        bytes,
                    };
                }
                args.out = MatRef::contiguous(outs[1], 0, dtype, tokens, width);
                self.write(outs[1], 0, &vec![0xff; size])?;
                match self.attention_with(&args, AttentionPath::Cudnn) {
                    Ok(0) => {
                        let sdpa = &self.compute("open")?.sdpa;
                        let why: Vec<String> = sdpa::runs(&att.segments)
                            .iter()
                            .filter_map(|run| sdpa.why_not(&sdpa_shape(&att, run)))
                            .collect();
                        failures.push(format!(
                            "{name}: no cuDNN engine takes the check's shape ({})",
                            why.join("; ")
                        ));
                        continue;
                    }
                    Ok(_) => {}
                    Err(err) => {
                        failures.push(format!("{name}: {}", err.message));
                        continue;
                    }
                }
                let mut results = Vec::new();
                for out in outs {
                    let mut bytes = vec![0u8; size];
                    self.read(out, 0, &mut bytes)?;
                    results.push(decode(dtype, &bytes));
                }
                let spacing = unit(dtype);
                let differing = results[0]
                    .iter()
                    .zip(&results[1])
                    .filter(|&(kernel, cudnn)| {
                        let bound = CUDNN_CHECK_UNITS * spacing * kernel.abs().max(1.0);
                        // NaN on either side differs too.
                        !matches!(
                            (kernel - cudnn).abs().partial_cmp(&bound),
                            Some(Ordering::Less | Ordering::Equal)
                        )
                    })
                    .count();
                if differing == 0 {
                    ready.push((dtype, head_dim));
                } else {
                    failures.push(format!(
                        "{name}: {differing} of {} outputs differ from the plugin kernel's by \
                         more than {CUDNN_CHECK_UNITS} units in the last place",
                        tokens * width
                    ));
                }
            }
        }
        Ok((ready, failures))
    }
}

/// The workspace cuDNN's plans for `att`'s runs need ([`sdpa::Sdpa::workspace`]), with room
/// to align its start; the same as `attention_workspace` where cuDNN serves.
fn sdpa_workspace(compute: &Compute, att: &validate::Attention) -> u64 {
    let runs = sdpa::runs(&att.segments);
    if runs.len() > sdpa::MAX_RUNS {
        return 0;
    }
    let shapes: Vec<SdpaShape> = runs.iter().map(|run| sdpa_shape(att, run)).collect();
    match compute.sdpa.workspace(&shapes) {
        0 => 0,
        most => most + WORKSPACE_ALIGNMENT - 1,
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
