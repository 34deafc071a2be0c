/* Fake HIP runtime for kvxfer's tests: the exported names and C signatures of libamdhip64 that the HIP
 * executor and the pinning helper call, on host memory. The version is settable (hipRuntimeGetVersion can
 * also be made to fail); like ROCm, a batch above shim_max_count descriptors faults, and versions below
 * 7.13 reject numAttrs > 0 when shim_reject_attrs_code is set. */
#include "shim_common.h"

typedef int hipError_t;
typedef void *hipStream_t;
typedef void *hipEvent_t;
typedef struct { int type; int id; } hipMemLocation;
typedef struct { int srcAccessOrder; hipMemLocation srcLocHint; hipMemLocation dstLocHint; unsigned int flags; } hipMemcpyAttributes;
_Static_assert(sizeof(hipMemcpyAttributes) == SHIM_ATTR_BYTES, "hipMemcpyAttributes is 24 bytes");

#define hipSuccess 0
#define hipErrorInvalidValue 1
#define hipErrorInvalidResourceHandle 400

#define H(x) ((long)(uintptr_t)(x))

hipError_t hipRuntimeGetVersion(int *v) {
    if (shim_version_fails) return shim_version_fails;
    *v = (int)shim_reported_version();
    return hipSuccess;
}

hipError_t hipGetDeviceCount(int *n) { *n = 1; return hipSuccess; }
static int current_device = 0;
hipError_t hipSetDevice(int d) { if (d < 0 || d > 3) return 101; current_device = d; return hipSuccess; }  /* 101: hipErrorInvalidDevice */
hipError_t hipGetDevice(int *d) { *d = current_device; return hipSuccess; }

const char *hipGetErrorName(hipError_t e) {
    switch (e) {
    case 0: return "hipSuccess";
    case 1: return "hipErrorInvalidValue";
    case 2: return "hipErrorOutOfMemory";
    case 101: return "hipErrorInvalidDevice";
    case 400: return "hipErrorInvalidResourceHandle";
    case 600: return "hipErrorNotReady";
    case 700: return "hipErrorIllegalAddress";
    case 712: return "hipErrorHostMemoryAlreadyRegistered";
    default: return "hipErrorUnknown";
    }
}

hipError_t hipStreamCreateWithFlags(hipStream_t *s, unsigned int flags) { (void)flags; *s = (hipStream_t)(uintptr_t)shim_new_stream(); return hipSuccess; }
hipError_t hipStreamDestroy(hipStream_t s) { (void)s; return hipSuccess; }
hipError_t hipEventCreateWithFlags(hipEvent_t *e, unsigned int flags) {
    (void)flags;
    long h = shim_new_event();
    if (h < 0) return 2;
    *e = (hipEvent_t)(uintptr_t)h;
    return hipSuccess;
}
hipError_t hipEventDestroy(hipEvent_t e) { return shim_event_ok(H(e)) ? hipSuccess : hipErrorInvalidResourceHandle; }
hipError_t hipEventRecord(hipEvent_t e, hipStream_t s) {
    if (!shim_event_ok(H(e))) return hipErrorInvalidResourceHandle;
    shim_record(H(e), H(s));
    return hipSuccess;
}
hipError_t hipStreamWaitEvent(hipStream_t s, hipEvent_t e, unsigned int flags) {
    (void)flags;
    if (!shim_event_ok(H(e))) return hipErrorInvalidResourceHandle;
    shim_log_op(OP_WAIT, H(s), H(e));
    return hipSuccess;
}
hipError_t hipEventQuery(hipEvent_t e) { return shim_event_ok(H(e)) ? hipSuccess : hipErrorInvalidResourceHandle; }
hipError_t hipEventSynchronize(hipEvent_t e) {
    if (!shim_event_ok(H(e))) return hipErrorInvalidResourceHandle;
    shim_log_op(OP_SYNC, H(e), 0);
    return hipSuccess;
}
hipError_t hipEventElapsedTime(float *ms, hipEvent_t a, hipEvent_t b) {
    if (!shim_event_ok(H(a)) || !shim_event_ok(H(b))) return hipErrorInvalidResourceHandle;
    *ms = (float)((shim_event_time[H(b)] - shim_event_time[H(a)]) * 1e3);
    return hipSuccess;
}

hipError_t hipMemcpyAsync(void *dst, const void *src, size_t n, int kind, hipStream_t s) {
    if (kind != 4) return hipErrorInvalidValue;  /* kvxfer always passes hipMemcpyDefault */
    return shim_copy(dst, src, n, H(s));
}

hipError_t hipMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count, hipMemcpyAttributes *attrs,
                               size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, hipStream_t s) {
    return shim_batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, H(s), hipErrorInvalidValue);
}

hipError_t hipHostRegister(void *p, size_t n, unsigned int flags) { (void)flags; return shim_register(p, n); }
hipError_t hipHostUnregister(void *p) { return shim_unregister(p); }
