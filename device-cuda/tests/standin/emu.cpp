// Runs the plugin's CUDA kernels (kernels/iris.cu, included below unchanged) on the CPU, for the
// stand-in driver: cuModuleLoadData accepts any image, cuModuleGetFunction finds the kernels by
// name, and cuLaunchKernel runs the grid one block at a time with one host thread per CUDA
// thread. __syncthreads is a barrier of the block's threads; warp shuffles exchange values
// through a per-warp slot array between two barriers of the warp's 32 threads. Shared memory
// is function-local static storage, which all threads of the running block share.
//
// This checks indexing, tiling, synchronisation and numerics of the kernels and the plugin's
// launch arguments and grids; it says nothing about their speed.

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

static thread_local uint3 threadIdx;
static thread_local uint3 blockIdx;
static uint3 blockDim;
static uint3 gridDim;

struct Block {
    std::barrier<> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> slots;
    explicit Block(unsigned threads) : all((std::ptrdiff_t)threads), slots(threads) {
        for (unsigned w = 0; w < (threads + 31) / 32; ++w)
            warps.push_back(std::make_unique<std::barrier<>>(32));
    }
};
static Block *block;

static void __syncthreads() { block->all.arrive_and_wait(); }

static float exchange(float v, unsigned from_lane) {
    unsigned t = threadIdx.x;
    unsigned base = t & ~31u;
    std::barrier<> &warp = *block->warps[t / 32];
    block->slots[t] = v;
    warp.arrive_and_wait();
    float r = block->slots[base + (from_lane & 31u)];
    warp.arrive_and_wait();
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

int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)stream;
    (void)extra;
    if (by != 1 || bz != 1 || shared != 0 || bx == 0 || bx % 32 != 0) return 1;  // INVALID_VALUE
    Launcher run = *static_cast<const Launcher *>(function);
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                Block current(bx);
                block = &current;
                std::vector<std::thread> threads;
                threads.reserve(bx);
                for (unsigned t = 0; t < bx; ++t) {
                    threads.emplace_back([=] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        run(params);
                    });
                }
                for (auto &thread : threads) thread.join();
                block = nullptr;
            }
    return 0;
}
}
