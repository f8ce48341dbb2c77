/*
 * A stand-in for cuDNN 9 (libcudnn.so.9) beside the stand-in driver: the backend (graph) API
 * subset the plugin's fused attention calls, computing scaled-dot-product attention on the host
 * (device memory is host memory there) in double precision, each output rounded once.
 *
 * It keeps cuDNN's rules where the plugin could break them: the attributes each descriptor
 * requires before it is finalized, their types and counts, references only to finalized
 * descriptors of the right kind, no attribute set after finalizing, distinct tensor ids in a
 * graph, the attention operation's shapes ([b, h, s, d] for Q, K, V and O; f16 or bf16; d a
 * multiple of 8 up to 256; unit stride along d; a by-value f32 scale), engine configurations
 * filled by the heuristic, plans on the graph's handle, every operand's id and pointer in the
 * variant pack, pointers aligned as their tensors declare, and a workspace as large as the plan
 * says. Anything else is an error status, as the real library answers.
 *
 * An execution is ordered on the handle's stream (cudnnSetStream's; the legacy NULL stream until
 * one is set) as on a GPU: before touching memory, it runs that stream's queued work and what
 * that work waits for, through the stand-in driver's iris_standin_flush_stream (found at run time
 * in the libcuda.so.1 the process loaded; with another driver, nothing is run), so that it reads
 * what the driver's deferred mode (IRIS_STANDIN_DEFER=1) copies in before it. In a context the
 * driver says faulted or destroyed it fails with CUDNN_STATUS_EXECUTION_FAILED.
 *
 * Like the real library, a handle allocates device state of its own at its first execution
 * (IRIS_STANDIN_CUDNN_LAZY_BYTES, 1 MiB unless set, 0 turns it off), freed when the handle is
 * destroyed, and a plan loads what it runs at its first execution (IRIS_STANDIN_CUDNN_PLAN_BYTES,
 * 0 unless set), freed when the plan is destroyed (or, with IRIS_STANDIN_CUDNN_PLAN_MEMORY_KEPT=1,
 * kept by the handle until it is destroyed, as a library caching what it loaded would), all
 * through the stand-in driver's cuMemAlloc. The memory the plugin reports must account for them.
 *
 * Switches (environment):
 *   IRIS_STANDIN_CUDNN_VERSION    what cudnnGetVersion returns (default: the define of that
 *                                 name, 91700 = 9.17.0)
 *   IRIS_STANDIN_CUDNN_CUDART     what cudnnGetCudartVersion returns (default: the define, 12080)
 *   IRIS_STANDIN_CUDNN_WORKSPACE  bytes every plan needs (default 4096); an execution fills them
 *                                 with 0xA5 first, so a workspace overlapping an operand shows
 *   IRIS_STANDIN_CUDNN_NO_ENGINE  1: the heuristic has no engine for any graph
 *   IRIS_STANDIN_CUDNN_WRONG      1: each execution adds 0.5 to its first output element
 *
 * A descriptor tied to a handle (an operation graph, an execution plan) destroyed after that
 * handle aborts the process with a message, since a real library may touch the handle then. So
 * does a handle used by two threads at once (an execution, or the finalizing of a graph, a
 * heuristic or a plan on it, while another thread is in one): cuDNN's handles are not
 * thread-safe.
 *
 * For tests of building plans off the caller's thread: iris_standin_cudnn_hold_plans(1) makes
 * every execution plan's finalizing wait (holding its handle) until
 * iris_standin_cudnn_hold_plans(0); iris_standin_cudnn_held_plans() counts the waits begun. A
 * wait of 60 s aborts with a message (the thread that set the hold is the one waiting).
 *
 * Counters for tests: iris_standin_cudnn_executes(), iris_standin_cudnn_failed_executes()
 * (executions that returned an error status, such as a plan's first one when the device memory
 * it loads cannot be allocated), iris_standin_cudnn_plans() (execution plans finalized),
 * iris_standin_cudnn_live_descriptors() and iris_standin_cudnn_live_handles() (created and not
 * destroyed).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "driver.h"
#include "half.h"

#ifndef IRIS_STANDIN_CUDNN_VERSION
#define IRIS_STANDIN_CUDNN_VERSION 91700
#endif
#ifndef IRIS_STANDIN_CUDNN_CUDART
#define IRIS_STANDIN_CUDNN_CUDART 12080
#endif

typedef int cudnnStatus_t;

enum {
    OK = 0,
    NOT_INITIALIZED = 1001,
    BAD_PARAM = 2000,
    NULL_POINTER = 2002,
    MISALIGNED_POINTER = 2003,
    NOT_FINALIZED = 2004,
    SHAPE_MISMATCH = 2008,
    DUPLICATED_ENTRIES = 2009,
    ATTRIBUTE_TYPE = 2010,
    DESCRIPTOR_TYPE = 2012,
    NOT_SUPPORTED = 3000,
    GRAPH_PATTERN = 3001,
    NOT_SUPPORTED_SHAPE = 3002,
    INTERNAL_ERROR = 4000,
    EXECUTION_FAILED = 5000,
};

/* cudnnBackendDescriptorType_t */
enum { ENGINECFG = 3, ENGINEHEUR = 4, EXECUTION_PLAN = 5, OPERATIONGRAPH = 15, VARIANT_PACK = 16,
       TENSOR = 17, SDPA_FWD = 41 };
/* cudnnBackendAttributeType_t */
enum { T_HANDLE = 0, T_DATA_TYPE = 1, T_BOOLEAN = 2, T_INT64 = 3, T_VOID_PTR = 6, T_HEUR_MODE = 8,
       T_DESCRIPTOR = 15 };
/* cudnnDataType_t */
enum { DT_FLOAT = 0, DT_HALF = 2, DT_BFLOAT16 = 9 };
/* cudnnBackendAttributeName_t */
enum {
    A_HEUR_MODE = 200, A_HEUR_GRAPH = 201, A_HEUR_RESULTS = 202,
    A_CFG_WORKSPACE = 303,
    A_PLAN_HANDLE = 400, A_PLAN_CONFIG = 401, A_PLAN_WORKSPACE = 402,
    A_GRAPH_HANDLE = 800, A_GRAPH_OPS = 801,
    A_T_ALIGNMENT = 900, A_T_DATA_TYPE = 901, A_T_DIMS = 902, A_T_STRIDES = 903, A_T_UID = 906,
    A_T_VIRTUAL = 907, A_T_BY_VALUE = 908,
    A_PACK_UIDS = 1000, A_PACK_POINTERS = 1001, A_PACK_WORKSPACE = 1003,
    A_SDPA_Q = 2800, A_SDPA_K = 2801, A_SDPA_V = 2802, A_SDPA_O = 2803, A_SDPA_SCALE = 2805,
};

#define MAX_DIMS 8
#define MAX_PACK 16

struct handle {
    void *stream;
    unsigned long long state; /* device memory of the first execution, 0 before */
    int busy;                 /* a thread is in a call on the handle */
    unsigned long long *plan_memory; /* what plans loaded at their first execution */
    size_t plan_allocations;
};

struct desc {
    int type;
    bool finalized;
    /* TENSOR */
    int data_type, ndims, nstrides;
    int64_t dims[MAX_DIMS], strides[MAX_DIMS], uid, alignment;
    bool has_type, has_uid, has_alignment, is_virtual, by_value;
    /* SDPA_FWD: q, k, v, o, scale */
    struct desc *operand[5];
    /* OPERATIONGRAPH, EXECUTION_PLAN */
    struct handle *handle;
    struct desc *op;
    /* ENGINEHEUR, ENGINECFG */
    struct desc *graph;
    int mode;
    bool has_mode;
    /* EXECUTION_PLAN */
    struct desc *config;
    int64_t workspace;
    bool executed;
    unsigned long long memory; /* what it loaded at its first execution, freed with it */
    /* VARIANT_PACK */
    int npack, npointers;
    int64_t uids[MAX_PACK];
    void *pointers[MAX_PACK];
    void *workspace_ptr;
};

static unsigned long long executes, failed_executes, plans, live_descriptors, live_handles,
    held_plans;
static int hold_plans;

void iris_standin_cudnn_hold_plans(int on) { __atomic_store_n(&hold_plans, on, __ATOMIC_SEQ_CST); }
unsigned long long iris_standin_cudnn_held_plans(void) {
    return __atomic_load_n(&held_plans, __ATOMIC_SEQ_CST);
}

unsigned long long iris_standin_cudnn_executes(void) { return executes; }
unsigned long long iris_standin_cudnn_failed_executes(void) { return failed_executes; }
unsigned long long iris_standin_cudnn_plans(void) { return plans; }
unsigned long long iris_standin_cudnn_live_descriptors(void) { return live_descriptors; }
unsigned long long iris_standin_cudnn_live_handles(void) { return live_handles; }

/* The library's entry points run one at a time, as a real handle's calls must anyway. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static long long env_number(const char *name, long long fallback) {
    const char *value = getenv(name);
    return value && *value ? strtoll(value, NULL, 10) : fallback;
}

size_t cudnnGetVersion(void) {
    return (size_t)env_number("IRIS_STANDIN_CUDNN_VERSION", IRIS_STANDIN_CUDNN_VERSION);
}

size_t cudnnGetCudartVersion(void) {
    return (size_t)env_number("IRIS_STANDIN_CUDNN_CUDART", IRIS_STANDIN_CUDNN_CUDART);
}

const char *cudnnGetErrorString(cudnnStatus_t status) {
    switch (status) {
        case OK: return "CUDNN_STATUS_SUCCESS";
        case NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
        case BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
        case NULL_POINTER: return "CUDNN_STATUS_BAD_PARAM_NULL_POINTER";
        case MISALIGNED_POINTER: return "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER";
        case NOT_FINALIZED: return "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED";
        case SHAPE_MISMATCH: return "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH";
        case DUPLICATED_ENTRIES: return "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES";
        case ATTRIBUTE_TYPE: return "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE";
        case DESCRIPTOR_TYPE: return "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE";
        case NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
        case GRAPH_PATTERN: return "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN";
        case NOT_SUPPORTED_SHAPE: return "CUDNN_STATUS_NOT_SUPPORTED_SHAPE";
        case INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
        case EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
        default: return "CUDNN_STATUS_UNKNOWN";
    }
}

/* ---- device memory through the driver the process loaded (as cublas.c does) ---- */

typedef int (*mem_alloc_fn)(unsigned long long *, size_t);
typedef int (*mem_free_fn)(unsigned long long);

static cudnnStatus_t device_alloc(unsigned long long *out, size_t bytes) {
    mem_alloc_fn mem_alloc = (mem_alloc_fn)driver_symbol("cuMemAlloc_v2");
    if (!mem_alloc) return NOT_INITIALIZED;
    return mem_alloc(out, bytes) == 0 ? OK : INTERNAL_ERROR;
}

static void device_free(unsigned long long ptr) {
    mem_free_fn mem_free = (mem_free_fn)driver_symbol("cuMemFree_v2");
    if (mem_free && ptr) mem_free(ptr);
}

/* ---- handles ---- */

/* Live handles, so that a descriptor tied to a destroyed one is caught (a real library may
 * touch the handle when such a descriptor goes). */
#define MAX_HANDLES 64
static struct handle *handles[MAX_HANDLES];

static bool live(const struct handle *h) {
    for (int i = 0; i < MAX_HANDLES; i++)
        if (handles[i] == h) return true;
    return false;
}

cudnnStatus_t cudnnCreate(void **out) {
    if (!out) return NULL_POINTER;
    struct handle *h = calloc(1, sizeof *h);
    pthread_mutex_lock(&lock);
    int slot = 0;
    while (slot < MAX_HANDLES && handles[slot]) slot++;
    if (slot == MAX_HANDLES) {
        pthread_mutex_unlock(&lock);
        free(h);
        return INTERNAL_ERROR;
    }
    handles[slot] = h;
    pthread_mutex_unlock(&lock);
    *out = h;
    __atomic_add_fetch(&live_handles, 1, __ATOMIC_RELAXED);
    return OK;
}

cudnnStatus_t cudnnDestroy(void *handle) {
    struct handle *h = handle;
    if (!h) return NULL_POINTER;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_HANDLES; i++)
        if (handles[i] == h) handles[i] = NULL;
    pthread_mutex_unlock(&lock);
    device_free(h->state);
    for (size_t i = 0; i < h->plan_allocations; i++) device_free(h->plan_memory[i]);
    free(h->plan_memory);
    free(h);
    __atomic_sub_fetch(&live_handles, 1, __ATOMIC_RELAXED);
    return OK;
}

cudnnStatus_t cudnnSetStream(void *handle, void *stream) {
    if (!handle) return NULL_POINTER;
    ((struct handle *)handle)->stream = stream;
    return OK;
}

/* ---- descriptors ---- */

cudnnStatus_t cudnnBackendCreateDescriptor(int type, void **out) {
    if (!out) return NULL_POINTER;
    struct desc *d = calloc(1, sizeof *d);
    d->type = type;
    *out = d;
    __atomic_add_fetch(&live_descriptors, 1, __ATOMIC_RELAXED);
    return OK;
}

cudnnStatus_t cudnnBackendDestroyDescriptor(void *desc) {
    if (!desc) return NULL_POINTER;
    const struct desc *d = desc;
    pthread_mutex_lock(&lock);
    bool orphaned = d->handle && !live(d->handle);
    pthread_mutex_unlock(&lock);
    if (orphaned) {
        fprintf(stderr, "stand-in cuDNN: a descriptor of type %d destroyed after its handle\n",
                d->type);
        abort();
    }
    device_free(d->memory);
    free(desc);
    __atomic_sub_fetch(&live_descriptors, 1, __ATOMIC_RELAXED);
    return OK;
}

/* A referenced descriptor: finalized, of the kind the attribute takes. */
static cudnnStatus_t referenced(const void *values, int64_t count, int kind, struct desc **out) {
    if (count != 1) return BAD_PARAM;
    struct desc *d = *(struct desc *const *)values;
    if (!d) return NULL_POINTER;
    if (d->type != kind) return DESCRIPTOR_TYPE;
    if (!d->finalized) return NOT_FINALIZED;
    *out = d;
    return OK;
}

static cudnnStatus_t set_tensor(struct desc *d, int name, int type, int64_t count, const void *v) {
    switch (name) {
        case A_T_DATA_TYPE:
            if (type != T_DATA_TYPE) return ATTRIBUTE_TYPE;
            if (count != 1) return BAD_PARAM;
            d->data_type = *(const int *)v;
            d->has_type = true;
            return OK;
        case A_T_DIMS:
        case A_T_STRIDES:
            if (type != T_INT64) return ATTRIBUTE_TYPE;
            if (count < 1 || count > MAX_DIMS) return BAD_PARAM;
            memcpy(name == A_T_DIMS ? d->dims : d->strides, v, (size_t)count * sizeof(int64_t));
            *(name == A_T_DIMS ? &d->ndims : &d->nstrides) = (int)count;
            return OK;
        case A_T_UID:
        case A_T_ALIGNMENT:
            if (type != T_INT64) return ATTRIBUTE_TYPE;
            if (count != 1) return BAD_PARAM;
            if (name == A_T_UID) {
                d->uid = *(const int64_t *)v;
                d->has_uid = true;
            } else {
                d->alignment = *(const int64_t *)v;
                d->has_alignment = true;
            }
            return OK;
        case A_T_VIRTUAL:
        case A_T_BY_VALUE:
            if (type != T_BOOLEAN) return ATTRIBUTE_TYPE;
            if (count != 1) return BAD_PARAM;
            *(name == A_T_VIRTUAL ? &d->is_virtual : &d->by_value) = *(const bool *)v;
            return OK;
        default: return NOT_SUPPORTED;
    }
}

cudnnStatus_t cudnnBackendSetAttribute(void *desc, int name, int type, int64_t count,
                                       const void *values) {
    struct desc *d = desc;
    if (!d || (count > 0 && !values)) return NULL_POINTER;
    if (count < 0) return BAD_PARAM;
    pthread_mutex_lock(&lock);
    cudnnStatus_t status = NOT_SUPPORTED;
    if (d->finalized) {
        status = BAD_PARAM;
    } else if (d->type == TENSOR) {
        status = set_tensor(d, name, type, count, values);
    } else if (d->type == SDPA_FWD && name >= A_SDPA_Q && name <= A_SDPA_SCALE && name != 2804) {
        int slot = name == A_SDPA_SCALE ? 4 : name - A_SDPA_Q;
        status = type != T_DESCRIPTOR ? ATTRIBUTE_TYPE
                                      : referenced(values, count, TENSOR, &d->operand[slot]);
    } else if (d->type == OPERATIONGRAPH && name == A_GRAPH_HANDLE) {
        if (type != T_HANDLE) status = ATTRIBUTE_TYPE;
        else if (count != 1) status = BAD_PARAM;
        else if (!(d->handle = *(struct handle *const *)values)) status = NULL_POINTER;
        else status = OK;
    } else if (d->type == OPERATIONGRAPH && name == A_GRAPH_OPS) {
        /* The stand-in runs graphs of one attention operation. */
        if (type != T_DESCRIPTOR) status = ATTRIBUTE_TYPE;
        else if (count != 1) status = GRAPH_PATTERN;
        else {
            struct desc *op = *(struct desc *const *)values;
            status = !op ? NULL_POINTER
                     : !op->finalized ? NOT_FINALIZED
                     : op->type != SDPA_FWD ? GRAPH_PATTERN
                     : OK;
            if (status == OK) d->op = op;
        }
    } else if (d->type == ENGINEHEUR && name == A_HEUR_GRAPH) {
        status = type != T_DESCRIPTOR ? ATTRIBUTE_TYPE
                                      : referenced(values, count, OPERATIONGRAPH, &d->graph);
    } else if (d->type == ENGINEHEUR && name == A_HEUR_MODE) {
        if (type != T_HEUR_MODE) status = ATTRIBUTE_TYPE;
        else if (count != 1) status = BAD_PARAM;
        else {
            d->mode = *(const int *)values;
            d->has_mode = true;
            status = d->mode >= 0 && d->mode <= 3 ? OK : BAD_PARAM;
        }
    } else if (d->type == EXECUTION_PLAN && name == A_PLAN_HANDLE) {
        if (type != T_HANDLE) status = ATTRIBUTE_TYPE;
        else if (count != 1) status = BAD_PARAM;
        else if (!(d->handle = *(struct handle *const *)values)) status = NULL_POINTER;
        else status = OK;
    } else if (d->type == EXECUTION_PLAN && name == A_PLAN_CONFIG) {
        status = type != T_DESCRIPTOR ? ATTRIBUTE_TYPE
                                      : referenced(values, count, ENGINECFG, &d->config);
    } else if (d->type == VARIANT_PACK && name == A_PACK_UIDS) {
        if (type != T_INT64) status = ATTRIBUTE_TYPE;
        else if (count > MAX_PACK) status = BAD_PARAM;
        else {
            memcpy(d->uids, values, (size_t)count * sizeof(int64_t));
            d->npack = (int)count;
            status = OK;
        }
    } else if (d->type == VARIANT_PACK && name == A_PACK_POINTERS) {
        if (type != T_VOID_PTR) status = ATTRIBUTE_TYPE;
        else if (count > MAX_PACK) status = BAD_PARAM;
        else {
            memcpy(d->pointers, values, (size_t)count * sizeof(void *));
            d->npointers = (int)count;
            status = OK;
        }
    } else if (d->type == VARIANT_PACK && name == A_PACK_WORKSPACE) {
        if (type != T_VOID_PTR) status = ATTRIBUTE_TYPE;
        else if (count != 1) status = BAD_PARAM;
        else {
            d->workspace_ptr = *(void *const *)values;
            status = OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

/* The attention operation's rules (see the header comment). */
static cudnnStatus_t finalize_sdpa(struct desc *d) {
    for (int i = 0; i < 5; i++)
        if (!d->operand[i]) return BAD_PARAM;
    struct desc *q = d->operand[0], *k = d->operand[1], *v = d->operand[2], *o = d->operand[3];
    struct desc *scale = d->operand[4];
    for (int i = 0; i < 4; i++) {
        struct desc *t = d->operand[i];
        if (t->ndims != 4) return BAD_PARAM;
        if (t->data_type != DT_HALF && t->data_type != DT_BFLOAT16) return NOT_SUPPORTED;
        if (t->data_type != q->data_type) return BAD_PARAM;
        if (t->is_virtual || t->by_value) return BAD_PARAM;
        if (t->strides[3] != 1) return NOT_SUPPORTED;
        if (t->dims[0] != q->dims[0] || t->dims[1] != q->dims[1] || t->dims[3] != q->dims[3])
            return SHAPE_MISMATCH;
    }
    if (k->dims[2] != v->dims[2] || o->dims[2] != q->dims[2]) return SHAPE_MISMATCH;
    if (q->dims[3] % 8 != 0 || q->dims[3] > 256) return NOT_SUPPORTED_SHAPE;
    if (scale->data_type != DT_FLOAT || !scale->by_value) return BAD_PARAM;
    for (int i = 0; i < scale->ndims; i++)
        if (scale->dims[i] != 1) return BAD_PARAM;
    return OK;
}

static cudnnStatus_t finalize(struct desc *d) {
    switch (d->type) {
        case TENSOR:
            if (!d->has_type || !d->ndims || d->nstrides != d->ndims || !d->has_uid ||
                !d->has_alignment)
                return BAD_PARAM;
            if (d->alignment <= 0 || (d->alignment & (d->alignment - 1)) != 0) return BAD_PARAM;
            for (int i = 0; i < d->ndims; i++)
                if (d->dims[i] < 1 || d->strides[i] < 1) return BAD_PARAM;
            return OK;
        case SDPA_FWD: return finalize_sdpa(d);
        case OPERATIONGRAPH: {
            if (!d->handle || !d->op) return BAD_PARAM;
            /* Two different tensors with one id. */
            for (int i = 0; i < 5; i++)
                for (int j = i + 1; j < 5; j++) {
                    struct desc *a = d->op->operand[i], *b = d->op->operand[j];
                    if (a != b && a->uid == b->uid) return DUPLICATED_ENTRIES;
                }
            return OK;
        }
        case ENGINEHEUR: return d->graph && d->has_mode ? OK : BAD_PARAM;
        case ENGINECFG: return BAD_PARAM; /* only the heuristic fills one */
        case EXECUTION_PLAN:
            if (!d->handle || !d->config) return BAD_PARAM;
            if (d->handle != d->config->graph->handle) return BAD_PARAM;
            d->graph = d->config->graph;
            d->workspace = env_number("IRIS_STANDIN_CUDNN_WORKSPACE", 4096);
            __atomic_add_fetch(&plans, 1, __ATOMIC_RELAXED);
            return OK;
        case VARIANT_PACK: return d->npack == d->npointers && d->npack > 0 ? OK : BAD_PARAM;
        default: return NOT_SUPPORTED;
    }
}

/* Marks `h` in use by the calling thread; another thread in it aborts the process. */
static void enter_handle(struct handle *h) {
    if (h && __atomic_exchange_n(&h->busy, 1, __ATOMIC_SEQ_CST)) {
        fprintf(stderr, "stand-in cuDNN: a handle used by two threads at once\n");
        abort();
    }
}

static void leave_handle(struct handle *h) {
    if (h) __atomic_store_n(&h->busy, 0, __ATOMIC_SEQ_CST);
}

/* Waits while the tests' hold is on (see the top of this file). */
static void wait_for_hold(void) {
    if (!__atomic_load_n(&hold_plans, __ATOMIC_SEQ_CST)) return;
    __atomic_add_fetch(&held_plans, 1, __ATOMIC_SEQ_CST);
    for (int waited = 0; __atomic_load_n(&hold_plans, __ATOMIC_SEQ_CST); waited++) {
        if (waited == 60000) {
            fprintf(stderr, "stand-in cuDNN: a plan's finalizing waited 60 s on the hold\n");
            abort();
        }
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}

cudnnStatus_t cudnnBackendFinalize(void *desc) {
    struct desc *d = desc;
    if (!d) return NULL_POINTER;
    /* The handle the call works on, read before any other thread may change the graph. */
    struct handle *h = NULL;
    pthread_mutex_lock(&lock);
    if (d->type == OPERATIONGRAPH || d->type == EXECUTION_PLAN)
        h = d->handle;
    else if (d->type == ENGINEHEUR && d->graph)
        h = d->graph->handle;
    pthread_mutex_unlock(&lock);
    enter_handle(h);
    if (d->type == EXECUTION_PLAN) wait_for_hold();
    pthread_mutex_lock(&lock);
    cudnnStatus_t status = d->finalized ? BAD_PARAM : finalize(d);
    if (status == OK) d->finalized = true;
    pthread_mutex_unlock(&lock);
    leave_handle(h);
    return status;
}

cudnnStatus_t cudnnBackendGetAttribute(void *desc, int name, int type, int64_t requested,
                                       int64_t *count, void *values) {
    struct desc *d = desc;
    if (!d) return NULL_POINTER;
    if (!count) return NULL_POINTER;
    pthread_mutex_lock(&lock);
    cudnnStatus_t status = NOT_SUPPORTED;
    if (d->type == ENGINEHEUR && name == A_HEUR_RESULTS) {
        int64_t results = env_number("IRIS_STANDIN_CUDNN_NO_ENGINE", 0) == 1 ? 0 : 1;
        if (type != T_DESCRIPTOR) status = ATTRIBUTE_TYPE;
        else if (!d->finalized) status = NOT_FINALIZED;
        else if (requested < 0) status = BAD_PARAM;
        else if (requested == 0) {
            *count = results;
            status = OK;
        } else if (!values) {
            status = NULL_POINTER;
        } else {
            int64_t filled = requested < results ? requested : results;
            struct desc **configs = values;
            status = OK;
            for (int64_t i = 0; i < filled; i++) {
                if (!configs[i]) status = NULL_POINTER;
                else if (configs[i]->type != ENGINECFG) status = DESCRIPTOR_TYPE;
                else {
                    configs[i]->graph = d->graph;
                    configs[i]->finalized = true;
                }
            }
            if (status == OK) *count = filled;
        }
    } else if ((d->type == ENGINECFG && name == A_CFG_WORKSPACE) ||
               (d->type == EXECUTION_PLAN && name == A_PLAN_WORKSPACE)) {
        if (type != T_INT64) status = ATTRIBUTE_TYPE;
        else if (!d->finalized) status = NOT_FINALIZED;
        else if (requested < 1 || !values) status = BAD_PARAM;
        else {
            *(int64_t *)values = env_number("IRIS_STANDIN_CUDNN_WORKSPACE", 4096);
            *count = 1;
            status = OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

/* ---- execution ---- */

static double load(const void *p, int type, int64_t i) {
    uint16_t bits = ((const uint16_t *)p)[i];
    return type == DT_HALF ? f16_to_f32(bits) : bf16_to_f32(bits);
}

static void store(void *p, int type, int64_t i, double v) {
    ((uint16_t *)p)[i] = type == DT_HALF ? f32_to_f16((float)v) : f32_to_bf16((float)v);
}

/* The pack's pointer for `tensor`, checked against its alignment (host pointer when by value). */
static cudnnStatus_t operand(const struct desc *pack, const struct desc *tensor, void **out) {
    for (int i = 0; i < pack->npack; i++) {
        if (pack->uids[i] != tensor->uid) continue;
        if (!pack->pointers[i]) return BAD_PARAM;
        if (!tensor->by_value && ((uintptr_t)pack->pointers[i] % (uintptr_t)tensor->alignment) != 0)
            return MISALIGNED_POINTER;
        *out = pack->pointers[i];
        return OK;
    }
    return BAD_PARAM;
}

/* O[b,h,i,:] = sum_j softmax_j(scale * Q[b,h,i,:] . K[b,h,j,:]) V[b,h,j,:] */
static void attention(const struct desc *const t[4], void *const p[4], double scale) {
    const struct desc *q = t[0], *k = t[1], *v = t[2], *o = t[3];
    int64_t batch = q->dims[0], heads = q->dims[1], sq = q->dims[2], skv = k->dims[2];
    int64_t d = q->dims[3];
    int type = q->data_type;
    double *weights = malloc((size_t)skv * sizeof(double));
    double *row = malloc((size_t)d * sizeof(double));
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < heads; h++) {
            int64_t qb = b * q->strides[0] + h * q->strides[1];
            int64_t kb = b * k->strides[0] + h * k->strides[1];
            int64_t vb = b * v->strides[0] + h * v->strides[1];
            int64_t ob = b * o->strides[0] + h * o->strides[1];
            for (int64_t i = 0; i < sq; i++) {
                double max = -INFINITY, total = 0.0;
                for (int64_t j = 0; j < skv; j++) {
                    double dot = 0.0;
                    for (int64_t c = 0; c < d; c++)
                        dot += load(p[0], type, qb + i * q->strides[2] + c) *
                               load(p[1], type, kb + j * k->strides[2] + c);
                    weights[j] = scale * dot;
                    if (weights[j] > max) max = weights[j];
                }
                for (int64_t j = 0; j < skv; j++) {
                    weights[j] = exp(weights[j] - max);
                    total += weights[j];
                }
                for (int64_t c = 0; c < d; c++) row[c] = 0.0;
                for (int64_t j = 0; j < skv; j++)
                    for (int64_t c = 0; c < d; c++)
                        row[c] += weights[j] * load(p[2], type, vb + j * v->strides[2] + c);
                for (int64_t c = 0; c < d; c++)
                    store(p[3], type, ob + i * o->strides[2] + c, row[c] / total);
            }
        }
    }
    free(weights);
    free(row);
}

static cudnnStatus_t execute(struct handle *h, struct desc *plan, struct desc *pack) {
    if (!plan->finalized || !pack->finalized) return NOT_FINALIZED;
    if (plan->type != EXECUTION_PLAN || pack->type != VARIANT_PACK) return DESCRIPTOR_TYPE;
    if (plan->handle != h) return BAD_PARAM;
    const struct desc *op = plan->graph->op;
    const struct desc *tensors[4] = {op->operand[0], op->operand[1], op->operand[2],
                                     op->operand[3]};
    void *pointers[4], *scale;
    for (int i = 0; i < 4; i++) {
        cudnnStatus_t status = operand(pack, tensors[i], &pointers[i]);
        if (status != OK) return status;
    }
    cudnnStatus_t status = operand(pack, op->operand[4], &scale);
    if (status != OK) return status;
    if (context_failed()) return EXECUTION_FAILED;
    /* The stream's earlier work first: it may still write the operands (or read the workspace). */
    run_queued_work(h->stream);
    if (plan->workspace > 0) {
        if (!pack->workspace_ptr) return NULL_POINTER;
        memset(pack->workspace_ptr, 0xA5, (size_t)plan->workspace);
    }
    /* The handle's own state, then what the plan loads, at their first execution. */
    if (!h->state) {
        long long bytes = env_number("IRIS_STANDIN_CUDNN_LAZY_BYTES", 1 << 20);
        if (bytes > 0 && (status = device_alloc(&h->state, (size_t)bytes)) != OK) return status;
    }
    if (!plan->executed) {
        long long bytes = env_number("IRIS_STANDIN_CUDNN_PLAN_BYTES", 0);
        if (bytes > 0) {
            unsigned long long ptr = 0;
            if ((status = device_alloc(&ptr, (size_t)bytes)) != OK) return status;
            if (env_number("IRIS_STANDIN_CUDNN_PLAN_MEMORY_KEPT", 0) == 1) {
                h->plan_memory = realloc(h->plan_memory,
                                         (h->plan_allocations + 1) * sizeof(unsigned long long));
                h->plan_memory[h->plan_allocations++] = ptr;
            } else {
                plan->memory = ptr;
            }
        }
        plan->executed = true;
    }
    attention(tensors, pointers, *(const float *)scale);
    if (env_number("IRIS_STANDIN_CUDNN_WRONG", 0) == 1) {
        uint16_t *first = pointers[3];
        store(first, tensors[3]->data_type, 0, load(first, tensors[3]->data_type, 0) + 0.5);
    }
    __atomic_add_fetch(&executes, 1, __ATOMIC_RELAXED);
    return OK;
}

cudnnStatus_t cudnnBackendExecute(void *handle, void *plan, void *pack) {
    if (!handle || !plan || !pack) return NULL_POINTER;
    enter_handle(handle);
    pthread_mutex_lock(&lock);
    cudnnStatus_t status = execute(handle, plan, pack);
    if (status != OK) __atomic_add_fetch(&failed_executes, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&lock);
    leave_handle(handle);
    return status;
}
