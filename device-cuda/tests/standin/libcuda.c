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
 * Deferred work (IRIS_STANDIN_DEFER=1) models what a GPU does asynchronously, stream by stream,
 * so that a missing cross-stream wait fails in CI as it would on a GPU:
 *   - Each stream (the legacy NULL stream too) has a FIFO queue of the work a GPU could still be
 *     doing: copies between device addresses and from or to page-locked host memory
 *     (cuMemHostAlloc), fills, host functions (cuLaunchHostFunc), stream-ordered frees
 *     (cuMemFreeAsync, which free when reached) and waits for events (cuStreamWaitEvent).
 *     Work runs in order within a stream; nothing orders two streams but events.
 *   - cuEventRecord(e, s) marks e at s's tail at the call (re-recording moves the mark); e is
 *     complete once s has run that far, and an event never recorded is complete.
 *     cuStreamWaitEvent(s, e) captures e's mark at the call, as CUDA does: later work on s runs
 *     only after e's stream has run up to it.
 *   - Nothing runs by itself: queued work runs when something needs it, and only as far as
 *     needed. cuStreamSynchronize(s) runs s's queue; cuEventSynchronize(e) e's stream up to its
 *     mark; cuCtxSynchronize and iris_standin_flush() every queue. An operation on a stream that
 *     the stand-in does at once (a copy from or to pageable memory, which the driver stages
 *     synchronously) first runs that stream's queue, as does a kernel launch
 *     (the emulator calls iris_standin_flush_stream(stream)) and a library's computation (the
 *     stand-in cuBLAS, cuBLASLt and cuDNN call it with their handle's or call's stream, looked
 *     up at run time; a handle's stream not set is NULL, the legacy stream, here as in CUDA).
 *     The synchronous calls without a stream (cuMemcpyHtoD/DtoH, cuMemsetD8, cuMemFree,
 *     cuMemFreeHost, cuMemPoolDestroy) run every queue, as the driver's implicit
 *     synchronisation does. cuStreamDestroy runs the stream's queue first (a GPU finishes a
 *     destroyed stream's work).
 *   - Running a stream up to a point runs, before each wait in its queue, the waited-for stream
 *     up to the captured mark, and then lets that stream run on as far as it can without waiting
 *     itself, as a GPU's other engine would. So a missing wait shows in both directions: a
 *     consumer without its wait runs before its producer (the producer only runs when waited
 *     for), and a producer without its wait for the consumer runs ahead and overwrites what the
 *     consumer has not read yet. There is no deadlock: a mark covers only work enqueued before
 *     the wait that captured it, so each wait depends on strictly older work.
 *   - cuStreamQuery answers CUDA_ERROR_NOT_READY while the stream has queued work, cuEventQuery
 *     while the event's stream has not run up to its mark; neither runs anything.
 *   - Not modelled: the legacy stream's implicit synchronisation with blocking streams (the
 *     plugin's streams are all non-blocking); the per-thread default stream is the legacy one.
 * cuPointerGetAttribute tells page-locked host memory (CU_MEMORYTYPE_HOST) from pageable
 * (CUDA_ERROR_INVALID_VALUE), as the driver does. Entry points are thread-safe.
 *
 * The primary context lives from its first cuDevicePrimaryCtxRetain to the release that drops
 * the last reference, as in CUDA: that release destroys it, which runs its queued work (unless
 * it faulted), frees every device allocation and page-locked block still live (the bytes are
 * counted, iris_standin_teardown_bytes()) and clears a fault; memory pools are the device's
 * and outlive it. A call that needs the context after that, on a thread where it is still
 * current, fails with CUDA_ERROR_CONTEXT_IS_DESTROYED and is counted
 * (iris_standin_calls_after_teardown()): a plugin that frees or synchronises after releasing
 * its context would touch freed memory on a GPU.
 *
 * Faults (IRIS_STANDIN_FAULT_LAUNCH, iris_standin_fault_launch()): a kernel that faults (an
 * illegal address) is launched without an error, as on a GPU, and does not run; from then on
 * every call that needs the context fails with CUDA_ERROR_ILLEGAL_ADDRESS, the sticky error of
 * a corrupted context (synchronisation, copies, allocation and frees, memory queries, launches,
 * and the stand-in libraries' computations), queued work never runs (host functions are not
 * called), until the context is destroyed. Device queries and the primary context's retain and
 * release still answer.
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
 *   IRIS_STANDIN_FAULT_LAUNCH  the Nth kernel launch faults (see Faults above); tests can also
 *                          arm it at run time with iris_standin_fault_launch(n)
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
    ILLEGAL_ADDRESS = 700,
    CONTEXT_IS_DESTROYED = 709,
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
/* Guards every table and the queues: the plugin is called from several threads. */
static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;

/* Page-locked host allocations, to tell them from pageable memory. */
struct host_block {
    char *ptr;
    size_t bytes;
    struct host_block *next;
};
static struct host_block *host_blocks;

/* One piece of queued asynchronous work (IRIS_STANDIN_DEFER=1). */
enum op_kind { OP_COPY, OP_FILL, OP_FREE, OP_HOST_FN, OP_WAIT };
struct stream;
struct op {
    enum op_kind kind;
    void *dst; /* OP_COPY: `bytes` from `src` to `dst`; OP_FILL: `count` values at `dst` */
    const void *src;
    size_t bytes;
    unsigned int fill_value; /* OP_FILL: the value, `fill_width` bytes wide (1, 2 or 4) */
    int fill_width;
    size_t count;
    CUdeviceptr free_ptr;    /* OP_FREE: a stream-ordered free */
    void (*host_fn)(void *); /* OP_HOST_FN: called with `host_data` */
    void *host_data;
    /* OP_WAIT: later work waits until `wait_stream` has run `wait_mark` operations (NULL: the
     * stream is gone, its work all done). */
    struct stream *wait_stream;
    unsigned long long wait_mark;
    struct op *next;
};

/* A stream: its queue, in enqueue order, and two counts of its operations that make positions
 * in it comparable: `enqueued` ever and `completed` (run) so far. A mark (an event's, a wait's)
 * is a value of `enqueued`; the stream has reached it once `completed` is as large, since the
 * queue runs in order. CUstream handles are `struct stream *`, except the legacy one. */
struct stream {
    struct op *head, *tail;
    unsigned long long enqueued, completed;
    struct stream *next; /* every live stream, for whole-context synchronisation */
};
/* The legacy (NULL) stream, which also stands for CU_STREAM_LEGACY and CU_STREAM_PER_THREAD;
 * it heads the list of live streams and is never destroyed. */
static struct stream legacy_stream;
static struct stream *streams = &legacy_stream;

/* An event: where it was last recorded (`stream` NULL: never, or on a stream since destroyed,
 * whose work all ran; complete either way). */
struct event {
    struct stream *stream;
    unsigned long long mark;
    struct event *next; /* every live event, to forget a destroyed stream */
};
static struct event *events;

void iris_standin_flush(void);
void iris_standin_flush_stream(CUstream stream);
static char primary_context;
static __thread CUcontext current;
/* References to the primary context (retains not yet released), and whether one existed. */
static int context_refs;
static int context_ever;
/* The sticky error of a fault (0: none), until the context is destroyed. */
static CUresult sticky;
/* Launches until the one that faults (0: none armed); see iris_standin_launch_faults(). */
static unsigned long long fault_launch;
static unsigned long long calls_after_teardown;
static unsigned long long teardown_bytes;

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

/* What a call that needs the context gets: 0 while it is usable, CONTEXT_IS_DESTROYED after the
 * last release (counted), the sticky error after a fault. */
CUresult iris_standin_context_error(void) {
    pthread_mutex_lock(&state_lock);
    CUresult result = SUCCESS;
    if (context_ever && !context_refs) {
        calls_after_teardown++;
        result = CONTEXT_IS_DESTROYED;
    } else {
        result = sticky;
    }
    pthread_mutex_unlock(&state_lock);
    return result;
}

/* GUARD, then the context's state. */
#define CONTEXT_GUARD()                                        \
    do {                                                       \
        GUARD();                                               \
        CUresult context_error = iris_standin_context_error(); \
        if (context_error) return context_error;               \
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
    fault_launch = env_number("IRIS_STANDIN_FAULT_LAUNCH", 0);
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

/* The first retain (after none, or after the last release) makes a fresh context. */
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    GUARD();
    (void)device;
    pthread_mutex_lock(&state_lock);
    if (!context_refs) sticky = SUCCESS;
    context_refs++;
    context_ever = 1;
    pthread_mutex_unlock(&state_lock);
    *ctx = &primary_context;
    return SUCCESS;
}

static void teardown_locked(void);

/* The release of the last reference destroys the context. */
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    GUARD();
    (void)device;
    pthread_mutex_lock(&state_lock);
    CUresult result = SUCCESS;
    if (!context_refs) {
        result = 201; /* CUDA_ERROR_INVALID_CONTEXT: nothing retained */
    } else if (--context_refs == 0) {
        teardown_locked();
    }
    pthread_mutex_unlock(&state_lock);
    return result;
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
    CONTEXT_GUARD();
    iris_standin_flush();
    return SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    CONTEXT_GUARD();
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

/* The stream a handle names: the plugin's streams are ours; NULL, CU_STREAM_LEGACY (1) and
 * CU_STREAM_PER_THREAD (2) are the legacy stream. */
static struct stream *stream_of(CUstream handle) {
    if ((uintptr_t)handle <= 2) return &legacy_stream;
    return (struct stream *)handle;
}

/* Whether `stream` has run its first `mark` operations (a NULL stream's work all ran). */
static int reached(const struct stream *stream, unsigned long long mark) {
    return !stream || stream->completed >= mark;
}

/* Whether the head of `stream`'s queue may run now: anything but a wait not yet met. */
static int head_ready(const struct stream *stream) {
    const struct op *op = stream->head;
    return op && (op->kind != OP_WAIT || reached(op->wait_stream, op->wait_mark));
}

/* Writes `count` values of `width` bytes (1, 2 or 4) at `dst`. */
static void fill(void *dst, unsigned int value, int width, size_t count) {
    if (width == 1) {
        memset(dst, (int)value, count);
    } else if (width == 2) {
        unsigned short *p = dst;
        for (size_t i = 0; i < count; i++) p[i] = (unsigned short)value;
    } else {
        unsigned int *p = dst;
        for (size_t i = 0; i < count; i++) p[i] = value;
    }
}

/* Runs the head of `stream`'s queue, which head_ready allows; the caller holds state_lock.
 * Host functions run here, on the synchronising thread with the lock held, which is fine for
 * the plugin's (a memcpy): CUDA forbids calling the driver from one anyway. */
static void run_head_locked(struct stream *stream) {
    struct op *op = stream->head;
    stream->head = op->next;
    if (!stream->head) stream->tail = NULL;
    switch (op->kind) {
        case OP_COPY: memmove(op->dst, op->src, op->bytes); break;
        case OP_FILL: fill(op->dst, op->fill_value, op->fill_width, op->count); break;
        case OP_FREE: device_free(op->free_ptr); break;
        case OP_HOST_FN: op->host_fn(op->host_data); break;
        case OP_WAIT: break; /* met: nothing to do */
    }
    stream->completed++;
    free(op);
}

/* Runs `stream`'s queue until it has reached `mark`; the caller holds state_lock.
 *
 * Before a wait not yet met, the waited-for stream runs up to the wait's mark (recursively,
 * for its own waits), then runs on while its head is ready, since a GPU would not stop it
 * there: a producer that should wait for this stream but does not then overwrites what this
 * stream has yet to read. Running on stops at the first wait not yet met, so nothing beyond
 * the mark is forced.
 * This ends: a wait's mark covers only work enqueued before the wait, so every recursive step
 * needs strictly older work, and a stream already being run further up is only ever asked for
 * marks it has reached. The head is read again after each step, since running another stream
 * on may have run this one's ready head too. */
static void run_until_locked(struct stream *stream, unsigned long long mark) {
    if (sticky) return; /* a faulted context runs nothing more */
    while (stream->completed < mark && !sticky) {
        struct op *op = stream->head;
        if (op->kind == OP_WAIT && !reached(op->wait_stream, op->wait_mark)) {
            struct stream *other = op->wait_stream;
            run_until_locked(other, op->wait_mark);
            while (!sticky && head_ready(other)) run_head_locked(other);
            continue;
        }
        run_head_locked(stream);
    }
}

/* Runs `stream`'s whole queue (and what it waits for); the caller holds state_lock. */
static void drain_locked(struct stream *stream) {
    run_until_locked(stream, stream->enqueued);
}

/* Runs every stream's queue; the caller holds state_lock. Running one stream never adds work
 * to another, so one pass leaves them all empty. */
static void drain_all_locked(void) {
    for (struct stream *stream = streams; stream; stream = stream->next) drain_locked(stream);
}

/* Runs every queue: everything enqueued so far has completed afterwards. */
void iris_standin_flush(void) {
    pthread_mutex_lock(&state_lock);
    drain_all_locked();
    pthread_mutex_unlock(&state_lock);
}

/* Runs `stream`'s queue and what it waits for, as an operation on that stream that runs at
 * once must: the kernel emulator (emu.cpp) calls this before each launch, and the stand-in
 * cuBLAS, cuBLASLt and cuDNN (cublas.c, cudnn.c) before each computation. */
void iris_standin_flush_stream(CUstream stream) {
    pthread_mutex_lock(&state_lock);
    drain_locked(stream_of(stream));
    pthread_mutex_unlock(&state_lock);
}

/* Appends a zeroed operation of `kind` to `stream`'s queue and returns it to be filled in; the
 * caller holds state_lock. */
static struct op *enqueue_locked(struct stream *stream, enum op_kind kind) {
    struct op *op = calloc(1, sizeof *op);
    op->kind = kind;
    if (stream->tail) stream->tail->next = op; else stream->head = op;
    stream->tail = op;
    stream->enqueued++;
    return op;
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

/* Calls that needed the context after it was destroyed (see the top of this file). */
unsigned long long iris_standin_calls_after_teardown(void) {
    pthread_mutex_lock(&state_lock);
    unsigned long long calls = calls_after_teardown;
    pthread_mutex_unlock(&state_lock);
    return calls;
}

/* Device and page-locked bytes the context's destruction freed: what was still allocated. */
unsigned long long iris_standin_teardown_bytes(void) {
    pthread_mutex_lock(&state_lock);
    unsigned long long bytes = teardown_bytes;
    pthread_mutex_unlock(&state_lock);
    return bytes;
}

/* Device memory allocated now. */
unsigned long long iris_standin_used_memory(void) {
    pthread_mutex_lock(&state_lock);
    unsigned long long bytes = used_memory;
    pthread_mutex_unlock(&state_lock);
    return bytes;
}

/* Arms a fault: the `launches`th kernel launch from now faults (1: the next one). */
void iris_standin_fault_launch(unsigned long long launches) {
    pthread_mutex_lock(&state_lock);
    fault_launch = launches;
    pthread_mutex_unlock(&state_lock);
}

/* Called by the kernel emulator (emu.cpp) at each launch, after the stream's earlier work ran:
 * whether this launch is the armed one, which then faults the context instead of running. */
int iris_standin_launch_faults(void) {
    pthread_mutex_lock(&state_lock);
    int faults = fault_launch && --fault_launch == 0;
    if (faults) sticky = ILLEGAL_ADDRESS;
    pthread_mutex_unlock(&state_lock);
    return faults;
}

/* Destroys the context (its last release); the caller holds state_lock. A healthy context
 * finishes its queued work first; a faulted one drops it unrun. Every device allocation and
 * page-locked block still live is freed and counted. Streams and events stay allocated here
 * (a handle the plugin still holds must not dangle in the stand-in), emptied. */
static void teardown_locked(void) {
    if (!sticky) drain_all_locked();
    for (struct stream *stream = streams; stream; stream = stream->next) {
        while (stream->head) {
            struct op *op = stream->head;
            stream->head = op->next;
            free(op);
        }
        stream->tail = NULL;
        stream->completed = stream->enqueued;
    }
    while (live) {
        struct allocation *entry = live;
        live = entry->next;
        teardown_bytes += entry->bytes;
        free((void *)(uintptr_t)entry->ptr);
        free(entry);
    }
    used_memory = 0;
    while (host_blocks) {
        struct host_block *block = host_blocks;
        host_blocks = block->next;
        teardown_bytes += block->bytes;
        free(block->ptr);
        free(block);
    }
    sticky = SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
    CONTEXT_GUARD();
    pthread_mutex_lock(&state_lock);
    CUresult result = device_alloc(ptr, bytes);
    pthread_mutex_unlock(&state_lock);
    return result;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    CONTEXT_GUARD();
    pthread_mutex_lock(&state_lock);
    /* The driver synchronises the context before a plain free. */
    drain_all_locked();
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

/* A stream-ordered free: when deferring, the memory stays allocated until the stream reaches
 * the free. */
CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream stream) {
    CONTEXT_GUARD();
    pthread_mutex_lock(&state_lock);
    CUresult result = SUCCESS;
    if (free_fails_locked(ptr)) {
        result = INVALID_VALUE;
    } else if (defer) {
        enqueue_locked(stream_of(stream), OP_FREE)->free_ptr = ptr;
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
    CONTEXT_GUARD();
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
    CONTEXT_GUARD();
    pthread_mutex_lock(&state_lock);
    /* The driver synchronises the context before freeing page-locked memory: queued copies from
     * or to it are done. */
    drain_all_locked();
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
    CONTEXT_GUARD();
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

/* A copy on `stream` (NULL: a synchronous copy, which waits for every stream): queued when
 * deferring, unless `host` (the host side of the copy, NULL for one between device addresses)
 * is pageable memory, which the driver stages at once; else done at once after the work it
 * must follow. */
static CUresult copy(void *dst, const void *src, size_t bytes, const void *host,
                     struct stream *stream) {
    CONTEXT_GUARD();
    if (fail_copy) return fail_copy;
    pthread_mutex_lock(&state_lock);
    if (defer && stream && (!host || pinned_locked(host))) {
        struct op *op = enqueue_locked(stream, OP_COPY);
        op->dst = dst;
        op->src = src;
        op->bytes = bytes;
    } else {
        if (stream) drain_locked(stream); else drain_all_locked();
        memmove(dst, src, bytes);
    }
    pthread_mutex_unlock(&state_lock);
    return SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream) {
    return copy((void *)(uintptr_t)dst, src, bytes, src, stream_of(stream));
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    return copy(dst, (const void *)(uintptr_t)src, bytes, dst, stream_of(stream));
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    __atomic_add_fetch(&device_copies, 1, __ATOMIC_RELAXED);
    return copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes, NULL,
                stream_of(stream));
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
    return copy((void *)(uintptr_t)dst, src, bytes, NULL, NULL);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
    __atomic_add_fetch(&blocking_reads, 1, __ATOMIC_RELAXED);
    return copy(dst, (const void *)(uintptr_t)src, bytes, NULL, NULL);
}

/* A fill on `stream` (NULL: a synchronous fill, after every stream): queued when deferring,
 * else done at once after the work it must follow. */
static CUresult fill_on(CUdeviceptr dst, unsigned int value, int width, size_t count,
                        struct stream *stream) {
    CONTEXT_GUARD();
    pthread_mutex_lock(&state_lock);
    if (defer && stream) {
        struct op *op = enqueue_locked(stream, OP_FILL);
        op->dst = (void *)(uintptr_t)dst;
        op->fill_value = value;
        op->fill_width = width;
        op->count = count;
    } else {
        if (stream) drain_locked(stream); else drain_all_locked();
        fill((void *)(uintptr_t)dst, value, width, count);
    }
    pthread_mutex_unlock(&state_lock);
    return SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t count) {
    return fill_on(dst, value, 1, count, NULL);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream) {
    return fill_on(dst, value, 1, count, stream_of(stream));
}

CUresult cuMemsetD16Async(CUdeviceptr dst, unsigned short value, size_t count, CUstream stream) {
    return fill_on(dst, value, 2, count, stream_of(stream));
}

CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream) {
    return fill_on(dst, value, 4, count, stream_of(stream));
}

/* A stream of its own (blocking or not: the legacy stream's implicit synchronisation is not
 * modelled), on the list of live streams. */
CUresult cuStreamCreate(CUstream *stream, unsigned int flags) {
    CONTEXT_GUARD();
    (void)flags;
    struct stream *created = calloc(1, sizeof *created);
    if (!created) return OUT_OF_MEMORY;
    pthread_mutex_lock(&state_lock);
    created->next = streams->next; /* after the legacy stream, which stays first */
    streams->next = created;
    pthread_mutex_unlock(&state_lock);
    *stream = created;
    return SUCCESS;
}

/* A host function: queued on its stream when deferring, else called at once after the queues
 * (empty then). */
CUresult cuLaunchHostFunc(CUstream stream, void (*fn)(void *), void *data) {
    CONTEXT_GUARD();
    if (!fn) return INVALID_VALUE;
    pthread_mutex_lock(&state_lock);
    if (defer) {
        struct op *op = enqueue_locked(stream_of(stream), OP_HOST_FN);
        op->host_fn = fn;
        op->host_data = data;
        pthread_mutex_unlock(&state_lock);
        return SUCCESS;
    }
    drain_all_locked();
    pthread_mutex_unlock(&state_lock);
    fn(data);
    return SUCCESS;
}

/* A GPU finishes a destroyed stream's work: it runs here, first. Then nothing may point at the
 * stream any more: events recorded on it and other streams' waits for it are complete (all its
 * work ran), which a NULL stream says. */
CUresult cuStreamDestroy_v2(CUstream stream) {
    CONTEXT_GUARD();
    struct stream *gone = stream_of(stream);
    if (gone == &legacy_stream) return SUCCESS; /* not ours to free */
    pthread_mutex_lock(&state_lock);
    drain_locked(gone);
    for (struct event *event = events; event; event = event->next) {
        if (event->stream == gone) event->stream = NULL;
    }
    for (struct stream **at = &streams; *at;) {
        if (*at == gone) {
            *at = gone->next;
            continue;
        }
        for (struct op *op = (*at)->head; op; op = op->next) {
            if (op->kind == OP_WAIT && op->wait_stream == gone) op->wait_stream = NULL;
        }
        at = &(*at)->next;
    }
    pthread_mutex_unlock(&state_lock);
    free(gone);
    return SUCCESS;
}

/* Runs the stream's queue, and what it waits for on other streams. */
CUresult cuStreamSynchronize(CUstream stream) {
    CONTEXT_GUARD();
    iris_standin_flush_stream(stream);
    if (sync_delay_ms) {
        struct timespec pause = {(time_t)(sync_delay_ms / 1000), (long)(sync_delay_ms % 1000) * 1000000L};
        nanosleep(&pause, NULL);
    }
    return SUCCESS;
}

/* Not ready while the stream has queued work (a wait not met included); runs nothing. */
CUresult cuStreamQuery(CUstream stream) {
    CONTEXT_GUARD();
    pthread_mutex_lock(&state_lock);
    int busy = stream_of(stream)->head != NULL;
    pthread_mutex_unlock(&state_lock);
    return busy ? NOT_READY : SUCCESS;
}

/* Later work on `stream` waits for the event's mark as it is now (recording the event again
 * later does not move the wait). A wait already met (an event never recorded, or complete)
 * queues nothing. */
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
    CONTEXT_GUARD();
    (void)flags;
    const struct event *waited = event;
    pthread_mutex_lock(&state_lock);
    if (waited && !reached(waited->stream, waited->mark)) {
        struct op *op = enqueue_locked(stream_of(stream), OP_WAIT);
        op->wait_stream = waited->stream;
        op->wait_mark = waited->mark;
    }
    pthread_mutex_unlock(&state_lock);
    return SUCCESS;
}

CUresult cuEventCreate(CUevent *event, unsigned int flags) {
    CONTEXT_GUARD();
    (void)flags;
    struct event *created = calloc(1, sizeof *created);
    if (!created) return OUT_OF_MEMORY;
    pthread_mutex_lock(&state_lock);
    created->next = events;
    events = created;
    pthread_mutex_unlock(&state_lock);
    *event = created;
    return SUCCESS;
}

/* Marks the event at the stream's tail: it completes once the work enqueued so far has run.
 * Without deferral nothing is ever queued, so every event is complete at once. */
CUresult cuEventRecord(CUevent event, CUstream stream) {
    CONTEXT_GUARD();
    struct event *recorded = event;
    if (!recorded) return SUCCESS;
    pthread_mutex_lock(&state_lock);
    recorded->stream = stream_of(stream);
    recorded->mark = recorded->stream->enqueued;
    pthread_mutex_unlock(&state_lock);
    return SUCCESS;
}

/* Not ready while the event's stream has not run up to its mark; runs nothing. */
CUresult cuEventQuery(CUevent event) {
    CONTEXT_GUARD();
    const struct event *queried = event;
    if (!queried) return SUCCESS;
    pthread_mutex_lock(&state_lock);
    int done = reached(queried->stream, queried->mark);
    pthread_mutex_unlock(&state_lock);
    return done ? SUCCESS : NOT_READY;
}

/* Runs the event's stream up to its mark (and what that work waits for on other streams). */
CUresult cuEventSynchronize(CUevent event) {
    CONTEXT_GUARD();
    const struct event *waited = event;
    if (!waited) return SUCCESS;
    pthread_mutex_lock(&state_lock);
    if (waited->stream) run_until_locked(waited->stream, waited->mark);
    pthread_mutex_unlock(&state_lock);
    return SUCCESS;
}

CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    CONTEXT_GUARD();
    (void)start;
    (void)end;
    *ms = 0.0f;
    return SUCCESS;
}

/* Waits captured the event's mark, so queued work never points at the event itself. */
CUresult cuEventDestroy_v2(CUevent event) {
    CONTEXT_GUARD();
    pthread_mutex_lock(&state_lock);
    for (struct event **at = &events; *at; at = &(*at)->next) {
        if (*at == event) {
            *at = (*at)->next;
            break;
        }
    }
    pthread_mutex_unlock(&state_lock);
    free(event);
    return SUCCESS;
}

#ifndef IRIS_STANDIN_KERNELS
/* Without the kernel emulator (emu.cpp), kernels cannot run. */
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    CONTEXT_GUARD();
    (void)module;
    (void)image;
    return NOT_SUPPORTED;
}

CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    CONTEXT_GUARD();
    (void)function;
    (void)module;
    (void)name;
    return NOT_SUPPORTED;
}

CUresult cuModuleUnload(CUmodule module) {
    CONTEXT_GUARD();
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
    CONTEXT_GUARD();
    (void)f; (void)attribute; (void)value;
    return NOT_SUPPORTED;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        CUstream stream, void **params, void **extra) {
    CONTEXT_GUARD();
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
