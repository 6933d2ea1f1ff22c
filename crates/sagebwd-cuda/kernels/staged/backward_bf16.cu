// ---- The BF16 tile: #3 to #7 all BF16 ---------------------------------------------------------------------
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
// tile before Sᵀ, so its reductions run while Sᵀ and dPᵀ are on the tensor cores.
// BF16_BWD_STAGE_AHEAD: block qb + 1 is staged inside tile qb, after block qb − 1's dV, dK have landed, so those
// products run across the end of the iteration and the barrier; 0 drains them before the barrier.
// d = 64 only: at d = 128 the 128 dV/dK registers in flight with Sᵀ, dPᵀ, dQ make ptxas serialize
// the wgmma pipeline (C7512, insufficient registers).
#ifndef BF16_BWD_STAGE_AHEAD
#define BF16_BWD_STAGE_AHEAD (HEAD_DIM == 64)
#endif
// The sm_90a tile: a diagonal tile masked by two compares per entry against per-key row limits
// (ds_masked), the tile's wgmma descriptors built once per operand tile and advanced per k-step by one add
// (DescWords); at d = 64 also BF16_BWD_STSM_DS (bf16(dS)ᵀ stored by stmatrix: 4 instructions per thread instead of 16)
// and BF16_BWD_PRED_RED (the dQ reductions predicated instead of branched around, add_dq_pred). At d = 128 (255 registers)
// stmatrix and the predicated reductions (which ptxas still branches around there) cost most of what the mask and
// the descriptors gain, so those two are d = 64 only.
#define BF16_BWD_D64_OPTS (HEAD_DIM == 64)
#ifndef BF16_BWD_STSM_DS
#define BF16_BWD_STSM_DS BF16_BWD_D64_OPTS
#endif
#ifndef BF16_BWD_PRED_RED
#define BF16_BWD_PRED_RED BF16_BWD_D64_OPTS
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
    static constexpr bool STAGES_NEXT = BWD_WGMMA && BF16_BWD_STAGE_AHEAD;
    static constexpr bool BULK_DQ = false;  // StagedBf16Bulk: dQ by tensor reduces
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
#if BF16_BWD_PRED_RED
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
    // where visible()'s per-entry row and key arithmetic became predicate bitmasks (as in the BF16 forward).
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

#if BWD_WGMMA && BF16_BWD_STSM_DS
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

// ---- The BF16 tile at d = 128 with dV issued early (sage_bwd_main_sm90_bf16_persistent only) ---------
// StagedBf16 with another tile(): dV += bf16(P)ᵀ dO is issued as soon as P is computed and masked (its
// own commit group), so it runs on the tensor cores while dS = fl(P·fl(dP − D)) is computed; dK after.
// Issued after dS, both would leave the tensor cores idle from dPᵀ's end to dV's start (and the tile's end full
// of barrier and drain stalls). Same products, same FP32 operations: the same bits.
// Only the persistent kernel runs it (sage_bwd_main_sm80, which holds the sage instance too, keeps its
// SASS); BF16_BWD_EARLY_DV=0 gives that kernel StagedBf16 again.
// (Staging block qb + 1 inside this tile, or loading the next row constants late, is slower.)
// sage_bwd_main_sm90_bf16_persistent_tma_dq's tile the warpgroup index as warpgroup_index() (warp-uniform to ptxas), for its Sᵀ, dPᵀ
// A descriptors and its dQ B descriptor. With threadIdx.x >> 7 ptxas
// builds those descriptors in vector registers, hoists six of them out of the query loop and, at 255 registers,
// spills them: each tile reloads them right before the Sᵀ / dPᵀ issue. With warpgroup_index(): 250 registers, no
// stack, fewer instructions in the query loop (no LDL/STL, almost no R2UR, one SHFL per tile).
#ifndef BF16_BWD_EARLY_DV
#define BF16_BWD_EARLY_DV (HEAD_DIM == 128)
#endif
// The kernels that add dQ by TMA tensor reduces (sage_bwd_main_sm90_bf16_persistent_tma_dq at d = 128, sage_bwd_main_sm90_int8_tma_dq at d = 64) take the
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
#if BWD_WGMMA && BF16_BWD_EARLY_DV && !BF16_BWD_STAGE_AHEAD && !BF16_BWD_STSM_DS
#define BF16_BWD_EARLY_DV_PATH 1
// ---- dQ of the d = 128 BF16 tile by TMA reduce-adds (sage_bwd_main_sm90_bf16_persistent_tma_dq) ------------
// The landed dQ tile (warp w: rows 16(w mod 4).., columns (w div 4)·64.., 16 × 64 FP32) goes to the
// warp's own 4 KB of a staging area instead of 16 red.global.add.v2.f32 per thread; the four boxes of a
// warpgroup (one column half, rows 0..63 in order) are one 16 KB box of the accumulator's 4-D tensor map
// (32 columns, d/32 column boxes, n_q rows, B·H_q; box 32 × 2 × 64 × 1, 128-byte swizzle; rows past n_q
// are clipped by the map), added by one cp.reduce.async.bulk.tensor from one lane of the warpgroup's first
// warp once its four warps have staged (a named barrier per warpgroup): two reduces of 16 KB per
// tile rather than eight of 4 KB, one per warp, which the copy engine would serve one after another. The issuing lane waits until its
// reduce has read the area before the next tile's barrier (a) (staged_query_loop), after which any warp may
// stage again. Swizzled staging: the 32-byte group of n-tile j in row g is (j mod 4) ^ (g mod 4), so each
// STS.64 takes 2 shared wavefronts (8 unswizzled: rows of 256 bytes).
// The same FP32 values are added (the accumulator's additions were unordered atomics before too);
// the TMA add is .rn with subnormals flushed, as REDG.E.ADD.F32x2.FTZ.RN.
// The tensor map travels in front of BackwardParams in the kernel's one __grid_constant__ parameter
// (BwdParamsDqMap, dq_map_of).
#define BF16_DQ_WARP_BOX 4096  // bytes of one warp's staging box (16 rows × 64 FP32)
#define BF16_DQ_HALF_BAR0 1           // named barriers 1 (warpgroup 0) and 2 (warpgroup 1): the half staged
// acc[0..1] at shared a = base ^ X (row g), acc[2..3] at a + 2048 (row g + 8).
template <int X>
__device__ __forceinline__ void bf16_dq_sts_pair(u32 base, const float (&acc)[4]) {
    asm volatile("{\n.reg .b32 a;\nxor.b32 a, %0, %1;\nst.shared.v2.f32 [a], {%2, %3};\nst.shared.v2.f32 [a+2048], {%4, %5};\n}\n"
                 ::"r"(base), "n"(X), "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3]));
}
// A landed dQ tile (acc[n]: columns 8n.. of the warp's half, rows g, g + 8) into the warp's staging box
// at `area` (1024-aligned) in the 128-byte swizzle the map's box has: logical byte L = 256·row +
// 128·(n div 4) + 32·(n mod 4) + 8t, physical L ^ (((L >> 7) mod 8) << 4).
__device__ __forceinline__ void bf16_dq_stage(u32 area, const float (*acc)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 box = area + (threadIdx.x >> 5) * BF16_DQ_WARP_BOX;
    const u32 l0 = g * 256 + 8 * t, l1 = l0 + 128;
    const u32 b0 = box + (l0 ^ (((l0 >> 7) & 7) << 4)), b1 = box + (l1 ^ (((l1 >> 7) & 7) << 4));
    // The XOR inside the asm: ptxas would otherwise hoist the 8 per-lane addresses out of the query
    // loop (8 registers held across the tile, spilled at 255).
    static_assert(HEAD_DIM == 128, "BF16 dQ staging: 8 n-tiles per warp");
    bf16_dq_sts_pair<0>(b0, acc[0]);
    bf16_dq_sts_pair<32>(b0, acc[1]);
    bf16_dq_sts_pair<64>(b0, acc[2]);
    bf16_dq_sts_pair<96>(b0, acc[3]);
    bf16_dq_sts_pair<0>(b1, acc[4]);
    bf16_dq_sts_pair<32>(b1, acc[5]);
    bf16_dq_sts_pair<64>(b1, acc[6]);
    bf16_dq_sts_pair<96>(b1, acc[7]);
}
// Warpgroup wg's staged column half of dQ block qb added to the accumulator by one lane of its first warp
// (elect.sync; the warp is converged), as one commit group, once the warpgroup's four warps have fenced
// their stores to the async proxy and met at the half's named barrier. wg: warp-uniform (warpgroup_index).
__device__ __forceinline__ void bf16_dq_reduce(const BackwardParams& p, u32 area, int bh, int qb, int wg) {
    fence_proxy_async();
    named_sync(BF16_DQ_HALF_BAR0 + wg, 128);  // the warpgroup's 128 threads
    if (((threadIdx.x >> 5) & 3) == 0) {
        tma_reduce_add_4d_elect(dq_map_of(p), 0, 2 * wg, qb * BLOCK_Q, bh, area + 4 * wg * BF16_DQ_WARP_BOX);
        bulk_commit();
    }
}
// The staging area is free here: the lane that issued the previous reduce waited for its read before (a).
__device__ __forceinline__ void bf16_bulk_dq(const BackwardParams& p, u32 area, const float (*acc)[4], int bh, int qb, int wg) {
    bf16_dq_stage(area, acc);
    bf16_dq_reduce(p, area, bh, qb, wg);
}
// StagedBf16's layout plus the staging area (8 warps × 4 KB), 1024-aligned for the swizzle.
struct Bf16BulkLayout : StagedBf16::Layout {
    static constexpr int dqst0 = (red + red_bytes + 1023) & ~1023;
    static constexpr int dqst_bytes = (THREADS / 32) * BF16_DQ_WARP_BOX;
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

// StagedBf16EarlyT<false> = StagedBf16Early (sage_bwd_main_sm90_bf16_persistent), <true> = StagedBf16Bulk
// (dQ by TMA reduce-adds; sage_bwd_main_sm90_bf16_persistent_tma_dq). The same tile otherwise.
template <bool BULK>
struct StagedBf16EarlyT : StagedBf16 {
    typedef typename Bf16EarlyLayout<BULK>::type Layout;
    static constexpr bool BULK_DQ = BULK;
    // issue_dq_words with the warpgroup given (warp-uniform to ptxas, as warpgroup_index()).
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
            bf16_bulk_dq(p, smem + Bf16BulkLayout::dqst0, acc, bh, qb, wg);
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
            add_tile_dq(p, smem, acc, bh, qb, warpgroup_index());
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
        const int wg = BULK ? warpgroup_index() : (int)(threadIdx.x >> 7);
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
        // bf16(dS)ᵀ to shared memory for dQ, as tile() stores it without BF16_BWD_STSM_DS.
        store_ds_words(x.ds, da);
        return 0.0f;
    }
};
typedef StagedBf16EarlyT<false> StagedBf16Early;
typedef StagedBf16EarlyT<true> StagedBf16Bulk;
#else
#define BF16_BWD_EARLY_DV_PATH 0
#endif
