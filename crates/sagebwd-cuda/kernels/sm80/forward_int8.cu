// ---------------------------------------------------------------------------------------------
// Forward attention on tensor cores (ALGORITHM.md §4), the same computation as sage_fwd_reference: one
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
// sch: the scale of each row half (the same value in both but for wsp_softmax_p_hat_int_max's data dependency).
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
// forward's time swung from one build to the next; this form has fewer instructions and is faster.
// Permuted order: kept per entry: the prefix form (limit from the thread's first column + 4·(lane % 4))
// made ptxas schedule the whole INT8 key loop differently, faster at some shapes and slower at others.
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
    if constexpr (!PERMUTED) {  // the BF16 forward: its own form (the prefix limits below)
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

