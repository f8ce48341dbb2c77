//! Native bf16 matrix products: `out = act(a · B + bias) (+ out)` with f32 accumulation, on
//! AVX512-BF16 dot products, on AMX-BF16 tiles ([`super::amx`]) where the CPU has them, or on
//! AVX-512F or AVX2 f32 FMAs with the bf16 widened in registers ([`super::fma`]) where it has
//! neither or its dot product is slow.
//!
//! Both bf16 instruction sets multiply pairs of bf16 and add both products of a pair into one
//! f32 (`vdpbf16ps` 16 lanes at a time, `tdpbf16ps` a 16 x 16 tile at a time), so both read the
//! right operand in the same layout, and the FMA kernel reads it too:
//!
//! - the right operand (the weight) is packed once into [`PackedB`]: panels of [`NR`] output
//!   columns, each panel `[pairs][NR]` 32-bit words holding `(w[j, 2i], w[j, 2i+1])`, zero-padded
//!   past `k` and `n`. `pairs` is `⌈k/2⌉`, rounded up to a whole tile of 16 pairs for AMX
//!   ([`Kernel::pair_align`]). The dot-product kernel reads one panel row per step as two full
//!   vectors, in order, so the weight streams through the prefetchers with no gathers; AMX loads
//!   16 panel rows as one tile per half-panel. Model weights are packed once and cached
//!   ([`PackCache`]); attention packs its key and value blocks as it goes.
//! - the left operand is packed per task, in the layout of the kernel the weight was packed for.
//!   For dot products it is `[⌈k/2⌉][MR]` words per block of [`MR`] rows, so the kernel's
//!   broadcasts come from one pointer at constant offsets.
//!
//! The dot-product micro-kernel keeps an `MR x NR` f32 tile in 28 of the 32 vector registers for
//! the whole of `k` (no K blocking: at `k ≤ 5120` a panel is at most 320 KiB and stays in L2),
//! then the epilogue adds the bias, applies the activation, adds the old output and converts.
//! Work is split over the device's pool by blocks of rows and, when rows are few, by ranges of
//! panels; each task packs its rows once and reuses them across all its panels.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use iris_plugin::abi::{Activation, BufferHandle};
use rayon::prelude::*;

use super::{amx, fma, math, pack};
use crate::isa::{Simd, Tier};
use crate::memory::Region;

/// Output columns per packed panel: two 16-lane f32 vectors.
pub const NR: usize = 32;
/// Rows per micro-kernel call: 14 x 2 accumulators leave 4 of 32 registers for operands.
pub const MR: usize = 14;
/// Rows per task: the packed rows (`MC x k` bf16, 280 KiB at `k = 1280`) stay in L2 while the
/// task's panels pass.
pub const MC: usize = MR * 8;
/// Tasks per pool thread the work is cut into when rows are few, for balance.
const TASKS_PER_THREAD: usize = 4;
/// Rows of the f32 tile a micro-kernel fills per call: the most of any kernel (AMX's 2 x 16).
pub(crate) const TILE_ROWS: usize = 32;

/// The f32 results of one block of rows against one panel, row-major.
pub(crate) type Tile = [[f32; NR]; TILE_ROWS];

/// The micro-kernel a product runs on, chosen when its weight is packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// AVX512-BF16 `vdpbf16ps` on vector registers.
    DotProduct,
    /// AMX-BF16 `tdpbf16ps` on tile registers.
    Amx,
    /// AVX-512F f32 FMAs on the pairs widened in registers.
    FmaAvx512,
    /// AVX2 f32 FMAs on the pairs widened in registers.
    FmaAvx2,
}

impl Kernel {
    /// The kernel a tier runs bf16 products on; `None` where the `gemm` crate runs them on a
    /// copy widened to f32.
    pub fn for_tier(tier: Tier) -> Option<Kernel> {
        match tier {
            Tier::Amx => Some(Kernel::Amx),
            Tier::Avx512Bf16 => Some(Kernel::DotProduct),
            Tier::Avx512 => Some(Kernel::FmaAvx512),
            Tier::Avx2 => Some(Kernel::FmaAvx2),
            Tier::Generic => None,
        }
    }

    /// Packed rows hold a multiple of this many pairs: AMX consumes `k` a whole tile (16
    /// pairs) at a time, and the zeros it reads past `k` must be in the packing.
    pub fn pair_align(self) -> usize {
        match self {
            Kernel::DotProduct | Kernel::FmaAvx512 | Kernel::FmaAvx2 => 1,
            Kernel::Amx => amx::TILE_PAIRS,
        }
    }

    /// Whether this CPU runs the kernel (for AMX: and the OS granted tile data).
    pub fn available(self) -> bool {
        match self {
            Kernel::DotProduct => available(),
            Kernel::Amx => available() && amx::usable(),
            Kernel::FmaAvx512 => fma::available_avx512(),
            Kernel::FmaAvx2 => fma::available_avx2(),
        }
    }

    /// Whether attention's products run on this kernel. The FMA kernels are not faster than
    /// the `gemm` crate's f32 kernels on attention's blocks (a head dimension of 64 to 128
    /// along `k` or `n`, key blocks packed as they are visited): bf16 attention at the
    /// Qwen2-VL tower's shape took about 1.3x as long on them (criterion `attention/bf16`,
    /// `avx512`), so it keeps the widened path there.
    pub fn suits_attention(self) -> bool {
        matches!(self, Kernel::DotProduct | Kernel::Amx)
    }

    /// The pairs a packed row of `k` values holds.
    fn pairs(self, k: usize) -> usize {
        k.div_ceil(2).next_multiple_of(self.pair_align())
    }
}

/// A row-major bf16 matrix in memory: element `(r, c)` at `ptr + r * stride + c` (bf16 bits).
#[derive(Clone, Copy)]
pub(crate) struct Bf16Mat {
    pub(crate) ptr: *const u16,
    pub(crate) stride: usize,
}

impl Bf16Mat {
    /// The bits of element `(j, c)` of a weight read as `[n, k]`, stored `[k, n]` when
    /// `transposed`.
    ///
    /// # Safety
    /// The element lies in live memory.
    unsafe fn get(&self, j: usize, c: usize, transposed: bool) -> u16 {
        let index = if transposed {
            c * self.stride + j
        } else {
            j * self.stride + c
        };
        // SAFETY: forwarded to the caller.
        unsafe { *self.ptr.add(index) }
    }
}

/// A row-major output matrix of `T`.
#[derive(Clone, Copy)]
pub(crate) struct OutMat<T> {
    pub(crate) ptr: *mut T,
    pub(crate) stride: usize,
}

// SAFETY: addresses of validated views or owned scratch that outlive the product they are sent
// into; tasks write disjoint tiles of an `OutMat` and only read a `Bf16Mat`.
unsafe impl Send for Bf16Mat {}
// SAFETY: as above.
unsafe impl Sync for Bf16Mat {}
// SAFETY: as above.
unsafe impl<T> Send for OutMat<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for OutMat<T> {}

/// What happens to each f32 result before it is stored.
#[derive(Clone, Copy)]
pub(crate) struct Epilogue<'a> {
    /// Added per output column (`n` values).
    pub(crate) bias: Option<&'a [f32]>,
    /// Applied after the bias.
    pub(crate) act: Activation,
    /// Add the old output after the activation.
    pub(crate) accumulate: bool,
}

impl Epilogue<'_> {
    /// Plain store.
    pub(crate) const STORE: Epilogue<'static> = Epilogue {
        bias: None,
        act: Activation::NONE,
        accumulate: false,
    };
}

/// A weight `[n, k]` packed into pairs-of-bf16 panels for one [`Kernel`] (see the module docs).
pub struct PackedB {
    data: Vec<u32>,
    n: usize,
    k: usize,
    pairs: usize,
    kernel: Kernel,
}

impl PackedB {
    /// Packs `w`, an `[n, k]` matrix, or `[k, n]` when `transposed`, for `kernel`; packs panels
    /// on the current rayon pool when `parallel`.
    ///
    /// # Safety
    /// `w` covers the stated shape in live memory that nothing writes during the call.
    pub(crate) unsafe fn pack(
        w: Bf16Mat,
        n: usize,
        k: usize,
        transposed: bool,
        parallel: bool,
        kernel: Kernel,
    ) -> PackedB {
        let mut packed = PackedB {
            data: Vec::new(),
            n,
            k,
            pairs: 0,
            kernel,
        };
        // SAFETY: forwarded to the caller.
        unsafe { packed.repack(w, n, k, transposed, parallel) };
        packed
    }

    /// Packs `w` into this buffer for the same kernel, reusing its memory (attention packs
    /// block after block).
    ///
    /// # Safety
    /// As for [`PackedB::pack`].
    pub(crate) unsafe fn repack(
        &mut self,
        w: Bf16Mat,
        n: usize,
        k: usize,
        transposed: bool,
        parallel: bool,
    ) {
        let pairs = self.kernel.pairs(k);
        let panel_len = pairs * NR;
        self.n = n;
        self.k = k;
        self.pairs = pairs;
        self.data.clear();
        self.data.resize(n.div_ceil(NR) * panel_len, 0);
        if panel_len == 0 {
            return;
        }
        // Pairs that hold at least one value; the rest stay zero.
        let filled = k.div_ceil(2);
        let fill = |(p, panel): (usize, &mut [u32])| {
            let j0 = p * NR;
            let cols = NR.min(n - j0);
            if transposed {
                // Rows `2i` and `2i + 1` of the stored `[k, n]` interleave into panel row `i`.
                for i in 0..filled {
                    // SAFETY: columns `j0..j0 + cols` of rows `2i` and `2i + 1 < k` are inside
                    // `[k, n]` (caller's contract); panel row `i` holds `NR >= cols` words.
                    unsafe {
                        let lo = w.ptr.add(2 * i * w.stride + j0);
                        let hi = (2 * i + 1 < k).then(|| lo.add(w.stride));
                        pack::interleave_rows(lo, hi, cols, panel[i * NR..].as_mut_ptr());
                    }
                }
            } else {
                // Rows of the stored `[n, k]` are rows of words: 16 of them at a time become
                // 16 columns of the panel.
                for c0 in (0..cols).step_by(16) {
                    let rows = 16.min(cols - c0);
                    // SAFETY: rows `j0 + c0..j0 + c0 + rows` hold `k / 2` whole words inside
                    // `[n, k]` (caller's contract); the panel holds `pairs * NR` words, and
                    // the last written is `(k / 2 - 1) * NR + c0 + rows - 1` from its start.
                    unsafe {
                        pack::transpose_words(
                            rows,
                            k / 2,
                            |r| w.ptr.add((j0 + c0 + r) * w.stride).cast::<u32>(),
                            panel[c0..].as_mut_ptr(),
                            NR,
                        )
                    };
                }
                if k % 2 == 1 {
                    for jj in 0..cols {
                        // SAFETY: element `(j0 + jj, k - 1)` is inside `[n, k]`.
                        panel[(k / 2) * NR + jj] =
                            u32::from(unsafe { w.get(j0 + jj, k - 1, false) });
                    }
                }
            }
        };
        if parallel {
            self.data
                .par_chunks_mut(panel_len)
                .enumerate()
                .for_each(fill);
        } else {
            self.data.chunks_mut(panel_len).enumerate().for_each(fill);
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        (self.data.capacity() * size_of::<u32>()) as u64
    }

    /// Output columns.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Reduction length.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The kernel this packing is for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Pairs per panel row: `⌈k/2⌉` rounded up to [`Kernel::pair_align`].
    pub fn pairs(&self) -> usize {
        self.pairs
    }

    /// Writes the weight back in its stored layout: `[n, k]` bf16 rows `stride` apart, or
    /// `[k, n]` when `transposed`.
    ///
    /// # Safety
    /// `w` covers that shape in live memory that nothing else touches during the call.
    pub(crate) unsafe fn unpack_into(&self, w: *mut u16, stride: usize, transposed: bool) {
        for p in 0..self.n.div_ceil(NR) {
            let panel = self.panel(p);
            let j0 = p * NR;
            for jj in 0..NR.min(self.n - j0) {
                for c in 0..self.k {
                    let word = panel[(c / 2) * NR + jj];
                    // The low half holds the even position along `k` (see `pack`).
                    let bytes = word.to_le_bytes();
                    let half = 2 * (c % 2);
                    let bits = u16::from_le_bytes([bytes[half], bytes[half + 1]]);
                    let (row, col) = if transposed {
                        (c, j0 + jj)
                    } else {
                        (j0 + jj, c)
                    };
                    // SAFETY: `(row, col)` is inside the stored shape (caller's contract).
                    unsafe { *w.add(row * stride + col) = bits };
                }
            }
        }
    }

    fn panel(&self, p: usize) -> &[u32] {
        let len = self.pairs * NR;
        &self.data[p * len..(p + 1) * len]
    }
}

/// Whether this CPU runs the dot-product kernel and the vector bf16 conversions.
pub(crate) fn available() -> bool {
    crate::isa::has_avx512_bf16()
}

/// `out[m, n] = epilogue(a[m, k] · B)` with `B` packed, on the kernel `B` was packed for; on
/// `pool` when given, else on the calling thread. `m, n, k` may be anything, zero included.
///
/// # Safety
/// `b.kernel().available()`; `a` covers `[m, k]` and `out` `[m, n]` in live memory; `out`
/// overlaps neither `a` nor the epilogue's bias and nothing else touches it during the call;
/// `b.n() == n`, `b.k() == k`, and the bias has `n` values.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul<T: Output>(
    pool: Option<(&rayon::ThreadPool, usize)>,
    m: usize,
    n: usize,
    k: usize,
    a: Bf16Mat,
    b: &PackedB,
    out: OutMat<T>,
    epilogue: Epilogue<'_>,
) {
    debug_assert!(b.kernel().available());
    // SAFETY: forwarded to the caller; the micro-kernel is the one `b` was packed for.
    unsafe {
        match b.kernel() {
            Kernel::DotProduct => matmul_on::<Dot, T>(pool, m, n, k, a, b, out, epilogue),
            Kernel::FmaAvx512 => matmul_on::<fma::Avx512, T>(pool, m, n, k, a, b, out, epilogue),
            Kernel::FmaAvx2 => matmul_on::<fma::Avx2, T>(pool, m, n, k, a, b, out, epilogue),
            Kernel::Amx => {
                matmul_on::<amx::Amx<amx::Hardware>, T>(pool, m, n, k, a, b, out, epilogue)
            }
        }
    }
}

/// A micro-kernel: how a task's rows of `a` are packed, and how a block of them meets a panel.
pub(crate) trait Micro: Default {
    /// Rows one [`Micro::block`] call computes, at most [`TILE_ROWS`].
    const BLOCK: usize;
    /// Rows per task: packed, they stay in L2 while the task's panels pass.
    const TASK_ROWS: usize;
    /// Rows of the result are written in whole groups of this many: `height` rounded up.
    const GRANULE: usize;

    /// Packs rows `m0..m0 + rows` of `a` (`k` columns) into `dst`, `pairs` pairs per row.
    ///
    /// # Safety
    /// The rows lie in live memory that nothing writes during the call.
    unsafe fn pack_rows(
        a: Bf16Mat,
        m0: usize,
        rows: usize,
        k: usize,
        pairs: usize,
        dst: &mut Vec<u32>,
    );

    /// Readies the unit for one task's blocks.
    ///
    /// # Safety
    /// The CPU runs the kernel.
    unsafe fn enter(&mut self) {}

    /// Ends a task begun with [`Micro::enter`].
    ///
    /// # Safety
    /// As for [`Micro::enter`].
    unsafe fn leave(&mut self) {}

    /// `out[..height] = packed rows r0..r0 + height · panel`, [`NR`] f32 per row; writes
    /// `height` rounded up to [`Micro::GRANULE`] rows.
    ///
    /// # Safety
    /// Inside [`Micro::enter`] and [`Micro::leave`]; `packed` came from [`Micro::pack_rows`]
    /// with these `pairs`, holds rows `r0..r0 + height`, `r0` is a multiple of
    /// [`Micro::BLOCK`], `height ≤ BLOCK`, `panel` holds `pairs * NR` words, and `out` the
    /// rows written, nothing else touching them.
    unsafe fn block(
        &mut self,
        packed: &[u32],
        r0: usize,
        height: usize,
        pairs: usize,
        panel: &[u32],
        out: TileOut,
    );
}

/// Where a micro-kernel writes: rows of [`NR`] f32, `stride` values apart.
#[derive(Clone, Copy)]
pub(crate) struct TileOut {
    pub(crate) ptr: *mut f32,
    pub(crate) stride: usize,
}

impl TileOut {
    fn of(tile: &mut Tile) -> TileOut {
        TileOut {
            ptr: tile.as_mut_ptr().cast(),
            stride: NR,
        }
    }
}

thread_local! {
    /// Each pool thread's packed rows, kept between products so that their pages stay mapped.
    static PACKED_ROWS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`matmul`] on the micro-kernel `M`.
///
/// # Safety
/// As for [`matmul`], with `M` a kernel the CPU runs and `b` packed for it.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_on<M: Micro, T: Output>(
    pool: Option<(&rayon::ThreadPool, usize)>,
    m: usize,
    n: usize,
    k: usize,
    a: Bf16Mat,
    b: &PackedB,
    out: OutMat<T>,
    epilogue: Epilogue<'_>,
) {
    debug_assert!(b.n() == n && b.k() == k);
    if m == 0 || n == 0 {
        return;
    }
    let pairs = b.pairs();
    let panels = n.div_ceil(NR);
    let row_blocks = m.div_ceil(M::TASK_ROWS);
    let threads = pool.map_or(1, |(_, threads)| threads);
    let chunks = if threads > 1 {
        (TASKS_PER_THREAD * threads)
            .div_ceil(row_blocks)
            .clamp(1, panels)
    } else {
        1
    };
    let per_chunk = panels.div_ceil(chunks);
    let tasks = row_blocks * chunks;
    // A plain f32 store needs no epilogue: whole blocks go straight into `out`.
    let direct = T::IS_F32
        && epilogue.bias.is_none()
        && epilogue.act == Activation::NONE
        && !epilogue.accumulate;
    let task = |t: usize| {
        // Whole captures: the operands' `Sync` covers their pointers.
        let (a, out) = (&a, &out);
        let (block, chunk) = (t / chunks, t % chunks);
        let m0 = block * M::TASK_ROWS;
        let rows = M::TASK_ROWS.min(m - m0);
        let p0 = chunk * per_chunk;
        let p1 = (p0 + per_chunk).min(panels);
        if p0 >= p1 {
            return;
        }
        PACKED_ROWS.with(|cell| {
            let mut packed = cell.borrow_mut();
            // SAFETY: rows `m0..m0 + rows` of `a` are inside `[m, k]` (caller's contract).
            unsafe { M::pack_rows(*a, m0, rows, k, pairs, &mut packed) };
            let mut unit = M::default();
            let mut tile: Tile = [[0.0; NR]; TILE_ROWS];
            let mut old = [0.0f32; NR];
            // SAFETY: the CPU runs `M` (caller's contract).
            unsafe { unit.enter() };
            for p in p0..p1 {
                let panel = b.panel(p);
                let j0 = p * NR;
                let cols = NR.min(n - j0);
                for r0 in (0..rows).step_by(M::BLOCK) {
                    let height = M::BLOCK.min(rows - r0);
                    if direct && cols == NR && height.is_multiple_of(M::GRANULE) {
                        // SAFETY: inside enter/leave; `packed` holds this task's rows packed
                        // with `pairs`, `r0` steps by `BLOCK`, `panel` holds `pairs * NR` words;
                        // `height` is whole granules, so the rows written are rows
                        // `m0 + r0..m0 + r0 + height < m` and columns `j0..j0 + NR <= n` of
                        // `out`, which this task alone writes.
                        unsafe {
                            let dst = TileOut {
                                ptr: out.ptr.add((m0 + r0) * out.stride + j0).cast(),
                                stride: out.stride,
                            };
                            unit.block(&packed, r0, height, pairs, panel, dst);
                        }
                        continue;
                    }
                    // SAFETY: inside enter/leave; `packed` holds this task's rows packed with
                    // `pairs`, `r0` steps by `BLOCK`, `panel` holds `pairs * NR` words, and
                    // the tile holds `TILE_ROWS` rows, as many as any kernel writes.
                    unsafe {
                        unit.block(&packed, r0, height, pairs, panel, TileOut::of(&mut tile))
                    };
                    for (r, row) in tile[..height].iter_mut().enumerate() {
                        let row = &mut row[..cols];
                        if let Some(bias) = epilogue.bias {
                            math::add_assign(row, &bias[j0..j0 + cols]);
                        }
                        if epilogue.act != Activation::NONE {
                            math::activate_slice(epilogue.act, row);
                        }
                        // SAFETY: row `m0 + r0 + r < m`, columns `j0..j0 + cols <= n` of
                        // `out`; this task alone writes them.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                out.ptr.add((m0 + r0 + r) * out.stride + j0),
                                cols,
                            )
                        };
                        if epilogue.accumulate {
                            // SAFETY: the CPU runs the kernels (caller's contract).
                            unsafe { T::load(dst, &mut old[..cols]) };
                            math::add_assign(row, &old[..cols]);
                        }
                        // SAFETY: as above.
                        unsafe { T::store(row, dst) };
                    }
                }
            }
            // SAFETY: pairs with `enter` above.
            unsafe { unit.leave() };
        });
    };
    match pool {
        Some((pool, _)) if tasks > 1 => pool.install(|| (0..tasks).into_par_iter().for_each(task)),
        _ => (0..tasks).for_each(task),
    }
}

/// The AVX512-BF16 micro-kernel: blocks of [`MR`] rows against a panel, in vector registers.
#[derive(Default)]
pub(crate) struct Dot;

impl Micro for Dot {
    const BLOCK: usize = MR;
    const TASK_ROWS: usize = MC;
    const GRANULE: usize = 1;

    /// Packs into `[pairs][MR]` words per block of `MR` rows (the last block
    /// `[pairs][rows % MR]`), so block `r0` starts at word `r0 * pairs`.
    unsafe fn pack_rows(
        a: Bf16Mat,
        m0: usize,
        rows: usize,
        k: usize,
        pairs: usize,
        dst: &mut Vec<u32>,
    ) {
        debug_assert_eq!(pairs, k.div_ceil(2));
        dst.clear();
        dst.resize(rows * pairs, 0);
        for r0 in (0..rows).step_by(MR) {
            let height = MR.min(rows - r0);
            let block = &mut dst[r0 * pairs..(r0 + height) * pairs];
            let row = |r: usize| {
                // SAFETY: row `m0 + r0 + r` of `a` (caller's contract).
                unsafe { a.ptr.add((m0 + r0 + r) * a.stride) }
            };
            // SAFETY: each row holds `k / 2` whole words; `block` holds `pairs * height`
            // words, of which the transpose writes the first `(k / 2) * height`.
            unsafe {
                pack::transpose_words(
                    height,
                    k / 2,
                    |r| row(r).cast::<u32>(),
                    block.as_mut_ptr(),
                    height,
                )
            };
            if k % 2 == 1 {
                for r in 0..height {
                    // SAFETY: the last value of row `r` (caller's contract).
                    block[(pairs - 1) * height + r] = u32::from(unsafe { *row(r).add(k - 1) });
                }
            }
        }
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
        let lhs = &packed[r0 * pairs..(r0 + height) * pairs];
        debug_assert!(panel.len() == pairs * NR);
        macro_rules! dispatch {
            ($($h:literal)*) => {
                match height {
                    // SAFETY: the CPU has the features and `out` holds `height` rows (caller's
                    // contract); `lhs` holds `pairs * height` words and `panel` `pairs * NR`.
                    $($h => unsafe { kernel::<$h>(lhs.as_ptr(), panel.as_ptr(), pairs, out) },)*
                    _ => unreachable!("tile height {height} outside 1..={MR}"),
                }
            };
        }
        dispatch!(1 2 3 4 5 6 7 8 9 10 11 12 13 14);
    }
}

/// The micro-kernel: an `R x NR` f32 tile in registers over all `pairs` steps.
///
/// # Safety
/// The CPU has AVX-512F/BW and AVX512-BF16; `lhs` holds `pairs * R` words, `panel`
/// `pairs * NR`, and `out` `R` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn kernel<const R: usize>(lhs: *const u32, panel: *const u32, pairs: usize, out: TileOut) {
    use std::arch::x86_64::{
        __m512bh, _mm512_dpbf16_ps, _mm512_loadu_ps, _mm512_set1_epi32, _mm512_setzero_ps,
        _mm512_storeu_ps,
    };
    // SAFETY (whole body): reads stay inside `lhs` (`pairs * R` words) and `panel`
    // (`pairs * NR` words) per the caller; `__m512bh` and `__m512` are both 64 bytes of lanes.
    unsafe {
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        let (mut a, mut b) = (lhs, panel);
        for _ in 0..pairs {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_ps(b.cast::<f32>()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_ps(b.add(16).cast::<f32>()));
            for r in 0..R {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r) as i32));
                lo[r] = _mm512_dpbf16_ps(lo[r], x, b0);
                hi[r] = _mm512_dpbf16_ps(hi[r], x, b1);
            }
            a = a.add(R);
            b = b.add(NR);
        }
        for r in 0..R {
            let row = out.ptr.add(r * out.stride);
            _mm512_storeu_ps(row, lo[r]);
            _mm512_storeu_ps(row.add(16), hi[r]);
        }
    }
}

/// Portable stand-in so that the crate builds elsewhere; never called ([`available`] is false).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<const R: usize>(
    _lhs: *const u32,
    _panel: *const u32,
    _pairs: usize,
    _out: TileOut,
) {
    unreachable!("the bf16 kernels need x86-64")
}

/// An output element type of [`matmul`]: f32, or bf16 rounded to nearest even on the vector
/// instructions of the thread's [`crate::isa::active`] set: with AVX512-BF16's `vcvtneps2bf16`
/// where the CPU has it (denormals flush to zero, which the scalar conversion elsewhere keeps),
/// else with AVX-512F or AVX2 integer operations that round as the scalar conversion does.
pub(crate) trait Output: Copy + Send + Sync + 'static {
    /// Whether this is f32, which results are stored as without conversion.
    const IS_F32: bool;

    /// Converts `src` into `dst` (same length).
    ///
    /// # Safety
    /// None beyond the slices' (the instruction set is checked); unsafe as the vector code
    /// behind it is.
    unsafe fn load(src: &[Self], dst: &mut [f32]);
    /// Converts `src` into `dst` (same length).
    ///
    /// # Safety
    /// As for [`Output::load`].
    unsafe fn store(src: &[f32], dst: &mut [Self]);
}

impl Output for f32 {
    const IS_F32: bool = true;
    unsafe fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    unsafe fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Output for half::bf16 {
    const IS_F32: bool = false;
    unsafe fn load(src: &[half::bf16], dst: &mut [f32]) {
        // SAFETY: each conversion runs where the CPU has its instructions.
        unsafe {
            match crate::isa::active() {
                Simd::Avx512 if fma::available_avx512() => widen_bf16(src, dst),
                Simd::Avx512 | Simd::Avx2 if fma::available_avx2() => widen_bf16_avx2(src, dst),
                _ => super::Elem::load(src, dst),
            }
        }
    }
    unsafe fn store(src: &[f32], dst: &mut [half::bf16]) {
        // SAFETY: as above; the dot-product conversion where the CPU has it.
        unsafe {
            match crate::isa::active() {
                Simd::Avx512 if available() => narrow_bf16(src, dst),
                Simd::Avx512 if fma::available_avx512() => narrow_bf16_rounding(src, dst),
                Simd::Avx512 | Simd::Avx2 if fma::available_avx2() => {
                    narrow_bf16_rounding_avx2(src, dst)
                }
                _ => super::Elem::store(src, dst),
            }
        }
    }
}

/// bf16 to f32 (exact): each value's bits shifted into the high half of a 32-bit lane.
///
/// # Safety
/// The CPU has AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen_bf16(src: &[half::bf16], dst: &mut [f32]) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_slli_epi32,
        _mm512_storeu_ps,
    };
    debug_assert_eq!(src.len(), dst.len());
    let mut chunks = src.chunks_exact(16);
    let mut out = dst.chunks_exact_mut(16);
    for (s, d) in (&mut chunks).zip(&mut out) {
        // SAFETY: 16 bf16 (32 bytes) read from `s`, 16 f32 written to `d`.
        unsafe {
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(s.as_ptr().cast::<__m256i>()));
            _mm512_storeu_ps(
                d.as_mut_ptr(),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)),
            );
        }
    }
    for (s, d) in chunks.remainder().iter().zip(out.into_remainder()) {
        *d = s.to_f32();
    }
}

/// f32 to bf16, rounding to nearest even.
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn narrow_bf16(src: &[f32], dst: &mut [half::bf16]) {
    use std::arch::x86_64::{__m256i, _mm256_storeu_si256, _mm512_cvtneps_pbh, _mm512_loadu_ps};
    debug_assert_eq!(src.len(), dst.len());
    let mut chunks = src.chunks_exact(16);
    let mut out = dst.chunks_exact_mut(16);
    for (s, d) in (&mut chunks).zip(&mut out) {
        // SAFETY: 16 f32 read from `s`, 16 bf16 (32 bytes) written to `d`; `__m256bh` and
        // `__m256i` are both 32 bytes.
        unsafe {
            let narrow: __m256i =
                std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(s.as_ptr())));
            _mm256_storeu_si256(d.as_mut_ptr().cast::<__m256i>(), narrow);
        }
    }
    for (s, d) in chunks.remainder().iter().zip(out.into_remainder()) {
        *d = half::bf16::from_f32(*s);
    }
}

/// f32 to bf16 on AVX-512F integer operations, rounding to nearest even as
/// `half::bf16::from_f32` does: `bits + 0x7fff + (bit 16)`, then the high half; a NaN keeps its
/// high half with the quiet bit set.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn narrow_bf16_rounding(src: &[f32], dst: &mut [half::bf16]) {
    use std::arch::x86_64::{
        __m256i, _CMP_UNORD_Q, _mm256_storeu_si256, _mm512_add_epi32, _mm512_and_si512,
        _mm512_castps_si512, _mm512_cmp_ps_mask, _mm512_cvtepi32_epi16, _mm512_loadu_ps,
        _mm512_mask_blend_epi32, _mm512_or_si512, _mm512_set1_epi32, _mm512_srli_epi32,
    };
    debug_assert_eq!(src.len(), dst.len());
    let mut chunks = src.chunks_exact(16);
    let mut out = dst.chunks_exact_mut(16);
    for (s, d) in (&mut chunks).zip(&mut out) {
        // SAFETY: 16 f32 read from `s`, 16 bf16 (32 bytes) written to `d`.
        unsafe {
            let x = _mm512_loadu_ps(s.as_ptr());
            let bits = _mm512_castps_si512(x);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
            let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            let chosen = _mm512_mask_blend_epi32(nan, rounded, quiet);
            let narrow = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(chosen));
            _mm256_storeu_si256(d.as_mut_ptr().cast::<__m256i>(), narrow);
        }
    }
    for (s, d) in chunks.remainder().iter().zip(out.into_remainder()) {
        *d = half::bf16::from_f32(*s);
    }
}

/// bf16 to f32 (exact) on AVX2, 8 lanes at a time.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_bf16_avx2(src: &[half::bf16], dst: &mut [f32]) {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_slli_epi32,
        _mm256_storeu_ps,
    };
    debug_assert_eq!(src.len(), dst.len());
    let mut chunks = src.chunks_exact(8);
    let mut out = dst.chunks_exact_mut(8);
    for (s, d) in (&mut chunks).zip(&mut out) {
        // SAFETY: 8 bf16 (16 bytes) read from `s`, 8 f32 written to `d`.
        unsafe {
            let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(s.as_ptr().cast::<__m128i>()));
            _mm256_storeu_ps(
                d.as_mut_ptr(),
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits)),
            );
        }
    }
    for (s, d) in chunks.remainder().iter().zip(out.into_remainder()) {
        *d = s.to_f32();
    }
}

/// f32 to bf16 on AVX2 integer operations, rounding as [`narrow_bf16_rounding`] does, 8 lanes
/// at a time.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn narrow_bf16_rounding_avx2(src: &[f32], dst: &mut [half::bf16]) {
    use std::arch::x86_64::{
        __m128i, _CMP_UNORD_Q, _mm_storeu_si128, _mm256_add_epi32, _mm256_and_si256,
        _mm256_blendv_epi8, _mm256_castps_si256, _mm256_castsi256_si128, _mm256_cmp_ps,
        _mm256_loadu_ps, _mm256_or_si256, _mm256_packus_epi32, _mm256_permute4x64_epi64,
        _mm256_set1_epi32, _mm256_srli_epi32,
    };
    debug_assert_eq!(src.len(), dst.len());
    let mut chunks = src.chunks_exact(8);
    let mut out = dst.chunks_exact_mut(8);
    for (s, d) in (&mut chunks).zip(&mut out) {
        // SAFETY: 8 f32 read from `s`, 8 bf16 (16 bytes) written to `d`.
        unsafe {
            let x = _mm256_loadu_ps(s.as_ptr());
            let bits = _mm256_castps_si256(x);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
            let rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
            let quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            let high = _mm256_srli_epi32::<16>(_mm256_blendv_epi8(rounded, quiet, nan));
            // Every lane is at most 0xffff, so the unsigned saturation is exact; the pack works
            // per 128-bit lane, and the permutation brings the two lanes' halves together.
            let packed = _mm256_packus_epi32(high, high);
            let ordered = _mm256_permute4x64_epi64::<0b00_00_10_00>(packed);
            _mm_storeu_si128(
                d.as_mut_ptr().cast::<__m128i>(),
                _mm256_castsi256_si128(ordered),
            );
        }
    }
    for (s, d) in chunks.remainder().iter().zip(out.into_remainder()) {
        *d = half::bf16::from_f32(*s);
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn narrow_bf16_rounding(src: &[f32], dst: &mut [half::bf16]) {
    super::Elem::store(src, dst);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn widen_bf16_avx2(src: &[half::bf16], dst: &mut [f32]) {
    super::Elem::load(src, dst);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn narrow_bf16_rounding_avx2(src: &[f32], dst: &mut [half::bf16]) {
    super::Elem::store(src, dst);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn widen_bf16(src: &[half::bf16], dst: &mut [f32]) {
    super::Elem::load(src, dst);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn narrow_bf16(src: &[f32], dst: &mut [half::bf16]) {
    super::Elem::store(src, dst);
}

/// Where a packed weight came from: buffer, byte offset, shape, stride and layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PackKey {
    pub(crate) buf: BufferHandle,
    pub(crate) offset: u64,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) stride: usize,
    pub(crate) transposed: bool,
}

impl PackKey {
    /// Bytes from the first element to one past the last (bf16 elements).
    fn span(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        ((self.rows - 1) * self.stride + self.cols) * size_of::<u16>()
    }

    /// Whether the weight's bytes overlap bytes `[start, end)` of its buffer.
    fn overlaps(&self, start: u64, end: u64) -> bool {
        let first = self.offset;
        let last = first.saturating_add(self.span() as u64);
        first < end && start < last
    }
}

/// The packed copies of constant weights, keyed by where they came from, each standing in for
/// its weight's bytes.
///
/// A weight stored densely (no gaps between rows) is held once: once packed, the pages of its
/// buffer range go back to the OS (`Region::release_pages`) and the packed copy is the only
/// one. Anything that then touches those bytes other than a product on the packed copy (a read,
/// a copy, a write, another op) first unpacks them back into place and drops the copy
/// (`PackCache::touch`), so the buffer's contents never change behind a caller's back. A
/// weight with gaps keeps its bytes and the copy sits beside them. [`PackCache::bytes`] counts
/// what the copies add to the buffers they belong to: the padding of the panels and the page
/// ends that stay mapped, or the whole copy where it sits beside.
#[derive(Default)]
pub struct PackCache {
    entries: Mutex<HashMap<BufferHandle, Vec<Entry>>>,
    bytes: AtomicU64,
}

/// One packed weight.
struct Entry {
    key: PackKey,
    packed: Arc<PackedB>,
    /// The buffer whose pages the copy replaced, and how many bytes went back to the OS.
    released: Option<(Arc<Region>, usize)>,
}

impl Entry {
    /// Bytes the copy adds to its buffer.
    fn extra(&self) -> u64 {
        let released = self.released.as_ref().map_or(0, |(_, bytes)| *bytes);
        self.packed.bytes().saturating_sub(released as u64)
    }

    /// Unpacks the weight back into its buffer when its pages were given back.
    fn restore(&self) {
        if let Some((region, _)) = &self.released {
            let key = &self.key;
            // Invariant: the key's offset was validated inside this region when it was packed.
            let start = usize::try_from(key.offset).expect("offset inside a live region");
            // SAFETY: the weight lies inside the region (validated when packed) and is dense;
            // the caller holds the cache lock, so no product is reading the copy's pages while
            // nothing else may read the range until this returns (see `PackCache::touch`).
            unsafe {
                self.packed.unpack_into(
                    region.ptr().add(start).cast::<u16>(),
                    key.stride,
                    key.transposed,
                );
            }
        }
    }
}

impl PackCache {
    /// The packed copy for `key`, packing it with `pack` on a miss. The copy is kept only when
    /// `live()` (asked under the cache's lock) says the buffer still exists, so a buffer freed
    /// while its product was queued leaves nothing behind. A kept copy of a dense weight
    /// replaces the weight's pages in `region`, the buffer `key` names.
    ///
    /// # Safety
    /// Runs in queue order; `key` describes a validated bf16 range of `region`, and the range
    /// is not read again except through this cache (every other access goes through
    /// [`PackCache::touch`] first).
    pub(crate) unsafe fn get_or_pack(
        &self,
        key: PackKey,
        region: &Arc<Region>,
        live: impl Fn() -> bool,
        pack: impl FnOnce() -> PackedB,
    ) -> Arc<PackedB> {
        if let Some(found) = self.find(&key) {
            return found;
        }
        // The same bytes read with another shape: put them back before reading them.
        self.touch(key.buf, key.offset, key.offset + key.span() as u64);
        let packed = Arc::new(pack());
        let mut entries = self.lock();
        if let Some(found) = entries
            .get(&key.buf)
            .and_then(|list| list.iter().find(|entry| entry.key == key))
        {
            return Arc::clone(&found.packed);
        }
        if !live() {
            return packed;
        }
        let list = entries.entry(key.buf).or_default();
        let dense = key.stride == key.cols;
        let released = dense
            .then(|| {
                let start = usize::try_from(key.offset).ok()?;
                // SAFETY: the range is inside the region (caller's contract) and only read
                // through the copy from now on.
                let bytes = unsafe { region.release_pages(start, key.span()) };
                (bytes > 0).then(|| (Arc::clone(region), bytes))
            })
            .flatten();
        let entry = Entry {
            key,
            packed: Arc::clone(&packed),
            released,
        };
        self.bytes.fetch_add(entry.extra(), Ordering::AcqRel);
        list.push(entry);
        packed
    }

    /// Makes bytes `[start, end)` of `buf` plain memory again before something other than a
    /// product on a packed copy touches them: every copy over them is unpacked into place if it
    /// replaced the bytes, and dropped (a write would make it stale). Runs in queue order.
    pub(crate) fn touch(&self, buf: BufferHandle, start: u64, end: u64) {
        let mut entries = self.lock();
        let Some(list) = entries.get_mut(&buf) else {
            return;
        };
        list.retain(|entry| {
            if !entry.key.overlaps(start, end) {
                return true;
            }
            entry.restore();
            self.bytes.fetch_sub(entry.extra(), Ordering::AcqRel);
            false
        });
        if list.is_empty() {
            entries.remove(&buf);
        }
    }

    /// Drops every packed copy taken from `buf`, which was just freed. Work queued before the
    /// free may still read the buffer, so a copy that replaced bytes of a buffer such work holds
    /// is unpacked first.
    ///
    /// This runs on the caller's thread, outside queue order, so the unpacking holds the cache
    /// lock until it is whole: queued work looks the weight up, or puts bytes back
    /// ([`PackCache::touch`]), under that lock, and so finds either the packed copy or the
    /// complete weight in its buffer, never a half-written one.
    pub(crate) fn evict(&self, buf: BufferHandle) {
        let mut entries = self.lock();
        let Some(list) = entries.remove(&buf) else {
            return;
        };
        for entry in list {
            // The entry holds one reference; any other is queued work's (the table forgot the
            // handle before this call).
            if let Some((region, _)) = &entry.released
                && Arc::strong_count(region) > 1
            {
                entry.restore();
            }
            self.bytes.fetch_sub(entry.extra(), Ordering::AcqRel);
        }
        drop(entries);
    }

    /// Bytes the packed copies add to the buffers they come from.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    /// Number of packed copies held.
    pub fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Whether no packed copy is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of buffers the packed copies have given back to the OS.
    pub fn released_bytes(&self) -> u64 {
        self.lock()
            .values()
            .flatten()
            .filter_map(|entry| entry.released.as_ref())
            .map(|(_, bytes)| *bytes as u64)
            .sum()
    }

    fn find(&self, key: &PackKey) -> Option<Arc<PackedB>> {
        self.lock()
            .get(&key.buf)?
            .iter()
            .find(|entry| entry.key == *key)
            .map(|entry| Arc::clone(&entry.packed))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<BufferHandle, Vec<Entry>>> {
        // A poisoned lock only means a panic elsewhere; the map itself stays consistent.
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    fn bits(values: &[f32]) -> Vec<u16> {
        values
            .iter()
            .map(|v| bf16::from_f32(*v).to_bits())
            .collect()
    }

    fn value(seed: usize) -> f32 {
        // Small integers and halves: exact in bf16, so products and sums are exact in f32.
        ((seed * 7919 % 17) as f32 - 8.0) * 0.5
    }

    /// How a test runs a product: on the kernel a weight is packed for, or on the AMX loops
    /// with the tile instructions computed by [`amx::model::Model`].
    #[derive(Clone, Copy, Debug)]
    enum Runner {
        Native(Kernel),
        AmxModel,
    }

    impl Runner {
        /// Every runner this CPU runs; the ones it cannot are named with the reason.
        fn all() -> Vec<Runner> {
            let mut runners = vec![Runner::AmxModel];
            for (kernel, tier) in [
                (Kernel::DotProduct, Tier::Avx512Bf16),
                (Kernel::Amx, Tier::Amx),
                (Kernel::FmaAvx512, Tier::Avx512),
                (Kernel::FmaAvx2, Tier::Avx2),
            ] {
                if kernel.available() {
                    runners.push(Runner::Native(kernel));
                } else {
                    let why = Tier::resolve(tier).1.unwrap_or_default();
                    eprintln!("skipped the {kernel:?} kernel: {why}");
                }
            }
            runners
        }

        fn kernel(self) -> Kernel {
            match self {
                Runner::Native(kernel) => kernel,
                Runner::AmxModel => Kernel::Amx,
            }
        }

        /// # Safety
        /// As for [`matmul`], bar the kernel's availability for the model.
        #[allow(clippy::too_many_arguments)]
        unsafe fn run<T: Output>(
            self,
            pool: Option<(&rayon::ThreadPool, usize)>,
            m: usize,
            n: usize,
            k: usize,
            a: Bf16Mat,
            b: &PackedB,
            out: OutMat<T>,
            epilogue: Epilogue<'_>,
        ) {
            // SAFETY: forwarded to the caller.
            unsafe {
                match self {
                    Runner::Native(_) => matmul(pool, m, n, k, a, b, out, epilogue),
                    Runner::AmxModel => matmul_on::<amx::Amx<amx::model::Model>, T>(
                        pool, m, n, k, a, b, out, epilogue,
                    ),
                }
            }
        }
    }

    /// Exact products (inputs exact in bf16, sums small integers) against an f64 loop, on
    /// every kernel: every dot-product tile height, AMX's half and whole 32-row blocks, odd
    /// and even `k` inside and across 32-value tiles, ragged `n`, more rows than one task;
    /// both weight layouts; with and without bias and accumulation.
    #[test]
    fn products_are_exact_on_exact_inputs() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let shapes = [
            (1, 1, 1),
            (15, 33, 3),
            (29, 65, 16),
            (113, 40, 17),
            (17, 32, 32),
            (33, 70, 97),
            (130, 17, 64),
        ];
        for runner in Runner::all() {
            for (m, n, k) in shapes {
                let a: Vec<f32> = (0..m * k).map(value).collect();
                let w: Vec<f32> = (0..n * k).map(|i| value(i + 3)).collect();
                let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
                let bias: Vec<f32> = (0..n).map(|j| value(j + 11)).collect();
                let old: Vec<f32> = (0..m * n).map(|i| value(i + 5)).collect();
                let (abits, wbits, wtbits) = (bits(&a), bits(&w), bits(&wt));
                for (transposed, add) in [(false, false), (true, false), (false, true)] {
                    let src = if transposed { &wtbits } else { &wbits };
                    let stride = if transposed { n } else { k };
                    let a_mat = Bf16Mat {
                        ptr: abits.as_ptr(),
                        stride: k,
                    };
                    let w_mat = Bf16Mat {
                        ptr: src.as_ptr(),
                        stride,
                    };
                    // SAFETY: the vectors cover the shapes.
                    let packed =
                        unsafe { PackedB::pack(w_mat, n, k, transposed, false, runner.kernel()) };
                    assert!(packed.pairs().is_multiple_of(runner.kernel().pair_align()));
                    let mut out = if add {
                        old.clone()
                    } else {
                        vec![f32::NAN; m * n]
                    };
                    let out_mat = OutMat {
                        ptr: out.as_mut_ptr(),
                        stride: n,
                    };
                    let epilogue = Epilogue {
                        bias: add.then_some(bias.as_slice()),
                        act: Activation::NONE,
                        accumulate: add,
                    };
                    // SAFETY: as above; `out` is separate.
                    unsafe {
                        runner.run(Some((&pool, 2)), m, n, k, a_mat, &packed, out_mat, epilogue)
                    };
                    for i in 0..m {
                        for j in 0..n {
                            let mut want: f64 = (0..k)
                                .map(|c| f64::from(a[i * k + c]) * f64::from(w[j * k + c]))
                                .sum();
                            if add {
                                want += f64::from(bias[j]) + f64::from(old[i * n + j]);
                            }
                            assert_eq!(
                                f64::from(out[i * n + j]),
                                want,
                                "{runner:?} {m}x{n}x{k} transposed={transposed} add={add} \
                                 at ({i}, {j})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// General inputs: every kernel within f32 rounding of an f64 loop over the same bf16
    /// values, bf16 output included where the CPU converts it natively.
    #[test]
    fn products_match_a_reference_on_general_inputs() {
        let (m, n, k) = (45, 50, 300);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.0137)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) * 0.0211)
            .collect();
        let (abits, wbits) = (bits(&a), bits(&w));
        let widen = |b: u16| f64::from(bf16::from_bits(b).to_f32());
        let converts = fma::available_avx2();
        if !converts {
            eprintln!("bf16 outputs not checked: this CPU lacks AVX2 for the conversions");
        }
        for runner in Runner::all() {
            let a_mat = Bf16Mat {
                ptr: abits.as_ptr(),
                stride: k,
            };
            let w_mat = Bf16Mat {
                ptr: wbits.as_ptr(),
                stride: k,
            };
            // SAFETY: the vectors cover the shapes.
            let packed = unsafe { PackedB::pack(w_mat, n, k, false, true, runner.kernel()) };
            let mut out = vec![0.0f32; m * n];
            let out_mat = OutMat {
                ptr: out.as_mut_ptr(),
                stride: n,
            };
            // SAFETY: as above.
            unsafe { runner.run(None, m, n, k, a_mat, &packed, out_mat, Epilogue::STORE) };
            let mut narrow = vec![bf16::ZERO; m * n];
            if converts {
                let narrow_mat = OutMat {
                    ptr: narrow.as_mut_ptr(),
                    stride: n,
                };
                // SAFETY: as above; the CPU has the vector conversions.
                unsafe { runner.run(None, m, n, k, a_mat, &packed, narrow_mat, Epilogue::STORE) };
            }
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| widen(abits[i * k + c]) * widen(wbits[j * k + c]))
                        .sum();
                    let scale: f64 = (0..k)
                        .map(|c| (widen(abits[i * k + c]) * widen(wbits[j * k + c])).abs())
                        .sum();
                    let got = f64::from(out[i * n + j]);
                    assert!(
                        (got - want).abs() <= 1e-6 * scale,
                        "{runner:?} f32 at ({i}, {j}): {got} vs {want}"
                    );
                    if converts {
                        let got = f64::from(narrow[i * n + j].to_f32());
                        assert!(
                            (got - want).abs() <= 1e-6 * scale + want.abs() / 256.0,
                            "{runner:?} bf16 at ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The instruction sets this CPU runs the vector conversions on, with a function that
    /// runs a closure on each.
    fn conversion_sets() -> Vec<Simd> {
        let sets: Vec<Simd> = [Simd::Avx512, Simd::Avx2]
            .into_iter()
            .filter(|simd| match simd {
                Simd::Avx512 => fma::available_avx512(),
                _ => fma::available_avx2(),
            })
            .collect();
        if sets.is_empty() {
            eprintln!("vector conversions not checked: this CPU lacks AVX2");
        }
        sets
    }

    /// The vector conversions round like `half` (to nearest even) on normal values, ties and
    /// the tail past the last full vector included; widening is exact. On every instruction
    /// set the CPU runs them on.
    #[test]
    fn vector_conversions_match_the_scalar_ones() {
        let mut values: Vec<f32> = (0..37).map(|i| (i as f32 - 18.3) * 0.137).collect();
        // Exact ties between two bf16 values: 1 + 2^-8 and 1 + 3 * 2^-8.
        values.extend([
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -0.0,
            f32::INFINITY,
            3.0e38,
        ]);
        for simd in conversion_sets() {
            crate::isa::with_simd(simd, || {
                let mut narrow = vec![bf16::ZERO; values.len()];
                // SAFETY: plain slices of equal length.
                unsafe { <bf16 as Output>::store(&values, &mut narrow) };
                for (v, got) in values.iter().zip(&narrow) {
                    assert_eq!(got.to_bits(), bf16::from_f32(*v).to_bits(), "{simd:?} {v}");
                }
                let mut wide = vec![0.0f32; narrow.len()];
                // SAFETY: as above.
                unsafe { <bf16 as Output>::load(&narrow, &mut wide) };
                for (n, got) in narrow.iter().zip(&wide) {
                    assert_eq!(got.to_bits(), n.to_f32().to_bits(), "{simd:?}");
                }
            });
        }
    }

    /// The conversions for CPUs without AVX512-BF16 round bit for bit as `half` does, on
    /// every kind of value: ties either way, values that round up into the next exponent or
    /// to infinity, denormals (which `vcvtneps2bf16` would flush), infinities and NaNs.
    #[test]
    fn the_integer_rounding_matches_half_on_every_kind_of_value() {
        let mut values: Vec<f32> = [
            0x3f80_8000u32, // 1 + 2^-8: a tie, rounds down to the even 1
            0x3f81_8000,    // a tie that rounds up to the even neighbour
            0x3f80_8001,    // just above a tie
            0x3fff_ffff,    // rounds up into the next exponent
            0x7f7f_ffff,    // the largest f32: rounds to infinity
            0xff7f_ffff,
            0x0000_0001, // the smallest denormal
            0x0040_8000, // a denormal tie
            0x807f_ffff, // the largest negative denormal
            0x7f80_0000, // infinity
            0xff80_0000,
            0x7fc0_0000, // a quiet NaN
            0x7f80_0001, // a signalling NaN whose payload sits in the low half only
            0xffa0_1234,
            0x8000_0000,
        ]
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
        values.extend((0..4099u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
        for simd in conversion_sets() {
            let mut got = vec![bf16::ZERO; values.len()];
            // SAFETY: the CPU has the instruction set (`conversion_sets`).
            unsafe {
                match simd {
                    Simd::Avx512 => narrow_bf16_rounding(&values, &mut got),
                    _ => narrow_bf16_rounding_avx2(&values, &mut got),
                }
            }
            for (v, got) in values.iter().zip(&got) {
                assert_eq!(
                    got.to_bits(),
                    bf16::from_f32(*v).to_bits(),
                    "{simd:?} {v} ({:#010x})",
                    v.to_bits()
                );
            }
        }
    }

    /// The AMX loops on the model: one product per 16 x 16 output tile and 16 pairs of `k`
    /// (half blocks skip the lower tiles), and every task configures and releases the tiles.
    #[test]
    fn amx_blocks_issue_whole_tiles_only() {
        let (rows, k) = (20, 40);
        let abits = bits(&(0..rows * k).map(value).collect::<Vec<_>>());
        let a = Bf16Mat {
            ptr: abits.as_ptr(),
            stride: k,
        };
        let pairs = Kernel::Amx.pairs(k);
        assert_eq!(pairs, 32);
        let mut packed = Vec::new();
        // SAFETY: `abits` is `[rows, k]`.
        unsafe { amx::Amx::<amx::model::Model>::pack_rows(a, 0, rows, k, pairs, &mut packed) };
        assert_eq!(packed.len(), 32 * pairs, "rows padded to whole tiles");
        assert!(packed[rows * pairs..].iter().all(|&w| w == 0));
        assert!(packed[..pairs].iter().skip(k / 2).all(|&w| w == 0));
        let panel = vec![0u32; pairs * NR];
        let mut tile: Tile = [[0.0; NR]; TILE_ROWS];
        for (height, dots) in [(16, 2 * 2), (17, 4 * 2)] {
            let mut micro = amx::Amx::<amx::model::Model>::default();
            // SAFETY: the model runs anywhere; `packed` holds 32 rows of `pairs` words.
            unsafe {
                micro.enter();
                micro.block(&packed, 0, height, pairs, &panel, TileOut::of(&mut tile));
                micro.leave();
            }
            assert_eq!(micro.unit().dots, dots, "height {height}");
        }
    }

    /// A `[rows, cols]` bf16 weight at the start of a fresh buffer of `memory`, its bits and its
    /// handle.
    fn weight_buffer(
        memory: &crate::memory::Memory,
        rows: usize,
        cols: usize,
        extra: usize,
    ) -> (BufferHandle, Arc<Region>, Vec<u16>) {
        let values: Vec<f32> = (0..rows * cols).map(|i| value(i * 7 + 3)).collect();
        let w = bits(&values);
        let buf = memory
            .alloc((w.len() * 2 + extra) as u64, 0, || Ok(()))
            .unwrap();
        let region = memory.region("test", buf).unwrap();
        // SAFETY: the region holds at least `w.len()` bf16 and nothing else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(w.as_ptr(), region.ptr().cast::<u16>(), w.len()) };
        (buf, region, w)
    }

    /// The buffer's first `len` bf16, as stored now.
    fn stored(region: &Region, len: usize) -> Vec<u16> {
        // SAFETY: the region holds at least `len` bf16, and the test is its only user.
        unsafe { std::slice::from_raw_parts(region.ptr().cast::<u16>(), len) }.to_vec()
    }

    fn key(buf: BufferHandle, rows: usize, cols: usize, transposed: bool) -> PackKey {
        PackKey {
            buf,
            offset: 0,
            rows,
            cols,
            stride: cols,
            transposed,
        }
    }

    fn pack_of(region: &Region, key: PackKey) -> PackedB {
        let (n, k) = if key.transposed {
            (key.cols, key.rows)
        } else {
            (key.rows, key.cols)
        };
        let w = Bf16Mat {
            ptr: region.ptr().cast::<u16>(),
            stride: key.stride,
        };
        // SAFETY: the key describes the weight written at the start of the region.
        unsafe { PackedB::pack(w, n, k, key.transposed, false, Kernel::DotProduct) }
    }

    #[test]
    fn unpacking_gives_back_the_weight_in_either_layout() {
        for (n, k, transposed) in [(70, 33, false), (33, 70, true), (32, 64, false)] {
            let (rows, cols) = if transposed { (k, n) } else { (n, k) };
            let values: Vec<f32> = (0..rows * cols).map(value).collect();
            let w = bits(&values);
            let mat = Bf16Mat {
                ptr: w.as_ptr(),
                stride: cols,
            };
            // SAFETY: `w` is `[rows, cols]`.
            let packed = unsafe { PackedB::pack(mat, n, k, transposed, false, Kernel::Amx) };
            let mut back = vec![0u16; w.len()];
            // SAFETY: `back` is `[rows, cols]`.
            unsafe { packed.unpack_into(back.as_mut_ptr(), cols, transposed) };
            assert_eq!(back, w, "n {n} k {k} transposed {transposed}");
        }
    }

    #[test]
    fn a_dense_weight_is_held_once_and_put_back_when_touched() {
        let memory = crate::memory::Memory::new(1 << 24, false);
        let cache = PackCache::default();
        let (rows, cols) = (256, 96);
        let (buf, region, w) = weight_buffer(&memory, rows, cols, 1024);
        let key = key(buf, rows, cols, false);
        // SAFETY: the test is in queue order by construction (one thread), and reaches the
        // weight's bytes only through `touch` below.
        let first = unsafe { cache.get_or_pack(key, &region, || true, || pack_of(&region, key)) };
        let released = cache.released_bytes();
        // 48 KiB of weight: all but the partial pages at its ends go back to the OS.
        assert!(released + 8192 >= (w.len() * 2) as u64, "{released}");
        assert_eq!(cache.bytes(), first.bytes() - released);
        // SAFETY: as above.
        let again = unsafe { cache.get_or_pack(key, &region, || true, || unreachable!("cached")) };
        assert!(Arc::ptr_eq(&first, &again));

        // Bytes past the weight are not the weight's: touching them keeps the copy.
        let end = (w.len() * 2) as u64;
        cache.touch(buf, end, end + 1024);
        assert_eq!(cache.len(), 1);
        // A read of the weight's bytes gets them back exactly, and the copy goes.
        cache.touch(buf, 10, 12);
        assert!(cache.is_empty());
        assert_eq!((cache.bytes(), cache.released_bytes()), (0, 0));
        assert_eq!(stored(&region, w.len()), w);
    }

    #[test]
    fn a_freed_buffer_leaves_nothing_and_queued_readers_still_see_the_weight() {
        let memory = crate::memory::Memory::new(1 << 24, false);
        let cache = PackCache::default();
        let (rows, cols) = (96, 256);
        let (buf, region, w) = weight_buffer(&memory, rows, cols, 0);
        let key = key(buf, rows, cols, true);
        // SAFETY: as in the test above.
        unsafe { cache.get_or_pack(key, &region, || true, || pack_of(&region, key)) };
        assert!(cache.released_bytes() > 0);
        // `region` stands for queued work that still holds the freed buffer.
        memory.free(buf).unwrap();
        cache.evict(buf);
        assert!(cache.is_empty());
        assert_eq!(cache.bytes(), 0);
        assert_eq!(stored(&region, w.len()), w);

        // A product queued before the free packs after it: nothing is kept.
        let (buf, region, _) = weight_buffer(&memory, rows, cols, 0);
        memory.free(buf).unwrap();
        let key = super::tests::key(buf, rows, cols, false);
        // SAFETY: as above.
        unsafe { cache.get_or_pack(key, &region, || false, || pack_of(&region, key)) };
        assert!(cache.is_empty());
    }

    #[test]
    fn a_weight_with_gaps_keeps_its_bytes_and_the_copy_sits_beside() {
        let memory = crate::memory::Memory::new(1 << 24, false);
        let cache = PackCache::default();
        let (buf, region, w) = weight_buffer(&memory, 128, 128, 0);
        // The left half of each row: rows 256 bytes apart with gaps between them.
        let key = PackKey {
            stride: 128,
            ..key(buf, 128, 64, false)
        };
        // SAFETY: as above.
        let packed = unsafe { cache.get_or_pack(key, &region, || true, || pack_of(&region, key)) };
        assert_eq!(cache.released_bytes(), 0);
        assert_eq!(cache.bytes(), packed.bytes());
        assert_eq!(stored(&region, w.len()), w);
        cache.touch(buf, 0, 2);
        assert_eq!((cache.len(), cache.bytes()), (0, 0));
    }
}
