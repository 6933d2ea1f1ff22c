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

// ---------------------------------------------------------------------------------------------
// The staged path for the sagebwd product mix (#3, #4, #6, #7 INT8, #5 BF16; no Q-smoothing, no dQ
// correction): the same arithmetic as mma_tile_*, reorganised around the key block.
//
// - Stationary for the whole query loop (loaded once by cp.async): the K̂ tile [128 keys][d] (A of
//   Sᵀ), the K̂ᵀ tile [d][128 keys] (B of dQ) and the BF16 V tile [128 keys][d] (A of dPᵀ).
// - Per query block, double-buffered by cp.async (block qb + 1 loads while qb computes): Q̂ [64][d]
//   (B of Sᵀ), dO [64][d] BF16 (B of dPᵀ), dÔᵀ [d][64] (B of dV), Q̂ᵀ [d][64] (B of dK), and the
//   rows' L = lse2 − b_r and D by plain loads.
// - Warp w owns keys 16w..16w+15 and computes the transposed tile Sᵀ = K̂ Q̂ᵀ, dPᵀ = V dOᵀ (16 keys ×
//   64 query rows) in registers; P and dS stay in registers and, once the block knows the tile's
//   amax, become P̂ᵀ and dŜᵀ as the A fragments of dV = P̂ᵀ dÔ and dK = dŜᵀ Q̂ directly. The query
//   rows are fed to ldmatrix in the forward's permuted order (accumulator column n of n-tile nt is
//   row qrow_of(nt, n)), which makes the accumulator layout equal the m16n8k32 A layout.
// - dŜ goes once through shared memory (bytes, [64 rows][128 keys], swizzled) for dQ = dŜ K̂: warp w
//   then owns rows 16(w mod 4).. × half of d and adds its tile to the FP32 accumulator with 8-byte
//   vector reductions.
// Two barriers per tile: operands (and the previous dŜ) ready; the tile's amax.
// All operand tiles use XOR-swizzled 16-byte chunks, chosen so that each ldmatrix phase (8 rows of
// one chunk column) and each dŜ byte store hits 8 distinct bank groups.

#define BF_QT (BLOCK_Q * HEAD_DIM)           // bytes of the Q̂ (also dÔᵀ, Q̂ᵀ) stage tile
#define BF_KT (BLOCK_KV * HEAD_DIM)          // bytes of the K̂ (also K̂ᵀ) tile
#define BF_OFF_KT BF_KT
#define BF_OFF_V (2 * BF_KT)
#define BF_OFF_STAGE (4 * BF_KT)             // after K̂, K̂ᵀ and V (2·BF_KT bytes)
#define BF_ST_DO BF_QT                       // offsets inside one stage
#define BF_ST_DOT (3 * BF_QT)
#define BF_ST_QT (4 * BF_QT)
#define BF_ST_ROWS (5 * BF_QT)               // float L[64], D[64]
#define BF_STAGE_BYTES (5 * BF_QT + 2 * BLOCK_Q * 4)
#define BF_OFF_DS (BF_OFF_STAGE + 2 * BF_STAGE_BYTES)
#define BF_OFF_RED (BF_OFF_DS + 2 * BLOCK_Q * BLOCK_KV)  // dŜ double-buffered by query-block parity
#define BWD_FAST_SMEM_BYTES (BF_OFF_RED + 2 * (THREADS / 32) * 4)
#define BWD_GATHER_SMEM_BYTES ((int)sizeof(BackwardShared))

// Whether the staged path takes these flags (the host's `staged_backward` in src/backward.rs).
__device__ __forceinline__ bool bwd_fast_path(int flags) {
    const int mask = F_QK_BWD | F_DV | F_DP | F_DQ | F_DK | F_SMOOTH_Q | F_DQ_CORR;
    return (flags & mask) == (F_QK_BWD | F_DV | F_DQ | F_DK);
}

// Swizzles (common.cuh): physical 16-byte chunk of logical chunk c in row `row` of each tile.
// K̂ / V (A operands, ldmatrix reads 8 consecutive keys per chunk column): natural row order.
__device__ __forceinline__ int swz_key_i8(int row, int c) { return swz_i8_rows8(row, c); }
__device__ __forceinline__ int swz_key_bf16(int row, int c) { return swz_rows8(row, c); }
// Q̂ / dO (B operands read in the permuted row order: rows base + {0, 1, 4, 5, 8, 9, 12, 13}).
__device__ __forceinline__ int swz_qrow_i8(int row, int c) { return swz_i8_permuted(row, c); }
__device__ __forceinline__ int swz_qrow_bf16(int row, int c) { return swz_permuted(row, c); }
// dÔᵀ / Q̂ᵀ: [d][64] (64-byte rows); K̂ᵀ: [d][128] (128-byte rows).
__device__ __forceinline__ int swz_t64(int row, int c) { return swz_rows8_half(row, c); }
__device__ __forceinline__ int swz_t128(int row, int c) { return swz_rows8(row, c); }
// dŜ [64][128] bytes: conflict-free for ldmatrix (8 consecutive rows) and for the byte stores of
// one instruction (rows r0 + 4t, t = 0..3).
__device__ __forceinline__ int swz_ds(int row, int c) { return c ^ ((row & 7) ^ ((row >> 2) & 2)); }

// Query row (0..63) of accumulator column n of n-tile nt in the permuted order (as the forward's keys).
__device__ __forceinline__ int qrow_of(int nt, int n) { return 16 * (nt >> 1) + 2 * (nt & 1) + 4 * (n >> 1) + (n & 1); }

struct SwzKeyI8 { __device__ int operator()(int r, int c) const { return swz_key_i8(r, c); } };
struct SwzKeyBf16 { __device__ int operator()(int r, int c) const { return swz_key_bf16(r, c); } };
struct SwzQrowI8 { __device__ int operator()(int r, int c) const { return swz_qrow_i8(r, c); } };
struct SwzQrowBf16 { __device__ int operator()(int r, int c) const { return swz_qrow_bf16(r, c); } };
struct SwzT64 { __device__ int operator()(int r, int c) const { return swz_t64(r, c); } };
struct SwzT128 { __device__ int operator()(int r, int c) const { return swz_t128(r, c); } };

// Copies ROWS rows of CH 16-byte chunks (source stride `stride` bytes) into a swizzled tile; rows
// ≥ valid_rows are zero-filled without reading. Unrolled: every thread copies ROWS·CH/THREADS chunks.
template <int ROWS, int CH, class Swz>
__device__ __forceinline__ void stage_rows(u32 dst, const void* src, long stride, int valid_rows, Swz swz) {
    static_assert((ROWS * CH) % THREADS == 0 && THREADS % CH == 0, "stage_rows: tile does not split evenly");
    const unsigned char* s = (const unsigned char*)src;
    const int c = threadIdx.x % CH, row0 = threadIdx.x / CH;
#pragma unroll
    for (int k = 0; k < ROWS * CH / THREADS; ++k) {
        const int row = row0 + k * (THREADS / CH);
        const bool valid = row < valid_rows;
        cp_async16(dst + row * CH * 16 + swz(row, c) * 16, valid ? s + row * stride + c * 16 : s, valid);
    }
}

// The key block's stationary tiles: K̂, K̂ᵀ, V (rows past n_k zero; K̂ᵀ columns past n_k are read as
// they are and meet dŜ = 0).
__device__ void stage_key_block(const BackwardParams& p, u32 smem, int bh_kv, int kb) {
    const Dims& d = p.dims;
    const int key0 = kb * BLOCK_KV, valid = d.n_k - key0;
    const long row0 = (long)bh_kv * d.n_k + key0;
    stage_rows<BLOCK_KV, HEAD_DIM / 16>(smem, p.op.k_hat + row0 * HEAD_DIM, HEAD_DIM, valid, SwzKeyI8());
    stage_rows<HEAD_DIM, BLOCK_KV / 16>(smem + BF_OFF_KT, p.tr.k_hat_t + (long)bh_kv * HEAD_DIM * d.n_kpad + key0,
                                        d.n_kpad, HEAD_DIM, SwzT128());
    stage_rows<BLOCK_KV, HEAD_DIM / 8>(smem + BF_OFF_V, p.v + row0 * HEAD_DIM, 2 * HEAD_DIM, valid, SwzKeyBf16());
}

// Query block qb's operand tiles into stage `st` (Q̂, dO rows past n_q zero; the transposed copies
// are n_qpad long, entries past n_q meet P̂ = dŜ = 0).
__device__ void stage_query_block(const BackwardParams& p, u32 st, int bh, int qb) {
    const Dims& d = p.dims;
    const int row0 = qb * BLOCK_Q, valid = d.n_q - row0;
    const long q_off = ((long)bh * d.n_q + row0) * HEAD_DIM;
    const long t_off = (long)bh * HEAD_DIM * d.n_qpad + row0;
    stage_rows<BLOCK_Q, HEAD_DIM / 16>(st, p.op.q_hat + q_off, HEAD_DIM, valid, SwzQrowI8());
    stage_rows<BLOCK_Q, HEAD_DIM / 8>(st + BF_ST_DO, p.d_o + q_off, 2 * HEAD_DIM, valid, SwzQrowBf16());
    stage_rows<HEAD_DIM, BLOCK_Q / 16>(st + BF_ST_DOT, p.tr.do_hat_t + t_off, d.n_qpad, HEAD_DIM, SwzT64());
    stage_rows<HEAD_DIM, BLOCK_Q / 16>(st + BF_ST_QT, p.tr.q_hat_t + t_off, d.n_qpad, HEAD_DIM, SwzT64());
}

// L = fl(lse2 − b_r) (INT8 #3) and D of row `rl` of query block qb (threads 0..63); L = +∞, D = 0
// past n_q, so that P = exp2(t − L) = 0 and dS = 0 there without a mask.
struct RowConsts {
    float L, D;
};
__device__ __forceinline__ RowConsts load_row_consts(const BackwardParams& p, int bh, int qb, int rl) {
    RowConsts rc;
    rc.L = pos_inf();
    rc.D = 0.0f;
    const int r = qb * BLOCK_Q + rl;
    if (r < p.dims.n_q) {
        const long row = (long)bh * p.dims.n_q + r;
        rc.L = __fsub_rn(p.lse2[row], p.op.row_offset[row]);
        rc.D = p.delta[row];
    }
    return rc;
}

// Block-wide max of two non-negative values; `red` holds 2·(THREADS/32) floats. The caller's
// barriers keep `red` from being rewritten before everyone has read it (see sage_bwd_main_fast).
__device__ __forceinline__ void block_max2(float& a, float& b, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, o));
    }
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        red[warp] = a;
        red[THREADS / 32 + warp] = b;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) {
        a = fmaxf(a, red[w]);
        b = fmaxf(b, red[THREADS / 32 + w]);
    }
}

// Sᵀ (INT32) and dPᵀ (FP32) of the warp's 16 keys × the 64 rows of the stage, permuted row order.
// Every ldmatrix address is a per-lane base plus a compile-time offset: the swizzle term of a lane
// does not depend on the n-tile (the rows qrow_of(nt, r) of one lane agree in the bits it uses).
__device__ __forceinline__ void tile_st_dpt(u32 smem, u32 st, int (*s_acc)[4], float (*dp)[4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
    const int key_row = warp * 16 + (mi & 1) * 8 + r;  // A rows (ldmatrix matrices 0/1: keys 0-7 / 8-15)
    const int q_row = qrow_of(0, r);                    // B rows of n-tile 0; n-tile nt adds qrow_of(nt, 0)
#if HEAD_DIM == 128
    const int key_x = r, q_x = r;  // swz_key_i8 / swz_qrow_i8 terms of this lane's rows
#else
    const int key_x = r >> 1, q_x = r >> 1;
#endif
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s_acc[nt][e] = 0;
            dp[nt][e] = 0.0f;
        }
    // Sᵀ = K̂ Q̂ᵀ, two k-steps (64 of d) per ldmatrix of B.
    const u32 ka_base = smem + key_row * HEAD_DIM, qb_base = st + q_row * HEAD_DIM;
#pragma unroll
    for (int cg = 0; cg < HEAD_DIM / 64; ++cg) {
        u32 ka[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) ldmatrix_x4(ka[h], ka_base + (((4 * cg + 2 * h + (mi >> 1)) ^ key_x) << 4));
        const u32 b_lane = qb_base + (((4 * cg + mi) ^ q_x) << 4);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            u32 b[4];
            ldmatrix_x4(b, b_lane + qrow_of(nt, 0) * HEAD_DIM);
            mma_s8(s_acc[nt], ka[0], b);
            mma_s8(s_acc[nt], ka[1], b + 2);
        }
    }
    // dPᵀ = V dOᵀ (BF16, FP32 sums in any order), two k-steps (32 of d) per ldmatrix of B.
    const u32 va_base = smem + BF_OFF_V + key_row * 2 * HEAD_DIM, do_base = st + BF_ST_DO + q_row * 2 * HEAD_DIM;
#pragma unroll
    for (int cg = 0; cg < HEAD_DIM / 32; ++cg) {
        u32 va[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) ldmatrix_x4(va[h], va_base + (((4 * cg + 2 * h + (mi >> 1)) ^ r) << 4));
        const u32 b_lane = do_base + (((4 * cg + mi) ^ r) << 4);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            u32 b[4];
            ldmatrix_x4(b, b_lane + qrow_of(nt, 0) * 2 * HEAD_DIM);
            mma_bf16(dp[nt], va[0], b);
            mma_bf16(dp[nt], va[1], b + 2);
        }
    }
}

// acc[nd] (16 keys × 8 columns per d-tile) = A (the warp's P̂ᵀ or dŜᵀ, 16 keys × 64 rows) · B, B
// from a [d][64] stage tile (dÔᵀ or Q̂ᵀ); out[nd][e] = fl(out + fl(float(acc)·scale)).
__device__ __forceinline__ void tile_key_product(u32 bt, const u32 (*a)[4], float scale, float (*out)[4]) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd) {
        const int row = nd * 8 + r;
        u32 b[4];
        ldmatrix_x4(b, bt + row * BLOCK_Q + (swz_t64(row, mi) << 4));
        int acc[4] = {0, 0, 0, 0};
        mma_s8(acc, a[0], b);
        mma_s8(acc, a[1], b + 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) out[nd][e] = __fadd_rn(out[nd][e], __fmul_rn(i2f_exact(acc[e]), scale));
    }
}

// dQ += dŜ K̂ for rows 16(w mod 4).. and columns (w div 4)·d/2.. of the tile (dŜ at shared address
// ds_tile), by vector reductions into the FP32 accumulator (rows past n_q skipped).
__device__ __forceinline__ void tile_dq_fast(const BackwardParams& p, u32 smem, u32 ds_tile, float scale, int bh,
                                             int qb) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
    const int r_loc0 = (warp & 3) * 16, c0 = (warp >> 2) * (HEAD_DIM / 2);
    const int a_row = r_loc0 + (mi & 1) * 8 + r;
    u32 da[BLOCK_KV / 32][4];
#pragma unroll
    for (int ks = 0; ks < BLOCK_KV / 32; ++ks)
        ldmatrix_x4(da[ks], ds_tile + a_row * BLOCK_KV + (swz_ds(a_row, 2 * ks + (mi >> 1)) << 4));
    const int g = lane >> 2, t = lane & 3;
    const int r_lo = qb * BLOCK_Q + r_loc0 + g, r_hi = r_lo + 8;
    float* dq_lo = p.dq_acc + ((long)bh * p.dims.n_q + r_lo) * HEAD_DIM + c0 + 2 * t;
    float* dq_hi = dq_lo + 8 * HEAD_DIM;
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 16; ++nd) {
        const int row = c0 + nd * 8 + r;  // K̂ᵀ row = column of dQ
        int acc[4] = {0, 0, 0, 0};
#pragma unroll
        for (int cg = 0; cg < BLOCK_KV / 64; ++cg) {
            u32 b[4];
            ldmatrix_x4(b, smem + BF_OFF_KT + row * BLOCK_KV + (swz_t128(row, 4 * cg + mi) << 4));
            mma_s8(acc, da[2 * cg], b);
            mma_s8(acc, da[2 * cg + 1], b + 2);
        }
        if (r_lo < p.dims.n_q)
            red_add_f32x2(dq_lo + nd * 8, __fmul_rn(i2f_exact(acc[0]), scale), __fmul_rn(i2f_exact(acc[1]), scale));
        if (r_hi < p.dims.n_q)
            red_add_f32x2(dq_hi + nd * 8, __fmul_rn(i2f_exact(acc[2]), scale), __fmul_rn(i2f_exact(acc[3]), scale));
    }
}

__device__ void sage_bwd_main_fast(const BackwardParams& p, unsigned char* smem_ptr) {
    const Dims& d = p.dims;
    const int kb = blockIdx.x, bh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int bh_kv = kv_head_of(d, bh);
    const u32 smem = smem_addr(smem_ptr);
    float* red = (float*)(smem_ptr + BF_OFF_RED);
    const int key0 = kb * BLOCK_KV, wkey0 = key0 + warp * 16;
    const float s_k = p.op.k_scale[bh_kv * d.n_kblk + kb];

    float dv[HEAD_DIM / 8][4], dk[HEAD_DIM / 8][4];
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv[nd][e] = dk[nd][e] = 0.0f;

    const int qb0 = query_block_begin(d, kb);
    if (qb0 < d.n_qblk) {
        stage_key_block(p, smem, bh_kv, kb);
        stage_query_block(p, smem + BF_OFF_STAGE, bh, qb0);
    }
    cp_async_commit();
    if (threadIdx.x < BLOCK_Q && qb0 < d.n_qblk) {
        const RowConsts rc = load_row_consts(p, bh, qb0, threadIdx.x);
        float* rows = (float*)(smem_ptr + BF_OFF_STAGE + BF_ST_ROWS);
        rows[threadIdx.x] = rc.L;
        rows[BLOCK_Q + threadIdx.x] = rc.D;
    }

    // Two barriers per tile. dŜ of block qb is complete at barrier (a) of block qb + 1, so dQ of block
    // qb − 1 runs at the end of iteration qb (where few registers are live), from the other dŜ buffer.
    // Block qb + 1 is staged after (a), when every warp is done with its buffer (read last by qb − 1).
    float dq_scale = 0.0f;  // fl(s_dŜ·s_K) of the pending dQ tile
    for (int qb = qb0; qb < d.n_qblk; ++qb) {
        const int buf = (qb - qb0) & 1;
        const u32 st = smem + BF_OFF_STAGE + buf * BF_STAGE_BYTES;
        const bool has_next = qb + 1 < d.n_qblk;
        const float s_q = p.op.q_scale[bh * d.n_qblk + qb], s_do = p.do_scale[bh * d.n_qblk + qb];
        const float s_qk = __fmul_rn(__fmul_rn(s_q, p.c_lambda), s_k);  // fl(fl(s_Q·cλ)·s_K), §4
        cp_async_wait<0>();  // this thread's copies of block qb are done
        __syncthreads();     // (a) everyone's copies, row constants and dŜ of block qb − 1 are visible
        if (has_next) stage_query_block(p, smem + BF_OFF_STAGE + (buf ^ 1) * BF_STAGE_BYTES, bh, qb + 1);
        cp_async_commit();
        RowConsts next_rc = {pos_inf(), 0.0f};
        if (has_next && threadIdx.x < BLOCK_Q) next_rc = load_row_consts(p, bh, qb + 1, threadIdx.x);

        // Sᵀ, dPᵀ → P, dS in registers (permuted rows), with the tile's amax.
        int s_acc[8][4];
        float ds[8][4];
        tile_st_dpt(smem, st, s_acc, ds);
        const float* rows = (const float*)(smem_ptr + BF_OFF_STAGE + buf * BF_STAGE_BYTES + BF_ST_ROWS);
        const int last_key = wkey0 + 15;
        const bool need_mask = last_key >= d.n_k || (d.causal && last_key > qb * BLOCK_Q + (d.n_k - d.n_q));
        float prob[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int rl = qrow_of(nt, 2 * t);  // rows rl, rl + 1 (even: one 8-byte load each)
            const float2 L = *(const float2*)(rows + rl), D = *(const float2*)(rows + BLOCK_Q + rl);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float t_score = __fmul_rn((float)s_acc[nt][e], s_qk);
                prob[nt][e] = exp2f(__fsub_rn(t_score, (e & 1) ? L.y : L.x));                       // exp2(t − L)
                ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D.y : D.x));  // fl(P·fl(dP − D))
            }
        }
        if (need_mask) {  // warp-uniform: only tiles on the diagonal or past n_k
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!visible(d, qb * BLOCK_Q + qrow_of(nt, 2 * t + (e & 1)), wkey0 + g + 8 * (e >> 1)))
                        prob[nt][e] = ds[nt][e] = 0.0f;
        }
        float amax_p = 0.0f, amax_ds = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                amax_p = fmaxf(amax_p, prob[nt][e]);
                amax_ds = fmaxf(amax_ds, fabsf(ds[nt][e]));
            }
        block_max2(amax_p, amax_ds, red);  // (b)
        const GroupScale sc_p = group_scale(amax_p), sc_ds = group_scale(amax_ds);

        // P̂ᵀ, dŜᵀ as A fragments (k-step s: rows 32s.., see qrow_of); dŜ bytes to shared memory.
        u32 pa[2][4], da[2][4];
        // dŜ byte addresses of this lane for rows 4t + 2b + x (b = n-tile parity, x = column parity)
        // at key 16w + g; other n-tiles and keys g + 8 are compile-time offsets (16 rows keep the
        // swizzle term).
        unsigned char* ds_out[4];
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int row = 4 * t + 2 * b + x;
                ds_out[2 * b + x] = smem_ptr + BF_OFF_DS + buf * (BLOCK_Q * BLOCK_KV) + row * BLOCK_KV +
                                    (swz_ds(row, warp) << 4) + g;
            }
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int n0 = 4 * s + 2 * half;
                    pa[s][2 * half + h] = pack_lo_bytes(
                        quant_bits(prob[n0][2 * h], sc_p.inv), quant_bits(prob[n0][2 * h + 1], sc_p.inv),
                        quant_bits(prob[n0 + 1][2 * h], sc_p.inv), quant_bits(prob[n0 + 1][2 * h + 1], sc_p.inv));
                    u32 qd[4] = {quant_bits(ds[n0][2 * h], sc_ds.inv), quant_bits(ds[n0][2 * h + 1], sc_ds.inv),
                                 quant_bits(ds[n0 + 1][2 * h], sc_ds.inv), quant_bits(ds[n0 + 1][2 * h + 1], sc_ds.inv)};
                    da[s][2 * half + h] = pack_lo_bytes(qd[0], qd[1], qd[2], qd[3]);
                    // The same four bytes into dŜ[row][key]: key 16w + g + 8h, rows qrow_of(n, 2t + {0,1}).
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        ds_out[(i >> 1) * 2 + (i & 1)][16 * (n0 >> 1) * BLOCK_KV + 8 * h] = (unsigned char)qd[i];
                }

        // dV += P̂ᵀ dÔ (#4), dK += dŜᵀ Q̂ (#7), per-tile scales (§2.3).
        tile_key_product(st + BF_ST_DOT, pa, __fmul_rn(sc_p.scale, s_do), dv);
        tile_key_product(st + BF_ST_QT, da, __fmul_rn(sc_ds.scale, s_q), dk);
        if (has_next && threadIdx.x < BLOCK_Q) {
            float* nrows = (float*)(smem_ptr + BF_OFF_STAGE + (buf ^ 1) * BF_STAGE_BYTES + BF_ST_ROWS);
            nrows[threadIdx.x] = next_rc.L;
            nrows[BLOCK_Q + threadIdx.x] = next_rc.D;
        }
        if (qb > qb0) tile_dq_fast(p, smem, smem + BF_OFF_DS + (buf ^ 1) * (BLOCK_Q * BLOCK_KV), dq_scale, bh, qb - 1);
        dq_scale = __fmul_rn(sc_ds.scale, s_k);
    }
    cp_async_wait<0>();
    __syncthreads();  // dŜ of the last block complete
    if (qb0 < d.n_qblk)
        tile_dq_fast(p, smem, smem + BF_OFF_DS + ((d.n_qblk - 1 - qb0) & 1) * (BLOCK_Q * BLOCK_KV), dq_scale, bh, d.n_qblk - 1);

#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = wkey0 + g + 8 * h;
            if (j >= d.n_k) continue;
            const long idx = ((long)bh * d.n_k + j) * HEAD_DIM + nd * 8 + 2 * t;
            *(float2*)(p.dk_acc + idx) = make_float2(dk[nd][2 * h], dk[nd][2 * h + 1]);
            *(float2*)(p.dv_acc + idx) = make_float2(dv[nd][2 * h], dv[nd][2 * h + 1]);
        }
}

// Both paths take their shared memory from the dynamic allocation (`backward_smem_bytes` in
// src/backward.rs); a launch with less traps rather than corrupt memory.
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_mma(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    if (bwd_fast_path(p.flags)) {
        require_dynamic_smem((u32)BWD_FAST_SMEM_BYTES);
        sage_bwd_main_fast(p, smem_raw);
        return;
    }
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
