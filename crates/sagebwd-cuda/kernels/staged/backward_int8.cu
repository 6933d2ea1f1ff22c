// ---- The INT8 tile: #3, #4, #6, #7 INT8, #5 BF16 ---------------------------------------------------------
struct StagedSage {
    // Key block: K̂, K̂ᵀ (BF_KT bytes each), V (2·BF_KT); stage: Q̂, dO (2·BF_QT), dÔᵀ, Q̂ᵀ; dŜ bytes.
    // (Two stages; the pipelined loop's type StagedSage64 below has its own layout.)
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
            wgmma_s8_ss_n64(s, sage_kstep_desc<BLOCK_KV, HEAD_DIM>(smem_lo, 0, 64 * wg, ks),
                            sage_kstep_desc<BLOCK_Q, HEAD_DIM>(st_lo, 0, 0, ks), ks);
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)  // = wg_issue_bf16_keys_by_rows(dp, smem + v, st + d_o, wg)
            wgmma_bf16_ss_n64(dp, sage_kstep_desc<BLOCK_KV, BF_ROW>(smem_lo, v, 64 * wg, ks),
                              sage_kstep_desc<BLOCK_Q, BF_ROW>(st_lo, d_o, 0, ks), ks);
        wgmma_commit();
    }

    // The pipelined loops (d = 64 and d = 128): wg_issue_scores_dp's two commit groups as two calls (Sᵀ goes out a
    // tile ahead, dPᵀ with its tile).
    static __device__ __forceinline__ void wg_issue_scores(int (&s)[8][4], u32 smem_lo, u32 st_lo, int wg) {
        wgmma_fence();  // the accumulators were last read by ordinary instructions
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 32; ++ks)
            wgmma_s8_ss_n64(s, sage_kstep_desc<BLOCK_KV, HEAD_DIM>(smem_lo, 0, 64 * wg, ks),
                            sage_kstep_desc<BLOCK_Q, HEAD_DIM>(st_lo, 0, 0, ks), ks);
        wgmma_commit();
    }
    static __device__ __forceinline__ void wg_issue_dp(float (&dp)[8][4], u32 smem_lo, u32 st_lo, int wg) {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
            wgmma_bf16_ss_n64(dp, sage_kstep_desc<BLOCK_KV, BF_ROW>(smem_lo, v, 64 * wg, ks),
                              sage_kstep_desc<BLOCK_Q, BF_ROW>(st_lo, d_o, 0, ks), ks);
        wgmma_commit();
    }

    // Issues acc = a (the warp's 16 keys × 64 rows: 2 k-steps of A fragments) · columns 32c..32c + 31
    // of the [d][64] tile at bt (K-major, rows contiguous), exact INT32, as one commit group.
    // of the [d][64] tile at byte bt_off of the stage whose descriptor low word is st_lo.
    static __device__ __forceinline__ void wg_issue_chunk(int (&acc)[4][4], const u32 (*a)[4], u32 st_lo, u32 bt_off, int c) {
        wgmma_fence();  // acc was read, a written, by ordinary instructions since the last wgmma
#pragma unroll
        for (int ks = 0; ks < BLOCK_Q / 32; ++ks)
            wgmma_s8_rs_n32(acc, a[ks], sage_kstep_desc<HEAD_DIM, BLOCK_Q>(st_lo, bt_off, 32 * c, ks), ks);
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
    // I2FP: one I2FP per value at every d (the d = 128 pipelined tile), else sage_i2f.
    template <bool I2FP = false>
    static __device__ __forceinline__ void dequant_chunk(const int (*acc)[4], float (*out)[4], float scale) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                out[nt][e] = __fmaf_rn(I2FP ? (float)acc[nt][e] : sage_i2f(acc[nt][e]), scale, out[nt][e]);
    }
#endif

    // P̂ᵀ, dŜᵀ (pa, da: the A fragments of dV's and dK's products, k-step s: rows 32s..) of the tile's
    // P and dS by the group scales' inverses, and the dŜ bytes into the tile at ds_tile.
    static __device__ __forceinline__ void quantize_tile(float (*prob)[4], float (*ds)[4], float inv_p, float inv_ds,
                                                         unsigned char* ds_tile, u32 (*pa)[4], u32 (*da)[4]) {
        quantize_words<true>(prob, ds, inv_p, inv_ds, ds_tile, pa, da);
    }
    // quantize_tile's two halves: the d = 128 pipelined loop issues dV's first chunks between them, so that those
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
        const u32 smem_lo = sage_desc_lo(x.smem), st_lo = sage_desc_lo(x.st);
        // Issued on every tile (the same commit groups each time, or ptxas serializes); the first
        // tile's result (of a stale buffer) is not added.
        int dq_acc[HEAD_DIM / 16][4];
        wgmma_fence();
        issue_dq(dq_acc, smem_lo, sage_desc_lo(x.prev_ds));
        wgmma_commit();
        wg_issue_scores_dp(s_acc, ds, smem_lo, st_lo, warpgroup_index());
        wgmma_wait<2>();  // dQ of block qb − 1 landed; Sᵀ, dPᵀ run on
        wgmma_fence_regs(dq_acc);
        if (x.has_prev) sage_add_dq(p, dq_acc, x.prev_dq_scale, x.bh, x.qb - 1);  // block-uniform
        else interleave_kt_for_dq(x.smem + kt);  // the CTA's first tile; block (b) below is the barrier
        wgmma_wait<1>();  // Sᵀ done; dPᵀ may still run
        wgmma_fence_regs(s_acc);
        tile_p_regs<true>(x.rows, s_acc, s_qk, prob);
        amax_p = sage_tile_max<false>(prob);  // while dPᵀ runs; redone below if the tile is masked
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
        amax_p = sage_tile_max<false>(prob);
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
        const int wg = warpgroup_index();
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 32; ++ks)
            wgmma_s8_ss(acc, sage_kstep_desc<BLOCK_Q, BLOCK_KV>(ds_lo, 0, 0, ks),
                        sage_kstep_desc<HEAD_DIM, BLOCK_KV>(smem_lo, kt, wg * (HEAD_DIM / 2), ks), ks);
    }
#endif

    // dS = P ∘ (dP − D) (sage_ds_regs), the mask, P's and dS's block amax (barrier (b); amax_p: P's warp
    // amax before the mask), their group scales, and P̂, dŜ quantized: dŜ stored at x.ds, both as A fragments.
    static __device__ __forceinline__ void quantize_p_ds(const Dims& d, const StagedTile& x, float (*prob)[4], float (*ds)[4],
                                                         float amax_p, GroupScale& sc_p, GroupScale& sc_ds, u32 (*pa)[4],
                                                         u32 (*da)[4]) {
        sage_ds_regs(x.rows, prob, ds);
        if (sage_mask(d, x.qb, x.kb, prob, ds)) amax_p = sage_tile_max<false>(prob);  // warp-uniform
        float amax_ds = sage_tile_max<true>(ds);
        block_max2(amax_p, amax_ds, x.red);  // (b)
        sage_group_scales(amax_p, amax_ds, sc_p, sc_ds);
        quantize_tile(prob, ds, sc_p.inv, sc_ds.inv, x.ds, pa, da);
    }

    // Every product of tile() has been waited for inside it.
    static __device__ __forceinline__ void drain(float (*)[4], float (*)[4]) {}

    // dQ += dŜ K̂ (#6) for the warp's rows and half of d (dŜ at shared address ds_tile). I2FP, ROT_ACC: as
    // sage_add_dq's (wgmma dQ only).
    template <bool I2FP = false, bool ROT_ACC = false>
    static __device__ __forceinline__ void dq(const BackwardParams& p, u32 smem, u32 ds_tile, float scale, int bh, int qb) {
#if BWD_WGMMA
        int acc[HEAD_DIM / 16][4];
        wgmma_fence();
        issue_dq(acc, sage_desc_lo(smem), sage_desc_lo(ds_tile));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(acc);
        sage_add_dq<I2FP, ROT_ACC>(p, acc, scale, bh, qb);
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

#define SAGE_DQ_STAGING_ROW (HEAD_DIM * 4)  // bytes of one dQ staging row (unpadded)
// A landed dQ tile of the wgmma layout (the values sage_add_dq adds: fl(float(acc)·scale)) into a
// staging tile (I2FP: as sage_add_dq's): warp w's rows 16(w mod 4) + lane/4 (+ 8), columns (w div 4)·d/2 + 8n + 2(lane mod 4).
template <bool I2FP = false>
__device__ __forceinline__ void pipelined_stage_dq(unsigned char* tile, const int (*acc)[4], float scale) {
    const auto cvt = [](int a) { return I2FP ? (float)a : sage_i2f(a); };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* lo = (float*)(tile + ((warp & 3) * 16 + (lane >> 2)) * SAGE_DQ_STAGING_ROW) + (warp >> 2) * (HEAD_DIM / 2) + 2 * (lane & 3);
    float* hi = lo + 8 * (SAGE_DQ_STAGING_ROW / 4);
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 16; ++n) {
        *(float2*)(lo + 8 * n) = make_float2(__fmul_rn(cvt(acc[n][0]), scale), __fmul_rn(cvt(acc[n][1]), scale));
        *(float2*)(hi + 8 * n) = make_float2(__fmul_rn(cvt(acc[n][2]), scale), __fmul_rn(cvt(acc[n][3]), scale));
    }
}

// ROT_DQ (d = 64 and d = 128): pipelined_stage_dq's values at
// pipelined_stage_dq's addresses, the order of the stores permuted per row. Rows are 4d bytes (256 or 512),
// so every row of a 16-row block starts at the same bank and
// pipelined_stage_dq's STS.64 (8 rows × 32 bytes, n-tile j of every row) takes 8 wavefronts, not 2. Here
// store j of lane (r = lane/4, c = lane mod 4) writes n-tile j ^ k, k = r mod 4 (columns 8(j ^ k) + 2c,
// +1 of the warp's half): rows r and r + 4 share a group of 8 banks, the 4 groups differ, 2 wavefronts.
// With NT = d/16 n-tiles per warp (4 or 8) and the tile 32·NT-byte aligned (ALIGNED: d = 64's 1024-byte
// layout start, dqst0 and dqst_bytes multiples of 128, checked where the tile is chosen), the lane's
// offset has bits 5 .. 4 + log2(NT) clear, so the address of store j is (base + 32k) ^ 32j. The values
// are picked by two select stages (swap n-tiles j, j ^ 1 where k & 1, then j, j ^ 2 where k & 2).
__device__ __forceinline__ void pipelined_sts_f2(u32 addr, float2 v) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}
// ALIGNED = false (d = 128's layout: the tile only 16-byte aligned): the XOR on the offset within the tile,
// then one add per store; the whole warp's addresses shift by the same amount, so the banks stay distinct.
// SELECT = false (d = 128 on sm_90a: SAGE_DQ_ACC_ROT): store j writes n-tile j itself at that address,
// so row r's n-tile m lands at position m ^ (r mod 4), the layout the accumulator keeps (common.cuh): the
// same banks, without the 4·NT selects per thread (2 per score at d = 128).
template <bool I2FP = false, bool ALIGNED = true, bool SELECT = true>
__device__ __forceinline__ void pipelined_stage_dq_rot(u32 tile, const int (*acc)[4], float scale) {
    constexpr int NT = HEAD_DIM / 16;
    static_assert(NT == 4 || NT == 8, "the permutation assumes 4 or 8 n-tiles per warp");
    const auto cvt = [](int a) { return I2FP ? (float)a : sage_i2f(a); };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int k = (lane >> 2) & 3;
    const u32 off = ((warp & 3) * 16 + (lane >> 2)) * SAGE_DQ_STAGING_ROW + (warp >> 2) * (HEAD_DIM * 2) + 8 * (lane & 3) + 32 * k;
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
        pipelined_sts_f2(a, v[0][j]);
        pipelined_sts_f2(a + 8 * SAGE_DQ_STAGING_ROW, v[1][j]);
    }
}
