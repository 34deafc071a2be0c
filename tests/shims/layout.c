/* Prints sizeof/offsetof of CUmemcpyAttributes and CUmemLocation from cuda.h, one "name value" per line,
 * for comparison with kvxfer's ctypes structures. */
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>

int main(void) {
    printf("sizeof %zu\n", sizeof(CUmemcpyAttributes));
    printf("alignof %zu\n", _Alignof(CUmemcpyAttributes));
    printf("srcAccessOrder %zu\n", offsetof(CUmemcpyAttributes, srcAccessOrder));
    printf("srcLocHint %zu\n", offsetof(CUmemcpyAttributes, srcLocHint));
    printf("dstLocHint %zu\n", offsetof(CUmemcpyAttributes, dstLocHint));
    printf("flags %zu\n", offsetof(CUmemcpyAttributes, flags));
    printf("loc.sizeof %zu\n", sizeof(CUmemLocation));
    printf("loc.type %zu\n", offsetof(CUmemLocation, type));
    printf("loc.id %zu\n", offsetof(CUmemLocation, id));
    printf("enum.ANY %d\n", (int)CU_MEMCPY_SRC_ACCESS_ORDER_ANY);
    printf("enum.STREAM %d\n", (int)CU_MEMCPY_SRC_ACCESS_ORDER_STREAM);
    printf("enum.HOST %d\n", (int)CU_MEM_LOCATION_TYPE_HOST);
    printf("enum.DEVICE %d\n", (int)CU_MEM_LOCATION_TYPE_DEVICE);
    printf("enum.PREFER_OVERLAP %d\n", (int)CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE);
    return 0;
}
