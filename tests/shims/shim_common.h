/* Shared core of kvxfer's fake CUDA and HIP runtimes (test shims, host memory only).
 *
 * Copies are synchronous memmove calls; streams and events are small integer handles; event timestamps
 * come from CLOCK_MONOTONIC. Everything a test needs to assert is recorded in plain globals that Python
 * reads with ctypes (in_dll): per-call descriptor counts, numAttrs, whether failIdx was passed, the raw
 * 24-byte attribute records with their attrsIdxs, and an operation log of (op, a, b) triples.
 */
#ifndef KVXFER_SHIM_COMMON_H
#define KVXFER_SHIM_COMMON_H

#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define SHIM_MAX_CALLS 65536
#define SHIM_MAX_ATTRS 65536
#define SHIM_MAX_LOG 65536
#define SHIM_MAX_EVENTS 65536
#define SHIM_ATTR_BYTES 24

enum { OP_RECORD = 1, OP_WAIT = 2, OP_BATCH = 3, OP_COPY = 4, OP_SYNC = 5, OP_STREAM = 6,
       OP_REGISTER = 7, OP_UNREGISTER = 8 };

/* Controls (set from Python). */
long shim_version = 0;            /* what the version query reports */
int shim_version_fails = 0;       /* nonzero: the version query returns this error code */
long shim_fail_at = -1;           /* global descriptor index (since reset) at which a copy fails */
int shim_fail_code = 0;
long shim_max_count = 0;          /* > 0: a batch larger than this fails without copying (ROCm faults) */
int shim_max_count_code = 0;
int shim_reject_attrs_code = 0;   /* nonzero: batches with numAttrs > 0 fail with this code */
long shim_register_fail_at = -1;  /* host-register call index (since reset) that fails */
int shim_register_fail_code = 0;

/* Records (read from Python). */
long shim_descriptors = 0;
long shim_ncalls = 0;
size_t shim_call_count[SHIM_MAX_CALLS];
size_t shim_call_num_attrs[SHIM_MAX_CALLS];
int shim_call_has_fail_idx[SHIM_MAX_CALLS];
long shim_call_stream[SHIM_MAX_CALLS];
long shim_nattrs = 0;
unsigned char shim_attrs[SHIM_MAX_ATTRS][SHIM_ATTR_BYTES];
size_t shim_attr_idx[SHIM_MAX_ATTRS];
long shim_nlog = 0;
long shim_log[SHIM_MAX_LOG][3];
long shim_nregister = 0;
long shim_registered = 0;         /* currently registered ranges */

/* The version to report (tests set shim_version through ctypes before building a runtime). */
static long shim_reported_version(void) { return shim_version; }

static long shim_nstreams = 0;
static long shim_nevents = 0;
static double shim_event_time[SHIM_MAX_EVENTS];

void shim_reset(void) {
    shim_fail_at = -1; shim_fail_code = 0; shim_max_count = 0; shim_max_count_code = 0;
    shim_reject_attrs_code = 0; shim_register_fail_at = -1; shim_register_fail_code = 0; shim_version_fails = 0;
    shim_descriptors = 0; shim_ncalls = 0; shim_nattrs = 0; shim_nlog = 0; shim_nregister = 0; shim_registered = 0;
}

static void shim_log_op(long op, long a, long b) {
    if (shim_nlog < SHIM_MAX_LOG) {
        shim_log[shim_nlog][0] = op; shim_log[shim_nlog][1] = a; shim_log[shim_nlog][2] = b;
        shim_nlog++;
    }
}

static double shim_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static long shim_new_stream(void) { shim_log_op(OP_STREAM, shim_nstreams + 1, 0); return ++shim_nstreams; }
static long shim_new_event(void) { return shim_nevents < SHIM_MAX_EVENTS - 1 ? ++shim_nevents : -1; }

static int shim_event_ok(long ev) { return ev > 0 && ev <= shim_nevents; }

static void shim_record(long ev, long stream) {
    shim_event_time[ev] = shim_now();
    shim_log_op(OP_RECORD, ev, stream);
}

/* One batch: record it, apply the configured faults, then memmove descriptor by descriptor.
 * Returns 0 or an error code; on a descriptor fault *fail_idx (when given) is that descriptor's index in
 * the call, and the descriptors before it have been copied, as a real driver may do. */
static int shim_batch(void *const *dsts, void *const *srcs, const size_t *sizes, size_t count, const void *attrs,
                      const size_t *attrs_idxs, size_t num_attrs, size_t *fail_idx, long stream, int invalid) {
    if (shim_ncalls < SHIM_MAX_CALLS) {
        shim_call_count[shim_ncalls] = count;
        shim_call_num_attrs[shim_ncalls] = num_attrs;
        shim_call_has_fail_idx[shim_ncalls] = fail_idx != NULL;
        shim_call_stream[shim_ncalls] = stream;
    }
    shim_ncalls++;
    shim_log_op(OP_BATCH, stream, (long)count);
    for (size_t a = 0; a < num_attrs && shim_nattrs < SHIM_MAX_ATTRS; a++, shim_nattrs++) {
        memcpy(shim_attrs[shim_nattrs], (const unsigned char *)attrs + a * SHIM_ATTR_BYTES, SHIM_ATTR_BYTES);
        shim_attr_idx[shim_nattrs] = attrs_idxs[a];
    }
    if (fail_idx) *fail_idx = SIZE_MAX;
    if (count == 0 || !dsts || !srcs || !sizes) return invalid;
    if (shim_max_count > 0 && (long)count > shim_max_count) return shim_max_count_code;
    if (num_attrs > 0 && shim_reject_attrs_code) return shim_reject_attrs_code;
    if (num_attrs > count || (num_attrs > 0 && (!attrs || !attrs_idxs || attrs_idxs[0] != 0))) return invalid;
    for (size_t a = 0; a < num_attrs; a++) {
        int order;
        memcpy(&order, (const unsigned char *)attrs + a * SHIM_ATTR_BYTES, sizeof order);
        if (order < 1 || order > 3) return invalid;  /* INVALID (0) or out of the enum */
        if (a > 0 && attrs_idxs[a] <= attrs_idxs[a - 1]) return invalid;
        if (attrs_idxs[a] >= count) return invalid;
    }
    for (size_t i = 0; i < count; i++) {
        if (shim_descriptors == shim_fail_at) {
            shim_descriptors++;
            if (fail_idx) *fail_idx = i;
            return shim_fail_code;
        }
        memmove(dsts[i], srcs[i], sizes[i]);
        shim_descriptors++;
    }
    return 0;
}

static inline int shim_copy(void *dst, const void *src, size_t n, long stream) {
    shim_log_op(OP_COPY, stream, (long)n);
    if (shim_descriptors == shim_fail_at) {
        shim_descriptors++;
        return shim_fail_code;
    }
    memmove(dst, src, n);
    shim_descriptors++;
    return 0;
}

static inline int shim_register(void *p, size_t n) {
    shim_log_op(OP_REGISTER, (long)(uintptr_t)p, (long)n);
    if (shim_nregister++ == shim_register_fail_at) return shim_register_fail_code;
    shim_registered++;
    return 0;
}

static inline int shim_unregister(void *p) {
    shim_log_op(OP_UNREGISTER, (long)(uintptr_t)p, 0);
    shim_registered--;
    return 0;
}

#endif
