// Step 1: the factors a of the tile's base-2 scores t = fl(a·sc) (score_factor, −∞ where masked);
// returns sc.
__device__ float forward_scores(const ForwardParams& p, ForwardShared& s, int bh, int bh_kv, int qb, int kb) {
    const bool int8 = p.flags & F_QK, smooth_q = p.flags & F_SMOOTH_Q;
    const int qs = bh * p.dims.n_qblk + qb, ks = bh_kv * p.dims.n_kblk + kb;
    for (int e = threadIdx.x; e < BLOCK_Q * BLOCK_KV; e += THREADS) {
        const int rl = e / BLOCK_KV, jl = e % BLOCK_KV;
        const int r = qb * BLOCK_Q + rl, j = kb * BLOCK_KV + jl;
        float a = neg_inf();
        if (visible(p.dims, r, j))
            a = score_factor(p.op, int8, (long)bh * p.dims.n_q + r, (long)bh_kv * p.dims.n_k + j, qs, ks, p.c_lambda,
                             smooth_q, s.beta[jl]);
        s.tile[rl][jl] = a;
    }
    return score_scale(p.op, int8, qs, ks, p.c_lambda, smooth_q);
}

// Step 2: online-softmax update of one row; leaves in the tile the P operand of #2 (P̂ as a float
// when INT8, with its per-row scale, else bf16(p)).
// The tile holds the factors a and sc the scale of t = fl(a·sc): the row max is fl(max a · sc) (a
// row masked in this tile: −∞·sc, −∞ or NaN for sc = 0, and fmaxf keeps m_old), p = exp2(fma(a, sc,
// −m_use)) on visible entries only (the select: a masked −∞ never meets sc = 0 in the fma).
__device__ void forward_softmax_row(const ForwardParams& p, ForwardShared& s, int rl, float sc) {
    float* row = s.tile[rl];
    float mx = neg_inf();
    for (int j = 0; j < BLOCK_KV; ++j) mx = fmaxf(mx, row[j]);
    const float m_old = s.m[rl];
    const float m_new = running_max(p.flags & F_QK, m_old, __fmul_rn(mx, sc));
    const float m_use = m_new == neg_inf() ? 0.0f : m_new;
    float sum = 0.0f, amax = 0.0f;
    for (int j = 0; j < BLOCK_KV; ++j) {
        const float pj = row[j] == neg_inf() ? 0.0f : exp2_ftz(__fmaf_rn(row[j], sc, -m_use));
        row[j] = pj;
        sum = __fadd_rn(sum, pj);
        amax = fmaxf(amax, pj);  // the §4 group amax
    }
    const float alpha = exp2_ftz(__fsub_rn(m_old, m_use));
    s.alpha[rl] = alpha;
    s.l[rl] = __fadd_rn(__fmul_rn(s.l[rl], alpha), sum);
    s.m[rl] = m_new;
    if (p.flags & F_PV) {
        const GroupScale g = group_scale(amax);
        s.p_scale[rl] = g.scale;
        for (int j = 0; j < BLOCK_KV; ++j) row[j] = (float)quantize(row[j], g.inv);
    } else {
        for (int j = 0; j < BLOCK_KV; ++j) row[j] = round_bf16(row[j]);
    }
}

// Step 3: O = fl(O·α) + PV_block for this thread's O entries.
__device__ void forward_pv(const ForwardParams& p, ForwardShared& s, float* o_acc, int bh_kv, int kb) {
    const int keys = min(BLOCK_KV, p.dims.n_k - kb * BLOCK_KV);
    const long v_row0 = (long)bh_kv * p.dims.n_k + kb * BLOCK_KV;
    const bool int8 = p.flags & F_PV;
    const float s_v = int8 ? p.v_scale[bh_kv * p.dims.n_kblk + kb] : 0.0f;
#pragma unroll
    for (int i = 0; i < O_PER_THREAD; ++i) {
        const int e = threadIdx.x + i * THREADS;
        const int rl = e / HEAD_DIM, c = e % HEAD_DIM;
        const float* prow = s.tile[rl];
        if (int8) {
            int acc = 0;
            for (int j = 0; j < keys; ++j) acc += (int)prow[j] * (int)p.v_hat[(v_row0 + j) * HEAD_DIM + c];
            o_acc[i] = dequant_add(acc, s.p_scale[rl], s_v, __fmul_rn(o_acc[i], s.alpha[rl]));
        } else {
            float pv = 0.0f;
            for (int j = 0; j < keys; ++j)
                pv = __fadd_rn(pv, __fmul_rn(prow[j], bf16_to_f32(p.v[(v_row0 + j) * HEAD_DIM + c])));
            o_acc[i] = __fadd_rn(__fmul_rn(o_acc[i], s.alpha[rl]), pv);
        }
    }
}

// An output value of §4: fl(x · r_l) with r_l = fl(1/l) of its row; 0 for a row with no visible key (l = 0).
__device__ __forceinline__ float o_normalized(float x, float l, float r_l) { return l == 0.0f ? 0.0f : __fmul_rn(x, r_l); }

// Final step: O = fl(O · fl(1/l)) as BF16 (§4); lse2 = fl(m + log2 l), the LSE of the true scores: an INT8 #1
// scored the smoothed K, so the row offset b_r is added back once (§4); the exported natural LSE is
// fl(lse2 · ln 2). A row with no visible key gets O = 0, lse2 = lse = +∞.
__device__ void forward_store(const ForwardParams& p, ForwardShared& s, const float* o_acc, int bh, int qb) {
#pragma unroll
    for (int i = 0; i < O_PER_THREAD; ++i) {
        const int e = threadIdx.x + i * THREADS;
        const int rl = e / HEAD_DIM, c = e % HEAD_DIM;
        const int r = qb * BLOCK_Q + rl;
        if (r >= p.dims.n_q) continue;
        const float l = s.l[rl];
        const float o = o_normalized(o_acc[i], l, __frcp_rn(l));
        p.o[((long)bh * p.dims.n_q + r) * HEAD_DIM + c] = f32_to_bf16(o);
    }
    if (threadIdx.x < BLOCK_Q) {
        const int rl = threadIdx.x, r = qb * BLOCK_Q + rl;
        if (r < p.dims.n_q) {
            const long row = (long)bh * p.dims.n_q + r;
            const float l = s.l[rl];
            float lse2 = pos_inf();
            if (l != 0.0f) {
                lse2 = __fadd_rn(s.m[rl], log2f(l));
                if (p.flags & F_QK) lse2 = __fadd_rn(lse2, p.op.row_offset[row]);
            }
            p.lse2[row] = lse2;
            p.lse[row] = l != 0.0f ? __fmul_rn(lse2, p.ln2) : pos_inf();
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) sage_fwd_reference(ForwardParams p) {
    __shared__ ForwardShared s;
    const int qb = blockIdx.x, bh = blockIdx.y;
    const int bh_kv = kv_head_of(p.dims, bh);
    const bool smooth_q = p.flags & F_SMOOTH_Q;

    if (threadIdx.x < BLOCK_Q) {
        s.m[threadIdx.x] = neg_inf();
        s.l[threadIdx.x] = 0.0f;
    }
    if (smooth_q && threadIdx.x < HEAD_DIM)
        s.q_mean[threadIdx.x] = p.op.q_mean[((long)bh * p.dims.n_qblk + qb) * HEAD_DIM + threadIdx.x];
    float o_acc[O_PER_THREAD];
#pragma unroll
    for (int i = 0; i < O_PER_THREAD; ++i) o_acc[i] = 0.0f;
    __syncthreads();

    const int kb_end = key_block_end(p.dims, qb);
    for (int kb = 0; kb < kb_end; ++kb) {
        if (smooth_q && threadIdx.x < BLOCK_KV) {
            const int j = kb * BLOCK_KV + threadIdx.x;
            s.beta[threadIdx.x] = j < p.dims.n_k
                ? beta_of(s.q_mean, p.op.k + ((long)bh_kv * p.dims.n_k + j) * HEAD_DIM, p.op.k_mean + (long)bh_kv * HEAD_DIM)
                : 0.0f;
        }
        __syncthreads();
        const float sc = forward_scores(p, s, bh, bh_kv, qb, kb);
        __syncthreads();
        if (threadIdx.x < BLOCK_Q) forward_softmax_row(p, s, threadIdx.x, sc);
        __syncthreads();
        forward_pv(p, s, o_acc, bh_kv, kb);
        __syncthreads();
    }
    forward_store(p, s, o_acc, bh, qb);
}
