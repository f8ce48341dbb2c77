// Runs the plugin's CUDA kernels (kernels/iris.cu, included below unchanged) on the CPU, for the
// stand-in driver: cuModuleLoadData accepts any image, cuModuleGetFunction finds the kernels by
// name, and cuLaunchKernel runs the grid one block at a time. Each CUDA thread of a block is a
// fiber (ucontext) with its own stack, all on the calling host thread: a barrier (__syncthreads,
// or the warp-wide one around a shuffle) counts arrivals and yields to the next fiber until the
// last one arrives. Warp shuffles exchange values through a per-warp slot array between two warp
// barriers. Shared memory is function-local static storage, which every fiber of the running
// block shares. On x86-64 a fiber switch is a few instructions (callee-saved registers and the
// stack pointer); elsewhere it is swapcontext, which also saves the signal mask with a syscall.
//
// This checks indexing, tiling, synchronisation and numerics of the kernels and the plugin's
// launch arguments and grids; it says nothing about their speed.

#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

// The stand-in driver's queue of deferred work (libcuda.c).
extern "C" void iris_standin_flush_stream(void *stream);
// The context's state (0: usable; else the code every call that needs it returns) and whether
// this launch is the one armed to fault (see "Faults" in libcuda.c).
extern "C" int iris_standin_context_error(void);
extern "C" int iris_standin_launch_faults(void);

struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};

// The running fiber's indices: the scheduler sets threadIdx before it switches to a fiber.
static uint3 threadIdx;
static uint3 blockIdx;
static uint3 blockDim;
static uint3 gridDim;

namespace emu {

constexpr std::size_t STACK_BYTES = 256 * 1024;

struct Fiber {
    ucontext_t context;
    void *sp = nullptr;  // saved stack pointer (x86-64 switch)
    std::vector<char> stack = std::vector<char>(STACK_BYTES);
    bool done = false;
};

struct Barrier {
    unsigned arrived = 0;
    unsigned generation = 0;
};

ucontext_t scheduler;
void *scheduler_sp;
std::vector<Fiber> fibers;
unsigned running;
Barrier block_barrier;
std::vector<Barrier> warp_barriers;
std::vector<float> slots;
void (*kernel)(void **);
void **kernel_params;

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save,
// switches to `load` and restores what was saved there (System V x86-64 ABI).
extern "C" void iris_emu_switch(void **save, void *load);
asm(R"(
    .text
    .globl iris_emu_switch
    .type iris_emu_switch, @function
iris_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size iris_emu_switch, .-iris_emu_switch
)");
constexpr bool FAST_SWITCH = true;
#else
constexpr bool FAST_SWITCH = false;
void iris_emu_switch(void **, void *) {}
#endif

void yield() {
    if (FAST_SWITCH)
        iris_emu_switch(&fibers[running].sp, scheduler_sp);
    else
        swapcontext(&fibers[running].context, &scheduler);
}

void wait(Barrier &barrier, unsigned count) {
    unsigned generation = barrier.generation;
    if (++barrier.arrived == count) {
        barrier.arrived = 0;
        barrier.generation++;
        return;
    }
    while (barrier.generation == generation) yield();
}

void entry() {
    kernel(kernel_params);
    fibers[running].done = true;
    if (FAST_SWITCH) {
        // A finished fiber is never resumed: its stack has no frame to return to.
        iris_emu_switch(&fibers[running].sp, scheduler_sp);
        std::abort();
    }
    // With ucontext, returning resumes the scheduler (uc_link).
}

// A fresh stack for `fiber` whose first switch-in "returns" into entry() with the stack
// aligned as after a call.
void prepare(Fiber &fiber) {
    auto top = reinterpret_cast<std::uintptr_t>(fiber.stack.data() + fiber.stack.size()) & ~std::uintptr_t{15};
    auto *slot = reinterpret_cast<void **>(top);
    *--slot = nullptr;                             // entry()'s return address: never used
    *--slot = reinterpret_cast<void *>(&entry);    // where the switch's `ret` goes
    for (int i = 0; i < 6; ++i) *--slot = nullptr;  // rbp, rbx, r12-r15
    fiber.sp = slot;
}

// Runs one block of `threads` fibers to completion. Returns false on a deadlock (fibers left
// waiting at a barrier the others will never reach).
bool run_block(unsigned threads) {
    if (fibers.size() < threads) fibers.resize(threads);
    block_barrier = Barrier{};
    warp_barriers.assign((threads + 31) / 32, Barrier{});
    slots.assign(threads, 0.0f);
    for (unsigned t = 0; t < threads; ++t) {
        Fiber &fiber = fibers[t];
        fiber.done = false;
        if (FAST_SWITCH) {
            prepare(fiber);
            continue;
        }
        getcontext(&fiber.context);
        fiber.context.uc_stack.ss_sp = fiber.stack.data();
        fiber.context.uc_stack.ss_size = fiber.stack.size();
        fiber.context.uc_link = &scheduler;
        makecontext(&fiber.context, entry, 0);
    }
    for (;;) {
        bool pending = false;
        unsigned generation = block_barrier.generation;
        std::vector<unsigned> warp_generations;
        for (const Barrier &b : warp_barriers) warp_generations.push_back(b.generation);
        bool progressed = false;
        for (unsigned t = 0; t < threads; ++t) {
            if (fibers[t].done) continue;
            pending = true;
            running = t;
            threadIdx = {t, 0, 0};
            if (FAST_SWITCH)
                iris_emu_switch(&scheduler_sp, fibers[t].sp);
            else
                swapcontext(&scheduler, &fibers[t].context);
            if (fibers[t].done) progressed = true;
        }
        if (!pending) return true;
        for (std::size_t w = 0; w < warp_barriers.size(); ++w)
            progressed |= warp_barriers[w].generation != warp_generations[w];
        progressed |= block_barrier.generation != generation;
        if (!progressed) return false;
    }
}

}  // namespace emu

static void __syncthreads() { emu::wait(emu::block_barrier, blockDim.x); }

static float exchange(float v, unsigned from_lane) {
    unsigned t = threadIdx.x;
    unsigned base = t & ~31u;
    emu::Barrier &warp = emu::warp_barriers[t / 32];
    emu::slots[t] = v;
    emu::wait(warp, 32);
    float r = emu::slots[base + (from_lane & 31u)];
    emu::wait(warp, 32);
    return r;
}

static float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    return exchange(v, (threadIdx.x & 31u) ^ (unsigned)lane_mask);
}

static float __shfl_sync(unsigned, float v, int lane) { return exchange(v, (unsigned)lane); }

static unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
static float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
static unsigned atomicOr(unsigned *p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }

// The tensor-core kernels' instructions (kernels/iris.cu wraps each in a function of this name),
// defined below the kernels, where their conversions are visible. mma and ldmatrix are
// warp-wide: every lane leaves its registers (or its row address) in a per-lane slot, the last
// lane to arrive computes the whole warp's result from the fragment layouts of the PTX ISA
// ("Matrix Fragments for mma.m16n8k16 with floating point type", "Warp-level matrix load
// instruction: ldmatrix") and leaves each lane its registers. cp.async is a synchronous copy,
// so waiting for it is a no-op.
static unsigned char *dynamic_shared();
template <bool BF16>
static void mma_16816(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]);
static void ldmatrix_x4(unsigned r[4], const unsigned short *row);
static void ldmatrix_x4_trans(unsigned r[4], const unsigned short *row);
static void check_shared(const void *p, std::size_t bytes, const char *what);
static void cp_async_16(void *dst, const void *src) {
    check_shared(dst, 16, "cp.async");
    std::memcpy(dst, src, 16);
}
static void cp_async_commit() {}
static void cp_async_wait_all() {}
template <bool BF16>
static unsigned pack2(float lo, float hi);

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

// A vector access a GPU would fault on (its address not a multiple of its size): the emulator
// aborts with the kernel's block and thread.
// Counted, so that tests can tell which of a kernel's paths ran.
static unsigned long long vector_accesses;
static void check_aligned(const void *p, std::size_t bytes) {
    ++vector_accesses;
    if (reinterpret_cast<std::uintptr_t>(p) % bytes == 0) return;
    std::fprintf(stderr,
                 "emulator: %zu-byte vector access at %p is misaligned (block %u,%u,%u thread %u)\n",
                 bytes, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
    std::abort();
}
#define IRIS_CHECK_ALIGNED(p, bytes) check_aligned((p), (bytes))

#include "iris.cu"

// ---------------------------------------------------------------------------------------------
// Warp-wide instructions
// ---------------------------------------------------------------------------------------------

namespace emu {

// What one lane hands a warp-wide instruction and gets back.
struct LaneSlot {
    unsigned a[4];
    unsigned b[2];
    float c[4];
    const unsigned short *row;
    unsigned out[4];
};
std::vector<LaneSlot> lane_slots;
std::vector<unsigned char> shared_bytes;  // the launch's dynamic shared memory

// Runs `compute(first lane's slot)` once per warp when all 32 lanes have filled their slots.
// Every lane arrives with its inputs and leaves with its outputs; a lane can only reach the
// next instruction's slot after the warp's last lane arrived here, so one barrier suffices.
template <class F>
void warp_collective(F compute) {
    unsigned t = threadIdx.x;
    Barrier &barrier = warp_barriers[t / 32];
    unsigned generation = barrier.generation;
    if (++barrier.arrived == 32) {
        compute(&lane_slots[t & ~31u]);
        barrier.arrived = 0;
        barrier.generation++;
        return;
    }
    while (barrier.generation == generation) yield();
}

// PTX ISA, m16n8k16 with .f16/.bf16 multiplicands: groupID = lane >> 2, threadID_in_group =
// lane % 4. A element i (0..7; register i / 2, half i % 2, low half first) sits at row groupID
// for i in {0, 1, 4, 5} and groupID + 8 otherwise, column 2 threadID_in_group + (i & 1), + 8
// for i >= 4. B element i (0..3) at row 2 threadID_in_group + (i & 1), + 8 for i >= 2, column
// groupID. C/D element i (0..3) at row groupID for i < 2 and groupID + 8 otherwise, column
// 2 threadID_in_group + (i & 1).
struct Position {
    unsigned row, col;
};
Position a_position(unsigned lane, unsigned i) {
    return {(lane >> 2) + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8u : 0u),
            (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8u : 0u)};
}
Position b_position(unsigned lane, unsigned i) {
    return {(lane % 4) * 2 + (i & 1) + (i >= 2 ? 8u : 0u), lane >> 2};
}
Position c_position(unsigned lane, unsigned i) {
    return {(lane >> 2) + (i >= 2 ? 8u : 0u), (lane % 4) * 2 + (i & 1)};
}

unsigned short half_of(unsigned reg, unsigned i) { return (unsigned short)(i & 1 ? reg >> 16 : reg); }

}  // namespace emu

static unsigned char *dynamic_shared() { return emu::shared_bytes.data(); }

// Where a GPU would fault (or read another block's data): `p .. p + bytes` starting inside the
// launch's dynamic shared memory, or within 64 KiB past its end, but not ending inside it. The
// emulator aborts with the kernel's block and thread. (Static __shared__ arrays, which only
// emu_check.cu uses, live elsewhere and are not checked.)
static void check_shared(const void *p, std::size_t bytes, const char *what) {
    auto base = reinterpret_cast<std::uintptr_t>(emu::shared_bytes.data());
    auto size = emu::shared_bytes.size();
    auto at = reinterpret_cast<std::uintptr_t>(p);
    if (at < base || at >= base + size + (64u << 10)) return;
    if (at + bytes <= base + size) return;
    std::fprintf(stderr,
                 "emulator: %s at shared byte %zu (%zu bytes) is outside the launch's %zu bytes "
                 "of dynamic shared memory (block %u,%u,%u thread %u)\n",
                 what, (std::size_t)(at - base), bytes, size, blockIdx.x, blockIdx.y, blockIdx.z,
                 threadIdx.x);
    std::abort();
}

template <bool BF16>
static void mma_16816(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    emu::LaneSlot &mine = emu::lane_slots[threadIdx.x];
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, b, sizeof mine.b);
    std::memcpy(mine.c, c, sizeof mine.c);
    emu::warp_collective([](emu::LaneSlot *warp) {
        auto value = [](unsigned short h) { return BF16 ? bf16_to_f32(h) : f16_to_f32(h); };
        float am[16][16], bm[16][8], cm[16][8];
        for (unsigned lane = 0; lane < 32; ++lane) {
            for (unsigned i = 0; i < 8; ++i) {
                emu::Position p = emu::a_position(lane, i);
                am[p.row][p.col] = value(emu::half_of(warp[lane].a[i / 2], i));
            }
            for (unsigned i = 0; i < 4; ++i) {
                emu::Position p = emu::b_position(lane, i);
                bm[p.row][p.col] = value(emu::half_of(warp[lane].b[i / 2], i));
                p = emu::c_position(lane, i);
                cm[p.row][p.col] = warp[lane].c[i];
            }
        }
        // Products of 16-bit floats are exact in f32; the sum is kept in f64 and rounded once.
        for (unsigned lane = 0; lane < 32; ++lane)
            for (unsigned i = 0; i < 4; ++i) {
                emu::Position p = emu::c_position(lane, i);
                double sum = cm[p.row][p.col];
                for (unsigned k = 0; k < 16; ++k) sum += (double)am[p.row][k] * bm[k][p.col];
                warp[lane].out[i] = __float_as_uint((float)sum);
            }
    });
    for (unsigned i = 0; i < 4; ++i) d[i] = __uint_as_float(mine.out[i]);
}

// ldmatrix .m8n8 .x4 .b16: lane 8m + r gives the address of row r of matrix m; register m of
// lane l receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix m (low half first).
// With .trans the matrix is read column-major: row 2 (l % 4) and 2 (l % 4) + 1, column l / 4.
template <bool TRANS>
static void ldmatrix(unsigned r[4], const unsigned short *row) {
    check_shared(row, 16, "ldmatrix");
    emu::LaneSlot &mine = emu::lane_slots[threadIdx.x];
    mine.row = row;
    emu::warp_collective([](emu::LaneSlot *warp) {
        for (unsigned lane = 0; lane < 32; ++lane)
            for (unsigned m = 0; m < 4; ++m) {
                unsigned lo, hi;
                if (TRANS) {
                    lo = warp[8 * m + 2 * (lane % 4)].row[lane / 4];
                    hi = warp[8 * m + 2 * (lane % 4) + 1].row[lane / 4];
                } else {
                    lo = warp[8 * m + lane / 4].row[2 * (lane % 4)];
                    hi = warp[8 * m + lane / 4].row[2 * (lane % 4) + 1];
                }
                warp[lane].out[m] = lo | (hi << 16);
            }
    });
    std::memcpy(r, mine.out, sizeof mine.out);
}

static void ldmatrix_x4(unsigned r[4], const unsigned short *row) { ldmatrix<false>(r, row); }
static void ldmatrix_x4_trans(unsigned r[4], const unsigned short *row) { ldmatrix<true>(r, row); }

template <bool BF16>
static unsigned pack2(float lo, float hi) {
    if (BF16) return f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
    return f32_to_f16(lo) | ((unsigned)f32_to_f16(hi) << 16);
}

#include "emu_check.cu"

// ---------------------------------------------------------------------------------------------
// Launching by name with cuLaunchKernel's parameter array
// ---------------------------------------------------------------------------------------------

using Launcher = void (*)(void **params);

template <typename... A, std::size_t... I>
static void call(void (*kernel)(A...), void **params, std::index_sequence<I...>) {
    kernel(*static_cast<A *>(params[I])...);
}

template <auto K, typename... A>
static void invoke(void **params) {
    call(K, params, std::index_sequence_for<A...>{});
}

template <auto K, typename R, typename... A>
static constexpr Launcher launcher_of(R (*)(A...)) {
    return &invoke<K, A...>;
}

template <typename R, typename... A>
static constexpr unsigned arity_of(R (*)(A...)) {
    return sizeof...(A);
}

// A kernel: how to run it from the driver's parameter array, and how many parameters it takes.
struct Kernel {
    Launcher run;
    unsigned arity;
};

#define KERNEL(name) {#name, Kernel{launcher_of<name>(name), arity_of(name)}},
#define FLOAT_NAMES(NAME)                                                                    \
    KERNEL(norm_##NAME) KERNEL(activation_##NAME) KERNEL(binary_##NAME)                     \
    KERNEL(gemm_epilogue_##NAME) KERNEL(rotary_##NAME) KERNEL(cast_f32_##NAME)              \
    KERNEL(cast_f16_##NAME) KERNEL(cast_bf16_##NAME) KERNEL(attention_##NAME##_32)          \
    KERNEL(attention_##NAME##_64) KERNEL(attention_##NAME##_72) KERNEL(attention_##NAME##_80) \
    KERNEL(attention_##NAME##_96) KERNEL(attention_##NAME##_128)
#define FLASH_NAMES(NAME)                                                                    \
    KERNEL(flash_attention_##NAME##_64) KERNEL(flash_attention_##NAME##_72)                  \
    KERNEL(flash_attention_##NAME##_80) KERNEL(flash_attention_##NAME##_96)                  \
    KERNEL(flash_attention_##NAME##_128) KERNEL(flash_attention_q128_##NAME##_64)            \
    KERNEL(flash_attention_q128_##NAME##_72) KERNEL(flash_attention_q128_##NAME##_80)

static const std::map<std::string, Kernel> &kernels() {
    static const std::map<std::string, Kernel> table = {
        KERNEL(copy_regions) FLOAT_NAMES(f32) FLOAT_NAMES(f16) FLOAT_NAMES(bf16)
        FLASH_NAMES(f16) FLASH_NAMES(bf16)
        KERNEL(gather_b1) KERNEL(gather_b2) KERNEL(gather_b4)
        KERNEL(emu_check_mma_f16) KERNEL(emu_check_mma_bf16)};
    return table;
}

extern "C" {

int cuModuleLoadData(void **module, const void *image) {
    if (int err = iris_standin_context_error()) return err;
    (void)image;
    static char loaded;
    *module = &loaded;
    return 0;
}

int cuModuleGetFunction(void **function, void *module, const char *name) {
    if (int err = iris_standin_context_error()) return err;
    (void)module;
    auto found = kernels().find(name);
    if (found == kernels().end()) return 500;  // CUDA_ERROR_NOT_FOUND
    *function = (void *)&found->second;
    return 0;
}

int cuModuleUnload(void *module) {
    if (int err = iris_standin_context_error()) return err;
    (void)module;
    return 0;
}

// Dynamic shared memory a block may have without the function's opt-in, and at most with it
// (an A100's 163 KiB; the stand-in device is compute capability 8.0).
constexpr unsigned STATIC_SHARED_LIMIT = 48 << 10;
constexpr int OPT_IN_SHARED_LIMIT = 163 << 10;
static std::map<const void *, int> max_dynamic_shared;

int cuFuncSetAttribute(void *function, int attribute, int value) {
    if (int err = iris_standin_context_error()) return err;
    constexpr int MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;  // CU_FUNC_ATTRIBUTE_...
    if (attribute != MAX_DYNAMIC_SHARED_SIZE_BYTES) return 801;  // CUDA_ERROR_NOT_SUPPORTED
    if (value < 0 || value > OPT_IN_SHARED_LIMIT) return 1;      // INVALID_VALUE
    max_dynamic_shared[function] = value;
    return 0;
}

// The grid of the last launch, for tests that check how the plugin shapes grids.
static unsigned last_grid[3];

void iris_standin_last_grid(unsigned *out) {
    out[0] = last_grid[0];
    out[1] = last_grid[1];
    out[2] = last_grid[2];
}

// Vector accesses (the kernels' four-wide loads and stores) since the library loaded.
unsigned long long iris_standin_vector_accesses(void) { return vector_accesses; }

int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)extra;
    if (int err = iris_standin_context_error()) return err;
    // Work queued on the launch's stream before it runs first, and what that work waits for
    // on other streams (the stand-in driver's deferred mode), as on a GPU: nothing else.
    iris_standin_flush_stream(stream);
    // A launch that faults is accepted, as a GPU accepts it; the context's later calls fail.
    if (iris_standin_launch_faults()) return 0;
    if (by != 1 || bz != 1 || bx == 0 || bx % 32 != 0) return 1;  // INVALID_VALUE
    // As on a GPU, more than 48 KiB of dynamic shared memory needs the function's opt-in.
    auto opted = max_dynamic_shared.find(function);
    if (shared > STATIC_SHARED_LIMIT &&
        (opted == max_dynamic_shared.end() || shared > (unsigned)opted->second))
        return 1;  // INVALID_VALUE
    emu::shared_bytes.assign(shared, 0xff);  // not zeroed, as on a GPU
    emu::lane_slots.assign(bx, emu::LaneSlot{});
    last_grid[0] = gx;
    last_grid[1] = gy;
    last_grid[2] = gz;
    const Kernel &launched = *static_cast<const Kernel *>(function);
    emu::kernel = launched.run;
    emu::kernel_params = params;
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                if (!emu::run_block(bx)) return 719;  // CUDA_ERROR_LAUNCH_FAILED: a deadlock
            }
    // IRIS_STANDIN_WRONG_KERNEL names an attention kernel that computes wrong, as a kernel
    // miscompiled for or racing on some GPU would: the lowest bit of its first output element
    // (parameter 6, `out`) flips after it runs.
    static const char *wrong = std::getenv("IRIS_STANDIN_WRONG_KERNEL");
    if (wrong != nullptr) {
        auto named = kernels().find(wrong);
        if (named != kernels().end() && function == (void *)&named->second)
            **static_cast<unsigned short **>(params[6]) ^= 1;
    }
    // IRIS_STANDIN_WRONG_WIDE=<kernel>:<parameter> names an elementwise kernel whose four-wide
    // path computes wrong: after it runs with `lanes` (its last parameter) 4, the lowest bit of
    // the first element of its output (the parameter of that index) flips.
    static const char *wrong_wide = std::getenv("IRIS_STANDIN_WRONG_WIDE");
    if (wrong_wide != nullptr) {
        std::string spec = wrong_wide;
        auto colon = spec.find(':');
        auto named = kernels().find(spec.substr(0, colon));
        if (colon != std::string::npos && named != kernels().end() &&
            function == (void *)&named->second &&
            *static_cast<int *>(params[launched.arity - 1]) == 4) {
            unsigned out = (unsigned)std::atoi(spec.c_str() + colon + 1);
            **static_cast<unsigned short **>(params[out]) ^= 1;
        }
    }
    return 0;
}
}
