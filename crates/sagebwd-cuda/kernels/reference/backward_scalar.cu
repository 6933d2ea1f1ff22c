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
            // t = fl(a·sc) (§4); P = exp2(fma(a, sc, −L)) for INT8 #3 (§5), fma(t, 1, −L) = fl(t − L) otherwise.
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

extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_reference(BackwardParams p) {
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

