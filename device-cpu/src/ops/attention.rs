//! Variable-length, non-causal multi-head attention, tiled with an online softmax.
//!
//! Work items are `(segment, head, block of Q_BLOCK queries)`; a fixed set of one task per
//! thread pulls items from a shared counter, so every task owns one scratch slot of the caller's
//! workspace for its whole life. Per item, keys and values are visited in blocks of
//! [`K_BLOCK`]: scores `S = (scale·Q)·Kᵀ` and the update `acc += P·V` are matrix products on
//! the `gemm` crate's single-threaded kernels, and the softmax is kept online (running max and
//! sum per query, rescaling `acc` when the max grows), so no segment-wide score matrix exists.
//! f32 keys and values are read in place through their row strides; f16/bf16 blocks are
//! converted into the slot first.
//!
//! bf16 attention on a tier with bf16 products of its own (`avx512bf16`, `amx`) runs both
//! products on `native::matmul` instead (not on the FMA kernels of `avx512` and `avx2`, which
//! gain nothing over the `gemm` crate at attention's small blocks): queries are read in place, each key and value block is
//! packed into pairs-of-bf16 panels as it is visited, scores and the accumulator stay f32, and
//! the probabilities are rounded to bf16 for `P·V` (as bf16 attention does elsewhere).

use std::sync::atomic::{AtomicUsize, Ordering};

use gemm::Parallelism;
use iris_plugin::abi::{AttentionArgs, DType, PluginError};
use iris_plugin::validate::{self, Checker, Mat};
use rayon::prelude::*;

use super::gemm::{Dst, Operand, matrix, run_gemm};
use super::native::{self as native, Bf16Mat, Epilogue, Kernel, OutMat, PackedB};
use super::{Elem, Touch, Touches, View, math, with_elem};
use crate::device::CpuDevice;
use crate::error::invalid;
use crate::memory::BUFFER_ALIGN;
use crate::queue::Exec;

/// Queries per work item. Each key and value block is packed once per item, and the
/// probabilities once per block, so larger items pack less per flop: 256 rather than 128 made
/// f32 attention at the tower's shape 6% (AVX2) to 13% (AVX-512) faster; 512 adds 2-4% more at
/// twice the workspace and half the items to balance. One 1024-token image of 16 heads is still
/// 64 items.
pub const Q_BLOCK: usize = 256;
/// Keys per inner step.
pub const K_BLOCK: usize = 256;
/// f32 values per cache line: scratch parts start on cache lines.
const LINE_FLOATS: usize = BUFFER_ALIGN / 4;

/// Checked attention operands.
struct Plan {
    q: View,
    k: View,
    v: View,
    out: View,
    heads: usize,
    head_dim: usize,
    segments: Vec<(usize, usize)>,
}

/// Offsets (in f32 elements) of the parts of one thread's scratch slot.
#[derive(Clone, Copy)]
struct SlotLayout {
    q: usize,
    acc: usize,
    s: usize,
    max: usize,
    sum: usize,
    k: usize,
    v: usize,
    len: usize,
}

impl SlotLayout {
    /// The layout for `head_dim`; `None` when its size overflows `usize` (a head dimension
    /// no buffer could hold, which the shapes-only workspace query can still be asked about).
    fn new(head_dim: usize, convert: bool) -> Option<SlotLayout> {
        let kv = if convert {
            K_BLOCK.checked_mul(head_dim)?
        } else {
            0
        };
        let per_query = Q_BLOCK.checked_mul(head_dim)?;
        let parts = [
            per_query,
            per_query,
            Q_BLOCK * K_BLOCK,
            Q_BLOCK,
            Q_BLOCK,
            kv,
            kv,
        ];
        let mut offsets = [0usize; 8];
        for (i, part) in parts.iter().enumerate() {
            let lines = part.div_ceil(LINE_FLOATS).checked_mul(LINE_FLOATS)?;
            offsets[i + 1] = offsets[i].checked_add(lines)?;
        }
        Some(SlotLayout {
            q: offsets[0],
            acc: offsets[1],
            s: offsets[2],
            max: offsets[3],
            sum: offsets[4],
            k: offsets[5],
            v: offsets[6],
            len: offsets[7],
        })
    }
}

/// The workspace, carved into one slot per thread.
#[derive(Clone, Copy)]
struct Slots {
    base: *mut f32,
    layout: SlotLayout,
}

// SAFETY: `base` points into the caller's workspace buffer, kept alive by the op for the
// duration of the parallel section; each task uses only its own slot.
unsafe impl Send for Slots {}
// SAFETY: as above.
unsafe impl Sync for Slots {}

impl Slots {
    /// Slot `index` as a slice.
    ///
    /// # Safety
    /// `index` is below the number of slots the workspace was checked to hold, and only one
    /// task uses a given slot at a time.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot(&self, index: usize) -> &mut [f32] {
        // SAFETY: forwarded to the caller.
        unsafe {
            std::slice::from_raw_parts_mut(self.base.add(index * self.layout.len), self.layout.len)
        }
    }
}

impl CpuDevice {
    /// Scratch bytes an attention with these arguments needs: one slot per thread plus
    /// alignment. Shapes and dtype only: the contract lets a caller size the workspace before
    /// any operand exists (a planning pass), so no buffer handle is looked up here.
    pub(crate) fn attention_workspace_impl(
        &self,
        args: &AttentionArgs<'_>,
    ) -> Result<u64, PluginError> {
        let checked = validate::attention(&Checker::shapes_only("attention_workspace"), args)?;
        self.workspace_for(
            "attention_workspace",
            checked.tokens,
            checked.heads,
            checked.head_dim,
            checked.q.dtype,
        )
    }

    /// Checks [`AttentionArgs`] and its workspace, and resolves the operands.
    pub(crate) fn prepare_attention(
        &self,
        args: &AttentionArgs<'_>,
    ) -> Result<AttentionJob, PluginError> {
        const OP: &str = "attention";
        let lens = self.lens();
        let check = Checker::new(OP, &lens);
        let checked = validate::attention(&check, args)?;
        let required = self.workspace_for(
            OP,
            checked.tokens,
            checked.heads,
            checked.head_dim,
            checked.q.dtype,
        )?;
        check.workspace(
            &args.workspace,
            required,
            &[
                ("q", &checked.q),
                ("k", &checked.k),
                ("v", &checked.v),
                ("out", &checked.out),
                ("cu_seqlens_device", &checked.cu_seqlens_device),
            ],
        )?;
        let workspace = if required == 0 {
            None
        } else {
            let ws = &args.workspace;
            let mat = Mat {
                buf: ws.buf,
                offset: ws.offset,
                end: ws.offset + ws.bytes,
                dtype: DType::U8,
                rows: 1,
                cols: check.fits("workspace", ws.bytes)?,
                stride: check.fits("workspace", ws.bytes)?,
            };
            Some(View::new(self, OP, "workspace", &mat)?)
        };
        Ok(AttentionJob {
            plan: Plan {
                q: View::new(self, OP, "q", &checked.q)?,
                k: View::new(self, OP, "k", &checked.k)?,
                v: View::new(self, OP, "v", &checked.v)?,
                out: View::new(self, OP, "out", &checked.out)?,
                heads: checked.heads,
                head_dim: checked.head_dim,
                segments: checked.segments,
            },
            cu_seqlens: args.cu_seqlens.to_vec(),
            cu_seqlens_device: View::new(
                self,
                OP,
                "cu_seqlens_device",
                &checked.cu_seqlens_device,
            )?,
            scale: args.scale,
            workspace,
        })
    }

    /// One scratch slot per worker thread, plus slack to align the first slot.
    fn workspace_for(
        &self,
        op: &str,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        dtype: DType,
    ) -> Result<u64, PluginError> {
        if tokens == 0 || heads == 0 {
            return Ok(0);
        }
        SlotLayout::new(head_dim, dtype != DType::F32)
            .and_then(|layout| self.options.threads.checked_mul(layout.len))
            .and_then(|floats| floats.checked_mul(size_of::<f32>()))
            .and_then(|bytes| bytes.checked_add(BUFFER_ALIGN))
            .and_then(|bytes| u64::try_from(bytes).ok())
            .ok_or_else(|| {
                invalid(
                    op,
                    format!("head_dim {head_dim}: the workspace would be too large to address"),
                )
            })
    }
}

/// A checked attention, with its workspace.
pub(crate) struct AttentionJob {
    plan: Plan,
    cu_seqlens: Vec<u32>,
    cu_seqlens_device: View,
    scale: f32,
    workspace: Option<View>,
}

impl Touches for AttentionJob {
    fn touches(&self) -> Vec<Touch> {
        let plan = &self.plan;
        let mut touched = vec![
            plan.q.touch(),
            plan.k.touch(),
            plan.v.touch(),
            plan.out.touch(),
            self.cu_seqlens_device.touch(),
        ];
        touched.extend(self.workspace.as_ref().map(View::touch));
        touched
    }
}

impl AttentionJob {
    /// Runs the attention on `exec`'s pool.
    pub(crate) fn run(&self, exec: &Exec) -> Result<(), PluginError> {
        // The reference device holds the host to its promise that both copies of the
        // boundaries agree: a CUDA device reads only the device copy, aclnn only the host one.
        // SAFETY: an i32 `[1, segments + 1]` view (checked) that no op writes meanwhile.
        let device_cu = unsafe { self.cu_seqlens_device.i32_row() };
        if let Some(i) = (0..self.cu_seqlens.len())
            .find(|&i| i64::from(device_cu[i]) != i64::from(self.cu_seqlens[i]))
        {
            return Err(invalid(
                "attention",
                format!(
                    "`cu_seqlens_device`[{i}] = {} disagrees with `cu_seqlens`[{i}] = {}",
                    device_cu[i], self.cu_seqlens[i]
                ),
            ));
        }
        let Some(workspace) = &self.workspace else {
            // No workspace is needed only when there is nothing to compute.
            return Ok(());
        };
        let base = workspace.addr();
        // The first line boundary at or after `base` is at most BUFFER_ALIGN - 1 bytes
        // further, which `workspace_for` reserves.
        let base = base
            .wrapping_add(base.align_offset(BUFFER_ALIGN))
            .cast::<f32>();
        let plan = &self.plan;
        let slots = Slots {
            base,
            // Invariant: `prepare_attention` sized the workspace with this layout.
            layout: SlotLayout::new(plan.head_dim, plan.q.dtype != DType::F32)
                .expect("sized when the call was checked"),
        };
        if plan.q.dtype == DType::BF16
            && let Some(kernel) = exec.bf16_kernel().filter(|kernel| kernel.suits_attention())
        {
            let scale = self.scale;
            exec.run_items(plan, slots, |item, scratch, packs| {
                attend_bf16(plan, scale, item, slots.layout, scratch, packs, kernel);
            });
            return Ok(());
        }
        with_elem!("attention", plan.q.dtype, T => {
            let scale = self.scale;
            exec.run_items(plan, slots, |item, scratch, _| {
                attend::<T>(plan, scale, item, slots.layout, scratch);
            });
            Ok(())
        })
    }
}

impl Exec {
    /// Runs `attend` on every item, one task per thread, each with its own workspace slot and
    /// packing buffers.
    fn run_items(
        &self,
        plan: &Plan,
        slots: Slots,
        attend: impl Fn(Item, &mut [f32], &mut PackBuffers) + Sync,
    ) {
        // Longest segments first: their items are the most expensive (a greedy LPT order).
        let mut segments: Vec<(usize, usize)> =
            plan.segments.iter().copied().filter(|s| s.1 > 0).collect();
        segments.sort_by_key(|s| std::cmp::Reverse(s.1));
        let mut items = Vec::new();
        for &(start, len) in &segments {
            for q0 in (0..len).step_by(Q_BLOCK) {
                for head in 0..plan.heads {
                    items.push(Item {
                        start,
                        len,
                        head,
                        q0,
                    });
                }
            }
        }
        let next = AtomicUsize::new(0);
        let threads = self.threads;
        self.pool.install(|| {
            (0..threads).into_par_iter().for_each(|slot| {
                // SAFETY: `slot < threads`, the number of slots `workspace_bytes` counted, and
                // each index is handed to exactly one task.
                let scratch = unsafe { slots.slot(slot) };
                let mut packs = PackBuffers::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    attend(*item, scratch, &mut packs);
                }
            });
        });
    }
}

/// One unit of work: a block of queries of one head within one segment.
#[derive(Clone, Copy)]
struct Item {
    start: usize,
    len: usize,
    head: usize,
    q0: usize,
}

/// A task's buffers for the native bf16 path: packed key and value blocks and the
/// probabilities in bf16. Small (a few tens of KiB at head dimensions up to 128) and reused for
/// every item of the task.
#[derive(Default)]
struct PackBuffers {
    k: Option<PackedB>,
    v: Option<PackedB>,
    p: Vec<half::bf16>,
}

/// Packs `w` into `slot`, reusing its memory.
///
/// # Safety
/// As for [`PackedB::pack`].
unsafe fn pack_into(
    slot: &mut Option<PackedB>,
    w: Bf16Mat,
    n: usize,
    k: usize,
    transposed: bool,
    kernel: Kernel,
) -> &PackedB {
    match slot {
        // SAFETY: forwarded to the caller.
        Some(packed) if packed.kernel() == kernel => unsafe {
            packed.repack(w, n, k, transposed, false)
        },
        // SAFETY: as above.
        _ => *slot = Some(unsafe { PackedB::pack(w, n, k, transposed, false, kernel) }),
    }
    slot.as_ref().expect("packed just above")
}

/// One query's online-softmax step over a block of scores: `row` becomes `exp(row - max)` under
/// the new running `max`, `sum` gains the block's sum, and `acc` is rescaled when the max grew.
fn online_softmax(row: &mut [f32], max: &mut f32, sum: &mut f32, acc: &mut [f32]) {
    let new_max = max.max(math::max(row));
    let correction = if *max == f32::NEG_INFINITY {
        0.0
    } else {
        math::exp(*max - new_max)
    };
    let block_sum = math::exp_shifted_sum(row, new_max);
    *sum = *sum * correction + block_sum;
    if correction != 1.0 {
        math::scale(acc, correction);
    }
    *max = new_max;
}

/// Computes the output rows of one item on the native bf16 kernels.
fn attend_bf16(
    plan: &Plan,
    scale: f32,
    item: Item,
    layout: SlotLayout,
    scratch: &mut [f32],
    packs: &mut PackBuffers,
    kernel: Kernel,
) {
    let d = plan.head_dim;
    let c0 = item.head * d;
    let qb = Q_BLOCK.min(item.len - item.q0);
    let (acc, rest) = scratch[layout.acc..].split_at_mut(layout.s - layout.acc);
    let acc = &mut acc[..qb * d];
    let (s_tile, rest) = rest.split_at_mut(layout.max - layout.s);
    let (max, rest) = rest.split_at_mut(layout.sum - layout.max);
    let (sum, _) = rest.split_at_mut(layout.k - layout.sum);
    let (max, sum) = (&mut max[..qb], &mut sum[..qb]);
    acc.fill(0.0);
    max.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    let at = |view: &View, row: usize| Bf16Mat {
        // SAFETY: row `row` and columns `c0..c0 + d` lie inside the validated view.
        ptr: unsafe { view.ptr::<half::bf16>().add(row * view.stride + c0) }.cast::<u16>(),
        stride: view.stride,
    };
    let q = at(&plan.q, item.start + item.q0);
    packs.p.resize(Q_BLOCK * K_BLOCK, half::bf16::ZERO);
    for k0 in (0..item.len).step_by(K_BLOCK) {
        let kb = K_BLOCK.min(item.len - k0);
        let first = item.start + k0;
        let s = &mut s_tile[..qb * kb];
        // SAFETY: inputs are disjoint from `out` (checked), so no one writes them; the key
        // rows `first..first + kb` and columns `c0..c0 + d` are inside the view, and the query
        // rows likewise; `s` is `[qb, kb]` scratch. The caller checked the CPU's features.
        unsafe {
            let keys = pack_into(&mut packs.k, at(&plan.k, first), kb, d, false, kernel);
            let out = OutMat {
                ptr: s.as_mut_ptr(),
                stride: kb,
            };
            native::matmul(None, qb, kb, d, q, keys, out, Epilogue::STORE);
        }
        let p = &mut packs.p[..qb * kb];
        for (i, (row, p_row)) in s
            .chunks_exact_mut(kb)
            .zip(p.chunks_exact_mut(kb))
            .enumerate()
        {
            math::scale(row, scale);
            online_softmax(row, &mut max[i], &mut sum[i], &mut acc[i * d..(i + 1) * d]);
            // SAFETY: the caller checked the CPU's features.
            unsafe { <half::bf16 as native::Output>::store(row, p_row) };
        }
        let probs = Bf16Mat {
            ptr: p.as_ptr().cast::<u16>(),
            stride: kb,
        };
        // SAFETY: as above, for the value rows; `acc` is `[qb, d]` scratch.
        unsafe {
            let values = pack_into(&mut packs.v, at(&plan.v, first), d, kb, true, kernel);
            let out = OutMat {
                ptr: acc.as_mut_ptr(),
                stride: d,
            };
            let add = Epilogue {
                accumulate: true,
                ..Epilogue::STORE
            };
            native::matmul(None, qb, d, kb, probs, values, out, add);
        }
    }
    for (i, row) in acc.chunks_exact_mut(d).enumerate() {
        math::scale(row, 1.0 / sum[i]);
        // SAFETY: this item is the only writer of these columns of this row of `out`, which
        // is disjoint from every input.
        let dst = unsafe {
            plan.out
                .segment_mut::<half::bf16>(item.start + item.q0 + i, c0, d)
        };
        // SAFETY: the caller checked the CPU's features.
        unsafe { <half::bf16 as native::Output>::store(row, dst) };
    }
}

/// Computes the output rows of one item.
fn attend<T: Elem>(plan: &Plan, scale: f32, item: Item, layout: SlotLayout, scratch: &mut [f32]) {
    let d = plan.head_dim;
    let c0 = item.head * d;
    let qb = Q_BLOCK.min(item.len - item.q0);
    let convert = plan.q.dtype != DType::F32;
    let (head, rest) = scratch[layout.q..].split_at_mut(layout.acc - layout.q);
    let q_tile = &mut head[..qb * d];
    let (acc, rest) = rest.split_at_mut(layout.s - layout.acc);
    let acc = &mut acc[..qb * d];
    let (s_tile, rest) = rest.split_at_mut(layout.max - layout.s);
    let (max, rest) = rest.split_at_mut(layout.sum - layout.max);
    let (sum, rest) = rest.split_at_mut(layout.k - layout.sum);
    let (k_tile, v_tile) = rest.split_at_mut(layout.v - layout.k);
    let (max, sum) = (&mut max[..qb], &mut sum[..qb]);

    for (i, row) in q_tile.chunks_exact_mut(d).enumerate() {
        // SAFETY: `q` is an input, disjoint from `out` (checked), so no one writes it.
        T::load(
            unsafe { plan.q.segment::<T>(item.start + item.q0 + i, c0, d) },
            row,
        );
    }
    math::scale(q_tile, scale);
    acc.fill(0.0);
    max.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    let q_op = matrix(q_tile.as_ptr(), d);

    for k0 in (0..item.len).step_by(K_BLOCK) {
        let kb = K_BLOCK.min(item.len - k0);
        let first = item.start + k0;
        let (k_op, v_op) = if convert {
            for (j, row) in k_tile[..kb * d].chunks_exact_mut(d).enumerate() {
                // SAFETY: inputs are disjoint from `out` (checked), so no one writes them.
                T::load(unsafe { plan.k.segment::<T>(first + j, c0, d) }, row);
            }
            for (j, row) in v_tile[..kb * d].chunks_exact_mut(d).enumerate() {
                // SAFETY: as above.
                T::load(unsafe { plan.v.segment::<T>(first + j, c0, d) }, row);
            }
            (matrix(k_tile.as_ptr(), d), matrix(v_tile.as_ptr(), d))
        } else {
            // SAFETY: rows `first..first + kb` and columns `c0..c0 + d` are inside the views.
            let (k_ptr, v_ptr) = unsafe {
                (
                    plan.k.ptr::<f32>().add(first * plan.k.stride + c0),
                    plan.v.ptr::<f32>().add(first * plan.v.stride + c0),
                )
            };
            (matrix(k_ptr, plan.k.stride), matrix(v_ptr, plan.v.stride))
        };
        // Kᵀ as the right operand: element (c, j) is K[j, c].
        let kt = Operand {
            ptr: k_op.ptr,
            col_stride: k_op.row_stride,
            row_stride: 1,
        };
        let s = &mut s_tile[..qb * kb];
        // Block sizes are small constants.
        let kb_rs = kb as isize;
        // SAFETY: `s` is `[qb, kb]` scratch; `q_tile` is `[qb, d]`; `kt` covers `d x kb`
        // elements of live keys; nothing else touches `s` during the call.
        unsafe {
            run_gemm(
                qb,
                kb,
                d,
                Dst {
                    ptr: s.as_mut_ptr(),
                    row_stride: kb_rs,
                },
                false,
                q_op,
                kt,
                Parallelism::None,
            );
        }
        for (i, row) in s.chunks_exact_mut(kb).enumerate() {
            online_softmax(row, &mut max[i], &mut sum[i], &mut acc[i * d..(i + 1) * d]);
        }
        let p_op = matrix(s.as_ptr(), kb);
        // `d` is a column count of a validated view.
        let d_rs = d as isize;
        // SAFETY: `acc` is `[qb, d]` scratch; `p_op` is `[qb, kb]`; `v_op` covers `kb x d`
        // elements of live values.
        unsafe {
            run_gemm(
                qb,
                d,
                kb,
                Dst {
                    ptr: acc.as_mut_ptr(),
                    row_stride: d_rs,
                },
                true,
                p_op,
                v_op,
                Parallelism::None,
            );
        }
    }
    for (i, row) in acc.chunks_exact_mut(d).enumerate() {
        math::scale(row, 1.0 / sum[i]);
        // SAFETY: this item is the only writer of these columns of this row of `out`, which
        // is disjoint from every input.
        T::store(row, unsafe {
            plan.out.segment_mut::<T>(item.start + item.q0 + i, c0, d)
        });
    }
}
