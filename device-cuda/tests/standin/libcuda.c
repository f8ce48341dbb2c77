/*
 * A stand-in for the CUDA driver (libcuda.so.1) for tests on machines without a GPU.
 *
 * It exports the driver entry points the plugin calls, with host memory as device memory and
 * every asynchronous operation done at once. Built alone, it cannot run kernels: module loads and
 * launches return CUDA_ERROR_NOT_SUPPORTED. Built with -DIRIS_STANDIN_KERNELS and linked with
 * emu.cpp, it runs the plugin's own kernels (kernels/iris.cu) on the CPU, one fiber per CUDA
 * thread. It returns only codes that exist in cudarc's CUresult enum.
 *
 * For tests to look inside: iris_standin_live_pools() counts memory pools not destroyed,
 * iris_standin_blocking_reads() the synchronous device-to-host copies (cuMemcpyDtoH),
 * iris_standin_device_copies() the device-to-device copies (cuMemcpyDtoDAsync).
 *
 * Deferred work (IRIS_STANDIN_DEFER=1) models what a GPU does asynchronously: stream-ordered
 * frees, and copies from or to page-locked host memory (cuMemHostAlloc), stay queued until a
 * synchronisation (stream, context, event) or the next operation that runs at once (a launch,
 * a fill, a device copy, a copy from or to pageable memory, which the driver stages
 * synchronously). cuStreamQuery answers CUDA_ERROR_NOT_READY while work is queued.
 * cuPointerGetAttribute tells page-locked host memory (CU_MEMORYTYPE_HOST) from pageable
 * (CUDA_ERROR_INVALID_VALUE), as the driver does. Entry points are thread-safe.
 *
 * Switches, read at cuInit:
 *   IRIS_STANDIN_MODE      ok (default) | no_device (cuInit: CUDA_ERROR_NO_DEVICE)
 *                          | stub (every call: CUDA_ERROR_STUB_LIBRARY, like the toolkit's stub)
 *                          | not_ready (cuInit: CUDA_ERROR_SYSTEM_NOT_READY, an NVSwitch system
 *                          whose fabric manager is not running)
 *   IRIS_STANDIN_FAIL_ATTRIBUTE  a device attribute (number) whose query fails (INVALID_VALUE)
 *   IRIS_STANDIN_DEVICES   device count (default 1)
 *   IRIS_STANDIN_MEMORY    bytes of device memory (default 1 GiB)
 *   IRIS_STANDIN_OOM_AT    the Nth device allocation fails with CUDA_ERROR_OUT_OF_MEMORY
 *   IRIS_STANDIN_DRIVER    the driver version cuDriverGetVersion reports (default
 *                          IRIS_STANDIN_DRIVER_DEFAULT, set at build time, 12040 unless given;
 *                          13000 or more runs CUDA 13's libraries)
 *   IRIS_STANDIN_CC        the compute capability, as major * 10 + minor (default 80)
 *   IRIS_STANDIN_POOLS     0: the device has no memory pools (default 1)
 *   IRIS_STANDIN_FAIL_COPY a CUresult every memcpy returns (e.g. 719, launch failed)
 *   IRIS_STANDIN_FAIL_MEM_INFO_AT  the Nth cuMemGetInfo fails (CUDA_ERROR_UNKNOWN)
 *   IRIS_STANDIN_FAIL_FREE_OF  a size in bytes: the first cuMemFree or cuMemFreeAsync of an
 *                          allocation of that size fails (CUDA_ERROR_INVALID_VALUE) and frees
 *                          nothing; later frees of it succeed
 *   IRIS_STANDIN_DEFER     1: queue asynchronous work as described above (default 0)
 *   IRIS_STANDIN_SYNC_DELAY_MS  cuStreamSynchronize returns this long after the queue ran
 *   IRIS_STANDIN_WRONG_KERNEL   an attention kernel (by name) whose first output element gets
 *                          its lowest bit flipped after each launch (emu.cpp): a wrong kernel
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUmemoryPool;

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    STUB_LIBRARY = 34,
    NO_DEVICE = 100,
    NOT_READY = 600,
    SYSTEM_NOT_READY = 802,
    INVALID_DEVICE = 101,
    NOT_FOUND = 500,
    NOT_SUPPORTED = 801,
};

static int initialised;
static int mode_stub;
static int devices = 1;
static unsigned long long total_memory = 1ull << 30;
static unsigned long long used_memory;
static unsigned long long oom_at;
static unsigned long long allocations;
/* The default driver version: CUDA 12.4, the driver API the plugin's bindings call. */
#ifndef IRIS_STANDIN_DRIVER_DEFAULT
#define IRIS_STANDIN_DRIVER_DEFAULT 12040
#endif
static int driver_version = IRIS_STANDIN_DRIVER_DEFAULT;
static int pools = 1;
static int fail_copy;
static unsigned long long fail_free_of;
static unsigned long long fail_mem_info_at, mem_info_calls;
static int fail_attribute = -1;
static int compute_capability = 80;
static int live_pools;
static int defer;
static unsigned long long sync_delay_ms;
static unsigned long long blocking_reads;
static unsigned long long device_copies;
/* Guards every table and the queue: the plugin is called from several threads. */
static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;

/* Page-locked host allocations, to tell them from pageable memory. */
struct host_block {
    char *ptr;
    size_t bytes;
    struct host_block *next;
};
static struct host_block *host_blocks;

/* Queued asynchronous work (IRIS_STANDIN_DEFER=1), in enqueue order. */
struct deferred {
    void *dst;
    const void *src;
    size_t bytes;
    CUdeviceptr free_ptr; /* nonzero: a stream-ordered free */
    void (*host_fn)(void *); /* nonzero: a host function, called with `host_data` */
    void *host_data;
    struct deferred *next;
};
static struct deferred *queue_head, *queue_tail;
void iris_standin_flush(void);
static char primary_context;
static __thread CUcontext current;

/* Sizes of live device allocations, to give memory back on free. */
struct allocation {
    CUdeviceptr ptr;
    size_t bytes;
    struct allocation *next;
};
static struct allocation *live;

static unsigned long long env_number(const char *name, unsigned long long fallback) {
    const char *value = getenv(name);
    return value && *value ? strtoull(value, NULL, 10) : fallback;
}

#define GUARD()                                     \
    do {                                            \
        if (mode_stub) return STUB_LIBRARY;         \
        if (!initialised) return NOT_INITIALIZED;   \
    } while (0)

CUresult cuInit(unsigned int flags) {
    (void)flags;
    const char *mode = getenv("IRIS_STANDIN_MODE");
    if (mode && strcmp(mode, "stub") == 0) {
        mode_stub = 1;
        return STUB_LIBRARY;
    }
    if (mode && strcmp(mode, "no_device") == 0) return NO_DEVICE;
    if (mode && strcmp(mode, "not_ready") == 0) return SYSTEM_NOT_READY;
    fail_attribute = (int)env_number("IRIS_STANDIN_FAIL_ATTRIBUTE", (unsigned long long)-1);
    compute_capability = (int)env_number("IRIS_STANDIN_CC", 80);
    defer = (int)env_number("IRIS_STANDIN_DEFER", 0);
    sync_delay_ms = env_number("IRIS_STANDIN_SYNC_DELAY_MS", 0);
    devices = (int)env_number("IRIS_STANDIN_DEVICES", 1);
    total_memory = env_number("IRIS_STANDIN_MEMORY", 1ull << 30);
    oom_at = env_number("IRIS_STANDIN_OOM_AT", 0);
    driver_version = (int)env_number("IRIS_STANDIN_DRIVER", IRIS_STANDIN_DRIVER_DEFAULT);
    pools = (int)env_number("IRIS_STANDIN_POOLS", 1);
    fail_copy = (int)env_number("IRIS_STANDIN_FAIL_COPY", 0);
    fail_free_of = env_number("IRIS_STANDIN_FAIL_FREE_OF", 0);
    fail_mem_info_at = env_number("IRIS_STANDIN_FAIL_MEM_INFO_AT", 0);
    initialised = 1;
    return SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (mode_stub) return STUB_LIBRARY;
    *version = driver_version;
    return SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    GUARD();
    *count = devices;
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    GUARD();
    if (ordinal < 0 || ordinal >= devices) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    GUARD();
    (void)device;
    strncpy(name, "iris stand-in device", (size_t)len);
    if (len > 0) name[len - 1] = 0;
    return SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) {
    GUARD();
    (void)device;
    *bytes = total_memory;
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    GUARD();
    (void)device;
    if (attribute == fail_attribute) return INVALID_VALUE;
    switch (attribute) {
        case 13: *value = 1500000; break;    /* SM clock, kHz */
        case 16: *value = 4; break;          /* multiprocessors */
        case 36: *value = 1000000; break;    /* memory clock, kHz */
        case 37: *value = 256; break;        /* memory bus width, bits */
        case 75: *value = compute_capability / 10; break; /* compute capability major */
        case 76: *value = compute_capability % 10; break; /* compute capability minor */
        case 115: *value = pools; break;     /* memory pools supported */
        default: *value = 0;
    }
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned int *flags, int *active) {
    GUARD();
    (void)device;
    *flags = 0;
    *active = 0;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    GUARD();
    (void)device;
    *ctx = &primary_context;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    GUARD();
    (void)device;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    GUARD();
    *ctx = current;
    return SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    GUARD();
    current = ctx;
    return SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    GUARD();
    iris_standin_flush();
    return SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    GUARD();
    if (!current) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    if (fail_mem_info_at && ++mem_info_calls == fail_mem_info_at) return 999; /* CUDA_ERROR_UNKNOWN */
    *free_bytes = total_memory - used_memory;
    *total_bytes = total_memory;
    return SUCCESS;
}

static CUresult device_alloc(CUdeviceptr *ptr, size_t bytes) {
    allocations++;
    if ((oom_at && allocations == oom_at) || bytes > total_memory - used_memory) return OUT_OF_MEMORY;
    /* 256-byte aligned, as the driver aligns every allocation (the libraries' choices depend
     * on the operands' alignment). */
    void *memory = aligned_alloc(256, bytes ? (bytes + 255) / 256 * 256 : 256);
    struct allocation *entry = malloc(sizeof *entry);
    if (!memory || !entry) {
        free(memory);
        free(entry);
        return OUT_OF_MEMORY;
    }
    entry->ptr = (CUdeviceptr)(uintptr_t)memory;
    entry->bytes = bytes;
    entry->next = live;
    live = entry;
    used_memory += bytes;
    *ptr = entry->ptr;
    return SUCCESS;
}

/* IRIS_STANDIN_FAIL_FREE_OF: whether this free of `ptr` is the one that fails (once); the
 * caller holds state_lock. */
static int free_fails_locked(CUdeviceptr ptr) {
    if (!fail_free_of) return 0;
    for (struct allocation *entry = live; entry; entry = entry->next) {
        if (entry->ptr == ptr && entry->bytes == fail_free_of) {
            fail_free_of = 0;
            return 1;
        }
    }
    return 0;
}

static CUresult device_free(CUdeviceptr ptr) {
    for (struct allocation **at = &live; *at; at = &(*at)->next) {
        if ((*at)->ptr == ptr) {
            struct allocation *entry = *at;
            *at = entry->next;
            used_memory -= entry->bytes;
            free((void *)(uintptr_t)ptr);
            free(entry);
            return SUCCESS;
        }
    }
    return INVALID_VALUE;
}

/* Runs the queued work in order; the caller holds state_lock. */
static void flush_locked(void) {
    while (queue_head) {
        struct deferred *op = queue_head;
        queue_head = op->next;
        if (op->host_fn) {
            op->host_fn(op->host_data);
        } else if (op->free_ptr) {
            device_free(op->free_ptr);
        } else {
            memmove(op->dst, op->src, op->bytes);
        }
        free(op);
    }
    queue_tail = NULL;
}

/* Runs the queued work: everything enqueued so far has completed afterwards. */
void iris_standin_flush(void) {
    pthread_mutex_lock(&state_lock);
    flush_locked();
    pthread_mutex_unlock(&state_lock);
}

static void enqueue_locked(void *dst, const void *src, size_t bytes, CUdeviceptr free_ptr) {
    struct deferred *op = calloc(1, sizeof *op);
    op->dst = dst;
    op->src = src;
    op->bytes = bytes;
    op->free_ptr = free_ptr;
    if (queue_tail) queue_tail->next = op; else queue_head = op;
    queue_tail = op;
}

static int pinned_locked(const void *ptr) {
    for (struct host_block *block = host_blocks; block; block = block->next) {
        if ((const char *)ptr >= block->ptr && (const char *)ptr < block->ptr + block->bytes) {
            return 1;
        }
    }
    return 0;
}

unsigned long long iris_standin_live_pools(void) { return (unsigned long long)live_pools; }
unsigned long long iris_standin_blocking_reads(void) { return blocking_reads; }
unsigned long long iris_standin_device_copies(void) { return device_copies; }

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
    GUARD();
    pthread_mutex_lock(&state_lock);
    CUresult result = device_alloc(ptr, bytes);
    pthread_mutex_unlock(&state_lock);
    return result;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    GUARD();
    pthread_mutex_lock(&state_lock);
    flush_locked();
    CUresult result = free_fails_locked(ptr) ? INVALID_VALUE : device_free(ptr);
    pthread_mutex_unlock(&state_lock);
    return result;
}

CUresult cuMemAllocAsync(CUdeviceptr *ptr, size_t bytes, CUstream stream) {
    (void)stream;
    return cuMemAlloc_v2(ptr, bytes);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *ptr, size_t bytes, CUmemoryPool pool, CUstream stream) {
    GUARD();
    (void)pool;
    (void)stream;
    if (!pools) return NOT_SUPPORTED;
    /* Queued frees still hold their memory: allocating does not run them. */
    return cuMemAlloc_v2(ptr, bytes);
}

CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream stream) {
    GUARD();
    (void)stream;
    pthread_mutex_lock(&state_lock);
    CUresult result = SUCCESS;
    if (free_fails_locked(ptr)) {
        result = INVALID_VALUE;
    } else if (defer) {
        enqueue_locked(NULL, NULL, 0, ptr);
    } else {
        result = device_free(ptr);
    }
    pthread_mutex_unlock(&state_lock);
    return result;
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props) {
    GUARD();
    (void)props;
    if (!pools) return NOT_SUPPORTED;
    *pool = malloc(1);
    live_pools++;
    return SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    GUARD();
    iris_standin_flush();
    free(pool);
    live_pools--;
    return SUCCESS;
}


CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attribute, void *value) {
    GUARD();
    (void)pool;
    (void)attribute;
    (void)value;
    return SUCCESS;
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attribute, void *value) {
    GUARD();
    (void)pool;
    /* Reserved and used are the same: freed memory returns at once. */
    *(unsigned long long *)value = (attribute == 5 || attribute == 7) ? used_memory : 0;
    return SUCCESS;
}

CUresult cuMemHostAlloc(void **ptr, size_t bytes, unsigned int flags) {
    GUARD();
    (void)flags;
    *ptr = aligned_alloc(64, (bytes + 63) / 64 * 64);
    struct host_block *block = malloc(sizeof *block);
    if (!*ptr || !block) {
        free(*ptr);
        free(block);
        return OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&state_lock);
    block->ptr = *ptr;
    block->bytes = bytes;
    block->next = host_blocks;
    host_blocks = block;
    pthread_mutex_unlock(&state_lock);
    return SUCCESS;
}

CUresult cuMemFreeHost(void *ptr) {
    GUARD();
    pthread_mutex_lock(&state_lock);
    flush_locked();
    for (struct host_block **at = &host_blocks; *at; at = &(*at)->next) {
        if ((*at)->ptr == ptr) {
            struct host_block *block = *at;
            *at = block->next;
            free(block);
            break;
        }
    }
    pthread_mutex_unlock(&state_lock);
    free(ptr);
    return SUCCESS;
}

/* CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2) only: host for page-locked memory, device for device
 * allocations; pageable memory is unknown to the driver (INVALID_VALUE). */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    GUARD();
    if (attribute != 2) return INVALID_VALUE;
    pthread_mutex_lock(&state_lock);
    unsigned int type = 0;
    if (pinned_locked((const void *)(uintptr_t)ptr)) type = 1; /* CU_MEMORYTYPE_HOST */
    for (struct allocation *entry = live; entry && !type; entry = entry->next) {
        if (ptr >= entry->ptr && ptr < entry->ptr + entry->bytes) type = 2; /* DEVICE */
    }
    pthread_mutex_unlock(&state_lock);
    if (!type) return INVALID_VALUE;
    *(unsigned int *)data = type;
    return SUCCESS;
}

/* A copy: queued when deferring and `host` (the host side of the copy, if any) is page-locked,
 * else done at once after the queue. */
static CUresult copy(void *dst, const void *src, size_t bytes, const void *host) {
    GUARD();
    if (fail_copy) return fail_copy;
    pthread_mutex_lock(&state_lock);
    if (defer && host && pinned_locked(host)) {
        enqueue_locked(dst, src, bytes, 0);
    } else {
        flush_locked();
        memmove(dst, src, bytes);
    }
    pthread_mutex_unlock(&state_lock);
    return SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream) {
    (void)stream;
    return copy((void *)(uintptr_t)dst, src, bytes, src);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    (void)stream;
    return copy(dst, (const void *)(uintptr_t)src, bytes, dst);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    (void)stream;
    __atomic_add_fetch(&device_copies, 1, __ATOMIC_RELAXED);
    return copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes, NULL);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
    return copy((void *)(uintptr_t)dst, src, bytes, NULL);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
    __atomic_add_fetch(&blocking_reads, 1, __ATOMIC_RELAXED);
    return copy(dst, (const void *)(uintptr_t)src, bytes, NULL);
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t count) {
    GUARD();
    iris_standin_flush();
    memset((void *)(uintptr_t)dst, value, count);
    return SUCCESS;
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream) {
    (void)stream;
    return cuMemsetD8_v2(dst, value, count);
}

CUresult cuMemsetD16Async(CUdeviceptr dst, unsigned short value, size_t count, CUstream stream) {
    GUARD();
    (void)stream;
    iris_standin_flush();
    unsigned short *p = (unsigned short *)(uintptr_t)dst;
    for (size_t i = 0; i < count; i++) p[i] = value;
    return SUCCESS;
}

CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream) {
    GUARD();
    (void)stream;
    iris_standin_flush();
    unsigned int *p = (unsigned int *)(uintptr_t)dst;
    for (size_t i = 0; i < count; i++) p[i] = value;
    return SUCCESS;
}

CUresult cuStreamCreate(CUstream *stream, unsigned int flags) {
    GUARD();
    (void)flags;
    *stream = malloc(1);
    return SUCCESS;
}

/* A host function: queued with the deferred work when deferring (all streams are one queue
 * here), else called at once after the queue. */
CUresult cuLaunchHostFunc(CUstream stream, void (*fn)(void *), void *data) {
    GUARD();
    (void)stream;
    if (!fn) return INVALID_VALUE;
    pthread_mutex_lock(&state_lock);
    if (defer) {
        enqueue_locked(NULL, NULL, 0, 0);
        queue_tail->host_fn = fn;
        queue_tail->host_data = data;
        pthread_mutex_unlock(&state_lock);
        return SUCCESS;
    }
    flush_locked();
    pthread_mutex_unlock(&state_lock);
    fn(data);
    return SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream stream) {
    GUARD();
    iris_standin_flush();
    free(stream);
    return SUCCESS;
}

CUresult cuStreamSynchronize(CUstream stream) {
    GUARD();
    (void)stream;
    iris_standin_flush();
    if (sync_delay_ms) {
        struct timespec pause = {(time_t)(sync_delay_ms / 1000), (long)(sync_delay_ms % 1000) * 1000000L};
        nanosleep(&pause, NULL);
    }
    return SUCCESS;
}

CUresult cuStreamQuery(CUstream stream) {
    GUARD();
    (void)stream;
    pthread_mutex_lock(&state_lock);
    int busy = queue_head != NULL;
    pthread_mutex_unlock(&state_lock);
    return busy ? NOT_READY : SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
    GUARD();
    (void)stream;
    (void)event;
    (void)flags;
    return SUCCESS;
}

CUresult cuEventCreate(CUevent *event, unsigned int flags) {
    GUARD();
    (void)flags;
    *event = malloc(1);
    return SUCCESS;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
    GUARD();
    (void)event;
    (void)stream;
    return SUCCESS;
}

/* Events complete with the whole queue (the stand-in does not track where one was recorded). */
CUresult cuEventQuery(CUevent event) {
    GUARD();
    (void)event;
    iris_standin_flush();
    return SUCCESS;
}

CUresult cuEventSynchronize(CUevent event) {
    GUARD();
    (void)event;
    iris_standin_flush();
    return SUCCESS;
}

CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    GUARD();
    (void)start;
    (void)end;
    *ms = 0.0f;
    return SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent event) {
    GUARD();
    free(event);
    return SUCCESS;
}

#ifndef IRIS_STANDIN_KERNELS
/* Without the kernel emulator (emu.cpp), kernels cannot run. */
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    GUARD();
    (void)module;
    (void)image;
    return NOT_SUPPORTED;
}

CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    GUARD();
    (void)function;
    (void)module;
    (void)name;
    return NOT_SUPPORTED;
}

CUresult cuModuleUnload(CUmodule module) {
    GUARD();
    (void)module;
    return SUCCESS;
}

/* Tensor maps (Hopper's TMA) are never made here; the entry points exist because cuDNN's
 * sub-libraries link against them, so that the real cuDNN loads over this driver
 * (tests/cudnn.rs). */
CUresult cuTensorMapEncodeTiled(void) {
    GUARD();
    return NOT_SUPPORTED;
}

CUresult cuTensorMapEncodeIm2col(void) {
    GUARD();
    return NOT_SUPPORTED;
}

CUresult cuFuncSetAttribute(CUfunction f, int attribute, int value) {
    GUARD();
    (void)f; (void)attribute; (void)value;
    return NOT_SUPPORTED;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        CUstream stream, void **params, void **extra) {
    GUARD();
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
    (void)shared; (void)stream; (void)params; (void)extra;
    return NOT_SUPPORTED;
}
#endif

CUresult cuGetErrorString(CUresult error, const char **text) {
    (void)error;
    *text = "stand-in driver error";
    return SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **text) {
    (void)error;
    *text = "CUDA_ERROR_STANDIN";
    return SUCCESS;
}

/* Libraries that use the driver's private tables (NVRTC, cuBLAS) ask for them here; there are
 * none, and saying so makes them fail cleanly instead of crashing. */
CUresult cuGetExportTable(const void **table, const void *id) {
    (void)id;
    *table = NULL;
    return NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    (void)symbol; (void)version; (void)flags;
    *pfn = NULL;
    return NOT_FOUND;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status) {
    (void)symbol; (void)version; (void)flags;
    *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return NOT_FOUND;
}
