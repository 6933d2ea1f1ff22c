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

// The gradient of chunk `c` in place: scale · (softmax − onehot(target)), 0 past the vocabulary.
__device__ __forceinline__ void xent_grad8(uint4& chunk, int c, int vocab, u32 target, float row_max, float k, float scale) {
    u16* z = reinterpret_cast<u16*>(&chunk);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int j = 8 * c + i;
        float p = j < vocab ? __expf(bf16_to_f32(z[i]) - row_max) * k : 0.0f;
        if (j == (int)target) p -= scale;
        z[i] = f32_to_bf16(p);
    }
}

// Chunks per thread a row keeps in registers (4 words each): 8 · 1024 · 8 = 65,536 logits, the
// GPT-2 vocabulary padded to 50,304 included. Wider rows stream through twice.
#define XENT_REG_CHUNKS 8

// row_loss[r] = logsumexp(z[r]) − z[r, target] for the BF16 logits z = logits[r, 0..vocab); with
// want_grad, logits[r] is overwritten (BF16, the operand of the two backward products) by
// scale · (softmax(z[r]) − onehot(target)), and the padding columns up to ld by 0. ld is a multiple
// of 8 and rows start 16-byte aligned (the padded vocabulary), so the row is read in 16-byte chunks.
// Thread x takes chunks x, x + blockDim.x, … in that order on both paths (the same sums). A row of at
// most XENT_REG_CHUNKS chunks per thread is read once and kept in registers for the gradient;
// otherwise it is read again. In place is safe: each chunk is read and written by the same thread,
// and the target logit is read by every thread before the first barrier, so before any write.
extern "C" __global__ void __launch_bounds__(1024) xent(u16* logits, long ld, const u32* targets, float* row_loss,
                                                       int vocab, float scale, int want_grad) {
    __shared__ float scratch[WARP];
    const long r = blockIdx.x;
    uint4* row = reinterpret_cast<uint4*>(logits + r * ld);
    const int chunks = (int)(ld / 8), step = blockDim.x;
    const bool in_registers = chunks <= XENT_REG_CHUNKS * step;
    const u32 target = targets[r];
    const float z_target = bf16_to_f32(logits[r * ld + target]);
    float m = -__int_as_float(0x7f800000), s = 0.0f;
    uint4 held[XENT_REG_CHUNKS];
    if (in_registers) {
#pragma unroll
        for (int i = 0; i < XENT_REG_CHUNKS; i++) {
            const int c = threadIdx.x + i * step;
            if (c < chunks) held[i] = row[c];
        }
#pragma unroll
        for (int i = 0; i < XENT_REG_CHUNKS; i++) {
            const int c = threadIdx.x + i * step;
            if (c < chunks) softmax_accumulate8(held[i], vocab - 8 * c, m, s);
        }
    } else {
        for (int c = threadIdx.x; c < chunks; c += step) softmax_accumulate8(row[c], vocab - 8 * c, m, s);
    }
    const float row_max = block_max(m, scratch);
    s = block_sum(m == -__int_as_float(0x7f800000) ? 0.0f : s * __expf(m - row_max), scratch);
    if (threadIdx.x == 0) row_loss[r] = row_max + logf(s) - z_target;
    if (!want_grad) return;
    const float k = scale / s;
    if (in_registers) {
#pragma unroll
        for (int i = 0; i < XENT_REG_CHUNKS; i++) {
            const int c = threadIdx.x + i * step;
            if (c < chunks) {
                xent_grad8(held[i], c, vocab, target, row_max, k, scale);
                row[c] = held[i];
            }
        }
    } else {
        for (int c = threadIdx.x; c < chunks; c += step) {
            uint4 chunk = row[c];
            xent_grad8(chunk, c, vocab, target, row_max, k, scale);
            row[c] = chunk;
        }
    }
}
