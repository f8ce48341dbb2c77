/*
 * A stand-in for cuBLAS and cuBLASLt (libcublas.so.N, libcublasLt.so.N) beside the stand-in
 * driver: the entry points the plugin calls, computing on the host (device memory is host
 * memory there) with the libraries' column-major conventions, in double precision.
 *
 * cublasGemmEx and cublasLtMatmul take f32, f16 and bf16 inputs with an f32 or same-type
 * output, alpha and beta; cublasLtMatmul also the DEFAULT, BIAS, GELU and GELU_BIAS epilogues
 * (GELU is the tanh form). Anything else is CUBLAS_STATUS_NOT_SUPPORTED. With
 * IRIS_STANDIN_LT_NO_ALGO=1 set, cuBLASLt's heuristic finds no algorithm for any problem (as it
 * does for layouts or alignments it does not take).
 *
 * iris_standin_lt_setups() counts cuBLASLt's set-up calls (descriptor, layout and preference
 * creation, heuristic queries), for tests of the plugin's cache of them.
 *
 * Each computation is ordered on its stream as on a GPU: before computing, cublasGemmEx runs the
 * queued work of its handle's stream (cublasSetStream_v2's; the legacy NULL stream until one is
 * set) and cublasLtMatmul that of its `stream` argument, and what that work waits for, through
 * the stand-in driver's iris_standin_flush_stream (found at run time in the libcuda.so.1 the
 * process loaded; with another driver, nothing is run). Without it, a product would read
 * operands the driver's deferred mode (IRIS_STANDIN_DEFER=1) has not copied in yet.
 *
 * Like the real libraries, a handle allocates device state of its own on its first computation
 * (cuBLAS's default workspace pool, lazily loaded kernels): IRIS_STANDIN_BLAS_LAZY_BYTES bytes
 * (2 MiB unless set; 0 turns it off) through the stand-in driver's cuMemAlloc, freed when the
 * handle is destroyed. The memory the plugin reports must account for it.
 *
 * A computation in a context the stand-in driver says faulted or destroyed fails with
 * CUBLAS_STATUS_EXECUTION_FAILED, as its kernel's launch would.
 *
 * iris_standin_gelu_epilogues() counts matmuls run with a GELU epilogue.
 *
 * iris_standin_math_mode() is the last mode given to cublasSetMathMode and
 * iris_standin_reduction_mask() the last CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK set (7, all
 * schemes, when none was), for tests of the one-rounding contract.
 *
 * Both report version IRIS_STANDIN_CUBLAS_VERSION (major * 10000 + minor * 100 + patch: a
 * compile-time define, 120400 unless given, so that a library built under CUDA 13's names can
 * say 130000), or the value of the environment variable of the same name.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "half.h"

#ifndef IRIS_STANDIN_CUBLAS_VERSION
#define IRIS_STANDIN_CUBLAS_VERSION 120400
#endif

static int standin_version(void) {
    const char *value = getenv("IRIS_STANDIN_CUBLAS_VERSION");
    return value && *value ? atoi(value) : IRIS_STANDIN_CUBLAS_VERSION;
}

static unsigned long long lt_setups;
static int math_mode;
static unsigned reduction_mask = 7;

static unsigned long long gelu_epilogues;

unsigned long long iris_standin_lt_setups(void) { return lt_setups; }
unsigned long long iris_standin_gelu_epilogues(void) { return gelu_epilogues; }
unsigned long long iris_standin_math_mode(void) { return (unsigned long long)math_mode; }
unsigned long long iris_standin_reduction_mask(void) { return reduction_mask; }

typedef int cublasStatus_t;
enum { OK = 0, NOT_INITIALIZED = 1, ALLOC_FAILED = 3, INVALID_VALUE = 7, EXECUTION_FAILED = 13,
       NOT_SUPPORTED = 15 };
enum { R_32F = 0, R_16F = 2, R_16BF = 14 };
enum { OP_N = 0, OP_T = 1 };
enum { EPI_DEFAULT = 1, EPI_BIAS = 4, EPI_GELU = 32, EPI_GELU_BIAS = 36 };

static double load(const void *p, int type, size_t i) {
    switch (type) {
        case R_32F: return ((const float *)p)[i];
        case R_16F: return f16_to_f32(((const uint16_t *)p)[i]);
        default: return bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

static void store(void *p, int type, size_t i, double v) {
    switch (type) {
        case R_32F: ((float *)p)[i] = (float)v; break;
        case R_16F: ((uint16_t *)p)[i] = f32_to_f16((float)v); break;
        default: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    }
}

static int known_type(int type) { return type == R_32F || type == R_16F || type == R_16BF; }

/* C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C (+ bias[i]), column-major. */
static void gemm(int ta, int tb, long m, long n, long k, double alpha, const void *a, int at,
                 long lda, const void *b, int bt, long ldb, double beta, const void *c, int ct,
                 long ldc, void *d, int dt, long ldd, const void *bias, int gelu) {
    for (long j = 0; j < n; j++) {
        for (long i = 0; i < m; i++) {
            double sum = 0.0;
            for (long l = 0; l < k; l++) {
                double x = load(a, at, ta == OP_N ? (size_t)(i + l * lda) : (size_t)(l + i * lda));
                double y = load(b, bt, tb == OP_N ? (size_t)(l + j * ldb) : (size_t)(j + l * ldb));
                sum += x * y;
            }
            double v = alpha * sum;
            if (beta != 0.0) v += beta * load(c, ct, (size_t)(i + j * ldc));
            if (bias) v += load(bias, dt, (size_t)i);
            if (gelu) v = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
            store(d, dt, (size_t)(i + j * ldd), v);
        }
    }
}

/* ---- cuBLAS ---- */

/* A handle, the device state it allocated on its first computation (0 until then), and the
 * stream its cuBLAS work is enqueued on (NULL, the legacy stream, until set). */
struct handle {
    unsigned long long state;
    void *stream;
};

typedef int (*mem_alloc_fn)(unsigned long long *, size_t);
typedef int (*mem_free_fn)(unsigned long long);

/* Allocates the handle's own device state through the driver the process loaded. */
static cublasStatus_t first_use(struct handle *h) {
    if (h->state) return OK;
    const char *value = getenv("IRIS_STANDIN_BLAS_LAZY_BYTES");
    size_t bytes = value && *value ? strtoull(value, NULL, 10) : (size_t)2 << 20;
    if (bytes == 0) return OK;
    mem_alloc_fn mem_alloc = (mem_alloc_fn)driver_symbol("cuMemAlloc_v2");
    if (!mem_alloc) return NOT_INITIALIZED;
    return mem_alloc(&h->state, bytes) == 0 ? OK : ALLOC_FAILED;
}

cublasStatus_t cublasCreate_v2(void **handle) {
    *handle = calloc(1, sizeof(struct handle));
    return OK;
}

cublasStatus_t cublasDestroy_v2(void *handle) {
    struct handle *h = handle;
    if (h && h->state) {
        mem_free_fn mem_free = (mem_free_fn)driver_symbol("cuMemFree_v2");
        if (mem_free) mem_free(h->state);
    }
    free(handle);
    return OK;
}

cublasStatus_t cublasSetMathMode(void *handle, int mode) {
    (void)handle;
    math_mode = mode;
    return OK;
}

cublasStatus_t cublasSetStream_v2(void *handle, void *stream) {
    if (!handle) return NOT_INITIALIZED;
    ((struct handle *)handle)->stream = stream;
    return OK;
}

/* libraryPropertyType: MAJOR_VERSION 0, MINOR_VERSION 1, PATCH_LEVEL 2. */
cublasStatus_t cublasGetProperty(int type, int *value) {
    int version = standin_version();
    switch (type) {
        case 0: *value = version / 10000; return OK;
        case 1: *value = version % 10000 / 100; return OK;
        case 2: *value = version % 100; return OK;
        default: return INVALID_VALUE;
    }
}

/* Both libraries refuse a workspace that is not 256-byte aligned (cuBLAS documents
 * CUBLAS_STATUS_INVALID_VALUE for cublasSetWorkspace). */
static int misaligned_workspace(const void *workspace, size_t bytes) {
    return bytes > 0 && ((uintptr_t)workspace & 255u) != 0;
}

cublasStatus_t cublasSetWorkspace_v2(void *handle, void *workspace, size_t bytes) {
    (void)handle;
    return misaligned_workspace(workspace, bytes) ? INVALID_VALUE : OK;
}

cublasStatus_t cublasGemmEx(void *handle, int ta, int tb, int m, int n, int k, const void *alpha,
                            const void *a, int at, int lda, const void *b, int bt, int ldb,
                            const void *beta, void *c, int ct, int ldc, int compute, int algo) {
    (void)compute;
    (void)algo;
    if (!known_type(at) || bt != at || (ct != at && ct != R_32F)) return NOT_SUPPORTED;
    if (m < 0 || n < 0 || k < 0 || lda < 1 || ldb < 1 || ldc < (m > 1 ? m : 1)) return INVALID_VALUE;
    cublasStatus_t status = first_use(handle);
    if (status != OK) return status;
    if (context_failed()) return EXECUTION_FAILED;
    run_queued_work(((struct handle *)handle)->stream);
    gemm(ta, tb, m, n, k, *(const float *)alpha, a, at, lda, b, bt, ldb, *(const float *)beta, c, ct,
         ldc, c, ct, ldc, NULL, 0);
    return OK;
}

/* ---- cuBLASLt ---- */

struct desc { int ta, tb; unsigned epilogue; const void *bias; };
struct layout { int type; uint64_t rows, cols; int64_t ld; };

cublasStatus_t cublasLtCreate(void **handle) { return cublasCreate_v2(handle); }
cublasStatus_t cublasLtDestroy(void *handle) { return cublasDestroy_v2(handle); }
size_t cublasLtGetVersion(void) { return (size_t)standin_version(); }

cublasStatus_t cublasLtMatmulDescCreate(void **out, int compute, int scale) {
    __atomic_add_fetch(&lt_setups, 1, __ATOMIC_RELAXED);
    (void)compute;
    if (scale != R_32F) return NOT_SUPPORTED;
    struct desc *d = calloc(1, sizeof *d);
    d->epilogue = EPI_DEFAULT;
    *out = d;
    return OK;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(void *desc, int attr, const void *buf, size_t size) {
    struct desc *d = desc;
    switch (attr) {
        case 3: if (size != 4) return INVALID_VALUE; d->ta = *(const int *)buf; return OK;
        case 4: if (size != 4) return INVALID_VALUE; d->tb = *(const int *)buf; return OK;
        case 7: if (size != 4) return INVALID_VALUE; d->epilogue = *(const unsigned *)buf; return OK;
        case 8: if (size != sizeof(void *)) return INVALID_VALUE; d->bias = *(const void *const *)buf; return OK;
        default: return NOT_SUPPORTED;
    }
}

cublasStatus_t cublasLtMatmulDescDestroy(void *desc) {
    free(desc);
    return OK;
}

cublasStatus_t cublasLtMatrixLayoutCreate(void **out, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    __atomic_add_fetch(&lt_setups, 1, __ATOMIC_RELAXED);
    if (!known_type(type)) return NOT_SUPPORTED;
    if (ld < (int64_t)(rows > 1 ? rows : 1)) return INVALID_VALUE;
    struct layout *l = calloc(1, sizeof *l);
    *l = (struct layout){type, rows, cols, ld};
    *out = l;
    return OK;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(void *layout) {
    free(layout);
    return OK;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(void **out) {
    __atomic_add_fetch(&lt_setups, 1, __ATOMIC_RELAXED);
    *out = calloc(1, 8);
    return OK;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(void *pref, int attr, const void *buf, size_t size) {
    (void)pref;
    /* CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, a uint32_t */
    if (attr == 3) {
        if (size != 4) return INVALID_VALUE;
        reduction_mask = *(const unsigned *)buf;
    }
    return OK;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(void *pref) {
    free(pref);
    return OK;
}

/* The heuristic result: a 64-byte algorithm, workspace size, state, waves, 4 reserved ints. */
struct heuristic { uint64_t algo[8]; size_t workspace; int state; float waves; int reserved[4]; };

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(void *handle, void *desc, void *a, void *b, void *c,
                                              void *d, void *pref, int requested,
                                              struct heuristic *results, int *count) {
    __atomic_add_fetch(&lt_setups, 1, __ATOMIC_RELAXED);
    (void)handle; (void)desc; (void)a; (void)b; (void)c; (void)d; (void)pref;
    if (requested < 1) return INVALID_VALUE;
    const char *no_algo = getenv("IRIS_STANDIN_LT_NO_ALGO");
    if (no_algo && strcmp(no_algo, "1") == 0) return NOT_SUPPORTED;
    memset(results, 0, sizeof *results);
    results->algo[0] = 42;
    results->waves = 1.0f;
    *count = 1;
    return OK;
}

cublasStatus_t cublasLtMatmul(void *handle, void *desc, const void *alpha, const void *a, void *ad,
                              const void *b, void *bd, const void *beta, const void *c, void *cd,
                              void *d, void *dd, const struct heuristic *algo, void *workspace,
                              size_t workspace_bytes, void *stream) {
    if (misaligned_workspace(workspace, workspace_bytes)) return INVALID_VALUE;
    cublasStatus_t status = first_use(handle);
    if (status != OK) return status;
    const struct desc *op = desc;
    const struct layout *la = ad, *lb = bd, *lc = cd, *ld = dd;
    if (!algo || algo->algo[0] != 42) return INVALID_VALUE;
    long m = (long)ld->rows, n = (long)ld->cols;
    long k = op->ta == OP_N ? (long)la->cols : (long)la->rows;
    long am = op->ta == OP_N ? (long)la->rows : (long)la->cols;
    long bk = op->tb == OP_N ? (long)lb->rows : (long)lb->cols;
    long bn = op->tb == OP_N ? (long)lb->cols : (long)lb->rows;
    if (am != m || bk != k || bn != n || lc->rows != ld->rows || lc->cols != ld->cols) return INVALID_VALUE;
    if (la->type != lb->type || lc->type != ld->type) return NOT_SUPPORTED;
    int with_bias = op->epilogue == EPI_BIAS || op->epilogue == EPI_GELU_BIAS;
    int gelu = op->epilogue == EPI_GELU || op->epilogue == EPI_GELU_BIAS;
    if (!with_bias && !gelu && op->epilogue != EPI_DEFAULT) return NOT_SUPPORTED;
    if (with_bias && !op->bias) return INVALID_VALUE;
    if (context_failed()) return EXECUTION_FAILED;
    if (gelu) __atomic_add_fetch(&gelu_epilogues, 1, __ATOMIC_RELAXED);
    run_queued_work(stream);
    gemm(op->ta, op->tb, m, n, k, *(const float *)alpha, a, la->type, la->ld, b, lb->type, lb->ld,
         *(const float *)beta, c, lc->type, lc->ld, d, ld->type, ld->ld, with_bias ? op->bias : NULL,
         gelu);
    return OK;
}
