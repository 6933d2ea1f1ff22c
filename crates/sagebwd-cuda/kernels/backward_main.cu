// Backward main kernel (ALGORITHM.md §5): one thread block per (key block of B_kv = 128 keys,
// batch·query head). The block keeps its dK, dV accumulators in registers and loops over the
// query blocks that can see its keys; per 64 × 128 tile it recomputes S and P, computes dP and
// dS, quantizes P and dS per tile when their products are INT8, updates dV and dK, and adds its
// dQ contribution to the FP32 global accumulator with atomicAdd. dK, dV are written per query
// head; the postprocess sums the heads of a GQA group. Scalar CUDA-core arithmetic (dp4a / FP32),
// operands read through the caches, the P and dS tiles in (dynamic) shared memory.

// Mirrored by `BackwardParams` in src/backward.rs.
struct BackwardParams {
    ScoreOperands op;
    const i8* v_hat;        // [B, Hkv, Nk, d]
    const float* v_scale;   // [B, Hkv, n_kblk]
    const u16* v;           // [B, Hkv, Nk, d]
    const i8* do_hat;       // [B, Hq, Nq, d]
    const float* do_scale;  // [B, Hq, n_qblk]
    const u16* d_o;         // [B, Hq, Nq, d]
    const float* lse2;      // [B, Hq, Nq]
    const float* delta;     // [B, Hq, Nq]
    float* dq_acc;          // [B, Hq, Nq, d], zeroed by the preprocess
    float* ds_rowsum;       // [B, Hq, Nq], zeroed; Σ_j dS (only with the dQ correction)
    float* dk_acc;          // [B, Hq, Nk, d], written whole
    float* dv_acc;          // [B, Hq, Nk, d], written whole
    Dims dims;
    int flags;
    float c_lambda;
};

#define KV_PER_THREAD (BLOCK_KV * HEAD_DIM / THREADS)
#define Q_PER_THREAD (BLOCK_Q * HEAD_DIM / THREADS)

// Lives in dynamic shared memory (over the 48 KB static limit); the host passes sizeof of its
// mirror, and the kernel traps if it got less.
struct BackwardShared {
    float p[BLOCK_Q][BLOCK_KV];   // P (FP32, masked → 0)
    float ds[BLOCK_Q][BLOCK_KV];  // dS (FP32, masked → 0)
    float lse2[BLOCK_Q], delta[BLOCK_Q];  // L[r] of §5 (lse2, less b_r for an INT8 #3) and D[r]
    float q_mean[HEAD_DIM];
    float beta[BLOCK_KV];
    float colsum[BLOCK_KV];
    float scratch[THREADS / 32];
};

struct TileScales {
    GroupScale p, ds;
};

// First query block with a row that sees key block kb.
__device__ __forceinline__ int query_block_begin(const Dims& d, int kb) {
    if (!d.causal) return 0;
    const int r_min = max(0, kb * BLOCK_KV - (d.n_k - d.n_q));
    return r_min / BLOCK_Q;
}

// Per-row constants of query block qb (and the Q-smoothing bias of this tile).
__device__ void load_row_state(const BackwardParams& p, BackwardShared& s, int bh, int bh_kv, int qb, int kb) {
    const int tid = threadIdx.x;
    if (tid < BLOCK_Q) {
        const int r = qb * BLOCK_Q + tid;
        const bool ok = r < p.dims.n_q;
        // L[r]: an INT8 #3 scores the smoothed K, lower than the true scores by b_r (§5).
        float L = pos_inf();
        if (ok) {
            L = p.lse2[(long)bh * p.dims.n_q + r];
            if (p.flags & F_QK_BWD) L = __fsub_rn(L, p.op.row_offset[(long)bh * p.dims.n_q + r]);
        }
        s.lse2[tid] = L;
        s.delta[tid] = ok ? p.delta[(long)bh * p.dims.n_q + r] : 0.0f;
    }
    const bool smooth_q = p.flags & F_SMOOTH_Q;
    if (smooth_q && tid < HEAD_DIM) s.q_mean[tid] = p.op.q_mean[((long)bh * p.dims.n_qblk + qb) * HEAD_DIM + tid];
    __syncthreads();
    if (smooth_q && tid < BLOCK_KV) {
        const int j = kb * BLOCK_KV + tid;
        s.beta[tid] = j < p.dims.n_k
            ? beta_of(s.q_mean, p.op.k + ((long)bh_kv * p.dims.n_k + j) * HEAD_DIM, p.op.k_mean + (long)bh_kv * HEAD_DIM)
            : 0.0f;
    }
    __syncthreads();
}

// P = exp2(t − lse2), dP (#5), dS = fl(P·fl(dP − D)) for the tile; returns the per-tile scales.
__device__ TileScales tile_p_ds(const BackwardParams& p, BackwardShared& s, int bh, int bh_kv, int qb, int kb) {
    const bool int8_qk = p.flags & F_QK_BWD, int8_dp = p.flags & F_DP, smooth_q = p.flags & F_SMOOTH_Q;
    const float s_do = p.do_scale[bh * p.dims.n_qblk + qb];
    const float s_v = p.v_scale[bh_kv * p.dims.n_kblk + kb];
    float amax_p = 0.0f, amax_ds = 0.0f;
    for (int e = threadIdx.x; e < BLOCK_Q * BLOCK_KV; e += THREADS) {
        const int rl = e / BLOCK_KV, jl = e % BLOCK_KV;
        const int r = qb * BLOCK_Q + rl, j = kb * BLOCK_KV + jl;
        float prob = 0.0f, ds = 0.0f;
        if (visible(p.dims, r, j)) {
            const long q_row = (long)bh * p.dims.n_q + r, k_row = (long)bh_kv * p.dims.n_k + j;
            const float t = score(p.op, int8_qk, q_row, k_row, bh * p.dims.n_qblk + qb,
                                  bh_kv * p.dims.n_kblk + kb, p.c_lambda, smooth_q, s.beta[jl]);
            prob = exp2f(__fsub_rn(t, s.lse2[rl]));  // exp2(t − L)
            const float dp = int8_dp
                ? dequant(dot_i8(p.do_hat + q_row * HEAD_DIM, p.v_hat + k_row * HEAD_DIM), s_do, s_v)
                : dot_bf16(p.d_o + q_row * HEAD_DIM, p.v + k_row * HEAD_DIM);
            ds = __fmul_rn(prob, __fsub_rn(dp, s.delta[rl]));
        }
        s.p[rl][jl] = prob;
        s.ds[rl][jl] = ds;
        amax_p = fmaxf(amax_p, prob);
        amax_ds = fmaxf(amax_ds, fabsf(ds));
    }
    TileScales sc;
    sc.p = group_scale(block_max(amax_p, s.scratch));
    sc.ds = group_scale(block_max(amax_ds, s.scratch));
    return sc;
}

// Unquantized dS sums: per key over the tile's rows (Q-smoothing's dK term, INT8 #7 only) and per
// row over the tile's keys (into ds_rowsum for the optional dQ correction, INT8 #6 only).
__device__ void tile_ds_sums(const BackwardParams& p, BackwardShared& s, int bh, int qb) {
    const int tid = threadIdx.x;
    if ((p.flags & F_SMOOTH_Q) && (p.flags & F_DK) && tid < BLOCK_KV) {
        float sum = 0.0f;
        for (int r = 0; r < BLOCK_Q; ++r) sum = __fadd_rn(sum, s.ds[r][tid]);
        s.colsum[tid] = sum;
    }
    if ((p.flags & F_DQ_CORR) && (p.flags & F_DQ) && tid < BLOCK_Q) {
        const int r = qb * BLOCK_Q + tid;
        if (r < p.dims.n_q) {
            float sum = 0.0f;
            for (int j = 0; j < BLOCK_KV; ++j) sum = __fadd_rn(sum, s.ds[tid][j]);
            atomicAdd(p.ds_rowsum + (long)bh * p.dims.n_q + r, sum);
        }
    }
    __syncthreads();
}

// dV += Pᵀ dO (#4) and dK += dSᵀ Q (#7; INT8: dŜᵀ Q̂ plus Q-smoothing's colsum(dS)·Q_m; BF16:
// bf16(dS)ᵀ Q) for this thread's entries.
__device__ void tile_dv_dk(const BackwardParams& p, BackwardShared& s, const TileScales& sc, float* dv, float* dk,
                           int bh, int qb) {
    const int rows = min(BLOCK_Q, p.dims.n_q - qb * BLOCK_Q);
    const long q_row0 = (long)bh * p.dims.n_q + qb * BLOCK_Q;
    const bool int8_dv = p.flags & F_DV, int8_dk = p.flags & F_DK, smooth_q = p.flags & F_SMOOTH_Q;
    const float s_do = p.do_scale[bh * p.dims.n_qblk + qb];
    const float s_q = p.op.q_scale[bh * p.dims.n_qblk + qb];
#pragma unroll
    for (int i = 0; i < KV_PER_THREAD; ++i) {
        const int e = threadIdx.x + i * THREADS;
        const int jl = e / HEAD_DIM, c = e % HEAD_DIM;
        if (int8_dv) {
            int acc = 0;
            for (int r = 0; r < rows; ++r)
                acc += quantize(s.p[r][jl], sc.p.inv) * (int)p.do_hat[(q_row0 + r) * HEAD_DIM + c];
            dv[i] = __fadd_rn(dv[i], dequant(acc, sc.p.scale, s_do));
        } else {
            float sum = 0.0f;
            for (int r = 0; r < rows; ++r)
                sum = __fadd_rn(sum, __fmul_rn(round_bf16(s.p[r][jl]), bf16_to_f32(p.d_o[(q_row0 + r) * HEAD_DIM + c])));
            dv[i] = __fadd_rn(dv[i], sum);
        }
        if (int8_dk) {
            int acc = 0;
            for (int r = 0; r < rows; ++r)
                acc += quantize(s.ds[r][jl], sc.ds.inv) * (int)p.op.q_hat[(q_row0 + r) * HEAD_DIM + c];
            dk[i] = __fadd_rn(dk[i], dequant(acc, sc.ds.scale, s_q));
        } else {
            float sum = 0.0f;
            for (int r = 0; r < rows; ++r)
                sum = __fadd_rn(sum, __fmul_rn(round_bf16(s.ds[r][jl]), bf16_to_f32(p.op.q[(q_row0 + r) * HEAD_DIM + c])));
            dk[i] = __fadd_rn(dk[i], sum);
        }
        if (smooth_q && int8_dk) dk[i] = __fadd_rn(dk[i], __fmul_rn(s.colsum[jl], s.q_mean[c]));
    }
}

// dQ += dS K (#6; INT8: dŜ K̂ of the smoothed K; BF16: bf16(dS) K), added to the FP32 global
// accumulator.
__device__ void tile_dq(const BackwardParams& p, BackwardShared& s, const TileScales& sc, int bh, int bh_kv, int qb, int kb) {
    const int keys = min(BLOCK_KV, p.dims.n_k - kb * BLOCK_KV);
    const long k_row0 = (long)bh_kv * p.dims.n_k + kb * BLOCK_KV;
    const bool int8_dq = p.flags & F_DQ;
    const float s_k = p.op.k_scale[bh_kv * p.dims.n_kblk + kb];
#pragma unroll
    for (int i = 0; i < Q_PER_THREAD; ++i) {
        const int e = threadIdx.x + i * THREADS;
        const int rl = e / HEAD_DIM, c = e % HEAD_DIM;
        const int r = qb * BLOCK_Q + rl;
        if (r >= p.dims.n_q) continue;
        float val;
        if (int8_dq) {
            int acc = 0;
            for (int j = 0; j < keys; ++j)
                acc += quantize(s.ds[rl][j], sc.ds.inv) * (int)p.op.k_hat[(k_row0 + j) * HEAD_DIM + c];
            val = dequant(acc, sc.ds.scale, s_k);
        } else {
            val = 0.0f;
            for (int j = 0; j < keys; ++j)
                val = __fadd_rn(val, __fmul_rn(round_bf16(s.ds[rl][j]), bf16_to_f32(p.op.k[(k_row0 + j) * HEAD_DIM + c])));
        }
        atomicAdd(p.dq_acc + ((long)bh * p.dims.n_q + r) * HEAD_DIM + c, val);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < sizeof(BackwardShared)) __trap();
    BackwardShared& s = *reinterpret_cast<BackwardShared*>(smem_raw);

    const int kb = blockIdx.x, bh = blockIdx.y;
    const int group = p.dims.heads_q / p.dims.heads_kv;
    const int bh_kv = (bh / p.dims.heads_q) * p.dims.heads_kv + (bh % p.dims.heads_q) / group;

    float dv[KV_PER_THREAD], dk[KV_PER_THREAD];
#pragma unroll
    for (int i = 0; i < KV_PER_THREAD; ++i) dv[i] = dk[i] = 0.0f;

    for (int qb = query_block_begin(p.dims, kb); qb < p.dims.n_qblk; ++qb) {
        load_row_state(p, s, bh, bh_kv, qb, kb);
        const TileScales sc = tile_p_ds(p, s, bh, bh_kv, qb, kb);  // ends with a barrier
        tile_ds_sums(p, s, bh, qb);
        tile_dv_dk(p, s, sc, dv, dk, bh, qb);
        tile_dq(p, s, sc, bh, bh_kv, qb, kb);
        __syncthreads();  // the tiles are overwritten by the next query block
    }

#pragma unroll
    for (int i = 0; i < KV_PER_THREAD; ++i) {
        const int e = threadIdx.x + i * THREADS;
        const int jl = e / HEAD_DIM, c = e % HEAD_DIM;
        const int j = kb * BLOCK_KV + jl;
        if (j >= p.dims.n_k) continue;
        const long idx = ((long)bh * p.dims.n_k + j) * HEAD_DIM + c;
        p.dk_acc[idx] = dk[i];
        p.dv_acc[idx] = dv[i];
    }
}
