//! AMX-BF16 matrix products: the tile micro-kernel behind [`Kernel::Amx`].
//!
//! AMX adds eight tile registers of up to 16 rows of 64 bytes, and `tdpbf16ps`, which
//! multiplies a tile A of 16 rows x 16 pairs of bf16 by a tile B of 16 pairs x 16 columns
//! (each 32-bit element one pair, the layout of [`PackedB`] panels) into a tile C of 16 x 16
//! f32. One call of the micro-kernel computes 32 rows x one 32-column panel: four C tiles
//! (`tmm0..3`), two A tiles (`tmm4`, `tmm5`: rows 0-15 and 16-31) and two B tiles (`tmm6`,
//! `tmm7`: the panel's two halves), so every tile loaded feeds two products.
//!
//! Rows of `a` are packed per task row-major, `pairs` words per row (a multiple of
//! [`TILE_PAIRS`], as the weight's packing is) and rows padded to a multiple of 16 with zeros:
//! every load is a whole 16 x 64-byte tile, and the zeros past `k` and `m` add nothing.
//!
//! Linux hands tile data to a process only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`); [`usable`] asks once per process, and the AMX tier is not offered
//! when the kernel refuses. Each task loads the tile configuration before its first block and
//! releases the tiles after its last, so no thread keeps AMX state between products.
//!
//! The instructions are emitted with inline assembly (Rust's AMX intrinsics are not stable).
//! `TileUnit` keeps them apart from the kernel's loops: `Hardware` runs them, and in tests
//! a model computes what the Intel SDM defines each instruction to compute, so the packing,
//! padding and loop structure are checked on every CPU while the instructions themselves run
//! only where AMX exists.
//!
//! [`Kernel::Amx`]: super::native::Kernel::Amx
//! [`PackedB`]: super::native::PackedB

use std::sync::OnceLock;

use super::native::{Bf16Mat, Micro, NR, TileOut};

/// Pairs of bf16 in one tile row (64 bytes): the step along `k` of one `tdpbf16ps`.
pub const TILE_PAIRS: usize = 16;
/// Rows of one tile.
const TILE_M: usize = 16;
/// Bytes in one tile row.
const TILE_ROW_BYTES: usize = 64;

/// Tile registers as the micro-kernel uses them: accumulators `C<row half><column half>`, row
/// halves of the packed rows, column halves of the panel.
const C00: u8 = 0;
const C01: u8 = 1;
const C10: u8 = 2;
const C11: u8 = 3;
const A0: u8 = 4;
const A1: u8 = 5;
const B0: u8 = 6;
const B1: u8 = 7;

/// Whether AMX-BF16 products can run in this process: the CPU has AMX-TILE and AMX-BF16 and
/// the OS granted tile data. The first call makes the request; later calls return its answer.
pub fn usable() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| crate::isa::has_amx() && request_tile_data())
}

/// Asks Linux for permission to use tile data (the registers' 8 KiB of state). A kernel
/// without AMX support answers `EINVAL`, and the AMX tier is then not offered.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    // From the kernel's arch/x86/include/uapi/asm/prctl.h and the XSAVE feature number of
    // tile data in the Intel SDM.
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: arch_prctl with these arguments only changes which XSAVE features this process
    // may use; it reads and writes no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tile_data() -> bool {
    false
}

/// The eight tile registers and the instructions on them, as the micro-kernel uses them:
/// every tile configured as 16 rows of 64 bytes.
pub(crate) trait TileUnit: Default {
    /// Loads the configuration (`ldtilecfg`), which also zeroes every tile.
    ///
    /// # Safety
    /// [`usable`] is true.
    unsafe fn configure(&mut self);

    /// Zeroes `tile` (`tilezero`).
    ///
    /// # Safety
    /// Configured.
    unsafe fn zero(&mut self, tile: u8);

    /// Loads 16 rows of 64 bytes, `stride` bytes apart, from `src` into `tile` (`tileloadd`).
    ///
    /// # Safety
    /// Configured; the 16 rows lie in live memory.
    unsafe fn load(&mut self, tile: u8, src: *const u32, stride: usize);

    /// `c += a · b` on pairs of bf16 into f32 (`tdpbf16ps`).
    ///
    /// # Safety
    /// Configured.
    unsafe fn dot(&mut self, c: u8, a: u8, b: u8);

    /// Stores `tile`'s 16 rows of 16 f32, `stride` bytes apart, at `dst` (`tilestored`).
    ///
    /// # Safety
    /// Configured; the 16 rows lie in live memory nothing else touches.
    unsafe fn store(&mut self, tile: u8, dst: *mut f32, stride: usize);

    /// Returns the tiles to their initial state (`tilerelease`).
    ///
    /// # Safety
    /// [`usable`] is true.
    unsafe fn release(&mut self);
}

/// The AMX micro-kernel on a [`TileUnit`]: blocks of 32 rows against one 32-column panel.
#[derive(Default)]
pub(crate) struct Amx<U: TileUnit> {
    unit: U,
}

impl<U: TileUnit> Micro for Amx<U> {
    const BLOCK: usize = 2 * TILE_M;
    /// Four blocks: 128 rows of `k = 1280` are 320 KiB packed, which stay in L2.
    const TASK_ROWS: usize = 4 * 2 * TILE_M;
    /// Whole tiles: a block of up to 16 rows writes 16, one of 17 to 32 writes 32.
    const GRANULE: usize = TILE_M;

    /// Row-major, `pairs` words per row, rows padded with zeros to a multiple of 16.
    unsafe fn pack_rows(
        a: Bf16Mat,
        m0: usize,
        rows: usize,
        k: usize,
        pairs: usize,
        dst: &mut Vec<u32>,
    ) {
        debug_assert!(pairs.is_multiple_of(TILE_PAIRS) && pairs >= k.div_ceil(2));
        dst.clear();
        dst.resize(rows.next_multiple_of(TILE_M) * pairs, 0);
        if pairs == 0 {
            // k = 0: nothing to pack (and no zero-sized chunks to take).
            return;
        }
        for (r, packed) in dst.chunks_exact_mut(pairs).take(rows).enumerate() {
            // A row of bf16 is already a row of words (the first of each pair in the low
            // half); an odd last value lands in the low half of a zeroed word.
            // SAFETY: row `m0 + r` of `a` holds `k` values (caller's contract) and `packed`
            // holds `pairs >= k / 2` words, `2 * pairs >= k` bf16.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    a.ptr.add((m0 + r) * a.stride),
                    packed.as_mut_ptr().cast::<u16>(),
                    k,
                )
            };
        }
    }

    unsafe fn enter(&mut self) {
        // SAFETY: the CPU runs the kernel (caller's contract).
        unsafe { self.unit.configure() };
    }

    unsafe fn leave(&mut self) {
        // SAFETY: as above.
        unsafe { self.unit.release() };
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
        let two = height > TILE_M;
        let rows = if two { 2 * TILE_M } else { TILE_M };
        // Whole tiles only: the packing padded the rows to a multiple of 16.
        let lhs = &packed[r0 * pairs..(r0 + rows) * pairs];
        assert!(panel.len() == pairs * NR && pairs.is_multiple_of(TILE_PAIRS));
        let u = &mut self.unit;
        let a_stride = pairs * size_of::<u32>();
        let b_stride = NR * size_of::<u32>();
        let c_stride = out.stride * size_of::<f32>();
        // SAFETY: configured (inside enter/leave, caller's contract). Every load reads 16 rows
        // of 16 words: A rows `i0..i0 + 16` words into each of 16 (or 32) packed rows of
        // `pairs` words, B rows `i0..i0 + 16` of the `[pairs][NR]` panel at column 0 or 16;
        // `i0 + 16 <= pairs`, so all lie inside the slices checked above. Stores write 16
        // rows of 16 f32 into the 16 (or 32) rows of `out` (caller's contract).
        unsafe {
            for c in [C00, C01, C10, C11] {
                u.zero(c);
            }
            for i0 in (0..pairs).step_by(TILE_PAIRS) {
                let b = panel.as_ptr().add(i0 * NR);
                u.load(B0, b, b_stride);
                u.load(B1, b.add(TILE_ROW_BYTES / size_of::<u32>()), b_stride);
                u.load(A0, lhs.as_ptr().add(i0), a_stride);
                u.dot(C00, A0, B0);
                u.dot(C01, A0, B1);
                if two {
                    u.load(A1, lhs.as_ptr().add(TILE_M * pairs + i0), a_stride);
                    u.dot(C10, A1, B0);
                    u.dot(C11, A1, B1);
                }
            }
            let half = TILE_ROW_BYTES / size_of::<f32>();
            u.store(C00, out.ptr, c_stride);
            u.store(C01, out.ptr.add(half), c_stride);
            if two {
                let lower = out.ptr.add(TILE_M * out.stride);
                u.store(C10, lower, c_stride);
                u.store(C11, lower.add(half), c_stride);
            }
        }
    }
}

#[cfg(test)]
impl<U: TileUnit> Amx<U> {
    /// The tile unit, for tests that look at the work done.
    pub(crate) fn unit(&self) -> &U {
        &self.unit
    }
}

/// The CPU's tile registers.
#[derive(Default)]
pub(crate) struct Hardware;

/// The tile configuration `ldtilecfg` reads (palette 1): 64 bytes, 64-byte aligned.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile.
    colsb: [u16; 16],
    /// Rows of each tile.
    rows: [u8; 16],
}

const _: () = assert!(
    TILE_ROW_BYTES == 64 && TILE_M == 16,
    "CONFIG spells the tile shape"
);

/// Tiles 0-7 as [`TILE_M`] rows of [`TILE_ROW_BYTES`]; 8-15 unused.
static CONFIG: Config = {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 8 {
        colsb[t] = 64;
        rows[t] = 16;
        t += 1;
    }
    Config {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb,
        rows,
    }
};

#[cfg(target_arch = "x86_64")]
impl TileUnit for Hardware {
    #[inline(always)]
    unsafe fn configure(&mut self) {
        // SAFETY: the CPU has AMX and tile data is granted (caller's contract); `CONFIG` is a
        // valid palette-1 configuration.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &raw const CONFIG, options(nostack, readonly))
        };
    }

    #[inline(always)]
    unsafe fn zero(&mut self, tile: u8) {
        use std::arch::asm;
        // SAFETY: configured (caller's contract).
        unsafe {
            match tile {
                C00 => asm!("tilezero tmm0", options(nostack, nomem)),
                C01 => asm!("tilezero tmm1", options(nostack, nomem)),
                C10 => asm!("tilezero tmm2", options(nostack, nomem)),
                C11 => asm!("tilezero tmm3", options(nostack, nomem)),
                _ => unreachable!("tmm{tile} is not an accumulator in this kernel"),
            }
        }
    }

    #[inline(always)]
    unsafe fn load(&mut self, tile: u8, src: *const u32, stride: usize) {
        use std::arch::asm;
        // SAFETY: configured, and the rows are live (caller's contract).
        unsafe {
            match tile {
                A0 => asm!("tileloadd tmm4, [{0} + {1}*1]", in(reg) src, in(reg) stride,
                    options(nostack, readonly)),
                A1 => asm!("tileloadd tmm5, [{0} + {1}*1]", in(reg) src, in(reg) stride,
                    options(nostack, readonly)),
                B0 => asm!("tileloadd tmm6, [{0} + {1}*1]", in(reg) src, in(reg) stride,
                    options(nostack, readonly)),
                B1 => asm!("tileloadd tmm7, [{0} + {1}*1]", in(reg) src, in(reg) stride,
                    options(nostack, readonly)),
                _ => unreachable!("tmm{tile} is not an operand in this kernel"),
            }
        }
    }

    #[inline(always)]
    unsafe fn dot(&mut self, c: u8, a: u8, b: u8) {
        use std::arch::asm;
        // SAFETY: configured (caller's contract).
        unsafe {
            match (c, a, b) {
                (C00, A0, B0) => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem)),
                (C01, A0, B1) => asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem)),
                (C10, A1, B0) => asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem)),
                (C11, A1, B1) => asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem)),
                _ => unreachable!("no product tmm{c} += tmm{a} · tmm{b} in this kernel"),
            }
        }
    }

    #[inline(always)]
    unsafe fn store(&mut self, tile: u8, dst: *mut f32, stride: usize) {
        use std::arch::asm;
        // SAFETY: configured, and the rows are live and ours (caller's contract).
        unsafe {
            match tile {
                C00 => asm!("tilestored [{0} + {1}*1], tmm0", in(reg) dst, in(reg) stride,
                    options(nostack)),
                C01 => asm!("tilestored [{0} + {1}*1], tmm1", in(reg) dst, in(reg) stride,
                    options(nostack)),
                C10 => asm!("tilestored [{0} + {1}*1], tmm2", in(reg) dst, in(reg) stride,
                    options(nostack)),
                C11 => asm!("tilestored [{0} + {1}*1], tmm3", in(reg) dst, in(reg) stride,
                    options(nostack)),
                _ => unreachable!("tmm{tile} is not an accumulator in this kernel"),
            }
        }
    }

    #[inline(always)]
    unsafe fn release(&mut self) {
        // SAFETY: AMX is usable (caller's contract).
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Portable stand-in so that the crate builds elsewhere; never called ([`usable`] is false).
#[cfg(not(target_arch = "x86_64"))]
impl TileUnit for Hardware {
    unsafe fn configure(&mut self) {
        unreachable!("AMX needs x86-64")
    }
    unsafe fn zero(&mut self, _tile: u8) {
        unreachable!("AMX needs x86-64")
    }
    unsafe fn load(&mut self, _tile: u8, _src: *const u32, _stride: usize) {
        unreachable!("AMX needs x86-64")
    }
    unsafe fn dot(&mut self, _c: u8, _a: u8, _b: u8) {
        unreachable!("AMX needs x86-64")
    }
    unsafe fn store(&mut self, _tile: u8, _dst: *mut f32, _stride: usize) {
        unreachable!("AMX needs x86-64")
    }
    unsafe fn release(&mut self) {
        unreachable!("AMX needs x86-64")
    }
}

#[cfg(test)]
pub(crate) mod model {
    //! The tile instructions as the Intel SDM defines them, in plain Rust.

    use super::*;

    /// Eight tiles of 16 rows x 16 words, and whether a configuration is loaded. Using a tile
    /// unconfigured, or a tile register the configuration leaves out, panics, as the
    /// instruction would fault.
    pub(crate) struct Model {
        tiles: Box<[[[u32; 16]; TILE_M]; 8]>,
        configured: bool,
        /// Products run, for tests that count the work.
        pub(crate) dots: usize,
    }

    impl Default for Model {
        fn default() -> Self {
            Model {
                tiles: Box::new([[[0; 16]; TILE_M]; 8]),
                configured: false,
                dots: 0,
            }
        }
    }

    impl Model {
        fn tile(&mut self, t: u8) -> &mut [[u32; 16]; TILE_M] {
            assert!(self.configured, "tile instruction before ldtilecfg");
            &mut self.tiles[usize::from(t)]
        }
    }

    /// A bf16 as f32; denormals read as zero, as the instruction reads them.
    fn widen(bits: u32) -> f32 {
        let bits = bits << 16;
        if bits & 0x7f80_0000 == 0 {
            f32::from_bits(bits & 0x8000_0000)
        } else {
            f32::from_bits(bits)
        }
    }

    impl TileUnit for Model {
        unsafe fn configure(&mut self) {
            self.configured = true;
            *self.tiles = [[[0; 16]; TILE_M]; 8];
        }

        unsafe fn zero(&mut self, tile: u8) {
            *self.tile(tile) = [[0; 16]; TILE_M];
        }

        unsafe fn load(&mut self, tile: u8, src: *const u32, stride: usize) {
            let dst = self.tile(tile);
            for (r, row) in dst.iter_mut().enumerate() {
                // SAFETY: the 16 rows are live (caller's contract).
                let from = unsafe { src.cast::<u8>().add(r * stride).cast::<[u32; 16]>() };
                // SAFETY: as above; rows need not be aligned.
                *row = unsafe { from.read_unaligned() };
            }
        }

        /// `c[m][n] += a[m][2k] b[2k][n] + a[m][2k+1] b[2k+1][n]` in f32, one product at a
        /// time, for `k` in pair order (the SDM's pseudo-code).
        unsafe fn dot(&mut self, c: u8, a: u8, b: u8) {
            self.dots += 1;
            let (a, b) = (*self.tile(a), *self.tile(b));
            for (m, row) in self.tile(c).iter_mut().enumerate() {
                for (n, word) in row.iter_mut().enumerate() {
                    let mut acc = f32::from_bits(*word);
                    for k in 0..TILE_PAIRS {
                        acc += widen(a[m][k] & 0xffff) * widen(b[k][n] & 0xffff);
                        acc += widen(a[m][k] >> 16) * widen(b[k][n] >> 16);
                    }
                    *word = acc.to_bits();
                }
            }
        }

        unsafe fn store(&mut self, tile: u8, dst: *mut f32, stride: usize) {
            let src = *self.tile(tile);
            for (r, row) in src.iter().enumerate() {
                let values = row.map(f32::from_bits);
                // SAFETY: the 16 rows are live and ours (caller's contract).
                unsafe {
                    dst.cast::<u8>()
                        .add(r * stride)
                        .cast::<[f32; 16]>()
                        .write_unaligned(values)
                };
            }
        }

        unsafe fn release(&mut self) {
            assert!(self.configured, "tilerelease without a configuration");
            self.configured = false;
        }
    }
}
