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
        float sc = 1.0f;  // t = fl(t·sc) below: the factor a and its scale for INT8 #3 (§5), else t itself and 1
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

