/*
 * A stand-in for the CUDA driver (libcuda.so.1) for tests on machines without a GPU.
 *
 * It exports the driver entry points the plugin calls, with host memory as device memory and
 * every asynchronous operation done at once. Built alone, it cannot run kernels: module loads and
 * launches return CUDA_ERROR_NOT_SUPPORTED. Built with -DIRIS_STANDIN_KERNELS and linked with
 * emu.cpp, it runs the plugin's own kernels (kernels/iris.cu) on the CPU, one fiber per CUDA
 * thread. It returns only codes that exist in cudarc's CUresult enum.
 *
 * For tests to look inside: iris_standin_live_pools() counts memory pools not destroyed.
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
 *                          IRIS_STANDIN_DRIVER_DEFAULT, set at build time: 12040 or 13000)
 *   IRIS_STANDIN_POOLS     0: the device has no memory pools (default 1)
 *   IRIS_STANDIN_FAIL_COPY a CUresult every memcpy returns (e.g. 719, launch failed)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
/* The default driver version: the first release of the plugin build's CUDA major or later. */
#ifndef IRIS_STANDIN_DRIVER_DEFAULT
#define IRIS_STANDIN_DRIVER_DEFAULT 12040
#endif
static int driver_version = IRIS_STANDIN_DRIVER_DEFAULT;
static int pools = 1;
static int fail_copy;
static int fail_attribute = -1;
static int live_pools;
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
    devices = (int)env_number("IRIS_STANDIN_DEVICES", 1);
    total_memory = env_number("IRIS_STANDIN_MEMORY", 1ull << 30);
    oom_at = env_number("IRIS_STANDIN_OOM_AT", 0);
    driver_version = (int)env_number("IRIS_STANDIN_DRIVER", IRIS_STANDIN_DRIVER_DEFAULT);
    pools = (int)env_number("IRIS_STANDIN_POOLS", 1);
    fail_copy = (int)env_number("IRIS_STANDIN_FAIL_COPY", 0);
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
        case 16: *value = 4; break;          /* multiprocessors */
        case 36: *value = 1000000; break;    /* memory clock, kHz */
        case 37: *value = 256; break;        /* memory bus width, bits */
        case 75: *value = 8; break;          /* compute capability major */
        case 76: *value = 0; break;          /* compute capability minor */
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
    return SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    GUARD();
    if (!current) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    *free_bytes = total_memory - used_memory;
    *total_bytes = total_memory;
    return SUCCESS;
}

static CUresult device_alloc(CUdeviceptr *ptr, size_t bytes) {
    allocations++;
    if ((oom_at && allocations == oom_at) || bytes > total_memory - used_memory) return OUT_OF_MEMORY;
    void *memory = malloc(bytes ? bytes : 1);
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

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
    GUARD();
    return device_alloc(ptr, bytes);
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    GUARD();
    return device_free(ptr);
}

CUresult cuMemAllocAsync(CUdeviceptr *ptr, size_t bytes, CUstream stream) {
    GUARD();
    (void)stream;
    return device_alloc(ptr, bytes);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *ptr, size_t bytes, CUmemoryPool pool, CUstream stream) {
    GUARD();
    (void)pool;
    (void)stream;
    if (!pools) return NOT_SUPPORTED;
    return device_alloc(ptr, bytes);
}

CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream stream) {
    GUARD();
    (void)stream;
    return device_free(ptr);
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
    free(pool);
    live_pools--;
    return SUCCESS;
}

int iris_standin_live_pools(void) { return live_pools; }

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
    return *ptr ? SUCCESS : OUT_OF_MEMORY;
}

CUresult cuMemFreeHost(void *ptr) {
    GUARD();
    free(ptr);
    return SUCCESS;
}

#define COPY(dst, src, bytes)                  \
    do {                                       \
        GUARD();                               \
        if (fail_copy) return fail_copy;       \
        memmove((dst), (src), (bytes));        \
        return SUCCESS;                        \
    } while (0)

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream) {
    (void)stream;
    COPY((void *)(uintptr_t)dst, src, bytes);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    (void)stream;
    COPY(dst, (const void *)(uintptr_t)src, bytes);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    (void)stream;
    COPY((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
    COPY((void *)(uintptr_t)dst, src, bytes);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
    COPY(dst, (const void *)(uintptr_t)src, bytes);
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t count) {
    GUARD();
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
    unsigned short *p = (unsigned short *)(uintptr_t)dst;
    for (size_t i = 0; i < count; i++) p[i] = value;
    return SUCCESS;
}

CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream) {
    GUARD();
    (void)stream;
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

CUresult cuStreamDestroy_v2(CUstream stream) {
    GUARD();
    free(stream);
    return SUCCESS;
}

CUresult cuStreamSynchronize(CUstream stream) {
    GUARD();
    (void)stream;
    return SUCCESS;
}

CUresult cuStreamQuery(CUstream stream) {
    GUARD();
    (void)stream;
    return SUCCESS;
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

CUresult cuEventQuery(CUevent event) {
    GUARD();
    (void)event;
    return SUCCESS;
}

CUresult cuEventSynchronize(CUevent event) {
    GUARD();
    (void)event;
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
