// A check of the emulator's own model of mma.m16n8k16 and ldmatrix (emu.cpp), independent of
// the attention kernel: tests/ops.rs launches emu_check_mma_<type> on one warp with a 16x16 A
// and a 16x8 B of small integers (exact in f16 and bf16) and compares every result with the
// plain product. The fragments are built here from the PTX ISA's formulas, written out again
// rather than taken from the emulator, so a wrong layout model gives a wrong product.
//
// d[0 .. 128):   A·B, A and B fragments read element by element by the formulas
// d[128 .. 256): A·B, A by ldmatrix_x4 from A's rows, B by ldmatrix_x4 from Bᵀ's rows
// d[256 .. 384): A·B, B by ldmatrix_x4_trans from B's rows
// d[384 .. 512): A·B + the first product as C (accumulation)

template <bool BF16>
static void emu_check_mma(const float *a, const float *b, float *d) {
    __shared__ __align__(16) u16 a_rows[16 * 16];
    __shared__ __align__(16) u16 b_rows[16 * 8];
    __shared__ __align__(16) u16 bt_rows[8 * 16];
    const unsigned lane = threadIdx.x, g = lane >> 2, t = lane & 3, m = lane >> 3;
    auto narrow = [](float x) -> u16 { return BF16 ? f32_to_bf16(x) : f32_to_f16(x); };
    for (unsigned i = lane; i < 256; i += 32) a_rows[i] = narrow(a[i]);
    for (unsigned i = lane; i < 128; i += 32) {
        b_rows[i] = narrow(b[i]);
        bt_rows[(i % 8) * 16 + i / 8] = narrow(b[i]);
    }
    __syncthreads();

    // A register r: rows g (r even) or g + 8, columns 2t, 2t + 1, + 8 for r >= 2.
    // B register r: rows 2t, 2t + 1, + 8 for r = 1, column g.
    u32 af[4], bf[2];
    for (unsigned r = 0; r < 4; ++r) {
        const u16 *p = a_rows + (g + 8 * (r & 1)) * 16 + 2 * t + 8 * (r >> 1);
        af[r] = p[0] | ((u32)p[1] << 16);
    }
    for (unsigned r = 0; r < 2; ++r) {
        const unsigned k = 2 * t + 8 * r;
        bf[r] = b_rows[k * 8 + g] | ((u32)b_rows[(k + 1) * 8 + g] << 16);
    }
    // ldmatrix: lane 8m + i addresses row i of matrix m. A's matrices in register order:
    // rows 0-7 columns 0-7, rows 8-15 columns 0-7, rows 0-7 columns 8-15, rows 8-15 columns 8-15.
    u32 al[4], bl[4], bt[4];
    ldmatrix_x4(al, a_rows + (8 * (m & 1) + (lane & 7)) * 16 + 8 * (m >> 1));
    ldmatrix_x4(bl, bt_rows + (lane & 7) * 16 + 8 * (m & 1));     // matrices 2, 3 repeat 0, 1
    ldmatrix_x4_trans(bt, b_rows + (8 * (m & 1) + (lane & 7)) * 8);

    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float out[4][4];
    mma_16816<BF16>(out[0], af, bf, zero);
    mma_16816<BF16>(out[1], al, bl, zero);
    mma_16816<BF16>(out[2], af, bt, zero);
    mma_16816<BF16>(out[3], af, bf, out[0]);
    // D register i: row g, + 8 for i >= 2; column 2t + (i & 1).
    for (unsigned which = 0; which < 4; ++which)
        for (unsigned i = 0; i < 4; ++i)
            d[which * 128 + (g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = out[which][i];
}

static void emu_check_mma_f16(const float *a, const float *b, float *d) { emu_check_mma<false>(a, b, d); }
static void emu_check_mma_bf16(const float *a, const float *b, float *d) { emu_check_mma<true>(a, b, d); }
