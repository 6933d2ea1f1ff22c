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
    float* dk_acc;          // [B, Hq, Nk, d], written whole (null with dk_out)
    float* dv_acc;          // [B, Hq, Nk, d], written whole (null with dv_out)
    // [B, Hkv, Nk, d] BF16: set only for a staged path without GQA (H_q = H_kv), where one block
    // holds the whole dK, dV of its keys; the block then writes the postprocess's result itself.
    u16* dk_out;
    u16* dv_out;
    Dims dims;
    int flags;
    float c_lambda;
    float c;                // softmax scale 1/sqrt(d) (dK = fl(c·Σ dK))
};
// Layout contract with src/backward.rs (which asserts the same size).
static_assert(sizeof(BackwardParams) == 304, "BackwardParams layout changed: update src/backward.rs");

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

// P = exp2(t − lse2) (INT8 #3 fused, §5), dP (#5), dS = fl(P·fl(dP − D)) for the tile; returns the per-tile scales.
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
            // t = fl(a·sc) (§4); P = exp2(fma(a, sc, −L)) for INT8 #3 (bfma24, §5), fma(t, 1, −L) = fl(t − L) otherwise.
            const float a = score_factor(p.op, int8_qk, q_row, k_row, bh * p.dims.n_qblk + qb,
                                         bh_kv * p.dims.n_kblk + kb, p.c_lambda, smooth_q, s.beta[jl]);
            const float sc = score_scale(p.op, int8_qk, bh * p.dims.n_qblk + qb, bh_kv * p.dims.n_kblk + kb,
                                         p.c_lambda, smooth_q);
            prob = exp2_ftz(__fmaf_rn(a, sc, -s.lse2[rl]));
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
            dv[i] = dequant_add(acc, sc.p.scale, s_do, dv[i]);
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
            dk[i] = dequant_add(acc, sc.ds.scale, s_q, dk[i]);
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
        float sc = 1.0f;  // t = fl(t·sc) below: the factor a and its scale for INT8 #3 (bfma24, §5), else t itself and 1
        if (int8_qk) {
            int acc[4] = {0, 0, 0, 0};
            tile_s8(acc, ReadI8(), vq8, 0, ReadI8(), vk8, nt * 8, HEAD_DIM);
            if (!smooth_q) sc = s_qk;
            for (int e = 0; e < 4; ++e) {
                t[e] = (float)acc[e];
                if (smooth_q) t[e] = __fadd_rn(__fmul_rn(t[e], s_qk), __fmul_rn(p.c_lambda, s.beta[k_loc0 + nt * 8 + c_col(e)]));
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
                prob = exp2_ftz(__fmaf_rn(t[e], sc, -s.lse2[rl]));  // fma(t, 1, −L) = fl(t − L)
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
            for (int e = 0; e < 4; ++e) dv[nt][e] = dequant_add(acc[e], sc.p.scale, s_do, dv[nt][e]);
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
                dk[nt][e] = dequant_add(acc[e], sc.ds.scale, s_q, dk[nt][e]);
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
// The staged paths: the same arithmetic as mma_tile_*, reorganised around the key block. Two
// product mixes have one: `sage` (#3, #4, #6, #7 INT8, #5 BF16; no Q-smoothing, no dQ correction:
// the sagebwd preset) and `bf16` (#3 to #7 all BF16: the fpa preset; the switches act on INT8
// products only, so they do not matter). Both share the skeleton `staged_backward_main<Path>`:
//
// - Stationary for the whole query loop (loaded once by cp.async): the key block's operand tiles
//   (sage: K̂ [128 keys][d] (A of Sᵀ), K̂ᵀ [d][128 keys] (B of dQ), BF16 V [128 keys][d] (A of dPᵀ);
//   bf16: K [128][d] (A of Sᵀ, B of dQ read transposed), V [128][d] (A of dPᵀ)).
// - Per query block, double-buffered by cp.async (block qb + 1 loads while qb computes): the
//   block's operand tiles (sage: Q̂ [64][d] (B of Sᵀ), dO [64][d] BF16 (B of dPᵀ), dÔᵀ [d][64] (B of
//   dV), Q̂ᵀ [d][64] (B of dK); bf16: Q [64][d] (B of Sᵀ; of dK read transposed), dO [64][d] (B of
//   dPᵀ; of dV read transposed)), and the rows' L and D by plain loads.
// - Warp w owns keys 16w..16w+15 and computes the transposed tile Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (16 keys ×
//   64 query rows) in registers; P and dS stay in registers and become the A fragments of dV = Pᵀ dO
//   and dK = dSᵀ Q directly (sage: P̂ᵀ and dŜᵀ, once the block knows the tile's amax; the query
//   rows are fed to ldmatrix in the forward's permuted order, accumulator column n of n-tile nt is
//   row qrow_of(nt, n), which makes the accumulator layout equal the m16n8k32 A layout. bf16: the
//   accumulators of n-tiles 2ks, 2ks + 1 packed to bf16x2 are the m16n8k16 A fragment of k-step ks,
//   natural row order, as in the forward's P·V).
// - dS goes once through shared memory, double-buffered by query-block parity (sage: dŜ bytes
//   [64 rows][128 keys]; bf16: bf16(dS)ᵀ [128 keys][64 rows], which the A fragments of dQ = dS K
//   read transposed) for dQ: warp w then owns rows 16(w mod 4).. × half of d and adds its tile to
//   the FP32 accumulator with 8-byte vector reductions. dQ of block qb − 1 runs at the end of
//   iteration qb, from the other dS buffer.
// Barriers per tile: one (operands, row constants and the previous dS ready), plus the tile amax's
// for sage. All operand tiles use XOR-swizzled 16-byte chunks, chosen so that each ldmatrix phase
// (8 rows of one chunk column) and each dS store hits 8 distinct bank groups.

// Dynamic shared memory of a staged path: the key block's tiles (KEY bytes), two query-block stages
// (STAGE bytes of operand tiles), two L[64], D[64] blocks, two dS tiles of DS bytes, the amax
// scratch, and ALIGN_SLACK bytes so that the start can be rounded up to 1024 (wgmma's swizzled
// tiles must start on a 1024-byte boundary; the operand tiles keep it, as KEY and STAGE are
// multiples of 1024). Mirrored by `staged_backward_smem_bytes` in src/backward.rs.
#define ALIGN_SLACK 1024
// pipe14: NSTAGES = 3 (the sage path at d = 64) adds a third stage after the second and a second
// amax scratch after the first (the pipelined query loop, see "pipe14" below); 2 is the layout above.
// pipe14b: DQST > 0 (the sage path at d = 64) adds two dQ staging tiles of DQST bytes after the scratches.
template <int KEY, int STAGE, int DS, int NSTAGES = 2, int DQST = 0>
struct StagedLayout {
    static constexpr int stage0 = KEY;                        // stage 0; stage 1 (and 2) follow
    static constexpr int stage_bytes = STAGE;
    static constexpr int rows0 = KEY + NSTAGES * STAGE;       // L, D of stage 0; stage 1's follow
    static constexpr int rows_bytes = 2 * BLOCK_Q * 4;
    static constexpr int ds0 = rows0 + 2 * rows_bytes;        // dS tile 0; tile 1 follows
    static constexpr int ds_bytes = DS;
    static constexpr int red = ds0 + 2 * DS;
    static constexpr int red_bytes = 2 * (THREADS / 32) * 4;  // one amax scratch (NSTAGES − 1 of them)
    static constexpr int dqst0 = red + (NSTAGES - 1) * red_bytes;  // dQ staging tile 0; tile 1 follows
    static constexpr int dqst_bytes = DQST;
    static constexpr int bytes = dqst0 + 2 * DQST + ALIGN_SLACK;
    static_assert(NSTAGES == 2 || NSTAGES == 3, "two or three query-block stages");
    static_assert(KEY % 1024 == 0 && STAGE % 1024 == 0, "operand tiles must stay 1024-byte aligned");
};

#define BF_QT (BLOCK_Q * HEAD_DIM)           // bytes of an INT8 [64][d] tile (a BF16 one is twice that)
#define BF_KT (BLOCK_KV * HEAD_DIM)          // bytes of an INT8 [128][d] tile
#define BF_ROW (2 * HEAD_DIM)                // bytes of one BF16 row of d values

// Which path `sage_bwd_main_mma` takes (the host's `staged_backward` in src/backward.rs).
#define BWD_GATHER 0
#define BWD_STAGED_SAGE 1
#define BWD_STAGED_BF16 2
__device__ __forceinline__ int bwd_fast_path(int flags) {
    const int products = F_QK_BWD | F_DV | F_DP | F_DQ | F_DK;
    const int mask = products | F_SMOOTH_Q | F_DQ_CORR;
    if ((flags & mask) == (F_QK_BWD | F_DV | F_DQ | F_DK)) return BWD_STAGED_SAGE;
    if ((flags & products) == 0) return BWD_STAGED_BF16;
    return BWD_GATHER;
}

// Swizzles (common.cuh): physical 16-byte chunk of logical chunk c in row `row` of each tile.
// K̂ / V (A operands, ldmatrix reads 8 consecutive keys per chunk column): natural row order.
__device__ __forceinline__ int swz_key_i8(int row, int c) { return swz_i8_rows8(row, c); }
__device__ __forceinline__ int swz_key_bf16(int row, int c) { return swz_rows8(row, c); }
// Q̂ / dO (B operands read in the permuted row order: rows base + {0, 1, 4, 5, 8, 9, 12, 13}).
__device__ __forceinline__ int swz_qrow_i8(int row, int c) { return swz_i8_permuted(row, c); }
__device__ __forceinline__ int swz_qrow_bf16(int row, int c) { return swz_permuted(row, c); }
// dÔᵀ / Q̂ᵀ: [d][64] (64-byte rows); K̂ᵀ: [d][128] (128-byte rows); bf16(dS)ᵀ [128][64 BF16].
__device__ __forceinline__ int swz_t64(int row, int c) { return swz_rows8_half(row, c); }
__device__ __forceinline__ int swz_t128(int row, int c) { return swz_rows8(row, c); }
// dŜ [64][128] bytes: conflict-free for ldmatrix (8 consecutive rows) and for the byte stores of
// one instruction (rows r0 + 4t, t = 0..3).
__device__ __forceinline__ int swz_ds(int row, int c) { return c ^ ((row & 7) ^ ((row >> 2) & 2)); }

// Query row (0..63) of accumulator column n of n-tile nt in the permuted order (as the forward's keys).
__device__ __forceinline__ int qrow_of(int nt, int n) { return 16 * (nt >> 1) + 2 * (nt & 1) + 4 * (n >> 1) + (n & 1); }
// ... in the permuted (sage) or natural (bf16) order.
template <bool PERMUTED>
__device__ __forceinline__ int tile_row(int nt, int n) { return PERMUTED ? qrow_of(nt, n) : 8 * nt + n; }

struct SwzKeyI8 { __device__ int operator()(int r, int c) const { return swz_key_i8(r, c); } };
struct SwzKeyBf16 { __device__ int operator()(int r, int c) const { return swz_key_bf16(r, c); } };
struct SwzQrowI8 { __device__ int operator()(int r, int c) const { return swz_qrow_i8(r, c); } };
struct SwzQrowBf16 { __device__ int operator()(int r, int c) const { return swz_qrow_bf16(r, c); } };
struct SwzT64 { __device__ int operator()(int r, int c) const { return swz_t64(r, c); } };
struct SwzT128 { __device__ int operator()(int r, int c) const { return swz_t128(r, c); } };

// Copies ROWS rows of CH 16-byte chunks (source stride `stride` bytes) into a tile: chunk c of row
// `row` goes to byte dst + off(row, c); rows ≥ valid_rows are zero-filled without reading.
// Unrolled: every thread copies ROWS·CH/THREADS chunks.
template <int ROWS, int CH, class Off>
__device__ __forceinline__ void stage_rows_at(u32 dst, const void* src, long stride, int valid_rows, Off off) {
    static_assert((ROWS * CH) % THREADS == 0 && THREADS % CH == 0, "stage_rows_at: tile does not split evenly");
    const unsigned char* s = (const unsigned char*)src;
    const int c = threadIdx.x % CH, row0 = threadIdx.x / CH;
#pragma unroll
    for (int k = 0; k < ROWS * CH / THREADS; ++k) {
        const int row = row0 + k * (THREADS / CH);
        const bool valid = row < valid_rows;
        cp_async16(dst + off(row, c), valid ? s + row * stride + c * 16 : s, valid);
    }
}

// Byte offset of chunk c of row `row` in a tile of CH-chunk rows whose chunks are permuted by Swz.
template <int CH, class Swz>
struct SwizzledRows {
    Swz swz;
    __device__ u32 operator()(int row, int c) const { return row * CH * 16 + swz(row, c) * 16; }
};

// stage_rows_at into a swizzled tile of CH-chunk rows.
template <int ROWS, int CH, class Swz>
__device__ __forceinline__ void stage_rows(u32 dst, const void* src, long stride, int valid_rows, Swz swz) {
    stage_rows_at<ROWS, CH>(dst, src, stride, valid_rows, SwizzledRows<CH, Swz>{swz});
}

// [128][d] BF16 rows of the key block (rows past n_k zero) and [64][d] BF16 rows of query block qb
// (rows past n_q zero), natural row order unless given another swizzle.
template <class Swz = SwzKeyBf16>
__device__ __forceinline__ void stage_key_rows_bf16(u32 dst, const u16* x, const Dims& d, int bh_kv, int kb,
                                                    Swz swz = Swz()) {
    const int key0 = kb * BLOCK_KV;
    stage_rows<BLOCK_KV, HEAD_DIM / 8>(dst, x + ((long)bh_kv * d.n_k + key0) * HEAD_DIM, BF_ROW, d.n_k - key0, swz);
}
template <class Swz = SwzKeyBf16>
__device__ __forceinline__ void stage_query_rows_bf16(u32 dst, const u16* x, const Dims& d, int bh, int qb,
                                                      Swz swz = Swz()) {
    const int row0 = qb * BLOCK_Q;
    stage_rows<BLOCK_Q, HEAD_DIM / 8>(dst, x + ((long)bh * d.n_q + row0) * HEAD_DIM, BF_ROW, d.n_q - row0, swz);
}

// L and D of row `rl` of query block qb (threads 0..63): L = fl(lse2 − b_r) after an INT8 #3 (its
// scores are of the smoothed K, lower than the true ones by b_r, §5), lse2 after a BF16 #3;
// L = +∞, D = 0 past n_q, so that P = exp2(t − L) = 0 and dS = 0 there without a mask.
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
        rc.L = (p.flags & F_QK_BWD) ? __fsub_rn(p.lse2[row], p.op.row_offset[row]) : p.lse2[row];
        rc.D = p.delta[row];
    }
    return rc;
}
__device__ __forceinline__ void store_row_consts(float* rows, const RowConsts& rc) {
    rows[threadIdx.x] = rc.L;
    rows[BLOCK_Q + threadIdx.x] = rc.D;
}

__device__ __forceinline__ void mma_acc(int* c, const u32* a, const u32* b) { mma_s8(c, a, b); }
__device__ __forceinline__ void mma_acc(float* c, const u32* a, const u32* b) { mma_bf16(c, a, b); }

// acc[nt] = the warp's 16 keys (A: rows of a [key][CH chunks] tile) × the 64 query rows of n-tiles
// nt = 0..7 (B: rows of a [row][CH chunks] stage tile, in the permuted or natural order), summed over
// all CH chunks: INT8 m16n8k32 or BF16 m16n8k16 by the accumulator type; either way one k-step is 2
// chunks, so one ldmatrix.x4 of B serves two k-steps. a_lane / b_lane: this lane's ldmatrix row
// (keys 8·(mi mod 2) + r; n-tile 0's row r), a_x / b_x: its swizzle term, which the rows of later
// n-tiles and k-steps share, so every address is a per-lane base plus a compile-time offset.
template <int CH, int ROW_BYTES, bool PERMUTED, class Acc>
__device__ __forceinline__ void keys_by_rows(Acc (*acc)[4], u32 a_lane, int a_x, u32 b_lane, int b_x) {
    const int mi = (threadIdx.x & 31) >> 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0;
#pragma unroll
    for (int cg = 0; cg < CH / 4; ++cg) {
        u32 a[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) ldmatrix_x4(a[h], a_lane + (((4 * cg + 2 * h + (mi >> 1)) ^ a_x) << 4));
        const u32 b_cg = b_lane + (((4 * cg + mi) ^ b_x) << 4);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            u32 b[4];
            ldmatrix_x4(b, b_cg + tile_row<PERMUTED>(nt, 0) * ROW_BYTES);
            mma_acc(acc[nt], a[0], b);
            mma_acc(acc[nt], a[1], b + 2);
        }
    }
}

// P of one score (§5) from the S accumulator and the row's L: INT8 #3 (an int accumulator) exp2(fma(a, scale, −L)),
// one rounding (bfma24); BF16 #3 exp2(fl(fl(S·scale) − L)).
__device__ __forceinline__ float p_of_score(int acc, float scale, float L) { return exp2_ftz(__fmaf_rn((float)acc, scale, -L)); }
__device__ __forceinline__ float p_of_score(float acc, float scale, float L) {
    return exp2_ftz(__fsub_rn(__fmul_rn(acc, scale), L));
}

// P = exp2(fma(S, scale, −L)) (INT8, bfma24) or exp2(fl(fl(S·scale) − L)) (BF16) of the warp's transposed tile (s: the Sᵀ accumulators, scale =
// fl(fl(s_Q·cλ)·s_K) for INT8, cλ for BF16), not yet masked.
template <bool PERMUTED, class Acc>
__device__ __forceinline__ void tile_p_regs(const float* rows, const Acc (*s)[4], float scale, float (*prob)[4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 L = *(const float2*)(rows + tile_row<PERMUTED>(nt, 2 * t));  // rows rl, rl + 1 (even)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            prob[nt][e] = p_of_score(s[nt][e], scale, (e & 1) ? L.y : L.x);
    }
}

// dS = fl(P·fl(dP − D)) (dp in, dS out), then P and dS masked → 0; rows past n_q need no mask
// (L = +∞, D = 0).
template <bool PERMUTED>
__device__ __forceinline__ void tile_ds_regs(const Dims& d, const float* rows, int qb, int kb, float (*prob)[4],
                                             float (*ds)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wkey0 = kb * BLOCK_KV + (threadIdx.x >> 5) * 16;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 D = *(const float2*)(rows + BLOCK_Q + tile_row<PERMUTED>(nt, 2 * t));
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D.y : D.x));
    }
    const int last_key = wkey0 + 15;
    const bool need_mask = last_key >= d.n_k || (d.causal && last_key > qb * BLOCK_Q + (d.n_k - d.n_q));
    if (need_mask) {  // warp-uniform: only tiles on the diagonal or past n_k
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!visible(d, qb * BLOCK_Q + tile_row<PERMUTED>(nt, 2 * t + (e & 1)), wkey0 + g + 8 * (e >> 1)))
                    prob[nt][e] = ds[nt][e] = 0.0f;
    }
}

// Both: P and dS of the warp's tile from the Sᵀ and dPᵀ accumulators (dp in, dS out), masked.
template <bool PERMUTED, class Acc>
__device__ __forceinline__ void tile_p_ds_regs(const Dims& d, const float* rows, int qb, int kb, const Acc (*s)[4],
                                               float scale, float (*prob)[4], float (*ds)[4]) {
    tile_p_regs<PERMUTED>(rows, s, scale, prob);
    tile_ds_regs<PERMUTED>(d, rows, qb, kb, prob, ds);
}

// Adds the 16 × 16 dQ columns c..c + 15 of the warp's rows (acc[0]: columns c.., acc[1]: c + 8..) to
// the FP32 accumulator, rows past n_q skipped. dq_lo: this lane's first element (row r_lo).
__device__ __forceinline__ void red_add_dq16(const Dims& d, float* dq_lo, int r_lo, const float (*v)[4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        if (r_lo < d.n_q) red_add_f32x2(dq_lo + 8 * j, v[j][0], v[j][1]);
        if (r_lo + 8 < d.n_q) red_add_f32x2(dq_lo + 8 * HEAD_DIM + 8 * j, v[j][2], v[j][3]);
    }
}

// This lane's first dQ row (r_lo; r_lo + 8 is its other) and element for the warp's dQ tile:
// rows 16(w mod 4).. of block qb, columns (w div 4)·d/2 + 2t...
__device__ __forceinline__ float* dq_lane_ptr(const BackwardParams& p, int bh, int qb, int& r_lo) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    r_lo = qb * BLOCK_Q + (warp & 3) * 16 + (lane >> 2);
    return p.dq_acc + ((long)bh * p.dims.n_q + r_lo) * HEAD_DIM + (warp >> 2) * (HEAD_DIM / 2) + 2 * (lane & 3);
}

// One query block's tile, as the paths see it.
struct StagedTile {
    u32 smem;           // shared address of the dynamic allocation
    u32 st;             // this block's stage
    const float* rows;  // its L[64], D[64]
    unsigned char* ds;  // its dS tile (generic pointer)
    float* red;         // the amax scratch
    int bh, bh_kv, qb;  // (batch, query head), its kv head, the query block
    int kb;             // the key block (staged_block_coords)
    u32 prev_ds;        // shared address of block qb − 1's dS tile (valid when qb > the first block)
    float prev_dq_scale;  // and its dQ scale (sage)
    bool has_prev;
    u32 next_st;        // the stage block qb + 1 goes to (a path with STAGES_NEXT stages it in tile())
    bool has_next;
};

// ---- wgmma operand tiles (sm_90a) -----------------------------------------------------------------
// On sm_90a the sage path computes Sᵀ and dPᵀ with wgmma (BWD_WGMMA): the warpgroup's 64 keys are
// the M rows, the 64 query rows the N columns; K̂, V (A) and Q̂, dO (B) are K-major tiles in the
// hardware's swizzled layout. The Q̂ and dO rows are stored in the permuted order (row 8nt + n holds
// query row qrow_of(nt, n)), so the accumulator is the mma.sync path's, permuted rows included.
#ifdef SAGE_WGMMA
#define BWD_WGMMA 1
// dQ = dŜ K̂ runs on wgmma too (A = the dŜ byte tile, B = K̂ᵀ, both in the 128-byte-swizzle layout), issued
// for block qb − 1 at the start of tile qb, before Sᵀ, and added while Sᵀ and dPᵀ run (as the fpa path).
// Waited for right after issue, an mma.sync dQ was 1–3 % faster at d = 128 and the wgmma one 0.3–1.4 % faster
// at d = 64 (docs/RESULTS-gpu.md, "Backward on wgmma"); issued early, the wgmma one is faster at both
// ("Backward on wgmma (sm_90a), fpa path"). The other forms are in the history before session 21.

// Tile row holding query row `row` (inverse of qrow_of: row = 16a + 4b + 2c + e sits at 8(2a + c) + 2b + e).
__device__ __forceinline__ int permuted_qrow(int row) {
    return (row & ~15) | (((row >> 1) & 1) << 3) | (((row >> 2) & 3) << 1) | (row & 1);
}

// Byte offset of 16-byte chunk c of row `row` in a K-major tile of ROWS rows of ROW_BYTES bytes.
// Rows of up to 128 bytes are one swizzle atom column (64-byte rows: 64-byte swizzle); 256-byte
// rows (BF16, d = 128) are two atom columns, each a [ROWS][128-byte] tile, the second after the first.
template <int ROWS, int ROW_BYTES, bool PERMUTED>
struct WgKmajor {
    static constexpr int ATOM = ROW_BYTES < 128 ? ROW_BYTES : 128;
    __device__ u32 operator()(int row, int c) const {
        const int prow = PERMUTED ? permuted_qrow(row) : row;
        const int byte = 16 * c;
        return (byte / ATOM) * (ROWS * ATOM) + swizzled_offset(prow * ATOM + byte % ATOM, ATOM);
    }
};

// Descriptor of k-step ks (32 bytes of every row) of a WgKmajor<ROWS, ROW_BYTES> tile at `tile`,
// from row row0 (a multiple of 8, one swizzle period) on.
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ u64 wg_kstep_desc(u32 tile, int row0, int ks) {
    constexpr int ATOM = ROW_BYTES < 128 ? ROW_BYTES : 128, STEPS = ATOM / 32;
    return kmajor_desc(tile + (ks / STEPS) * (ROWS * ATOM) + row0 * ATOM + 32 * (ks % STEPS), ATOM);
}

// Issues acc = A·Bᵀ of a BF16 product over d, no commit: A = rows 64wg.. of the [128][d] key tile
// at a_tile, B = the [64][d] query tile at b_tile, both WgKmajor. dPᵀ = V dOᵀ of both staged paths
// and the fpa path's Sᵀ = K Qᵀ (accumulators from zero; FP32 sums in the hardware's order, §1).
__device__ __forceinline__ void wg_issue_bf16_keys_by_rows(float (&acc)[8][4], u32 a_tile, u32 b_tile, int wg) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
        wgmma_bf16_ss_n64(acc, wg_kstep_desc<BLOCK_KV, BF_ROW>(a_tile, 64 * wg, ks), wg_kstep_desc<BLOCK_Q, BF_ROW>(b_tile, 0, ks), ks);
}
#else
#define BWD_WGMMA 0
#endif

// ---- sage10: helpers of the staged sage tile (fewer CUDA-core instructions per tile) ---------------
// At d = 64 the sage tile is bound by its CUDA-core work, not by the tensor cores (docs/RESULTS-gpu.md,
// "INT8 sagebwd backward at d64"); these replace shared helpers whose SASS did the same arithmetic in
// more, or more serial, instructions. Every value they produce is bit-identical to the old one.

// float(acc) in the dV, dK, dQ dequantizations (|acc| ≤ 127²·128 < 2^22: both forms below are exact).
// d = 64: one I2FP (1 issue slot; sage10's call: backward −2.3 / −3.1 % at the training shape N1k / N4k
// against i2f_exact, verified); d = 128 keeps i2f_exact (VIADD + FADD, off the conversion pipe), the form
// timed there (the I2FP variant is verified at d = 128 too but was not timed).
__device__ __forceinline__ float sage10_i2f(int a) { return HEAD_DIM == 64 ? (float)a : i2f_exact(a); }

// Max of a warp tile's 32 values (|values| with ABS), as 4 independent chains and a 2-level tree:
// fmax is exact and order-free, so the result is the sequential loop's; the chains cut the latency
// (one serial FMNMX chain of 32 before).
// pamax24 (sm_90a, P's amax, ABS = false): P is finite and ≥ +0 (the inputs are checked, §9; masked
// entries are +0), and non-negative floats order as their bit patterns, so the integer max of the bits
// (with 0, as the chains' start) is the fmax, bit for bit: 11 + 4 + 2 three-way integer maxima
// (VIMNMX3, Hopper's DPX) instead of 32 + 3 FMNMX.
template <bool ABS>
__device__ __forceinline__ float sage10_tile_max(const float (*v)[4]) {
#if defined(SAGE_WGMMA)
    if constexpr (!ABS) {
        auto x = [&](int i) { return __float_as_int(v[i >> 2][i & 3]); };
        int a[11];
#pragma unroll
        for (int k = 0; k < 10; ++k) a[k] = __vimax3_s32(x(3 * k), x(3 * k + 1), x(3 * k + 2));
        a[10] = __vimax3_s32(x(30), x(31), 0);
        const int b0 = __vimax3_s32(a[0], a[1], a[2]), b1 = __vimax3_s32(a[3], a[4], a[5]);
        const int b2 = __vimax3_s32(a[6], a[7], a[8]), b3 = __vimax3_s32(a[9], a[10], b0);
        return __int_as_float(__vimax3_s32(b1, b2, b3));
    }
#endif
    float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) m[e] = fmaxf(m[e], ABS ? fabsf(v[nt][e]) : v[nt][e]);
    return fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
}

// Block-wide max of two non-negative values; `red` (16-byte aligned) holds 2·(THREADS/32) floats. The
// caller's barriers keep `red` from being rewritten before everyone has read it (see
// staged_backward_main). The per-warp partials are read back as float4 and combined as a tree.
// sbwd12 (sm_90a; d = 64, and d = 128 since sbwd13): the warp step as one redux.sync max of the bits per value: a and b are
// per-thread maxima from 0 (sage10_tile_max: never NaN, never below +0), and non-negative floats
// order as their bit patterns, so the u32 max is the fmax, bit for bit (5 serial shuffle + fmax steps
// before).
__device__ __forceinline__ void block_max2(float& a, float& b, float* red) {
#if defined(SAGE_WGMMA)  // sbwd13: d = 128 too
    a = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(a)));
    b = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(b)));
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, o));
    }
#endif
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        red[warp] = a;
        red[THREADS / 32 + warp] = b;
    }
    __syncthreads();
    static_assert(THREADS / 32 == 8, "block_max2 reads 8 partials per value");
    const float4* r4 = (const float4*)red;
    const float4 a0 = r4[0], a1 = r4[1], b0 = r4[2], b1 = r4[3];
    a = fmaxf(fmaxf(fmaxf(a0.x, a0.y), fmaxf(a0.z, a0.w)), fmaxf(fmaxf(a1.x, a1.y), fmaxf(a1.z, a1.w)));
    b = fmaxf(fmaxf(fmaxf(b0.x, b0.y), fmaxf(b0.z, b0.w)), fmaxf(fmaxf(b1.x, b1.y), fmaxf(b1.z, b1.w)));
}

// bwd17 (ATOMIC_AMAX): block_max2 of the pipelined d = 64 loop (and, amax24, of sb16's d = 128 loop) with the block step in shared atomics. Tile i's slot
// (2 floats, slot i mod 4 at byte 8(i mod 4) of the loop's 128-byte amax scratch, 32-byte aligned) is +0 when its first
// red arrives: the slots start at +0 (zeroed before the loop's first barrier) and tile i's thread 0 zeroes slot
// i + 2 mod 4 (its address: tile i's slot's XOR 16) after barrier (b) of tile i, when every read of it (tile i − 2,
// before (b) of tile i − 1) is done and before any red into it (tile i + 2, after (b) of tile i + 1). a and b are
// per-thread maxima from +0 (sage10_tile_max: never NaN, never below +0), so the u32 max of their bits is their fmax,
// bit for bit, as redux's warp step is already: the same values as block_max2's. Every lane issues the two reds, lane 0
// to the slot and lanes 1..31 to sink words 32..92 bytes past it (within the scratch, never read; lane_off = lane 0: 0,
// else 32 + 4·(lane mod 16)): one ATOMS each, no branch (a lane-0 or elect.sync predicate became a branch around each
// ATOMS, and ptxas re-aggregated a lane-0 atomic over the active lanes by another redux). Leaves a and b as
// block_max2 does.
__device__ __forceinline__ void bwd17_block_max2(float& a, float& b, u32 slot, u32 lane_off) {
    a = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(a)));
    b = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(b)));
    asm volatile("red.shared.max.u32 [%0], %1;\nred.shared.max.u32 [%0+4], %2;\n"
                 ::"r"(slot + lane_off), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)) : "memory");
    __syncthreads();
    float2 m;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(m.x), "=f"(m.y) : "r"(slot) : "memory");
    a = m.x;
    b = m.y;
    if (threadIdx.x == 0) asm volatile("st.shared.v2.f32 [%0], {%1, %1};\n" ::"r"(slot ^ 16u), "f"(0.0f) : "memory");
}
// bwd16 (with SPLIT; the default since session 15's final call): the tile's group scales
// computed by every thread, without a division or a shuffle: fl(amax/127) by div127_rn (common.cuh, exact
// on every finite amax ≥ 0), fl(127/amax) by fwd14's branch-free division (common.cuh's inv127_rn, checked
// on the device against __fdiv_rn(127, amax) on every non-negative FP32). The same bits as
// sage10_group_scales' (0 and 0 for amax = 0) for every finite amax (amax = +inf, only from an infinite dS:
// fl(amax/127) becomes NaN instead of +inf; every dequantized product of that tile is NaN either way, since
// all its quantized values are 0). Instead of the IEEE division (FCHK, its slow-path branch) and 4 shuffles
// after barrier (b): +17 instructions per tile. Measured with the split (final call, same binary): −3.7 % at
// the training shape N 4096, ±0 at N 1024 (the persistent grid there has no split, so not these scales either).
// scales24: sb16's d = 128 loop takes them too (−1.1 % backward there).
__device__ __forceinline__ void bwd16_group_scales(float amax, GroupScale& g) {
    g.scale = div127_rn(amax);  // 0 for amax = 0
    g.inv = inv127_rn(amax);  // common.cuh
}

// group_scale(amax_p) and group_scale(amax_ds) with one division per lane instead of four per
// thread: lane k (mod 4) computes quotient k (0: amax_p/127, 1: 127/amax_p, 2: amax_ds/127,
// 3: 127/amax_ds; 0 for an all-zero group, as group_scale) and lanes 0..3 broadcast theirs. The
// same __fdiv_rn on the same operands, so the same bits; every lane holds both amax (block max).
__device__ __forceinline__ void sage10_group_scales(float amax_p, float amax_ds, GroupScale& sp, GroupScale& sds) {
    const int k = threadIdx.x & 3;
    const float amax = k < 2 ? amax_p : amax_ds;
    const bool inv = k & 1;
    float q = __fdiv_rn(inv ? 127.0f : amax, inv ? amax : 127.0f);
    if (amax == 0.0f) q = 0.0f;
    sp.scale = __shfl_sync(0xffffffffu, q, 0);
    sp.inv = __shfl_sync(0xffffffffu, q, 1);
    sds.scale = __shfl_sync(0xffffffffu, q, 2);
    sds.inv = __shfl_sync(0xffffffffu, q, 3);
}

// The causal / n_k mask of tile_ds_regs (permuted row order) as one key limit per row: key j ≥ 0
// of row r is visible iff j < visible_end(d, r) (common.cuh). The lane's keys are wkey0 + g + 8h,
// so each entry is one compare of 8h against the row's limit less wkey0 + g. Sets P = dS = 0 where
// masked, as before; returns whether the warp's tile needed a mask (warp-uniform).
__device__ __forceinline__ bool sage10_mask(const Dims& d, int qb, int kb, float (*prob)[4], float (*ds)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wkey0 = kb * BLOCK_KV + (threadIdx.x >> 5) * 16;
    const int last_key = wkey0 + 15;
    const bool need_mask = last_key >= d.n_k || (d.causal && last_key > qb * BLOCK_Q + (d.n_k - d.n_q));
    if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int lim = visible_end(d, qb * BLOCK_Q + qrow_of(nt, 2 * t + c)) - (wkey0 + g);
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (8 * h >= lim) prob[nt][2 * h + c] = ds[nt][2 * h + c] = 0.0f;
            }
    }
    return need_mask;
}

// dS = fl(P·fl(dP − D)) of tile_ds_regs (dp in, dS out), without its mask.
__device__ __forceinline__ void sage10_ds_regs(const float* rows, const float (*prob)[4], float (*ds)[4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 D = *(const float2*)(rows + BLOCK_Q + qrow_of(nt, 2 * t));
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D.y : D.x));
    }
}

// Adds fl(float(acc)·scale) of the warp's 16 × d/2 dQ tile of block qb (rows 16(w mod 4).., columns
// (w div 4)·d/2..; acc[2np + j]: columns 16np + 8j.., as red_add_dq16) to the FP32 accumulator.
// A block whose 64 rows are all below n_q (every one but a ragged last) takes a branch-free path
// from one lane pointer; before, every 8-byte reduction sat in its own guarded branch with its
// address rebuilt inside (~200 instructions per tile at d = 64, now ~70).
// I2FP: the INT32 → FP32 conversion by one I2FP at every d (sb128's d = 128 path), else sage10_i2f.
// ROT_ACC (StagedSage128, SAGE_DQ_ACC_ROT): n-tile n of rows r_lo, r_lo + 8 to chunk position n ^ (r_lo mod 4).
template <bool I2FP = false, bool ROT_ACC = false>
__device__ __forceinline__ void sage10_add_dq(const BackwardParams& p, const int (*acc)[4], float scale, int bh, int qb) {
    float val[HEAD_DIM / 16][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) val[n][e] = __fmul_rn(I2FP ? (float)acc[n][e] : sage10_i2f(acc[n][e]), scale);
    int r_lo;
    float* dq_lo = dq_lane_ptr(p, bh, qb, r_lo);
    if (ROT_ACC) {  // once per item (its last block): plain guards
        static_assert(!ROT_ACC || SAGE_DQ_ACC_ROT, "the rotated accumulator order is sm_90a's d = 128 one");
        const int k = (threadIdx.x >> 2) & 3;  // = sage_dq_acc_chunk_xor(r_lo), and of r_lo + 8 (from the lane: fewer instructions)
        const bool lo = r_lo < p.dims.n_q, hi = r_lo + 8 < p.dims.n_q;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 16; ++n) {
            float* at = dq_lo + 8 * (n ^ k);
            if (lo) red_add_f32x2(at, val[n][0], val[n][1]);
            if (hi) red_add_f32x2(at + 8 * HEAD_DIM, val[n][2], val[n][3]);
        }
        return;
    }
    if ((qb + 1) * BLOCK_Q <= p.dims.n_q) {  // block-uniform
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 16; ++n) {
            red_add_f32x2(dq_lo + 8 * n, val[n][0], val[n][1]);
            red_add_f32x2(dq_lo + 8 * HEAD_DIM + 8 * n, val[n][2], val[n][3]);
        }
    } else {
#pragma unroll
        for (int np = 0; np < HEAD_DIM / 32; ++np) red_add_dq16(p.dims, dq_lo + 16 * np, r_lo, val + 2 * np);
    }
}

#if BWD_WGMMA
// wgmma descriptors as one low word per operand block plus compile-time offsets. A shared address
// a is a multiple of 16 below 2^18 (228 KB), so kmajor_desc(a + off) = kmajor_desc(a) + off/16 in
// the low word (start address a >> 4 < 2^14 never carries into bit 16, the LBO field) and the high
// word is a constant of the row width. Before, each of the tile's 28 descriptors was rebuilt from
// its address (add, mask, shift, or, then two moves to uniform registers).
__device__ __forceinline__ u32 sage10_desc_lo(u32 addr) { return (u32)kmajor_desc(addr, 128); }

// = wg_kstep_desc<ROWS, ROW_BYTES>(base + tile_off, row0, ks) for lo = sage10_desc_lo(base).
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ u64 sage10_kstep_desc(u32 lo, u32 tile_off, int row0, int ks) {
    constexpr int ATOM = ROW_BYTES < 128 ? ROW_BYTES : 128, STEPS = ATOM / 32;
    const u32 hi = (u32)(kmajor_desc(0, ATOM) >> 32);  // a constant
    const u32 off = tile_off + (ks / STEPS) * (ROWS * ATOM) + 32 * (ks % STEPS);
    return ((u64)hi << 32) | (u64)(lo + (off >> 4) + row0 * (ATOM / 16));
}
#endif

// ---- sage11: query-block staging with per-thread copy offsets computed once per CTA ------------
// The staged driver stages block qb + 1 through a QueryStager<Path> built before its query loop. This
// default asks the path every time (its stage_query_block rebuilds every address from threadIdx);
// a path may specialize it to keep the per-thread parts of its copies (swizzled destinations, source
// offsets, row limits) in registers: StagedSage at d = 64 on sm_90a, below its section.
template <class Path>
struct QueryStager {
    __device__ __forceinline__ QueryStager(const BackwardParams&, int) {}
    __device__ __forceinline__ void operator()(const BackwardParams& p, u32 st, int bh, int qb) const {
        Path::stage_query_block(p, st, bh, qb);
    }
};

// ---- sbwd12: the dŜ tile by stmatrix at d = 64 -----------------------------------------------
// The Sᵀ accumulator gives lane (g, t) keys g and g + 8 of the warp's 16 (one 16-byte chunk of a dŜ
// row) for rows 4t + c (+ 16, 2 per n-tile): 32 one-byte stores per thread per tile before. Stored
// instead as 16-bit pairs {key g, key g + 8} by two stmatrix.trans, each 16-byte chunk of dŜ holds its
// 16 keys in the order byte 2g + h = key g + 8h; K̂ᵀ (dQ's B, K = the keys) gets the same order in
// every 16-byte chunk, once per CTA in its first tile. dQ's INT32 sums over the keys are exact, so
// the order of their terms does not change a bit. With the wgmma dQ (sm_90a), at d = 64 (sbwd12) and, since
// sbwd13, at d = 128 (the dŜ tile is [64][128] bytes at both head dims; the K̂ᵀ half of a warpgroup is d/2 rows
// of 128 bytes: 2 chunks per thread at d = 64, 4 at d = 128).
#if BWD_WGMMA
// Byte 2g + h of every 16-byte chunk of this warpgroup's half of the K̂ᵀ tile (rows wg·d/2.., the
// rows its dQ wgmma reads) := byte g + 8h. In place, each thread its own two chunks; then the proxy
// fence (the caller's next barrier makes it visible to the next dQ wgmma).
__device__ __forceinline__ void sbwd12_interleave_kt(u32 kt_tile) {
    constexpr int CHUNKS = HEAD_DIM / 2 * BLOCK_KV / (128 * 16);  // per thread: 2 at d = 64, 4 at d = 128
    static_assert(THREADS == 256 && HEAD_DIM / 2 * BLOCK_KV == CHUNKS * 128 * 16, "whole chunks per thread");
    const u32 a = kt_tile + (threadIdx.x >> 7) * (HEAD_DIM / 2 * BLOCK_KV) + 16 * (threadIdx.x & 127);
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const uint4 w = ld_shared_u4(a + 2048 * k);
        st_shared_u4(a + 2048 * k, make_uint4(interleave_bytes<false>(w.x, w.z), interleave_bytes<true>(w.x, w.z),
                                              interleave_bytes<false>(w.y, w.w), interleave_bytes<true>(w.y, w.w)));
    }
    fence_proxy_async();
}
#endif

// ---- sbwd13: the warpgroup index as a value ptxas knows is warp-uniform --------------------------
// threadIdx.x / 128 is the same in every lane of a warp, but ptxas does not know it: each wgmma whose
// descriptor depends on it (Sᵀ's and dPᵀ's A: K̂, V rows 64·wg; dQ's B: K̂ᵀ rows wg·d/2) had its
// descriptor built in vector registers and moved by 2 R2UR (+ VIADD, IMAD.MOV) per wgmma. Broadcast
// from lane 0 by a full-mask shuffle (as CUTLASS's canonical_warp_group_idx), it is uniform to ptxas
// and the descriptors live in uniform registers. The same value, so the same operands.
// Measured (sbwd13's call, docs/RESULTS-gpu.md): at d = 64 alone it made the backward 0.6–1.8 % SLOWER
// (ptxas re-executes the shuffle in every tile, right before the first wgmma), so it is off there; at
// d = 128 it is on, as part of the configuration that measured faster (with the dŜ stmatrix and the
// redux amax: −0.8 to −2.5 %); its own share at d = 128 was not separated.
#if BWD_WGMMA
#ifndef SBWD13_UNIFORM_WG
#define SBWD13_UNIFORM_WG (HEAD_DIM == 128)
#endif
__device__ __forceinline__ int sbwd13_wg() {
#if SBWD13_UNIFORM_WG
    return __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
#else
    return threadIdx.x >> 7;
#endif
}
#endif

// ---- pipe14: the sage query loop software-pipelined across query blocks (sm_90a, d = 64) -----------
// staged_query_loop<StagedSage14T> (pipe14b: sage14_query_loop, below the generic loop): Sᵀ of block qb + 1 is issued
// right after the dV/dK products of block qb, so it runs while they are dequantized; the stage of
// qb + 1 is waited for at the tile's amax barrier, and the tile has that one block barrier instead of
// two. Three query-block stages (qb + 2 loads while qb and qb + 1 are read) and two amax scratches (no
// second barrier separates one tile's reads from the next tile's writes). The same arithmetic in the
// same order (every product, every FP32 operation as before). Measured (pipe14's call,
// docs/RESULTS-gpu.md): sagebwd backward −6.3 % at the training shape N 4096, −1.3 % at N 1024 (the
// persistent grid), −6.5 to −7.2 % on the d = 64 sweep's plain-grid rows; verified 152/152.
#if BWD_WGMMA && HEAD_DIM == 64
#define PIPE14_LOOP 1
#define PIPE14_STAGES 3
#else
#define PIPE14_LOOP 0
#define PIPE14_STAGES 2
#endif
// sb128: the INT8 path at d = 128 on sm_90a as its own type StagedSage128 (below StagedSage14T) with its own
// query loop (dQ by bulk reduce-adds, raw row constants, scales a tile ahead).
#if BWD_WGMMA && HEAD_DIM == 128
#define SB128_LOOP 1
#else
#define SB128_LOOP 0
#endif
#if SB128_LOOP != SAGE_DQ_ACC_ROT
#error "StagedSage128 writes the dQ accumulator in SAGE_DQ_ACC_ROT's order, which sage_bwd_post_dq_sage reads"
#endif

// ---- sage: #3, #4, #6, #7 INT8, #5 BF16 ---------------------------------------------------------
struct StagedSage {
    // Key block: K̂, K̂ᵀ (BF_KT bytes each), V (2·BF_KT); stage: Q̂, dO (2·BF_QT), dÔᵀ, Q̂ᵀ; dŜ bytes.
    // (pipe14b: two stages; the pipelined loop's type StagedSage14 below has its own layout.)
    typedef StagedLayout<4 * BF_KT, 5 * BF_QT, BLOCK_Q * BLOCK_KV> Layout;
    static constexpr int kt = BF_KT, v = 2 * BF_KT;                   // offsets in the key block
    static constexpr int d_o = BF_QT, dot = 3 * BF_QT, qt = 4 * BF_QT;  // offsets in a stage

    static constexpr bool WGMMA = BWD_WGMMA;  // Sᵀ and dPᵀ by wgmma (K̂, V, Q̂, dO in its tile layout)
    static constexpr bool STAGES_NEXT = false;
    static constexpr bool BULK_DQ = false;  // dQ by bulk or tensor reduces from a staging area (derived paths)

    // K̂ᵀ columns past n_k are read as they are and meet dŜ = 0.
    static __device__ __forceinline__ void stage_key_block(const BackwardParams& p, u32 smem, int bh_kv, int kb) {
        const Dims& d = p.dims;
        const int key0 = kb * BLOCK_KV;
        const i8* k_hat = p.op.k_hat + ((long)bh_kv * d.n_k + key0) * HEAD_DIM;
        const i8* k_hat_t = p.tr.k_hat_t + (long)bh_kv * HEAD_DIM * d.n_kpad + key0;
#if BWD_WGMMA
        stage_rows_at<BLOCK_KV, HEAD_DIM / 16>(smem, k_hat, HEAD_DIM, d.n_k - key0, WgKmajor<BLOCK_KV, HEAD_DIM, false>());
        stage_rows_at<BLOCK_KV, HEAD_DIM / 8>(smem + v, p.v + ((long)bh_kv * d.n_k + key0) * HEAD_DIM, BF_ROW, d.n_k - key0,
                                              WgKmajor<BLOCK_KV, BF_ROW, false>());
#else
        stage_rows<BLOCK_KV, HEAD_DIM / 16>(smem, k_hat, HEAD_DIM, d.n_k - key0, SwzKeyI8());
        stage_key_rows_bf16(smem + v, p.v, d, bh_kv, kb);
#endif
#if BWD_WGMMA
        stage_rows_at<HEAD_DIM, BLOCK_KV / 16>(smem + kt, k_hat_t, d.n_kpad, HEAD_DIM, WgKmajor<HEAD_DIM, BLOCK_KV, false>());
#else
        stage_rows<HEAD_DIM, BLOCK_KV / 16>(smem + kt, k_hat_t, d.n_kpad, HEAD_DIM, SwzT128());
#endif
    }

    // The transposed copies are n_qpad long; entries past n_q meet P̂ = dŜ = 0.
    static __device__ __forceinline__ void stage_query_block(const BackwardParams& p, u32 st, int bh, int qb) {
        const Dims& d = p.dims;
        const int row0 = qb * BLOCK_Q;
        const long t_off = (long)bh * HEAD_DIM * d.n_qpad + row0;
        const i8* q_hat = p.op.q_hat + ((long)bh * d.n_q + row0) * HEAD_DIM;
#if BWD_WGMMA
        stage_rows_at<BLOCK_Q, HEAD_DIM / 16>(st, q_hat, HEAD_DIM, d.n_q - row0, WgKmajor<BLOCK_Q, HEAD_DIM, true>());
        stage_rows_at<BLOCK_Q, HEAD_DIM / 8>(st + d_o, p.d_o + ((long)bh * d.n_q + row0) * HEAD_DIM, BF_ROW, d.n_q - row0,
                                             WgKmajor<BLOCK_Q, BF_ROW, true>());
        stage_rows_at<HEAD_DIM, BLOCK_Q / 16>(st + dot, p.tr.do_hat_t + t_off, d.n_qpad, HEAD_DIM,
                                              WgKmajor<HEAD_DIM, BLOCK_Q, false>());
        stage_rows_at<HEAD_DIM, BLOCK_Q / 16>(st + qt, p.tr.q_hat_t + t_off, d.n_qpad, HEAD_DIM,
                                              WgKmajor<HEAD_DIM, BLOCK_Q, false>());
#else
        stage_rows<BLOCK_Q, HEAD_DIM / 16>(st, q_hat, HEAD_DIM, d.n_q - row0, SwzQrowI8());
        stage_query_rows_bf16(st + d_o, p.d_o, d, bh, qb, SwzQrowBf16());
        stage_rows<HEAD_DIM, BLOCK_Q / 16>(st + dot, p.tr.do_hat_t + t_off, d.n_qpad, HEAD_DIM, SwzT64());
        stage_rows<HEAD_DIM, BLOCK_Q / 16>(st + qt, p.tr.q_hat_t + t_off, d.n_qpad, HEAD_DIM, SwzT64());
#endif
    }

#if BWD_WGMMA
    // Issues Sᵀ = K̂ Q̂ᵀ (#3, exact INT32) and then dPᵀ = V dOᵀ (#5, FP32) of warpgroup wg's 64 keys ×
    // the 64 rows (permuted), as two commit groups: P can be computed while dPᵀ runs.
    // Descriptors from the low words of the key block (smem_lo) and the stage (st_lo).
    static __device__ __forceinline__ void wg_issue_scores_dp(int (&s)[8][4], float (&dp)[8][4], u32 smem_lo, u32 st_lo, int wg) {
        wgmma_fence();  // the accumulators were last written by the previous tile's code
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 32; ++ks)
            wgmma_s8_ss_n64(s, sage10_kstep_desc<BLOCK_KV, HEAD_DIM>(smem_lo, 0, 64 * wg, ks),
                            sage10_kstep_desc<BLOCK_Q, HEAD_DIM>(st_lo, 0, 0, ks), ks);
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)  // = wg_issue_bf16_keys_by_rows(dp, smem + v, st + d_o, wg)
            wgmma_bf16_ss_n64(dp, sage10_kstep_desc<BLOCK_KV, BF_ROW>(smem_lo, v, 64 * wg, ks),
                              sage10_kstep_desc<BLOCK_Q, BF_ROW>(st_lo, d_o, 0, ks), ks);
        wgmma_commit();
    }

    // pipe14 (d = 64) and sb16 (d = 128): wg_issue_scores_dp's two commit groups as two calls (Sᵀ goes out a
    // tile ahead, dPᵀ with its tile).
    static __device__ __forceinline__ void wg_issue_scores(int (&s)[8][4], u32 smem_lo, u32 st_lo, int wg) {
        wgmma_fence();  // the accumulators were last read by ordinary instructions
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 32; ++ks)
            wgmma_s8_ss_n64(s, sage10_kstep_desc<BLOCK_KV, HEAD_DIM>(smem_lo, 0, 64 * wg, ks),
                            sage10_kstep_desc<BLOCK_Q, HEAD_DIM>(st_lo, 0, 0, ks), ks);
        wgmma_commit();
    }
    static __device__ __forceinline__ void wg_issue_dp(float (&dp)[8][4], u32 smem_lo, u32 st_lo, int wg) {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
            wgmma_bf16_ss_n64(dp, sage10_kstep_desc<BLOCK_KV, BF_ROW>(smem_lo, v, 64 * wg, ks),
                              sage10_kstep_desc<BLOCK_Q, BF_ROW>(st_lo, d_o, 0, ks), ks);
        wgmma_commit();
    }

    // Issues acc = a (the warp's 16 keys × 64 rows: 2 k-steps of A fragments) · columns 32c..32c + 31
    // of the [d][64] tile at bt (K-major, rows contiguous), exact INT32, as one commit group.
    // of the [d][64] tile at byte bt_off of the stage whose descriptor low word is st_lo.
    static __device__ __forceinline__ void wg_issue_chunk(int (&acc)[4][4], const u32 (*a)[4], u32 st_lo, u32 bt_off, int c) {
        wgmma_fence();  // acc was read, a written, by ordinary instructions since the last wgmma
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 32; ++ks)
            wgmma_s8_rs_n32(acc, a[ks], sage10_kstep_desc<HEAD_DIM, BLOCK_Q>(st_lo, bt_off, 32 * c, ks), ks);
        wgmma_commit();
    }

    // dV += P̂ᵀ dÔ (#4) and dK += dŜᵀ Q̂ (#7) of the tile: out[nd][e] = fma(float(acc), scale, out),
    // acc exact over the tile's 64 rows (§2.3). 2·d/32 chunks of 32 columns (dV's, then dK's), two
    // in flight, so that one chunk's dequantization overlaps the next chunk's product.
    template <bool I2FP = false>
    static __device__ __forceinline__ void wg_key_products(u32 st_lo, const u32 (*pa)[4], const u32 (*da)[4], float scale_v,
                                                           float scale_k, float (*dv)[4], float (*dk)[4]) {
        constexpr int C = HEAD_DIM / 32, N = 2 * C;
        int acc[2][4][4];
        wg_issue_chunk(acc[0], pa, st_lo, dot, 0);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int j = i + 1;
            if (j < N) {
                wg_issue_chunk(acc[j & 1], j < C ? pa : da, st_lo, j < C ? dot : qt, j % C);
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
            wgmma_fence_regs(acc[i & 1]);
            dequant_chunk<I2FP>(acc[i & 1], (i < C ? dv : dk) + 4 * (i % C), i < C ? scale_v : scale_k);
        }
    }
#endif

    // acc[nd] (16 keys × 8 columns per d-tile) = A (the warp's P̂ᵀ or dŜᵀ, 16 keys × 64 rows) · B, B
    // from a [d][64] stage tile (dÔᵀ or Q̂ᵀ); out[nd][e] = fma(float(acc), scale, out) (§2.3).
    static __device__ __forceinline__ void key_product(u32 bt, const u32 (*a)[4], float scale, float (*out)[4]) {
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
            for (int e = 0; e < 4; ++e) out[nd][e] = __fmaf_rn(i2f_exact(acc[e]), scale, out[nd][e]);
        }
    }

#if BWD_WGMMA
    // out[nt][e] = fma(float(acc), scale, out) of one 32-column chunk (wg_key_products' dequantization).
    // I2FP: one I2FP per value at every d (sb128's d = 128 tile), else sage10_i2f.
    template <bool I2FP = false>
    static __device__ __forceinline__ void dequant_chunk(const int (*acc)[4], float (*out)[4], float scale) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                out[nt][e] = __fmaf_rn(I2FP ? (float)acc[nt][e] : sage10_i2f(acc[nt][e]), scale, out[nt][e]);
    }
#endif

    // P̂ᵀ, dŜᵀ (pa, da: the A fragments of dV's and dK's products, k-step s: rows 32s..) of the tile's
    // P and dS by the group scales' inverses, and the dŜ bytes into the tile at ds_tile.
    static __device__ __forceinline__ void quantize_tile(float (*prob)[4], float (*ds)[4], float inv_p, float inv_ds,
                                                         unsigned char* ds_tile, u32 (*pa)[4], u32 (*da)[4]) {
        quantize_words<true>(prob, ds, inv_p, inv_ds, ds_tile, pa, da);
    }
    // quantize_tile's two halves: sb16's loop (d = 128) issues dV's first chunks between them (sb20), so that those
    // products run while dŜ is quantized and stored.
    static __device__ __forceinline__ void quantize_p(float (*prob)[4], float inv_p, u32 (*pa)[4]) {
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int h = 0; h < 2; ++h) pa[s][2 * half + h] = quant_quad(prob, 4 * s + 2 * half, h, inv_p, QuantBits());
    }
    static __device__ __forceinline__ void quantize_ds(float (*ds)[4], float inv_ds, unsigned char* ds_tile, u32 (*da)[4]) {
        quantize_words<false>(nullptr, ds, 0.0f, inv_ds, ds_tile, nullptr, da);
    }
    // dŜ (and with P, P̂ interleaved with it, word by word: quantize_tile's order) as A fragments, the dŜ bytes stored.
    template <bool P>
    static __device__ __forceinline__ void quantize_words(float (*prob)[4], float (*ds)[4], float inv_p, float inv_ds,
                                                          unsigned char* ds_tile, u32 (*pa)[4], u32 (*da)[4]) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if !BWD_WGMMA
        const int g = lane >> 2, t = lane & 3;
#endif
#if !BWD_WGMMA
        // dŜ byte addresses of this lane for rows 4t + 2b + c (b = n-tile parity, c = column parity)
        // at key 16w + g; other n-tiles and keys g + 8 are compile-time offsets (16 rows keep the
        // swizzle term).
        unsigned char* ds_out[4];
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int row = 4 * t + 2 * b + c;
                ds_out[2 * b + c] = ds_tile + row * BLOCK_KV + (swz_ds(row, warp) << 4) + g;
            }
#endif
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int n0 = 4 * s + 2 * half;
                    if (P) pa[s][2 * half + h] = quant_quad(prob, n0, h, inv_p, QuantBits());
                    u32 qd[4] = {quant_bits(ds[n0][2 * h], inv_ds), quant_bits(ds[n0][2 * h + 1], inv_ds),
                                 quant_bits(ds[n0 + 1][2 * h], inv_ds), quant_bits(ds[n0 + 1][2 * h + 1], inv_ds)};
                    da[s][2 * half + h] = pack_lo_bytes(qd[0], qd[1], qd[2], qd[3]);
#if !BWD_WGMMA
                    // The same four bytes into dŜ[row][key]: key 16w + g + 8h, rows qrow_of(n, 2t + {0,1}).
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        ds_out[(i >> 1) * 2 + (i & 1)][16 * (n0 >> 1) * BLOCK_KV + 8 * h] = (unsigned char)qd[i];
#endif
                }
#if BWD_WGMMA
        {
            // n-tile nt's register: {dŜ(row c = 0: key g, key g + 8), (row c = 1: the same)} from the two
            // A words of its n-tile pair (h = 0, 1: bytes (nt, c) at 2(nt mod 2) + c). Matrix i of a store is
            // n-tile i (+ 4 in the second): rows 16(i div 2) + 2(i mod 2) + 4t + c (32 rows further in the
            // second); lane l gives row j = l mod 8 (t = j div 2, c = j mod 2) of matrix l / 8.
            u32 sd[8];
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    sd[4 * s + 2 * half] = interleave_bytes<false>(da[s][2 * half], da[s][2 * half + 1]);
                    sd[4 * s + 2 * half + 1] = interleave_bytes<true>(da[s][2 * half], da[s][2 * half + 1]);
                }
            const int j = lane & 7, mi = lane >> 3;
            const int row = 16 * (mi >> 1) + 2 * (mi & 1) + 4 * (j >> 1) + (j & 1);
            const u32 ds_row = smem_addr(ds_tile) + row * BLOCK_KV + ((warp ^ (row & 7)) << 4);
            stmatrix_x4_trans(ds_row, sd[0], sd[1], sd[2], sd[3]);
            stmatrix_x4_trans(ds_row + 32 * BLOCK_KV, sd[4], sd[5], sd[6], sd[7]);
        }
#endif
    }

    // Sᵀ, dPᵀ → P, dS → P̂ᵀ, dŜᵀ (A fragments; k-step s: rows 32s.., see qrow_of) once the block knows
    // the tile amax; dŜ bytes to shared memory; dV += P̂ᵀ dÔ (#4), dK += dŜᵀ Q̂ (#7), per-tile scales
    // (§2.3). Returns the dQ tile's scale fl(s_dŜ·s_K).
    static __device__ __forceinline__ float tile(const BackwardParams& p, const StagedTile& x, float (*dv)[4],
                                                 float (*dk)[4]) {
        const Dims& d = p.dims;
        const float s_q = p.op.q_scale[x.bh * d.n_qblk + x.qb], s_do = p.do_scale[x.bh * d.n_qblk + x.qb];
        const float s_k = p.op.k_scale[x.bh_kv * d.n_kblk + x.kb];
        const float s_qk = __fmul_rn(__fmul_rn(s_q, p.c_lambda), s_k);  // fl(fl(s_Q·cλ)·s_K), §4

        int s_acc[8][4];
        float ds[8][4];
        float prob[8][4];
        float amax_p;
#if BWD_WGMMA
        const u32 smem_lo = sage10_desc_lo(x.smem), st_lo = sage10_desc_lo(x.st);
        // Issued on every tile (the same commit groups each time, or ptxas serializes); the first
        // tile's result (of a stale buffer) is not added.
        int dq_acc[HEAD_DIM / 16][4];
        wgmma_fence();
        issue_dq(dq_acc, smem_lo, sage10_desc_lo(x.prev_ds));
        wgmma_commit();
        wg_issue_scores_dp(s_acc, ds, smem_lo, st_lo, sbwd13_wg());
        wgmma_wait<2>();  // dQ of block qb − 1 landed; Sᵀ, dPᵀ run on
        wgmma_fence_regs(dq_acc);
        if (x.has_prev) sage10_add_dq(p, dq_acc, x.prev_dq_scale, x.bh, x.qb - 1);  // block-uniform
        else sbwd12_interleave_kt(x.smem + kt);  // the CTA's first tile; block (b) below is the barrier
        wgmma_wait<1>();  // Sᵀ done; dPᵀ may still run
        wgmma_fence_regs(s_acc);
        tile_p_regs<true>(x.rows, s_acc, s_qk, prob);
        amax_p = sage10_tile_max<false>(prob);  // while dPᵀ runs; redone below if the tile is masked
        wgmma_wait<0>();
        wgmma_fence_regs(ds);
#else
        {
            const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
            const int mi = lane >> 3, r = lane & 7;
            const int key_row = warp * 16 + (mi & 1) * 8 + r, q_row = qrow_of(0, r);
            const int x8 = HEAD_DIM == 128 ? r : r >> 1;  // swz_key_i8 / swz_qrow_i8 terms of this lane's rows
            keys_by_rows<HEAD_DIM / 16, HEAD_DIM, true>(s_acc, x.smem + key_row * HEAD_DIM, x8, x.st + q_row * HEAD_DIM, x8);
            keys_by_rows<HEAD_DIM / 8, BF_ROW, true>(ds, x.smem + v + key_row * BF_ROW, r, x.st + d_o + q_row * BF_ROW, r);
        }
        tile_p_regs<true>(x.rows, s_acc, s_qk, prob);
        amax_p = sage10_tile_max<false>(prob);
#endif
        GroupScale sc_p, sc_ds;
        u32 pa[2][4], da[2][4];
        quantize_p_ds(d, x, prob, ds, amax_p, sc_p, sc_ds, pa, da);
#if BWD_WGMMA
        wg_key_products(st_lo, pa, da, __fmul_rn(sc_p.scale, s_do), __fmul_rn(sc_ds.scale, s_q), dv, dk);
#else
        key_product(x.st + dot, pa, __fmul_rn(sc_p.scale, s_do), dv);
        key_product(x.st + qt, da, __fmul_rn(sc_ds.scale, s_q), dk);
#endif
        return __fmul_rn(sc_ds.scale, s_k);
    }

#if BWD_WGMMA
    // Issues acc = dŜ K̂ (#6, exact INT32): M = the 64 rows, N = warpgroup wg's half of d (K̂ᵀ rows
    // wg·d/2..), K = the 128 keys; A = the dŜ byte tile; smem_lo, ds_lo: descriptor low words of the
    // key block and of the dŜ tile.
    static __device__ __forceinline__ void issue_dq(int (&acc)[HEAD_DIM / 16][4], u32 smem_lo, u32 ds_lo) {
        const int wg = sbwd13_wg();
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 32; ++ks)
            wgmma_s8_ss(acc, sage10_kstep_desc<BLOCK_Q, BLOCK_KV>(ds_lo, 0, 0, ks),
                        sage10_kstep_desc<HEAD_DIM, BLOCK_KV>(smem_lo, kt, wg * (HEAD_DIM / 2), ks), ks);
    }
#endif

    // dS = P ∘ (dP − D) (sage10_ds_regs), the mask, P's and dS's block amax (barrier (b); amax_p: P's warp
    // amax before the mask), their group scales, and P̂, dŜ quantized: dŜ stored at x.ds, both as A fragments.
    static __device__ __forceinline__ void quantize_p_ds(const Dims& d, const StagedTile& x, float (*prob)[4], float (*ds)[4],
                                                         float amax_p, GroupScale& sc_p, GroupScale& sc_ds, u32 (*pa)[4],
                                                         u32 (*da)[4]) {
        sage10_ds_regs(x.rows, prob, ds);
        if (sage10_mask(d, x.qb, x.kb, prob, ds)) amax_p = sage10_tile_max<false>(prob);  // warp-uniform
        float amax_ds = sage10_tile_max<true>(ds);
        block_max2(amax_p, amax_ds, x.red);  // (b)
        sage10_group_scales(amax_p, amax_ds, sc_p, sc_ds);
        quantize_tile(prob, ds, sc_p.inv, sc_ds.inv, x.ds, pa, da);
    }

    // Every product of tile() has been waited for inside it.
    static __device__ __forceinline__ void drain(float (*)[4], float (*)[4]) {}

    // dQ += dŜ K̂ (#6) for the warp's rows and half of d (dŜ at shared address ds_tile). I2FP, ROT_ACC: as
    // sage10_add_dq's (wgmma dQ only).
    template <bool I2FP = false, bool ROT_ACC = false>
    static __device__ __forceinline__ void dq(const BackwardParams& p, u32 smem, u32 ds_tile, float scale, int bh, int qb) {
#if BWD_WGMMA
        int acc[HEAD_DIM / 16][4];
        wgmma_fence();
        issue_dq(acc, sage10_desc_lo(smem), sage10_desc_lo(ds_tile));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(acc);
        sage10_add_dq<I2FP, ROT_ACC>(p, acc, scale, bh, qb);
#else
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
        const int c0 = (warp >> 2) * (HEAD_DIM / 2);
        const int a_row = (warp & 3) * 16 + (mi & 1) * 8 + r;
        u32 da[BLOCK_KV / 32][4];
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 32; ++ks)
            ldmatrix_x4(da[ks], ds_tile + a_row * BLOCK_KV + (swz_ds(a_row, 2 * ks + (mi >> 1)) << 4));
        int r_lo;
        float* dq_lo = dq_lane_ptr(p, bh, qb, r_lo);
#pragma unroll
        for (int np = 0; np < HEAD_DIM / 32; ++np) {
            float val[2][4];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int row = c0 + (2 * np + j) * 8 + r;  // K̂ᵀ row = column of dQ
                int acc[4] = {0, 0, 0, 0};
#pragma unroll
                for (int cg = 0; cg < BLOCK_KV / 64; ++cg) {
                    u32 b[4];
                    ldmatrix_x4(b, smem + kt + row * BLOCK_KV + (swz_t128(row, 4 * cg + mi) << 4));
                    mma_s8(acc, da[2 * cg], b);
                    mma_s8(acc, da[2 * cg + 1], b + 2);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) val[j][e] = __fmul_rn(i2f_exact(acc[e]), scale);
            }
            red_add_dq16(p.dims, dq_lo + 16 * np, r_lo, val);
        }
#endif
    }
};

#if BWD_WGMMA && HEAD_DIM == 64
// StagedSage::stage_query_block (wgmma layout, d = 64) with its per-thread parts computed once per CTA:
// before, ~90 instructions per tile rebuilt 5 swizzled destinations and 5 guarded 64-bit sources
// (ptxas rematerialized them in the loop); now per tile a block-uniform base per tile and per copy an
// add (and for Q̂, dO a compare and a select). The same chunks go to the same bytes as before; an
// invalid row (past n_q) is zero-filled from the tile's first byte as before. d = 128 keeps the
// default: its kernel is at 254 registers and has none to hold these.
template <>
struct QueryStager<StagedSage> {
    // One 16-byte chunk per thread of Q̂ [64][64 B] and of each [64][64 B] transposed tile (dÔᵀ, Q̂ᵀ),
    // two of dO [64][128 B] (rows tid/8 and tid/8 + 32).
    static_assert(THREADS == 256 && BLOCK_Q == 64, "QueryStager<StagedSage>: one chunk per thread per 64-byte tile");
    u32 src_rows;   // threadIdx·16: the chunk's byte in a tile of contiguous rows (Q̂: row tid/4; dO: row tid/8)
    u32 src_t;      // (tid/4)·n_qpad + (tid mod 4)·16: its byte in a transposed tile (row tid/4 < d: always valid)
    u32 dst_q, dst_do, dst_t;  // its destinations in a stage (WgKmajor, as stage_query_block)
    int row_q, row_do;         // its Q̂ row and its first dO row

    __device__ __forceinline__ QueryStager(const BackwardParams& p, int) {
        const int tid = threadIdx.x;
        src_rows = 16u * tid;
        src_t = (u32)((tid >> 2) * p.dims.n_qpad + (tid & 3) * 16);
        row_q = tid >> 2;
        row_do = tid >> 3;
        dst_q = WgKmajor<BLOCK_Q, HEAD_DIM, true>()(row_q, tid & 3);
        dst_do = StagedSage::d_o + WgKmajor<BLOCK_Q, BF_ROW, true>()(row_do, tid & 7);
        dst_t = WgKmajor<HEAD_DIM, BLOCK_Q, false>()(tid >> 2, tid & 3);
        // Each through an identity shuffle: ptxas rematerializes a value from threadIdx inside the loop
        // when it can (it did: the first version saved 17 of ~90 instructions), not across a SHFL.
        src_rows = opaque(src_rows);
        src_t = opaque(src_t);
        dst_q = opaque(dst_q);
        dst_do = opaque(dst_do);
        dst_t = opaque(dst_t);
        row_q = opaque(row_q);
        row_do = opaque(row_do);
    }
    template <class T>
    static __device__ __forceinline__ T opaque(T v) { return __shfl_sync(0xffffffffu, v, threadIdx.x & 31); }

    // cp.async of the chunk at byte `off` of the tile at `tile`, or a zero fill (source: the tile's start).
    static __device__ __forceinline__ void copy(u32 dst, const void* tile, u32 off, bool valid) {
        cp_async16(dst, (const unsigned char*)tile + (valid ? off : 0u), valid);
    }

    __device__ __forceinline__ void operator()(const BackwardParams& p, u32 st, int bh, int qb) const {
        const Dims& d = p.dims;
        const int row0 = qb * BLOCK_Q, rows = d.n_q - row0;  // rows ≥ `rows` are past n_q
        const long t_off = (long)bh * HEAD_DIM * d.n_qpad + row0;
        const i8* q_hat = p.op.q_hat + ((long)bh * d.n_q + row0) * HEAD_DIM;
        const u16* d_o = p.d_o + ((long)bh * d.n_q + row0) * HEAD_DIM;
        copy(st + dst_q, q_hat, src_rows, row_q < rows);
        // Row tid/8 + 32 of dO: 32 rows (4 096 bytes) further in the source and, as 32 is a multiple of
        // the permutation's 16 rows and of the 128-byte swizzle's 8, 4 096 bytes further in the tile.
        copy(st + dst_do, d_o, src_rows, row_do < rows);
        copy(st + dst_do + 32 * BF_ROW, d_o, src_rows + 32 * BF_ROW, row_do + 32 < rows);
        copy(st + StagedSage::dot + dst_t, p.tr.do_hat_t + t_off, src_t, true);
        copy(st + StagedSage::qt + dst_t, p.tr.q_hat_t + t_off, src_t, true);
    }
};
#endif

#define SAGE14_DQ_ROW (HEAD_DIM * 4)  // bytes of one dQ staging row (unpadded; pipe14b, bulk15, sb128)
// A landed dQ tile of the wgmma layout (the values sage10_add_dq adds: fl(float(acc)·scale)) into a
// staging tile (I2FP: as sage10_add_dq's): warp w's rows 16(w mod 4) + lane/4 (+ 8), columns (w div 4)·d/2 + 8n + 2(lane mod 4).
template <bool I2FP = false>
__device__ __forceinline__ void sage14_stage_dq(unsigned char* tile, const int (*acc)[4], float scale) {
    const auto cvt = [](int a) { return I2FP ? (float)a : sage10_i2f(a); };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* lo = (float*)(tile + ((warp & 3) * 16 + (lane >> 2)) * SAGE14_DQ_ROW) + (warp >> 2) * (HEAD_DIM / 2) + 2 * (lane & 3);
    float* hi = lo + 8 * (SAGE14_DQ_ROW / 4);
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 16; ++n) {
        *(float2*)(lo + 8 * n) = make_float2(__fmul_rn(cvt(acc[n][0]), scale), __fmul_rn(cvt(acc[n][1]), scale));
        *(float2*)(hi + 8 * n) = make_float2(__fmul_rn(cvt(acc[n][2]), scale), __fmul_rn(cvt(acc[n][3]), scale));
    }
}

// bulk15 (ROT; d = 64, and since session 14 d = 128): sage14_stage_dq's values at
// sage14_stage_dq's addresses, the order of the stores permuted per row. Rows are 4d bytes (256 or 512),
// so every row of a 16-row block starts at the same bank and
// sage14_stage_dq's STS.64 (8 rows × 32 bytes, n-tile j of every row) takes 8 wavefronts, not 2. Here
// store j of lane (r = lane/4, c = lane mod 4) writes n-tile j ^ k, k = r mod 4 (columns 8(j ^ k) + 2c,
// +1 of the warp's half): rows r and r + 4 share a group of 8 banks, the 4 groups differ, 2 wavefronts.
// With NT = d/16 n-tiles per warp (4 or 8) and the tile 32·NT-byte aligned (ALIGNED: d = 64's 1024-byte
// layout start, dqst0 and dqst_bytes multiples of 128, checked where the tile is chosen), the lane's
// offset has bits 5 .. 4 + log2(NT) clear, so the address of store j is (base + 32k) ^ 32j. The values
// are picked by two select stages (swap n-tiles j, j ^ 1 where k & 1, then j, j ^ 2 where k & 2).
__device__ __forceinline__ void sage14_sts_f2(u32 addr, float2 v) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}
// ALIGNED = false (d = 128's layout: the tile only 16-byte aligned): the XOR on the offset within the tile,
// then one add per store; the whole warp's addresses shift by the same amount, so the banks stay distinct.
// SELECT = false (sb26, d = 128 on sm_90a: SAGE_DQ_ACC_ROT): store j writes n-tile j itself at that address,
// so row r's n-tile m lands at position m ^ (r mod 4), the layout the accumulator keeps (common.cuh): the
// same banks, without the 4·NT selects per thread (2 per score at d = 128: 5.6 % of the loop's instructions).
template <bool I2FP = false, bool ALIGNED = true, bool SELECT = true>
__device__ __forceinline__ void sage14_stage_dq_rot(u32 tile, const int (*acc)[4], float scale) {
    constexpr int NT = HEAD_DIM / 16;
    static_assert(NT == 4 || NT == 8, "the permutation assumes 4 or 8 n-tiles per warp");
    const auto cvt = [](int a) { return I2FP ? (float)a : sage10_i2f(a); };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int k = (lane >> 2) & 3;
    const u32 off = ((warp & 3) * 16 + (lane >> 2)) * SAGE14_DQ_ROW + (warp >> 2) * (HEAD_DIM * 2) + 8 * (lane & 3) + 32 * k;
    const u32 lo = ALIGNED ? tile + off : off;
    float2 v[2][NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        v[0][n] = make_float2(__fmul_rn(cvt(acc[n][0]), scale), __fmul_rn(cvt(acc[n][1]), scale));
        v[1][n] = make_float2(__fmul_rn(cvt(acc[n][2]), scale), __fmul_rn(cvt(acc[n][3]), scale));
    }
    if (SELECT) {
        const bool x1 = k & 1, x2 = k & 2;
        float2 t[2][NT];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < NT; ++j) t[h][j] = x1 ? v[h][j ^ 1] : v[h][j];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < NT; ++j) v[h][j] = x2 ? t[h][j ^ 2] : t[h][j];  // = the n-tile j ^ k
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const u32 a = ALIGNED ? lo ^ (32 * j) : tile + (lo ^ (32 * j));
        sage14_sts_f2(a, v[0][j]);
        sage14_sts_f2(a + 8 * SAGE14_DQ_ROW, v[1][j]);
    }
}
#if PIPE14_LOOP
// ---- pipe14b: the pipelined sage path (d = 64, sm_90a) as its own types, with its own entries ----------
// StagedSage14T<KIND, BULK, ROWS8, F, ROT, SPLIT> = StagedSage with the pipelined loop (staged_query_loop below) and its
// layout: three query-block stages, two amax scratches and, with BULK, two dQ staging tiles (64 rows ×
// (d FP32 + 32 bytes; the rows are used unpadded, the 32 bytes are pipe14b's padded variant's, kept so that
// the measured kernel is the committed one)). Options, measured in pipe14b's call (docs/RESULTS-gpu.md):
// - BULK: the loop writes a landed dQ tile to a staging tile (the same FP32 values sage10_add_dq adds) and,
//   after the next tile's barrier, warp w adds rows 8w..8w + 7 to the accumulator by one bulk reduce
//   (cp.reduce.async.bulk .add.f32, 2 KB), instead of 8 red.global.add.v2.f32 per thread;
// - ROWS8: the row constants of block qb + 2 loaded and stored by lanes 0..7 of every warp (8 rows each)
//   instead of threads 0..63;
// - F: dPᵀ of block qb + 1 also issued at the end of tile qb (pipe14's variant F: P after both products).
// - ROT (bulk15): with BULK, the staging stores in a per-row order that makes them conflict-free
//   (sage14_stage_dq_rot: same values, same addresses; the tile stays row-major, so each warp's 8 rows
//   stay one 2 KB bulk source).
// KIND only tells the two instances apart. StagedSage14 runs sage_bwd_main_mma_sage (plain grid):
// bulk15: BULK and ROT, without ROWS8 and F (NOT RUN ON A GPU when written: pipe14b measured none of
// the options there, as with BULK + ROWS8 it was 0.5–2 % slower and ROWS8 alone +8 %; bulk alone
// removes the 16 REDG and their wait without ROWS8's ~25 divergent instructions in all 8 warps);
// StagedSage14P runs sage_bwd_main_persist_sage: BULK, ROWS8, F, unrotated (−2.1 % at the training
// shape N 1024). sage_bwd_main_mma keeps StagedSage with the generic loop (= main 37e5e90's code for every path it runs).
// The staging rows are reserved 4d + 32 bytes either way (pipe14b's padded variant; the host allocates
// both kernels the same shared memory), the stores use the first 4d.
// - SPLIT (bwd16): the query loop as two loops, the tiles that may need the causal / n_k mask first, then
//   the rest without any mask code (sage14_query_loop): ptxas had put 32 register moves of P and the mask
//   test into every tile for the mask branch. Measured (bwd16's call, docs/RESULTS-gpu.md): sagebwd backward
//   −3.2 % at the training shape N 4096 (plain grid). Plain grid only: in the persistent kernel (252
//   registers) the second copy of the loop body makes ptxas spill (255 registers + 8 bytes of stack).
#ifndef SAGE14_PLAIN_OPTS
#define SAGE14_PLAIN_OPTS true, false, false, true, true
#endif
#ifndef SAGE14_PERSIST_OPTS
#define SAGE14_PERSIST_OPTS true, true, true, false, false
#endif
// - ATOMIC_AMAX (bwd17; the plain grid's kernels, KIND 0 and 2, only): the tile amax of P and dS by one
//   red.shared.max.u32 per value per warp into a 2-float slot, then one 8-byte load after the barrier (bwd17_block_max2),
//   instead of 8 partials per value stored, read back as 4 LDS.128 and combined by 14 FMNMX after it. Measured (bwd17's
//   call, docs/RESULTS-gpu.md): sagebwd backward −1.0 % at the training shape N 4096; verified (170/170, plain grid --quick).
//   (bwd17's ROWS4, the row constants interleaved for 8 LDS.128 instead of 16 LDS.64, measured +1.7 % alone and +0.3 %
//   on top of this: removed, kept on branch bwd17.)
// - TMA_DQ (bwd18; KIND 2 = StagedSage14Q, kernel sage_bwd_main_mma_sage_q, the default at d = 64 since session 17's
//   final call: backward −4.1 % at the training shape N 4k and 8k; SAGEBWD_SAGE_TMA_DQ=0 in src/backward.rs restores
//   KIND 0's bulk reduces): StagedSage14's tile with fpab15's dQ staging at d = 64: each warp
//   stores its own landed dQ fragment (16 rows × 32 FP32) into its 2 KB box in the 128-byte swizzle (conflict-free
//   without bulk15's 32 selects), and after the next tile's barrier (b), where the base issues its row bulk reduces,
//   the tile's boxes go out as tensor reduces (bwd18_tma_stage_dq, sb21_tma_reduce_dq). Boxes double-buffered
//   like the staging tiles; the bulk wait_read before (b) and the proxy fence before it cover them as before.
template <int KIND, bool BULK, bool ROWS8, bool F, bool ROT, bool SPLIT>
struct StagedSage14T : StagedSage {
    static constexpr bool BULK_DQ = BULK, ROWS_8 = ROWS8, DP_AHEAD = F, ROT_DQ = BULK && ROT, SPLIT_MASK = SPLIT;
    static constexpr bool ATOMIC_AMAX = KIND != 1;
    static constexpr bool TMA_DQ = KIND == 2 && BULK;
    typedef StagedLayout<4 * BF_KT, 5 * BF_QT, BLOCK_Q * BLOCK_KV, 3, BULK ? BLOCK_Q * (HEAD_DIM * 4 + 32) : 0> Layout;
};
typedef StagedSage14T<0, SAGE14_PLAIN_OPTS> StagedSage14;
typedef StagedSage14T<1, SAGE14_PERSIST_OPTS> StagedSage14P;
typedef StagedSage14T<2, SAGE14_PLAIN_OPTS> StagedSage14Q;
template <int KIND, bool BULK, bool ROWS8, bool F, bool ROT, bool SPLIT>
struct QueryStager<StagedSage14T<KIND, BULK, ROWS8, F, ROT, SPLIT>> : QueryStager<StagedSage> {
    __device__ __forceinline__ QueryStager(const BackwardParams& p, int bh) : QueryStager<StagedSage>(p, bh) {}
};
#endif

#if SB128_LOOP
// ---- sb128: the INT8 path at d = 128 (sm_90a) as its own type, with its own query loop -----------------
// StagedSage128 = StagedSage (two query-block stages, the same tile: dQ of block qb − 1 issued before Sᵀ, dPᵀ)
// with its own query loop (sb16_query_loop, below sage14's helpers). Each item was measured against the form before it
// (docs/RESULTS-gpu.md, sessions 14–20); the other forms are in the history before session 21.
// - Bulk dQ (sb128): the landed dQ of block qb − 1 (the values sage10_add_dq adds, fl(float(acc)·scale)) goes to a
//   staging tile [64][d] FP32 instead of 16 red.global.add.v2.f32 per thread, and warp w adds rows 8w..8w + 7 (4 KB)
//   to the accumulator by one bulk reduce (pipe14b's sage14_bulk_dq), in bulk15's permuted order (sage14_stage_dq_rot:
//   2 shared wavefronts per STS.64 instead of 8). The per-thread reductions had waited for the LSU (prof15: long
//   scoreboard 7.0 %, LG throttle 2.8 %); without the bulk form +4 % at N 4096, without the order +4.6 to +11.6 %.
//   Since sb26 the permuted order is kept in the accumulator (SAGE_DQ_ACC_ROT, common.cuh; the postprocess reads it
//   back in order) instead of undone by 64 FSEL per thread and tile (2.1 of ~37 instructions per score, ncu).
// - Raw row constants: those of block qb + 1 loaded raw (lse2, offset, D) early and subtracted when stored at the
//   end of the tile (pipe14's (3)), so that no warp waits for global loads inside the tile.
// - Scales ahead: s_Q, s_dO of block qb + 1 loaded in tile qb and s_K once per item (the scale loads had sat behind
//   the stage's copies in the LSU queue: 3.8 %).
// - One I2FP per float(acc) in the dV, dK, dQ dequantizations (exact, |acc| < 2^22) instead of i2f_exact's VIADD +
//   FADD: 160 instructions fewer per thread per tile (+4 % at N 4096 without it).
// - Pipelined (sb16): Sᵀ of block qb + 1 issued at the end of tile qb, one block barrier per tile (the amax barrier
//   (b)), and each stage split by lifetime: its Sᵀ/dPᵀ operands (Q̂, dO: part A, free once every warp has waited for
//   dPᵀ, i.e. at (b)) and its dV/dK operands (dÔᵀ, Q̂ᵀ: part B, free at the next (b)). After (b) of tile qb, A of
//   block qb + 2 goes to the A part of stage qb mod 2 and B of block qb + 1 to the B part of stage (qb + 1) mod 2, so
//   block j's operands still sit in stage j mod 2 and the two stages (80 KB) suffice where pipe14 needed three.
// - P̂, then dV's first two chunks issued, then dŜ quantized and stored while they run (sb20): d 128 backward −0.3 to
//   −1.4 % at every sweep shape (call21b). The same order at d = 64 was +1.1 to +2.5 % slower, so pipe14's loop keeps
//   quantize_tile. Moving also the work after (b) that no product waits for (the next blocks' copies, the row loads,
//   the bulk dQ of qb − 2) behind those chunks made ptxas spill (4 STL, 5 LDL) and cost +4.7 to +8.1 % (call21c).
// The same products and FP32 operations as StagedSage, in the same order (only the unordered FP32 additions of dQ
// into the accumulator happen in another order, as pipe14b's bulk dQ). Shared memory: StagedSage's layout, a second
// amax scratch and two 32 KB staging tiles. Measured (sb128's call; verified 152/152): backward at d = 128 −4.5 to
// −9.1 % at N 1024 / 4096, −13 % at N 16384; sb16 and sb20 on top of it.
// Which thread issues the TMA copies (SB20_TMA_THREAD) and which 64 threads load and store the row constants
// (SB20_ROW_BASE .. + 63) in sb16's loop: both duties on warpgroup 1 (warps 4 and 5). Measured (call21g, the d 128
// sweep shapes, three rounds, against both on warpgroup 0, i.e. thread 0 and threads 0..63): −0.2 to −1.2 % at every
// shape; split between the warpgroups (the copies on 1 and the rows on 0, or the reverse) +4.5 % and +3.6 %: the
// warpgroup that carries an extra duty reaches the tile's barrier and its wgmma issues late, and one late warpgroup
// costs less than two.
#ifndef SB20_TMA_THREAD
#define SB20_TMA_THREAD 128
#endif
#ifndef SB20_ROW_BASE
#define SB20_ROW_BASE 128
#endif
struct StagedSage128 : StagedSage {
    static constexpr bool BULK_DQ = true;
    typedef StagedLayout<4 * BF_KT, 5 * BF_QT, BLOCK_Q * BLOCK_KV, 2, BLOCK_Q * HEAD_DIM * 4> Layout128;
    // With a second amax scratch before the dQ staging tiles (one barrier per tile).
    struct Layout : Layout128 {
        static constexpr int dqst0 = Layout128::red + 2 * Layout128::red_bytes;
        static constexpr int bytes = dqst0 + 2 * Layout128::dqst_bytes + ALIGN_SLACK;
    };

    // StagedSage::stage_query_block in two parts, copied at different times by sb16's loop: A = Q̂, dO (Sᵀ's and
    // dPᵀ's B operands), B = dÔᵀ, Q̂ᵀ (the key products'). (Not shared with stage_query_block: written as two
    // calls there, ptxas scheduled the d = 64 and d = 128 kernels differently.)
    static __device__ __forceinline__ void stage_query_a(const BackwardParams& p, u32 st, int bh, int qb) {
        const Dims& d = p.dims;
        const int row0 = qb * BLOCK_Q;
        const i8* q_hat = p.op.q_hat + ((long)bh * d.n_q + row0) * HEAD_DIM;
        stage_rows_at<BLOCK_Q, HEAD_DIM / 16>(st, q_hat, HEAD_DIM, d.n_q - row0, WgKmajor<BLOCK_Q, HEAD_DIM, true>());
        stage_rows_at<BLOCK_Q, HEAD_DIM / 8>(st + d_o, p.d_o + ((long)bh * d.n_q + row0) * HEAD_DIM, BF_ROW, d.n_q - row0,
                                             WgKmajor<BLOCK_Q, BF_ROW, true>());
    }
    static __device__ __forceinline__ void stage_query_b(const BackwardParams& p, u32 st, int bh, int qb) {
        const Dims& d = p.dims;
        const long t_off = (long)bh * HEAD_DIM * d.n_qpad + qb * BLOCK_Q;
        stage_rows_at<HEAD_DIM, BLOCK_Q / 16>(st + dot, p.tr.do_hat_t + t_off, d.n_qpad, HEAD_DIM,
                                              WgKmajor<HEAD_DIM, BLOCK_Q, false>());
        stage_rows_at<HEAD_DIM, BLOCK_Q / 16>(st + qt, p.tr.q_hat_t + t_off, d.n_qpad, HEAD_DIM,
                                              WgKmajor<HEAD_DIM, BLOCK_Q, false>());
    }

    // The landed dQ tile's values fl(float(acc)·scale) into a staging tile (one I2FP per value), each row's
    // chunks in the accumulator's order (SAGE_DQ_ACC_ROT, sb26).
    static __device__ __forceinline__ void stage_dq(unsigned char* tile, const int (*acc)[4], float scale) {
        sage14_stage_dq_rot<true, false, false>((u32)__cvta_generic_to_shared(tile), acc, scale);
    }

    // StagedSage::dq (the item's last dQ tile, after the loop) with one I2FP per value, to the accumulator's order.
    static __device__ __forceinline__ void dq(const BackwardParams& p, u32 smem, u32 ds_tile, float scale, int bh, int qb) {
        StagedSage::dq<true, true>(p, smem, ds_tile, scale, bh, qb);
    }
    static constexpr bool TMA_STAGE = false;
};
// ---- sb20: sb16's in-loop stage copies by TMA (d = 128, plain grid: sage_bwd_main_mma_sage_t) ----------------------
// sb16's profile (RESULTS-gpu.md): after barrier (b) every thread rebuilt the swizzled destinations and guarded sources
// of its 10 cp.async chunks (~110 instructions per thread per tile, 3 spilled values reloaded), on the stretch between
// (b) and the first dV/dK chunk where the tensor pipe has only dQ(qb − 1) to run. Here one thread (SB20_TMA_THREAD)
// issues the same bytes as 5 TMA boxes completing on one mbarrier, waited for where the cp.async wait was (before the
// next tile's (b)).
// The four maps (src/backward.rs `sage128_stage_maps`) sit in front of BackwardParams in the kernel's one parameter:
//   0: Q̂ [rows·n_q][d] INT8 as 5-D {d, e: 2, b: 4, c: 2, a}, strides {1, 4, 2, 16} rows, box {d, 2, 4, 2, 4}: query
//      row 16a + 4b + 2c + e lands in tile row 16a + 8c + 2b + e, which is permuted_qrow's order; the 128-byte
//      swizzle is WgKmajor's;
//   1: dO [rows·n_q][d] BF16, the same view, box {64, 2, 4, 2, 4}: two boxes, WgKmajor's two atom columns;
//   2, 3: dÔᵀ, Q̂ᵀ [rows][d][n_qpad] INT8 as 3-D {n_qpad, d, rows}, box {64, d, 1}, 64-byte swizzle.
// The host takes it only when n_q % 64 == 0: the rows of consecutive heads are then whole 16-row groups and no query
// block is ragged (the cp.async copies zero-fill rows past n_q; here no such row exists).
// At d = 64 the same copies on bwd18's TMA-dQ kernel measured +2.3 to +5.6 % (call21e, verified 182/182): there the
// per-thread cp.async copies were already cheap (QueryStager's precomputed parts), the TMA form added 18 instructions
// to the loop, and the issuing warp delays its warpgroup on a shorter tile. Not used.
struct __align__(64) StageMapsParam {
    unsigned long long w[4][16];
};
struct BwdParamsStageMaps {
    StageMapsParam maps;
    BackwardParams p;
};
static_assert(sizeof(StageMapsParam) == 512 && sizeof(BwdParamsStageMaps) == 832, "BwdParamsStageMaps layout: src/backward.rs");
struct StagedSage128T : StagedSage128 {
    static constexpr bool TMA_STAGE = true;
    static constexpr u32 A_BYTES = 3 * BF_QT, B_BYTES = 2 * BF_QT;  // Q̂ + dO, dÔᵀ + Q̂ᵀ

    static __device__ __forceinline__ const unsigned long long* maps(const BackwardParams& p) {
        return ((const StageMapsParam*)((const char*)&p - sizeof(StageMapsParam)))->w[0];
    }
    // The issuing thread (SB20_TMA_THREAD), once per CTA before a block barrier: the mbarrier (one arrival, its own,
    // with the bytes).
    static __device__ __forceinline__ void init(const BackwardParams& p, u32 bar) {
        mbar_init(bar, 1);
        fence_mbar_init();
#pragma unroll
        for (int m = 0; m < 4; ++m) tma_prefetch_map(maps(p) + 16 * m);
    }

    // A of block qa (if `a`) into the stage at st_a, B of block qb into the stage at st_b, on mbarrier bar (one thread).
    static __device__ __forceinline__ void stage_copies(const BackwardParams& p, u32 bar, u32 st_a, u32 st_b, int bh, int qa,
                                                        int qb, bool a) {
        const unsigned long long* m = maps(p);
        mbar_arrive_expect_tx(bar, (a ? A_BYTES : 0) + B_BYTES);
        if (a) {
            const int grp = (bh * p.dims.n_q + qa * BLOCK_Q) / 16;  // rows·n_q < 2^31 (the host checks)
            tma_load_5d(st_a, m, 0, 0, 0, 0, grp, bar);
            tma_load_5d(st_a + d_o, m + 16, 0, 0, 0, 0, grp, bar);
            tma_load_5d(st_a + d_o + BLOCK_Q * 128, m + 16, 64, 0, 0, 0, grp, bar);
        }
        tma_load_3d(st_b + dot, m + 32, qb * BLOCK_Q, 0, bh, bar);
        tma_load_3d(st_b + qt, m + 48, qb * BLOCK_Q, 0, bh, bar);
    }
};
#endif

// ---- bf16: #3 to #7 all BF16 ---------------------------------------------------------------------
// acc[n] (16 rows × 8 columns, n = 0..2·NP − 1) += a (KS k-steps of 16 in registers, A fragments) ·
// B, B from a BF16 tile of ROW-byte rows (BF_ROW, or 128 for one atom column of a WgKmajor tile) read transposed (k = tile row, n = tile column): tile
// rows 16ks.. for k-step ks, columns 8·chunk0.. (swizzle swz_rows8). Lane (mi, r) addresses row
// 16ks + 8·(mi mod 2) + r, chunk chunk0 + 2np + mi / 2: the x4 load gives the B fragments of
// n-tiles 2np, 2np + 1.
// k-steps outer: consecutive mma go to different accumulators.
template <int KS, int NP, int ROW = BF_ROW>
__device__ __forceinline__ void frags_by_tile_t(float (*acc)[4], const u32 (*a)[4], u32 tile, int chunk0) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
    const u32 lane_row = tile + (8 * (mi & 1) + r) * ROW;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int np = 0; np < NP; ++np) {
            u32 b[4];
            ldmatrix_x4_trans(b, lane_row + ks * 16 * ROW + (((chunk0 + 2 * np + (mi >> 1)) ^ r) << 4));
            mma_bf16(acc[2 * np], a[ks], b);
            mma_bf16(acc[2 * np + 1], a[ks], b + 2);
        }
}

// On sm_90a (BWD_WGMMA) the fpa path runs Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += bf16(P)ᵀ dO and dK += bf16(dS)ᵀ Q
// on wgmma: K, V, Q, dO are staged once in the WgKmajor layout (natural row order); Sᵀ and dPᵀ read
// them K-major, dV and dK read the same Q / dO tiles MN-major (the 16-bit transpose flag), with
// bf16(P)ᵀ / bf16(dS)ᵀ as register A operands. Every warpgroup reads each operand tile once per
// product, where mma.sync made each of the 8 warps read Q, dO (and K for dQ) by ldmatrix.
// dQ = bf16(dS) K runs on wgmma too (A = bf16(dS)ᵀ, B = K, both MN-major), issued at the start of the next
// tile before Sᵀ, so its reductions run while Sᵀ and dPᵀ are on the tensor cores (the mma.sync dQ after the tile
// is in the history before session 21).
// FPA_STAGES_NEXT: block qb + 1 is staged inside tile qb, after block qb − 1's dV, dK have landed, so those
// products run across the end of the iteration and the barrier; 0 drains them before the barrier.
// d = 64 only: at d = 128 the 128 dV/dK registers in flight with Sᵀ, dPᵀ, dQ make ptxas serialize
// the wgmma pipeline (C7512, insufficient registers).
#ifndef FPA_STAGES_NEXT
#define FPA_STAGES_NEXT (HEAD_DIM == 64)
#endif
// fpabwd10 (sm_90a tile only): a diagonal tile masked by two compares per entry against per-key row limits
// (ds_masked), the tile's wgmma descriptors built once per operand tile and advanced per k-step by one add
// (DescWords); at d = 64 also FPA_STSM_DS (bf16(dS)ᵀ stored by stmatrix: 4 instructions per thread instead of 16)
// and FPA_PRED_RED (the dQ reductions predicated instead of branched around, add_dq_pred). All four at d = 64:
// −3 to −5 % backward time at every d = 64 shape (fpabwd10). d = 128 (255 registers, 0 spill with any subset):
// the mask and the descriptors measured −1.9 to −2.6 % at every row of the fpa sweep; adding stmatrix and the
// predicated reductions (which ptxas still branches around at d = 128) lost most of that (0.0 to −1.8 %) in the
// same call, so those two are d = 64 only (RESULTS-gpu.md, fpa11).
#define FPA_FEWER_INSTR_DEFAULT (HEAD_DIM == 64)
#ifndef FPA_STSM_DS
#define FPA_STSM_DS FPA_FEWER_INSTR_DEFAULT
#endif
#ifndef FPA_PRED_RED
#define FPA_PRED_RED FPA_FEWER_INSTR_DEFAULT
#endif
#if BWD_WGMMA
__device__ __forceinline__ void wgmma_bf16_ss_tt(float (&d)[8][4], u64 a_desc, u64 b_desc, int acc) {
    wgmma_bf16_ss_tt_n64(d, a_desc, b_desc, acc);
}
__device__ __forceinline__ void wgmma_bf16_ss_tt(float (&d)[4][4], u64 a_desc, u64 b_desc, int acc) {
    wgmma_bf16_ss_tt_n32(d, a_desc, b_desc, acc);
}
__device__ __forceinline__ void wgmma_bf16_rs_tb(float (*d)[4], const u32 (&a)[4], u64 b_desc) {
#if HEAD_DIM == 128
    wgmma_bf16_rs_n128_tb(d, a, b_desc, 1);
#else
    wgmma_bf16_rs_n64_tb(d, a, b_desc, 1);
#endif
}
#endif

struct StagedBf16 {
    // Key block: K, V (2·BF_KT bytes each); stage: Q, dO (2·BF_QT each); bf16(dS)ᵀ [128][64].
    typedef StagedLayout<4 * BF_KT, 4 * BF_QT, 2 * BLOCK_Q * BLOCK_KV> Layout;
    static constexpr bool WGMMA = BWD_WGMMA;
    // tile() stages block qb + 1 once block qb − 1's dV, dK (which read that stage) have landed, so
    // those products overlap the end of the iteration and the barrier instead of being waited for there.
    static constexpr bool STAGES_NEXT = BWD_WGMMA && FPA_STAGES_NEXT;
    static constexpr bool BULK_DQ = false;  // StagedBf16Bulk: dQ by tensor reduces (fpab15)
    static constexpr int v = 2 * BF_KT;   // offset in the key block
    static constexpr int d_o = 2 * BF_QT; // offset in a stage
    static constexpr int DST_ROW = 2 * BLOCK_Q;  // bytes of one bf16(dS)ᵀ row (a key's 64 rows)
#if BWD_WGMMA
    typedef WgKmajor<BLOCK_KV, BF_ROW, false> KeyOff;
    typedef WgKmajor<BLOCK_Q, BF_ROW, false> QueryOff;
#else
    typedef SwizzledRows<HEAD_DIM / 8, SwzKeyBf16> KeyOff;
    typedef SwizzledRows<HEAD_DIM / 8, SwzKeyBf16> QueryOff;
#endif

    // The original inputs: BF16 products never see the smoothed K (§1).
    static __device__ __forceinline__ void stage_key_block(const BackwardParams& p, u32 smem, int bh_kv, int kb) {
        const int key0 = kb * BLOCK_KV;
        const long off = ((long)bh_kv * p.dims.n_k + key0) * HEAD_DIM;
        stage_rows_at<BLOCK_KV, HEAD_DIM / 8>(smem, p.op.k + off, BF_ROW, p.dims.n_k - key0, KeyOff());
        stage_rows_at<BLOCK_KV, HEAD_DIM / 8>(smem + v, p.v + off, BF_ROW, p.dims.n_k - key0, KeyOff());
    }
    static __device__ __forceinline__ void stage_query_block(const BackwardParams& p, u32 st, int bh, int qb) {
        const int row0 = qb * BLOCK_Q;
        const long off = ((long)bh * p.dims.n_q + row0) * HEAD_DIM;
        stage_rows_at<BLOCK_Q, HEAD_DIM / 8>(st, p.op.q + off, BF_ROW, p.dims.n_q - row0, QueryOff());
        stage_rows_at<BLOCK_Q, HEAD_DIM / 8>(st + d_o, p.d_o + off, BF_ROW, p.dims.n_q - row0, QueryOff());
    }

#if BWD_WGMMA
    // Issues acc = the dQ tile (the 64 rows × warpgroup wg's d/2 columns) = bf16(dS) K over the 128 keys:
    // A = bf16(dS)ᵀ at dst_tile (one 128-byte row of 64 query rows per key), B = K columns wg·d/2..
    // (at d = 64 half of a 64-column atom: from byte 64 of its rows for wg = 1); k-step = 16 keys.
    static __device__ __forceinline__ void issue_dq(float (&acc)[HEAD_DIM / 16][4], u32 smem, u32 dst_tile) {
        const int col0 = (threadIdx.x >> 7) * (HEAD_DIM / 2);
        const u32 b0 = smem + (col0 / 64) * (BLOCK_KV * 128) + (col0 % 64) * 2;
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 16; ++ks)
            wgmma_bf16_ss_tt(acc, mnmajor_desc(dst_tile + ks * 16 * DST_ROW, BLOCK_KV * DST_ROW),
                             mnmajor_desc(b0 + ks * 16 * 128, BLOCK_KV * 128), ks);
    }
    // Adds a landed dQ tile of block qb to the FP32 accumulator (warp: rows 16(w mod 4)..).
    static __device__ __forceinline__ void add_dq(const BackwardParams& p, const float (*acc)[4], int bh, int qb) {
        int r_lo;
        float* dq_lo = dq_lane_ptr(p, bh, qb, r_lo);
#pragma unroll
        for (int np = 0; np < HEAD_DIM / 32; ++np) red_add_dq16(p.dims, dq_lo + 16 * np, r_lo, acc + 2 * np);
    }
    // add_dq (the same reductions) with each one guarded by its row's predicate (r < n_q) instead of
    // a branch around it. The staged tile's; the ws kernel keeps add_dq.
    static __device__ __forceinline__ void add_dq_pred(const BackwardParams& p, const float (*acc)[4], int bh, int qb) {
#if FPA_PRED_RED
        int r_lo;
        float* dq_lo = dq_lane_ptr(p, bh, qb, r_lo);
        const bool lo = r_lo < p.dims.n_q, hi = r_lo + 8 < p.dims.n_q;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 16; ++n) {  // columns 8n.. of the warp's half
            red_add_f32x2_if(lo, dq_lo + 8 * n, acc[n][0], acc[n][1]);
            red_add_f32x2_if(hi, dq_lo + 8 * HEAD_DIM + 8 * n, acc[n][2], acc[n][3]);
        }
#else
        add_dq(p, acc, bh, qb);
#endif
    }
#endif

#if BWD_WGMMA
    // issue_dq with the descriptors advanced by DescWords (the same products).
    static __device__ __forceinline__ void issue_dq_words(float (&acc)[HEAD_DIM / 16][4], u32 smem, u32 dst_tile) {
        const int col0 = (threadIdx.x >> 7) * (HEAD_DIM / 2);
        const u32 b0 = smem + (col0 / 64) * (BLOCK_KV * 128) + (col0 % 64) * 2;
        const DescWords a = desc_words(mnmajor_desc(dst_tile, BLOCK_KV * DST_ROW));
        const DescWords b = desc_words(mnmajor_desc(b0, BLOCK_KV * 128));
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 16; ++ks) wgmma_bf16_ss_tt(acc, a.at(ks * 16 * DST_ROW), b.at(ks * 16 * 128), ks);
    }
#endif
#if BWD_WGMMA
    // wg_issue_bf16_keys_by_rows (A = key rows 64wg.. of a [128][d] tile, B = a [64][d] tile, both
    // WgKmajor: k-step ks at atom column ks / 4, byte 32·(ks mod 4)) with DescWords.
    static __device__ __forceinline__ void issue_keys_by_rows(float (&acc)[8][4], u32 a_tile, u32 b_tile, int wg) {
        const DescWords a = desc_words(kmajor_desc(a_tile + 64 * wg * 128, 128));
        const DescWords b = desc_words(kmajor_desc(b_tile, 128));
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
            wgmma_bf16_ss_n64(acc, a.at((ks / 4) * (BLOCK_KV * 128) + 32 * (ks % 4)), b.at((ks / 4) * (BLOCK_Q * 128) + 32 * (ks % 4)), ks);
    }
#endif

#if BWD_WGMMA
    // dS = fl(P·fl(dP − D)) (ds: dPᵀ in, dS out) as tile_ds_regs<false>, then P and dS of hidden entries
    // → 0 by the prefix form of visible(): entry (nt, e) is row row0 + o (row0 = 64qb + 2t; o = 8nt +
    // e mod 2, a compile-time offset) of key j_h = wkey0 + g + 8h (h = e div 2), and visible ⇔ first_h ≤
    // o < rows_left, with rows_left = n_q − row0 and first_h = j_h − (n_k − n_q) − row0 (causal), 0 (not),
    // BLOCK_Q (j_h ≥ n_k: above every o). Two compares with an immediate and two selects per entry,
    // where visible()'s per-entry row and key arithmetic became predicate bitmasks (as in fwd9's forward).
    static __device__ __forceinline__ void ds_masked(const Dims& d, const float* rows, int qb, int kb,
                                                     float (&prob)[8][4], float (&ds)[8][4]) {
        const int t = threadIdx.x & 3;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const float2 D = *(const float2*)(rows + BLOCK_Q + 8 * nt + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D.y : D.x));
        }
        hide_masked(d, qb, kb, prob, ds);
    }

    // The mask of ds_masked on any set of this thread's [8][4] entry arrays: hidden entries → 0.
    template <class... Tiles>
    static __device__ __forceinline__ void hide_masked(const Dims& d, int qb, int kb, Tiles&... v) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int wkey0 = kb * BLOCK_KV + (threadIdx.x >> 5) * 16;
        const int last_key = wkey0 + 15;
        const bool need_mask = last_key >= d.n_k || (d.causal && last_key > qb * BLOCK_Q + (d.n_k - d.n_q));
        if (need_mask) {  // warp-uniform: only tiles on the diagonal or past n_k
            const int row0 = qb * BLOCK_Q + 2 * t, rows_left = d.n_q - row0;
            int first[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = wkey0 + g + 8 * h;
                first[h] = j >= d.n_k ? BLOCK_Q : (d.causal ? j - (d.n_k - d.n_q) - row0 : 0);
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int o = 8 * nt + (e & 1);
                    const bool hidden = o < first[e >> 1] || o >= rows_left;
                    ((v[nt][e] = hidden ? 0.0f : v[nt][e]), ...);
                }
        }
    }
#endif

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ of the warp's 16 keys × the 64 rows → P (t = fl(cλ·S), §4) and dS
    // (ds: dPᵀ in, dS out), masked.
    static __device__ __forceinline__ void scores_p_ds(const BackwardParams& p, const StagedTile& x, float (&prob)[8][4],
                                                       float (&ds)[8][4]) {
        float s[8][4];
#if BWD_WGMMA
        const int wg = threadIdx.x >> 7;
        wgmma_fence();  // the accumulators were last written by the previous tile's code
        // Issued on every tile so that the commit groups are the same each time (ptxas serializes
        // the pipeline otherwise); the first tile's result (of a stale buffer) is not added.
        float dq_acc[HEAD_DIM / 16][4];
        issue_dq_words(dq_acc, x.smem, x.prev_ds);
        wgmma_commit();
        issue_keys_by_rows(s, x.smem, x.st, wg);
        wgmma_commit();
        issue_keys_by_rows(ds, x.smem + v, x.st + d_o, wg);
        wgmma_commit();
        wgmma_wait<2>();  // dV, dK and dQ of block qb − 1 landed; Sᵀ, dPᵀ run on
        wgmma_fence_regs(dq_acc);
        if (STAGES_NEXT) {
            if (x.has_next) stage_query_block(p, x.next_st, x.bh, x.qb + 1);  // the stage block qb − 1 used
            cp_async_commit();
        }
        if (x.has_prev) add_dq_pred(p, dq_acc, x.bh, x.qb - 1);  // block-uniform
        wgmma_wait<1>();  // Sᵀ done (and the previous tile's dV, dK); dPᵀ may still run
        wgmma_fence_regs(s);
        tile_p_regs<false>(x.rows, s, p.c_lambda, prob);
        wgmma_wait<0>();
        wgmma_fence_regs(ds);
        ds_masked(p.dims, x.rows, x.qb, x.kb, prob, ds);
#else
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
        const int key_row = warp * 16 + (mi & 1) * 8 + r;
        keys_by_rows<HEAD_DIM / 8, BF_ROW, false>(s, x.smem + key_row * BF_ROW, r, x.st + r * BF_ROW, r);
        keys_by_rows<HEAD_DIM / 8, BF_ROW, false>(ds, x.smem + v + key_row * BF_ROW, r, x.st + d_o + r * BF_ROW, r);
        tile_p_ds_regs<false>(p.dims, x.rows, x.qb, x.kb, s, p.c_lambda, prob, ds);
#endif
    }

    // dV += bf16(P)ᵀ dO (#4), dK += bf16(dS)ᵀ Q (#7), summed straight into the accumulators (FP32
    // sums in any order, §1). wgmma: issued as one commit group that drain() waits for, so the
    // dS stores and the previous block's dQ run while the tensor cores work; B = the dO / Q tile
    // MN-major, k-step ks = rows 16ks.. (16 rows of 128 bytes in each 64-column atom column).
    static __device__ __forceinline__ void key_products(u32 st, const u32 (*pa)[4], const u32 (*da)[4], float (*dv)[4],
                                                        float (*dk)[4]) {
#if BWD_WGMMA
        wgmma_fence();  // pa, da just written
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks) wgmma_bf16_rs_tb(dv, pa[ks], mnmajor_desc(st + d_o + ks * 16 * 128, BLOCK_Q * 128));
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks) wgmma_bf16_rs_tb(dk, da[ks], mnmajor_desc(st + ks * 16 * 128, BLOCK_Q * 128));
        wgmma_commit();
#else
        frags_by_tile_t<BLOCK_Q / 16, HEAD_DIM / 16>(dv, pa, st + d_o, 0);
        frags_by_tile_t<BLOCK_Q / 16, HEAD_DIM / 16>(dk, da, st, 0);
#endif
    }

#if BWD_WGMMA
    // key_products with DescWords (the same products).
    static __device__ __forceinline__ void key_products_words(u32 st, const u32 (*pa)[4], const u32 (*da)[4],
                                                              float (*dv)[4], float (*dk)[4]) {
        const DescWords o = desc_words(mnmajor_desc(st + d_o, BLOCK_Q * 128));
        const DescWords q = desc_words(mnmajor_desc(st, BLOCK_Q * 128));
        wgmma_fence();  // pa, da just written
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks) wgmma_bf16_rs_tb(dv, pa[ks], o.at(ks * 16 * 128));
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks) wgmma_bf16_rs_tb(dk, da[ks], q.at(ks * 16 * 128));
        wgmma_commit();
    }
#endif

    // bf16(dS)ᵀ (the dK A fragments) to shared memory for dQ, one 32-bit word per store: word (key g + 8h,
    // rows 16ks + 8c + 2t, +1) at row 16w + g + 8h, chunk 2ks + c (swizzled by the key's low bits, g: the
    // 128-byte swizzle).
    static __device__ __forceinline__ void store_ds_words(unsigned char* ds, const u32 (&da)[BLOCK_Q / 16][4]) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int g = lane >> 2, t = lane & 3;
        unsigned char* ds_lane = ds + (warp * 16 + g) * DST_ROW + 4 * t;
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = i >> 1, h = i & 1;
                *(u32*)(ds_lane + 8 * h * DST_ROW + (((2 * ks + c) ^ g) << 4)) = da[ks][i];
            }
    }
    // P (or dS), this thread's [8][4] accumulator entries, → the bf16 A fragments of dV (dK): entry i of
    // k-step ks packs n-tile 2ks + i/2, columns 2(i mod 2), + 1. The two-array form packs P and dS in one pass.
    static __device__ __forceinline__ u32 a_frag_word(const float (&v)[8][4], int ks, int i) {
        const int nt = 2 * ks + (i >> 1), h = i & 1;
        return pack_bf16x2(v[nt][2 * h], v[nt][2 * h + 1]);
    }
    static __device__ __forceinline__ void pack_a_frags(u32 (&a)[BLOCK_Q / 16][4], const float (&v)[8][4]) {
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks)
#pragma unroll
            for (int i = 0; i < 4; ++i) a[ks][i] = a_frag_word(v, ks, i);
    }
    static __device__ __forceinline__ void pack_a_frags(u32 (&a)[BLOCK_Q / 16][4], const float (&v)[8][4],
                                                        u32 (&b)[BLOCK_Q / 16][4], const float (&w)[8][4]) {
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[ks][i] = a_frag_word(v, ks, i);
                b[ks][i] = a_frag_word(w, ks, i);
            }
    }

    // The dV, dK products of the last tile() are complete and their accumulators readable (before
    // the next barrier (a), after which the stage they read is restaged).
    static __device__ __forceinline__ void drain(float (*dv)[4], float (*dk)[4]) {
#if BWD_WGMMA
        wgmma_wait<0>();
        wgmma_fence_rows<HEAD_DIM / 8>(dv);
        wgmma_fence_rows<HEAD_DIM / 8>(dk);
#endif
    }

    // P, dS → bf16(P)ᵀ, bf16(dS)ᵀ as the A fragments of k-step ks (n-tiles 2ks, 2ks + 1) of dV and dK;
    // bf16(dS)ᵀ to shared memory for dQ. Returns no scale (BF16 products have none).
    static __device__ __forceinline__ float tile(const BackwardParams& p, const StagedTile& x, float (*dv)[4],
                                                 float (*dk)[4]) {
        float prob[8][4], ds[8][4];
        scores_p_ds(p, x, prob, ds);

        u32 pa[BLOCK_Q / 16][4], da[BLOCK_Q / 16][4];
        pack_a_frags(pa, prob, da, ds);
#if BWD_WGMMA
        key_products_words(x.st, pa, da, dv, dk);
#else
        key_products(x.st, pa, da, dv, dk);
#endif

#if BWD_WGMMA && FPA_STSM_DS
        // By stmatrix: da[ks][i] is the 8 × 8 matrix (keys 16w + 8h.., rows 16ks + 8c..), c = i div 2,
        // h = i mod 2, in the fragment layout stmatrix takes; lane l addresses its row l mod 8 (key
        // 16w + 8h + l mod 8, same swizzle) of matrix i = l div 8.
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int m = lane >> 3, r = lane & 7;
        const u32 ds_row = smem_addr(x.ds) + (warp * 16 + 8 * (m & 1) + r) * DST_ROW;
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 16; ++ks)
            stmatrix_x4(ds_row + (((2 * ks + (m >> 1)) ^ r) << 4), da[ks][0], da[ks][1], da[ks][2], da[ks][3]);
#else
        store_ds_words(x.ds, da);
#endif
        return 0.0f;
    }

    // dQ += bf16(dS) K (#6) for the warp's rows and half of d: A from bf16(dS)ᵀ (at shared address
    // dst_tile) read transposed (lane (mi, r): key 16ks + 8·(mi div 2) + r, row chunk 2(w mod 4) +
    // mi mod 2), B from the K tile read transposed (WgKmajor: 64-column atom columns of 128-byte rows).
    static __device__ __forceinline__ void dq(const BackwardParams& p, u32 smem, u32 dst_tile, float, int bh, int qb) {
#if BWD_WGMMA
        float acc[HEAD_DIM / 16][4];
        wgmma_fence();
        issue_dq_words(acc, smem, dst_tile);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(acc);
        add_dq_pred(p, acc, bh, qb);
#else
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
        u32 da[BLOCK_KV / 16][4];
        const u32 a_lane = dst_tile + (8 * (mi >> 1) + r) * DST_ROW + (((2 * (warp & 3) + (mi & 1)) ^ r) << 4);
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 16; ++ks) ldmatrix_x4_trans(da[ks], a_lane + ks * 16 * DST_ROW);
        int r_lo;
        float* dq_lo = dq_lane_ptr(p, bh, qb, r_lo);
        float acc[HEAD_DIM / 16][4];
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 16; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
        const int c0 = (warp >> 2) * (HEAD_DIM / 16);  // first 16-byte chunk of the warp's columns
        frags_by_tile_t<BLOCK_KV / 16, HEAD_DIM / 32>(acc, da, smem, c0);
#pragma unroll
        for (int np = 0; np < HEAD_DIM / 32; ++np) red_add_dq16(p.dims, dq_lo + 16 * np, r_lo, acc + 2 * np);
#endif
    }
};

// ---- fpab14: the fpa tile at d = 128 with dV issued early (sage_bwd_main_persist_bf16 only) ---------
// StagedBf16 with another tile(): dV += bf16(P)ᵀ dO is issued as soon as P is computed and masked (its
// own commit group), so it runs on the tensor cores while dS = fl(P·fl(dP − D)) is computed; dK after.
// Before, both were issued after dS, and the tensor cores idled from dPᵀ's end to dV's start. Same
// products, same FP32 operations: the same bits. Measured (RESULTS-gpu.md, fpab14; variant E there):
// −1.9 % at fpa d128 N1k full, −0.8 to −1.8 % (mean of two runs) at the other N ≤ 4k rows; the ncu
// barrier and drain stalls at the tile's end fell from 12.7 % / 7.1 % to 3.3 % / 2.0 % of the samples.
// Only the persistent kernel runs it (sage_bwd_main_mma, which holds the sage instance too, keeps its
// SASS); FPA_EARLY_DV=0 gives that kernel StagedBf16 again.
// Staging block qb + 1 inside this tile and loading the next row constants late measured slower
// (+1.7 to +9 %; RESULTS-gpu.md, fpab14) and were removed.
// fpab15 variant U (the default since session 14's final call) gives
// sage_bwd_main_persist_bf16q's tile the warpgroup index as sbwd13_wg() (warp-uniform to ptxas), for its Sᵀ, dPᵀ
// A descriptors and its dQ B descriptor. With threadIdx.x >> 7 (as fpab15 measured) ptxas
// builds those descriptors in vector registers, hoists six of them out of the query loop and, at 255 registers,
// spills them (40 B of stack): each tile reloads them right before the Sᵀ / dPᵀ issue, 11.6 % of the ncu stall
// samples (fpab15's profile). With U: 250 registers, no stack, query loop 905 → 872 static instructions (no
// LDL/STL, R2UR 51 → 4, one SHFL per tile). Measured (same binary, cubin-swapped, H200): fpa d 128 backward
// −6.1 / −8.7 % at N 1k full / causal, −6.3 / −4.9 % at N 4k (RESULTS-gpu.md, lead session 14).
#ifndef FPA_EARLY_DV
#define FPA_EARLY_DV (HEAD_DIM == 128)
#endif
// The kernels that add dQ by TMA tensor reduces (fpab15's d = 128 fpa kernel, bwd18's d = 64 sage kernel) take the
// dQ accumulator's tensor map in front of BackwardParams in their one __grid_constant__ parameter: the map is at
// &p − 128 (p sits right after the 128-byte map; BackwardParams is 8-byte aligned).
struct __align__(64) DqMapParam {
    unsigned long long w[16];
};
struct BwdParamsDqMap {
    DqMapParam map;
    BackwardParams p;
};
static_assert(sizeof(DqMapParam) == 128 && alignof(BackwardParams) <= 128 && sizeof(BwdParamsDqMap) == 448,
              "BwdParamsDqMap layout: src/backward.rs");
__device__ __forceinline__ const void* dq_map_of(const BackwardParams& p) {
    return (const void*)((const char*)&p - sizeof(DqMapParam));
}
#if BWD_WGMMA && FPA_EARLY_DV && !FPA_STAGES_NEXT && !FPA_STSM_DS
#define FPA_EARLY_PATH 1
// ---- fpab15: dQ of the d = 128 fpa tile by TMA reduce-adds (sage_bwd_main_persist_bf16q) ------------
// The landed dQ tile (warp w: rows 16(w mod 4).., columns (w div 4)·64.., 16 × 64 FP32) goes to the
// warp's own 4 KB of a staging area instead of 16 red.global.add.v2.f32 per thread; the four boxes of a
// warpgroup (one column half, rows 0..63 in order) are one 16 KB box of the accumulator's 4-D tensor map
// (32 columns, d/32 column boxes, n_q rows, B·H_q; box 32 × 2 × 64 × 1, 128-byte swizzle; rows past n_q
// are clipped by the map), added by one cp.reduce.async.bulk.tensor from one lane of the warpgroup's first
// warp once its four warps have staged (a named barrier per warpgroup) (fpab22: two reduces of 16 KB per
// tile instead of fpab15's eight of 4 KB, one per warp; sb21's lesson). The issuing lane waits until its
// reduce has read the area before the next tile's barrier (a) (staged_query_loop), after which any warp may
// stage again. Swizzled staging: the 32-byte group of n-tile j in row g is (j mod 4) ^ (g mod 4), so each
// STS.64 takes 2 shared wavefronts (8 unswizzled: rows of 256 bytes).
// The same FP32 values are added (the accumulator's additions were unordered atomics before too);
// the TMA add is .rn with subnormals flushed, as REDG.E.ADD.F32x2.FTZ.RN.
// The tensor map travels in front of BackwardParams in the kernel's one __grid_constant__ parameter
// (BwdParamsDqMap, dq_map_of).
#define FPAB15_WARP_STAGE 4096  // bytes of one warp's staging box (16 rows × 64 FP32)
#define FPAB22_BAR0 1           // named barriers 1 (warpgroup 0) and 2 (warpgroup 1): the half staged
// acc[0..1] at shared a = base ^ X (row g), acc[2..3] at a + 2048 (row g + 8).
template <int X>
__device__ __forceinline__ void fpab15_sts_pair(u32 base, const float (&acc)[4]) {
    asm volatile("{\n.reg .b32 a;\nxor.b32 a, %0, %1;\nst.shared.v2.f32 [a], {%2, %3};\nst.shared.v2.f32 [a+2048], {%4, %5};\n}\n"
                 ::"r"(base), "n"(X), "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3]));
}
// A landed dQ tile (acc[n]: columns 8n.. of the warp's half, rows g, g + 8) into the warp's staging box
// at `area` (1024-aligned) in the 128-byte swizzle the map's box has: logical byte L = 256·row +
// 128·(n div 4) + 32·(n mod 4) + 8t, physical L ^ (((L >> 7) mod 8) << 4).
__device__ __forceinline__ void fpab15_stage_dq(u32 area, const float (*acc)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 box = area + (threadIdx.x >> 5) * FPAB15_WARP_STAGE;
    const u32 l0 = g * 256 + 8 * t, l1 = l0 + 128;
    const u32 b0 = box + (l0 ^ (((l0 >> 7) & 7) << 4)), b1 = box + (l1 ^ (((l1 >> 7) & 7) << 4));
    // The XOR inside the asm: ptxas would otherwise hoist the 8 per-lane addresses out of the query
    // loop (8 registers held across the tile, spilled at 255).
    static_assert(HEAD_DIM == 128, "fpab15 staging: 8 n-tiles per warp");
    fpab15_sts_pair<0>(b0, acc[0]);
    fpab15_sts_pair<32>(b0, acc[1]);
    fpab15_sts_pair<64>(b0, acc[2]);
    fpab15_sts_pair<96>(b0, acc[3]);
    fpab15_sts_pair<0>(b1, acc[4]);
    fpab15_sts_pair<32>(b1, acc[5]);
    fpab15_sts_pair<64>(b1, acc[6]);
    fpab15_sts_pair<96>(b1, acc[7]);
}
// Warpgroup wg's staged column half of dQ block qb added to the accumulator by one lane of its first warp
// (elect.sync; the warp is converged), as one commit group, once the warpgroup's four warps have fenced
// their stores to the async proxy and met at the half's named barrier. wg: warp-uniform (sbwd13_wg).
__device__ __forceinline__ void fpab15_reduce_dq(const BackwardParams& p, u32 area, int bh, int qb, int wg) {
    fence_proxy_async();
    named_sync(FPAB22_BAR0 + wg, 128);  // the warpgroup's 128 threads
    if (((threadIdx.x >> 5) & 3) == 0) {
        tma_reduce_add_4d_elect(dq_map_of(p), 0, 2 * wg, qb * BLOCK_Q, bh, area + 4 * wg * FPAB15_WARP_STAGE);
        bulk_commit();
    }
}
// The staging area is free here: the lane that issued the previous reduce waited for its read before (a).
__device__ __forceinline__ void fpab15_bulk_dq(const BackwardParams& p, u32 area, const float (*acc)[4], int bh, int qb, int wg) {
    fpab15_stage_dq(area, acc);
    fpab15_reduce_dq(p, area, bh, qb, wg);
}
// StagedBf16's layout plus the staging area (8 warps × 4 KB), 1024-aligned for the swizzle.
struct Bf16BulkLayout : StagedBf16::Layout {
    static constexpr int dqst0 = (red + red_bytes + 1023) & ~1023;
    static constexpr int dqst_bytes = (THREADS / 32) * FPAB15_WARP_STAGE;
    static constexpr int bytes = dqst0 + dqst_bytes + ALIGN_SLACK;
};
template <bool BULK>
struct Bf16EarlyLayout {
    typedef StagedBf16::Layout type;
};
template <>
struct Bf16EarlyLayout<true> {
    typedef Bf16BulkLayout type;
};

// StagedBf16EarlyT<false> = StagedBf16Early (fpab14; sage_bwd_main_persist_bf16), <true> = StagedBf16Bulk
// (fpab15: dQ by TMA reduce-adds; sage_bwd_main_persist_bf16q). The same tile otherwise.
template <bool BULK>
struct StagedBf16EarlyT : StagedBf16 {
    typedef typename Bf16EarlyLayout<BULK>::type Layout;
    static constexpr bool BULK_DQ = BULK;
    // issue_dq_words with the warpgroup given (warp-uniform to ptxas, as sbwd13_wg()).
    static __device__ __forceinline__ void issue_dq_wg(float (&acc)[HEAD_DIM / 16][4], u32 smem, u32 dst_tile, int wg) {
        const int col0 = wg * (HEAD_DIM / 2);
        const u32 b0 = smem + (col0 / 64) * (BLOCK_KV * 128) + (col0 % 64) * 2;
        const DescWords a = desc_words(mnmajor_desc(dst_tile, BLOCK_KV * DST_ROW));
        const DescWords b = desc_words(mnmajor_desc(b0, BLOCK_KV * 128));
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 16; ++ks) wgmma_bf16_ss_tt(acc, a.at(ks * 16 * DST_ROW), b.at(ks * 16 * 128), ks);
    }
    // A landed dQ tile of block qb into the accumulator.
    static __device__ __forceinline__ void add_tile_dq(const BackwardParams& p, u32 smem, const float (*acc)[4], int bh, int qb,
                                                       int wg) {
        if (BULK) {
            fpab15_bulk_dq(p, smem + Bf16BulkLayout::dqst0, acc, bh, qb, wg);
        } else {
            add_dq_pred(p, acc, bh, qb);
        }
    }
    // The item's last dQ (StagedBf16::dq with add_tile_dq).
    static __device__ __forceinline__ void dq(const BackwardParams& p, u32 smem, u32 dst_tile, float s, int bh, int qb) {
        if (BULK) {
            float acc[HEAD_DIM / 16][4];
            wgmma_fence();
            issue_dq_words(acc, smem, dst_tile);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_regs(acc);
            add_tile_dq(p, smem, acc, bh, qb, sbwd13_wg());
        } else {
            StagedBf16::dq(p, smem, dst_tile, s, bh, qb);
        }
    }
    // tile() with dV issued as soon as P is ready. Groups: dQ(qb − 1), Sᵀ, dPᵀ, then dV, then
    // dK. P is masked before it is packed for dV (as ds_masked masks it before the packing); dS =
    // fl(P·fl(dP − D)) with the masked P, then dS masked: visible entries see the unmasked P they saw
    // before, hidden ones are 0 as before: the same bits for every operand of every product.
    static __device__ __forceinline__ float tile(const BackwardParams& p, const StagedTile& x, float (*dv)[4],
                                                 float (*dk)[4]) {
        const int lane = threadIdx.x & 31;
        const int wg = BULK ? sbwd13_wg() : (int)(threadIdx.x >> 7);
        float s[8][4], ds[8][4], prob[8][4];
        wgmma_fence();  // the accumulators were last written by the previous tile's code
        float dq_acc[HEAD_DIM / 16][4];
        if (BULK) issue_dq_wg(dq_acc, x.smem, x.prev_ds, wg); else issue_dq_words(dq_acc, x.smem, x.prev_ds);
        wgmma_commit();
        issue_keys_by_rows(s, x.smem, x.st, wg);
        wgmma_commit();
        issue_keys_by_rows(ds, x.smem + v, x.st + d_o, wg);
        wgmma_commit();
        wgmma_wait<2>();  // dQ of block qb − 1 landed; Sᵀ, dPᵀ run on
        wgmma_fence_regs(dq_acc);
        if (x.has_prev) add_tile_dq(p, x.smem, dq_acc, x.bh, x.qb - 1, wg);  // block-uniform
        wgmma_wait<1>();  // Sᵀ done; dPᵀ may still run
        wgmma_fence_regs(s);
        tile_p_regs<false>(x.rows, s, p.c_lambda, prob);
        hide_masked(p.dims, x.qb, x.kb, prob);
        u32 pa[BLOCK_Q / 16][4], da[BLOCK_Q / 16][4];
        pack_a_frags(pa, prob);
        {
            const DescWords o = desc_words(mnmajor_desc(x.st + d_o, BLOCK_Q * 128));
            wgmma_fence();  // pa just written
#pragma unroll
            for (int ks = 0; ks < BLOCK_Q / 16; ++ks) wgmma_bf16_rs_tb(dv, pa[ks], o.at(ks * 16 * 128));
            wgmma_commit();
        }
        wgmma_wait<1>();  // dPᵀ done; dV runs on
        wgmma_fence_regs(ds);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const float2 D = *(const float2*)(x.rows + BLOCK_Q + 8 * nt + 2 * (lane & 3));
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D.y : D.x));
        }
        hide_masked(p.dims, x.qb, x.kb, ds);
        pack_a_frags(da, ds);
        {
            const DescWords q = desc_words(mnmajor_desc(x.st, BLOCK_Q * 128));
            wgmma_fence();  // da just written
#pragma unroll
            for (int ks = 0; ks < BLOCK_Q / 16; ++ks) wgmma_bf16_rs_tb(dk, da[ks], q.at(ks * 16 * 128));
            wgmma_commit();
        }
        // bf16(dS)ᵀ to shared memory for dQ, as tile() stores it without FPA_STSM_DS.
        store_ds_words(x.ds, da);
        return 0.0f;
    }
};
typedef StagedBf16EarlyT<false> StagedBf16Early;
typedef StagedBf16EarlyT<true> StagedBf16Bulk;
#else
#define FPA_EARLY_PATH 0
#endif

// The staged skeleton (see the top of this section). Two barriers per tile at most: (a) at the top
// (block qb's operands, row constants and the dS of block qb − 1 visible), and the sage tile's amax.
// dS of block qb is complete at (a) of block qb + 1, so dQ of block qb − 1 runs at the end of
// iteration qb (where few registers are live), from the other dS buffer, which the next writes only
// after the next (a). Block qb + 1 is staged after (a), when every warp is done with its buffer
// (read last by qb − 1); its row constants are stored at the end of iteration qb, likewise.
// CTAs per chunk of the causal block order: about two waves of one CTA per SM (132 on the H200).
#ifndef CAUSAL_CHUNK_CTAS
#define CAUSAL_CHUNK_CTAS 256
#endif
struct KeyBlockCoords {
    int kb, bh;
};
// The (key block, (batch, query head)) a staged CTA works on. Not causal: (blockIdx.x, blockIdx.y),
// every block the same work. Causal: key block kb has n_qblk − query_block_begin(kb) tiles, fewer for
// later kb, and CTAs start roughly in linear block order, so the grid (n_kblk, rows) is walked in chunks
// of heads (about CAUSAL_CHUNK_CTAS CTAs) and inside a chunk every head's kb = 0 comes first, then kb = 1…
// Heaviest first: the grid ends on its lightest blocks (a short tail), while a chunk's Q, dO and dQ
// rows stay in L2 for the key blocks of its heads.
// staged_item_coords: the same order for work item `linear` of n_kb × rows (the persistent grid's
// items are these linear indices; staged_block_coords is it at blockIdx.y · gridDim.x + blockIdx.x).
__device__ __forceinline__ KeyBlockCoords staged_item_coords(const Dims& d, int linear, int n_kb, int rows) {
    if (!d.causal) return {linear % n_kb, linear / n_kb};
    const int chunk_heads = max(1, CAUSAL_CHUNK_CTAS / n_kb);
    const int first = linear / (chunk_heads * n_kb) * chunk_heads;  // the chunk's first head
    const int heads = min(chunk_heads, rows - first);
    const int r = linear - first * n_kb;  // within the chunk: heads × n_kb, key block slowest
    return {r / heads, first + r % heads};
}
__device__ __forceinline__ KeyBlockCoords staged_block_coords(const Dims& d) {
    if (!d.causal) return {(int)blockIdx.x, (int)blockIdx.y};
    const int n_kb = gridDim.x, rows = gridDim.y;
    const int chunk_heads = max(1, CAUSAL_CHUNK_CTAS / n_kb);
    const int linear = blockIdx.y * n_kb + blockIdx.x;
    const int first = linear / (chunk_heads * n_kb) * chunk_heads;  // the chunk's first head
    const int heads = min(chunk_heads, rows - first);
    const int r = linear - first * n_kb;  // within the chunk: heads × n_kb, key block slowest
    return {r / heads, first + r % heads};
}

// Writes the block's dK, dV (warp w: keys 16w..16w + 15 of key block kb; rows past n_k skipped):
// BF16 results when the host set dk_out (no GQA), else the FP32 per-query-head partials.
__device__ __forceinline__ void store_dk_dv(const BackwardParams& p, int kb, int bh, const float (*dv)[4],
                                            const float (*dk)[4]) {
    const Dims& d = p.dims;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3, wkey0 = kb * BLOCK_KV + warp * 16;
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = wkey0 + g + 8 * h;
            if (j >= d.n_k) continue;
            const long idx = ((long)bh * d.n_k + j) * HEAD_DIM + nd * 8 + 2 * t;
            if (p.dk_out) {
                // sage_bwd_post_dkdv's arithmetic for a group of one: fl(c·fl(0 + dK)), fl(0 + dV) (the
                // 0 + turns −0 into +0 as the postprocess's sum does), rounded to BF16.
                const float k0 = __fmul_rn(p.c, __fadd_rn(0.0f, dk[nd][2 * h])), k1 = __fmul_rn(p.c, __fadd_rn(0.0f, dk[nd][2 * h + 1]));
                const float v0 = __fadd_rn(0.0f, dv[nd][2 * h]), v1 = __fadd_rn(0.0f, dv[nd][2 * h + 1]);
                *(u32*)(p.dk_out + idx) = (u32)f32_to_bf16(k0) | ((u32)f32_to_bf16(k1) << 16);
                *(u32*)(p.dv_out + idx) = (u32)f32_to_bf16(v0) | ((u32)f32_to_bf16(v1) << 16);
            } else {
                *(float2*)(p.dk_acc + idx) = make_float2(dk[nd][2 * h], dk[nd][2 * h + 1]);
                *(float2*)(p.dv_acc + idx) = make_float2(dv[nd][2 * h], dv[nd][2 * h + 1]);
            }
        }
}

// The StagedTile of query block qb in stage buf (0 or 1) of layout Lay: its operands, row constants and dS
// tile, the other stage's dS tile (block qb − 1's) and stage (block qb + 1's).
template <class Lay>
__device__ __forceinline__ StagedTile staged_tile(u32 smem, unsigned char* smem_ptr, int buf, int bh, int bh_kv, int kb, int qb,
                                                  bool has_prev, float prev_dq_scale, bool has_next) {
    StagedTile x;
    x.smem = smem;
    x.st = smem + Lay::stage0 + buf * Lay::stage_bytes;
    x.rows = (const float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes);
    x.ds = smem_ptr + Lay::ds0 + buf * Lay::ds_bytes;
    x.red = (float*)(smem_ptr + Lay::red);
    x.bh = bh;
    x.bh_kv = bh_kv;
    x.qb = qb;
    x.kb = kb;
    x.prev_ds = smem + Lay::ds0 + (buf ^ 1) * Lay::ds_bytes;
    x.has_prev = has_prev;
    x.prev_dq_scale = prev_dq_scale;
    x.next_st = smem + Lay::stage0 + (buf ^ 1) * Lay::stage_bytes;
    x.has_next = has_next;
    return x;
}

// The query-block loop of one work item (key block kb of head bh, its key block and first query block
// staged, the row constants of qb0 stored): every tile, dQ of all blocks but the last, then the
// barrier after which the last block's dS is complete. Returns the pending dQ tile's scale. Shared by
// the plain grid (staged_backward_main) and the persistent one (staged_backward_persist).
template <class Path>
__device__ __forceinline__ float staged_query_loop(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                   const QueryStager<Path>& stage_next, int kb, int bh, int bh_kv,
                                                   int qb0, float (*dv)[4], float (*dk)[4]) {
    typedef typename Path::Layout Lay;
    const Dims& d = p.dims;
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };
    float dq_scale = 0.0f;  // of the pending dQ tile
    for (int qb = qb0; qb < d.n_qblk; ++qb) {
        const int buf = (qb - qb0) & 1;
        const bool has_next = qb + 1 < d.n_qblk;
        cp_async_wait<0>();  // this thread's copies of block qb are done
#if BWD_WGMMA
        if (Path::WGMMA) fence_proxy_async();  // cp.async writes and dŜ stores → wgmma's (async proxy) reads
        if constexpr (Path::BULK_DQ) bulk_wait_read();  // fpab22: the dQ staging area free after (a)
#endif
        __syncthreads();     // (a)
        if (has_next && !Path::STAGES_NEXT) stage_next(p, stage(buf ^ 1), bh, qb + 1);
        cp_async_commit();
        RowConsts next_rc = {pos_inf(), 0.0f};
        if (has_next && threadIdx.x < BLOCK_Q) next_rc = load_row_consts(p, bh, qb + 1, threadIdx.x);

        StagedTile x = staged_tile<Lay>(smem, smem_ptr, buf, bh, bh_kv, kb, qb, qb > qb0, dq_scale, has_next);
        const float tile_dq_scale = Path::tile(p, x, dv, dk);
        if (has_next && threadIdx.x < BLOCK_Q) store_row_consts(rows_of(buf ^ 1), next_rc);
        // With the wgmma dQ (sm_90a) tile() issues block qb − 1's dQ itself, before Sᵀ, and adds it while Sᵀ, dPᵀ run.
        if (qb > qb0 && !BWD_WGMMA) Path::dq(p, smem, x.prev_ds, dq_scale, bh, qb - 1);
        if (!Path::STAGES_NEXT) Path::drain(dv, dk);  // before the next (a): block qb + 2 is staged into this block's stage
        dq_scale = tile_dq_scale;
    }
    cp_async_wait<0>();
#if BWD_WGMMA
    fence_proxy_async();  // the dS stores → dQ's wgmma reads
    if constexpr (Path::BULK_DQ) bulk_wait_read();  // fpab22: the dQ staging area free for the item's last dQ
#endif
    __syncthreads();  // dS of the last block complete
    return dq_scale;
}

#if PIPE14_LOOP || SB128_LOOP
// pipe14: the sage query loop at d = 64 on sm_90a, software-pipelined across query blocks (see the
// pipe14 note above StagedSage; pipe14b: the loop of StagedSage14T, sage14_query_loop, options there). Same contract as the generic loop: entered with the key block and
// block qb0 staged (one commit group) and qb0's row constants stored; leaves every dQ but the last
// added, the last block's dŜ complete behind a barrier, and no wgmma or copy in flight. Per tile,
// block qb (i = qb − qb0; stage i mod 3; L, D and dŜ buffers i mod 2; amax scratch i mod 2):
//   Sᵀ of qb was issued at the end of tile qb − 1 (before the loop for qb0); wait for it, issue dPᵀ
//   → P while dPᵀ runs; dS; the warps' amax; L, D of qb + 1 stored; this thread's copies of qb + 1
//   complete
//   → (b) the one block barrier of the tile: the tile amax; stage qb + 1, dŜ of qb − 1, L, D of qb + 1
//     visible; every warp past tile qb − 1's products (its stage, i + 2 mod 3, and its amax scratch
//     free) and past its dQ wgmma of qb − 2 (dŜ buffer i mod 2 free)
//   → group scales; dQ of qb − 1 issued (stale and not added on the first tile, as before); qb + 2
//     staged, its L, D loaded; P̂, dŜ quantized, dŜ stored; dV chunks issued; dQ of qb − 1 added;
//     dK chunks issued; Sᵀ of qb + 1 issued (of a stale stage and unused on the last tile: the commit
//     groups are the same on every tile); the dK chunks dequantized while it runs.
// No wgmma is read across the loop's back edge before a wait for all (wgmma_wait<0>): with a
// partial wait there, ptxas serializes every wgmma of the kernel (C7514). Only Sᵀ crosses it.
// Row constants travel as raw loads (lse2, row offset, D) and are subtracted when stored, a tile
// later: the subtraction waited for the global load right after it, in warps 0 and 1 only, and their
// warpgroup's next wgmma waited for them (ncu, base: ~4 % of the samples).
struct Sage14Rows {
    float lse2, off, D;
};
__device__ __forceinline__ Sage14Rows sage14_load_rows(const BackwardParams& p, int bh, int qb, int rl) {
    Sage14Rows r = {pos_inf(), 0.0f, 0.0f};
    const int q = qb * BLOCK_Q + rl;
    if (q < p.dims.n_q) {
        const long row = (long)bh * p.dims.n_q + q;
        r.lse2 = p.lse2[row];
        if (p.flags & F_QK_BWD) r.off = p.op.row_offset[row];
        r.D = p.delta[row];
    }
    return r;
}

// pipe14b (ROWS8): the row constants' thread: lanes 0..7 of each warp, row 8·warp + lane; else threads 0..63.
template <bool ROWS8>
__device__ __forceinline__ bool sage14_row_thread() {
    return ROWS8 ? (threadIdx.x & 31) < 8 : threadIdx.x < BLOCK_Q;
}
template <bool ROWS8>
__device__ __forceinline__ int sage14_row_of_thread() {
    return ROWS8 ? (threadIdx.x >> 5) * 8 + (threadIdx.x & 31) : threadIdx.x;
}
// Row rl's L, D as load_row_consts gives them: fl(lse2 − off) with F_QK_BWD, else lse2 (= fl(lse2 − 0), −0
// and ∞ included).
__device__ __forceinline__ void sage14_store_rows_at(float* rows, const Sage14Rows& r, int rl) {
    rows[rl] = __fsub_rn(r.lse2, r.off);
    rows[BLOCK_Q + rl] = r.D;
}

// pipe14b (BULK): *dst += the `bytes` FP32 bytes at shared src, by one lane of the (converged)
// warp that elect.sync picks, where `pred`. Warp-uniform operands: ptxas issues it once per warp from
// uniform registers (a per-lane address became a loop over the active lanes, ~8 instructions per row).
__device__ __forceinline__ void sage14_bulk_red_add(bool pred, float* dst, u32 src, u32 bytes) {
    asm volatile("{\n.reg .pred e, v;\nsetp.ne.b32 v, %0, 0;\nelect.sync _|e, 0xffffffff;\nand.pred e, e, v;\n"
                 "@e cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%1], [%2], %3;\n}\n"
                 ::"r"((int)pred), "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// The staged dQ tile of block qb added to the accumulator: rows 8w..8w + 7 (those < n_q, 2 KB contiguous)
// by warp w (warp_u = w, warp-uniform to ptxas) in one bulk reduce. One commit group per call per thread.
__device__ __forceinline__ void sage14_bulk_dq(const BackwardParams& p, u32 tile, int bh, int qb, int warp_u) {
    const int q0 = qb * BLOCK_Q + 8 * warp_u;
    float* dst = p.dq_acc + ((long)bh * p.dims.n_q + q0) * HEAD_DIM;
    const u32 src = tile + 8 * warp_u * SAGE14_DQ_ROW;
    const int rows = min(8, p.dims.n_q - q0);  // warp-uniform
    sage14_bulk_red_add(rows > 0, dst, src, (u32)max(rows, 0) * (HEAD_DIM * 4));
    bulk_commit();
}

// sb21 (session 21; sb16's loop, d = 128): the staged dQ tile of block qb added by one bulk reduce of its rows < n_q
// (32 KB at d = 128, contiguous in the staging tile and in the accumulator), issued by warp SB21_BULK_WARP alone instead
// of by every warp for its 8 rows (sage14_bulk_dq, which the d = 64 kernels without TMA reduces keep). One commit group
// per call for that warp's threads; only they wait for its read before the next barrier (b). Measured (call22d, the
// d 128 sweep shapes, three rounds, against sage14_bulk_dq): warp 5 −0.9 to −3.2 % backward at every shape (geometric
// mean −2.1 %), warp 4 (which also issues the stage copies, SB20_TMA_THREAD) −1.5 %; predicted 0 to −0.6 %: the copy
// engine serves the 8 bulks one after another and each warp waited for its own, which cost more than their issue.
#ifndef SB21_BULK_WARP
#define SB21_BULK_WARP 5
#endif
__device__ __forceinline__ void sb21_bulk_dq(const BackwardParams& p, u32 tile, int bh, int qb, int warp_u) {
    if (warp_u == SB21_BULK_WARP) {
        const int q0 = qb * BLOCK_Q, rows = min(BLOCK_Q, p.dims.n_q - q0);  // ≥ 1: qb is a block of the sequence
        sage14_bulk_red_add(true, p.dq_acc + ((long)bh * p.dims.n_q + q0) * HEAD_DIM, tile, (u32)rows * SAGE14_DQ_ROW);
        bulk_commit();
    }
}

// The pipelined loops' (pipe14 at d = 64, sb16 at d = 128) row constants of the thread's 16 rows (raw, from the
// staged row-constant block: L at `rows`, D at rows + BLOCK_Q) and P = exp2(fma(float(S), s, −L)) (bfma24) (tile_p_regs).
__device__ __forceinline__ void sage14_row_pairs(float2 (&x)[8], const float* rows, int t) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) x[nt] = *(const float2*)(rows + qrow_of(nt, 2 * t));
}
__device__ __forceinline__ void sage14_prob(float (&prob)[8][4], const int (&s_acc)[8][4], float s_qk, const float2 (&L)[8]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            prob[nt][e] = p_of_score(s_acc[nt][e], s_qk, (e & 1) ? L[nt].y : L[nt].x);
}
// The pipelined loops' start (pipe14 at d = 64, sb16 at d = 128): an item without query blocks drains its copies
// and returns; otherwise, after the first copies are issued, wait for the key block and block qb0 (the newest copy
// group, block qb0 + 1, may still fly) and put K̂ᵀ in dQ's byte order ((b) of tile qb0 orders it before the first dQ).
__device__ __forceinline__ bool sage14_no_query_block(const Dims& d, int qb0) {
    if (qb0 < d.n_qblk) return false;
    cp_async_wait<0>();
    __syncthreads();
    return true;
}
__device__ __forceinline__ void sage14_first_wait(u32 smem) {
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    sbwd12_interleave_kt(smem + StagedSage::kt);
}
// The pipelined query loops' scales of key block kb (pipe14's d 64, sb16's d 128): s_K, and the rows of s_Q and
// s_dO of head bh over its query blocks.
struct Sage14Scales {
    float s_k;
    const float* q_scale;
    const float* do_scale;
    __device__ __forceinline__ Sage14Scales(const BackwardParams& p, int kb, int bh, int bh_kv)
        : s_k(p.op.k_scale[bh_kv * p.dims.n_kblk + kb]), q_scale(p.op.q_scale + bh * p.dims.n_qblk),
          do_scale(p.do_scale + bh * p.dims.n_qblk) {}
};
#endif  // PIPE14_LOOP || SB128_LOOP (the row-constant and bulk dQ helpers above are shared with sb128)
#if PIPE14_LOOP
// dPᵀ's registers: declared in the loop (ds_in) or, with F (dPᵀ issued a tile ahead), before it (Sage14Ds).
template <bool F>
struct Sage14Ds {
    __device__ __forceinline__ float (&pick(float (&ds_in)[8][4]))[8][4] { return ds_in; }
};
template <>
struct Sage14Ds<true> {
    float v[8][4];
    __device__ __forceinline__ float (&pick(float (&)[8][4]))[8][4] { return v; }
};

// bwd18 TMA_DQ: the kernel's parameter is BwdParamsDqMap, the dQ accumulator's tensor map (4-D: 32 columns, d/32
// column blocks, n_q rows, B·H_q; box 32 × 1 × 16 × 1, 128-byte swizzle; rows past n_q clipped; src/backward.rs)
// followed by BackwardParams (dq_map_of).
#define BWD18_WARP_BOX 2048                    // one warp's staging box: 16 rows × 32 FP32
#define BWD18_BOXES ((THREADS / 32) * BWD18_WARP_BOX)  // one tile's 8 boxes
// {x, y} at shared (base ^ X) (row g) and {z, w} at (base ^ X) + 1024 (row g + 8).
template <int X>
__device__ __forceinline__ void bwd18_sts_pair(u32 base, float x, float y, float z, float w) {
    asm volatile("{\n.reg .b32 a;\nxor.b32 a, %0, %1;\nst.shared.v2.f32 [a], {%2, %3};\nst.shared.v2.f32 [a+1024], {%4, %5};\n}\n"
                 ::"r"(base), "n"(X), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
// The landed dQ tile (the values sage14_stage_dq_rot stages: fl(float(acc)·scale), sage10_i2f) into the warp's box at
// boxes + 2048·warp (boxes 1024-aligned): rows 16(w mod 4) + g (+ 8), columns (w div 4)·32 + 8n + 2t (+ 1) at box byte
// L = 128·row + 32n + 8t, physical L ^ ((row mod 8) << 4) (the map's swizzle): for each n the 32 lanes hit 2 × 8
// distinct 16-byte chunks of 8 rows, 2 wavefronts per STS.64, no selects.
__device__ __forceinline__ void bwd18_tma_stage_dq(u32 boxes, const int (*acc)[4], float scale) {
    static_assert(HEAD_DIM == 64, "bwd18_tma_stage_dq: 4 n-tiles per warp");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 b0 = boxes + warp * BWD18_WARP_BOX + 128 * g + ((8 * t) ^ (g << 4));  // bits 5, 6 of the box row clear
    float v[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) v[n][e] = __fmul_rn(sage10_i2f(acc[n][e]), scale);
    bwd18_sts_pair<0>(b0, v[0][0], v[0][1], v[0][2], v[0][3]);
    bwd18_sts_pair<32>(b0, v[1][0], v[1][1], v[1][2], v[1][3]);
    bwd18_sts_pair<64>(b0, v[2][0], v[2][1], v[2][2], v[2][3]);
    bwd18_sts_pair<96>(b0, v[3][0], v[3][1], v[3][2], v[3][3]);
}
// bwd18's dQ block, staged a tile earlier in 8 warp boxes (stores fenced and visible since (b)), added to the accumulator
// as two tensor reduces of 64 rows × 32 columns (sb21: the 4 boxes of a column half lie one after another, rows in
// order, in the same 128-byte swizzle, so the host's map has 64-row boxes; src/backward.rs `dq_acc_map`), both from one
// lane of warp SB21_TQ64_WARP, as one commit group: sage14_bulk_dq's place and contract. Measured (call22f, against one
// box per warp from its own lane, bwd18's form): −0.3 to −0.9 % backward at every d 64 shape but N 1k causal (+0.07 %),
// geometric mean −0.58 %; training shape −0.38 %. The 8 boxes from one lane were +2.2 to +2.6 % slower (call22e).
// Which warp issues them (call22h, against warp 5 here): warp 1 (warpgroup 0, whose threads 0..63 carry the row
// constants) level, −0.10 %; the row constants moved to threads 128..191 instead (both duties on warpgroup 1, as sb20
// at d = 128) +1.1 % (training shape +1.0 %): at d = 64 the duties' placement does not follow d = 128's.
#define SB21_TQ64_WARP 5
__device__ __forceinline__ void sb21_tma_reduce_dq(const BackwardParams& p, u32 boxes, int bh, int qb, int warp_u) {
    if (warp_u != SB21_TQ64_WARP) return;
#pragma unroll
    for (int c = 0; c < 2; ++c) tma_reduce_add_4d_elect(dq_map_of(p), 0, c, qb * BLOCK_Q, bh, boxes + 4 * c * BWD18_WARP_BOX);
    bulk_commit();
}
template <class Path>
__device__ __forceinline__ float sage14_query_loop(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                   const QueryStager<Path>& stage_next, int kb, int bh,
                                                   int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    typedef typename Path::Layout Lay;
    constexpr bool BULK = Path::BULK_DQ, F = Path::DP_AHEAD, SPLIT = Path::SPLIT_MASK;
    constexpr bool TQ = Path::TMA_DQ;  // bwd18
    const Dims& d = p.dims;
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };
    if (sage14_no_query_block(d, qb0)) return 0.0f;
    const int wg = sbwd13_wg(), t = threadIdx.x & 3;
    const bool row_thread = sage14_row_thread<Path::ROWS_8>();
    const int rl = sage14_row_of_thread<Path::ROWS_8>();
    const int warp_u = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0);  // the warp, uniform to ptxas
    const u32 smem_lo = sage10_desc_lo(smem);
    // TQ: two sets of 8 warp boxes (tile i stages into set i mod 2), 1024-aligned, inside the staging tiles' bytes.
    const u32 tq_boxes = (smem + Lay::dqst0 + 1023u) & ~1023u;
    static_assert(!TQ || ((Lay::dqst0 + 1023) & ~1023) + 2 * BWD18_BOXES <= Lay::dqst0 + 2 * Lay::dqst_bytes,
                  "bwd18 TMA_DQ: the warp boxes inside the staging tiles");
    const Sage14Scales sc(p, kb, bh, bh_kv);
    const float s_k = sc.s_k, *q_scale = sc.q_scale, *do_scale = sc.do_scale;
    float s_q = q_scale[qb0], s_do = do_scale[qb0];

    // Block qb0 + 1 into stage 1, its L, D into registers (stored in tile qb0).
    const bool two = qb0 + 1 < d.n_qblk;
    if (two) stage_next(p, stage(1), bh, qb0 + 1);
    cp_async_commit();
    Sage14Rows rows_next = {pos_inf(), 0.0f, 0.0f};
    if (two && row_thread) rows_next = sage14_load_rows(p, bh, qb0 + 1, rl);
    // ATOMIC_AMAX: 4 slots of 2 floats, then sink words (smem is 1024-byte aligned, so red is 32-byte aligned).
    static_assert(!Path::ATOMIC_AMAX || (Lay::dqst0 - Lay::red >= 128 && Lay::red % 32 == 0),
                  "bwd17_block_max2 needs a 128-byte, 32-byte aligned scratch");
    const u32 amax_lane_off = (threadIdx.x & 31) == 0 ? 0u : 32u + 4u * (threadIdx.x & 15);
    if (Path::ATOMIC_AMAX && threadIdx.x < 8) ((float*)(smem_ptr + Lay::red))[threadIdx.x] = 0.0f;  // before the first barrier
    sage14_first_wait(smem);

    int s_acc[8][4];
    StagedSage::wg_issue_scores(s_acc, smem_lo, sage10_desc_lo(stage(0)), wg);
    Sage14Ds<F> ds_ahead;  // F: dPᵀ of the next block, in flight across the back edge
    if (F) {
        float unused[8][4];
        StagedSage::wg_issue_dp(ds_ahead.pick(unused), smem_lo, sage10_desc_lo(stage(0)), wg);
    }

    float dq_scale = 0.0f;  // of the pending dQ tile (block qb − 1)
    u32 st_cur = stage(0), st_next = stage(1), st_free = stage(2);
    // bwd16: the loop body once with the mask (MASKED: tiles whose key block some row of the query block
    // may not see) and once without it. The masked tiles come first: a block needs the mask iff its
    // last key kb·128 + 127 is ≥ n_k (every block of a ragged last key block) or, causal, lies past the
    // block's first row's last visible key (qb·64 + n_k − n_q), and that holds for a prefix of the
    // query blocks (the second term falls as qb grows). The unmasked loop carries no mask code: with the
    // mask as a branch inside every tile, ptxas kept P's 32 registers out of the branch's way by 32
    // moves on every tile (and the mask test itself). The same operations on every value.
    const auto body = [&](const int qb, const bool MASKED) {
        const int i = qb - qb0, par = i & 1;
        const bool has_next = qb + 1 < d.n_qblk, has_next2 = qb + 2 < d.n_qblk;
        const float* rows = rows_of(par);
        const float s_qk = __fmul_rn(__fmul_rn(s_q, p.c_lambda), s_k);  // fl(fl(s_Q·cλ)·s_K), §4
        const int qn = has_next ? qb + 1 : qb;
        const float s_q_next = q_scale[qn], s_do_next = do_scale[qn];

        // P = exp2(fma(float(S), s, −L)) (bfma24) (tile_p_regs), L read before the wait; dPᵀ runs meanwhile.
        float2 L[8], D[8];
        sage14_row_pairs(L, rows, t);
        float ds_in[8][4];  // dPᵀ, then dS in place (without F)
        float (&ds)[8][4] = ds_ahead.pick(ds_in);
        wgmma_wait<0>();  // Sᵀ of qb (F: and dPᵀ)
        wgmma_fence_regs(s_acc);
        if (F) {
            wgmma_fence_regs(ds);
        } else {
            StagedSage::wg_issue_dp(ds, smem_lo, sage10_desc_lo(st_cur), wg);
        }
        float prob[8][4];
        sage14_prob(prob, s_acc, s_qk, L);
        float amax_p = sage10_tile_max<false>(prob);  // redone below if the tile is masked
        // dS = fl(P·fl(dP − D)) (sage10_ds_regs), D read before the wait.
        sage14_row_pairs(D, rows + BLOCK_Q, t);
        if (!F) {
            wgmma_wait<0>();  // dPᵀ of qb
            wgmma_fence_regs(ds);
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D[nt].y : D[nt].x));
        if (MASKED && sage10_mask(d, qb, kb, prob, ds)) amax_p = sage10_tile_max<false>(prob);  // warp-uniform
        float amax_ds = sage10_tile_max<true>(ds);
        if (has_next && row_thread) sage14_store_rows_at(rows_of(par ^ 1), rows_next, rl);
        if (BULK) bulk_wait_read();  // staging tile par (its bulk of tile i − 1) free after (b)
        cp_async_wait<0>();   // this thread's copies of block qb + 1
        fence_proxy_async();  // they and the dŜ stores of block qb − 1 → wgmma's reads
        if (Path::ATOMIC_AMAX) {
            bwd17_block_max2(amax_p, amax_ds, smem + Lay::red + 8 * (i & 3), amax_lane_off);  // (b)
        } else {
            block_max2(amax_p, amax_ds, (float*)(smem_ptr + Lay::red + par * Lay::red_bytes));  // (b)
        }
        GroupScale sc_p, sc_ds;
        if (SPLIT) {  // bwd16's scales
            bwd16_group_scales(amax_p, sc_p);
            bwd16_group_scales(amax_ds, sc_ds);
        } else {
            sage10_group_scales(amax_p, amax_ds, sc_p, sc_ds);
        }

        // dQ of block qb − 1 (every tile: the same commit groups each time; the first tile's is stale).
        int dq_acc[HEAD_DIM / 16][4];
        wgmma_fence();
        StagedSage::issue_dq(dq_acc, smem_lo, sage10_desc_lo(smem + Lay::ds0 + (par ^ 1) * Lay::ds_bytes));
        wgmma_commit();
        // Block qb + 2 into the stage block qb − 1 had (every warp is past its products: (b)).
        if (has_next2) stage_next(p, st_free, bh, qb + 2);
        cp_async_commit();
        Sage14Rows rows_next2 = {pos_inf(), 0.0f, 0.0f};
        if (has_next2 && row_thread) rows_next2 = sage14_load_rows(p, bh, qb + 2, rl);
        // BULK: dQ of block qb − 2, staged in tile i − 1 (tile par ^ 1), visible since (b).
        if (BULK && i >= 2) {
            if (TQ) {
                sb21_tma_reduce_dq(p, tq_boxes + (par ^ 1) * BWD18_BOXES, bh, qb - 2, warp_u);
            } else {
                sage14_bulk_dq(p, smem + Lay::dqst0 + (par ^ 1) * Lay::dqst_bytes, bh, qb - 2, warp_u);
            }
        }

        u32 pa[2][4], da[2][4];
        StagedSage::quantize_tile(prob, ds, sc_p.inv, sc_ds.inv, smem_ptr + Lay::ds0 + par * Lay::ds_bytes, pa, da);
        const float scale_v = __fmul_rn(sc_p.scale, s_do), scale_k = __fmul_rn(sc_ds.scale, s_q);
        const u32 st_lo = sage10_desc_lo(st_cur);
        int acc[2][4][4];
        StagedSage::wg_issue_chunk(acc[0], pa, st_lo, StagedSage::dot, 0);
        StagedSage::wg_issue_chunk(acc[1], pa, st_lo, StagedSage::dot, 1);
        wgmma_wait<2>();  // dQ of qb − 1 landed
        wgmma_fence_regs(dq_acc);
        if (BULK) {
            if (i > 0) {  // block-uniform
                if (TQ) {
                    bwd18_tma_stage_dq(tq_boxes + par * BWD18_BOXES, dq_acc, dq_scale);
                } else if (Path::ROT_DQ) {
                    static_assert(!Path::ROT_DQ || (Lay::dqst0 % (2 * HEAD_DIM) == 0 && Lay::dqst_bytes % (2 * HEAD_DIM) == 0),
                                  "sage14_stage_dq_rot's XOR addressing needs 32·NT-byte aligned staging tiles");
                    sage14_stage_dq_rot(smem + Lay::dqst0 + par * Lay::dqst_bytes, dq_acc, dq_scale);
                } else {
                    sage14_stage_dq(smem_ptr + Lay::dqst0 + par * Lay::dqst_bytes, dq_acc, dq_scale);
                }
            }
        } else {
            if (i > 0) sage10_add_dq(p, dq_acc, dq_scale, bh, qb - 1);  // block-uniform
        }
        wgmma_wait<1>();
        wgmma_fence_regs(acc[0]);
        StagedSage::dequant_chunk(acc[0], dv, scale_v);
        StagedSage::wg_issue_chunk(acc[0], da, st_lo, StagedSage::qt, 0);
        wgmma_wait<1>();
        wgmma_fence_regs(acc[1]);
        StagedSage::dequant_chunk(acc[1], dv + 4, scale_v);
        StagedSage::wg_issue_chunk(acc[1], da, st_lo, StagedSage::qt, 1);
        StagedSage::wg_issue_scores(s_acc, smem_lo, sage10_desc_lo(st_next), wg);  // block qb + 1
        if (F) {
            StagedSage::wg_issue_dp(ds, smem_lo, sage10_desc_lo(st_next), wg);  // block qb + 1
            wgmma_wait<3>();
        } else {
            wgmma_wait<2>();
        }
        wgmma_fence_regs(acc[0]);
        StagedSage::dequant_chunk(acc[0], dk, scale_k);
        if (F) {
            wgmma_wait<2>();
        } else {
            wgmma_wait<1>();
        }
        wgmma_fence_regs(acc[1]);
        StagedSage::dequant_chunk(acc[1], dk + 4, scale_k);

        dq_scale = __fmul_rn(sc_ds.scale, s_k);
        s_q = s_q_next;
        s_do = s_do_next;
        rows_next = rows_next2;
        const u32 st_done = st_cur;
        st_cur = st_next;
        st_next = st_free;
        st_free = st_done;
    };
    int qb = qb0;
    if (SPLIT) {
        const int last_key = kb * BLOCK_KV + BLOCK_KV - 1;
        const bool ragged = last_key >= d.n_k;
        for (; qb < d.n_qblk && (ragged || (d.causal && last_key > qb * BLOCK_Q + (d.n_k - d.n_q))); ++qb)
            body(qb, true);
        for (; qb < d.n_qblk; ++qb) body(qb, false);
    } else {
        for (; qb < d.n_qblk; ++qb) body(qb, true);
    }
    wgmma_wait<0>();      // the last tile's (unused) Sᵀ (and dPᵀ with F)
    fence_proxy_async();  // the last dŜ stores (and dQ staging stores) → the async proxy's reads
    __syncthreads();      // dS of the last block complete
    // BULK: dQ of block n_qblk − 2, staged by the last tile (i = n − 1 ≥ 1). Waited for (read) before the
    // next item's first barrier (b), completed before the CTA exits (staged_finish).
    const int n = d.n_qblk - qb0;
    if (BULK && n >= 2) {
        if (TQ) {
            sb21_tma_reduce_dq(p, tq_boxes + ((n - 1) & 1) * BWD18_BOXES, bh, d.n_qblk - 2, warp_u);
        } else {
            sage14_bulk_dq(p, smem + Lay::dqst0 + ((n - 1) & 1) * Lay::dqst_bytes, bh, d.n_qblk - 2, warp_u);
        }
    }
    return dq_scale;
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage14Q>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                  const QueryStager<StagedSage14Q>& stage_next, int kb, int bh,
                                                                  int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage14_query_loop<StagedSage14Q>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage14>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                 const QueryStager<StagedSage14>& stage_next, int kb, int bh,
                                                                 int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage14_query_loop<StagedSage14>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage14P>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                  const QueryStager<StagedSage14P>& stage_next, int kb, int bh,
                                                                  int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage14_query_loop<StagedSage14P>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
}
#endif

#if SB128_LOOP
// sb16: the query loop of StagedSage128 pipelined across query blocks (see the sb16 note above StagedSage128).
// The generic loop's contract: entered with the key block and block qb0 staged (one commit group) and qb0's
// row constants stored; leaves every dQ but the last added (staged and bulk-reduced), the last block's dŜ
// complete behind a barrier, no wgmma or copy in flight. Per tile, block qb (i = qb − qb0, par = i mod 2:
// its stage, L/D buffer, dŜ tile, amax scratch and dQ staging tile):
//   Sᵀ of qb was issued at the end of tile qb − 1 (before the loop for qb0); L read, wait for it, issue dPᵀ
//   → P while dPᵀ runs; D read, wait; dS, mask, the warps' amax; L, D of qb + 1 stored (raw rows, loaded a
//   tile earlier); this thread's bulk reduce of tile i − 1 has read its staging tile (par ^ 1 … the one tile
//   i + 1 writes: read before (b) of tile i + 1 at the latest, here at (b) of tile i) and its copies are done
//   → (b), the tile's one block barrier: the tile amax; A(qb + 1), B(qb), dŜ(qb − 1), the dQ(qb − 2) staging
//     stores, L, D of qb + 1 visible; every warp has waited for Sᵀ(qb), dPᵀ(qb) (A part of stage par free),
//     for tile qb − 1's products (B part of stage par ^ 1, dŜ tile par and amax scratch par ^ 1 free)
//   → group scales; dQ(qb − 1) issued (stale, unused, on the first tile: the same commit groups every tile);
//     A(qb + 2) → stage par, B(qb + 1) → stage par ^ 1 (cp.async, one group), raw L, D of qb + 2 loaded;
//     dQ(qb − 2) (staging par ^ 1) out by one bulk reduce per warp; P̂, dŜ quantized, dŜ stored; the 8
//     dV/dK chunks, two in flight; dQ(qb − 1) staged (staging par) once landed; Sᵀ(qb + 1) issued after
//     the last chunk (of a stale stage and unused on the last tile) and runs while the last two chunks are
//     dequantized.
// Only Sᵀ crosses the back edge, waited for by wgmma_wait<0> (pipe14: a partial wait there serializes every
// wgmma, C7514).
// S = StagedSage128 (the copies of blocks qb + 1, qb + 2 by cp.async) or StagedSage128T (sb20: by TMA, see its type).
template <class S>
__device__ __forceinline__ float sb16_query_loop(const BackwardParams& p, u32 smem, unsigned char* smem_ptr, int kb, int bh,
                                                 int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    typedef typename S::Layout Lay;
    const Dims& d = p.dims;
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };
    if (sage14_no_query_block(d, qb0)) return 0.0f;
    const int wg = sbwd13_wg(), t = threadIdx.x & 3;
    const int warp_u = threadIdx.x >> 5;  // plain, as sb128's loop (a shuffle made ptxas see the item loop divergent)
    const int rl = (int)threadIdx.x - SB20_ROW_BASE;  // the row constants: threads SB20_ROW_BASE .. + 63, row rl
    const bool row_thread = (unsigned)rl < BLOCK_Q;
    const u32 smem_lo = sage10_desc_lo(smem);
    const Sage14Scales sc(p, kb, bh, bh_kv);
    const float s_k = sc.s_k, *q_scale = sc.q_scale, *do_scale = sc.do_scale;
    float s_q = q_scale[qb0], s_do = do_scale[qb0];

    // A of block qb0 + 1 into stage 1 (its B follows in tile qb0), its raw L, D into registers.
    const bool two = qb0 + 1 < d.n_qblk;
    if (two) S::stage_query_a(p, stage(1), bh, qb0 + 1);
    cp_async_commit();
    Sage14Rows rows_next = {pos_inf(), 0.0f, 0.0f};
    if (two && row_thread) rows_next = sage14_load_rows(p, bh, qb0 + 1, rl);
    u32 bar = 0;  // sb20: the mbarrier of the TMA copies issued in tile i (phase i), made visible by the barrier below
    if constexpr (S::TMA_STAGE) {
        __shared__ __align__(8) unsigned long long stage_bar;
        bar = (u32)__cvta_generic_to_shared(&stage_bar);
        if (threadIdx.x == SB20_TMA_THREAD) S::init(p, bar);
    }
    // amax24: the tile amax's block step by shared atomics (bwd17_block_max2, as the d = 64 loop's ATOMIC_AMAX). Its
    // four slots are zeroed here, before the barrier in sage14_first_wait, at every entry (the persistent grid enters
    // once per item; the previous item's last slot reads were before its closing barrier).
    static_assert(Lay::dqst0 - Lay::red >= 128 && Lay::red % 32 == 0, "bwd17_block_max2 needs a 128-byte, 32-byte aligned scratch");
    const u32 amax_lane_off = (threadIdx.x & 31) == 0 ? 0u : 32u + 4u * (threadIdx.x & 15);
    if (threadIdx.x < 8) ((float*)(smem_ptr + Lay::red))[threadIdx.x] = 0.0f;
    sage14_first_wait(smem);

    int s_acc[8][4];
    S::wg_issue_scores(s_acc, smem_lo, sage10_desc_lo(stage(0)), wg);

    float dq_scale = 0.0f;  // of the pending dQ tile (block qb − 1)
    for (int qb = qb0; qb < d.n_qblk; ++qb) {
        const int i = qb - qb0, par = i & 1;
        const bool has_next = qb + 1 < d.n_qblk, has_next2 = qb + 2 < d.n_qblk;
        const float* rows = rows_of(par);
        const float s_qk = __fmul_rn(__fmul_rn(s_q, p.c_lambda), s_k);  // fl(fl(s_Q·cλ)·s_K), §4
        const int qn = has_next ? qb + 1 : qb;
        const float s_q_next = q_scale[qn], s_do_next = do_scale[qn];
        const u32 st_lo = sage10_desc_lo(stage(par));

        // P = exp2(fma(float(S), s, −L)) (bfma24) (tile_p_regs), L read before the wait; dPᵀ runs meanwhile.
        float2 L[8];
        sage14_row_pairs(L, rows, t);
        wgmma_wait<0>();  // Sᵀ of qb
        wgmma_fence_regs(s_acc);
        float ds[8][4];  // dPᵀ, then dS in place
        S::wg_issue_dp(ds, smem_lo, st_lo, wg);
        float prob[8][4];
        sage14_prob(prob, s_acc, s_qk, L);
        float amax_p = sage10_tile_max<false>(prob);  // redone below if the tile is masked
        // dS = fl(P·fl(dP − D)) (sage10_ds_regs), D read before the wait.
        float2 D[8];
        sage14_row_pairs(D, rows + BLOCK_Q, t);
        wgmma_wait<0>();  // dPᵀ of qb
        wgmma_fence_regs(ds);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D[nt].y : D[nt].x));
        if (sage10_mask(d, qb, kb, prob, ds)) amax_p = sage10_tile_max<false>(prob);  // warp-uniform
        float amax_ds = sage10_tile_max<true>(ds);
        if (has_next && row_thread) sage14_store_rows_at(rows_of(par ^ 1), rows_next, rl);
        bulk_wait_read();  // tile i − 1's bulk has read staging tile par, which this tile writes after (b)
        cp_async_wait<0>();       // this thread's copies of A(qb + 1), B(qb) (sb20: of A(qb0 + 1) only)
        if constexpr (S::TMA_STAGE)
            if (i > 0) mbar_wait(bar, (i - 1) & 1);  // sb20: tile i − 1's boxes, A(qb + 1) and B(qb), landed
        fence_proxy_async();      // they, the dŜ stores of qb − 1 and the dQ staging stores → the async proxy
        bwd17_block_max2(amax_p, amax_ds, smem + Lay::red + 8 * (i & 3), amax_lane_off);  // (b)
        GroupScale sc_p, sc_ds;
        // scales24: bwd16's branch-free scales (the d = 64 loop's) instead of sage10's division and shuffles.
        bwd16_group_scales(amax_p, sc_p);
        bwd16_group_scales(amax_ds, sc_ds);

        // dQ of block qb − 1 (every tile: the same commit groups each time; the first tile's is stale).
        int dq_acc[HEAD_DIM / 16][4];
        wgmma_fence();
        StagedSage::issue_dq(dq_acc, smem_lo, sage10_desc_lo(smem + Lay::ds0 + (par ^ 1) * Lay::ds_bytes));
        wgmma_commit();
        if constexpr (S::TMA_STAGE) {
            if (threadIdx.x == SB20_TMA_THREAD && has_next) S::stage_copies(p, bar, stage(par), stage(par ^ 1), bh, qb + 2, qb + 1, has_next2);
        } else {
            if (has_next2) S::stage_query_a(p, stage(par), bh, qb + 2);
            if (has_next) S::stage_query_b(p, stage(par ^ 1), bh, qb + 1);
            cp_async_commit();
        }
        Sage14Rows rows_next2 = {pos_inf(), 0.0f, 0.0f};
        if (has_next2 && row_thread) rows_next2 = sage14_load_rows(p, bh, qb + 2, rl);
        // dQ of block qb − 2, staged by tile i − 1 in staging tile par ^ 1, visible since (b).
        if (i >= 2) sb21_bulk_dq(p, smem + Lay::dqst0 + (par ^ 1) * Lay::dqst_bytes, bh, qb - 2, warp_u);

        u32 pa[2][4], da[2][4];
        // wg_key_products' chunks (dV's 4, then dK's 4, two in flight), dQ(qb − 1) staged after the first two
        // are issued, Sᵀ(qb + 1) after the last.
        constexpr int C = HEAD_DIM / 32, N = 2 * C;
        int acc[2][4][4];
        // sb20: P̂ first, dV's first two chunks issued, then dŜ quantized and stored while they run.
        StagedSage::quantize_p(prob, sc_p.inv, pa);
        StagedSage::wg_issue_chunk(acc[0], pa, st_lo, StagedSage::dot, 0);
        StagedSage::wg_issue_chunk(acc[1], pa, st_lo, StagedSage::dot, 1);
        StagedSage::quantize_ds(ds, sc_ds.inv, smem_ptr + Lay::ds0 + par * Lay::ds_bytes, da);
        const float scale_v = __fmul_rn(sc_p.scale, s_do), scale_k = __fmul_rn(sc_ds.scale, s_q);
        wgmma_wait<2>();  // dQ of qb − 1 landed
        wgmma_fence_regs(dq_acc);
        if (i > 0) S::stage_dq(smem_ptr + Lay::dqst0 + par * Lay::dqst_bytes, dq_acc, dq_scale);  // block-uniform
#pragma unroll
        for (int j = 0; j < N; ++j) {
            // in flight younger than chunk j: chunk j + 1 (j + 1 < N), Sᵀ(qb + 1) (j ≥ N − 2)
            if (j == N - 2) {
                wgmma_wait<2>();
            } else {
                wgmma_wait<1>();
            }
            wgmma_fence_regs(acc[j & 1]);
            StagedSage::dequant_chunk<true>(acc[j & 1], (j < C ? dv : dk) + 4 * (j % C), j < C ? scale_v : scale_k);
            const int k = j + 2;
            if (k < N) StagedSage::wg_issue_chunk(acc[j & 1], k < C ? pa : da, st_lo, k < C ? StagedSage::dot : StagedSage::qt, k % C);
            if (j == N - 3) S::wg_issue_scores(s_acc, smem_lo, sage10_desc_lo(stage(par ^ 1)), wg);  // block qb + 1
        }

        dq_scale = __fmul_rn(sc_ds.scale, s_k);
        s_q = s_q_next;
        s_do = s_do_next;
        rows_next = rows_next2;
    }
    wgmma_wait<0>();      // the last tile's (unused) Sᵀ
    cp_async_wait<0>();
    fence_proxy_async();  // the last dŜ stores and dQ staging stores → the async proxy's reads
    __syncthreads();      // dS of the last block complete
    // dQ of block n_qblk − 2, staged by the last tile (i = n − 1 ≥ 1). Waited for (read) before the next item's
    // first (b), completed before the CTA exits (staged_finish).
    const int n = d.n_qblk - qb0;
    if (n >= 2) sb21_bulk_dq(p, smem + Lay::dqst0 + ((n - 1) & 1) * Lay::dqst_bytes, bh, d.n_qblk - 2, warp_u);
    return dq_scale;
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage128>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                  const QueryStager<StagedSage128>&, int kb, int bh, int bh_kv,
                                                                  int qb0, float (*dv)[4], float (*dk)[4]) {
    return sb16_query_loop<StagedSage128>(p, smem, smem_ptr, kb, bh, bh_kv, qb0, dv, dk);
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage128T>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                   const QueryStager<StagedSage128T>&, int kb, int bh, int bh_kv,
                                                                   int qb0, float (*dv)[4], float (*dk)[4]) {
    return sb16_query_loop<StagedSage128T>(p, smem, smem_ptr, kb, bh, bh_kv, qb0, dv, dk);
}
#endif

// A key block's FP32 dV, dK accumulators (this thread's fragments) set to 0 before its query blocks.
__device__ __forceinline__ void zero_dv_dk(float (*dv)[4], float (*dk)[4]) {
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv[nd][e] = dk[nd][e] = 0.0f;
}

// What a path does before its CTA exits (pipe14b: StagedSage14T with BULK waits for its dQ bulk reductions).
template <class Path>
__device__ __forceinline__ void staged_finish() {}
#if FPA_EARLY_PATH
template <>
__device__ __forceinline__ void staged_finish<StagedBf16Bulk>() {
    bulk_wait();  // the dQ reduce-adds complete before the CTA exits
}
#endif
#if PIPE14_LOOP
template <>
__device__ __forceinline__ void staged_finish<StagedSage14>() {
    if (StagedSage14::BULK_DQ) bulk_wait();
}
template <>
__device__ __forceinline__ void staged_finish<StagedSage14P>() {
    if (StagedSage14P::BULK_DQ) bulk_wait();
}
template <>
__device__ __forceinline__ void staged_finish<StagedSage14Q>() {
    if (StagedSage14Q::BULK_DQ) bulk_wait();  // bwd18: its dQ tensor reduces complete before the CTA exits
}
#endif
#if SB128_LOOP
template <>
__device__ __forceinline__ void staged_finish<StagedSage128>() {
    if (StagedSage128::BULK_DQ) bulk_wait();
}
template <>
__device__ __forceinline__ void staged_finish<StagedSage128T>() {
    bulk_wait();
}
#endif

template <class Path>
__device__ void staged_backward_main(const BackwardParams& p, unsigned char* smem_ptr) {
    typedef typename Path::Layout Lay;
    const Dims& d = p.dims;
    const KeyBlockCoords at = staged_block_coords(d);
    const int kb = at.kb, bh = at.bh;
    const u32 raw = smem_addr(smem_ptr), smem = (raw + (ALIGN_SLACK - 1)) & ~(u32)(ALIGN_SLACK - 1);
    smem_ptr += smem - raw;  // the layout's offsets count from the 1024-byte aligned start
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };

    float dv[HEAD_DIM / 8][4], dk[HEAD_DIM / 8][4];
    zero_dv_dk(dv, dk);

    const int bh_kv = kv_head_of(d, bh);
    const int qb0 = query_block_begin(d, kb);
    if (qb0 < d.n_qblk) {
        Path::stage_key_block(p, smem, bh_kv, kb);
        Path::stage_query_block(p, stage(0), bh, qb0);
    }
    cp_async_commit();
    if (threadIdx.x < BLOCK_Q && qb0 < d.n_qblk) store_row_consts(rows_of(0), load_row_consts(p, bh, qb0, threadIdx.x));

    const QueryStager<Path> stage_next(p, bh);  // stages block qb + 1 (sage11)
    const float dq_scale = staged_query_loop<Path>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
    if (qb0 < d.n_qblk)
        Path::dq(p, smem, smem + Lay::ds0 + ((d.n_qblk - 1 - qb0) & 1) * Lay::ds_bytes, dq_scale, bh, d.n_qblk - 1);
    Path::drain(dv, dk);  // the last block's dV, dK (a path with STAGES_NEXT leaves them in flight)

    store_dk_dv(p, kb, bh, dv, dk);
    staged_finish<Path>();
}
// fpab12: a persistent grid (kernels sage_bwd_main_persist_{sage,bf16}; SAGEBWD_BWD_PERSIST in src/backward.rs). The grid
// is (G, 1) with G ≤ the CTAs that fit at once; CTA c starts on item c of the n_kblk × rows items (in
// staged_item_coords' order: heaviest first) and claims each next one from a counter (dynamic, as the
// hardware's block scheduler hands out the blocks of the plain grid: the tail stays short): one
// atomicAdd by thread 0 while the finished item's last dQ runs, broadcast through shared memory at the
// barrier that follows it. Past that barrier no warp reads the item's shared memory any more, so the
// next item's key block, first query block (cp.async) and row constants are issued before the
// finished item's dK, dV stores, which go out while those loads fly. The counter is the 32-bit word
// after the dQ accumulator's rows·n_q·d floats (the host allocates and zeroes it). The plain grid
// (n_kblk, rows) of sage_bwd_main_mma, one item per CTA, keeps staged_backward_main unchanged.
template <class Path>
__device__ __forceinline__ void staged_prologue(const BackwardParams& p, u32 smem, int kb, int bh) {
    const Dims& d = p.dims;
    const int qb0 = query_block_begin(d, kb);
    if (qb0 < d.n_qblk) {
        Path::stage_key_block(p, smem, kv_head_of(d, bh), kb);
        Path::stage_query_block(p, smem + Path::Layout::stage0, bh, qb0);
    }
    cp_async_commit();
}

// pbwd13: the item (and so kb, bh, qb0, the query loop's qb) as a value ptxas knows is warp-uniform, as
// in the plain grid where they come from blockIdx: broadcast from lane 0 by a full-mask shuffle at the
// top of every item. Carried as fpab12 had it (the coordinates, updated in the divergent row-constant
// tail of the last item), ptxas kept the query loop's counters, stage addresses and wgmma descriptors in
// vector registers and moved them by R2UR before every wgmma: +20 to +40 registers over the plain
// kernel, 56–96 B of spill in the INT8 kernel at d = 128, a slower tile where items are long. With it the
// query loop is within −4 to +1 % of the plain kernel's instructions at d = 64 and 128, no spill. Also the
// claim's gridDim.x is added after the barrier (added at the atomic, warp 0 waited for the atomic right
// after issuing it, before its part of the last dQ). Measured (pbwd13's call, docs/RESULTS-gpu.md):
// faster than the plain grid in both runs for the BF16 path at d = 64, 128 and the INT8 path at d = 128
// (−0.7 to −4.3 %), but for the INT8 path at d = 64 slower than fpab12's form (+0.4 to +1.0 % at causal
// N 1k, where fpab12's is the default) and than the plain grid at N 4k: there fpab12's form is kept.
template <class Path>
struct PersistUniformItem {
    static constexpr bool value = true;
};
#if HEAD_DIM == 64
template <>
struct PersistUniformItem<StagedSage> {
    static constexpr bool value = false;
};
#if PIPE14_LOOP
template <int KIND, bool BULK, bool ROWS8, bool F, bool ROT, bool SPLIT>
struct PersistUniformItem<StagedSage14T<KIND, BULK, ROWS8, F, ROT, SPLIT>> {
    static constexpr bool value = false;
};
#endif
#endif

template <class Path>
__device__ void staged_backward_persist(const BackwardParams& p, unsigned char* smem_ptr) {
    typedef typename Path::Layout Lay;
    constexpr bool UNIFORM = PersistUniformItem<Path>::value;
    const Dims& d = p.dims;
    const u32 raw = smem_addr(smem_ptr), smem = (raw + (ALIGN_SLACK - 1)) & ~(u32)(ALIGN_SLACK - 1);
    smem_ptr += smem - raw;  // the layout's offsets count from the 1024-byte aligned start
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };

    const int n_rows = d.batch * d.heads_q, n_items = d.n_kblk * n_rows;
    __shared__ int next_item;  // the claimed item (UNIFORM: the counter's value, the item − gridDim.x), thread 0 → the CTA
    int item = blockIdx.x;
    if (item >= n_items) return;  // (the host launches at most n_items CTAs)
    KeyBlockCoords at = staged_item_coords(d, item, d.n_kblk, n_rows);

    staged_prologue<Path>(p, smem, at.kb, at.bh);
    if (threadIdx.x < BLOCK_Q && query_block_begin(d, at.kb) < d.n_qblk)
        store_row_consts(rows_of(0), load_row_consts(p, at.bh, query_block_begin(d, at.kb), threadIdx.x));
    // Its per-thread parts do not depend on the head (the head goes to each call).
    const QueryStager<Path> stage_next(p, at.bh);  // stages block qb + 1 (sage11)
    for (;;) {
        if (UNIFORM) {
            item = __shfl_sync(0xffffffffu, item, 0);
            at = staged_item_coords(d, item, d.n_kblk, n_rows);
        }
        const int kb = at.kb, bh = at.bh;

        float dv[HEAD_DIM / 8][4], dk[HEAD_DIM / 8][4];
        zero_dv_dk(dv, dk);

        const int qb0 = query_block_begin(d, kb);
        const float dq_scale = staged_query_loop<Path>(p, smem, smem_ptr, stage_next, kb, bh, kv_head_of(d, bh), qb0, dv, dk);
        int claimed = UNIFORM ? 0 : n_items;
        if (threadIdx.x == 0)
            claimed = (int)atomicAdd((unsigned*)(p.dq_acc + (long)n_rows * d.n_q * HEAD_DIM), 1u) + (UNIFORM ? 0 : (int)gridDim.x);
        if (qb0 < d.n_qblk)
            Path::dq(p, smem, smem + Lay::ds0 + ((d.n_qblk - 1 - qb0) & 1) * Lay::ds_bytes, dq_scale, bh, d.n_qblk - 1);
        Path::drain(dv, dk);  // the last block's dV, dK (a path with STAGES_NEXT leaves them in flight)

        if (threadIdx.x == 0) next_item = claimed;
        __syncthreads();  // every warp done with this item's shared memory; next_item visible
        item = next_item + (UNIFORM ? (int)gridDim.x : 0);
        if (item < n_items) {
            at = staged_item_coords(d, item, d.n_kblk, n_rows);
            staged_prologue<Path>(p, smem, at.kb, at.bh);
            const int nqb0 = query_block_begin(d, at.kb);
            RowConsts rc = {pos_inf(), 0.0f};
            if (threadIdx.x < BLOCK_Q && nqb0 < d.n_qblk) rc = load_row_consts(p, at.bh, nqb0, threadIdx.x);
            store_dk_dv(p, kb, bh, dv, dk);  // while the next item's loads fly
            if (threadIdx.x < BLOCK_Q && nqb0 < d.n_qblk) store_row_consts(rows_of(0), rc);
        } else {
            store_dk_dv(p, kb, bh, dv, dk);
            staged_finish<Path>();
            return;
        }
    }
}
// The staged paths on the persistent grid, one entry per path (registers are allocated per kernel;
// sage_bwd_main_mma's code and registers stay as they were).
// pipe14b: the sage path's type of these kernels (the pipelined loop at d = 64 on sm_90a).
#if PIPE14_LOOP
typedef StagedSage14 StagedSageKernel;         // sage_bwd_main_mma_sage
typedef StagedSage14P StagedSagePersistKernel;  // sage_bwd_main_persist_sage
#elif SB128_LOOP
typedef StagedSage128 StagedSageKernel;         // sb128: sage_bwd_main_mma_sage at d = 128
typedef StagedSage128 StagedSagePersistKernel;  // sage_bwd_main_persist_sage
#else
typedef StagedSage StagedSageKernel;
typedef StagedSage StagedSagePersistKernel;
#endif
// The body of the staged paths' entry points: launched with PDL after the preprocess (src/backward.rs), so no
// global access before the wait; the fast path the host chose (`path`); shared memory for S's layout; then
// S's loop on the persistent grid (PERSIST) or the plain one.
template <class S, bool PERSIST>
__device__ __forceinline__ void staged_entry(const BackwardParams& p, int path, unsigned char* smem) {
    pdl_wait();
    if (bwd_fast_path(p.flags) != path) __trap();
    require_dynamic_smem((u32)S::Layout::bytes);
    if constexpr (PERSIST) staged_backward_persist<S>(p, smem);
    else staged_backward_main<S>(p, smem);
}
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_persist_sage(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSagePersistKernel, true>(p, BWD_STAGED_SAGE, smem_raw);
}
// pipe14b: the sage path on the plain grid in its own kernel (sage_bwd_main_mma's grid and block order;
// the host takes it for the sage path at d = 64 on sm_90a), so that sage_bwd_main_mma's registers and
// code for its other paths stay main 37e5e90's.
#if BWD_WGMMA && (HEAD_DIM == 64 || SB128_LOOP)
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_mma_sage(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSageKernel, false>(p, BWD_STAGED_SAGE, smem_raw);
}
#endif
// bwd18: sage_bwd_main_mma_sage at d = 64 with its dQ by TMA tensor reduces (StagedSage14Q; the default at d = 64,
// SAGEBWD_SAGE_TMA_DQ=0 in src/backward.rs selects sage_bwd_main_mma_sage); the same grid, block order and shared memory.
#if BWD_WGMMA && HEAD_DIM == 64 && PIPE14_LOOP
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_mma_sage_q(const __grid_constant__ BwdParamsDqMap pm) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSage14Q, false>(pm.p, BWD_STAGED_SAGE, smem_raw);
}
#endif
#if BWD_WGMMA && SB128_LOOP
// sb20: sb128's plain-grid kernel with sb16's in-loop stage copies by TMA (StagedSage128T; the host takes it at d = 128
// when n_q % 64 == 0).
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_mma_sage_t(const __grid_constant__ BwdParamsStageMaps pm) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSage128T, false>(pm.p, BWD_STAGED_SAGE, smem_raw);
}
#endif
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_persist_bf16(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    pdl_wait();  // launched with PDL after the preprocess (src/backward.rs): no global access before it
    if (bwd_fast_path(p.flags) != BWD_STAGED_BF16) __trap();
    require_dynamic_smem((u32)StagedBf16::Layout::bytes);
#if FPA_EARLY_PATH
    staged_backward_persist<StagedBf16Early>(p, smem_raw);
#else
    staged_backward_persist<StagedBf16>(p, smem_raw);
#endif
}
// fpab15: the fpa path at d = 128 on the persistent grid with dQ by TMA reduce-adds (StagedBf16Bulk);
// the host's default for fpa at d = 128 on sm_90a, every N (SAGEBWD_FPA_BULK_DQ=0: sage_bwd_main_persist_bf16).
// Measured (RESULTS-gpu.md, fpab15): −1.1 to −13.0 % backward time against sage_bwd_main_persist_bf16 at N ≤ 4096,
// −15.5 / −15.7 % against the plain grid at N 16384. The parameter is the dQ accumulator's tensor map followed
// by BackwardParams (BwdParamsDqMap).
#if FPA_EARLY_PATH && HEAD_DIM == 128
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_persist_bf16q(const __grid_constant__ BwdParamsDqMap pm) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedBf16Bulk, true>(pm.p, BWD_STAGED_BF16, smem_raw);
}
#endif

// Every path takes its shared memory from the dynamic allocation (`backward_smem_bytes` and
// `staged_backward_smem_bytes` in src/backward.rs); a launch with less traps rather than corrupt
// memory.
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_mma(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    pdl_wait();  // launched with PDL after the preprocess (src/backward.rs): no global access before it
    const int path = bwd_fast_path(p.flags);
    if (path == BWD_STAGED_SAGE) {
        require_dynamic_smem((u32)StagedSage::Layout::bytes);
        staged_backward_main<StagedSage>(p, smem_raw);
        return;
    }
    if (path == BWD_STAGED_BF16) {
        require_dynamic_smem((u32)StagedBf16::Layout::bytes);
        staged_backward_main<StagedBf16>(p, smem_raw);
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
