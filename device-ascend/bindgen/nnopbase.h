// Headers of the aclnn base library (libnnopbase.so): tensors, scalars, int arrays, executors.
// Input of generate.sh; not compiled by the build.
#include "aclnn/acl_meta.h"
#include "aclnn/aclnn_base.h"
