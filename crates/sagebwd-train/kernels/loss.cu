// Softmax cross-entropy over the vocabulary, forward and backward fused: one block per token row
// of BF16 logits, the gradient written over the logits in place. Mirrors src/layers/loss.rs (which
// works on transposed FP32 logits on the CPU).

// Online max and sum of exp over 8 logits: one rescale of the running sum per 8 values, not per value.
__device__ __forceinline__ void softmax_accumulate8(const uint4 chunk, int valid, float& m, float& s) {
    const u16* z = reinterpret_cast<const u16*>(&chunk);
    float zmax = m;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < valid) zmax = fmaxf(zmax, bf16_to_f32(z[i]));
    if (zmax == -__int_as_float(0x7f800000)) return; // nothing yet (padding only): exp(-inf + inf) is NaN
    s *= __expf(m - zmax); // 0 · exp(-inf) = 0 on the first valid chunk
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < valid) s += __expf(bf16_to_f32(z[i]) - zmax);
    m = zmax;
}

// row_loss[r] = logsumexp(z[r]) − z[r, target] for the BF16 logits z = logits[r, 0..vocab); with
// want_grad, logits[r] is overwritten (BF16, the operand of the two backward products) by
// scale · (softmax(z[r]) − onehot(target)), and the padding columns up to ld by 0. ld is a multiple
// of 8 and rows start 16-byte aligned (the padded vocabulary), so the row is read in 16-byte chunks.
// In place is safe: each chunk is read and written by the same thread, and the target logit is read
// by every thread before the first barrier, so before any write.
extern "C" __global__ void xent(u16* logits, long ld, const u32* targets, float* row_loss, int vocab, float scale,
                                int want_grad) {
    __shared__ float scratch[WARP];
    const long r = blockIdx.x;
    uint4* row = reinterpret_cast<uint4*>(logits + r * ld);
    const int chunks = (int)(ld / 8);
    const u32 target = targets[r];
    const float z_target = bf16_to_f32(logits[r * ld + target]);
    float m = -__int_as_float(0x7f800000), s = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) softmax_accumulate8(row[c], vocab - 8 * c, m, s);
    const float row_max = block_max(m, scratch);
    s = block_sum(m == -__int_as_float(0x7f800000) ? 0.0f : s * __expf(m - row_max), scratch);
    if (threadIdx.x == 0) row_loss[r] = row_max + logf(s) - z_target;
    if (!want_grad) return;
    const float k = scale / s;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        uint4 chunk = row[c];
        u16* z = reinterpret_cast<u16*>(&chunk);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = 8 * c + i;
            float p = j < vocab ? __expf(bf16_to_f32(z[i]) - row_max) * k : 0.0f;
            if (j == (int)target) p -= scale;
            z[i] = f32_to_bf16(p);
        }
        row[c] = chunk;
    }
}
