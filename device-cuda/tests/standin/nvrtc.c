/*
 * A stand-in for NVRTC (libnvrtc.so.N) beside the emulating stand-in driver: the entry points
 * the plugin calls. It compiles nothing: every program "compiles" to a small image the
 * emulating driver accepts (it runs the plugin's kernels from their C++ build and finds them
 * by name), so the plugin's path through NVRTC (version check, architecture choice, options,
 * the image it loads) runs without the real compiler.
 *
 * It reports version IRIS_STANDIN_NVRTC_MAJOR.0 (a compile-time define) and the architectures
 * of that major's NVRTC: CUDA 12's up to sm_90 (as 12.4 to 12.6), CUDA 13's from sm_75 to
 * sm_120 (13.0 dropped Maxwell, Pascal and Volta and knows Blackwell). Compiling for an
 * architecture outside the list fails with NVRTC_ERROR_INVALID_OPTION, as NVRTC does.
 * iris_standin_nvrtc_last_arch() is the architecture number of the last compilation (sm_XY or
 * compute_XY), for tests.
 */
#include <stdlib.h>
#include <string.h>

#ifndef IRIS_STANDIN_NVRTC_MAJOR
#define IRIS_STANDIN_NVRTC_MAJOR 12
#endif

enum { SUCCESS = 0, INVALID_INPUT = 3, INVALID_PROGRAM = 4, INVALID_OPTION = 5 };

#if IRIS_STANDIN_NVRTC_MAJOR >= 13
static const int archs[] = {75, 80, 86, 87, 89, 90, 100, 120};
#else
static const int archs[] = {70, 72, 75, 80, 86, 87, 89, 90};
#endif
static const int arch_count = (int)(sizeof(archs) / sizeof(archs[0]));
static const char cubin[] = "emulated cubin";
static const char ptx[] = "// emulated PTX";
static int last_arch;

int iris_standin_nvrtc_last_arch(void) { return last_arch; }

struct program { int ptx; };

int nvrtcVersion(int *major, int *minor) {
    *major = IRIS_STANDIN_NVRTC_MAJOR;
    *minor = 0;
    return SUCCESS;
}

int nvrtcGetNumSupportedArchs(int *count) {
    *count = arch_count;
    return SUCCESS;
}

int nvrtcGetSupportedArchs(int *out) {
    memcpy(out, archs, sizeof(archs));
    return SUCCESS;
}

int nvrtcCreateProgram(struct program **program, const char *source, const char *name,
                       int headers, const char *const *contents, const char *const *names) {
    (void)name;
    (void)contents;
    (void)names;
    if (!source || headers != 0) return INVALID_INPUT;
    *program = calloc(1, sizeof(struct program));
    return *program ? SUCCESS : INVALID_PROGRAM;
}

int nvrtcCompileProgram(struct program *program, int count, const char *const *options) {
    static const char option[] = "--gpu-architecture=";
    if (!program) return INVALID_PROGRAM;
    for (int i = 0; i < count; i++) {
        if (strncmp(options[i], option, sizeof(option) - 1) != 0) continue;
        const char *arch = options[i] + sizeof(option) - 1;
        program->ptx = strncmp(arch, "compute_", 8) == 0;
        int number = atoi(arch + (program->ptx ? 8 : 3));
        int known = 0;
        for (int j = 0; j < arch_count; j++) known |= archs[j] == number;
        if (!known) return INVALID_OPTION;
        last_arch = number;
    }
    return SUCCESS;
}

int nvrtcDestroyProgram(struct program **program) {
    free(*program);
    *program = NULL;
    return SUCCESS;
}

int nvrtcGetProgramLogSize(struct program *program, size_t *size) {
    (void)program;
    *size = 1;
    return SUCCESS;
}

int nvrtcGetProgramLog(struct program *program, char *log) {
    (void)program;
    log[0] = 0;
    return SUCCESS;
}

int nvrtcGetPTXSize(struct program *program, size_t *size) {
    (void)program;
    *size = sizeof(ptx);
    return SUCCESS;
}

int nvrtcGetPTX(struct program *program, char *out) {
    (void)program;
    memcpy(out, ptx, sizeof(ptx));
    return SUCCESS;
}

int nvrtcGetCUBINSize(struct program *program, size_t *size) {
    (void)program;
    *size = sizeof(cubin);
    return SUCCESS;
}

int nvrtcGetCUBIN(struct program *program, char *out) {
    (void)program;
    memcpy(out, cubin, sizeof(cubin));
    return SUCCESS;
}
