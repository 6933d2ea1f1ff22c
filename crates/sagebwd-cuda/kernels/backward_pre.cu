// Backward preprocess (ALGORITHM.md §5): D[r] = Σ_d O[r]·dO[r] in FP32, with O the saved BF16
// output (the products of two BF16 values are exact). One warp per query row. The dO quantization
// of this stage is `sage_quantize_rows` (quantize.cu). With one head group, the same warp also zeroes
// its row of the FP32 dQ accumulator (dq_zero, else null: the groups zero theirs with `sage_fill_u32`),
// one launch fewer on the short-N shapes where launches weigh.
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_delta(const u16* __restrict__ o,
                                                                     const u16* __restrict__ d_o,
                                                                     float* __restrict__ delta, long rows,
                                                                     float* __restrict__ dq_zero) {
    const long row = (long)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    if (dq_zero)
        for (int c = lane; c < HEAD_DIM; c += 32) dq_zero[row * HEAD_DIM + c] = 0.0f;
    float acc = 0.0f;
    for (int c = lane; c < HEAD_DIM; c += 32)
        acc = __fadd_rn(acc, __fmul_rn(bf16_to_f32(o[row * HEAD_DIM + c]), bf16_to_f32(d_o[row * HEAD_DIM + c])));
    for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
    if (lane == 0) delta[row] = acc;
}
