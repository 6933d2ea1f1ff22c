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

// ---- one pass over DRAM, few instructions per logit ------------------------------------------
//
// `xent` reads each 100 KB row (vocabulary 50,257) twice, and ncu shows it bound by instruction
// issue, not DRAM: ~20 instructions per logit (online rescale, a validity test and branch per value,
// the target test per value). Here the block first copies its row into shared memory (cp.async,
// every 16-byte chunk of the thread in flight at once), so DRAM sees one read and one write per
// logit (two rows fit an SM: 2 × 100.6 KB of 227 KB), and then makes three cheap passes over shared
// memory: the row max on packed BF16 pairs (max.bf16x2, exact: the max of BF16 values is one of them),
// Σ exp(z − max) (unpack, FFMA, EX2, FADD per logit), and the gradient (unpack, FFMA, EX2, FMUL, half
// a pack per logit). Only the chunk holding the last valid logit (and padding), and the one holding
// the target, take the checked slow path. Same rounding points as `xent` (FP32 softmax, BF16 gradient);
// the FP32 sum is taken against the row max instead of a running max (order of operations only).
#define XENT_STAGED_THREADS 512
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ void copy16_async(void* smem, const void* gmem) {
    u32 s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 max_bf16x2(u32 a, u32 b) {
    u32 r;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// exp(z − max) of a pair, as exp2(z · log2 e + nb) with nb = −max · log2 e.
__device__ __forceinline__ float exp_pair_sum(u32 w, float nb) {
    return ex2_ftz(fmaf(bf16_lo(w), LOG2E, nb)) + ex2_ftz(fmaf(bf16_hi(w), LOG2E, nb));
}
__device__ __forceinline__ u32 grad_pair(u32 w, float nb, float k) {
    return pack_bf16x2(ex2_ftz(fmaf(bf16_lo(w), LOG2E, nb)) * k, ex2_ftz(fmaf(bf16_hi(w), LOG2E, nb)) * k);
}

extern "C" __global__ void __launch_bounds__(XENT_STAGED_THREADS, 2)
xent_staged(u16* logits, long ld, const u32* targets, float* row_loss, int vocab, float scale, int want_grad) {
    extern __shared__ uint4 s_row[];  // [ld / 8] chunks of the row
    __shared__ float scratch[WARP];
    const long r = blockIdx.x;
    uint4* row = reinterpret_cast<uint4*>(logits + r * ld);
    const u16* s_z = reinterpret_cast<const u16*>(s_row);
    const int chunks = (int)(ld / 8), full = vocab / 8;  // chunks [0, full) hold valid logits only
    // Each thread copies, then reads, only its own chunks: no barrier between the copy and pass 1.
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) copy16_async(s_row + c, row + c);
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
    const u32 target = targets[r];

    u32 mx2 = 0xff80ff80u;  // (−inf, −inf)
    for (int c = threadIdx.x; c < full; c += blockDim.x) {
        const uint4 w = s_row[c];
        mx2 = max_bf16x2(max_bf16x2(mx2, max_bf16x2(w.x, w.y)), max_bf16x2(w.z, w.w));
    }
    float m = fmaxf(bf16_lo(mx2), bf16_hi(mx2));
    // The partial chunk's valid logits: read before any barrier, so by the thread that copied it.
    if (threadIdx.x == full % blockDim.x)
        for (int j = 8 * full; j < vocab; j++) m = fmaxf(m, bf16_to_f32(s_z[j]));
    const float row_max = block_max(m, scratch);  // its barriers also publish every thread's copy
    const float nb = -row_max * LOG2E;

    float s = 0.0f;
    for (int c = threadIdx.x; c < full; c += blockDim.x) {
        const uint4 w = s_row[c];
        s += (exp_pair_sum(w.x, nb) + exp_pair_sum(w.y, nb)) + (exp_pair_sum(w.z, nb) + exp_pair_sum(w.w, nb));
    }
    if (threadIdx.x == 0)
        for (int j = 8 * full; j < vocab; j++) s += ex2_ftz(fmaf(bf16_to_f32(s_z[j]), LOG2E, nb));
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) row_loss[r] = row_max + logf(s) - bf16_to_f32(s_z[target]);
    if (!want_grad) return;

    const float k = scale / s;
    const int target_chunk = (int)(target / 8);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        uint4 w = s_row[c];
        if (c < full && c != target_chunk) {
            w = make_uint4(grad_pair(w.x, nb, k), grad_pair(w.y, nb, k), grad_pair(w.z, nb, k), grad_pair(w.w, nb, k));
        } else {  // the target's chunk, the last valid logits, the padding (zeros)
            u16* z = reinterpret_cast<u16*>(&w);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int j = 8 * c + i;
                float p = j < vocab ? ex2_ftz(fmaf(bf16_to_f32(z[i]), LOG2E, nb)) * k : 0.0f;
                if (j == (int)target) p -= scale;
                z[i] = f32_to_bf16(p);
            }
        }
        row[c] = w;
    }
}
