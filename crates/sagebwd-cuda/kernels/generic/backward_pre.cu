// Backward preprocess (ALGORITHM.md §5): D[r] = Σ_d O[r]·dO[r] in FP32, with O the saved BF16
// output (the products of two BF16 values are exact). The dO quantization of this stage is
// `sage_quantize_rows` (quantize.cu). With one head group, the same lanes also zero the row of the
// FP32 dQ accumulator (dq_zero, else null: the groups zero theirs with `sage_fill_u32`), one launch
// fewer on the short-N shapes where launches weigh.
//
// DELTA_LANES = d/8 lanes per row, each with one 16-byte chunk (8 elements) of O and dO and two
// 16-byte zero stores: a memory-bound kernel wants many bytes in flight per thread (the one-warp-per-row
// version issued 2-byte loads, ~3 TB/s). The FP32 sum is the same tree as that version's, bit for bit:
// lane l of 32 summed elements l, l + 32, … in order, then a butterfly over l (xor 16, 8, 4, 2, 1).
// Here element c = 8j + i sits in lane j, slot i: the partial sum of l = c mod 32 = 8(j mod 4) + i is
// gathered in lane j < 4 (from lanes j + 4, j + 8, …), the butterfly's l bits 4 and 3 are lane bits 1
// and 0 (shuffles), its bits 2, 1, 0 are the slot (in registers). FP32 addition is commutative, so
// each step gives what every lane of the butterfly held.
#define DELTA_LANES (HEAD_DIM / 8)
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_delta(const u16* __restrict__ o,
                                                                     const u16* __restrict__ d_o,
                                                                     float* __restrict__ delta, long rows,
                                                                     float* __restrict__ dq_zero) {
    pdl_trigger();  // the backward main kernel (PDL, src/backward.rs) waits for this grid before any global access
    const long row = ((long)blockIdx.x * THREADS + threadIdx.x) / DELTA_LANES;
    const int j = threadIdx.x % DELTA_LANES;
    // Whole rows per warp (DELTA_LANES divides 32), so a row's lanes exit or stay together.
    const unsigned mask = __ballot_sync(0xffffffffu, row < rows);
    if (row >= rows) return;
    if (dq_zero) {
        float4* z = (float4*)(dq_zero + row * HEAD_DIM + 8 * j);
        z[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        z[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const uint4 ov = *(const uint4*)(o + row * HEAD_DIM + 8 * j);
    const uint4 dv = *(const uint4*)(d_o + row * HEAD_DIM + 8 * j);
    const u32 ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u16 oh = (u16)(ow[i >> 1] >> (16 * (i & 1))), dh = (u16)(dw[i >> 1] >> (16 * (i & 1)));
        s[i] = __fmul_rn(bf16_to_f32(oh), bf16_to_f32(dh));
    }
    // Lane j < 4: s[i] = fl(…fl(fl(0 + p[l]) + p[l + 32])…) for l = 8j + i (the old lane l's loop).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float acc = __fadd_rn(0.0f, s[i]);
#pragma unroll
        for (int m = 1; m < DELTA_LANES / 4; ++m) acc = __fadd_rn(acc, __shfl_down_sync(mask, s[i], 4 * m));
        s[i] = acc;
    }
    // Butterfly bits 4, 3 (lanes j ^ 2, j ^ 1; only lanes j < 4 carry the partial sums), then 2, 1, 0.
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = __fadd_rn(s[i], __shfl_xor_sync(mask, s[i], 2));
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = __fadd_rn(s[i], __shfl_xor_sync(mask, s[i], 1));
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = __fadd_rn(s[i], s[i + 4]);
#pragma unroll
    for (int i = 0; i < 2; ++i) s[i] = __fadd_rn(s[i], s[i + 2]);
    if (j == 0) delta[row] = __fadd_rn(s[0], s[1]);
}
