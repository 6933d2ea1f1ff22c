// ---------------------------------------------------------------------------------------------
// The persistent forward with an FP8 P·V (ALGORITHM.md §10.2, P in e4m3; the `p-e4m3*` variants): the INT8 kernel
// of forward_int8.cu (its producer, ring, schedule, stagger, epilogue and S = Q̂K̂ᵀ in INT8 with the integer row max)
// with another product mix, WspFp8Pv:
// - no amax of P: P′ = exp2(fma(a, sc, −fl(m − off))), off = fl(log2 448) − 8 (the lazy max leaves p ≤ 2⁸, so
//   P′ ≤ 448; cvt saturates above), packed two at a time by cvt.rn.satfinite.e4m3x2.f32 into the A fragments;
//   l sums the unrounded P′;
// - P·V by the e4m3 wgmma into a fresh FP32 accumulator per key block, added to fl(O·α) (one FADD per value: the
//   simulator's fp8_sum.promote = B_kv), no INT32 accumulator and no dequantization; V̂ᵀ is e4m3 with one
//   power-of-two scale per channel (sage_quantize_v_e4m3), applied once at the end:
//   O = bf16(fl(fl(O · fl(1/l)) · s_V[c])), lse2 = fl(fl(m − off) + log2 l) (+ b_r).

#define P8_OFFSET __int_as_float(0x3f4eaed0)  // fl(fl(log2 448) − 8), the simulator's `off` for INT8 #1

#ifdef SAGE_WGMMA
// The four e4m3 bytes of one A-fragment register from the exponentials t (the element order of quant_quad).
__device__ __forceinline__ u32 e4m3_quad(const float (*t)[4], int n0, int h) {
    return e4m3x2(t[n0][2 * h], t[n0][2 * h + 1]) | (e4m3x2(t[n0 + 1][2 * h], t[n0 + 1][2 * h + 1]) << 16);
}

// The product mix of the FP8 P·V kernel (the interface of WspInt8<V>, which ws_tile and wsp_staggered_tile call).
// V must include WSP_INT_ROW_MAX.
template <int V>
struct WspFp8Pv {
    static_assert((V & WSP_INT_ROW_MAX) != 0, "the FP8 mix takes the integer row max");
    int sacc[64];
    float pacc[HEAD_DIM / 2];
    u32 pa[BLOCK_KV / 32][4];
    u32 qt;
    float sq, k_sc, k_sc_next;
    const float* k_scales;
    const float* v_scales;  // s_V[c] of the (batch, KV head): [d]
    __device__ __forceinline__ WspFp8Pv(const ForwardParams& p, u32 q_tiles, int w, int bh, int bh_kv, int qb, int cta_end) {
        const Dims& d = p.dims;
        qt = q_tiles + w * WG_Q_TILE;
        sq = qb < d.n_qblk ? __fmul_rn(p.op.q_scale[bh * d.n_qblk + qb], p.c_lambda) : 0.0f;
        k_scales = p.op.k_scale + bh_kv * d.n_kblk;
        v_scales = p.v_scale + (long)bh_kv * HEAD_DIM;
        k_sc = cta_end > 0 ? k_scales[0] : 0.0f;
    }
    __device__ __forceinline__ void begin_block(int kb, bool next) { k_sc_next = next ? k_scales[kb + 1] : 0.0f; }
    __device__ __forceinline__ void issue_scores(u32 kt) { wg_issue_scores(sacc, qt, kt); }
    __device__ __forceinline__ void softmax(const Dims& d, RowState& st, int row0, int key0) {
        float t[S_TILES][4], mx[2], m_use[2], shift[2];
        float sc = __fmul_rn(sq, k_sc);
        wsp_int_max_scores<V>(d, sacc, t, mx, sc, row0, key0);
        if constexpr ((V & WSP_QUAD_INT_MAX) != 0) row_max_commit<true>(st, mx, m_use, sc);
        else quad_max_update<true>(st, mx, m_use, sc);
#pragma unroll
        for (int h = 0; h < 2; ++h) shift[h] = __fsub_rn(m_use[h], P8_OFFSET);
        softmax_exp_sum<false, true>(t, st, shift, nullptr, sc);
#pragma unroll
        for (int s = 0; s < BLOCK_KV / 32; ++s)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int h = 0; h < 2; ++h) pa[s][2 * half + h] = e4m3_quad(t, 4 * s + 2 * half, h);
    }
    __device__ __forceinline__ void pin() { pin_fragments(pa); }
    __device__ __forceinline__ void issue_pv(u32 vt) { wg_issue_pv(pacc, pa, vt); }
    // O = fl(fl(O·α) + acc): the block's tensor-core sum promoted into the FP32 O.
    __device__ __forceinline__ void o_update(float (*o)[4], const RowState& st) {
        o_rescale_add(o, st, [&](int nd, int e, float base) { return __fadd_rn(pacc[4 * nd + e], base); });
    }
    __device__ __forceinline__ void end_block() { k_sc = k_sc_next; }
    __device__ __forceinline__ bool warp_leader() const { return elect_one(); }
    // O = fl(fl(O · fl(1/l)) · s_V[c]) and m = fl(fl(m − off) + log2 l) with l = 1 after it, so that wsp_store's
    // normalization (· fl(1/1) = ·1, exact) and lse2 (m + log2 1 = m) give §10.2's values; rows with l = 0 stay as they
    // are (wsp_store writes 0 and +∞).
    __device__ __forceinline__ void finish_rows(const ForwardParams&, RowState& st, float (*o)[4]) const {
        float sv[O_TILES][2];
#pragma unroll
        for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) sv[nt][j] = v_scales[nt * 8 + c_col(j)];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (st.l[h] == 0.0f) continue;
            const float r_l = __frcp_rn(st.l[h]);
#pragma unroll
            for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) o[nt][2 * h + j] = __fmul_rn(__fmul_rn(o[nt][2 * h + j], r_l), sv[nt][j]);
            st.m[h] = __fadd_rn(__fsub_rn(st.m[h], P8_OFFSET), log2f(st.l[h]));
            st.l[h] = 1.0f;
        }
    }
};
#else
template <int V>
struct WspFp8Pv {};  // the entry's name for the sm_80 compilation, whose wsp_main traps
#endif  // SAGE_WGMMA

// The INT8 entry's options less those of its P quantizer (WSP_ROW1_AFTER_INVERSES orders the quantizer's inverses).
WSP_ENTRY(sage_fwd_sm90_fp8_pv_persistent, true,
          WSP_INT_MAX_OPTS | WSP_NO_TURNS | WSP_TILE_STAGGER | WSP_EARLY_STAGE_TEST | WSP_QUAD_INT_MAX | WSP_ELECT_LANE, WspFp8Pv)
