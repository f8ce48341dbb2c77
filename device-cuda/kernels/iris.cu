// iris's CUDA kernels, compiled at run time by NVRTC without any header.
//
// Storage types are f32, f16 and bf16 (the latter two as raw 16-bit patterns); every kernel
// loads into f32, computes in f32 and rounds to nearest even when it stores. Kernels take base
// pointers already advanced to the view's first element and row strides in elements, so any
// row-strided view (the q, k and v columns of a fused qkv buffer) is read in place.
//
// Every entry point is `extern "C"` with the storage type in its name (`norm_bf16`,
// `attention_f16_80`): the plugin looks each one up by that name when it loads the module.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define IRIS_INF __int_as_float(0x7f800000)
#define LOG2E 1.4426950408889634f

// ---------------------------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);  // NaN stays NaN (quiet), sign kept
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (u16)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 e = ((u32)h >> 10) & 0x1fu;
    u32 m = (u32)h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0u) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
#ifdef __CUDA_ARCH__
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return (u16)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
    if (x >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // rounds to infinity
    if (x < 0x38800000u) {                                // half subnormal or zero
        if (x < 0x33000000u) return (u16)sign;
        u32 e = x >> 23;
        u32 m = (x & 0x7fffffu) | 0x800000u;
        u32 shift = 126u - e;
        u32 rem = m & ((1u << shift) - 1u);
        u32 half = 1u << (shift - 1u);
        u32 bits = m >> shift;
        if (rem > half || (rem == half && (bits & 1u))) bits += 1u;
        return (u16)(sign | bits);
    }
    u32 bits = (x - 0x38000000u) >> 13;
    u32 rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (bits & 1u))) bits += 1u;
    return (u16)(sign | bits);
#endif
}

// A GPU faults on an access not aligned to its size (and the fault is sticky: the context is
// lost). The CPU emulator of the stand-in driver defines this to check every vector access here.
#ifndef IRIS_CHECK_ALIGNED
#define IRIS_CHECK_ALIGNED(p, bytes)
#endif

// Storage types: one element (`load`, `store`), or four consecutive ones in one access of four
// times the element's size (`load4`, `store4`: 16 bytes of f32, 8 of f16 or bf16). The four-wide
// forms need the address aligned to four elements; the plugin passes `lanes = 4` to a kernel
// only when every view it touches is (docs/CUDA.md, "Elementwise kernels").
struct F32 {
    static __device__ __forceinline__ float load(const void* p, i64 i) {
        return ((const float*)p)[i];
    }
    static __device__ __forceinline__ void store(void* p, i64 i, float v) { ((float*)p)[i] = v; }
    static __device__ __forceinline__ void load4(const void* p, i64 i, float* v) {
        IRIS_CHECK_ALIGNED((const float*)p + i, 16);
        const float4 c = *(const float4*)((const float*)p + i);
        v[0] = c.x;
        v[1] = c.y;
        v[2] = c.z;
        v[3] = c.w;
    }
    static __device__ __forceinline__ void store4(void* p, i64 i, const float* v) {
        IRIS_CHECK_ALIGNED((float*)p + i, 16);
        *(float4*)((float*)p + i) = float4{v[0], v[1], v[2], v[3]};
    }
};

// The 16-bit formats' conversions, for Half16.
struct F16Bits {
    static __device__ __forceinline__ float to_f32(u16 h) { return f16_to_f32(h); }
    static __device__ __forceinline__ u16 from_f32(float f) { return f32_to_f16(f); }
};
struct BF16Bits {
    static __device__ __forceinline__ float to_f32(u16 h) { return bf16_to_f32(h); }
    static __device__ __forceinline__ u16 from_f32(float f) { return f32_to_bf16(f); }
};

// A 16-bit storage type; four elements are two 32-bit words, the lower address in the lower
// half.
template <class B>
struct Half16 {
    static __device__ __forceinline__ float load(const void* p, i64 i) {
        return B::to_f32(((const u16*)p)[i]);
    }
    static __device__ __forceinline__ void store(void* p, i64 i, float v) {
        ((u16*)p)[i] = B::from_f32(v);
    }
    static __device__ __forceinline__ void load4(const void* p, i64 i, float* v) {
        IRIS_CHECK_ALIGNED((const u16*)p + i, 8);
        const uint2 c = *(const uint2*)((const u16*)p + i);
        v[0] = B::to_f32((u16)c.x);
        v[1] = B::to_f32((u16)(c.x >> 16));
        v[2] = B::to_f32((u16)c.y);
        v[3] = B::to_f32((u16)(c.y >> 16));
    }
    static __device__ __forceinline__ void store4(void* p, i64 i, const float* v) {
        IRIS_CHECK_ALIGNED((u16*)p + i, 8);
        *(uint2*)((u16*)p + i) = uint2{(u32)B::from_f32(v[0]) | ((u32)B::from_f32(v[1]) << 16),
                                       (u32)B::from_f32(v[2]) | ((u32)B::from_f32(v[3]) << 16)};
    }
};

typedef Half16<F16Bits> F16;
typedef Half16<BF16Bits> BF16;

// `N` consecutive elements (1, or 4 in one access) of storage type S, as f32.
template <int N>
struct Lanes {
    static const int n = N;
};
template <class S>
__device__ __forceinline__ void load_lanes(Lanes<1>, const void* p, i64 i, float* v) {
    v[0] = S::load(p, i);
}
template <class S>
__device__ __forceinline__ void load_lanes(Lanes<4>, const void* p, i64 i, float* v) {
    S::load4(p, i, v);
}
template <class S>
__device__ __forceinline__ void store_lanes(Lanes<1>, void* p, i64 i, const float* v) {
    S::store(p, i, v[0]);
}
template <class S>
__device__ __forceinline__ void store_lanes(Lanes<4>, void* p, i64 i, const float* v) {
    S::store4(p, i, v);
}

// ---------------------------------------------------------------------------------------------
// Reductions and activations
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.0f;
    int warps = (blockDim.x + 31) >> 5;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    __syncthreads();  // scratch may be reused at once
    return total;
}

// Activation codes are iris_plugin::abi::Activation's values.
__device__ __forceinline__ float activate(float x, int kind) {
    switch (kind) {
        // Both GELUs in forms without the cancellation of `1 + erf` and `1 + tanh` for
        // negative x, where those lose every digit of a small result: 1 + erf(t) = erfc(-t),
        // and 0.5 (1 + tanh(u)) = sigmoid(2u).
        case 1:  // gelu (erf)
            return 0.5f * x * erfcf(x * -0.70710678118654752f);
        case 2: {  // gelu (tanh)
            float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            return x / (1.0f + expf(-2.0f * u));
        }
        case 3:  // quick gelu
            return x / (1.0f + expf(-1.702f * x));
        case 4:  // silu
            return x / (1.0f + expf(-x));
        default:
            return x;
    }
}

// ---------------------------------------------------------------------------------------------
// Norms: one block per row (grid-stride over rows), two passes over the row for the statistics.
// Each thread reads `N` consecutive columns at a time (N = 4: one 8- or 16-byte load).
// ---------------------------------------------------------------------------------------------

template <class S, int N>
__device__ __forceinline__ void norm_rows(const void* x, i64 xs, void* out, i64 os, const void* w,
                                          const void* b, i64 rows, i64 cols, float eps, int rms,
                                          float* scratch) {
    const Lanes<N> lanes;
    const i64 first = (i64)threadIdx.x * N;
    const i64 step = (i64)blockDim.x * N;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 xo = r * xs;
        float mean = 0.0f;
        if (!rms) {
            float s = 0.0f;
            for (i64 c = first; c < cols; c += step) {
                float v[N];
                load_lanes<S>(lanes, x, xo + c, v);
#pragma unroll
                for (int k = 0; k < N; ++k) s += v[k];
            }
            mean = block_sum(s, scratch) / (float)cols;
        }
        float q = 0.0f;
        for (i64 c = first; c < cols; c += step) {
            float v[N];
            load_lanes<S>(lanes, x, xo + c, v);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float d = v[k] - mean;
                q += d * d;
            }
        }
        const float inv = 1.0f / sqrtf(block_sum(q, scratch) / (float)cols + eps);
        for (i64 c = first; c < cols; c += step) {
            float v[N], g[N], o[N];
            load_lanes<S>(lanes, x, xo + c, v);
            load_lanes<S>(lanes, w, c, g);
#pragma unroll
            for (int k = 0; k < N; ++k) o[k] = (v[k] - mean) * inv * g[k];
            if (b) {
                float bb[N];
                load_lanes<S>(lanes, b, c, bb);
#pragma unroll
                for (int k = 0; k < N; ++k) o[k] += bb[k];
            }
            store_lanes<S>(lanes, out, r * os + c, o);
        }
    }
}

template <class S>
__device__ __forceinline__ void norm_impl(const void* x, i64 xs, void* out, i64 os, const void* w,
                                          const void* b, i64 rows, i64 cols, float eps, int rms,
                                          int lanes) {
    __shared__ float scratch[32];
    if (lanes == 4) {
        norm_rows<S, 4>(x, xs, out, os, w, b, rows, cols, eps, rms, scratch);
    } else {
        norm_rows<S, 1>(x, xs, out, os, w, b, rows, cols, eps, rms, scratch);
    }
}

// ---------------------------------------------------------------------------------------------
// Elementwise kernels over [rows, cols] views, in groups of `lanes` columns of one row.
//
// lanes = 1: blockIdx.y strides rows, x strides columns, one element per thread. lanes = 4:
// each thread takes four columns at once, one 8- or 16-byte access per view, over the flattened
// [rows, cols / 4] groups (grid x only). One 2-byte element per thread keeps too few bytes in
// flight for a GPU's memory; four give each access 8 or 16. The plugin passes 4 only when every
// view's address and row stride are multiples of four elements, cols is too, and there are fewer
// than 2^31 groups, so that 32-bit indices suffice here.
// ---------------------------------------------------------------------------------------------

// Calls `body(r, c, Lanes<N>())` for every group of N columns starting at (r, c).
template <class Body>
__device__ __forceinline__ void for_each_group(i64 rows, i64 cols, int lanes, const Body& body) {
    if (lanes == 4) {
        const u32 per_row = (u32)(cols >> 2);
        const u32 groups = (u32)rows * per_row;
        for (u32 g = blockIdx.x * blockDim.x + threadIdx.x; g < groups;
             g += gridDim.x * blockDim.x) {
            const u32 r = g / per_row;
            body((i64)r, (i64)(g - r * per_row) * 4, Lanes<4>());
        }
        return;
    }
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < cols;
             c += (i64)gridDim.x * blockDim.x) {
            body(r, c, Lanes<1>());
        }
    }
}

// Each kernel's work on one group, as a function object (NVRTC takes no lambdas in device code
// without extended-lambda support): `operator()(r, c, Lanes<N>())` does N columns from (r, c).

template <class S>
struct Activate {
    const void* x;
    i64 xs;
    void* out;
    i64 os;
    int kind;
    template <int N>
    __device__ __forceinline__ void operator()(i64 r, i64 c, Lanes<N> w) const {
        float v[N];
        load_lanes<S>(w, x, r * xs + c, v);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = activate(v[k], kind);
        store_lanes<S>(w, out, r * os + c, v);
    }
};

template <class S>
__device__ __forceinline__ void activation_impl(const void* x, i64 xs, void* out, i64 os,
                                                i64 rows, i64 cols, int kind, int lanes) {
    for_each_group(rows, cols, lanes, Activate<S>{x, xs, out, os, kind});
}

// `bs` is 0 when `b` is one row broadcast over every row of `a`. `op`: 0 add, 1 multiply.
template <class S>
struct Binary {
    const void* a;
    i64 as;
    const void* b;
    i64 bs;
    void* out;
    i64 os;
    int op;
    template <int N>
    __device__ __forceinline__ void operator()(i64 r, i64 c, Lanes<N> w) const {
        float x[N], y[N];
        load_lanes<S>(w, a, r * as + c, x);
        load_lanes<S>(w, b, r * bs + c, y);
#pragma unroll
        for (int k = 0; k < N; ++k) x[k] = op == 0 ? x[k] + y[k] : x[k] * y[k];
        store_lanes<S>(w, out, r * os + c, x);
    }
};

template <class S>
__device__ __forceinline__ void binary_impl(const void* a, i64 as, const void* b, i64 bs,
                                            void* out, i64 os, i64 rows, i64 cols, int op,
                                            int lanes) {
    for_each_group(rows, cols, lanes, Binary<S>{a, as, b, bs, out, os, op});
}

template <class S, class D>
struct Cast {
    const void* src;
    i64 ss;
    void* out;
    i64 os;
    template <int N>
    __device__ __forceinline__ void operator()(i64 r, i64 c, Lanes<N> w) const {
        float v[N];
        load_lanes<S>(w, src, r * ss + c, v);
        store_lanes<D>(w, out, r * os + c, v);
    }
};

template <class S, class D>
__device__ __forceinline__ void cast_impl(const void* src, i64 ss, void* out, i64 os, i64 rows,
                                          i64 cols, int lanes) {
    for_each_group(rows, cols, lanes, Cast<S, D>{src, ss, out, os});
}

// The part of a gemm cuBLAS(Lt) cannot fuse: out = act(src + bias) (+ out when accumulating).
// `src` is the product: an f32 [rows, cols] scratch (`src_f32`), or `out` itself, or null for
// an empty product (k = 0).
template <class S>
struct Epilogue {
    const void* src;
    int src_f32;
    i64 ss;
    void* out;
    i64 os;
    const void* bias;
    int kind;
    int accumulate;
    template <int N>
    __device__ __forceinline__ void operator()(i64 r, i64 c, Lanes<N> w) const {
        float v[N];
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = 0.0f;
        if (src) {
            if (src_f32) {
                load_lanes<F32>(w, src, r * ss + c, v);
            } else {
                load_lanes<S>(w, src, r * ss + c, v);
            }
        }
        if (bias) {
            float b[N];
            load_lanes<S>(w, bias, c, b);
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] += b[k];
        }
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = activate(v[k], kind);
        if (accumulate) {
            float o[N];
            load_lanes<S>(w, out, r * os + c, o);
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] += o[k];
        }
        store_lanes<S>(w, out, r * os + c, v);
    }
};

template <class S>
__device__ __forceinline__ void gemm_epilogue_impl(const void* src, int src_f32, i64 ss,
                                                   void* out, i64 os, const void* bias, i64 rows,
                                                   i64 cols, int kind, int accumulate,
                                                   int lanes) {
    for_each_group(rows, cols, lanes,
                   Epilogue<S>{src, src_f32, ss, out, os, bias, kind, accumulate});
}

// Rotary embedding from f32 cos/sin tables [tokens, head_dim], in place on x
// [tokens, heads * head_dim]: each group is `lanes` pairs (j, j + head_dim / 2) of one head
// (lanes = 4 needs head_dim / 2 to be a multiple of 4, so that a group stays in one head).
template <class S>
struct Rotate {
    void* x;
    i64 xs;
    const float* cs;
    i64 css;
    const float* sn;
    i64 sns;
    i64 half;
    i64 head_dim;
    template <int N>
    __device__ __forceinline__ void operator()(i64 r, i64 c, Lanes<N> w) const {
        // 32-bit division on the four-wide path, whose columns fit 32 bits.
        const i64 h = N == 4 ? (i64)((u32)c / (u32)half) : c / half;
        const i64 j = c - h * half;
        const i64 base = r * xs + h * head_dim;
        float x1[N], x2[N], c1[N], c2[N], s1[N], s2[N], y1[N], y2[N];
        load_lanes<S>(w, x, base + j, x1);
        load_lanes<S>(w, x, base + j + half, x2);
        load_lanes<F32>(w, cs, r * css + j, c1);
        load_lanes<F32>(w, cs, r * css + j + half, c2);
        load_lanes<F32>(w, sn, r * sns + j, s1);
        load_lanes<F32>(w, sn, r * sns + j + half, s2);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            y1[k] = x1[k] * c1[k] - x2[k] * s1[k];
            y2[k] = x2[k] * c2[k] + x1[k] * s2[k];
        }
        store_lanes<S>(w, x, base + j, y1);
        store_lanes<S>(w, x, base + j + half, y2);
    }
};

template <class S>
__device__ __forceinline__ void rotary_impl(void* x, i64 xs, const float* cs, i64 css,
                                            const float* sn, i64 sns, i64 rows, i64 heads,
                                            i64 head_dim, int lanes) {
    const i64 half = head_dim / 2;
    for_each_group(rows, heads * half, lanes,
                   Rotate<S>{x, xs, cs, css, sn, sns, half, head_dim});
}

// Bits of the device status word, through which kernels report what the caller got wrong in
// data only the device sees; `synchronize` reads and clears it, and reports each bit set.
#define STATUS_BAD_GATHER_INDEX 1u  // a gather index outside its source rows
#define STATUS_BAD_SEGMENT 2u       // attention segment bounds outside the call's rows

// out[i] = src[idx[i]] by element type T of the dtype's size. A bad index writes zeros and
// sets STATUS_BAD_GATHER_INDEX.
template <class T>
__device__ __forceinline__ void gather_impl(const T* src, i64 ss, i64 src_rows, T* out, i64 os,
                                            const int* idx, i64 rows, i64 cols, u32* status) {
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const int from = idx[r];
        const bool ok = from >= 0 && (i64)from < src_rows;
        if (!ok && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, STATUS_BAD_GATHER_INDEX);
        for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < cols;
             c += (i64)gridDim.x * blockDim.x) {
            out[r * os + c] = ok ? src[(i64)from * ss + c] : (T)0;
        }
    }
}

// Segment `seg`'s first token and length, read from the device copy of `cu_seqlens`. The host
// sized the launch from its own copy, which the caller promises is the same: a device copy
// that disagrees must not make a kernel read or write outside the call's `rows` rows, nor
// leave queries beyond the `per_block` x gridDim.x its grid covers silently unwritten. Such a
// segment sets STATUS_BAD_SEGMENT and is not computed (false).
__device__ __forceinline__ bool segment_bounds(const int* cu_seqlens, int seg, i64 rows,
                                               int per_block, u32* status, i64* start, int* len) {
    const i64 first = cu_seqlens[seg];
    const i64 end = cu_seqlens[seg + 1];
    if (first < 0 || end < first || end > rows || end - first > (i64)gridDim.x * per_block) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, STATUS_BAD_SEGMENT);
        return false;
    }
    *start = first;
    *len = (int)(end - first);
    return true;
}

// ---------------------------------------------------------------------------------------------
// Variable-length attention, flash-attention style (no tensor cores).
//
// A block of 4 warps takes 32 queries of one head of one segment (grid: query tiles x heads x
// segments; segment bounds come from the device cu_seqlens). Queries, pre-scaled by
// scale * log2(e), stay in shared memory; keys and values stream through shared memory in
// tiles of 16. Each warp owns 8 queries. Scores: lane (h, j) = (lane / 16, lane % 16) computes
// the dot products of key j with the warp's queries 4h .. 4h + 3. Softmax is online (running
// maximum and sum per query, in f32, exp2). Output: each lane owns the head-dim columns
// lane + 32 t of its warp's 8 queries and accumulates p · v in f32, receiving p by shuffle.
// DP is the head dim padded to the kernel's size; columns from head_dim to DP are zeros.
// ---------------------------------------------------------------------------------------------

#define ATT_WARPS 4
#define ATT_QW 8
#define ATT_BQ (ATT_WARPS * ATT_QW)
#define ATT_BK 16
#define ATT_THREADS (ATT_WARPS * 32)

template <class S, int DP>
__device__ __forceinline__ void attention_impl(const void* q, i64 qs, const void* k, i64 ks_,
                                               const void* v, i64 vs_, void* out, i64 os,
                                               const int* cu_seqlens, int head_dim, float scale,
                                               i64 rows, u32* status) {
    constexpr int NS = (DP + 31) / 32;  // output column slots per lane
    constexpr int VP = NS * 32;         // padded value row
    constexpr int KP = DP + 4;          // padded key row: conflict-free float4 reads by row
    __shared__ __align__(16) float qsm[ATT_BQ * DP];
    __shared__ __align__(16) float ksm[ATT_BK * KP];
    __shared__ __align__(16) float vsm[ATT_BK * VP];

    const int seg = blockIdx.z;
    const int head = blockIdx.y;
    i64 start;
    int len;
    if (!segment_bounds(cu_seqlens, seg, rows, ATT_BQ, status, &start, &len)) return;
    const int q0 = blockIdx.x * ATT_BQ;
    if (q0 >= len) return;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const i64 col0 = (i64)head * head_dim;
    const float qscale = scale * LOG2E;

    for (int e = tid; e < ATT_BQ * DP; e += ATT_THREADS) {
        const int r = e / DP, c = e - (e / DP) * DP;
        float val = 0.0f;
        if (q0 + r < len && c < head_dim) val = S::load(q, (start + q0 + r) * qs + col0 + c) * qscale;
        qsm[e] = val;
    }

    const int j = lane & 15;  // key of this lane in the score phase
    const int h = lane >> 4;  // which 4 of the warp's 8 queries
    const float* qrow = qsm + (warp * ATT_QW + h * 4) * DP;

    float m_run[4], l_run[4];
    float o[ATT_QW][NS];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        m_run[u] = -IRIS_INF;
        l_run[u] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < ATT_QW; ++i)
#pragma unroll
        for (int t = 0; t < NS; ++t) o[i][t] = 0.0f;

    for (int k0 = 0; k0 < len; k0 += ATT_BK) {
        __syncthreads();  // previous tile fully consumed (and the query tile written)
        for (int e = tid; e < ATT_BK * DP; e += ATT_THREADS) {
            const int r = e / DP, c = e - (e / DP) * DP;
            float val = 0.0f;
            if (k0 + r < len && c < head_dim) val = S::load(k, (start + k0 + r) * ks_ + col0 + c);
            ksm[r * KP + c] = val;
        }
        for (int e = tid; e < ATT_BK * VP; e += ATT_THREADS) {
            const int r = e / VP, c = e - (e / VP) * VP;
            float val = 0.0f;
            if (k0 + r < len && c < head_dim) val = S::load(v, (start + k0 + r) * vs_ + col0 + c);
            vsm[e] = val;
        }
        __syncthreads();

        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float* krow = ksm + j * KP;
#pragma unroll 4
        for (int c = 0; c < DP; c += 4) {
            const float4 kv = *(const float4*)(krow + c);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float4 qv = *(const float4*)(qrow + u * DP + c);
                s[u] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
            }
        }
        const bool valid = k0 + j < len;
        float p[4], alpha[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float sv = valid ? s[u] : -IRIS_INF;
            float mt = sv;
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
            const float m_new = fmaxf(m_run[u], mt);
            alpha[u] = exp2f(m_run[u] - m_new);
            p[u] = exp2f(sv - m_new);
            l_run[u] = l_run[u] * alpha[u] + p[u];
            m_run[u] = m_new;
        }
#pragma unroll
        for (int i = 0; i < ATT_QW; ++i) {
            const float a = __shfl_sync(0xffffffffu, alpha[i & 3], (i >> 2) * 16);
#pragma unroll
            for (int t = 0; t < NS; ++t) o[i][t] *= a;
        }
#pragma unroll 4
        for (int jj = 0; jj < ATT_BK; ++jj) {
            float vv[NS];
#pragma unroll
            for (int t = 0; t < NS; ++t) vv[t] = vsm[jj * VP + lane + 32 * t];
#pragma unroll
            for (int i = 0; i < ATT_QW; ++i) {
                const float pj = __shfl_sync(0xffffffffu, p[i & 3], (i >> 2) * 16 + jj);
#pragma unroll
                for (int t = 0; t < NS; ++t) o[i][t] += pj * vv[t];
            }
        }
    }

    float l_sum[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        float l = l_run[u];
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        l_sum[u] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_QW; ++i) {
        const float l = __shfl_sync(0xffffffffu, l_sum[i & 3], (i >> 2) * 16);
        const int qi = q0 + warp * ATT_QW + i;
        if (qi < len) {
            const float inv = 1.0f / l;
#pragma unroll
            for (int t = 0; t < NS; ++t) {
                const int c = lane + 32 * t;
                if (c < head_dim) S::store(out, (start + qi) * os + col0 + c, o[i][t] * inv);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Variable-length attention on tensor cores, for f16 and bf16 (FlashAttention-2 style, sm_80+).
//
// A block of 4 warps takes 16 · RB queries per warp (RB row blocks of one MMA's 16 rows: 64 or
// 128 queries) of one head of one segment; the grid and `cu_seqlens` are as for attention_impl.
// Keys and values stream through shared memory in tiles of 64 rows of DK + 8 elements (the 8
// put consecutive rows on different banks for ldmatrix), two stages: the next tile loads with
// cp.async while the current one is computed. Per tile and warp: S = Q·Kᵀ by mma.m16n8k16 (K
// fragments by ldmatrix, each used by all RB row blocks), an online softmax in f32 (exp2 of
// S · scale · log2 e minus the running maximum, one FFMA per score), P rounded to the storage
// type in registers, where the accumulator layout of S is already the A layout of P (so P never
// touches shared memory), and O += P·V (V fragments by ldmatrix.trans, shared the same way).
// Q stays in registers as MMA A fragments for the whole pass where RB = 1; where RB = 2 it
// would not leave registers for twice the accumulators, so it stays in shared memory and is
// read by ldmatrix per tile (as FlashAttention-2 does). DK is the head dim padded to the MMA's
// k of 16 (72 runs as 80); padding columns and keys past the segment are zeros in shared
// memory, and keys past the segment are masked to minus infinity before the softmax. `scale`
// must be positive (the plugin sends other scales to attention_impl).
//
// Every query row goes through the same instructions in the same order whatever RB is: the two
// variants give the same bits, which the plugin checks on the device when it opens (RB = 2
// reads each K and V fragment once for both row blocks and each tile once per 128 queries;
// RB = 1 makes twice the blocks, for small launches).
//
// The warp-wide instructions are behind the small functions below (mma_16816, ldmatrix_x4,
// ldmatrix_x4_trans, cp_async_16 ...), which the CPU emulator of the stand-in driver
// implements from the PTX ISA's fragment layouts.
// ---------------------------------------------------------------------------------------------

#define FA_WARPS 4
#define FA_BK 64
#define FA_THREADS (FA_WARPS * 32)
#define FA_PAD 8

#ifdef __CUDA_ARCH__
extern __shared__ __align__(16) unsigned char iris_dynamic_shared[];

__device__ __forceinline__ unsigned char* dynamic_shared() { return iris_dynamic_shared; }

// The shared-window address of a generic pointer into shared memory.
// (The intrinsic, not inline PTX: the compiler sees through it, so addresses that differ by a
// constant share one register instead of each keeping its own conversion.)
__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

#if __CUDA_ARCH__ >= 800
// d = a · b + c for one 16x8x16 tile; a, b and c as the PTX ISA lays them out over the warp.
#define IRIS_MMA_16816(TYPE)                                                                 \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, " \
                 "{%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                                \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),         \
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]))
template <bool BF16>
__device__ __forceinline__ void mma_16816(float d[4], const u32 a[4], const u32 b[2],
                                          const float c[4]) {
    if (BF16) {
        IRIS_MMA_16816("bf16");
    } else {
        IRIS_MMA_16816("f16");
    }
}

// Four 8x8 matrices of 16-bit elements; lane 8m + r gives the address of row r of matrix m.
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

// As ldmatrix_x4, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

// 16 bytes from global to shared memory, asynchronously (L2 only: the tile is read once).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until every cp.async group this thread committed has landed.
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// Two f32 rounded to nearest even and packed, `lo` in the low half (the lower column).
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}
#endif
#endif

// Whether this compilation has the instructions above: sm_80 and later, or the emulator.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define IRIS_TENSOR_CORES 1
#else
#define IRIS_TENSOR_CORES 0
#endif

// Whether this compilation has the 128-query kernels' bodies: sm_80 and sm_90 on (the data-centre
// parts), or the emulator. On sm_86 and sm_89 the assembler spills them, so they are built empty
// there and the plugin never launches them (`kernels::q128_runs_on`).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 800 || __CUDA_ARCH__ >= 900
#define IRIS_Q128 1
#else
#define IRIS_Q128 0
#endif

#if IRIS_TENSOR_CORES
// One 64-row tile of K and of V (rows row0 .. row0 + 63 of the segment, the head's first DK
// columns) into shared memory rows of DK + FA_PAD elements: 16-byte chunks, DK / 16 of each
// tile per thread, by cp.async where `async` (16-byte aligned rows), element loads otherwise.
// Chunks past the head dim or the segment are zeros: V's must be finite (P is 0 there, and
// 0 times NaN is NaN), K's keep Q·Kᵀ of padding columns 0.
template <int DK>
__device__ __forceinline__ void fa_load_tiles(u16* kdst, u16* vdst, const u16* k, i64 ks,
                                              const u16* v, i64 vs, i64 row0, int rows,
                                              int head_dim, bool async) {
    constexpr int CHUNKS = DK / 8;  // per row
    static_assert(FA_BK * CHUNKS % FA_THREADS == 0, "whole chunks per thread");
    // Not unrolled: the unrolled addresses would stay live across the tile loop and cost more
    // registers (and blocks per SM) than the loop costs instructions.
#pragma unroll 1
    for (int it = 0; it < FA_BK * CHUNKS / FA_THREADS; ++it) {
        const int e = threadIdx.x + it * FA_THREADS;
        const int r = e / CHUNKS;
        const int c = (e - r * CHUNKS) * 8;
        const int at = r * (DK + FA_PAD) + c;
        if (r < rows && c < head_dim) {
            const u16* ksrc = k + (row0 + r) * ks + c;
            const u16* vsrc = v + (row0 + r) * vs + c;
            if (async) {
                cp_async_16(kdst + at, ksrc);
                cp_async_16(vdst + at, vsrc);
            } else {
                uint4 kc, vc;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    ((u16*)&kc)[i] = ksrc[i];
                    ((u16*)&vc)[i] = vsrc[i];
                }
                *(uint4*)(kdst + at) = kc;
                *(uint4*)(vdst + at) = vc;
            }
        } else {
            *(uint4*)(kdst + at) = uint4{0u, 0u, 0u, 0u};
            *(uint4*)(vdst + at) = uint4{0u, 0u, 0u, 0u};
        }
    }
}

// The block's BQ query rows (row0 .. row0 + BQ - 1 of the segment) into shared memory, laid out
// and zero-padded as fa_load_tiles lays out K.
template <int DK, int BQ>
__device__ __forceinline__ void fa_load_queries(u16* dst, const u16* q, i64 qs, i64 row0,
                                                int rows, int head_dim, bool async) {
    constexpr int CHUNKS = DK / 8;
    static_assert(BQ * CHUNKS % FA_THREADS == 0, "whole chunks per thread");
#pragma unroll 1
    for (int it = 0; it < BQ * CHUNKS / FA_THREADS; ++it) {
        const int e = threadIdx.x + it * FA_THREADS;
        const int r = e / CHUNKS;
        const int c = (e - r * CHUNKS) * 8;
        u16* d = dst + r * (DK + FA_PAD) + c;
        if (r < rows && c < head_dim) {
            const u16* src = q + (row0 + r) * qs + c;
            if (async) {
                cp_async_16(d, src);
            } else {
                uint4 chunk;
#pragma unroll
                for (int i = 0; i < 8; ++i) ((u16*)&chunk)[i] = src[i];
                *(uint4*)d = chunk;
            }
        } else {
            *(uint4*)d = uint4{0u, 0u, 0u, 0u};
        }
    }
}
#endif

template <bool BF16, int DK, int DV, int RB>
__device__ __forceinline__ void flash_attention_impl(const u16* q, i64 qs, const u16* k, i64 ks,
                                                     const u16* v, i64 vs, u16* out, i64 os,
                                                     const int* cu_seqlens, int head_dim,
                                                     float scale, i64 rows, u32* status) {
#if !IRIS_TENSOR_CORES
    return;  // tensor-core kernels need sm_80; the plugin never launches them below
#else
    if (RB > 1 && !IRIS_Q128) return;  // not launched on this architecture (IRIS_Q128)
    constexpr int RS = DK + FA_PAD;          // shared row stride in elements
    constexpr int TILE = FA_BK * RS;         // elements of one K or V tile
    constexpr int KSTEPS = DK / 16;          // k steps of Q·Kᵀ
    constexpr int NV = DV / 8;               // column groups of O
    constexpr int BQ = FA_WARPS * 16 * RB;   // queries per block
    constexpr bool Q_SHARED = RB > 1;
    u16* smem = (u16*)dynamic_shared();      // K stage 0, K stage 1, V stage 0, V stage 1, [Q]
    u16* qsm = smem + 4 * TILE;

    const int seg = blockIdx.z;
    const int head = blockIdx.y;
    i64 start;
    int len;
    if (!segment_bounds(cu_seqlens, seg, rows, BQ, status, &start, &len)) return;
    const int q0 = blockIdx.x * BQ;
    if (q0 >= len) return;

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;  // fragment row (and row + 8)
    const int t = lane & 3;   // fragment column pair
    const i64 col0 = (i64)head * head_dim;
    const float sl = scale * LOG2E;
    const int qw = q0 + warp * 16 * RB;  // this warp's first query (row block rb: + 16 rb)
    const bool active = qw < len;        // warp-uniform
    const u16* qb = q + start * qs + col0;
    const u16* kb = k + start * ks + col0;
    const u16* vb = v + start * vs + col0;
    const bool async = ((((u64)kb | (u64)vb) & 15u) == 0u) && ((ks | vs) & 7) == 0;

    // Q fragments in registers: a[0] row g, columns 2t, 2t + 1; a[1] row g + 8; a[2], a[3]
    // columns + 8. With Q_SHARED the array is not used (the compiler drops it).
    u32 qf[RB][Q_SHARED ? 1 : KSTEPS][4];
    if (!Q_SHARED) {
#pragma unroll
        for (int rb = 0; rb < RB; ++rb)
#pragma unroll
            for (int s = 0; s < (Q_SHARED ? 1 : KSTEPS); ++s)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int row = qw + rb * 16 + g + (r & 1) * 8;
                    const int col = s * 16 + t * 2 + (r >> 1) * 8;
                    u32 lo = 0u, hi = 0u;
                    if (row < len) {
                        const u16* p = qb + row * qs + col;
                        if (col < head_dim) lo = p[0];
                        if (col + 1 < head_dim) hi = p[1];
                    }
                    qf[rb][s][r] = lo | (hi << 16);
                }
    }

    float o[RB][NV][4];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
        for (int n = 0; n < NV; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[rb][n][i] = 0.0f;
    float m_run[RB][2];  // running maximum of S · sl, rows g and g + 8 of each row block
    float l_run[RB][2];  // this lane's part of the running sum
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m_run[rb][r] = -IRIS_INF;
            l_run[rb][r] = 0.0f;
        }

    const int tiles = (len + FA_BK - 1) / FA_BK;
    if (Q_SHARED) {
        const bool q_async = (((u64)qb & 15u) == 0u) && (qs & 7) == 0;
        fa_load_queries<DK, BQ>(qsm, qb, qs, q0, len - q0 < BQ ? len - q0 : BQ, head_dim,
                                q_async);
    }
    fa_load_tiles<DK>(smem, smem + 2 * TILE, kb, ks, vb, vs, 0, len < FA_BK ? len : FA_BK,
                      head_dim, async);
    cp_async_commit();

    for (int tile = 0; tile < tiles; ++tile) {
        const int k0 = tile * FA_BK;
        cp_async_wait_all();
        // Tile `tile` is visible to all, and every warp is done with the previous one, whose
        // stage the next tile's copies overwrite.
        __syncthreads();
        if (tile + 1 < tiles) {
            const int k1 = k0 + FA_BK;
            const int rows = len - k1 < FA_BK ? len - k1 : FA_BK;
            const int stage = (tile + 1) & 1;
            fa_load_tiles<DK>(smem + stage * TILE, smem + (2 + stage) * TILE, kb, ks, vb, vs, k1,
                              rows, head_dim, async);
            cp_async_commit();
        }
        if (!active) continue;
        const u16* ksm = smem + (tile & 1) * TILE;
        const u16* vsm = smem + (2 + (tile & 1)) * TILE;

        // S = Q·Kᵀ: 8 groups of 8 keys; one ldmatrix_x4 gives the B fragments of two groups.
        float sc[RB][8][4];
#pragma unroll
        for (int rb = 0; rb < RB; ++rb)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) sc[rb][j][i] = 0.0f;
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
            const int m = lane >> 3;
            u32 qa[RB][4];
#pragma unroll
            for (int rb = 0; rb < RB; ++rb) {
                if (Q_SHARED) {
                    // Matrix m: rows 8 (m % 2) + lane % 8 of the row block, columns
                    // 16s + 8 (m / 2): registers in the A fragment's order.
                    const u16* row = qsm + ((qw - q0) + rb * 16 + (m & 1) * 8 + (lane & 7)) * RS +
                                     s * 16 + (m >> 1) * 8;
                    ldmatrix_x4(qa[rb], row);
                } else {
#pragma unroll
                    for (int r = 0; r < 4; ++r) qa[rb][r] = qf[rb][Q_SHARED ? 0 : s][r];
                }
            }
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                // Matrix m: keys 8j + 8 (m / 2) + lane % 8, columns 16s + 8 (m % 2).
                const u16* row = ksm + (j * 8 + (m >> 1) * 8 + (lane & 7)) * RS + s * 16 + (m & 1) * 8;
                u32 b[4];
                ldmatrix_x4(b, row);
#pragma unroll
                for (int rb = 0; rb < RB; ++rb) {
                    mma_16816<BF16>(sc[rb][j], qa[rb], b, sc[rb][j]);
                    mma_16816<BF16>(sc[rb][j + 1], qa[rb], b + 2, sc[rb][j + 1]);
                }
            }
        }

        // Online softmax; element i of group j is key k0 + 8j + 2t + (i & 1), row g + 8 (i / 2).
        u32 pf[RB][4][4];
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
            float mx[2] = {-IRIS_INF, -IRIS_INF};
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (k0 + j * 8 + t * 2 + (i & 1) >= len) sc[rb][j][i] = -IRIS_INF;
                    mx[i >> 1] = fmaxf(mx[i >> 1], sc[rb][j][i]);
                }
            float alpha[2], neg_m[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m_run[rb][r], mx[r] * sl);  // sl > 0: max commutes
                alpha[r] = exp2f(m_run[rb][r] - m_new);
                m_run[rb][r] = m_new;
                neg_m[r] = -m_new;
            }
            float sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    sc[rb][j][i] = exp2f(fmaf(sc[rb][j][i], sl, neg_m[i >> 1]));
                    sum[i >> 1] += sc[rb][j][i];
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) l_run[rb][r] = l_run[rb][r] * alpha[r] + sum[r];
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) o[rb][n][i] *= alpha[i >> 1];

            // P's A fragment for keys 16s .. 16s + 15 is the S accumulators of groups 2s and
            // 2s + 1.
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                pf[rb][s][0] = pack2<BF16>(sc[rb][2 * s][0], sc[rb][2 * s][1]);
                pf[rb][s][1] = pack2<BF16>(sc[rb][2 * s][2], sc[rb][2 * s][3]);
                pf[rb][s][2] = pack2<BF16>(sc[rb][2 * s + 1][0], sc[rb][2 * s + 1][1]);
                pf[rb][s][3] = pack2<BF16>(sc[rb][2 * s + 1][2], sc[rb][2 * s + 1][3]);
            }
        }

        // O += P·V over 4 steps of 16 keys; one ldmatrix_x4_trans gives the B fragments of two
        // key steps for one group of 8 columns.
#pragma unroll
        for (int s = 0; s < 4; s += 2) {
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                // Matrix m = lane / 8: keys 16s + 8m + lane % 8, columns 8n.
                const u16* row = vsm + (s * 16 + (lane >> 3) * 8 + (lane & 7)) * RS + n * 8;
                u32 b[4];
                ldmatrix_x4_trans(b, row);
#pragma unroll
                for (int rb = 0; rb < RB; ++rb) {
                    mma_16816<BF16>(o[rb][n], pf[rb][s], b, o[rb][n]);
                    mma_16816<BF16>(o[rb][n], pf[rb][s + 1], b + 2, o[rb][n]);
                }
            }
        }
    }
    if (!active) return;

    // O / l, stored as pairs of columns 8n + 2t, + 1 for rows g and g + 8 of each row block.
    const bool pairs = (((u64)out & 3u) == 0u) && ((os | col0) & 1) == 0;
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_run[rb][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[r] = 1.0f / l;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = qw + rb * 16 + g + r * 8;
            if (row >= len) continue;
            u16* dst = out + (start + row) * os + col0;
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                const int col = n * 8 + t * 2;
                const u32 packed =
                    pack2<BF16>(o[rb][n][2 * r] * inv[r], o[rb][n][2 * r + 1] * inv[r]);
                if (pairs) {
                    *(u32*)(dst + col) = packed;
                } else {
                    dst[col] = (u16)packed;
                    dst[col + 1] = (u16)(packed >> 16);
                }
            }
        }
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// Batched copy: one block per region (grid-stride), 16-, 4- or 1-byte moves as alignment allows.
// `regions` holds (src, dst, bytes) triples of device addresses.
// ---------------------------------------------------------------------------------------------

// Copies many small regions ({src, dst, bytes} triples) at once: regions along the grid's y,
// chunks of `chunk` bytes (a multiple of 16) of each region along its x, so a region is spread
// over several SMs instead of one. Large regions go to the copy engine instead (the host side).
extern "C" __global__ void __launch_bounds__(256) copy_regions(const u64* regions, i64 count,
                                                               i64 chunk) {
    for (i64 r = blockIdx.y; r < count; r += gridDim.y) {
        const u64 src = regions[3 * r], dst = regions[3 * r + 1], bytes = regions[3 * r + 2];
        for (u64 begin = (u64)blockIdx.x * (u64)chunk; begin < bytes;
             begin += (u64)gridDim.x * (u64)chunk) {
            const u64 end = begin + (u64)chunk < bytes ? begin + (u64)chunk : bytes;
            if (((src | dst | bytes) & 15u) == 0u) {
                const uint4* s = (const uint4*)src;
                uint4* d = (uint4*)dst;
                for (u64 i = begin / 16u + threadIdx.x; i < end / 16u; i += blockDim.x) d[i] = s[i];
            } else if (((src | dst | bytes) & 3u) == 0u) {
                const u32* s = (const u32*)src;
                u32* d = (u32*)dst;
                for (u64 i = begin / 4u + threadIdx.x; i < end / 4u; i += blockDim.x) d[i] = s[i];
            } else {
                const u8* s = (const u8*)src;
                u8* d = (u8*)dst;
                for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) d[i] = s[i];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points, one per storage type (and head-dim size for attention).
// ---------------------------------------------------------------------------------------------

#define FLOAT_KERNELS(NAME, S)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        norm_##NAME(const void* x, i64 xs, void* out, i64 os, const void* w, const void* b,      \
                    i64 rows, i64 cols, float eps, int rms, int lanes) {                         \
        norm_impl<S>(x, xs, out, os, w, b, rows, cols, eps, rms, lanes);                         \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        activation_##NAME(const void* x, i64 xs, void* out, i64 os, i64 rows, i64 cols,         \
                          int kind, int lanes) {                                                 \
        activation_impl<S>(x, xs, out, os, rows, cols, kind, lanes);                             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        binary_##NAME(const void* a, i64 as, const void* b, i64 bs, void* out, i64 os, i64 rows, \
                      i64 cols, int op, int lanes) {                                             \
        binary_impl<S>(a, as, b, bs, out, os, rows, cols, op, lanes);                            \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        gemm_epilogue_##NAME(const void* src, int src_f32, i64 ss, void* out, i64 os,            \
                             const void* bias, i64 rows, i64 cols, int kind, int accumulate,     \
                             int lanes) {                                                        \
        gemm_epilogue_impl<S>(src, src_f32, ss, out, os, bias, rows, cols, kind, accumulate,    \
                              lanes);                                                            \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        rotary_##NAME(void* x, i64 xs, const float* cs, i64 css, const float* sn, i64 sns,       \
                      i64 rows, i64 heads, i64 head_dim, int lanes) {                            \
        rotary_impl<S>(x, xs, cs, css, sn, sns, rows, heads, head_dim, lanes);                   \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        cast_f32_##NAME(const void* src, i64 ss, void* out, i64 os, i64 rows, i64 cols,          \
                        int lanes) {                                                             \
        cast_impl<F32, S>(src, ss, out, os, rows, cols, lanes);                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        cast_f16_##NAME(const void* src, i64 ss, void* out, i64 os, i64 rows, i64 cols,          \
                        int lanes) {                                                             \
        cast_impl<F16, S>(src, ss, out, os, rows, cols, lanes);                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        cast_bf16_##NAME(const void* src, i64 ss, void* out, i64 os, i64 rows, i64 cols,         \
                         int lanes) {                                                            \
        cast_impl<BF16, S>(src, ss, out, os, rows, cols, lanes);                                 \
    }

FLOAT_KERNELS(f32, F32)
FLOAT_KERNELS(f16, F16)
FLOAT_KERNELS(bf16, BF16)

#define ATTENTION_KERNEL(NAME, S, DP)                                                           \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                  \
        attention_##NAME##_##DP(const void* q, i64 qs, const void* k, i64 ks, const void* v,  \
                                i64 vs, void* out, i64 os, const int* cu_seqlens,             \
                                int head_dim, float scale, i64 rows, u32* status) {           \
        attention_impl<S, DP>(q, qs, k, ks, v, vs, out, os, cu_seqlens, head_dim, scale, rows, \
                              status);                                                        \
    }

#define ATTENTION_SIZES(NAME, S)  \
    ATTENTION_KERNEL(NAME, S, 32) \
    ATTENTION_KERNEL(NAME, S, 64) \
    ATTENTION_KERNEL(NAME, S, 72) \
    ATTENTION_KERNEL(NAME, S, 80) \
    ATTENTION_KERNEL(NAME, S, 96) \
    ATTENTION_KERNEL(NAME, S, 128)

ATTENTION_SIZES(f32, F32)
ATTENTION_SIZES(f16, F16)
ATTENTION_SIZES(bf16, BF16)

// Tensor-core attention: flash_attention_<dtype>_<head dim> (64 queries per block) and
// flash_attention_q128_<dtype>_<head dim> (128), for the head dims they are built for (DK: the
// head dim padded to 16). Dynamic shared memory: 4 * 64 * (DK + 8) * 2 bytes, plus
// 128 * (DK + 8) * 2 for the queries of the 128-query kernels. There are no 128-query kernels at
// head dims 96 and 128: twice their accumulators (O and S: 96 + 64 or 128 + 64 registers per
// thread) leave too few registers for the rest, and the assembler spills.
#define FLASH_KERNEL(PREFIX, NAME, BF16, DV, DK, RB)                                           \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                    \
        PREFIX##NAME##_##DV(const void* q, i64 qs, const void* k, i64 ks, const void* v,       \
                            i64 vs, void* out, i64 os, const int* cu_seqlens, int head_dim,     \
                            float scale, i64 rows, u32* status) {                              \
        flash_attention_impl<BF16, DK, DV, RB>((const u16*)q, qs, (const u16*)k, ks,           \
                                               (const u16*)v, vs, (u16*)out, os, cu_seqlens,   \
                                               head_dim, scale, rows, status);                 \
    }

#define FLASH_SIZES(NAME, BF16)                                     \
    FLASH_KERNEL(flash_attention_, NAME, BF16, 64, 64, 1)           \
    FLASH_KERNEL(flash_attention_, NAME, BF16, 72, 80, 1)           \
    FLASH_KERNEL(flash_attention_, NAME, BF16, 80, 80, 1)           \
    FLASH_KERNEL(flash_attention_, NAME, BF16, 96, 96, 1)           \
    FLASH_KERNEL(flash_attention_, NAME, BF16, 128, 128, 1)         \
    FLASH_KERNEL(flash_attention_q128_, NAME, BF16, 64, 64, 2)      \
    FLASH_KERNEL(flash_attention_q128_, NAME, BF16, 72, 80, 2)      \
    FLASH_KERNEL(flash_attention_q128_, NAME, BF16, 80, 80, 2)

FLASH_SIZES(f16, false)
FLASH_SIZES(bf16, true)

#define GATHER_KERNEL(NAME, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        gather_##NAME(const T* src, i64 ss, i64 src_rows, T* out, i64 os, const int* idx,     \
                      i64 rows, i64 cols, u32* status) {                                      \
        gather_impl<T>(src, ss, src_rows, out, os, idx, rows, cols, status);                  \
    }

GATHER_KERNEL(b1, u8)
GATHER_KERNEL(b2, u16)
GATHER_KERNEL(b4, u32)
