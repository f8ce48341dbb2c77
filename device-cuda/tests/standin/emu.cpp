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
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

// The stand-in driver's queue of deferred work (libcuda.c).
extern "C" void iris_standin_flush(void);

struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
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

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

#include "iris.cu"

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

#define KERNEL(name) {#name, launcher_of<name>(name)},
#define FLOAT_NAMES(NAME)                                                                    \
    KERNEL(norm_##NAME) KERNEL(activation_##NAME) KERNEL(binary_##NAME)                     \
    KERNEL(gemm_epilogue_##NAME) KERNEL(rotary_##NAME) KERNEL(cast_f32_##NAME)              \
    KERNEL(cast_f16_##NAME) KERNEL(cast_bf16_##NAME) KERNEL(attention_##NAME##_32)          \
    KERNEL(attention_##NAME##_64) KERNEL(attention_##NAME##_72) KERNEL(attention_##NAME##_80) \
    KERNEL(attention_##NAME##_96) KERNEL(attention_##NAME##_128)

static const std::map<std::string, Launcher> &kernels() {
    static const std::map<std::string, Launcher> table = {
        KERNEL(copy_regions) FLOAT_NAMES(f32) FLOAT_NAMES(f16) FLOAT_NAMES(bf16)
        KERNEL(gather_b1) KERNEL(gather_b2) KERNEL(gather_b4)};
    return table;
}

extern "C" {

int cuModuleLoadData(void **module, const void *image) {
    (void)image;
    static char loaded;
    *module = &loaded;
    return 0;
}

int cuModuleGetFunction(void **function, void *module, const char *name) {
    (void)module;
    auto found = kernels().find(name);
    if (found == kernels().end()) return 500;  // CUDA_ERROR_NOT_FOUND
    *function = (void *)&found->second;
    return 0;
}

int cuModuleUnload(void *module) {
    (void)module;
    return 0;
}

// The grid of the last launch, for tests that check how the plugin shapes grids.
static unsigned last_grid[3];

void iris_standin_last_grid(unsigned *out) {
    out[0] = last_grid[0];
    out[1] = last_grid[1];
    out[2] = last_grid[2];
}

int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)stream;
    (void)extra;
    // Work queued before the launch runs first (the stand-in driver's deferred mode).
    iris_standin_flush();
    if (by != 1 || bz != 1 || shared != 0 || bx == 0 || bx % 32 != 0) return 1;  // INVALID_VALUE
    last_grid[0] = gx;
    last_grid[1] = gy;
    last_grid[2] = gz;
    emu::kernel = *static_cast<const Launcher *>(function);
    emu::kernel_params = params;
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                if (!emu::run_block(bx)) return 719;  // CUDA_ERROR_LAUNCH_FAILED: a deadlock
            }
    return 0;
}
}
