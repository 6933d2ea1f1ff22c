// Hopper (sm_90a) helpers: warpgroup matrix multiply (wgmma) wrappers, shared-memory matrix
// descriptors and the 128/64-byte swizzles they read, proxy fences. Everything here exists only
// when compiling for sm_90a (`__CUDA_ARCH_FEAT_SM90_ALL`); sm_80 compiles see an empty header.
//
// Descriptor layout (PTX ISA, "Matrix Descriptor Format"): bits 0–13 start address >> 4, 16–29
// leading-dimension byte offset >> 4 (unused by the K-major swizzled layouts here, set to 1),
// 32–45 stride byte offset >> 4 (distance between 8-row groups), 62–63 swizzle mode (1 = 128 B,
// 2 = 64 B). The swizzle is applied by the hardware to address bits: 16-byte chunk bits [4, 7) (or
// [4, 6)) XOR-ed with bits [7, 10) (or [7, 9)), so a tile must start on a 1024-byte boundary and the
// k-step of 32 bytes inside a row is an advance of the start address by 32 (2 in descriptor units).
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SAGE_WGMMA 1

#define SWIZZLE_128B 1
#define SWIZZLE_64B 2

// Byte offset (from a 1024-aligned tile start) where logical offset `off` of a K-major tile with
// rows of `row_bytes` (128 or 64) lives under the matching swizzle mode.
__device__ __forceinline__ u32 swizzled_offset(u32 off, int row_bytes) {
    const u32 mask = row_bytes == 128 ? 7u : 3u;
    return off ^ (((off >> 7) & mask) << 4);
}

// Descriptor of a K-major tile at shared address `addr` (1024-aligned) with rows of `row_bytes`
// bytes (128 → 128-byte swizzle, 64 → 64-byte swizzle); 8-row groups are 8·row_bytes apart.
__device__ __forceinline__ u64 kmajor_desc(u32 addr, int row_bytes) {
    const u64 mode = row_bytes == 128 ? SWIZZLE_128B : SWIZZLE_64B;
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)((8 * row_bytes) >> 4) << 32) | (mode << 62);
}

// Orders this thread's earlier register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Shared memory written through the generic proxy (st.shared, cp.async) becomes visible to the
// async proxy (wgmma operand reads) only after this fence in each writing thread (then a barrier).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (+)= a·B, m64n128k32, s8 × s8 → s32 (exact); A from registers (the m16n8k32 A layout per warp),
// B = 128 rows × 32 bytes, K-major, through the descriptor; accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_s8_rs_n128(int (&d)[64], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// d (+)= a·B, m64n64k32, s8 × s8 → s32 (exact); A from registers (the m16n8k32 A layout per warp),
// B = 64 rows × 32 bytes, K-major, through the descriptor; accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_s8_rs_n64(int (&d)[32], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// d (+)= a·B, m64n128k32, e4m3 × e4m3 → f32 (the tensor core's FP32 sum, ALGORITHM.md §10.5); A from registers (the
// m16n8k32 A layout per warp, as the s8 form), B = 128 rows × 32 bytes, K-major, through the descriptor; accumulate = 0
// starts a fresh sum.
__device__ __forceinline__ void wgmma_e4m3_rs_n128(float (&d)[64], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// d (+)= a·B, m64n64k32, e4m3 × e4m3 → f32 (the tensor core's FP32 sum, ALGORITHM.md §10.5); A from registers (the
// m16n8k32 A layout per warp, as the s8 form), B = 64 rows × 32 bytes, K-major, through the descriptor; accumulate = 0
// starts a fresh sum.
__device__ __forceinline__ void wgmma_e4m3_rs_n64(float (&d)[32], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// d (+)= A·B, m64n128k32, s8 × s8 → s32 (exact); A = 64 rows × 32 bytes and B = 128 rows × 32 bytes,
// both K-major in shared memory, through descriptors; accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_s8_ss_n128(int (&d)[64], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
// ---------------------------------------------------------------------------------------------
// Warp specialization (forward): mbarriers, the TMA tile load, register reallocation and
// named barriers. An mbarrier is 8 bytes of shared memory (8-byte aligned), addressed by its
// shared-space address; its phase completes when `count` arrivals and the expected transaction
// bytes (TMA) have all come in; waiters poll the parity of the phase they wait for.

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized mbarriers visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival (release: this thread's earlier shared-memory writes are visible to the waiters).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// Blocks until the phase with parity `parity` has completed (acquire).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// TMA: the box of a 2-D tensor map (a CUtensorMap in parameter space: a __grid_constant__ kernel
// parameter) at coordinates (c0 innermost, c1) into shared memory at dst
// (1024-aligned for the 128-byte swizzle), completing `bytes` transactions on mbarrier bar.
__device__ __forceinline__ void tma_load_2d(u32 dst, const void* map, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)map) : "memory");
}

// Register reallocation between warpgroups (whole warpgroup, same value): the producer gives
// registers back, the consumers take them.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Named barriers (ids 1..15; 0 is __syncthreads): sync waits until `threads` threads have arrived
// (this warp included), arrive only signals.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// backward (wgbwd)
// The backward's transposed tiles Sᵀ = K̂ Q̂ᵀ and dPᵀ = V dOᵀ: 64 keys (the warpgroup's) × 64 query
// rows, both operands K-major in shared memory. The accumulator d[nt][e] is the m16n8 C fragment
// of n-tile nt of the warp's 16 rows, exactly the layout of the mma.sync path's acc[nt][e].
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= A·B, m64n64k32, s8 × s8 → s32 (exact); accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_s8_ss_n64(int (&d)[8][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]), "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]), "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]), "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]), "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// Pins accumulator registers at this point (call it right after wgmma_wait): an empty volatile asm
// that "rewrites" each register is ordered after the wait (volatile asm keeps its order), so no
// read of the accumulators can be scheduled before the results have landed.
template <int R, int C>
__device__ __forceinline__ void wgmma_fence_regs(int (&d)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}
template <int R, int C>
__device__ __forceinline__ void wgmma_fence_regs(float (&d)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}

// d (+)= A·B, m64n64k16, bf16 × bf16 → f32 (FP32 sums in the hardware's order); both operands
// K-major (transpose flags 0), no negation; accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_bf16_ss_n64(float (&d)[8][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// d (+)= a·B, m64n32k32, s8 × s8 → s32 (exact); A from registers (the m16n8k32 A layout per warp),
// B = 32 rows × 32 bytes, K-major, through the descriptor; accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_s8_rs_n32(int (&d)[4][4], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// d (+)= A·B, m64n32k32, s8 × s8 → s32 (exact); A and B K-major in shared memory.
__device__ __forceinline__ void wgmma_s8_ss_n32(int (&d)[4][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_s8_ss(int (&d)[8][4], u64 a_desc, u64 b_desc, int accumulate) {
    wgmma_s8_ss_n64(d, a_desc, b_desc, accumulate);
}
__device__ __forceinline__ void wgmma_s8_ss(int (&d)[4][4], u64 a_desc, u64 b_desc, int accumulate) {
    wgmma_s8_ss_n32(d, a_desc, b_desc, accumulate);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// fpa forward (fpafwd)
// BF16 wgmma for the warp-specialized fpa forward (forward.cu, sage_fwd_sm90_bf16_pairs): S = Q Kᵀ with
// both operands K-major in shared memory, and O_block = P V with P from registers and V natural
// [key][d], i.e. an N-major B operand (transpose bit 1), which 16-bit wgmma supports.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= A·B, m64n128k16, bf16 × bf16 → f32; A and B K-major in shared memory; accumulate = 0
// starts a fresh sum.
__device__ __forceinline__ void wgmma_bf16_ss_n128(float (&d)[16][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// d (+)= a·B, m64n128k16, bf16 × bf16 → f32 (FP32 sums in the hardware's order); A from registers
// (the m16n8k16 A fragment of the warp's 16 rows), B N-major (transpose bit 1) through the
// descriptor; accumulate = 0 starts a fresh sum. d: 16 rows of 4 accumulators (an array or a chunk
// of a larger one).
__device__ __forceinline__ void wgmma_bf16_rs_n128_tb(float (*d)[4], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// The same, m64n64k16 (d = 64, or one 64-column half at d = 128).
__device__ __forceinline__ void wgmma_bf16_rs_n64_tb(float (*d)[4], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// TMA: the box of a 3-D tensor map at coordinates (c0 innermost, c1, c2) into shared memory at dst,
// completing its bytes on mbarrier bar (boxes past the tensor's ends are zero-filled).
__device__ __forceinline__ void tma_load_3d(u32 dst, const void* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// The same for a 5-D tensor map (coordinates c0 innermost .. c4).
__device__ __forceinline__ void tma_load_5d(u32 dst, const void* map, int c0, int c1, int c2, int c3, int c4, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
        "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
        : "memory");
}
// Bulk async-groups (cp.async.bulk / cp.reduce.async.bulk) of this thread: close the open group; wait until every
// earlier group has read its shared source (the source may be rewritten); wait until they have completed (their
// global writes done: before the CTA exits).
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// FP32 add of the shared box at src into a 4-D tensor map at {c0, c1, c2, c3}, issued by one lane of the (converged)
// warp that elect.sync picks, in the bulk async-group of that thread (the caller commits).
__device__ __forceinline__ void tma_reduce_add_4d_elect(const void* map, int c0, int c1, int c2, int c3, u32 src) {
    asm volatile("{\n.reg .pred e;\nelect.sync _|e, 0xffffffff;\n"
                 "@e cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 "}\n" ::"l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
                 : "memory");
}
// The shared box at src stored to a 3-D tensor map at {c0, c1, c2} (coordinates past the map's extents are not
// written), issued by one lane of the (converged) warp that elect.sync picks, in the bulk async-group of that thread
// (the caller commits).
__device__ __forceinline__ void tma_store_3d_elect(const void* map, int c0, int c1, int c2, u32 src) {
    asm volatile("{\n.reg .pred e;\nelect.sync _|e, 0xffffffff;\n"
                 "@e cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 "}\n" ::"l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(src)
                 : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// fpa backward (fpabwd)
// BF16 products of the fpa backward on wgmma whose B operand is read MN-major (the reduction runs over
// the tile's rows, the N columns are contiguous): dV += bf16(P)ᵀ dO and dK += bf16(dS)ᵀ Q take B straight
// from the [64 rows][d] dO / Q tiles that Sᵀ and dPᵀ read K-major, so no transposed copy is staged.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor of an MN-major tile at `addr` (1024-aligned) in the 128-byte swizzle: 8 rows of the
// reduction dimension × 128 bytes (64 BF16 of N) per atom; 8-row groups 1024 bytes apart (stride
// byte offset), successive 64-column atoms `atom_stride` bytes apart (leading byte offset).
__device__ __forceinline__ u64 mnmajor_desc(u32 addr, u32 atom_stride) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((atom_stride >> 4) & 0x3FFF) << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)SWIZZLE_128B << 62);
}

// Pins accumulator registers reached through a pointer (see wgmma_fence_regs).
template <int R>
__device__ __forceinline__ void wgmma_fence_rows(float (*d)[4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// fpa dQ = bf16(dS) K on wgmma: A = bf16(dS)ᵀ [keys][rows] and B = K [keys][d] are both MN-major in
// shared memory (transpose flags 1, 1).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= A·B, m64n32k16, bf16 × bf16 → f32, A and B MN-major; accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_bf16_ss_tt_n32(float (&d)[4][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
// d (+)= A·B, m64n64k16, bf16 × bf16 → f32, A and B MN-major; accumulate = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_bf16_ss_tt_n64(float (&d)[8][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// fpabwd10: fewer instructions in the fpa backward tile: guarded dQ reductions, dS stores by
// stmatrix, wgmma descriptors advanced per k-step by one add.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// *addr += {x, y} as red_add_f32x2 on sm_90, only where `pred`, with the predicate inside the asm: a C
// `if` around the asm became a BSSY/BRA/BSYNC triple per reduction, this a single predicated branch.
__device__ __forceinline__ void red_add_f32x2_if(bool pred, float* addr, float x, float y) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p red.global.add.v2.f32 [%1], {%2, %3};\n}\n"
                 ::"r"((int)pred), "l"(addr), "f"(x), "f"(y) : "memory");
}
// Four 8 × 8 b16 matrices to shared memory: register i of each lane holds matrix i in the mma
// fragment layout (row lane / 4, columns 2·(lane mod 4), + 1; the lower column at the lower
// address); lane l gives the address of row l mod 8 of matrix l / 8 (16 bytes).
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// A wgmma descriptor as its two 32-bit words, so that the k-steps of one operand tile are one 32-bit
// add each (to the start address, bits 0–13 of lo) instead of the whole descriptor recomputed from
// the address. The add cannot carry out of the field: shared addresses stay below 256 KB.
struct DescWords {
    u32 lo, hi;
    // The descriptor of the same tile `bytes` (a multiple of 16) further on.
    __device__ __forceinline__ u64 at(u32 bytes) const { return ((u64)hi << 32) | (u64)(lo + (bytes >> 4)); }
};
__device__ __forceinline__ DescWords desc_words(u64 desc) { return {(u32)desc, (u32)(desc >> 32)}; }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The INT8 backward's dŜ tile by stmatrix at d = 64 (StagedSage, staged/backward_int8.cu).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// stmatrix_x4 with .trans: lane (g, t)'s register i goes to matrix i transposed, its lower 16 bits
// to memory row 2t, its upper 16 bits to row 2t + 1, both at 16-bit element g of the row (lane l
// gives the address of row l mod 8 of matrix l / 8, 16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// Bytes {a.b[k], b.b[k], a.b[k + 1], b.b[k + 1]} for k = 0 (HI false) or 2 (HI true).
template <bool HI>
__device__ __forceinline__ u32 interleave_bytes(u32 a, u32 b) {
    u32 r;
    if (HI) asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(r) : "r"(a), "r"(b));
    else asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ uint4 ld_shared_u4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_u4(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
