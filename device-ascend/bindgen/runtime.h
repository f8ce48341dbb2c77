// Headers of the AscendCL runtime (libacl_rt.so, formerly libascendcl.so) that iris uses.
// Input of generate.sh; not compiled by the build.
#include "acl/acl_base.h"
#include "acl/acl_rt.h"
