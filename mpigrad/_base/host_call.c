/* A compiled step's call back into Python: MindSpore's aot Custom op (its CPU calling
 * convention: every input's, then every output's memory, dimension count, shape and dtype
 * name) calls host_call in place of a kernel, which hands the step's own buffers to the
 * callback mpigrad set with set_host_call (a ctypes callback: it takes the GIL itself).
 * No copy in or out, unlike a host call that receives and returns arrays. Returns the
 * callback's status (0: done; any other: MindSpore raises), 1 with no callback set. */
#include <stdint.h>

typedef int (*host_callback)(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **dtypes);

static host_callback callback;

void set_host_call(host_callback given) { callback = given; }

int host_call(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
              void *stream, void *extra) {
    (void)stream;
    (void)extra;
    return callback ? callback(nparam, params, ndims, shapes, dtypes) : 1;
}
