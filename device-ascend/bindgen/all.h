// Every header iris binds, for the shared type definitions (sys/types.rs).
// Input of generate.sh; not compiled by the build.
#include "runtime.h"
#include "nnopbase.h"
#include "opapi.h"
