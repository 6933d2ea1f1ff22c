// Backward postprocess (ALGORITHM.md §5, §7): dQ ← fl(c·fl(dQ + rowsum(dS)·K_m)) (the K-smoothing
// correction only when switched on and #6 is INT8; same order as the simulator), dK ← fl(c·Σ_group dK), dV ← Σ_group dV (FP32 sums over the query heads that
// share a kv head, in head order), all rounded to BF16.

// dQ's eight elements 8·e8 .. 8·e8 + 7 (one row; a, b their FP32 accumulators): the K-smoothing
// correction when on, the scale c, BF16, one 16-byte store.
__device__ __forceinline__ void store_dq8(u16* __restrict__ dq, long e8, float4 a, float4 b,
                                          const float* __restrict__ ds_rowsum, const float* __restrict__ k_mean,
                                          const Dims& d, int group, bool corr, float c) {
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    if (corr) {
        const long row = 8 * e8 / HEAD_DIM;
        const int col0 = (int)(8 * e8 % HEAD_DIM);
        const long bh = row / d.n_q;
        const long bh_kv = (bh / d.heads_q) * d.heads_kv + (bh % d.heads_q) / group;
        const float* km = k_mean + bh_kv * HEAD_DIM + col0;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(v[i], __fmul_rn(ds_rowsum[row], km[i]));
    }
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = (u32)f32_to_bf16(__fmul_rn(c, v[2 * i])) | ((u32)f32_to_bf16(__fmul_rn(c, v[2 * i + 1])) << 16);
    ((uint4*)dq)[e8] = make_uint4(w[0], w[1], w[2], w[3]);
}

// Eight consecutive elements of one row per thread and step (HEAD_DIM is a multiple of 8; dq_acc and dq
// start on whole rows): two 16-byte loads and one 16-byte store, more bytes in flight per thread than
// the four-element version (~3.5 TB/s), the same arithmetic per element. Launched with a grid for
// total / 8 threads.
extern "C" __global__ void sage_bwd_post_dq(const float* __restrict__ dq_acc, const float* __restrict__ ds_rowsum,
                                            const float* __restrict__ k_mean, u16* __restrict__ dq,
                                            Dims d, float c, int flags) {
    const long total8 = (long)d.batch * d.heads_q * d.n_q * HEAD_DIM / 8;
    const int group = d.heads_q / d.heads_kv;
    const bool corr = (flags & F_DQ_CORR) && (flags & F_DQ);
    for (long e8 = (long)blockIdx.x * blockDim.x + threadIdx.x; e8 < total8; e8 += (long)gridDim.x * blockDim.x) {
        const float4 a = ((const float4*)dq_acc)[2 * e8], b = ((const float4*)dq_acc)[2 * e8 + 1];
        store_dq8(dq, e8, a, b, ds_rowsum, k_mean, d, group, corr, c);
    }
}

// The dQ postprocess of the sagebwd path (src/backward.rs; fpa keeps sage_bwd_post_dq): the same
// arithmetic per element, POST_UNROLL groups of eight elements per thread (group e8 = block's first +
// k · blockDim.x + thread, so each load instruction stays coalesced) with all their loads issued
// before the first use. With one group per thread most of the warps' stall samples sit on the
// first use of its two loads (too few bytes in flight per SM to use the DRAM bandwidth). Launched with PDL after the main kernel: griddepcontrol.wait first.
// SAGE_DQ_ACC_ROT (sm_90a, d = 128): group e8 (row q's chunk e8 mod 16) is read from chunk e8 ^ (q mod 4) of
// the row (common.cuh), in the same 128 bytes, so the loads stay coalesced.
#define POST_UNROLL 4
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_post_dq_int8(const float* __restrict__ dq_acc,
                                                                           const float* __restrict__ ds_rowsum,
                                                                           const float* __restrict__ k_mean,
                                                                           u16* __restrict__ dq, Dims d, float c,
                                                                           int flags) {
    pdl_wait();
    const long total8 = (long)d.batch * d.heads_q * d.n_q * HEAD_DIM / 8;
    const int group = d.heads_q / d.heads_kv;
    const bool corr = (flags & F_DQ_CORR) && (flags & F_DQ);
    const long first = (long)blockIdx.x * THREADS * POST_UNROLL + threadIdx.x;
    float4 a[POST_UNROLL], b[POST_UNROLL];
#pragma unroll
    for (int k = 0; k < POST_UNROLL; ++k) {
        const long e8 = first + (long)k * THREADS;
        long at = e8;
        if (SAGE_DQ_ACC_ROT) {
            const long row = e8 / (HEAD_DIM / 8);  // b·h·n_q + q
            at ^= sage_dq_acc_chunk_xor((d.n_q & 3) == 0 ? row : row % d.n_q);  // q mod 4 (block-uniform choice)
        }
        if (e8 < total8) a[k] = ((const float4*)dq_acc)[2 * at], b[k] = ((const float4*)dq_acc)[2 * at + 1];
    }
#pragma unroll
    for (int k = 0; k < POST_UNROLL; ++k) {
        const long e8 = first + (long)k * THREADS;
        if (e8 >= total8) break;
        store_dq8(dq, e8, a[k], b[k], ds_rowsum, k_mean, d, group, corr, c);
    }
}

extern "C" __global__ void sage_bwd_post_dkdv(const float* __restrict__ dk_acc, const float* __restrict__ dv_acc,
                                              u16* __restrict__ dk, u16* __restrict__ dv, Dims d, float c) {
    const long per_head = (long)d.n_k * HEAD_DIM;
    const long total = (long)d.batch * d.heads_kv * per_head;
    const int group = d.heads_q / d.heads_kv;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long)gridDim.x * blockDim.x) {
        const long bh_kv = e / per_head, within = e % per_head;
        const long b = bh_kv / d.heads_kv, h_kv = bh_kv % d.heads_kv;
        float sk = 0.0f, sv = 0.0f;
        for (int g = 0; g < group; ++g) {
            const long src = (b * d.heads_q + h_kv * group + g) * per_head + within;
            sk = __fadd_rn(sk, dk_acc[src]);
            sv = __fadd_rn(sv, dv_acc[src]);
        }
        dk[e] = f32_to_bf16(__fmul_rn(c, sk));
        dv[e] = f32_to_bf16(sv);
    }
}
