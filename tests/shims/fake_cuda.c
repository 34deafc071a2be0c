/* Fake CUDA driver entry points for kvxfer's tests: both cuMemcpyBatchAsync ABIs, cuMemcpyAsync, and the
 * stream/event calls the executor uses, resolved through a fake cuGetProcAddress that honours a settable
 * driver version (and returns success with a NULL pointer where an older driver would).
 *
 * Built with -DSHIM_WITH_CUDA_H when cuda.h is present: each fake is then assigned to the PFN_* typedef of
 * cudaTypedefs.h, so the compiler checks every prototype against NVIDIA's header. */
#include "shim_common.h"

#ifdef SHIM_WITH_CUDA_H
#include <cuda.h>
#include <cudaTypedefs.h>
#else
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct { int type; int id; } CUmemLocation;
typedef struct { int srcAccessOrder; CUmemLocation srcLocHint; CUmemLocation dstLocHint; unsigned int flags; } CUmemcpyAttributes;
typedef int CUdriverProcAddressQueryResult;
#endif

#define E_OK 0
#define E_INVALID_VALUE 1
#define E_INVALID_HANDLE 400

int shim_null_batch = 0;  /* nonzero: cuGetProcAddress("cuMemcpyBatchAsync") returns success with NULL */

#define H(x) ((long)(uintptr_t)(x))

CUresult fake_cuDriverGetVersion(int *v) {
    if (shim_version_fails) return (CUresult)shim_version_fails;
    *v = (int)shim_reported_version();
    return E_OK;
}

CUresult fake_cuGetErrorName(CUresult code, const char **name) {
    switch ((int)code) {
    case 0: *name = "CUDA_SUCCESS"; return E_OK;
    case 1: *name = "CUDA_ERROR_INVALID_VALUE"; return E_OK;
    case 2: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return E_OK;
    case 400: *name = "CUDA_ERROR_INVALID_HANDLE"; return E_OK;
    case 600: *name = "CUDA_ERROR_NOT_READY"; return E_OK;
    case 700: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; return E_OK;
    case 801: *name = "CUDA_ERROR_NOT_SUPPORTED"; return E_OK;
    default: *name = NULL; return E_INVALID_VALUE;
    }
}

CUresult fake_cuStreamCreate(CUstream *s, unsigned int flags) { (void)flags; *s = (CUstream)(uintptr_t)shim_new_stream(); return E_OK; }
CUresult fake_cuStreamDestroy(CUstream s) { (void)s; return E_OK; }

CUresult fake_cuEventCreate(CUevent *e, unsigned int flags) {
    (void)flags;
    long h = shim_new_event();
    if (h < 0) return 2;
    *e = (CUevent)(uintptr_t)h;
    return E_OK;
}
CUresult fake_cuEventDestroy(CUevent e) { return shim_event_ok(H(e)) ? E_OK : E_INVALID_HANDLE; }
CUresult fake_cuEventRecord(CUevent e, CUstream s) {
    if (!shim_event_ok(H(e))) return E_INVALID_HANDLE;
    shim_record(H(e), H(s));
    return E_OK;
}
CUresult fake_cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags) {
    (void)flags;
    if (!shim_event_ok(H(e))) return E_INVALID_HANDLE;
    shim_log_op(OP_WAIT, H(s), H(e));
    return E_OK;
}
CUresult fake_cuEventQuery(CUevent e) { return shim_event_ok(H(e)) ? E_OK : E_INVALID_HANDLE; }
CUresult fake_cuEventSynchronize(CUevent e) {
    if (!shim_event_ok(H(e))) return E_INVALID_HANDLE;
    shim_log_op(OP_SYNC, H(e), 0);
    return E_OK;
}
CUresult fake_cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    if (!shim_event_ok(H(a)) || !shim_event_ok(H(b))) return E_INVALID_HANDLE;
    *ms = (float)((shim_event_time[H(b)] - shim_event_time[H(a)]) * 1e3);
    return E_OK;
}

CUresult fake_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return (CUresult)shim_copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, H(s));
}

CUresult fake_cuMemcpyBatchAsync_v12080(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                        CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                                        size_t *failIdx, CUstream s) {
    return (CUresult)shim_batch((void *const *)dsts, (void *const *)srcs, sizes, count, attrs, attrsIdxs, numAttrs,
                                failIdx, H(s), E_INVALID_VALUE);
}

CUresult fake_cuMemcpyBatchAsync_v13000(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                        CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream s) {
    return (CUresult)shim_batch((void *const *)dsts, (void *const *)srcs, sizes, count, attrs, attrsIdxs, numAttrs,
                                NULL, H(s), E_INVALID_VALUE);
}

/* Like the driver: a request above the driver's version is invalid; an unknown or unsupported symbol is
 * success with *pfn = NULL. */
CUresult fake_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                               CUdriverProcAddressQueryResult *status) {
    (void)flags;
    if (status) *status = 0;
    *pfn = NULL;
    long version = shim_reported_version();
    if (cudaVersion > version) return E_INVALID_VALUE;
    static const struct { const char *name; void *fn; } table[] = {
        {"cuGetErrorName", (void *)fake_cuGetErrorName},
        {"cuStreamCreate", (void *)fake_cuStreamCreate},
        {"cuStreamDestroy", (void *)fake_cuStreamDestroy},
        {"cuEventCreate", (void *)fake_cuEventCreate},
        {"cuEventDestroy", (void *)fake_cuEventDestroy},
        {"cuEventRecord", (void *)fake_cuEventRecord},
        {"cuStreamWaitEvent", (void *)fake_cuStreamWaitEvent},
        {"cuEventQuery", (void *)fake_cuEventQuery},
        {"cuEventSynchronize", (void *)fake_cuEventSynchronize},
        {"cuEventElapsedTime", (void *)fake_cuEventElapsedTime},
        {"cuMemcpyAsync", (void *)fake_cuMemcpyAsync},
    };
    if (strcmp(symbol, "cuMemcpyBatchAsync") == 0) {
        if (shim_null_batch || version < 12080 || cudaVersion < 12080) return E_OK;
        *pfn = cudaVersion >= 13000 ? (void *)fake_cuMemcpyBatchAsync_v13000 : (void *)fake_cuMemcpyBatchAsync_v12080;
        return E_OK;
    }
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(symbol, table[i].name) == 0) { *pfn = table[i].fn; return E_OK; }
    return E_OK;
}

#ifdef SHIM_WITH_CUDA_H
/* Prototype checks: each assignment fails to compile (-Werror) if a fake's signature differs from the header's. */
static PFN_cuMemcpyBatchAsync_v12080 check_batch_12080 __attribute__((used)) = fake_cuMemcpyBatchAsync_v12080;
static PFN_cuMemcpyBatchAsync_v13000 check_batch_13000 __attribute__((used)) = fake_cuMemcpyBatchAsync_v13000;
static PFN_cuMemcpyAsync_v4000 check_memcpy __attribute__((used)) = fake_cuMemcpyAsync;
static PFN_cuGetProcAddress_v12000 check_proc __attribute__((used)) = fake_cuGetProcAddress;
static PFN_cuEventRecord_v2000 check_record __attribute__((used)) = fake_cuEventRecord;
static PFN_cuStreamWaitEvent_v3020 check_wait __attribute__((used)) = fake_cuStreamWaitEvent;
static PFN_cuEventElapsedTime_v12080 check_elapsed __attribute__((used)) = fake_cuEventElapsedTime;
static PFN_cuEventCreate_v2000 check_event __attribute__((used)) = fake_cuEventCreate;
static PFN_cuStreamCreate_v2000 check_stream __attribute__((used)) = fake_cuStreamCreate;
static PFN_cuGetErrorName_v6000 check_name __attribute__((used)) = fake_cuGetErrorName;
static PFN_cuDriverGetVersion_v2020 check_version __attribute__((used)) = fake_cuDriverGetVersion;
_Static_assert(sizeof(CUmemcpyAttributes) == SHIM_ATTR_BYTES, "CUmemcpyAttributes is 24 bytes");
#endif
