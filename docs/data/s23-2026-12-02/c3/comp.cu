// Does generic memory compression make zeroing an FP32 accumulator (and the first reduce-adds into it) cheaper?
// nvcc -O3 -arch=sm_90a comp.cu -lcuda -o comp
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); printf("%s: %s\n", #x, s); exit(1); } } while (0)
#define RK(x) do { cudaError_t r = (x); if (r != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(r)); exit(1); } } while (0)
__global__ void zero(float4* p, size_t n) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = make_float4(0, 0, 0, 0); }
__global__ void red(float* p, size_t n) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) atomicAdd(p + i, 1.0f); }
__global__ void rd(const float4* p, size_t n, float* out) { float s = 0; for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { float4 v = p[i]; s += v.x + v.y + v.z + v.w; } if (s == 12345.f) *out = s; }
__global__ void flush(float4* p, size_t n) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i].x += 1.0f; }
int main() {
    CK(cuInit(0)); RK(cudaSetDevice(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0));
    int comp = 0; CK(cuDeviceGetAttribute(&comp, CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED, dev));
    printf("generic compression supported: %d\n", comp);
    const size_t bytes = 134217728, n4 = bytes / 16, n = bytes / 4;
    float* plain; RK(cudaMalloc(&plain, bytes));
    float* other; RK(cudaMalloc(&other, 256 << 20));  // to push lines out of L2
    CUmemAllocationProp prop = {}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0; prop.allocFlags.compressionType = CU_MEM_ALLOCATION_COMP_GENERIC;
    size_t gran; CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    size_t sz = (bytes + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, sz, &prop, 0));
    CUmemAllocationProp got = {}; CK(cuMemGetAllocationPropertiesFromHandle(&got, h));
    printf("compression granted: %d (granularity %zu)\n", (int)got.allocFlags.compressionType, gran);
    CUdeviceptr va; CK(cuMemAddressReserve(&va, sz, 0, 0, 0)); CK(cuMemMap(va, sz, 0, h, 0));
    CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE; CK(cuMemSetAccess(va, sz, &acc, 1));
    float* cbuf = (float*)va;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    const int G = 132 * 8, T = 512;
    for (int which = 0; which < 2; ++which) {
        float* p = which ? cbuf : plain;
        float tz = 0, tr = 0, trd = 0, tzr = 0, ms;
        for (int rep = 0; rep < 12; ++rep) {
            flush<<<G, T>>>((float4*)other, (256 << 20) / 16);
            cudaEventRecord(a); zero<<<G, T>>>((float4*)p, n4); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b); if (rep >= 2) tz += ms;
            flush<<<G, T>>>((float4*)other, (256 << 20) / 16);  // the zeroed lines leave L2 (as in the backward)
            cudaEventRecord(a); red<<<G, T>>>(p, n); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b); if (rep >= 2) tr += ms;
            flush<<<G, T>>>((float4*)other, (256 << 20) / 16);
            cudaEventRecord(a); rd<<<G, T>>>((const float4*)p, n4, other); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b); if (rep >= 2) trd += ms;
            flush<<<G, T>>>((float4*)other, (256 << 20) / 16);
            cudaEventRecord(a); zero<<<G, T>>>((float4*)p, n4); red<<<G, T>>>(p, n); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b); if (rep >= 2) tzr += ms;
        }
        float chk = 0; RK(cudaMemcpy(&chk, p + 12345, 4, cudaMemcpyDeviceToHost));
        printf("%s: zero %.1f us | red.add after flush %.1f us | read %.1f us | zero+red back to back %.1f us | check %.1f\n",
               which ? "compressible" : "plain", tz * 100, tr * 100, trd * 100, tzr * 100, chk);
    }
    RK(cudaGetLastError());
    return 0;
}
