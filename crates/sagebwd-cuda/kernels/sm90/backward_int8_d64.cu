#if SAGE64_PIPELINED_LOOP
// dPᵀ's registers: declared in the loop (ds_in) or, with F (dPᵀ issued a tile ahead), before it (PipelinedDs).
template <bool F>
struct PipelinedDs {
    __device__ __forceinline__ float (&pick(float (&ds_in)[8][4]))[8][4] { return ds_in; }
};
template <>
struct PipelinedDs<true> {
    float v[8][4];
    __device__ __forceinline__ float (&pick(float (&)[8][4]))[8][4] { return v; }
};

// TMA_DQ: the kernel's parameter is BwdParamsDqMap, the dQ accumulator's tensor map (4-D: 32 columns, d/32
// column blocks, n_q rows, B·H_q; box 32 × 1 × 16 × 1, 128-byte swizzle; rows past n_q clipped; src/backward.rs)
// followed by BackwardParams (dq_map_of).
#define DQ_TMA_WARP_BOX 2048                    // one warp's staging box: 16 rows × 32 FP32
#define DQ_TMA_BOXES ((THREADS / 32) * DQ_TMA_WARP_BOX)  // one tile's 8 boxes
// {x, y} at shared (base ^ X) (row g) and {z, w} at (base ^ X) + 1024 (row g + 8).
template <int X>
__device__ __forceinline__ void dq_box_sts_pair(u32 base, float x, float y, float z, float w) {
    asm volatile("{\n.reg .b32 a;\nxor.b32 a, %0, %1;\nst.shared.v2.f32 [a], {%2, %3};\nst.shared.v2.f32 [a+1024], {%4, %5};\n}\n"
                 ::"r"(base), "n"(X), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
// The landed dQ tile (the values pipelined_stage_dq_rot stages: fl(float(acc)·scale), sage_i2f) into the warp's box at
// boxes + 2048·warp (boxes 1024-aligned): rows 16(w mod 4) + g (+ 8), columns (w div 4)·32 + 8n + 2t (+ 1) at box byte
// L = 128·row + 32n + 8t, physical L ^ ((row mod 8) << 4) (the map's swizzle): for each n the 32 lanes hit 2 × 8
// distinct 16-byte chunks of 8 rows, 2 wavefronts per STS.64, no selects.
__device__ __forceinline__ void dq_box_stage(u32 boxes, const int (*acc)[4], float scale) {
    static_assert(HEAD_DIM == 64, "dq_box_stage: 4 n-tiles per warp");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 b0 = boxes + warp * DQ_TMA_WARP_BOX + 128 * g + ((8 * t) ^ (g << 4));  // bits 5, 6 of the box row clear
    float v[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) v[n][e] = __fmul_rn(sage_i2f(acc[n][e]), scale);
    dq_box_sts_pair<0>(b0, v[0][0], v[0][1], v[0][2], v[0][3]);
    dq_box_sts_pair<32>(b0, v[1][0], v[1][1], v[1][2], v[1][3]);
    dq_box_sts_pair<64>(b0, v[2][0], v[2][1], v[2][2], v[2][3]);
    dq_box_sts_pair<96>(b0, v[3][0], v[3][1], v[3][2], v[3][3]);
}
// TMA_DQ: the dQ block, staged a tile earlier in 8 warp boxes (stores fenced and visible since (b)), added to the accumulator
// as two tensor reduces of 64 rows × 32 columns (the 4 boxes of a column half lie one after another, rows in
// order, in the same 128-byte swizzle, so the host's map has 64-row boxes; src/backward.rs `dq_acc_map`), both from one
// lane of warp SAGE64_TMA_DQ_WARP, as one commit group: pipelined_bulk_dq's place and contract (faster than one
// box per warp from its own lane; 8 boxes from one lane are slower). The row constants stay on threads 0..63: at d = 64
// putting both duties on warpgroup 1, as at d = 128, is slower.
#define SAGE64_TMA_DQ_WARP 5
__device__ __forceinline__ void sage64_tma_reduce_dq(const BackwardParams& p, u32 boxes, int bh, int qb, int warp_u) {
    if (warp_u != SAGE64_TMA_DQ_WARP) return;
#pragma unroll
    for (int c = 0; c < 2; ++c) tma_reduce_add_4d_elect(dq_map_of(p), 0, c, qb * BLOCK_Q, bh, boxes + 4 * c * DQ_TMA_WARP_BOX);
    bulk_commit();
}
template <class Path>
__device__ __forceinline__ float sage64_query_loop(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                   const QueryStager<Path>& stage_next, int kb, int bh,
                                                   int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    typedef typename Path::Layout Lay;
    constexpr bool BULK = Path::BULK_DQ, F = Path::DP_AHEAD, SPLIT = Path::SPLIT_MASK;
    constexpr bool TQ = Path::TMA_DQ;
    const Dims& d = p.dims;
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };
    if (pipelined_no_query_block(d, qb0)) return 0.0f;
    const int wg = warpgroup_index(), t = threadIdx.x & 3;
    const bool row_thread = pipelined_row_thread<Path::ROWS_8>();
    const int rl = pipelined_row_of_thread<Path::ROWS_8>();
    const int warp_u = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0);  // the warp, uniform to ptxas
    const u32 smem_lo = sage_desc_lo(smem);
    // TQ: two sets of 8 warp boxes (tile i stages into set i mod 2), 1024-aligned, inside the staging tiles' bytes.
    const u32 tq_boxes = (smem + Lay::dqst0 + 1023u) & ~1023u;
    static_assert(!TQ || ((Lay::dqst0 + 1023) & ~1023) + 2 * DQ_TMA_BOXES <= Lay::dqst0 + 2 * Lay::dqst_bytes,
                  "TMA_DQ: the warp boxes inside the staging tiles");
    const PipelinedScales sc(p, kb, bh, bh_kv);
    const float s_k = sc.s_k, *q_scale = sc.q_scale, *do_scale = sc.do_scale;
    float s_q = q_scale[qb0], s_do = do_scale[qb0];

    // Block qb0 + 1 into stage 1, its L, D into registers (stored in tile qb0).
    const bool two = qb0 + 1 < d.n_qblk;
    if (two) stage_next(p, stage(1), bh, qb0 + 1);
    cp_async_commit();
    PipelinedRows rows_next = {pos_inf(), 0.0f, 0.0f};
    if (two && row_thread) rows_next = pipelined_load_rows(p, bh, qb0 + 1, rl);
    // ATOMIC_AMAX: 4 slots of 2 floats, then sink words (smem is 1024-byte aligned, so red is 32-byte aligned).
    static_assert(!Path::ATOMIC_AMAX || (Lay::dqst0 - Lay::red >= 128 && Lay::red % 32 == 0),
                  "block_max2_atomic needs a 128-byte, 32-byte aligned scratch");
    const u32 amax_lane_off = (threadIdx.x & 31) == 0 ? 0u : 32u + 4u * (threadIdx.x & 15);
    if (Path::ATOMIC_AMAX && threadIdx.x < 8) ((float*)(smem_ptr + Lay::red))[threadIdx.x] = 0.0f;  // before the first barrier
    pipelined_first_wait(smem);

    int s_acc[8][4];
    StagedSage::wg_issue_scores(s_acc, smem_lo, sage_desc_lo(stage(0)), wg);
    PipelinedDs<F> ds_ahead;  // F: dPᵀ of the next block, in flight across the back edge
    if (F) {
        float unused[8][4];
        StagedSage::wg_issue_dp(ds_ahead.pick(unused), smem_lo, sage_desc_lo(stage(0)), wg);
    }

    float dq_scale = 0.0f;  // of the pending dQ tile (block qb − 1)
    u32 st_cur = stage(0), st_next = stage(1), st_free = stage(2);
    // SPLIT_MASK: the loop body once with the mask (MASKED: tiles whose key block some row of the query block
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

        // P = exp2(fma(float(S), s, −L)) (tile_p_regs), L read before the wait; dPᵀ runs meanwhile.
        float2 L[8], D[8];
        pipelined_row_pairs(L, rows, t);
        float ds_in[8][4];  // dPᵀ, then dS in place (without F)
        float (&ds)[8][4] = ds_ahead.pick(ds_in);
        wgmma_wait<0>();  // Sᵀ of qb (F: and dPᵀ)
        wgmma_fence_regs(s_acc);
        if (F) {
            wgmma_fence_regs(ds);
        } else {
            StagedSage::wg_issue_dp(ds, smem_lo, sage_desc_lo(st_cur), wg);
        }
        float prob[8][4];
        pipelined_prob(prob, s_acc, s_qk, L);
        float amax_p = sage_tile_max<false>(prob);  // redone below if the tile is masked
        // dS = fl(P·fl(dP − D)) (sage_ds_regs), D read before the wait.
        pipelined_row_pairs(D, rows + BLOCK_Q, t);
        if (!F) {
            wgmma_wait<0>();  // dPᵀ of qb
            wgmma_fence_regs(ds);
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D[nt].y : D[nt].x));
        if (MASKED && sage_mask(d, qb, kb, prob, ds)) amax_p = sage_tile_max<false>(prob);  // warp-uniform
        float amax_ds = sage_tile_max<true>(ds);
        if (has_next && row_thread) pipelined_store_rows_at(rows_of(par ^ 1), rows_next, rl);
        if (BULK) bulk_wait_read();  // staging tile par (its bulk of tile i − 1) free after (b)
        cp_async_wait<0>();   // this thread's copies of block qb + 1
        fence_proxy_async();  // they and the dŜ stores of block qb − 1 → wgmma's reads
        if (Path::ATOMIC_AMAX) {
            block_max2_atomic(amax_p, amax_ds, smem + Lay::red + 8 * (i & 3), amax_lane_off);  // (b)
        } else {
            block_max2(amax_p, amax_ds, (float*)(smem_ptr + Lay::red + par * Lay::red_bytes));  // (b)
        }
        GroupScale sc_p, sc_ds;
        if (SPLIT) {  // the branch-free scales (group_scale_of_amax)
            group_scale_of_amax(amax_p, sc_p);
            group_scale_of_amax(amax_ds, sc_ds);
        } else {
            sage_group_scales(amax_p, amax_ds, sc_p, sc_ds);
        }

        // dQ of block qb − 1 (every tile: the same commit groups each time; the first tile's is stale).
        int dq_acc[HEAD_DIM / 16][4];
        wgmma_fence();
        StagedSage::issue_dq(dq_acc, smem_lo, sage_desc_lo(smem + Lay::ds0 + (par ^ 1) * Lay::ds_bytes));
        wgmma_commit();
        // Block qb + 2 into the stage block qb − 1 had (every warp is past its products: (b)).
        if (has_next2) stage_next(p, st_free, bh, qb + 2);
        cp_async_commit();
        PipelinedRows rows_next2 = {pos_inf(), 0.0f, 0.0f};
        if (has_next2 && row_thread) rows_next2 = pipelined_load_rows(p, bh, qb + 2, rl);
        // BULK: dQ of block qb − 2, staged in tile i − 1 (tile par ^ 1), visible since (b).
        if (BULK && i >= 2) {
            if (TQ) {
                sage64_tma_reduce_dq(p, tq_boxes + (par ^ 1) * DQ_TMA_BOXES, bh, qb - 2, warp_u);
            } else {
                pipelined_bulk_dq(p, smem + Lay::dqst0 + (par ^ 1) * Lay::dqst_bytes, bh, qb - 2, warp_u);
            }
        }

        u32 pa[2][4], da[2][4];
        StagedSage::quantize_tile(prob, ds, sc_p.inv, sc_ds.inv, smem_ptr + Lay::ds0 + par * Lay::ds_bytes, pa, da);
        const float scale_v = __fmul_rn(sc_p.scale, s_do), scale_k = __fmul_rn(sc_ds.scale, s_q);
        const u32 st_lo = sage_desc_lo(st_cur);
        int acc[2][4][4];
        StagedSage::wg_issue_chunk(acc[0], pa, st_lo, StagedSage::dot, 0);
        StagedSage::wg_issue_chunk(acc[1], pa, st_lo, StagedSage::dot, 1);
        wgmma_wait<2>();  // dQ of qb − 1 landed
        wgmma_fence_regs(dq_acc);
        if (BULK) {
            if (i > 0) {  // block-uniform
                if (TQ) {
                    dq_box_stage(tq_boxes + par * DQ_TMA_BOXES, dq_acc, dq_scale);
                } else if (Path::ROT_DQ) {
                    static_assert(!Path::ROT_DQ || (Lay::dqst0 % (2 * HEAD_DIM) == 0 && Lay::dqst_bytes % (2 * HEAD_DIM) == 0),
                                  "pipelined_stage_dq_rot's XOR addressing needs 32·NT-byte aligned staging tiles");
                    pipelined_stage_dq_rot(smem + Lay::dqst0 + par * Lay::dqst_bytes, dq_acc, dq_scale);
                } else {
                    pipelined_stage_dq(smem_ptr + Lay::dqst0 + par * Lay::dqst_bytes, dq_acc, dq_scale);
                }
            }
        } else {
            if (i > 0) sage_add_dq(p, dq_acc, dq_scale, bh, qb - 1);  // block-uniform
        }
        wgmma_wait<1>();
        wgmma_fence_regs(acc[0]);
        StagedSage::dequant_chunk(acc[0], dv, scale_v);
        StagedSage::wg_issue_chunk(acc[0], da, st_lo, StagedSage::qt, 0);
        wgmma_wait<1>();
        wgmma_fence_regs(acc[1]);
        StagedSage::dequant_chunk(acc[1], dv + 4, scale_v);
        StagedSage::wg_issue_chunk(acc[1], da, st_lo, StagedSage::qt, 1);
        StagedSage::wg_issue_scores(s_acc, smem_lo, sage_desc_lo(st_next), wg);  // block qb + 1
        if (F) {
            StagedSage::wg_issue_dp(ds, smem_lo, sage_desc_lo(st_next), wg);  // block qb + 1
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
            sage64_tma_reduce_dq(p, tq_boxes + ((n - 1) & 1) * DQ_TMA_BOXES, bh, d.n_qblk - 2, warp_u);
        } else {
            pipelined_bulk_dq(p, smem + Lay::dqst0 + ((n - 1) & 1) * Lay::dqst_bytes, bh, d.n_qblk - 2, warp_u);
        }
    }
    return dq_scale;
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage64TmaDq>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                  const QueryStager<StagedSage64TmaDq>& stage_next, int kb, int bh,
                                                                  int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage64_query_loop<StagedSage64TmaDq>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage64>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                 const QueryStager<StagedSage64>& stage_next, int kb, int bh,
                                                                 int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage64_query_loop<StagedSage64>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage64Persistent>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                  const QueryStager<StagedSage64Persistent>& stage_next, int kb, int bh,
                                                                  int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage64_query_loop<StagedSage64Persistent>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
}
#endif

