/*
 * What the stand-in libraries (cublas.c, cudnn.c) take from the stand-in driver the process
 * loaded: its symbols, found at run time (the plugin loads the driver locally), and its queues,
 * which a library call runs up to itself as a GPU orders it on its stream.
 */
#ifndef IRIS_STANDIN_DRIVER_H
#define IRIS_STANDIN_DRIVER_H

#include <dlfcn.h>

/* A symbol of the driver the process loaded (locally, as the plugin loads it). */
static inline void *driver_symbol(const char *name) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return driver ? dlsym(driver, name) : NULL;
}

typedef void (*flush_stream_fn)(void *);

/* Runs the work queued on `stream` (and what it waits for) in the stand-in driver, as a GPU runs
 * it before a library call enqueued after it; nothing with a driver that has no queues. */
static inline void run_queued_work(void *stream) {
    static flush_stream_fn flush;
    flush_stream_fn found = __atomic_load_n(&flush, __ATOMIC_ACQUIRE);
    if (!found) {
        found = (flush_stream_fn)driver_symbol("iris_standin_flush_stream");
        __atomic_store_n(&flush, found, __ATOMIC_RELEASE);
    }
    if (found) found(stream);
}

typedef int (*context_error_fn)(void);

/* Whether the driver's context can no longer compute (it faulted, or is destroyed), in which
 * case a library's computation fails as a kernel launch in that context would; never with a
 * driver that does not say. */
static inline int context_failed(void) {
    static context_error_fn check;
    context_error_fn found = __atomic_load_n(&check, __ATOMIC_ACQUIRE);
    if (!found) {
        found = (context_error_fn)driver_symbol("iris_standin_context_error");
        __atomic_store_n(&check, found, __ATOMIC_RELEASE);
    }
    return found && found() != 0;
}

#endif
