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
    Transposed tr;
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
// Layout contract with src/backward.rs (which asserts the same size).
static_assert(sizeof(BackwardParams) == 280, "BackwardParams layout changed: update src/backward.rs");

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
    require_dynamic_smem((u32)sizeof(BackwardShared));
    BackwardShared& s = *reinterpret_cast<BackwardShared*>(smem_raw);

    const int kb = blockIdx.x, bh = blockIdx.y;
    const int bh_kv = kv_head_of(p.dims, bh);

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

// ---------------------------------------------------------------------------------------------
// The same backward main step on tensor cores: one thread block of 8 warps per (key block,
// batch·query head), the same shared state (BackwardShared) and per-tile scales. Per 64 × 128 tile:
// warp w computes S (#3) and dP (#5) for query rows 16(w mod 4).. and keys 64(w div 4).. with
// mma.sync and writes P, dS to shared memory; after the tile's amax reductions, warp w owns keys
// 16w..16w+15 for dV (#4) and dK (#7) (accumulators in registers across query blocks), then query
// rows 16(w mod 4).. × half of d for dQ (#6, atomicAdd). Pᵀ and dSᵀ are strided views of the shared
// tiles; the B operands whose reduction runs over tokens (dO, Q, K) come from the transposed copies.

#define BWD_O_TILES (HEAD_DIM / 8)

// Phase 1: P and dS of the tile into shared memory; returns the tile scales.
__device__ TileScales mma_tile_p_ds(const BackwardParams& p, BackwardShared& s, int bh, int bh_kv, int qb, int kb) {
    const Dims& d = p.dims;
    const int warp = threadIdx.x >> 5;
    const int r_loc0 = (warp & 3) * 16, k_loc0 = (warp >> 2) * 64;
    const int row0 = qb * BLOCK_Q + r_loc0, key0 = kb * BLOCK_KV;
    const int n_rows = d.n_q - row0, n_keys = d.n_k - key0 - k_loc0;
    const long q_off = ((long)bh * d.n_q + row0) * HEAD_DIM;
    const long k_off = ((long)bh_kv * d.n_k + key0 + k_loc0) * HEAD_DIM;
    const bool int8_qk = p.flags & F_QK_BWD, int8_dp = p.flags & F_DP, smooth_q = p.flags & F_SMOOTH_Q;
    const float s_qk = __fmul_rn(__fmul_rn(p.op.q_scale[bh * d.n_qblk + qb], p.c_lambda), p.op.k_scale[bh_kv * d.n_kblk + kb]);
    const float s_do = p.do_scale[bh * d.n_qblk + qb], s_v = p.v_scale[bh_kv * d.n_kblk + kb];
    const View vq8 = view(p.op.q_hat + q_off, HEAD_DIM, 1, n_rows, HEAD_DIM);
    const View vk8 = view(p.op.k_hat + k_off, HEAD_DIM, 1, n_keys, HEAD_DIM);
    const View vq = view(p.op.q + q_off, HEAD_DIM, 1, n_rows, HEAD_DIM);
    const View vk = view(p.op.k + k_off, HEAD_DIM, 1, n_keys, HEAD_DIM);
    const View vdo8 = view(p.do_hat + q_off, HEAD_DIM, 1, n_rows, HEAD_DIM);
    const View vv8 = view(p.v_hat + k_off, HEAD_DIM, 1, n_keys, HEAD_DIM);
    const View vdo = view(p.d_o + q_off, HEAD_DIM, 1, n_rows, HEAD_DIM);
    const View vv = view(p.v + k_off, HEAD_DIM, 1, n_keys, HEAD_DIM);
    float amax_p = 0.0f, amax_ds = 0.0f;
#pragma unroll 1
    for (int nt = 0; nt < 8; ++nt) {
        float t[4], dp[4];
        if (int8_qk) {
            int acc[4] = {0, 0, 0, 0};
            tile_s8(acc, ReadI8(), vq8, 0, ReadI8(), vk8, nt * 8, HEAD_DIM);
            for (int e = 0; e < 4; ++e) {
                t[e] = __fmul_rn((float)acc[e], s_qk);
                if (smooth_q) t[e] = __fadd_rn(t[e], __fmul_rn(p.c_lambda, s.beta[k_loc0 + nt * 8 + c_col(e)]));
            }
        } else {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_bf16(acc, ReadBf16(), vq, 0, ReadBf16(), vk, nt * 8, HEAD_DIM);
            for (int e = 0; e < 4; ++e) t[e] = __fmul_rn(p.c_lambda, acc[e]);
        }
        if (int8_dp) {
            int acc[4] = {0, 0, 0, 0};
            tile_s8(acc, ReadI8(), vdo8, 0, ReadI8(), vv8, nt * 8, HEAD_DIM);
            for (int e = 0; e < 4; ++e) dp[e] = dequant(acc[e], s_do, s_v);
        } else {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_bf16(acc, ReadBf16(), vdo, 0, ReadBf16(), vv, nt * 8, HEAD_DIM);
            for (int e = 0; e < 4; ++e) dp[e] = acc[e];
        }
        for (int e = 0; e < 4; ++e) {
            const int rl = r_loc0 + c_row(e), jl = k_loc0 + nt * 8 + c_col(e);
            float prob = 0.0f, ds = 0.0f;
            if (visible(d, qb * BLOCK_Q + rl, key0 + jl)) {
                prob = exp2f(__fsub_rn(t[e], s.lse2[rl]));
                ds = __fmul_rn(prob, __fsub_rn(dp[e], s.delta[rl]));
            }
            s.p[rl][jl] = prob;
            s.ds[rl][jl] = ds;
            amax_p = fmaxf(amax_p, prob);
            amax_ds = fmaxf(amax_ds, fabsf(ds));
        }
    }
    TileScales sc;
    sc.p = group_scale(block_max(amax_p, s.scratch));
    sc.ds = group_scale(block_max(amax_ds, s.scratch));
    return sc;
}

// Phase 3: dV += Pᵀ dO (#4) and dK += dSᵀ Q (#7) for the warp's 16 keys.
__device__ void mma_tile_dv_dk(const BackwardParams& p, BackwardShared& s, const TileScales& sc, float (*dv)[4],
                               float (*dk)[4], int bh, int qb) {
    const Dims& d = p.dims;
    const int warp = threadIdx.x >> 5, k_loc0 = warp * 16;
    const int n_rows = d.n_q - qb * BLOCK_Q;
    // A(m = key, k = query row) = P[row][key], dS[row][key]: transposed views of the tiles.
    const View vpt = view(&s.p[0][k_loc0], 1, BLOCK_KV, 16, BLOCK_Q);
    const View vdst = view(&s.ds[0][k_loc0], 1, BLOCK_KV, 16, BLOCK_Q);
    // B(k = query row, n = column c), from the transposed copies (rows contiguous).
    const long t_off = (long)bh * HEAD_DIM * d.n_qpad + qb * BLOCK_Q;
    const View vdo8 = view(p.tr.do_hat_t + t_off, d.n_qpad, 1, HEAD_DIM, n_rows);
    const View vdo = view(p.tr.do_t + t_off, d.n_qpad, 1, HEAD_DIM, n_rows);
    const View vq8 = view(p.tr.q_hat_t + t_off, d.n_qpad, 1, HEAD_DIM, n_rows);
    const View vq = view(p.tr.q_t + t_off, d.n_qpad, 1, HEAD_DIM, n_rows);
    const float s_do = p.do_scale[bh * d.n_qblk + qb], s_q = p.op.q_scale[bh * d.n_qblk + qb];
    ReadF32Quant p_hat, ds_hat;
    p_hat.inv = sc.p.inv;
    ds_hat.inv = sc.ds.inv;
    const bool int8_dv = p.flags & F_DV, int8_dk = p.flags & F_DK, smooth_q = p.flags & F_SMOOTH_Q;
    // dV: the warp's Pᵀ fragments (P̂ᵀ or bf16(P)ᵀ) are gathered once and reused for every column tile.
    if (int8_dv) {
        u32 pa[BLOCK_Q / 32][4];
        frags_a_s8<BLOCK_Q>(pa, p_hat, vpt, 0);
#pragma unroll
        for (int nt = 0; nt < BWD_O_TILES; ++nt) {
            int acc[4] = {0, 0, 0, 0};
            tile_s8_a<BLOCK_Q>(acc, pa, ReadI8(), vdo8, nt * 8);
#pragma unroll
            for (int e = 0; e < 4; ++e) dv[nt][e] = __fadd_rn(dv[nt][e], dequant(acc[e], sc.p.scale, s_do));
        }
    } else {
        u32 pa[BLOCK_Q / 16][4];
        frags_a_bf16<BLOCK_Q>(pa, ReadF32Bf16(), vpt, 0);
#pragma unroll
        for (int nt = 0; nt < BWD_O_TILES; ++nt) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_bf16_a<BLOCK_Q>(acc, pa, ReadBf16(), vdo, nt * 8);
#pragma unroll
            for (int e = 0; e < 4; ++e) dv[nt][e] = __fadd_rn(dv[nt][e], acc[e]);
        }
    }
    // dK: likewise with dSᵀ.
    if (int8_dk) {
        u32 da[BLOCK_Q / 32][4];
        frags_a_s8<BLOCK_Q>(da, ds_hat, vdst, 0);
#pragma unroll
        for (int nt = 0; nt < BWD_O_TILES; ++nt) {
            int acc[4] = {0, 0, 0, 0};
            tile_s8_a<BLOCK_Q>(acc, da, ReadI8(), vq8, nt * 8);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                dk[nt][e] = __fadd_rn(dk[nt][e], dequant(acc[e], sc.ds.scale, s_q));
                if (smooth_q)
                    dk[nt][e] = __fadd_rn(dk[nt][e], __fmul_rn(s.colsum[k_loc0 + c_row(e)], s.q_mean[nt * 8 + c_col(e)]));
            }
        }
    } else {
        u32 da[BLOCK_Q / 16][4];
        frags_a_bf16<BLOCK_Q>(da, ReadF32Bf16(), vdst, 0);
#pragma unroll
        for (int nt = 0; nt < BWD_O_TILES; ++nt) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_bf16_a<BLOCK_Q>(acc, da, ReadBf16(), vq, nt * 8);
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[nt][e] = __fadd_rn(dk[nt][e], acc[e]);
        }
    }
}

// Adds one 16 × 8 dQ tile (rows qb·64 + r_loc0.., columns col0..) to the FP32 accumulator.
__device__ __forceinline__ void add_dq(const BackwardParams& p, const float* val, int bh, int qb, int r_loc0, int col0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int r = qb * BLOCK_Q + r_loc0 + c_row(e);
        if (r < p.dims.n_q) atomicAdd(p.dq_acc + ((long)bh * p.dims.n_q + r) * HEAD_DIM + col0 + c_col(e), val[e]);
    }
}

// Phase 4: dQ += dS K (#6) for query rows 16(w mod 4).. and half of the columns, atomically added.
__device__ void mma_tile_dq(const BackwardParams& p, BackwardShared& s, const TileScales& sc, int bh, int bh_kv,
                            int qb, int kb) {
    const Dims& d = p.dims;
    const int warp = threadIdx.x >> 5, r_loc0 = (warp & 3) * 16, c0 = (warp >> 2) * (HEAD_DIM / 2);
    const int key0 = kb * BLOCK_KV, n_keys = d.n_k - key0;
    const long t_off = (long)bh_kv * HEAD_DIM * d.n_kpad + key0;
    const View vds = view(&s.ds[r_loc0][0], BLOCK_KV, 1, 16, BLOCK_KV);
    const View vk8 = view(p.tr.k_hat_t + t_off, d.n_kpad, 1, HEAD_DIM, n_keys);  // B(k = key, n = c)
    const View vk = view(p.tr.k_t + t_off, d.n_kpad, 1, HEAD_DIM, n_keys);
    const float s_k = p.op.k_scale[bh_kv * d.n_kblk + kb];
    ReadF32Quant ds_hat;
    ds_hat.inv = sc.ds.inv;
    const bool int8_dq = p.flags & F_DQ;
    // The warp's dS fragments (dŜ or bf16(dS)) are gathered once and reused for every column tile.
    if (int8_dq) {
        u32 da[BLOCK_KV / 32][4];
        frags_a_s8<BLOCK_KV>(da, ds_hat, vds, 0);
#pragma unroll
        for (int nt = 0; nt < BWD_O_TILES / 2; ++nt) {
            int acc[4] = {0, 0, 0, 0};
            tile_s8_a<BLOCK_KV>(acc, da, ReadI8(), vk8, c0 + nt * 8);
            float val[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) val[e] = dequant(acc[e], sc.ds.scale, s_k);
            add_dq(p, val, bh, qb, r_loc0, c0 + nt * 8);
        }
    } else {
        u32 da[BLOCK_KV / 16][4];
        frags_a_bf16<BLOCK_KV>(da, ReadF32Bf16(), vds, 0);
#pragma unroll
        for (int nt = 0; nt < BWD_O_TILES / 2; ++nt) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_bf16_a<BLOCK_KV>(acc, da, ReadBf16(), vk, c0 + nt * 8);
            add_dq(p, acc, bh, qb, r_loc0, c0 + nt * 8);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_mma(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    require_dynamic_smem((u32)sizeof(BackwardShared));
    BackwardShared& s = *reinterpret_cast<BackwardShared*>(smem_raw);

    const int kb = blockIdx.x, bh = blockIdx.y;
    const int bh_kv = kv_head_of(p.dims, bh);

    float dv[BWD_O_TILES][4], dk[BWD_O_TILES][4];
#pragma unroll
    for (int nt = 0; nt < BWD_O_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv[nt][e] = dk[nt][e] = 0.0f;

    for (int qb = query_block_begin(p.dims, kb); qb < p.dims.n_qblk; ++qb) {
        load_row_state(p, s, bh, bh_kv, qb, kb);
        const TileScales sc = mma_tile_p_ds(p, s, bh, bh_kv, qb, kb);  // ends with a barrier
        tile_ds_sums(p, s, bh, qb);
        mma_tile_dv_dk(p, s, sc, dv, dk, bh, qb);
        mma_tile_dq(p, s, sc, bh, bh_kv, qb, kb);
        __syncthreads();  // the tiles are overwritten by the next query block
    }

    const int key_base = kb * BLOCK_KV + (threadIdx.x >> 5) * 16;
#pragma unroll
    for (int nt = 0; nt < BWD_O_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = key_base + c_row(e);
            if (j >= p.dims.n_k) continue;
            const long idx = ((long)bh * p.dims.n_k + j) * HEAD_DIM + nt * 8 + c_col(e);
            p.dk_acc[idx] = dk[nt][e];
            p.dv_acc[idx] = dv[nt][e];
        }
}
