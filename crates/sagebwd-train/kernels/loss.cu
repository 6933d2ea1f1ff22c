// Softmax cross-entropy over the vocabulary, forward and backward fused: one block per token row
// of FP32 logits. Mirrors src/layers/loss.rs (which works on transposed logits on the CPU).

// row_loss[r] = logsumexp(logits[r]) − logits[r, target]; with want_grad, d_logits[r] (BF16, the
// operand of the two backward products) = scale · (softmax(logits[r]) − onehot(target)), and 0 in
// the padding columns up to ld.
extern "C" __global__ void xent(const float* logits, long ld, const u32* targets, float* row_loss, u16* d_logits,
                                int vocab, float scale, int want_grad) {
    __shared__ float scratch[WARP];
    const long r = blockIdx.x;
    const float* l = logits + r * ld;
    // One pass for the maximum and the sum (online softmax: the running sum is rescaled whenever the
    // maximum grows), so the row is read twice in all, not three times.
    float m = -__int_as_float(0x7f800000), s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float z = l[j];
        if (z > m) {
            s = s * expf(m - z) + 1.0f;
            m = z;
        } else {
            s += expf(z - m);
        }
    }
    const float row_max = block_max(m, scratch);
    s = block_sum(m == -__int_as_float(0x7f800000) ? 0.0f : s * expf(m - row_max), scratch);
    m = row_max;
    const u32 target = targets[r];
    if (threadIdx.x == 0) row_loss[r] = m + logf(s) - l[target];
    if (!want_grad) return;
    const float k = scale / s;
    u16* d = d_logits + r * ld;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float p = expf(l[j] - m) * k;
        if (j == (int)target) p -= scale;
        d[j] = f32_to_bf16(p);
    }
    // The padding columns [vocab, ld) are part of the ∂hidden product's reduction: zero, not poison.
    for (long j = vocab + threadIdx.x; j < ld; j += blockDim.x) d[j] = 0;
}
