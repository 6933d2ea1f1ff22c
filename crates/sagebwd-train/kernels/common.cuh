// Shared device helpers of the training-step kernels: types, BF16 conversion, warp and block
// reductions, and the addressing of "rows" that are head vectors inside token rows.
//
// Like the attention kernels, these need no CUDA header (NVRTC provides built-ins, math functions
// and atomics). BF16 tensors are passed as raw `u16` bits.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Two FP32 values rounded to BF16 (nearest even; NaN stays NaN), `lo` in the low half: one
// cvt.rn.bf16x2.f32 (sm_80+), where rounding by integer arithmetic took ~5 instructions per value
// and made the small per-token kernels (heads, SwiGLU) instruction-bound.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u16 f32_to_bf16(float x) { return (u16)pack_bf16x2(x, 0.0f); }

template <class Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

struct SumOp {
    __device__ static float identity() { return 0.0f; }
    __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
    __device__ static float identity() { return -__int_as_float(0x7f800000); }
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp()); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, MaxOp()); }

// Block-wide reduction for blocks of up to 1024 threads; `scratch` holds 32 floats. Every thread
// gets the result. The order of the operations is fixed, so results are reproducible.
template <class Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch, Op op) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : Op::identity();
    return warp_reduce(v, op);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce(v, scratch, SumOp()); }
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce(v, scratch, MaxOp()); }

