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

/* The driver's `name`, looked up once into `*slot` (NULL: not there yet, or a driver without
 * it, which is looked for again). */
static inline void *cached_driver_symbol(void **slot, const char *name) {
    void *found = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!found) {
        found = driver_symbol(name);
        __atomic_store_n(slot, found, __ATOMIC_RELEASE);
    }
    return found;
}

/* Runs the work queued on `stream` (and what it waits for) in the stand-in driver, as a GPU runs
 * it before a library call enqueued after it; nothing with a driver that has no queues. */
static inline void run_queued_work(void *stream) {
    static void *flush;
    void (*found)(void *) =
        (void (*)(void *))cached_driver_symbol(&flush, "iris_standin_flush_stream");
    if (found) found(stream);
}

/* Whether the driver's context can no longer compute (it faulted, or is destroyed), in which
 * case a library's computation fails as a kernel launch in that context would; never with a
 * driver that does not say. */
static inline int context_failed(void) {
    static void *check;
    int (*found)(void) = (int (*)(void))cached_driver_symbol(&check, "iris_standin_context_error");
    return found && found() != 0;
}

#endif
