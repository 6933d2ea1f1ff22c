// Forward attention (ALGORITHM.md §4): one thread block per (query block of B_q = 64 rows,
// batch·query head); it walks the key blocks of B_kv = 128 keys with FlashAttention-2's online
// softmax in base 2. Design: scalar CUDA-core arithmetic (dp4a for INT8, FP32 for BF16), operands
// read from global memory through the caches, the 64 × 128 score/probability tile in shared memory.

// Mirrored by `ForwardParams` in src/forward.rs.
struct ForwardParams {
    ScoreOperands op;
    Transposed tr;
    const i8* v_hat;       // [B, Hkv, Nk, d]
    const float* v_scale;  // [B, Hkv, n_kblk]
    const u16* v;          // [B, Hkv, Nk, d] BF16
    u16* o;                // [B, Hq, Nq, d] BF16 output
    float* lse2;           // [B, Hq, Nq]
    float* lse;            // [B, Hq, Nq]
    Dims dims;
    int flags;
    float c_lambda;  // fl(c · log2 e)
    float ln2;       // FP32 ln 2
};
// Layout contract with src/forward.rs (which asserts the same size).
static_assert(sizeof(ForwardParams) == 240, "ForwardParams layout changed: update src/forward.rs");

#define O_PER_THREAD (BLOCK_Q * HEAD_DIM / THREADS)

struct ForwardShared {
    float tile[BLOCK_Q][BLOCK_KV];  // t, then p, then P̂ or bf16(p)
    float m[BLOCK_Q], l[BLOCK_Q], alpha[BLOCK_Q], p_scale[BLOCK_Q];
    float q_mean[HEAD_DIM];
    float beta[BLOCK_KV];
};

// Last key block any row of query block qb can see (exclusive bound), 0 if none.
__device__ __forceinline__ int key_block_end(const Dims& d, int qb) {
    if (!d.causal) return d.n_kblk;
    const int r_last = min((qb + 1) * BLOCK_Q, d.n_q) - 1;
    const int j_max = r_last + d.n_k - d.n_q;
    if (j_max < 0) return 0;
    return min(d.n_kblk, j_max / BLOCK_KV + 1);
}

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

extern "C" __global__ void __launch_bounds__(THREADS) sage_forward(ForwardParams p) {
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
// ---------------------------------------------------------------------------------------------
// Forward attention on tensor cores (ALGORITHM.md §4), the same computation as sage_forward: one
// thread block of 4 warps per (query block of 64 rows, batch·query head); warp w owns query rows
// 16w..16w+15 and walks the key blocks of 128 keys. S = Q Kᵀ with mma.sync (m16n8k32 INT8 or
// m16n8k16 BF16), online softmax in base 2 on the accumulator fragments (a row lives in the 4
// threads of a group), the P operand (P̂ per row per key block, or bf16(p)) staged in shared memory,
// O += P V with mma.sync, O in FP32 registers. Operands are gathered into fragments straight from
// global memory through the caches (views, common.cuh).

#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
#define S_TILES (BLOCK_KV / 8)  // 16 accumulator tiles of 16 × 8 per warp for S
#define O_TILES (HEAD_DIM / 8)  // 8 or 16 tiles for O

struct ForwardMmaShared {
    // Each warp's P operand, stored as the tensor cores read it: P̂ (INT8) or bf16(p).
    __attribute__((aligned(16))) i8 p8[MMA_WARPS][16][BLOCK_KV];
    __attribute__((aligned(16))) u16 p16[MMA_WARPS][16][BLOCK_KV];
    float q_mean[HEAD_DIM];
    float beta[BLOCK_KV];
};

// Per-row online-softmax state of the two rows (g, g + 8) a thread holds.
struct RowState {
    float m[2], l[2], alpha[2], p_scale[2];
};

// A warp's two rows before the first key block: running max −∞, sum 0, O accumulators 0.
__device__ __forceinline__ void start_rows(RowState& st, float (*o)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        st.m[h] = neg_inf();
        st.l[h] = 0.0f;
    }
#pragma unroll
    for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][e] = 0.0f;
}

// Max / sum over the 4 threads of a group (they hold one row between them).
__device__ __forceinline__ float group_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float group_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// S for this warp's 16 rows × 128 keys, as the factors a of the base-2 scores t = fl(a·sc)
// (score_factor; −∞ where masked); returns sc.
__device__ float mma_scores(const ForwardParams& p, const ForwardMmaShared& s, float (*t)[4], int bh, int bh_kv,
                            int qb, int kb, int row0) {
    const Dims& d = p.dims;
    const bool int8 = p.flags & F_QK, smooth_q = p.flags & F_SMOOTH_Q;
    const int key0 = kb * BLOCK_KV;
    const long q_off = (long)bh * d.n_q * HEAD_DIM, k_off = ((long)bh_kv * d.n_k + key0) * HEAD_DIM;
    const int n_rows = d.n_q - row0, n_keys = d.n_k - key0;
    // The warp's Q fragments are loaded once per key block and reused for all 16 key tiles.
    float sc_out = 1.0f;  // BF16 #1 (and Q-smoothing): t itself, not fused (§4)
    if (int8) {
        const View vq = view(p.op.q_hat + q_off + (long)row0 * HEAD_DIM, HEAD_DIM, 1, n_rows, HEAD_DIM);
        const View vk = view(p.op.k_hat + k_off, HEAD_DIM, 1, n_keys, HEAD_DIM);
        const float sc = __fmul_rn(__fmul_rn(p.op.q_scale[bh * d.n_qblk + qb], p.c_lambda),
                                   p.op.k_scale[bh_kv * d.n_kblk + kb]);
        u32 qa[HEAD_DIM / 32][4];
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 32; ++ks) frag_a_s8(qa[ks], ReadI8(), vq, 0, ks * 32);
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt) {
            int acc[4] = {0, 0, 0, 0};
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 32; ++ks) {
                u32 b[2];
                frag_b_s8(b, ReadI8(), vk, nt * 8, ks * 32);
                mma_s8(acc, qa[ks], b);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = (float)acc[e];
                if (smooth_q) v = __fadd_rn(__fmul_rn(v, sc), __fmul_rn(p.c_lambda, s.beta[nt * 8 + c_col(e)]));
                t[nt][e] = v;
            }
        }
        sc_out = smooth_q ? 1.0f : sc;
    } else {
        const View vq = view(p.op.q + q_off + (long)row0 * HEAD_DIM, HEAD_DIM, 1, n_rows, HEAD_DIM);
        const View vk = view(p.op.k + k_off, HEAD_DIM, 1, n_keys, HEAD_DIM);
        u32 qa[HEAD_DIM / 16][4];
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) frag_a_bf16(qa[ks], ReadBf16(), vq, 0, ks * 16);
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                u32 b[2];
                frag_b_bf16(b, ReadBf16(), vk, nt * 8, ks * 16);
                mma_bf16(acc, qa[ks], b);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) t[nt][e] = __fmul_rn(p.c_lambda, acc[e]);
        }
    }
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!visible(d, row0 + c_row(e), key0 + nt * 8 + c_col(e))) t[nt][e] = neg_inf();
    return sc_out;
}

// Online-softmax update of the thread's two rows (t: the factors a, sc: the scale of t = fl(a·sc);
// row max fl(max a · sc), p = exp2(fma(a, sc, −m_use)) on visible entries only, as
// forward_softmax_row); writes the P operand of #2 to the warp's tile.
__device__ void mma_softmax(const ForwardParams& p, float (*t)[4], RowState& st, i8 (*p8)[BLOCK_KV],
                            u16 (*p16)[BLOCK_KV], float sc) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: row g (elements 0, 1); h = 1: row g + 8 (2, 3)
        float mx = neg_inf();
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt) mx = fmaxf(mx, fmaxf(t[nt][2 * h], t[nt][2 * h + 1]));
        mx = group_max(mx);
        const float m_new = running_max(p.flags & F_QK, st.m[h], __fmul_rn(mx, sc));
        const float m_use = m_new == neg_inf() ? 0.0f : m_new;
        float sum = 0.0f, amax = 0.0f;
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
                const float pj = t[nt][e] == neg_inf() ? 0.0f : exp2_ftz(__fmaf_rn(t[nt][e], sc, -m_use));
                t[nt][e] = pj;
                sum = __fadd_rn(sum, pj);
                amax = fmaxf(amax, pj);
            }
        sum = group_sum(sum);
        amax = group_max(amax);  // the §4 group amax
        st.alpha[h] = exp2_ftz(__fsub_rn(st.m[h], m_use));
        st.l[h] = __fadd_rn(__fmul_rn(st.l[h], st.alpha[h]), sum);
        st.m[h] = m_new;
        const GroupScale g = group_scale(amax);
        st.p_scale[h] = g.scale;
        const bool int8 = p.flags & F_PV;
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
                if (int8) p8[c_row(e)][nt * 8 + c_col(e)] = (i8)quantize(t[nt][e], g.inv);
                else p16[c_row(e)][nt * 8 + c_col(e)] = f32_to_bf16(t[nt][e]);
            }
    }
}

// O = fl(O·α) + PV_block for the warp's 16 rows × d. The P fragments are loaded once; B(k = key,
// n = column c) is read from the transposed V̂ᵀ / Vᵀ, keys contiguous.
__device__ void mma_pv(const ForwardParams& p, const RowState& st, float (*o)[4], const i8 (*p8)[BLOCK_KV],
                       const u16 (*p16)[BLOCK_KV], int bh_kv, int kb) {
    const Dims& d = p.dims;
    const int key0 = kb * BLOCK_KV, n_keys = d.n_k - key0;
    const long t_off = (long)bh_kv * HEAD_DIM * d.n_kpad + key0;
    if (p.flags & F_PV) {
        const View vp = view(p8, BLOCK_KV, 1, 16, BLOCK_KV);
        const View vv = view(p.tr.v_hat_t + t_off, d.n_kpad, 1, HEAD_DIM, n_keys);
        const float s_v = p.v_scale[bh_kv * d.n_kblk + kb];
        u32 pa[BLOCK_KV / 32][4];
        frags_a_s8<BLOCK_KV>(pa, ReadI8(), vp, 0);
#pragma unroll
        for (int nt = 0; nt < O_TILES; ++nt) {
            int acc[4] = {0, 0, 0, 0};
            tile_s8_a<BLOCK_KV>(acc, pa, ReadI8(), vv, nt * 8);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[nt][e] = dequant_add(acc[e], st.p_scale[e >> 1], s_v, __fmul_rn(o[nt][e], st.alpha[e >> 1]));
        }
    } else {
        const View vp = view(p16, BLOCK_KV, 1, 16, BLOCK_KV);
        const View vv = view(p.tr.v_t + t_off, d.n_kpad, 1, HEAD_DIM, n_keys);
        u32 pa[BLOCK_KV / 16][4];
        frags_a_bf16<BLOCK_KV>(pa, ReadBf16(), vp, 0);
#pragma unroll
        for (int nt = 0; nt < O_TILES; ++nt) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_bf16_a<BLOCK_KV>(acc, pa, ReadBf16(), vv, nt * 8);
#pragma unroll
            for (int e = 0; e < 4; ++e) o[nt][e] = __fadd_rn(__fmul_rn(o[nt][e], st.alpha[e >> 1]), acc[e]);
        }
    }
}

// lse2 = m + log2 l (+ b_r after an INT8 #1), lse = fl(lse2·ln 2) of the thread's two rows; empty
// rows +∞. One thread of each quad writes (the quad shares its rows' state).
template <class RowOffset>
__device__ __forceinline__ void store_lse_rows(const ForwardParams& p, const RowState& st, int bh, int row0,
                                               RowOffset row_offset) {
    const Dims& d = p.dims;
    if ((threadIdx.x & 3) != 0) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + c_row(2 * h);
        if (r >= d.n_q) continue;
        const long row = (long)bh * d.n_q + r;
        float lse2 = pos_inf();
        if (st.l[h] != 0.0f) {
            lse2 = __fadd_rn(st.m[h], log2f(st.l[h]));
            if (p.flags & F_QK) lse2 = __fadd_rn(lse2, row_offset(h, row));
        }
        p.lse2[row] = lse2;
        p.lse[row] = st.l[h] != 0.0f ? __fmul_rn(lse2, p.ln2) : pos_inf();
    }
}
// b_r read where it is needed.
__device__ __forceinline__ void store_lse_rows(const ForwardParams& p, const RowState& st, int bh, int row0) {
    store_lse_rows(p, st, bh, row0, [&](int, long row) { return p.op.row_offset[row]; });
}

// O = fl(O · fl(1/l)) as BF16, lse2 (+ b_r after an INT8 #1), lse = fl(lse2·ln 2); empty rows: 0, +∞.
__device__ void mma_store(const ForwardParams& p, const RowState& st, float (*o)[4], int bh, int row0) {
    const Dims& d = p.dims;
    const float r_l[2] = {__frcp_rn(st.l[0]), __frcp_rn(st.l[1])};  // fl(1/l) once per row
#pragma unroll
    for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row0 + c_row(e);
            if (r >= d.n_q) continue;
            const float v = o_normalized(o[nt][e], st.l[e >> 1], r_l[e >> 1]);
            p.o[((long)bh * d.n_q + r) * HEAD_DIM + nt * 8 + c_col(e)] = f32_to_bf16(v);
        }
    store_lse_rows(p, st, bh, row0);
}

// The gathering path (any product mix): fragments straight from global memory, P staged per warp.
__device__ void forward_mma_gather(const ForwardParams& p, ForwardMmaShared& s) {
    const int qb = blockIdx.x, bh = blockIdx.y, warp = threadIdx.x >> 5;
    const int bh_kv = kv_head_of(p.dims, bh);
    const int row0 = qb * BLOCK_Q + warp * 16;
    const bool smooth_q = p.flags & F_SMOOTH_Q;
    if (smooth_q && threadIdx.x < HEAD_DIM)
        s.q_mean[threadIdx.x] = p.op.q_mean[((long)bh * p.dims.n_qblk + qb) * HEAD_DIM + threadIdx.x];

    RowState st;
    float o[O_TILES][4];
    start_rows(st, o);

    const int kb_end = key_block_end(p.dims, qb);
    for (int kb = 0; kb < kb_end; ++kb) {
        __syncthreads();  // q_mean written / the previous block's β no longer read
        if (smooth_q && threadIdx.x < BLOCK_KV) {
            const int j = kb * BLOCK_KV + threadIdx.x;
            s.beta[threadIdx.x] = j < p.dims.n_k
                ? beta_of(s.q_mean, p.op.k + ((long)bh_kv * p.dims.n_k + j) * HEAD_DIM, p.op.k_mean + (long)bh_kv * HEAD_DIM)
                : 0.0f;
        }
        __syncthreads();
        float t[S_TILES][4];
        const float sc = mma_scores(p, s, t, bh, bh_kv, qb, kb, row0);
        mma_softmax(p, t, st, s.p8[warp], s.p16[warp], sc);
        __syncwarp();
        mma_pv(p, st, o, s.p8[warp], s.p16[warp], bh_kv, kb);
        __syncwarp();  // the tile is rewritten by the next key block
    }
    mma_store(p, st, o, bh, row0);
}

// ---------------------------------------------------------------------------------------------
// The staged INT8 path (#1 and #2 both INT8, the sagebwd / int8-all presets): the same arithmetic,
// with the K̂ tile [128 keys][d] and the V̂ᵀ tile [d][128 keys] of each key block staged in shared
// memory by cp.async (16-byte, coalesced, double-buffered: block kb + 1 loads while kb computes),
// B fragments read with ldmatrix (XOR-swizzled 16-byte chunks: conflict-free), Q̂ fragments in
// registers for the whole key loop, and P̂ kept in registers as the A operand of P·V.
//
// Key permutation: S column n of n-tile nt holds key kmap(nt, n) = 16·(nt/2) + 2·(nt%2) + 4·(n/2) +
// n%2 (the K̂ rows are fed to ldmatrix in that order). Then the bytes a thread quantizes from its
// accumulators (columns 2t, 2t+1 of n-tiles 4s..4s+3) are keys 32s + 4t..4t+3 and 32s + 16 + 4t..
// 4t+3, exactly its m16n8k32 A fragment of k-step s against V̂ᵀ in natural key order: no shuffles.
// Every per-key operation (mask, β, max, quantization) uses the permuted index; INT32 sums are
// exact, so only the order of the FP32 row sum l inside a thread changes (not fixed by §4).

#define FK_CH (HEAD_DIM / 16)                 // 16-byte chunks per K̂ row
#define FK_TILE (BLOCK_KV * HEAD_DIM)          // bytes of one K̂ (or V̂ᵀ) tile
#define FAST_SMEM_BYTES (4 * FK_TILE + 4 * (BLOCK_KV + HEAD_DIM))
#define GATHER_SMEM_BYTES ((int)sizeof(ForwardMmaShared))

// Physical 16-byte chunk of chunk c of K̂ row `key` (read in the permuted key order) / of V̂ᵀ row
// `dd` (natural order): the swizzles of common.cuh.
__device__ __forceinline__ int k_swz(int key, int c) { return swz_i8_permuted(key, c); }
__device__ __forceinline__ int v_swz(int dd, int c) { return swz_rows8(dd, c); }

// quantize(x, inv) of common.cuh for 0 ≤ x ≤ amax with inv = fl(127/amax) (P̂ of §4), with the
// result in the low byte of the returned bits: fma(x, inv, 2^23) rounds the exact x·inv + 2^23 once,
// to the nearest integer, ties to even (ulp 1 on [2^23, 2^24), 2^23 even), as 2^23 + n (§2.2: the
// product is not rounded first). The clamp to [−127, 127] can never act here: x·inv ≤ amax·(127/amax)
// (1 + 2^-24) = 127(1 + 2^-24) < 127.5, so n ≤ 127 (and x ≥ 0 gives n ≥ 0); it is left out.
__device__ __forceinline__ u32 quant_pos_bits(float x, float inv) {
    return __float_as_uint(__fmaf_rn(x, inv, 8388608.0f));
}
struct QuantPosBits {
    __device__ __forceinline__ u32 operator()(float x, float inv) const { return quant_pos_bits(x, inv); }
};

// Issues the copies of key block kb into buffer `buf` (all MMA_THREADS threads).
__device__ __forceinline__ void fast_load(const ForwardParams& p, u32 ks, u32 vs, int bh_kv, int kb, int buf) {
    const Dims& d = p.dims;
    const int key0 = kb * BLOCK_KV;
    const i8* kg = p.op.k_hat + ((long)bh_kv * d.n_k + key0) * HEAD_DIM;
    const u32 kdst = ks + buf * FK_TILE;
#pragma unroll
    for (int i = threadIdx.x; i < BLOCK_KV * FK_CH; i += MMA_THREADS) {
        const int key = i / FK_CH, c = i % FK_CH;
        const bool valid = key0 + key < d.n_k;
        cp_async16(kdst + key * HEAD_DIM + k_swz(key, c) * 16, valid ? kg + key * HEAD_DIM + c * 16 : p.op.k_hat, valid);
    }
    // V̂ᵀ rows are n_kpad long: keys past n_k (read as garbage) meet P̂ = 0.
    const i8* vg = p.tr.v_hat_t + (long)bh_kv * HEAD_DIM * d.n_kpad + key0;
    const u32 vdst = vs + buf * FK_TILE;
#pragma unroll
    for (int i = threadIdx.x; i < HEAD_DIM * (BLOCK_KV / 16); i += MMA_THREADS) {
        const int dd = i / (BLOCK_KV / 16), c = i % (BLOCK_KV / 16);
        cp_async16(vdst + dd * BLOCK_KV + v_swz(dd, c) * 16, vg + (long)dd * d.n_kpad + c * 16, true);
    }
}

// The thread's two rows of a key block (h = 0: elements 0, 1 of each tile; h = 1: elements 2, 3):
// the row max over the quad into mx (a tree: exact in any order), and the online-softmax update
// m = max(m, rowmax), α = exp2(fl(m_old − m_use)), where m_use (0 for a row masked so far) is what
// the exponentials subtract. FUSED (INT8 #1, §4): t holds the score factors a of t = fl(a·sc), mx
// their max, and the row max of the scores is fl(mx·sc) (rounding is monotone, sc ≥ 0).
// thread_row_max: the thread's part, quad_max_update the rest.
__device__ __forceinline__ void thread_row_max(const float (*t)[4], float* mx) {
    float mq[4][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            mq[k][h] = fmaxf(fmaxf(t[k][2 * h], t[k][2 * h + 1]), fmaxf(t[k + 4][2 * h], t[k + 4][2 * h + 1]));
#pragma unroll
        for (int k = 0; k < 4; ++k)
            mq[k][h] = fmaxf(mq[k][h], fmaxf(fmaxf(t[k + 8][2 * h], t[k + 8][2 * h + 1]),
                                             fmaxf(t[k + 12][2 * h], t[k + 12][2 * h + 1])));
        mx[h] = fmaxf(fmaxf(mq[0][h], mq[1][h]), fmaxf(mq[2][h], mq[3][h]));
    }
}
// The max of the thread's row maxima mx[0], mx[1] over its quad (the 4 lanes of each row).
__device__ __forceinline__ void quad_fmax(float* mx) {
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        const float a0 = __shfl_xor_sync(0xffffffffu, mx[0], o2), a1 = __shfl_xor_sync(0xffffffffu, mx[1], o2);
        mx[0] = fmaxf(mx[0], a0);
        mx[1] = fmaxf(mx[1], a1);
    }
}
// The running max m, the m_use of the exponentials and the rescale α from the rows' maxima mx.
template <bool FUSED>
__device__ __forceinline__ void row_max_commit(RowState& st, const float* mx, float* m_use, float sc) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m_new = running_max(FUSED, st.m[h], FUSED ? __fmul_rn(mx[h], sc) : mx[h]);
        m_use[h] = m_new == neg_inf() ? 0.0f : m_new;
        st.alpha[h] = exp2_ftz(__fsub_rn(st.m[h], m_use[h]));
        st.m[h] = m_new;
    }
}
template <bool FUSED>
__device__ __forceinline__ void quad_max_update(RowState& st, float* mx, float* m_use, float sc) {
    quad_fmax(mx);
    row_max_commit<FUSED>(st, mx, m_use, sc);
}
template <bool FUSED>
__device__ __forceinline__ void row_max_update(float (*t)[4], RowState& st, float* mx, float* m_use, float sc) {
    thread_row_max(t, mx);
    quad_max_update<FUSED>(st, mx, m_use, sc);
}

// The exponentials of staged_softmax after row_max_update: p = exp2(fl(t − m_use)), FUSED (INT8
// #1, §4) p = exp2(fma(a, sc, −m_use)) (one rounding), into t, the row sums (and with AMAX the row
// maxima of p into amax) over the quad, l = fl(fl(l·α) + sum).
// sch: the scale of each row half (the same value in both but for wsp17_softmax_p_hat's data dependency).
template <bool AMAX, bool FUSED>
__device__ __forceinline__ void softmax_exp_sum_rows(float (*t)[4], RowState& st, const float* m_use, float* amax, const float* sch) {
    float sum[2];
    float ps[4][2], pm[4][2];
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int h = 0; h < 2; ++h) ps[k][h] = pm[k][h] = 0.0f;
    // exp2_ftz (§4) is the bare MUFU.EX2: one path for every argument, no subnormal fix-up to skip.
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = e >> 1, k = nt & 3;
            // A masked t = −∞ needs no select: fl(−∞ − m_use) = −∞ and exp2_ftz(−∞) = +0; FUSED: sc > 0
            // in a masked tile (mask_permuted), so fma(−∞, sc, −m_use) = −∞.
            const float pj = exp2_ftz(FUSED ? __fmaf_rn(t[nt][e], sch[h], -m_use[h]) : __fsub_rn(t[nt][e], m_use[h]));
            t[nt][e] = pj;
            ps[k][h] = __fadd_rn(ps[k][h], pj);
            if (AMAX) pm[k][h] = fmaxf(pm[k][h], pj);
        }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sum[h] = __fadd_rn(__fadd_rn(ps[0][h], ps[1][h]), __fadd_rn(ps[2][h], ps[3][h]));
        if (AMAX) amax[h] = fmaxf(fmaxf(pm[0][h], pm[1][h]), fmaxf(pm[2][h], pm[3][h]));
    }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        const float s0 = __shfl_xor_sync(0xffffffffu, sum[0], o2), s1 = __shfl_xor_sync(0xffffffffu, sum[1], o2);
        sum[0] = __fadd_rn(sum[0], s0);
        sum[1] = __fadd_rn(sum[1], s1);
        if (AMAX) {
            const float a0 = __shfl_xor_sync(0xffffffffu, amax[0], o2), a1 = __shfl_xor_sync(0xffffffffu, amax[1], o2);
            amax[0] = fmaxf(amax[0], a0);  // the §4 group amax (the max p)
            amax[1] = fmaxf(amax[1], a1);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) st.l[h] = __fadd_rn(__fmul_rn(st.l[h], st.alpha[h]), sum[h]);
}
template <bool AMAX, bool FUSED>
__device__ __forceinline__ void softmax_exp_sum(float (*t)[4], RowState& st, const float* m_use, float* amax, float sc) {
    const float sch[2] = {sc, sc};
    softmax_exp_sum_rows<AMAX, FUSED>(t, st, m_use, amax, sch);
}

// Online softmax of the staged paths (as mma_softmax), on the warp's S accumulators t[S_TILES][4]
// (base-2 scores, −∞ where masked; FUSED, the INT8 forward: the factors a = float(acc) of t =
// fl(a·sc)), any key order: the thread's two rows (h = 0: row g, elements 0, 1; h = 1: row g + 8,
// elements 2, 3) together, so that their dependent chains interleave; the row max by a tree (exact
// in any order); the row sum in 4 partial sums per thread (the order of this FP32 sum is not fixed
// by §4). Leaves p = exp2(t − m_new) (FUSED: exp2(fma(a, sc, −m_new))) in t and updates m, α, l in
// st. With AMAX also gives each row's max p, the §4 group amax of P̂.
template <bool AMAX, bool FUSED>
__device__ __forceinline__ void staged_softmax(float (*t)[4], RowState& st, float* amax, float sc) {
    float mx[2], m_use[2];
    row_max_update<FUSED>(t, st, mx, m_use, sc);
    softmax_exp_sum<AMAX, FUSED>(t, st, m_use, amax, sc);
}

// Key (within the block) of S column e of n-tile nt for this thread, in the permuted order kmap.
__device__ __forceinline__ int permuted_key(int nt, int e) {
    return (nt >> 1) * 16 + 2 * (nt & 1) + 4 * (threadIdx.x & 3) + (e & 1);
}

// The sc = 0 rule of the permuted masks (mask_tile, below): a masked tile of an all-zero Q̂ or K̂ block takes a = 0, sc = 1.
__device__ __forceinline__ void masked_zero_scale(float (*t)[4], float& sc) {
    if (sc == 0.0f) {
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) t[nt][e] = 0.0f;
        sc = 1.0f;
    }
}

// −∞ on the masked entries of the warp's 16 rows (from row0) × 128 keys (from key0), the keys in
// the permuted order kmap (INT8 paths) or natural (BF16 paths); only boundary tiles (sequence ends,
// causal diagonal) pay for it.
// Natural order: a row's visible keys are a prefix, so each of the thread's two rows gets one
// limit per tile, relative to the thread's first key column, and an entry costs one compare of its
// compile-time column offset with that limit and one select. The per-entry visible() let ptxas
// pack the compares into predicate bitmasks (P2R, then a LOP3 per entry) and the d = 64 causal BF16
// forward swung by 12 % from one build to the next (fpafwd3); this form is 26 % fewer instructions
// in fpp3s and 17 % faster at the training shape (fwd9).
// Permuted order: kept per entry, as aeae31c: the prefix form (limit from the thread's first column
// + 4·(lane % 4)) made the INT8 `ws3` forward 3.5 % faster at d = 64 causal N = 1k but 2.4 % slower
// at N = 4k (ptxas scheduled the whole key loop differently; fwd9's first call).
// The permuted (INT8 forward) callers mask the score factors a (t = fl(a·sc), §4): a masked a = −∞
// must meet sc > 0 in fma(a, sc, −m) (−∞·0 is NaN). sc = 0 (an all-zero Q̂ or K̂ block) makes every
// t of the tile ±0: a masked tile then takes a = 0, sc = 1 instead, the same t = 0 and the same
// fma(0, 1, −m) = −m. Tiles without a mask see no −∞ and keep sc = 0 (fma(a, 0, −m) = −m). The
// natural-order (BF16) callers mask t and pass a dummy sc.
__device__ __forceinline__ bool tile_needs_mask(const Dims& d, int row0, int key0) {
    const int last_row = row0 + 15, last_key = key0 + BLOCK_KV - 1;
    return last_key >= d.n_k || last_row >= d.n_q || (d.causal && last_key > row0 + (d.n_k - d.n_q));
}
template <bool PERMUTED>
__device__ __forceinline__ void mask_tile(const Dims& d, float (*t)[4], int row0, int key0, float& sc,
                                          float fill = neg_inf()) {
    if constexpr (!PERMUTED) {  // the BF16 forward: main's code, so that its SASS stays as it was
        const int last_row = row0 + 15, last_key = key0 + BLOCK_KV - 1;
        const bool need_mask = last_key >= d.n_k || last_row >= d.n_q || (d.causal && last_key > row0 + (d.n_k - d.n_q));
        if (!need_mask) return;
        const int col0 = key0 + 2 * (threadIdx.x & 3);  // key of entry (nt, e) = col0 + 8·nt + (e & 1) (c_col)
        const int limit[2] = {visible_end(d, row0 + c_row(0)) - col0, visible_end(d, row0 + c_row(2)) - col0};
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (nt * 8 + (e & 1) >= limit[e >> 1]) t[nt][e] = neg_inf();
        return;
    }
    if (!tile_needs_mask(d, row0, key0)) return;
    masked_zero_scale(t, sc);
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!visible(d, row0 + c_row(e), key0 + permuted_key(nt, e))) t[nt][e] = fill;
}
__device__ __forceinline__ void mask_permuted(const Dims& d, float (*t)[4], int row0, int key0, float& sc) {
    mask_tile<true>(d, t, row0, key0, sc);
}

// P̂ of the warp's S tile: the exponentials t quantized with the group inverses inv of its two row halves into
// the A fragments pa of the P̂V product (quant_quad).
__device__ __forceinline__ void quantize_p_tile(float (*t)[4], const float* inv, u32 (*pa)[4]) {
#pragma unroll
    for (int s = 0; s < BLOCK_KV / 32; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) pa[s][2 * half + h] = quant_quad(t, 4 * s + 2 * half, h, inv[h], QuantPosBits());
}

// Online softmax (staged_softmax) of the permuted score factors t (scale sc), then P̂ of §4 (per row
// and key block, its scale in st.p_scale) packed straight into the m16n8k32 A fragments of P·V in
// natural key order.
__device__ __forceinline__ void softmax_p_hat(float (*t)[4], RowState& st, u32 (*pa)[4], float sc) {
    float amax[2], inv[2];
    staged_softmax<true, true>(t, st, amax, sc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const GroupScale g = group_scale(amax[h]);
        st.p_scale[h] = g.scale;
        inv[h] = g.inv;
    }
    quantize_p_tile(t, inv, pa);
}

// O = fma(float(acc), fl(s_P·s_V), fl(O·α)) (§2.3) for one 16 × 8 d-tile (dq0, dq1: fl(s_P·s_V) of the
// thread's rows g, g + 8); float(acc) by the exact two-instruction trick.
__device__ __forceinline__ void o_update(float* o4, const int* acc4, const RowState& st, float dq0, float dq1) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
        o4[e] = __fmaf_rn(i2f_exact(acc4[e]), e < 2 ? dq0 : dq1, __fmul_rn(o4[e], st.alpha[e >> 1]));
}

// SMOOTH_Q is a template parameter: as a run-time flag the compiler predicated its per-score
// β load and multiply-add (~250 issued instructions per warp per key block even when off).
template <bool SMOOTH_Q>
__device__ void forward_mma_fast(const ForwardParams& p, unsigned char* smem) {
    const Dims& d = p.dims;
    const int qb = blockIdx.x, bh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh_kv = kv_head_of(d, bh);
    const int row0 = qb * BLOCK_Q + warp * 16;
    const bool smooth_q = SMOOTH_Q;
    const float c_lambda = p.c_lambda;
    const u32 ks = smem_addr(smem), vs = ks + 2 * FK_TILE;
    float* beta = (float*)(smem + 4 * FK_TILE);
    float* q_mean = beta + BLOCK_KV;

    const int kb_end = key_block_end(d, qb);
    if (kb_end > 0) fast_load(p, ks, vs, bh_kv, 0, 0);
    cp_async_commit();

    if (smooth_q && threadIdx.x < HEAD_DIM)
        q_mean[threadIdx.x] = p.op.q_mean[((long)bh * d.n_qblk + qb) * HEAD_DIM + threadIdx.x];
    // The warp's Q̂ fragments, once for the whole key loop (rows past n_q read as 0).
    u32 qa[HEAD_DIM / 32][4];
    {
        const View vq = view(p.op.q_hat + ((long)bh * d.n_q + row0) * HEAD_DIM, HEAD_DIM, 1, d.n_q - row0, HEAD_DIM);
#pragma unroll
        for (int s = 0; s < HEAD_DIM / 32; ++s) frag_a_s8(qa[s], ReadI8(), vq, 0, s * 32);
    }
    const float sq = __fmul_rn(p.op.q_scale[bh * d.n_qblk + qb], p.c_lambda);

    RowState st;
    float o[O_TILES][4];
    start_rows(st, o);

    // ldmatrix row addresses of this lane: matrix mi = lane / 8, row r = lane % 8.
    const int mi = lane >> 3, r = lane & 7, tq = lane & 3;
    const int krow = 4 * (r >> 1) + (r & 1);  // kmap(nt, r) − 16·(nt/2) − 2·(nt%2)
#if HEAD_DIM == 128
    const int kf = r;  // k_swz's XOR term for every row kmap(·, r)
#else
    const int kf = r >> 1;
#endif
    if (smooth_q) __syncthreads();  // q_mean written

    for (int kb = 0; kb < kb_end; ++kb) {
        const int buf = kb & 1, key0 = kb * BLOCK_KV;
        if (kb + 1 < kb_end) fast_load(p, ks, vs, bh_kv, kb + 1, buf ^ 1);
        cp_async_commit();
        if (smooth_q && threadIdx.x < BLOCK_KV) {
            const int j = key0 + threadIdx.x;
            beta[threadIdx.x] = j < d.n_k
                ? beta_of(q_mean, p.op.k + ((long)bh_kv * d.n_k + j) * HEAD_DIM, p.op.k_mean + (long)bh_kv * HEAD_DIM)
                : 0.0f;
        }
        cp_async_wait<1>();  // this thread's copies of block kb are done
        __syncthreads();     // everyone's copies (and β) are visible

        // S = Q̂ K̂ᵀ (INT32, exact) → the score factors a = float(acc) (t = fl(a·sc), §4), permuted
        // key order; with Q-smoothing t itself (β added) and sc = 1: the unfused fl(t − m).
        float sc = __fmul_rn(sq, p.op.k_scale[bh_kv * d.n_kblk + kb]);
        const u32 kbase = ks + buf * FK_TILE + krow * HEAD_DIM;
        float t[S_TILES][4];
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt) {
            const u32 rowa = kbase + ((nt >> 1) * 16 + 2 * (nt & 1)) * HEAD_DIM;
            int acc[4] = {0, 0, 0, 0};
#pragma unroll
            for (int cg = 0; cg < FK_CH / 4; ++cg) {
                u32 b[4];
                ldmatrix_x4(b, rowa + (((cg * 4 + mi) ^ kf) << 4));
                mma_s8(acc, qa[2 * cg], b);
                mma_s8(acc, qa[2 * cg + 1], b + 2);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = (nt >> 1) * 16 + 2 * (nt & 1) + 4 * tq + (e & 1);
                // I2F here (one issue slot; the conversion pipe has room for these 64 per key
                // block), the two-instruction exact trick in the P·V epilogue.
                float v = (float)acc[e];
                if (smooth_q) v = __fadd_rn(__fmul_rn(v, sc), __fmul_rn(c_lambda, beta[key]));
                t[nt][e] = v;
            }
        }
        if (smooth_q) sc = 1.0f;
        mask_permuted(d, t, row0, key0, sc);
        // Online softmax (staged_softmax), P̂ packed into A fragments.
        u32 pa[BLOCK_KV / 32][4];
        softmax_p_hat(t, st, pa, sc);
        // O = fma(float(acc), fl(s_P·s_V), fl(O·α)) per d-tile (§2.3).
        const float s_v = p.v_scale[bh_kv * d.n_kblk + kb];
        const float dq0 = __fmul_rn(st.p_scale[0], s_v), dq1 = __fmul_rn(st.p_scale[1], s_v);  // fl(s_P·s_V)
        const u32 vbase = vs + buf * FK_TILE + r * BLOCK_KV;
#pragma unroll
        for (int nd = 0; nd < O_TILES; ++nd) {
            const u32 rowa = vbase + nd * 8 * BLOCK_KV;
            int acc[4] = {0, 0, 0, 0};
#pragma unroll
            for (int cg = 0; cg < BLOCK_KV / 64; ++cg) {
                u32 b[4];
                ldmatrix_x4(b, rowa + (((cg * 4 + mi) ^ r) << 4));
                mma_s8(acc, pa[2 * cg], b);
                mma_s8(acc, pa[2 * cg + 1], b + 2);
            }
            o_update(o[nd], acc, st, dq0, dq1);
        }
        __syncthreads();  // buffer `buf` and β are rewritten next iteration
    }
    cp_async_wait<0>();
    mma_store(p, st, o, bh, row0);
}

// ---------------------------------------------------------------------------------------------
// The wgmma INT8 helpers (sm_90a; #1 and #2 INT8 without Q-smoothing) of the warp-specialized kernels below:
// the staged INT8 path's arithmetic on Hopper's warpgroup tensor-core instruction. Warpgroup w takes one query
// block of 64 rows, its warp i rows 16i..16i+15, so each thread holds exactly the fragments of the mma.sync path:
// the S accumulator of wgmma m64n128k32 is the 16 n-tiles × 4 values t[nt][e] of a warp, and its A operand
// (from registers) is the m16n8k32 A layout. Hence:
// - S = Q̂ K̂ᵀ: A = the warpgroup's Q̂ tile [64 rows][d] and B = the K̂ tile [128 keys][d], both in
//   shared memory, K-major (d contiguous), through descriptors. The K̂ rows are stored in the permuted key order
//   kmap (row 8nt + n holds key kmap(nt, n)), so the accumulator comes out permuted exactly as in the
//   staged path and P̂ packs into A fragments with no shuffle (softmax_p_hat).
// - O += P̂ V̂: A = P̂ (registers), B = the V̂ᵀ tile [d][128 keys], K-major (keys contiguous).
// Tiles are 1024-byte aligned in the hardware's swizzled layout (128-byte rows: 128-byte swizzle;
// the 64-byte K̂ rows at d = 64: 64-byte swizzle).
// (The first wgmma forward, one or two warpgroups per block without a producer, `SAGEBWD_FORWARD_WGMMA=pipe`,
// `pipe2`, `simple`, is in the history before session 21: the warp-specialized kernels replaced it in fwd3.)

#define WG_THREADS 128                     // one warpgroup
#define WG_TILE (BLOCK_KV * HEAD_DIM)       // bytes of one K̂ or V̂ᵀ tile (a multiple of 1024)
#define WG_Q_TILE (BLOCK_Q * HEAD_DIM)      // bytes of one warpgroup's Q̂ tile

#ifdef SAGE_WGMMA
// Row of the permuted K̂ tile that holds key `key` (inverse of kmap: key = 16a + 4b + 2c + e is
// column n = 2b + e of n-tile nt = 2a + c, i.e. row 8nt + n).
__device__ __forceinline__ int permuted_row(int key) {
    return (key & ~15) | (((key >> 1) & 1) << 3) | (((key >> 2) & 3) << 1) | (key & 1);
}

// Issues S = Q̂ K̂ᵀ (the warpgroup's 64 rows × 128 permuted keys) into acc, one commit group.
__device__ __forceinline__ void wg_issue_scores(int (&acc)[64], u32 qt, u32 kt) {
    const u64 qdesc = kmajor_desc(qt, HEAD_DIM), kdesc = kmajor_desc(kt, HEAD_DIM);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < HEAD_DIM / 32; ++s) wgmma_s8_ss_n128(acc, qdesc + 2 * s, kdesc + 2 * s, s);
    wgmma_commit();
}

// Issues acc = P̂ V̂ (64 rows × d) from the P̂ fragments pa and the V̂ᵀ tile at vt, one commit group.
__device__ __forceinline__ void wg_issue_pv(int (&acc)[HEAD_DIM / 2], const u32 (*pa)[4], u32 vt) {
    const u64 desc = kmajor_desc(vt, BLOCK_KV);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < BLOCK_KV / 32; ++s) {
#if HEAD_DIM == 128
        wgmma_s8_rs_n128(acc, pa[s], desc + 2 * s, s);
#else
        wgmma_s8_rs_n64(acc, pa[s], desc + 2 * s, s);
#endif
    }
    wgmma_commit();
}

// The score factors a = float(acc) of the finished S accumulators (base-2 scores t = fl(a·sc), §4),
// masked where needed (which may set sc = 1, mask_tile).
__device__ __forceinline__ void wg_scores(const Dims& d, float (*t)[4], const int (&acc)[64], float& sc, int row0, int key0) {
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) t[nt][e] = (float)acc[4 * nt + e];
    mask_permuted(d, t, row0, key0, sc);
}

#endif  // SAGE_WGMMA

// ---------------------------------------------------------------------------------------------
// Warp-specialized wgmma INT8 forward (sm_90a; fwd3): the helpers above with the copies moved out of the
// consumers' issue slots. Built first as a kernel of one block per query-block pair (`sage_forward_ws`, removed in
// session 21: the persistent kernels below have been the default at every shape since session 16); its ring, loads
// and consumer tile serve them and the BF16 kernels. A block of 3 warpgroups (384 threads) owns 2 query blocks
// (128 rows) at a time:
// - warpgroup 0, the producer (setmaxnreg 24): K̂ tiles by cp.async in the permuted key order
//   (a TMA box cannot express that order for a key count that is not a multiple of 16 without
//   reading past the end of K̂; cp.async zero-fills keys ≥ n_k), V̂ᵀ tiles by TMA (one thread, a
//   2-D tensor map over [B·H_kv·d rows][n_kpad keys], 128-byte swizzle = the wgmma layout), Q̂ of
//   both query blocks, into a ring of stages. Stage s is "full" (mbarrier, 128
//   producer arrivals + the TMA's byte count) once this thread's cp.async group has landed and
//   been fenced for the async proxy, "empty" (8 arrivals: each consumer warp) once both consumer
//   warpgroups' wgmmas have read it. The producer completes stage kb after issuing stage kb + 1,
//   so two stages are in flight; the consumers are never blocked by a barrier of the whole block.
// - warpgroups 1, 2, the consumers (setmaxnreg 240): query block w of the pair; S(kb + 1) issued before the
//   O update of block kb, so that it runs meanwhile. With PINGPONG (FA3), named barriers make the two warpgroups issue
//   their wgmmas in turn, so one warpgroup's softmax runs while the other's products run.
// - EARLY_AMAX: the P̂ group amax as exp2(fma(a_max, sc, −m_new)) (§4) before the exponentials, so
//   the two IEEE divisions of its scale run beside them instead of after a max over 64 values and
//   two shuffles; the quantizer needs no clamp to 127 (exp2_ftz is monotone on [−∞, 16], tested
//   exhaustively: no p exceeds that amax).
// - The K̂/V̂ᵀ scales of the next block are loaded a block ahead, and the P̂V
//   accumulators convert to FP32 by one I2FP.

#define WS_THREADS 384
#define WS_BARS 2                   // named barriers 1, 2: the consumers' ping-pong
// A CUtensorMap (128 bytes, 64-byte aligned) as the kernel receives it: src/tma.rs encodes it.
struct __align__(64) TmaMapParam {
    unsigned long long words[16];
};

#ifdef SAGE_WGMMA
// Shared-memory addresses of a warp-specialized layout: the Q tile(s) of both query blocks
// (Q_BYTES), rings of STAGES K and V tiles (TILE bytes each), then STAGES full and STAGES empty
// mbarriers (8 B each); the first tile 1024-aligned (the swizzled layouts need it).
template <int Q_BYTES, int TILE, int STAGES>
struct WsRing {
    static constexpr int kStages = STAGES;
    static constexpr int kSmemBytes = Q_BYTES + 2 * STAGES * TILE + 16 * STAGES + 1024;
    u32 q, k, v, full, empty;
    __device__ __forceinline__ WsRing(unsigned char* smem) {
        q = (smem_addr(smem) + 1023u) & ~1023u;
        k = q + Q_BYTES;
        v = k + STAGES * TILE;
        full = v + STAGES * TILE;
        empty = full + 8 * STAGES;
    }
    __device__ __forceinline__ u32 k_stage(int s) const { return k + s * TILE; }
    __device__ __forceinline__ u32 v_stage(int s) const { return v + s * TILE; }
    __device__ __forceinline__ u32 full_bar(int s) const { return full + 8 * s; }
    __device__ __forceinline__ u32 empty_bar(int s) const { return empty + 8 * s; }
    // Consumers: blocks until key block kb's stage is loaded.
    __device__ __forceinline__ void wait_full(int kb) const { mbar_wait(full_bar(kb % STAGES), (kb / STAGES) & 1); }
    // The mbarriers (one thread): "full" completes after `full_count` arrivals (+ the TMA bytes),
    // "empty" after one arrival per consumer warp (8).
    __device__ __forceinline__ void init(u32 full_count) const {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar(s), full_count);
            mbar_init(empty_bar(s), 8);
        }
        fence_mbar_init();
    }
    // Producer: for each key block, waits until its stage is free (read by every consumer warp the
    // previous time round), then lets fill(kb, s) load it.
    template <class Fill>
    __device__ __forceinline__ void produce(int cta_end, Fill fill) const {
        for (int kb = 0; kb < cta_end; ++kb) {
            const int s = kb % STAGES;
            if (kb >= STAGES) mbar_wait(empty_bar(s), ((kb / STAGES) - 1) & 1);
            fill(kb, s);
        }
    }
};

// K̂ rows of key block kb, permuted and swizzled into the stage at kt (128 producer threads, tid).
__device__ __forceinline__ void ws_load_k(const ForwardParams& p, u32 kt, int bh_kv, int kb, int tid) {
    const Dims& d = p.dims;
    const int key0 = kb * BLOCK_KV;
    const i8* kg = p.op.k_hat + ((long)bh_kv * d.n_k + key0) * HEAD_DIM;
#pragma unroll
    for (int i = tid; i < BLOCK_KV * FK_CH; i += WG_THREADS) {
        const int key = i / FK_CH, c = i % FK_CH;
        const bool valid = key0 + key < d.n_k;
        const u32 off = permuted_row(key) * HEAD_DIM + c * 16;
        cp_async16(kt + swizzled_offset(off, HEAD_DIM), valid ? kg + key * HEAD_DIM + c * 16 : p.op.k_hat, valid);
    }
}

// Q̂ rows r0.. of NQ query blocks (rows past n_q zero-filled).
template <int NQ>
__device__ __forceinline__ void ws_load_q_rows(const ForwardParams& p, u32 qt, int bh, int r0, int tid) {
    const Dims& d = p.dims;
    const i8* qg = p.op.q_hat + ((long)bh * d.n_q + r0) * HEAD_DIM;
#pragma unroll
    for (int i = tid; i < NQ * BLOCK_Q * FK_CH; i += WG_THREADS) {
        const int row = i / FK_CH, c = i % FK_CH;
        const bool valid = r0 + row < d.n_q;
        cp_async16(qt + swizzled_offset(row * HEAD_DIM + c * 16, HEAD_DIM), valid ? qg + row * HEAD_DIM + c * 16 : p.op.q_hat,
                   valid);
    }
}
// Q̂ rows of the NQ query blocks of this thread block.

// This thread's cp.async group of a stage has landed: fence it for the wgmma (async proxy) and arrive.
__device__ __forceinline__ void ws_complete_stage(u32 full_bar) {
    fence_proxy_async();
    mbar_arrive(full_bar);
}



// P̂ with the group amax known before the exponentials (EARLY_AMAX above); otherwise softmax_p_hat.
// The quantizer needs no clamp to 127 (QuantPosBits): exp2_ftz is monotone on [−∞, 16] (the fused
// argument exceeds 0 by at most the lazy max's slack of 8 and two roundings; sagebwd-gpu-check's
// exhaustive ex2 self-test), so every p of the row is ≤ the amax computed here, and x·inv rounds to ≤ 127 exactly as in softmax_p_hat (sage64b).
// BRANCHLESS (fwd14, the persistent kernel): the group scales by div127_rn and inv127_rn (common.cuh; no
// branch), the same bits as group_scale.
// softmax_p_hat_early_mx: the same with the thread's row maxima mx (before the quad reduction) given
// (fwd16: the persistent kernel takes them from its integer row max).
template <bool BRANCHLESS = false>
__device__ __forceinline__ void softmax_p_hat_early_mx(float (*t)[4], RowState& st, u32 (*pa)[4], float sc, float* mx) {
    float m_use[2], inv[2];
    quad_max_update<true>(st, mx, m_use, sc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // max_j exp2(fma(a_j, sc, −m_use)) = exp2(fma(a_max, sc, −m_use)): fma with sc ≥ 0 and exp2
        // are monotone (a masked row gives exp2(−∞) = 0, as the max over its zeros; sc > 0 there).
        const float amax = exp2_ftz(__fmaf_rn(mx[h], sc, -m_use[h]));
        if constexpr (BRANCHLESS) {
            st.p_scale[h] = div127_rn(amax);  // 0 for amax = 0, as group_scale
            inv[h] = inv127_rn(amax);
        } else {
            const GroupScale g = group_scale(amax);
            st.p_scale[h] = g.scale;
            inv[h] = g.inv;
        }
    }
    softmax_exp_sum<false, true>(t, st, m_use, nullptr, sc);
    quantize_p_tile(t, inv, pa);
}
template <bool BRANCHLESS = false>
__device__ __forceinline__ void softmax_p_hat_early(float (*t)[4], RowState& st, u32 (*pa)[4], float sc) {
    float mx[2];
    thread_row_max(t, mx);
    softmax_p_hat_early_mx<BRANCHLESS>(t, st, pa, sc, mx);
}

// Keeps the P̂ fragments' computation before this point: without it ptxas sank the quantization
// past the ping-pong barrier, between the wgmma issues, and serialized every wgmma (C7514).
template <int S>
__device__ __forceinline__ void pin_fragments(u32 (&pa)[S][4]) {
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(pa[s][i]));
}

// O = add(nd, e, fl(O·α)) for the warp's 16 rows × d, `add` adding the key block's contribution to
// the rescaled O; when no row of the warp changed its max, α = 1 and fl(O·1) = O exactly: the
// multiply is skipped.
template <class Add>
__device__ __forceinline__ void o_rescale_add(float (*o)[4], const RowState& st, Add add) {
    if (__all_sync(0xffffffffu, st.alpha[0] == 1.0f && st.alpha[1] == 1.0f)) {
#pragma unroll
        for (int nd = 0; nd < O_TILES; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[nd][e] = add(nd, e, o[nd][e]);
        return;
    }
#pragma unroll
    for (int nd = 0; nd < O_TILES; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nd][e] = add(nd, e, __fmul_rn(o[nd][e], st.alpha[e >> 1]));
}

// O = fma(float(acc), fl(s_P·s_V), fl(O·α)) (§2.3) from the finished P̂V accumulators, with s_V given (loaded a
// block ahead) and float(acc) by a plain conversion: |acc| ≤ 127²·128 < 2²⁴ is exact, and on sm_90
// it is one I2FP (the two-instruction trick of i2f_exact avoided sm_80's slow I2F).
__device__ __forceinline__ void ws_o_update(float (*o)[4], const int (&acc)[HEAD_DIM / 2], const RowState& st, float s_v) {
    const float dq0 = __fmul_rn(st.p_scale[0], s_v), dq1 = __fmul_rn(st.p_scale[1], s_v);  // fl(s_P·s_V)
    o_rescale_add(o, st, [&](int nd, int e, float base) { return __fmaf_rn((float)acc[4 * nd + e], e < 2 ? dq0 : dq1, base); });
}

// Ping-pong turn of consumer warpgroup w: wait for it (named barrier 1 + w, completed by the
// other warpgroup's pass_turn), then hand it over.
__device__ __forceinline__ void take_turn(int w) { named_sync(1 + w, 2 * WG_THREADS); }
__device__ __forceinline__ void pass_turn(int w) { named_arrive(1 + (w ^ 1), 2 * WG_THREADS); }

// The INT8 products of a consumer warpgroup (the wgmma path's arithmetic): S = Q̂ K̂ᵀ in INT32, P̂
// by softmax_p_hat(_early), P̂V in INT32, O = fma(float(acc), fl(s_P·s_V), fl(O·α)). The K̂ and V̂ᵀ
// scales of block kb + 1 are loaded during block kb: a load issued after a wgmma wait (a "memory"
// clobber) would put its L2 latency on every block's critical path.
// NB (fwd14, the persistent kernel): the early amax with branch-free group scales (softmax_p_hat_early<true>).
template <bool EARLY_AMAX, bool NB = false>
struct WsInt8 {
    int sacc[64], pacc[HEAD_DIM / 2];
    u32 pa[BLOCK_KV / 32][4];
    u32 qt;
    float sq, k_sc, v_sc, k_sc_next, v_sc_next;
    const float *k_scales, *v_scales;
    __device__ __forceinline__ WsInt8(const ForwardParams& p, u32 q_tiles, int w, int bh, int bh_kv, int qb, int cta_end) {
        const Dims& d = p.dims;
        qt = q_tiles + w * WG_Q_TILE;
        sq = qb < d.n_qblk ? __fmul_rn(p.op.q_scale[bh * d.n_qblk + qb], p.c_lambda) : 0.0f;
        k_scales = p.op.k_scale + bh_kv * d.n_kblk;
        v_scales = p.v_scale + bh_kv * d.n_kblk;
        k_sc = cta_end > 0 ? k_scales[0] : 0.0f;
        v_sc = cta_end > 0 ? v_scales[0] : 0.0f;
    }
    __device__ __forceinline__ void begin_block(int kb, bool next) {
        k_sc_next = next ? k_scales[kb + 1] : 0.0f;
        v_sc_next = next ? v_scales[kb + 1] : 0.0f;
    }
    __device__ __forceinline__ void issue_scores(u32 kt) { wg_issue_scores(sacc, qt, kt); }
    __device__ __forceinline__ void softmax(const Dims& d, RowState& st, int row0, int key0) {
        float t[S_TILES][4];
        float sc = __fmul_rn(sq, k_sc);
        wg_scores(d, t, sacc, sc, row0, key0);
        if (EARLY_AMAX) softmax_p_hat_early<NB>(t, st, pa, sc);
        else softmax_p_hat(t, st, pa, sc);
    }
    __device__ __forceinline__ void pin() { pin_fragments(pa); }
    __device__ __forceinline__ void issue_pv(u32 vt) { wg_issue_pv(pacc, pa, vt); }
    __device__ __forceinline__ void o_update(float (*o)[4], const RowState& st) { ws_o_update(o, pacc, st, v_sc); }
    __device__ __forceinline__ void end_block() {
        k_sc = k_sc_next;
        v_sc = v_sc_next;
    }
    // The one lane of the warp that arrives on a stage's "empty" barrier (ws_tile).
    __device__ __forceinline__ bool warp_leader() const { return (threadIdx.x & 31) == 0; }
};

// One tile of the persistent INT8 kernel (sfwd12) for consumer warpgroup w: ws_consume's loop
// (below, the same steps and the same arithmetic) over the `end` key blocks of its query block
// (rows from row0), which are the it0-th to the (it0 + end − 1)-th key blocks of the block's ring
// (counted over all its tiles); O and the row state in o, st (started by the caller). PINGPONG:
// end + 1 turns per tile; the caller passes the first and takes the last. (ws_consume itself does
// not call this: at d = 128 ptxas then scheduled the BF16 `fws*` kernels' stage addresses
// differently, so it keeps its own copy and their SASS stays unchanged.)
// EARLY_TEST (fwd17, the persistent kernel without turns): the "full" phase of stage kb + 1 is tested
// (mbarrier.test_wait, no suspend) before block kb's softmax, and the blocking wait after it runs only
// if that test failed: the test's shared-memory latency (~1.7 % of the consumer's stall samples at
// the try_wait's branch, fwd17) overlaps the softmax.
template <bool PINGPONG, bool OVERLAP, class Mix, class Ring, bool EARLY_TEST = false>
__device__ __forceinline__ void ws_tile(const Dims& d, const Ring& sm, Mix& mx, int w, int row0, int it0, int end,
                                        RowState& st, float (*o)[4]) {
    if (end > 0) {
        sm.wait_full(it0);
        if (PINGPONG) take_turn(w);
        mx.issue_scores(sm.k_stage(it0 % Ring::kStages));
        if (PINGPONG) pass_turn(w);
        wgmma_wait<0>();
    }
    for (int kb = 0; kb < end; ++kb) {
        const int s = (it0 + kb) % Ring::kStages, s1 = (it0 + kb + 1) % Ring::kStages;
        const bool next = kb + 1 < end;
        bool ready = false;
        if constexpr (EARLY_TEST && OVERLAP) ready = next && sm.test_full(it0 + kb + 1);
        mx.begin_block(kb, next);
        mx.softmax(d, st, row0, kb * BLOCK_KV);
        if (OVERLAP && next && !ready) sm.wait_full(it0 + kb + 1);
        mx.pin();
        if (PINGPONG) take_turn(w);
        mx.issue_pv(sm.v_stage(s));
        if (OVERLAP && next) mx.issue_scores(sm.k_stage(s1));
        if (OVERLAP && next) wgmma_wait<1>();  // P·V(kb) done; S(kb + 1) may still run
        else wgmma_wait<0>();
        // The turn passes once P·V(kb) is done (FA3 passes it right after the issue; a bar.arrive
        // with two wgmma groups in flight made ptxas serialize every wgmma, C7514).
        if (PINGPONG) pass_turn(w);
        __syncwarp();
        if (mx.warp_leader()) mbar_arrive(sm.empty_bar(s));  // K(kb), V(kb) read by this warp
        mx.o_update(o, st);
        if (!OVERLAP && next) {
            sm.wait_full(it0 + kb + 1);
            if (PINGPONG) take_turn(w);
            mx.issue_scores(sm.k_stage(s1));
            if (PINGPONG) pass_turn(w);
        }
        wgmma_wait<0>();
        mx.end_block();
    }
}

// A consumer warpgroup w of the warp-specialized forward: query block 2·blockIdx.x + w, the
// products and softmax of `Mix` on the stages of `Ring`. OVERLAP (the `pipe` schedule): S(kb + 1)
// is issued right behind P·V(kb) and runs during the O update; otherwise it is issued after it.
// PINGPONG: the two consumer warpgroups issue their wgmmas in turn (named barriers 1, 2).
template <bool PINGPONG, bool OVERLAP, class Mix, class Ring>
__device__ void ws_consume(const ForwardParams& p, const Ring& sm, Mix& mx, int w, int bh, int cta_end) {
    const Dims& d = p.dims;
    const int warp = (threadIdx.x >> 5) & 3, qb = 2 * blockIdx.x + w;
    const int row0 = qb * BLOCK_Q + warp * 16;
    RowState st;
    float o[O_TILES][4];
    start_rows(st, o);
    // Ping-pong: warpgroup 0 issues first (warpgroup 1 passes it the first turn); each passes the
    // turn after every issue, and warpgroup 0 takes the last turn warpgroup 1 passes after the
    // loop, so that no barrier phase is left pending at exit. (A conditional pass between the
    // wgmma issue and its wait made ptxas serialize every wgmma, C7514.)
    if (PINGPONG && w == 1 && cta_end > 0) pass_turn(1);
    if (cta_end > 0) {
        sm.wait_full(0);
        if (PINGPONG) take_turn(w);
        mx.issue_scores(sm.k_stage(0));
        if (PINGPONG) pass_turn(w);
        wgmma_wait<0>();
    }
    for (int kb = 0; kb < cta_end; ++kb) {
        const int s = kb % Ring::kStages, s1 = (kb + 1) % Ring::kStages;
        const bool next = kb + 1 < cta_end;
        mx.begin_block(kb, next);
        mx.softmax(d, st, row0, kb * BLOCK_KV);
        if (OVERLAP && next) sm.wait_full(kb + 1);
        mx.pin();
        if (PINGPONG) take_turn(w);
        mx.issue_pv(sm.v_stage(s));
        if (OVERLAP && next) mx.issue_scores(sm.k_stage(s1));
        if (OVERLAP && next) wgmma_wait<1>();  // P·V(kb) done; S(kb + 1) may still run
        else wgmma_wait<0>();
        // The turn passes once P·V(kb) is done (FA3 passes it right after the issue; a bar.arrive
        // with two wgmma groups in flight made ptxas serialize every wgmma, C7514).
        if (PINGPONG) pass_turn(w);
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(sm.empty_bar(s));  // K(kb), V(kb) read by this warp
        mx.o_update(o, st);
        if (!OVERLAP && next) {
            sm.wait_full(kb + 1);
            if (PINGPONG) take_turn(w);
            mx.issue_scores(sm.k_stage(s1));
            if (PINGPONG) pass_turn(w);
        }
        wgmma_wait<0>();
        mx.end_block();
    }
    if (PINGPONG && w == 0 && cta_end > 0) take_turn(0);
    if (qb < d.n_qblk) mma_store(p, st, o, bh, row0);
}

// The start of the pairs kernels (one block per query-block pair: the BF16 `fws3`): checks the launch, initializes the ring's
// mbarriers, and returns the end of the key blocks the block's two query blocks walk (those of the
// later one: a block past the earlier one's end is fully masked for it and changes nothing).
template <class Ring>
__device__ __forceinline__ int ws_start(const Ring& sm, const Dims& d, u32 full_count) {
    require_dynamic_smem((u32)Ring::kSmemBytes);
    if (blockDim.x != WS_THREADS) __trap();
    if (threadIdx.x == 0) sm.init(full_count);
    __syncthreads();
    return key_block_end(d, min(2 * (int)blockIdx.x + 1, d.n_qblk - 1));
}
#endif  // SAGE_WGMMA

// ---------------------------------------------------------------------------------------------
// The staged BF16 path (#1 and #2 both BF16: the fpa preset, and the isolations of the backward
// products, whose forward is fpa's): FlashAttention-2's forward with the arithmetic of §4. The
// K tile [128 keys][d] (double-buffered) and the V tile [128 keys][d] of each key block are staged
// in shared memory by cp.async from the original BF16 inputs (rows past n_k zero-filled), with
// XOR-swizzled 16-byte chunks (chunk c of row `key` at c ^ (key % 8): each ldmatrix phase reads 8
// consecutive rows of one logical chunk, so 8 distinct bank groups). The warp's Q fragments stay
// in registers; S = Q Kᵀ by m16n8k16 with B from ldmatrix; t = fl(cλ·S) (the BF16 #1 score);
// the online softmax of the INT8 path (staged_softmax, no amax). P·V takes bf16(p) straight from
// registers: the accumulators of S tiles 2ks and 2ks + 1 (row g / g + 8, keys 16ks + 2t, +1 and
// 16ks + 8 + 2t, +1) are the m16n8k16 A fragment of k-step ks once packed to bf16x2, in natural key
// order. V's B fragments by ldmatrix.trans (k = key). Per d-tile, O = fl(fl(O·α) + PV_block), PV
// summed in its own FP32 accumulator as §4 writes it; l sums the unrounded p.
//
// Schedule per key block kb (two barriers): wait for K(kb); barrier (a) (everyone is done with
// V(kb − 1) and K(kb − 1)); issue V(kb) and K(kb + 1); S and softmax; wait for V(kb); barrier (b);
// P·V. V(kb) loads while S is computed, K(kb + 1) during the whole block.

#define FB_ROW (HEAD_DIM * 2)                  // bytes of one BF16 K or V row
#define FB_CH (HEAD_DIM / 8)                   // 16-byte chunks per row
#define FB_TILE (BLOCK_KV * FB_ROW)            // bytes of one K or V tile
#define BF16_SMEM_BYTES (3 * FB_TILE)          // K twice, V once: 96 KB at d = 128, 48 KB at d = 64

// Copies rows [0, 128) of a [rows][d] BF16 operand into a swizzled tile at `dst`; rows ≥ n_rows
// are zero-filled (nothing read).
__device__ __forceinline__ void bf16_tile_load(u32 dst, const u16* src, int n_rows) {
#pragma unroll
    for (int it = 0; it < BLOCK_KV * FB_CH / MMA_THREADS; ++it) {
        const int i = threadIdx.x + it * MMA_THREADS;
        const int row = i / FB_CH, c = i % FB_CH;
        const bool valid = row < n_rows;
        cp_async16(dst + row * FB_ROW + (swz_rows8(row, c) << 4), valid ? src + row * HEAD_DIM + c * 8 : src, valid);
    }
}

// S = Q Kᵀ for the warp's 16 rows × 128 keys as base-2 scores t = fl(cλ·S) (unmasked). Lane
// (mi = lane / 8, r = lane % 8) addresses row nt·8 + r, chunk 4·cg + mi: the x4 load gives the
// B fragments of k-steps 2cg and 2cg + 1.
__device__ __forceinline__ void bf16_scores(float (*t)[4], const u32 (*qa)[4], u32 kbuf, int mi, int r, float c_lambda) {
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt) {
        const u32 rowa = kbuf + (nt * 8 + r) * FB_ROW;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int cg = 0; cg < FB_CH / 4; ++cg) {
            u32 b[4];
            ldmatrix_x4(b, rowa + (((cg * 4 + mi) ^ r) << 4));
            mma_bf16(acc, qa[2 * cg], b);
            mma_bf16(acc, qa[2 * cg + 1], b + 2);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) t[nt][e] = __fmul_rn(c_lambda, acc[e]);
    }
}

// O = fl(fl(O·α) + Σ_keys bf16(p)·V) for the warp's 16 rows × d, pa the bf16(p) A fragments. Lane
// (mi, r) addresses key 16·ks + 8·(mi % 2) + r, chunk 2·np + mi / 2: the transposed x4 load gives
// the B fragments (both key halves) of d-tiles 2np and 2np + 1.
__device__ __forceinline__ void bf16_pv(float (*o)[4], const u32 (*pa)[4], const RowState& st, u32 vbuf, int mi, int r) {
    const u32 lane_row = vbuf + (8 * (mi & 1) + r) * FB_ROW;
#pragma unroll
    for (int np = 0; np < O_TILES / 2; ++np) {
        const u32 chunk = ((2 * np + (mi >> 1)) ^ r) << 4;
        float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 16; ++ks) {
            u32 b[4];
            ldmatrix_x4_trans(b, lane_row + ks * 16 * FB_ROW + chunk);
            mma_bf16(acc[0], pa[ks], b);
            mma_bf16(acc[1], pa[ks], b + 2);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[2 * np + j][e] = __fadd_rn(__fmul_rn(o[2 * np + j][e], st.alpha[e >> 1]), acc[j][e]);
    }
}

// The BF16 path's softmax of the base-2 scores t (natural key order): mask, the online softmax
// (staged_softmax, no amax), and bf16(p) packed as the A fragments of P·V: the accumulators of S
// tiles 2kk and 2kk + 1 (keys 16kk..16kk + 15) are the m16n8k16 (and wgmma k16) A fragment kk.
__device__ __forceinline__ void bf16_softmax(const Dims& d, float (*t)[4], RowState& st, u32 (*pa)[4], int row0, int key0) {
    float unused = 1.0f;  // BF16 #1: t itself, not fused (§4)
    mask_tile<false>(d, t, row0, key0, unused);
    staged_softmax<false, false>(t, st, nullptr, 1.0f);
#pragma unroll
    for (int kk = 0; kk < BLOCK_KV / 16; ++kk) {
        pa[kk][0] = pack_bf16x2(t[2 * kk][0], t[2 * kk][1]);
        pa[kk][1] = pack_bf16x2(t[2 * kk][2], t[2 * kk][3]);
        pa[kk][2] = pack_bf16x2(t[2 * kk + 1][0], t[2 * kk + 1][1]);
        pa[kk][3] = pack_bf16x2(t[2 * kk + 1][2], t[2 * kk + 1][3]);
    }
}

__device__ void forward_mma_bf16(const ForwardParams& p, unsigned char* smem) {
    const Dims& d = p.dims;
    const int qb = blockIdx.x, bh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh_kv = kv_head_of(d, bh);
    const int row0 = qb * BLOCK_Q + warp * 16;
    const u32 ks = smem_addr(smem), vs = ks + 2 * FB_TILE;
    const u16* kg = p.op.k + (long)bh_kv * d.n_k * HEAD_DIM;  // unsmoothed K (§1)
    const u16* vg = p.v + (long)bh_kv * d.n_k * HEAD_DIM;

    const int kb_end = key_block_end(d, qb);
    if (kb_end > 0) bf16_tile_load(ks, kg, d.n_k);
    cp_async_commit();

    // The warp's Q fragments, once for the whole key loop (rows past n_q read as 0).
    u32 qa[HEAD_DIM / 16][4];
    {
        const View vq = view(p.op.q + ((long)bh * d.n_q + row0) * HEAD_DIM, HEAD_DIM, 1, d.n_q - row0, HEAD_DIM);
#pragma unroll
        for (int s = 0; s < HEAD_DIM / 16; ++s) frag_a_bf16(qa[s], ReadBf16(), vq, 0, s * 16);
    }
    RowState st;
    float o[O_TILES][4];
    start_rows(st, o);
    const int mi = lane >> 3, r = lane & 7;

    for (int kb = 0; kb < kb_end; ++kb) {
        const int key0 = kb * BLOCK_KV;
        cp_async_wait<0>();  // this thread's copies of K(kb)
        __syncthreads();     // (a): everyone's K(kb) visible; V(kb − 1), K(kb − 1) no longer read
        bf16_tile_load(vs, vg + (long)key0 * HEAD_DIM, d.n_k - key0);
        cp_async_commit();
        if (kb + 1 < kb_end)
            bf16_tile_load(ks + ((kb + 1) & 1) * FB_TILE, kg + (long)(key0 + BLOCK_KV) * HEAD_DIM, d.n_k - key0 - BLOCK_KV);
        cp_async_commit();

        float t[S_TILES][4];
        bf16_scores(t, qa, ks + (kb & 1) * FB_TILE, mi, r, p.c_lambda);
        u32 pa[BLOCK_KV / 16][4];
        bf16_softmax(d, t, st, pa, row0, key0);
        cp_async_wait<1>();  // this thread's copies of V(kb) (K(kb + 1) may still be in flight)
        __syncthreads();     // (b): everyone's V(kb) visible
        bf16_pv(o, pa, st, vs, mi, r);
    }
    cp_async_wait<0>();
    mma_store(p, st, o, bh, row0);
}

// ---------------------------------------------------------------------------------------------
// Warp-specialized BF16 path (sm_90a; fpafwd), kernel `sage_forward_ws_bf16`: the staged BF16 path's
// arithmetic (t = fl(cλ·S), staged_softmax, bf16(p), O = fl(fl(O·α) + PV_block), l of the
// unrounded p; only FP32 summation orders inside S and PV_block differ) on the warp-specialized
// structure of the INT8 one (WsRing, ws_start, ws_consume: the same ring, roles and ping-pong):
// - warpgroup 0, the producer: one thread issues every load by TMA (3-D tensor maps over Q, K, V
//   [B·H][N][d] BF16, box 64 columns × 128 rows, 128-byte swizzle; rows past N zero-filled):
//   Q of both query blocks once, K and V of each key block into a ring of FW_STAGES stages;
//   "full" is its one arrival + the TMA bytes, "empty" one arrival per consumer warp.
// - warpgroups 1, 2, the consumers: S = Q Kᵀ by wgmma m64n128k16 (both K-major in shared memory:
//   each tile is d/64 panels of [128 rows][64 columns], 128 bytes a row), the softmax on the
//   accumulators (the m16n8 C layout per warp, natural key order), bf16(p) packed straight into
//   the A fragments of O_block = P V (m64n{d}k16, A from registers), V natural [key][d] read as an
//   N-major B operand (transpose bit 1): no transposed copy of V.

#define FW_PANEL (BLOCK_KV * 128)             // bytes of one 64-column panel of a 128-row tile
#define FW_Q_BYTES (2 * BLOCK_Q * FB_ROW)     // Q of both query blocks
#define FW_STAGES (HEAD_DIM == 128 ? 2 : 4)   // 2 × 64 KB or 4 × 32 KB of K and V

#ifdef SAGE_WGMMA
using WsBf16Ring = WsRing<FW_Q_BYTES, FB_TILE, FW_STAGES>;

// The d/64 panels of 128 rows from `row` of (batch·head) bh into the tile at dst.
__device__ __forceinline__ void tma_panels(u32 dst, const void* map, int row, int bh, u32 bar) {
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 64; ++c) tma_load_3d(dst + c * FW_PANEL, map, c * 64, row, bh, bar);
}

__device__ void ws_producer_bf16(const void* qmap, const void* kmap, const void* vmap, const WsBf16Ring& sm, int bh,
                                 int bh_kv, int cta_end) {
    if (threadIdx.x != 0) return;  // one thread issues every TMA
    sm.produce(cta_end, [&](int kb, int s) {
        const u32 bar = sm.full_bar(s);
        mbar_arrive_expect_tx(bar, 2 * FB_TILE + (kb == 0 ? FW_Q_BYTES : 0));
        if (kb == 0) tma_panels(sm.q, qmap, 2 * blockIdx.x * BLOCK_Q, bh, bar);
        tma_panels(sm.k_stage(s), kmap, kb * BLOCK_KV, bh_kv, bar);
        tma_panels(sm.v_stage(s), vmap, kb * BLOCK_KV, bh_kv, bar);
    });
}

// S = Q Kᵀ of the warpgroup's 64 rows (Q at qt) and the 128 keys at kt (k-step s, 16 columns = 32 bytes, is at
// byte 32·(s mod 4) of panel s / 4).
__device__ __forceinline__ void fp_issue_scores(float (&sacc)[S_TILES][4], u32 qt, u32 kt) {
    const u64 qd = kmajor_desc(qt, 128), kd = kmajor_desc(kt, 128);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < HEAD_DIM / 16; ++s) {
        const u64 off = ((s / 4) * FW_PANEL + (s % 4) * 32) >> 4;
        wgmma_bf16_ss_n128(sacc, qd + off, kd + off, s);
    }
    wgmma_commit();
}

// The BF16 products of a consumer warpgroup (Mix of ws_consume).
struct WsBf16 {
    float sacc[S_TILES][4];  // S, then t, then p
    float pacc[O_TILES][4];  // PV_block
    u32 pa[BLOCK_KV / 16][4];
    u32 qt;
    float c_lambda;
    __device__ __forceinline__ WsBf16(const ForwardParams& p, u32 q_tiles, int w) {
        qt = q_tiles + w * BLOCK_Q * 128;  // the warpgroup's 64 rows of each panel
        c_lambda = p.c_lambda;
    }
    __device__ __forceinline__ void begin_block(int, bool) {}
    __device__ __forceinline__ void end_block() {}
    __device__ __forceinline__ void issue_scores(u32 kt) { fp_issue_scores(sacc, qt, kt); }
    __device__ __forceinline__ void softmax(const Dims& d, RowState& st, int row0, int key0) {
        wgmma_fence_regs(sacc);
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[nt][e] = __fmul_rn(c_lambda, sacc[nt][e]);
        bf16_softmax(d, sacc, st, pa, row0, key0);
    }
    __device__ __forceinline__ void pin() { pin_fragments(pa); }
    // O_block = P V: k-step ks is keys 16ks..16ks + 15, i.e. V rows at byte 16ks·128 of each panel.
    __device__ __forceinline__ void issue_pv(u32 vt) {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 16; ++ks) {
            const u64 vd = mnmajor_desc(vt + ks * 16 * 128, FW_PANEL);
#if HEAD_DIM == 128
            wgmma_bf16_rs_n128_tb(pacc, pa[ks], vd, ks);
#else
            wgmma_bf16_rs_n64_tb(pacc, pa[ks], vd, ks);
#endif
        }
        wgmma_commit();
    }
    __device__ __forceinline__ void o_update(float (*o)[4], const RowState& st) {
        wgmma_fence_regs(pacc);
        o_rescale_add(o, st, [&](int nd, int e, float base) { return __fadd_rn(base, pacc[nd][e]); });
    }
};

// ws3's schedule: ping-pong, S(kb + 1) during the O update of kb (fws1 without the ping-pong, fws0 with S(kb + 1)
// after the O update and fws3s with P·V as two n64 products measured slower: RESULTS-gpu.md, fpafwd; removed in
// session 21).
__device__ void ws_consumer_bf16(const ForwardParams& p, const WsBf16Ring& sm, int w, int bh, int cta_end) {
    WsBf16 mx(p, sm.q, w);
    ws_consume<true, true>(p, sm, mx, w, bh, cta_end);
}
#endif  // SAGE_WGMMA

// The warp-specialized BF16 path (#1 and #2 BF16 on sm_90a) on a grid of query-block pairs (`fws3`). Launched
// by src/forward.rs with 384 threads, WsBf16Ring::kSmemBytes of dynamic shared memory and the
// tensor maps of Q, K, V.
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    sage_forward_ws_bf16(const __grid_constant__ TmaMapParam qmap, const __grid_constant__ TmaMapParam kmap,
                         const __grid_constant__ TmaMapParam vmap, ForwardParams p) {
    extern __shared__ __align__(128) unsigned char ws_smem[];
#ifdef SAGE_WGMMA
    const Dims& d = p.dims;
    const int bh = blockIdx.y, bh_kv = kv_head_of(d, bh), wg = threadIdx.x >> 7;
    const WsBf16Ring sm(ws_smem);
    const int cta_end = ws_start(sm, d, 1);  // full: the producer's one arrival + the TMA bytes
    if (wg == 0) {
        setmaxnreg_dec<24>();
        ws_producer_bf16(&qmap, &kmap, &vmap, sm, bh, bh_kv, cta_end);
    } else {
        setmaxnreg_inc<240>();
        ws_consumer_bf16(p, sm, wg - 1, bh, cta_end);
    }
#else
    __trap();  // not compiled for sm_90a
#endif
}


// ---------------------------------------------------------------------------------------------
// Persistent BF16 forward (fpafwd2), kernels `sage_forward_ws_bf16_p*`: the arithmetic of
// sage_forward_ws_bf16 except that P·V accumulates straight onto the rescaled O (§4, #2 BF16: one
// FP32 sum of O·α and the products, in any order), which frees the PV_block accumulator for
// FlashAttention-3's in-warpgroup overlap, and a persistent grid:
// - tiles (query-block pair, batch·head) heaviest first (causal: the longest rows first, so the
//   grid's tail is short work); one block per SM walks tiles blockIdx.x, + gridDim.x, ...;
// - the producer thread streams Q of the next tile (FP_Q_SLOTS Q slots) and K, V of every key
//   block of every tile through one ring, so the next tile's loads overlap this tile's work and O
//   stores;
// - a consumer step for key block kb: issue S(kb + 1) = Q K(kb + 1)ᵀ, then O += P(kb) V(kb); wait
//   for S(kb + 1) only and run softmax(kb + 1) on the CUDA cores while P(kb)·V(kb) runs on the
//   tensor cores; then wait for it, release the stage, and rescale O by α(kb + 1). P(kb) and
//   P(kb + 1) live in two register sets (the loop is unrolled by two).

// The step for key block kb needs the stages of kb and kb + 1 at once (S(kb + 1) is issued before
// P·V(kb)), so 2 stages would leave the load of kb + 2 no slack (fpafwd2's first call: d = 128 lost
// 25–37 %): 3 at d = 128 (192 KB, hence one Q slot), 5 at d = 64 with two Q slots.
#define FP_STAGES (HEAD_DIM == 128 ? 3 : 5)  // 3 × 64 KB or 5 × 32 KB of K and V
#define FP_Q_SLOTS (HEAD_DIM == 128 ? 1 : 2)
// With one Q slot the consumers release it as soon as the tile's last S is done (not at the tile's
// end), so that the producer, which loads Q(i + 1) before the K, V of tile i + 1, is not held back
// until this tile ends: the next tile's first loads overlap this tile's last P·V.
#define FP_EARLY_Q (FP_Q_SLOTS == 1)

#ifdef SAGE_WGMMA
// Shared memory of the persistent kernel: FP_Q_SLOTS Q slots (tile i uses slot i % FP_Q_SLOTS), the
// K and V rings, then the mbarriers: FP_STAGES full, FP_STAGES empty, 2 Q-full, 2 Q-empty (8 B each;
// one pair unused with one slot).
struct FpSmem {
    static constexpr int kSmemBytes = FP_Q_SLOTS * FW_Q_BYTES + 2 * FP_STAGES * FB_TILE + 8 * (2 * FP_STAGES + 4) + 1024;
    u32 q, k, v, full, empty, q_full, q_empty;
    __device__ __forceinline__ FpSmem(unsigned char* smem) {
        q = (smem_addr(smem) + 1023u) & ~1023u;
        k = q + FP_Q_SLOTS * FW_Q_BYTES;
        v = k + FP_STAGES * FB_TILE;
        full = v + FP_STAGES * FB_TILE;
        empty = full + 8 * FP_STAGES;
        q_full = empty + 8 * FP_STAGES;
        q_empty = q_full + 16;
    }
    // Tile i's Q slot and its use count (the parity of its barriers): i & 1 and i >> 1 with two slots.
    __device__ __forceinline__ int q_index(int i) const { return FP_Q_SLOTS == 2 ? (i & 1) : 0; }
    __device__ __forceinline__ int q_round(int i) const { return FP_Q_SLOTS == 2 ? (i >> 1) : i; }
    __device__ __forceinline__ u32 q_slot(int i) const { return q + q_index(i) * FW_Q_BYTES; }
    __device__ __forceinline__ u32 k_stage(int it) const { return k + (it % FP_STAGES) * FB_TILE; }
    __device__ __forceinline__ u32 v_stage(int it) const { return v + (it % FP_STAGES) * FB_TILE; }
    __device__ __forceinline__ u32 full_bar(int it) const { return full + 8 * (it % FP_STAGES); }
    __device__ __forceinline__ u32 empty_bar(int it) const { return empty + 8 * (it % FP_STAGES); }
    __device__ __forceinline__ u32 q_full_bar(int i) const { return q_full + 8 * q_index(i); }
    __device__ __forceinline__ u32 q_empty_bar(int i) const { return q_empty + 8 * q_index(i); }
    // Consumers: the it-th key block this block loads (counted over all its tiles), and tile i's Q.
    __device__ __forceinline__ void wait_full(int it) const { mbar_wait(full_bar(it), (it / FP_STAGES) & 1); }
    __device__ __forceinline__ void wait_q(int i) const { mbar_wait(q_full_bar(i), q_round(i) & 1); }
    // Producer: the previous use of a stage / Q slot was released by every consumer warp.
    __device__ __forceinline__ void wait_empty(int it) const {
        if (it >= FP_STAGES) mbar_wait(empty_bar(it), ((it / FP_STAGES) - 1) & 1);
    }
    __device__ __forceinline__ void wait_q_empty(int i) const {
        if (i >= FP_Q_SLOTS) mbar_wait(q_empty_bar(i), (q_round(i) - 1) & 1);
    }
    // One thread: "full" barriers complete on the producer's one arrival + the TMA bytes, "empty"
    // ones on one arrival per consumer warp (8).
    __device__ __forceinline__ void init() const {
        for (int s = 0; s < FP_STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 8);
        }
        for (int s = 0; s < 2; ++s) {
            mbar_init(q_full + 8 * s, 1);
            mbar_init(q_empty + 8 * s, 8);
        }
        fence_mbar_init();
    }
};

// A tile of the persistent grid: query blocks 2·pair, 2·pair + 1 of (batch·head) bh, and the end of
// the key blocks they walk (those of the later one, as ws_start). Tile t: pairs in decreasing
// order (causal: decreasing work), batch·heads inside.
struct FpTile {
    int bh, pair, end;
};
__device__ __forceinline__ int fp_tile_count(const Dims& d) { return ((d.n_qblk + 1) / 2) * d.batch * d.heads_q; }
__device__ __forceinline__ FpTile fp_tile(const Dims& d, int t) {
    const int bhs = d.batch * d.heads_q, pairs = (d.n_qblk + 1) / 2;
    FpTile x;
    x.pair = pairs - 1 - t / bhs;
    x.bh = t % bhs;
    x.end = key_block_end(d, min(2 * x.pair + 1, d.n_qblk - 1));
    return x;
}

// The i-th tile of this block. Plain: t = blockIdx.x + i·gridDim.x. SNAKE: the rounds alternate
// direction over the heaviest-first order (round i odd: gridDim.x − 1 − blockIdx.x), so a block
// with the heaviest tile of one round gets the lightest of the next: a causal grid's blocks then
// get work within ~1–2 % of the mean where the plain stride leaves the heaviest 6–7 % above it
// (a static count of key blocks per block, fpafwd3). Either way the block's first tile is its
// heaviest.
template <bool SNAKE>
__device__ __forceinline__ int fp_block_tile(int i) {
    const int lane = SNAKE && (i & 1) ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    return i * (int)gridDim.x + lane;
}

// Head-grouped order (fpaf14, BF16 kernels only; `fpp3g`): the tiles of G (batch·head)s form a group,
// pairs in decreasing order and the group's heads inside, and the groups follow one another. With
// fp_tile's order the blocks running at once (one round, gridDim.x tiles) hold the same pair of
// ~gridDim.x different heads, and the next pair of a head comes B·H tiles later: when B·H ≳ gridDim.x
// (N ≤ 2k at H·D = 2048) every tile reads its K, V from DRAM (8–16 times each per head). In a group
// the pairs of a head run side by side, so its K, V are read from DRAM about once.
// G: tiles of equal weight (no causal imbalance) G = max(1, gridDim.x / pairs), a round holds every
// pair of its heads; else G = 2g / gcd(2g, pairs) with g = gridDim.x, so that a group is a whole
// number of two-round windows and each window is in decreasing order, as the snake deal needs
// (fp_block_tile: block b gets window positions b and 2g − 1 − b, a heavy and a light tile); G ≤ B·H
// (G = B·H is fp_tile's order).
__device__ __forceinline__ int fp_group_heads(const Dims& d) {
    const int bhs = d.batch * d.heads_q, pairs = (d.n_qblk + 1) / 2, g = gridDim.x;
    int G;
    if (fp_tile(d, 0).end == fp_tile(d, fp_tile_count(d) - 1).end) {
        G = max(1, g / pairs);
    } else {
        int a = 2 * g, b = pairs;
        while (b != 0) {
            const int r = a % b;
            a = b;
            b = r;
        }
        G = 2 * g / a;
    }
    return min(G, bhs);
}
__device__ __forceinline__ FpTile fp_tile_grouped(const Dims& d, int t, int G) {
    const int bhs = d.batch * d.heads_q, pairs = (d.n_qblk + 1) / 2;
    const int grp = t / (G * pairs), j = t - grp * G * pairs, h0 = grp * G, gs = min(G, bhs - h0);
    FpTile x;
    x.pair = pairs - 1 - j / gs;
    x.bh = h0 + j % gs;
    x.end = key_block_end(d, min(2 * x.pair + 1, d.n_qblk - 1));
    return x;
}
template <bool GROUPED>
__device__ __forceinline__ FpTile fp_tile_of(const Dims& d, int t, int G) {
    if constexpr (GROUPED) return fp_tile_grouped(d, t, G);
    else return fp_tile(d, t);
}

// The producer (one thread): for each tile of this block, its Q into slot i % FP_Q_SLOTS, then K and V of
// each key block into the ring; it runs ahead across tile boundaries as far as the ring allows.
template <bool SNAKE, bool GROUPED>
__device__ void fp_producer(const void* qmap, const void* kmap, const void* vmap, const FpSmem& sm, const Dims& d) {
    if (threadIdx.x != 0) return;
    const int n_tiles = fp_tile_count(d);
    const int G = GROUPED ? fp_group_heads(d) : 0;
    int it = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile_of<GROUPED>(d, t, G);
        const int bh_kv = kv_head_of(d, x.bh);
        sm.wait_q_empty(i);
        mbar_arrive_expect_tx(sm.q_full_bar(i), FW_Q_BYTES);
        tma_panels(sm.q_slot(i), qmap, 2 * x.pair * BLOCK_Q, x.bh, sm.q_full_bar(i));
        for (int kb = 0; kb < x.end; ++kb, ++it) {
            sm.wait_empty(it);
            mbar_arrive_expect_tx(sm.full_bar(it), 2 * FB_TILE);
            tma_panels(sm.k_stage(it), kmap, kb * BLOCK_KV, bh_kv, sm.full_bar(it));
            tma_panels(sm.v_stage(it), vmap, kb * BLOCK_KV, bh_kv, sm.full_bar(it));
        }
    }
}

// O += bf16(P) V onto the (already rescaled) O accumulators: accumulate = 1 in every k-step.
__device__ __forceinline__ void fp_issue_pv(float (*o)[4], const u32 (*pa)[4], u32 vt) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BLOCK_KV / 16; ++ks) {
        const u64 vd = mnmajor_desc(vt + ks * 16 * 128, FW_PANEL);
#if HEAD_DIM == 128
        wgmma_bf16_rs_n128_tb(o, pa[ks], vd, 1);
#else
        wgmma_bf16_rs_n64_tb(o, pa[ks], vd, 1);
#endif
    }
    wgmma_commit();
}

// t = fl(cλ·S), the mask, the online softmax (staged_softmax: m, α, l) and bf16(p) packed as the
// A fragments of P·V (bf16_softmax).
__device__ __forceinline__ void fp_softmax(const Dims& d, float (&sacc)[S_TILES][4], float c_lambda, RowState& st,
                                           u32 (*pa)[4], int row0, int key0) {
    wgmma_fence_regs(sacc);
    // t in its own registers: writing the S accumulators while P·V(kb) is in flight would make
    // ptxas serialize the wgmmas (C7515).
    float t[S_TILES][4];
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) t[nt][e] = __fmul_rn(c_lambda, sacc[nt][e]);
    bf16_softmax(d, t, st, pa, row0, key0);
}

// O = fl(O·α) before the next P·V accumulates onto it; skipped when no row of the warp changed
// its max (α = 1: fl(O·1) = O exactly).
__device__ __forceinline__ void fp_rescale(float (*o)[4], const RowState& st) {
    if (__all_sync(0xffffffffu, st.alpha[0] == 1.0f && st.alpha[1] == 1.0f)) return;
#pragma unroll
    for (int nd = 0; nd < O_TILES; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nd][e] = __fmul_rn(o[nd][e], st.alpha[e >> 1]);
}

// f32_to_bf16(o_normalized(O)) of the thread's pairs (columns 8nt + 2t, + 1 of rows g, g + 8), by
// pack_bf16x2_nan (epi15): one cvt per pair of products fl(O·fl(1/l)). If a row of the thread has
// l = 0 (no key: o_normalized's 0) or any product is NaN (only for non-finite O), the thread takes
// the software rounding of o_normalized for every pair (f32_to_bf16, NaN → 0x7fc0): the same bits
// either way (sage_bf16_pack_check: the cvt equals f32_to_bf16 on every non-NaN FP32 value).
__device__ __forceinline__ void o_pack_pairs(const RowState& st, const float (*o)[4], const float (&r_l)[2],
                                             u32 (&pk)[O_TILES][2]) {
    u32 nan = st.l[0] == 0.0f || st.l[1] == 0.0f;
#pragma unroll
    for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            pk[nt][h] = pack_bf16x2_nan(__fmul_rn(o[nt][2 * h], r_l[h]), __fmul_rn(o[nt][2 * h + 1], r_l[h]), nan);
    if (nan) {
#pragma unroll
        for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                pk[nt][h] = pack_bf16x2_sw(o_normalized(o[nt][2 * h], st.l[h], r_l[h]),
                                           o_normalized(o[nt][2 * h + 1], st.l[h], r_l[h]));
    }
}

// O = fl(O · fl(1/l)) as BF16 (o_pack_pairs), lse2 (+ b_r from row_offset(h, row) after an INT8 #1),
// lse; empty rows 0, +∞ (mma_store's values): each thread's two adjacent columns of each n-tile as one
// 32-bit store, rows ≥ n_q skipped: the persistent INT8 kernel's epilogue (wsp_store). fp_store (BF16)
// keeps its own form: through this helper (epi15's `fpp3su`) ptxas re-allocated the whole BF16 kernel
// and fpa's forward was 2–4 % slower at the training shape (RESULTS-gpu.md, epi15).
template <class RowOffset>
__device__ __forceinline__ void o_store_pairs(const ForwardParams& p, const RowState& st, const float (*o)[4], int bh,
                                              int row0, RowOffset row_offset) {
    const Dims& d = p.dims;
    const float r_l[2] = {__frcp_rn(st.l[0]), __frcp_rn(st.l[1])};  // fl(1/l) once per row
    u32 pk[O_TILES][2];  // rows g (h = 0), g + 8 (h = 1): BF16 of columns 8nt + 2t (low half), + 1
    o_pack_pairs(st, o, r_l, pk);
    u16* og = p.o + ((long)bh * d.n_q + row0) * HEAD_DIM;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = c_row(2 * h);
        if (row0 + r >= d.n_q) continue;
#pragma unroll
        for (int nt = 0; nt < O_TILES; ++nt) *(u32*)(og + r * HEAD_DIM + nt * 8 + c_col(0)) = pk[nt][h];
    }
    store_lse_rows(p, st, bh, row0, row_offset);
}

// mma_store's results (O = fl(O · fl(1/l)) as BF16, lse2, lse; empty rows 0, +∞) with each thread's
// two adjacent columns stored as one 32-bit word (pack_bf16x2 = f32_to_bf16 on finite values).
__device__ void fp_store(const ForwardParams& p, const RowState& st, const float (*o)[4], int bh, int row0) {
    const Dims& d = p.dims;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + c_row(2 * h);
        if (r >= d.n_q) continue;
        const float l = st.l[h], r_l = __frcp_rn(l);
        u16* dst = p.o + ((long)bh * d.n_q + r) * HEAD_DIM + c_col(0);
#pragma unroll
        for (int nt = 0; nt < O_TILES; ++nt) {
            // o_normalized written out: through the helper ptxas schedules the BF16 persistent kernels
            // differently (SASS checked, not timed), so they keep the measured form.
            const float lo = l == 0.0f ? 0.0f : __fmul_rn(o[nt][2 * h], r_l);
            const float hi = l == 0.0f ? 0.0f : __fmul_rn(o[nt][2 * h + 1], r_l);
            *(u32*)(dst + nt * 8) = pack_bf16x2(lo, hi);
        }
    }
    store_lse_rows(p, st, bh, row0);  // F_QK is off in the BF16 kernels: no b_r
}

// One consumer warpgroup's state over a tile: S accumulators, O, the row state, the tile's Q.
struct FpConsumer {
    float sacc[S_TILES][4];
    float o[O_TILES][4];
    RowState st;
    u32 qt;
    int row0, end;
};

// This warp is done with tile i's Q (every S of the tile complete): one arrival of the slot's 8.
__device__ __forceinline__ void fp_release_q(const FpSmem& sm, int i) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(sm.q_empty_bar(i));
}

// Key block kb (the it-th of the block) of tile i: see the section comment. pa_cur holds P(kb);
// pa_next receives P(kb + 1).
template <bool PINGPONG>
__device__ __forceinline__ void fp_step(const ForwardParams& p, const FpSmem& sm, FpConsumer& c, int w, int kb, int it,
                                        int i, u32 (&pa_cur)[BLOCK_KV / 16][4], u32 (&pa_next)[BLOCK_KV / 16][4]) {
    const bool next = kb + 1 < c.end;
    if (next) sm.wait_full(it + 1);
    pin_fragments(pa_cur);
    if (PINGPONG) take_turn(w);
    if (next) fp_issue_scores(c.sacc, c.qt, sm.k_stage(it + 1));
    fp_issue_pv(c.o, pa_cur, sm.v_stage(it));
    if (next) wgmma_wait<1>();  // S(kb + 1) done; P(kb)·V(kb) may still run
    else wgmma_wait<0>();
    if (PINGPONG) pass_turn(w);
    if (FP_EARLY_Q && kb + 2 == c.end) fp_release_q(sm, i);  // S(end − 1), the tile's last, is done
    if (next) fp_softmax(p.dims, c.sacc, p.c_lambda, c.st, pa_next, c.row0, (kb + 1) * BLOCK_KV);
    wgmma_wait<0>();
    wgmma_fence_rows<O_TILES>(c.o);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(sm.empty_bar(it));  // K(kb), V(kb) read by this warp
    if (next) fp_rescale(c.o, c.st);
}

// Tile i's first S and softmax (nothing of this warpgroup to overlap them with; the other one's
// turn keeps the tensor cores busy): P(0) into pa.
template <bool PINGPONG>
__device__ __forceinline__ void fp_first_block(const ForwardParams& p, const FpSmem& sm, FpConsumer& c, int w, int it,
                                               int i, u32 (&pa)[BLOCK_KV / 16][4]) {
    sm.wait_full(it);
    if (PINGPONG) take_turn(w);
    fp_issue_scores(c.sacc, c.qt, sm.k_stage(it));
    if (PINGPONG) pass_turn(w);
    wgmma_wait<0>();
    if (FP_EARLY_Q && c.end == 1) fp_release_q(sm, i);
    fp_softmax(p.dims, c.sacc, p.c_lambda, c.st, pa, c.row0, 0);
}

// Consumer warpgroup w of the persistent kernel: query block 2·pair + w of each of the block's
// tiles. Ping-pong: the turns alternate over all tiles (both warpgroups take end + 1 turns per
// tile), so warpgroup 1 passes the first turn once and warpgroup 0 takes the last one once.
// (Chaining each tile's first S + softmax onto the previous tile's last P·V, FA3's inter-tile
// overlap, was slower: RESULTS-gpu.md, fpafwd3, commit 73beb5b.)
template <bool PINGPONG, bool SNAKE, bool GROUPED>
__device__ void fp_consumer(const ForwardParams& p, const FpSmem& sm, int w) {
    const Dims& d = p.dims;
    const int warp = (threadIdx.x >> 5) & 3, n_tiles = fp_tile_count(d);
    const int G = GROUPED ? fp_group_heads(d) : 0;
    // The block's first tile is its heaviest: it has turns iff any tile has. (Grouped order: each
    // group starts over at the heaviest pair, so the block's tiles are checked one by one.)
    bool turns = PINGPONG && (int)blockIdx.x < n_tiles && fp_tile(d, blockIdx.x).end > 0;
    if constexpr (PINGPONG && GROUPED) {
        turns = false;
        for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i))
            turns = turns || fp_tile_grouped(d, t, G).end > 0;
    }
    if (turns && w == 1) pass_turn(1);
    FpConsumer c;
    u32 pa[2][BLOCK_KV / 16][4];
    int it = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile_of<GROUPED>(d, t, G);
        const int qb = 2 * x.pair + w;
        c.row0 = qb * BLOCK_Q + warp * 16;
        c.end = x.end;
        c.qt = sm.q_slot(i) + w * BLOCK_Q * 128;  // the warpgroup's 64 rows of each panel
        start_rows(c.st, c.o);
        sm.wait_q(i);
        if (c.end > 0) fp_first_block<PINGPONG>(p, sm, c, w, it, i, pa[0]);
        for (int kb = 0; kb < c.end; kb += 2) {
            fp_step<PINGPONG>(p, sm, c, w, kb, it + kb, i, pa[0], pa[1]);
            if (kb + 1 < c.end) fp_step<PINGPONG>(p, sm, c, w, kb + 1, it + kb + 1, i, pa[1], pa[0]);
        }
        it += c.end;
        if (!FP_EARLY_Q || c.end == 0) fp_release_q(sm, i);  // every S of the tile is done
        if (qb < d.n_qblk) fp_store(p, c.st, c.o, x.bh, c.row0);
    }
    if (turns && w == 0) take_turn(0);
}
#endif  // SAGE_WGMMA

// The persistent BF16 path: launched by src/forward.rs with min(tiles, SMs) blocks of 384 threads,
// FpSmem::kSmemBytes of dynamic shared memory and the tensor maps of Q, K, V.
template <bool PINGPONG, bool SNAKE, bool GROUPED>
__device__ __forceinline__ void fp_main(const void* qmap, const void* kmap, const void* vmap, const ForwardParams& p,
                                        unsigned char* smem) {
#ifdef SAGE_WGMMA
    require_dynamic_smem((u32)FpSmem::kSmemBytes);
    if (blockDim.x != WS_THREADS) __trap();
    const FpSmem sm(smem);
    if (threadIdx.x == 0) sm.init();
    __syncthreads();
    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        setmaxnreg_dec<24>();
        fp_producer<SNAKE, GROUPED>(qmap, kmap, vmap, sm, p.dims);
    } else {
        setmaxnreg_inc<240>();
        fp_consumer<PINGPONG, SNAKE, GROUPED>(p, sm, wg - 1);
    }
#else
    __trap();  // not compiled for sm_90a
#endif
}

#define FP_ENTRY(name, PINGPONG, SNAKE, GROUPED)                                                                  \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                                   \
        name(const __grid_constant__ TmaMapParam qmap, const __grid_constant__ TmaMapParam kmap,                  \
             const __grid_constant__ TmaMapParam vmap, ForwardParams p) {                                         \
        extern __shared__ __align__(128) unsigned char ws_smem[];                                                 \
        fp_main<PINGPONG, SNAKE, GROUPED>(&qmap, &kmap, &vmap, p, ws_smem);                                       \
    }
FP_ENTRY(sage_forward_ws_bf16_p3s, true, true, false)   // fpp3s: ping-pong, the snake tile order (fpafwd3)
FP_ENTRY(sage_forward_ws_bf16_p3g, true, true, true)    // fpp3g: fpp3s with head-grouped tiles (fpaf14)

// ---------------------------------------------------------------------------------------------
// Persistent INT8 forward (sfwd12), kernels `sage_forward_ws_p*`: the warp-specialized INT8 tile (ws3's schedule:
// ping-pong, early amax, S(kb + 1) overlapping the O update; WsInt8 and ws_tile, the pairs kernel's, so the same bits)
// on the persistent grid of the BF16 kernel (FpTile, fp_tile, fp_block_tile): min(tiles, SMs)
// blocks walk the tiles (query-block pair, batch·head) heaviest first (SNAKE: rounds alternate
// direction). The producer warpgroup streams Q̂ of the next tile into one of two Q slots and K̂, V̂ᵀ
// of every key block of every tile through one ring (its stage counter runs over all the block's
// tiles), so the next tile's loads overlap this tile's last blocks and O stores. A Q slot is
// loaded with the tile's first key block (same cp.async group: that stage's "full" barrier covers
// it) and released by the consumers (8 warps) at the tile's end. Tiles without key blocks (causal,
// N_q > N_k) load and release no Q slot: slots and their phases count the tiles with key blocks
// (j), so the producer never waits on a slot for a tile whose last stage it has not completed yet.
// The per-block scales (q_scale of the query block, k/v scales of key block 0) are loaded per tile
// by WsInt8's constructor.

// The tensor maps of the persistent INT8 kernel, its first parameters: V̂ᵀ (int8_v_map), for fwd22's copies
// (F_TMA_KQ) K̂ as the 5-D view whose box lands in the permuted row order of the K̂ tile (permuted_row; src/tma.rs
// `permuted_rows_map`) and Q̂ as 2-D rows (src/forward.rs `int8_kq_maps`), and O for fwd22s's stores (`o_map`).
struct WspMaps {
    const void *v, *k, *q, *o;
};

#define WSP_STAGES (HEAD_DIM == 128 ? 4 : 8)  // 4 × 32 KB or 8 × 16 KB of K̂ and V̂ᵀ
#define WSP_Q_BYTES (2 * WG_Q_TILE)           // Q̂ of both query blocks of a tile
// fwd22s (d = 128): O stored by TMA from a staging box per consumer warp (wsp_store). Measured (session 22, call c3):
// d 128 forward −0.1 to −8.4 % (geo. mean −3.3 %, most at N 1k); d 64 +4.2 % (+7.9 % at N 8k: ptxas re-allocated the
// d 64 consumer around it), so d 64 keeps the 4-byte pair stores and its SASS.
#define WSP_TMA_O (HEAD_DIM == 128)
#define WSP_OST_WARP (WSP_TMA_O ? 16 * HEAD_DIM * 2 : 0)  // a consumer warp's O staging: 16 rows × d BF16
// fwd16's variant bits of the persistent kernel (wsp_consumer, WspInt8; described there).
#define WSP16_IMAX 1
#define WSP16_MASK_LIMIT 2
#define WSP16_NO_PINGPONG 4
// fwd17's bits (d = 64; wsp17_softmax_p_hat, ws_tile's EARLY_TEST; described there).
#define WSP17_INV_ROW1 8
#define WSP17_EARLY_TEST 32
#define WSP17_QUAD_IMAX 64
#define WSP17_ELECT 128
// fwd18 (d = 64, without turns): wsp_consumer with wsp18_tile, the once-per-tile stagger of the two consumer
// warpgroups (described there).
#define WSP18_STAGGER 8192

#ifdef SAGE_WGMMA
// WsRing's layout and interface (stage indices s, counters kb over the block's key blocks) with two
// Q̂ slots (the j-th tile with key blocks uses slot j & 1) and their "empty" mbarriers after the
// stages' ones.
struct WspSmem {
    static constexpr int kStages = WSP_STAGES;
    static constexpr int kSmemBytes =
        2 * WSP_Q_BYTES + 2 * WSP_STAGES * WG_TILE + 8 * WSP_OST_WARP + 8 * (2 * WSP_STAGES + 2) + 1024;
    u32 q, k, v, ost, full, empty, q_empty;
    __device__ __forceinline__ WspSmem(unsigned char* smem) {
        q = (smem_addr(smem) + 1023u) & ~1023u;
        k = q + 2 * WSP_Q_BYTES;
        v = k + WSP_STAGES * WG_TILE;
        ost = v + WSP_STAGES * WG_TILE;  // the 8 consumer warps' O staging (wsp_store)
        full = ost + 8 * WSP_OST_WARP;
        empty = full + 8 * WSP_STAGES;
        q_empty = empty + 8 * WSP_STAGES;
    }
    __device__ __forceinline__ u32 q_slot(int i) const { return q + (i & 1) * WSP_Q_BYTES; }
    __device__ __forceinline__ u32 k_stage(int s) const { return k + s * WG_TILE; }
    __device__ __forceinline__ u32 v_stage(int s) const { return v + s * WG_TILE; }
    __device__ __forceinline__ u32 full_bar(int s) const { return full + 8 * s; }
    __device__ __forceinline__ u32 empty_bar(int s) const { return empty + 8 * s; }
    __device__ __forceinline__ u32 q_empty_bar(int i) const { return q_empty + 8 * (i & 1); }
    __device__ __forceinline__ void wait_full(int kb) const { mbar_wait(full_bar(kb % WSP_STAGES), (kb / WSP_STAGES) & 1); }
    // Whether that phase has completed already (no wait; acquire when it has).
    __device__ __forceinline__ bool test_full(int kb) const {
        u32 r;
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(r)
            : "r"(full_bar(kb % WSP_STAGES)), "r"((u32)(kb / WSP_STAGES) & 1)
            : "memory");
        return r != 0;
    }
    // Producer: the previous use of the stage of the it-th key block / of the j-th Q slot was released.
    __device__ __forceinline__ void wait_empty(int it) const {
        if (it >= WSP_STAGES) mbar_wait(empty_bar(it % WSP_STAGES), ((it / WSP_STAGES) - 1) & 1);
    }
    __device__ __forceinline__ void wait_q_empty(int i) const {
        if (i >= 2) mbar_wait(q_empty_bar(i), ((i >> 1) - 1) & 1);  // i = j
    }
    // One thread: "full" completes on the 128 producer arrivals + the TMA's (with its bytes), with fwd22's copies
    // (`tma_kq`) on the one arrival of the thread that issues them (with the bytes); the "empty" ones on one arrival
    // per consumer warp (8).
    __device__ __forceinline__ void init(bool tma_kq) const {
        for (int s = 0; s < WSP_STAGES; ++s) {
            mbar_init(full_bar(s), tma_kq ? 1 : WG_THREADS + 1);
            mbar_init(empty_bar(s), 8);
        }
        for (int s = 0; s < 2; ++s) mbar_init(q_empty + 8 * s, 8);
        fence_mbar_init();
    }
};

// fwd22 (F_TMA_KQ, where n_k is a non-zero multiple of 16): every copy of the producer by TMA from its one thread (tid 0): per
// key block K̂ and V̂ᵀ, per tile with key blocks Q̂ of both query blocks with its first block, on the stage's "full"
// barrier (one arrival with the bytes). The K̂ view folds the heads' 16-key groups together, so a head's last block
// may read the next head's first keys instead of zeros (the tensor's end reads zeros) and Q̂'s rows past n_q the next
// head's rows: such keys are masked (tile_needs_mask) and such rows are never stored. Instead of ws_load_k's ~40
// address instructions per 16-byte cp.async: the copies took ~18 % of the kernel's issued instructions (call c1).
template <bool SNAKE>
__device__ void wsp_producer_tma(const WspMaps& m, const ForwardParams& p, const WspSmem& sm) {
    const Dims& d = p.dims;
    const int n_tiles = fp_tile_count(d);
    int it = 0, j = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile(d, t);
        if (x.end == 0) continue;
        const int bh_kv = kv_head_of(d, x.bh), g0 = bh_kv * (d.n_k / 16);  // the head's first 16-key group
        sm.wait_q_empty(j);
        for (int kb = 0; kb < x.end; ++kb, ++it) {
            const int s = it % WSP_STAGES;
            const u32 full = sm.full_bar(s);
            sm.wait_empty(it);
            mbar_arrive_expect_tx(full, 2 * WG_TILE + (kb == 0 ? WSP_Q_BYTES : 0));
            if (kb == 0) tma_load_2d(sm.q_slot(j), m.q, 0, x.bh * d.n_q + 2 * x.pair * BLOCK_Q, full);
            tma_load_5d(sm.k_stage(s), m.k, 0, 0, 0, 0, g0 + kb * (BLOCK_KV / 16), full);
            tma_load_2d(sm.v_stage(s), m.v, kb * BLOCK_KV, bh_kv * HEAD_DIM, full);
        }
        ++j;
    }
}

// The producer warpgroup (ws_producer's loads, over all the block's tiles): stage `it` is completed
// after stage it + 1 was issued (two in flight), across tile boundaries too. With F_TMA_KQ: wsp_producer_tma.
template <bool SNAKE>
__device__ void wsp_producer(const WspMaps& m, const ForwardParams& p, const WspSmem& sm) {
    const Dims& d = p.dims;
    const int tid = threadIdx.x, n_tiles = fp_tile_count(d);  // tid 0..127
    if (p.flags & F_TMA_KQ) {
        if (tid == 0) wsp_producer_tma<SNAKE>(m, p, sm);
        return;
    }
    int it = 0, j = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile(d, t);
        if (x.end == 0) continue;
        const int bh_kv = kv_head_of(d, x.bh);
        sm.wait_q_empty(j);
        for (int kb = 0; kb < x.end; ++kb, ++it) {
            const int s = it % WSP_STAGES;
            sm.wait_empty(it);
            if (tid == 0) {
                mbar_arrive_expect_tx(sm.full_bar(s), WG_TILE);
                tma_load_2d(sm.v_stage(s), m.v, kb * BLOCK_KV, bh_kv * HEAD_DIM, sm.full_bar(s));
            }
            if (kb == 0) ws_load_q_rows<2>(p, sm.q_slot(j), x.bh, 2 * x.pair * BLOCK_Q, tid);
            ws_load_k(p, sm.k_stage(s), bh_kv, kb, tid);
            cp_async_commit();
            if (it > 0) {
                cp_async_wait<1>();  // stage it − 1 (it may still be in flight)
                ws_complete_stage(sm.full_bar((it - 1) % WSP_STAGES));
            }
        }
        ++j;
    }
    if (it > 0) {
        cp_async_wait<0>();
        ws_complete_stage(sm.full_bar((it - 1) % WSP_STAGES));
    }
}

// The tile's O (BF16) and lse2, lse of a consumer warp (rows row0..row0 + 15): mma_store's values
// (the same bits) stored another way (fwd14). mma_store writes each thread's 32 (d = 128: 64) BF16 as
// 2-byte stores, 8 rows per instruction, a quarter of each 32-byte sector: under ncu at the training
// shape (d = 64, N 4k) the consumer warps spent ~14 % of their samples in the tile's epilogue, mostly
// waiting for the store queue to take the next store's registers, and ~3 % waiting for the b_r load
// queued behind those stores; both warpgroups end a tile together, so nothing overlaps it. Here the
// thread's BF16 pairs (columns 2t, 2t + 1 of each n-tile, adjacent) go out as one 4-byte store each:
// half the stores, half the sector traffic. The b_r of the thread's rows (`ro`, row_offset, §3.5)
// come from wsp_row_offsets: at d = 64 loaded at the tile's start (WSP_EARLY_RO), at d = 128 just
// before the stores (early, ptxas spilled in the d = 128 key loop: that consumer is at its 240
// registers). Measured and not kept (RESULTS-gpu.md, fwd14): the tile staged in shared memory and
// stored as 16-byte rows — with stmatrix or a __syncwarp / per-warp bar.sync ptxas treated the whole
// consumer as possibly divergent (WARPSYNC and collective shuffle paths in the key loop, +8.5 % at
// N 4k); with plain shared stores and no warp barrier (relying on the converged warp's in-order
// shared-memory accesses) it was −1.4 % at N 1k and ±0 at N 4k against this. epi15: the pairs are
// packed by cvt.rn.bf16x2.f32 (o_pack_pairs, in o_store_pairs); deferring this epilogue past the next
// tile's first S (`wsp3se`) and fp_store as o_store_pairs (`fpp3su`) were slower (RESULTS-gpu.md, epi15).
// fwd22s (WSP_TMA_O, d = 128; d = 64 keeps o_store_pairs): the warp's BF16 pairs (o_pack_pairs, the same bits) go
// to its staging box in shared memory (16 rows × d in boxes of 64 columns = 128 bytes per row, 128-byte swizzle: the
// 16-byte chunk c of row r at c ^ (r mod 8), so that each 4-byte store of the warp hits 32 distinct banks), then one
// lane stores each box by a TMA tensor store (src/forward.rs `o_map`: rows past n_q are outside the map, not written). The lane that issued the previous tile's
// stores waits for their read of the box first (every lane waits: whichever lane elect.sync picked has them).
// Instead of o_store_pairs' 32 4-byte global stores per thread, whose LSU queue ("lg throttle") held the
// consumer ~7 % of its samples at d 128 N 1k (session 22's profile).
__device__ __forceinline__ void wsp_stage_pair(u32 box, int row, int nt, u32 v) {
    const int c = nt % 8, t = threadIdx.x & 3;
    asm volatile("{\n.reg .b32 a;\nxor.b32 a, %1, %2;\nshl.b32 a, a, 4;\nadd.u32 a, a, %0;\nst.shared.b32 [a], %3;\n}\n"
                 ::"r"(box + (nt / 8) * 2048 + row * 128 + 4 * t), "r"(c), "r"(row & 7), "r"(v) : "memory");
}
__device__ void wsp_store(const ForwardParams& p, const void* omap, u32 ost, const RowState& st, const float (*o)[4], int bh,
                          int row0, const float (&ro)[2]) {
    if constexpr (!WSP_TMA_O) {
        o_store_pairs(p, st, o, bh, row0, [&](int h, long) { return ro[h]; });  // b_r loaded earlier
        return;
    }
    const float r_l[2] = {__frcp_rn(st.l[0]), __frcp_rn(st.l[1])};  // fl(1/l) once per row
    u32 pk[O_TILES][2];  // rows g (h = 0), g + 8 (h = 1): BF16 of columns 8nt + 2t (low half), + 1
    o_pack_pairs(st, o, r_l, pk);
    const u32 box = ost + ((threadIdx.x >> 5) - 4) * WSP_OST_WARP;  // consumer warps 0..7 (threads 128..383)
    bulk_wait_read();
    __syncwarp();
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wsp_stage_pair(box, g + 8 * h, nt, pk[nt][h]);
    fence_proxy_async();
    __syncwarp();
#pragma unroll
    for (int half = 0; half < HEAD_DIM / 64; ++half) tma_store_3d_elect(omap, 64 * half, row0, bh, box + half * 2048);
    bulk_commit();
    store_lse_rows(p, st, bh, row0, [&](int h, long) { return ro[h]; });  // b_r loaded earlier
}

// row_offset (b_r) of the thread's two rows where wsp_store's lse needs them (quad leaders, rows < n_q,
// #1 INT8), 0 elsewhere.
__device__ __forceinline__ void wsp_row_offsets(const ForwardParams& p, int bh, int row0, float (&ro)[2]) {
    const Dims& d = p.dims;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + c_row(2 * h);
        const bool need = (threadIdx.x & 3) == 0 && r < d.n_q && (p.flags & F_QK);
        ro[h] = need ? p.op.row_offset[(long)bh * d.n_q + r] : 0.0f;
    }
}
// d = 64: the b_r loads at the tile's start, their latency hidden by the key loop (wsp_store).
#define WSP_EARLY_RO (HEAD_DIM == 64)

// fwd16: the persistent consumer's key-block softmax at d = 64 (bits of V; the default WSP16_DEFAULT
// below). WSP16_IMAX: the thread's row maxima of the score factors a = float(acc) as float(max acc),
// the integer max by VIMNMX3 (15 three-input + 1 two-input per row instead of 31 FMNMX on the floats),
// taken straight from the S accumulators before the mask test (so that ptxas interleaves them with
// the 64 I2FP; wasted on boundary blocks, which overwrite mx with the float max of the masked
// factors): the conversion is exact (|acc| ≤ 127²·64 < 2²⁴) and non-decreasing, so float(max acc) =
// max float(acc) bit for bit (I2FP of 0 is +0, no −0 arises). The same mx as before, hence the same
// m, α, P̂, l. WSP16_MASK_LIMIT (with WSP16_IMAX): boundary blocks masked by wsp_mask_limit (one
// limit per row) instead of mask_permuted. WSP16_NO_PINGPONG: no turns at all (opt-in, `wsp3s-nopp`).
// Measured (RESULTS-gpu.md, fwd16): IMAX + MASK_LIMIT −7.8 % / −10.4 % of the training-shape forward
// at N 4k / 1k; also measured and dropped: the turn passed right behind the wgmma issues (+6 % at
// N 4k), unsigned ring counters (+0.8 %), the producer's "empty" waits with a suspend hint (±0).
// (The WSP16_* bits are defined above, outside SAGE_WGMMA: the entries use them on sm_80 too.)

// mask_permuted's −∞ by one limit per row (the BF16 mask's form, fwd9, for the permuted key order):
// the key of entry (nt, e) is col0 + c with col0 = key0 + 4·(lane % 4) and the compile-time offset
// c = 16·(nt / 2) + 2·(nt % 2) + (e % 2) (permuted_key), and visible(d, r, j) ⇔ j < visible_end(d, r)
// for j ≥ 0 (common.cuh), so an entry is masked iff c ≥ visible_end(d, r) − col0: one compare and one
// select per entry instead of visible()'s three tests. Same entries, same sc = 0 rule (mask_tile).
// For boundary blocks only (the caller tests tile_needs_mask).
__device__ __forceinline__ void wsp_mask_limit(const Dims& d, float (*t)[4], int row0, int key0, float& sc) {
    masked_zero_scale(t, sc);
    const int col0 = key0 + 4 * (threadIdx.x & 3);
    const int limit[2] = {visible_end(d, row0 + c_row(0)) - col0, visible_end(d, row0 + c_row(2)) - col0};
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if ((nt >> 1) * 16 + 2 * (nt & 1) + (e & 1) >= limit[e >> 1]) t[nt][e] = neg_inf();
}

// The max of row h (0: elements 0, 1 of each n-tile; 1: elements 2, 3) of this thread's S
// accumulators: 32 → 11 → 4 → 2 → 1.
__device__ __forceinline__ int wsp_row_imax(const int (&acc)[64], int h) {
    int a[11];
#pragma unroll
    for (int k = 0; k < 11; ++k) {
        const int i = 3 * k;  // entries i, i + 1, i + 2 of the row: n-tile j / 2, element 2h + j % 2
        const int x0 = acc[4 * (i >> 1) + 2 * h + (i & 1)], x1 = acc[4 * ((i + 1) >> 1) + 2 * h + ((i + 1) & 1)];
        a[k] = k < 10 ? __vimax3_s32(x0, x1, acc[4 * ((i + 2) >> 1) + 2 * h + ((i + 2) & 1)]) : max(x0, x1);
    }
    const int b0 = __vimax3_s32(a[0], a[1], a[2]), b1 = __vimax3_s32(a[3], a[4], a[5]);
    const int b2 = __vimax3_s32(a[6], a[7], a[8]), b3 = max(a[9], a[10]);
    return max(__vimax3_s32(b0, b1, b2), b3);
}

// fwd17: x with a data dependency on inv, x unchanged: the bits of x plus the sign bit of inv, which
// is 0 (inv127_rn gives +0, a positive value or +inf — fl(127/amax) overflows for amax < ~2^-121). As
// inline PTX so that neither NVVM nor ptxas folds it. (The device call's build had fma(0, inv, x),
// which is NaN for inv = +inf: the σ = 5 verify cases failed with O = inf; see RESULTS-gpu.md, fwd17.)
__device__ __forceinline__ float wsp17_dep(float x, float inv) {
    u32 r;
    asm("{\n.reg .u32 s;\nshr.u32 s, %2, 31;\nadd.u32 %0, %1, s;\n}\n" : "=r"(r) : "r"(__float_as_uint(x)), "r"(__float_as_uint(inv)));
    return __uint_as_float(r);
}

// fwd17: softmax_p_hat_early_mx<true> (the same operations, the same order, the same bits) with the
// exponentials' scale sc of row 1 (WSP17_INV_ROW1) made data-
// dependent on the group inverses inv of the quantizer (wsp17_dep: the same value). In main's SASS
// ptxas issued the two RCP chains of inv127_rn after all 64 EX2s (nothing waited on them before the
// quantization), so the 64 quantizing FFMAs + 48 PRMTs ran after the EX2 stream instead of in the
// issue slots between its MUFUs; with row 1's exponentials depending on inv, the chains run during
// row 0's exponentials and the quantization can interleave with row 1's.
// Measured (fwd17's device call): interleaved as intended (49–52 of the 64 FFMAs before the 60th EX2),
// but 1.8–2.8 % slower alone at N 4k / 8k: the EX2s of the SMSP's two consumer warps share the XU, so the
// stream's stall "wait" became "mio" (the MUFU queue) and the slots gained were not free (RESULTS-gpu.md).
// WSP17_QUAD_IMAX: mx holds the quad's row maxima already (quad_fmax after the integer shuffles), so only
// row_max_commit is left.
template <int V>
__device__ __forceinline__ void wsp17_softmax_p_hat(float (*t)[4], RowState& st, u32 (*pa)[4], float sc, float* mx) {
    float m_use[2], inv[2];
    if constexpr ((V & WSP17_QUAD_IMAX) != 0) row_max_commit<true>(st, mx, m_use, sc);
    else quad_max_update<true>(st, mx, m_use, sc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float amax = exp2_ftz(__fmaf_rn(mx[h], sc, -m_use[h]));
        st.p_scale[h] = div127_rn(amax);
        inv[h] = inv127_rn(amax);
    }
    float sch[2] = {sc, sc};
    if constexpr ((V & WSP17_INV_ROW1) != 0) sch[1] = wsp17_dep(wsp17_dep(sc, inv[0]), inv[1]);
    softmax_exp_sum_rows<false, true>(t, st, m_use, nullptr, sch);
    quantize_p_tile(t, inv, pa);
}

template <int V>
struct WspInt8 : WsInt8<true, true> {
    using Base = WsInt8<true, true>;
    __device__ __forceinline__ WspInt8(const ForwardParams& p, u32 q_tiles, int w, int bh, int bh_kv, int qb, int cta_end)
        : Base(p, q_tiles, w, bh, bh_kv, qb, cta_end) {}
    // WSP17_ELECT: elect.sync (one ELECT, any one lane) instead of lane 0 by S2R of %tid, which ptxas
    // re-read in every key block (its latency before the O update, fwd17).
    __device__ __forceinline__ bool warp_leader() const {
        if constexpr ((V & WSP17_ELECT) != 0) {
            u32 e;
            asm volatile("{\n.reg .pred e;\nelect.sync _|e, 0xffffffff;\nselp.u32 %0, 1, 0, e;\n}\n" : "=r"(e));
            return e != 0;
        } else {
            return Base::warp_leader();
        }
    }
    __device__ __forceinline__ void softmax(const Dims& d, RowState& st, int row0, int key0) {
        if constexpr (V & WSP16_IMAX) {
            float t[S_TILES][4], mx[2];
            float sc = __fmul_rn(sq, k_sc);
            if constexpr ((V & WSP17_QUAD_IMAX) != 0) {
                // fwd17: the quad's row maxima on the integers (float(max acc) = max float(acc), as above),
                // so that the shuffles' latency overlaps the 64 I2FP; boundary blocks redo them on the floats.
                int im[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) im[h] = wsp_row_imax(sacc, h);
#pragma unroll
                for (int o2 = 1; o2 <= 2; o2 <<= 1)
#pragma unroll
                    for (int h = 0; h < 2; ++h) im[h] = max(im[h], __shfl_xor_sync(0xffffffffu, im[h], o2));
#pragma unroll
                for (int h = 0; h < 2; ++h) mx[h] = (float)im[h];
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) mx[h] = (float)wsp_row_imax(sacc, h);
            }
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) t[nt][e] = (float)sacc[4 * nt + e];
            // (QUAD_IMAX: the test is warp-uniform — row0 and key0 are — and voted so that ptxas knows it: the
            // shuffles of the masked path then leave the rest of the loop convergent, without BRA.DIV paths.)
            const bool masked = tile_needs_mask(d, row0, key0);
            if ((V & WSP17_QUAD_IMAX) != 0 ? __any_sync(0xffffffffu, masked) : masked) {
                if constexpr ((V & WSP16_MASK_LIMIT) != 0) wsp_mask_limit(d, t, row0, key0, sc);
                else mask_permuted(d, t, row0, key0, sc);
                thread_row_max(t, mx);
                if constexpr ((V & WSP17_QUAD_IMAX) != 0) quad_fmax(mx);
            }
            if constexpr ((V & (WSP17_INV_ROW1 | WSP17_QUAD_IMAX)) != 0) wsp17_softmax_p_hat<V>(t, st, pa, sc, mx);
            else softmax_p_hat_early_mx<true>(t, st, pa, sc, mx);
        } else {
            Base::softmax(d, st, row0, key0);
        }
    }
};

// fwd18: the once-per-tile stagger (WSP18_STAGGER, d = 64, no turns). Without turns (`wsp3s-nopp`) the two
// consumer warpgroups run free and drift apart within a block's tiles, by different amounts on different
// SMs. Here warpgroup 1 starts each tile's first S only once warpgroup 0's S of its first key block of the
// tile is done (named barrier 3, warpgroup 0 arrives at the start of that block's softmax): the two are
// re-aligned, nearly in phase, at every tile; then they run free again, with no per-block barrier. So that
// warpgroup 0 never arrives twice on barrier 3 before warpgroup 1 waited there once, warpgroup 0 starts a
// tile only after warpgroup 1 has started the previous one (barrier 4: warpgroup 1 arrives once before its
// first tile and after each wait on 3, warpgroup 0 waits before each tile and once after its last). Tiles
// without key blocks take no part (both warpgroups skip them alike). The arithmetic is ws_tile's.
// Measured (fwd18's call, RESULTS-gpu.md): in phase is what pays — warpgroup 1 half a block or more behind
// (at later points of warpgroup 0's first block, or once per kernel) was 1.6–6 % slower than `wsp3s-nopp`,
// while this variant was −2.0 % at the training shape N 4k; ncu puts the gain in the kernel's tail
// (the last SM finishes 16 k cycles after the average one instead of 35 k), not in the per-block stalls.
#define WSP18_BAR_GO1 3  // warpgroup 0 → 1: the tile's start
#define WSP18_BAR_GO0 4  // warpgroup 1 → 0: the previous tile started
// bar.arrive on barrier 3 (256 threads) if p, predicated (no branch before the softmax's code).
__device__ __forceinline__ void wsp18_arrive_if(bool p) {
    asm volatile("{\n.reg .pred q;\nsetp.ne.u32 q, %0, 0;\n@q bar.arrive 3, 256;\n}\n" ::"r"((u32)p) : "memory");
}

// ws_tile<false, true> (no turns, overlap; the same steps) with warpgroup 0's arrival on barrier 3 at the
// start of the tile's first key block when `arrive`.
template <int V>
__device__ __forceinline__ void wsp18_tile(const Dims& d, const WspSmem& sm, WspInt8<V>& mx, int row0, int it0, int end,
                                           RowState& st, float (*o)[4], bool arrive) {
    if (end > 0) {
        sm.wait_full(it0);
        mx.issue_scores(sm.k_stage(it0 % WspSmem::kStages));
        wgmma_wait<0>();
    }
    // arr: `arrive` in the first key block, false after it, opaque to NVVM (which otherwise peeled the first
    // block off the loop to resolve kb == 0: a second copy of the whole block's code).
    u32 arr = arrive;
    for (int kb = 0; kb < end; ++kb) {
        const int s = (it0 + kb) % WspSmem::kStages, s1 = (it0 + kb + 1) % WspSmem::kStages;
        const bool next = kb + 1 < end;
        mx.begin_block(kb, next);
        wsp18_arrive_if(arr != 0);
        mx.softmax(d, st, row0, kb * BLOCK_KV);
        if (next) sm.wait_full(it0 + kb + 1);
        mx.pin();
        mx.issue_pv(sm.v_stage(s));
        if (next) mx.issue_scores(sm.k_stage(s1));
        if (next) wgmma_wait<1>();  // P·V(kb) done; S(kb + 1) may still run
        else wgmma_wait<0>();
        __syncwarp();
        if (mx.warp_leader()) mbar_arrive(sm.empty_bar(s));  // K(kb), V(kb) read by this warp
        mx.o_update(o, st);
        wgmma_wait<0>();
        mx.end_block();
        arr = 0;
        asm volatile("" : "+r"(arr));
    }
}

// Consumer warpgroup w: query block 2·pair + w of each of the block's tiles, one ws_tile each with
// WsInt8<early amax> (the per-tile scales), then its Q slot released and O stored. Ping-pong: the
// turns alternate over all tiles (end + 1 per tile for both warpgroups), so warpgroup 1 passes the
// first turn once and warpgroup 0 takes the last one once; the block's first tile is its heaviest,
// so it has turns iff any tile has. WSP18_STAGGER (no turns): wsp18_tile with the stagger's handshake
// (above) instead, whose first arrival and last wait follow the same rule.
template <bool SNAKE, int V>
__device__ void wsp_consumer(const ForwardParams& p, const WspMaps& maps, const WspSmem& sm, int w) {
    constexpr bool PP = !(V & WSP16_NO_PINGPONG), STAGGER = (V & WSP18_STAGGER) != 0;
    const Dims& d = p.dims;
    const int warp = (threadIdx.x >> 5) & 3, n_tiles = fp_tile_count(d);
    const bool turns = (PP || STAGGER) && (int)blockIdx.x < n_tiles && fp_tile(d, blockIdx.x).end > 0;
    if (turns && w == 1) {
        if constexpr (STAGGER) named_arrive(WSP18_BAR_GO0, 2 * WG_THREADS);
        else pass_turn(1);
    }
    int it = 0, j = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile(d, t);
        const int qb = 2 * x.pair + w, row0 = qb * BLOCK_Q + warp * 16;
        WspInt8<V> mx(p, sm.q_slot(j), w, x.bh, kv_head_of(d, x.bh), qb, x.end);
        float ro[2];
        if (WSP_EARLY_RO) wsp_row_offsets(p, x.bh, row0, ro);
        RowState st;
        float o[O_TILES][4];
        start_rows(st, o);
        if constexpr (STAGGER) {
            // (The warpgroup test voted, so that ptxas knows it is warp-uniform: otherwise it treated the
            // softmax's shuffles as possibly divergent, a second, collective path for them.)
            const bool stag = x.end > 0;
            const bool w0 = __any_sync(0xffffffffu, stag && w == 0), w1 = __any_sync(0xffffffffu, stag && w != 0);
            if (w0) named_sync(WSP18_BAR_GO0, 2 * WG_THREADS);
            if (w1) {
                named_sync(WSP18_BAR_GO1, 2 * WG_THREADS);
                named_arrive(WSP18_BAR_GO0, 2 * WG_THREADS);
            }
            wsp18_tile<V>(d, sm, mx, row0, it, x.end, st, o, w0);
        } else {
            ws_tile<PP, true, WspInt8<V>, WspSmem, (V & WSP17_EARLY_TEST) != 0>(d, sm, mx, w, row0, it, x.end, st, o);
        }
        it += x.end;
        if (x.end > 0) {
            __syncwarp();
            if ((threadIdx.x & 31) == 0) mbar_arrive(sm.q_empty_bar(j));  // every S of the tile is done
            ++j;
        }
        // (Voted: warp-uniform, as qb is, but ptxas cannot know it (w comes from threadIdx.x); wsp_store's warp-wide
        // steps under a test it took as divergent gave the consumer collective fallback paths, key loop included.)
        if (WSP_TMA_O ? __any_sync(0xffffffffu, qb < d.n_qblk) : qb < d.n_qblk) {
            if (!WSP_EARLY_RO) wsp_row_offsets(p, x.bh, row0, ro);
            wsp_store(p, maps.o, sm.ost, st, o, x.bh, row0, ro);
        }
    }
    if (turns && w == 0) {
        if constexpr (STAGGER) named_sync(WSP18_BAR_GO0, 2 * WG_THREADS);
        else take_turn(0);
    }
    if (WSP_TMA_O) bulk_wait();  // the O stores (wsp_store) have read their staging and written O before the CTA exits
}
#endif  // SAGE_WGMMA

// The persistent INT8 path: launched by src/forward.rs with min(tiles, SMs) blocks of 384 threads,
// WspSmem::kSmemBytes of dynamic shared memory and the tensor maps (WspMaps).
template <bool SNAKE, int V>
__device__ __forceinline__ void wsp_main(const WspMaps& maps, const ForwardParams& p, unsigned char* smem) {
#ifdef SAGE_WGMMA
    require_dynamic_smem((u32)WspSmem::kSmemBytes);
    if (blockDim.x != WS_THREADS) __trap();
    const WspSmem sm(smem);
    if (threadIdx.x == 0) sm.init((p.flags & F_TMA_KQ) != 0);
    __syncthreads();
    // Launched with PDL after the Q/K/V quantization (src/forward.rs): nothing of global memory is
    // read or written above, and every thread waits here for the quantization's grid (which itself
    // waits for the K mean's) before its role reads Q̂, K̂, V̂ᵀ or their scales.
    pdl_wait();
    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        setmaxnreg_dec<24>();
        wsp_producer<SNAKE>(maps, p, sm);
    } else {
        setmaxnreg_inc<240>();
        wsp_consumer<SNAKE, V>(p, maps, sm, wg - 1);
    }
#else
    __trap();  // not compiled for sm_90a
#endif
}

#define WSP_ENTRY(name, SNAKE, V)                                                                                 \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                                   \
        name(const __grid_constant__ TmaMapParam vmap, const __grid_constant__ TmaMapParam kmap,                  \
             const __grid_constant__ TmaMapParam qmap, const __grid_constant__ TmaMapParam omap, ForwardParams p) {  \
        extern __shared__ __align__(128) unsigned char ws_smem[];                                                 \
        wsp_main<SNAKE, V>(WspMaps{&vmap, &kmap, &qmap, &omap}, p, ws_smem);                                      \
    }
// The two entries (src/forward.rs `int8_persistent_default`: `wsp3s-sx` at both head dims since session 22), each a
// measured step over the one before (RESULTS-gpu.md; the earlier entries `wsp3s`, `wsp3s-0`, `wsp3s-nopp`, `wsp3s-stagger` are in
// the history before session 21):
// - fwd16 (both): the integer row max and the one-limit boundary mask (training shape −10.4 / −7.8 % at N 1k / 4k;
//   d = 128 −0.8 / −6.5 % at N 1k full / causal, −1.3 / −4.3 % at N 4k).
// - fwd17's bits (both): row 1's exponentials after the quantizer inverses, so that ptxas puts the quantization into
//   the EX2 stream's idle slots; the next stage's early test (with the turns only); the quad maxima on the integers;
//   elect.sync. −1.8 to −2.5 % against the kernel without them at d 64 N 1k; at d 128 −1.0 to −2.6 % at every sweep
//   shape (call20e).
// wsp3s-x (the d = 128 default until session 22, opt-in since): with the ping-pong turns of the consumer warpgroups (FA3).
// wsp3s-sx (the default): no turns, fwd18's once-per-tile stagger (wsp18_tile) instead: −0.8 to −3.2 % forward
// against the previous d 64 rules at every d 64 sweep and training shape (call20g); at d 128 +0.2 to +1.4 % against
// wsp3s-x then, −1.7 to −4.8 % (geo. mean −3.3 %) once fwd22 had taken the producer's copies off the schedulers (c5).
#define WSP16_DEFAULT (WSP16_IMAX | WSP16_MASK_LIMIT)
#define WSP17_ALL (WSP17_INV_ROW1 | WSP17_EARLY_TEST | WSP17_QUAD_IMAX | WSP17_ELECT)
WSP_ENTRY(sage_forward_ws_p3s_x, true, WSP16_DEFAULT | WSP17_ALL)
WSP_ENTRY(sage_forward_ws_p3s_sx, true, WSP16_DEFAULT | WSP16_NO_PINGPONG | WSP18_STAGGER | WSP17_ALL)

// Every path takes its shared memory from the dynamic allocation, its own size (src/forward.rs,
// `forward_mma_smem_bytes`, mirrors FAST_SMEM_BYTES, BF16_SMEM_BYTES and GATHER_SMEM_BYTES); a
// launch with less traps rather than corrupt memory.
// 128 threads (the launch bounds of 256 are those of the two-warpgroup wgmma path it also ran until session 21:
// kept so that the SASS of its paths stays the one verified).
extern "C" __global__ void __launch_bounds__(256) sage_forward_mma(ForwardParams p) {
    extern __shared__ __align__(128) unsigned char fwd_smem[];
    const int fwd_products = p.flags & (F_QK | F_PV);
    if (fwd_products == (F_QK | F_PV)) {
        require_dynamic_smem((u32)FAST_SMEM_BYTES);
        if (p.flags & F_SMOOTH_Q) forward_mma_fast<true>(p, fwd_smem);
        else forward_mma_fast<false>(p, fwd_smem);
    } else if (fwd_products == 0) {
        // Smoothing flags do not matter here: BF16 products take the unsmoothed inputs (§1).
        require_dynamic_smem((u32)BF16_SMEM_BYTES);
        forward_mma_bf16(p, fwd_smem);
    } else {
        require_dynamic_smem((u32)GATHER_SMEM_BYTES);
        forward_mma_gather(p, *(ForwardMmaShared*)fwd_smem);
    }
}
