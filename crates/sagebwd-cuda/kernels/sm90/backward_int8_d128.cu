#if SAGE128_PIPELINED_LOOP
// The query loop of StagedSage128 pipelined across query blocks (see the note above StagedSage128).
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
// Only Sᵀ crosses the back edge, waited for by wgmma_wait<0> (a partial wait there makes ptxas serialize every
// wgmma, warning C7514).
// S = StagedSage128 (the copies of blocks qb + 1, qb + 2 by cp.async) or StagedSage128TmaStage (by TMA, see its type).
template <class S>
__device__ __forceinline__ float sage128_query_loop(const BackwardParams& p, u32 smem, unsigned char* smem_ptr, int kb, int bh,
                                                 int bh_kv, int qb0, float (*dv)[4], float (*dk)[4]) {
    typedef typename S::Layout Lay;
    const Dims& d = p.dims;
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };
    if (pipelined_no_query_block(d, qb0)) return 0.0f;
    const int wg = warpgroup_index(), t = threadIdx.x & 3;
    const int warp_u = threadIdx.x >> 5;  // plain (a shuffle makes ptxas see the item loop divergent)
    const int rl = (int)threadIdx.x - SAGE128_ROW_THREAD0;  // the row constants: threads SAGE128_ROW_THREAD0 .. + 63, row rl
    const bool row_thread = (unsigned)rl < BLOCK_Q;
    const u32 smem_lo = sage_desc_lo(smem);
    const PipelinedScales sc(p, kb, bh, bh_kv);
    const float s_k = sc.s_k, *q_scale = sc.q_scale, *do_scale = sc.do_scale;
    float s_q = q_scale[qb0], s_do = do_scale[qb0];

    // A of block qb0 + 1 into stage 1 (its B follows in tile qb0), its raw L, D into registers.
    const bool two = qb0 + 1 < d.n_qblk;
    if (two) S::stage_query_a(p, stage(1), bh, qb0 + 1);
    cp_async_commit();
    PipelinedRows rows_next = {pos_inf(), 0.0f, 0.0f};
    if (two && row_thread) rows_next = pipelined_load_rows(p, bh, qb0 + 1, rl);
    u32 bar = 0;  // TMA_STAGE: the mbarrier of the TMA copies issued in tile i (phase i), made visible by the barrier below
    if constexpr (S::TMA_STAGE) {
        __shared__ __align__(8) unsigned long long stage_bar;
        bar = (u32)__cvta_generic_to_shared(&stage_bar);
        if (threadIdx.x == SAGE128_TMA_THREAD) S::init(p, bar);
    }
    // The tile amax's block step by shared atomics (block_max2_atomic, as the d = 64 loop's ATOMIC_AMAX). Its
    // four slots are zeroed here, before the barrier in pipelined_first_wait, at every entry (the persistent grid enters
    // once per item; the previous item's last slot reads were before its closing barrier).
    static_assert(Lay::dqst0 - Lay::red >= 128 && Lay::red % 32 == 0, "block_max2_atomic needs a 128-byte, 32-byte aligned scratch");
    const u32 amax_lane_off = (threadIdx.x & 31) == 0 ? 0u : 32u + 4u * (threadIdx.x & 15);
    if (threadIdx.x < 8) ((float*)(smem_ptr + Lay::red))[threadIdx.x] = 0.0f;
    pipelined_first_wait(smem);

    int s_acc[8][4];
    S::wg_issue_scores(s_acc, smem_lo, sage_desc_lo(stage(0)), wg);

    float dq_scale = 0.0f;  // of the pending dQ tile (block qb − 1)
    for (int qb = qb0; qb < d.n_qblk; ++qb) {
        const int i = qb - qb0, par = i & 1;
        const bool has_next = qb + 1 < d.n_qblk, has_next2 = qb + 2 < d.n_qblk;
        const float* rows = rows_of(par);
        const float s_qk = __fmul_rn(__fmul_rn(s_q, p.c_lambda), s_k);  // fl(fl(s_Q·cλ)·s_K), §4
        const int qn = has_next ? qb + 1 : qb;
        const float s_q_next = q_scale[qn], s_do_next = do_scale[qn];
        const u32 st_lo = sage_desc_lo(stage(par));

        // P = exp2(fma(float(S), s, −L)) (tile_p_regs), L read before the wait; dPᵀ runs meanwhile.
        float2 L[8];
        pipelined_row_pairs(L, rows, t);
        wgmma_wait<0>();  // Sᵀ of qb
        wgmma_fence_regs(s_acc);
        float ds[8][4];  // dPᵀ, then dS in place
        S::wg_issue_dp(ds, smem_lo, st_lo, wg);
        float prob[8][4];
        pipelined_prob(prob, s_acc, s_qk, L);
        float amax_p = sage_tile_max<false>(prob);  // redone below if the tile is masked
        // dS = fl(P·fl(dP − D)) (sage_ds_regs), D read before the wait.
        float2 D[8];
        pipelined_row_pairs(D, rows + BLOCK_Q, t);
        wgmma_wait<0>();  // dPᵀ of qb
        wgmma_fence_regs(ds);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D[nt].y : D[nt].x));
        if (sage_mask(d, qb, kb, prob, ds)) amax_p = sage_tile_max<false>(prob);  // warp-uniform
        float amax_ds = sage_tile_max<true>(ds);
        if (has_next && row_thread) pipelined_store_rows_at(rows_of(par ^ 1), rows_next, rl);
        bulk_wait_read();  // tile i − 1's bulk has read staging tile par, which this tile writes after (b)
        cp_async_wait<0>();       // this thread's copies of A(qb + 1), B(qb) (TMA_STAGE: of A(qb0 + 1) only)
        if constexpr (S::TMA_STAGE)
            if (i > 0) mbar_wait(bar, (i - 1) & 1);  // TMA_STAGE: tile i − 1's boxes, A(qb + 1) and B(qb), landed
        fence_proxy_async();      // they, the dŜ stores of qb − 1 and the dQ staging stores → the async proxy
        block_max2_atomic(amax_p, amax_ds, smem + Lay::red + 8 * (i & 3), amax_lane_off);  // (b)
        GroupScale sc_p, sc_ds;
        // The branch-free scales (group_scale_of_amax, as the d = 64 loop) instead of a division and shuffles.
        group_scale_of_amax(amax_p, sc_p);
        group_scale_of_amax(amax_ds, sc_ds);

        // dQ of block qb − 1 (every tile: the same commit groups each time; the first tile's is stale).
        int dq_acc[HEAD_DIM / 16][4];
        wgmma_fence();
        StagedSage::issue_dq(dq_acc, smem_lo, sage_desc_lo(smem + Lay::ds0 + (par ^ 1) * Lay::ds_bytes));
        wgmma_commit();
        if constexpr (S::TMA_STAGE) {
            if (threadIdx.x == SAGE128_TMA_THREAD && has_next) S::stage_copies(p, bar, stage(par), stage(par ^ 1), bh, qb + 2, qb + 1, has_next2);
        } else {
            if (has_next2) S::stage_query_a(p, stage(par), bh, qb + 2);
            if (has_next) S::stage_query_b(p, stage(par ^ 1), bh, qb + 1);
            cp_async_commit();
        }
        PipelinedRows rows_next2 = {pos_inf(), 0.0f, 0.0f};
        if (has_next2 && row_thread) rows_next2 = pipelined_load_rows(p, bh, qb + 2, rl);
        // dQ of block qb − 2, staged by tile i − 1 in staging tile par ^ 1, visible since (b).
        if (i >= 2) sage128_bulk_dq(p, smem + Lay::dqst0 + (par ^ 1) * Lay::dqst_bytes, bh, qb - 2, warp_u);

        u32 pa[2][4], da[2][4];
        // wg_key_products' chunks (dV's 4, then dK's 4, two in flight), dQ(qb − 1) staged after the first two
        // are issued, Sᵀ(qb + 1) after the last.
        constexpr int C = HEAD_DIM / 32, N = 2 * C;
        int acc[2][4][4];
        // P̂ first, dV's first two chunks issued, then dŜ quantized and stored while they run.
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
            if (j == N - 3) S::wg_issue_scores(s_acc, smem_lo, sage_desc_lo(stage(par ^ 1)), wg);  // block qb + 1
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
    if (n >= 2) sage128_bulk_dq(p, smem + Lay::dqst0 + ((n - 1) & 1) * Lay::dqst_bytes, bh, d.n_qblk - 2, warp_u);
    return dq_scale;
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage128>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                  const QueryStager<StagedSage128>&, int kb, int bh, int bh_kv,
                                                                  int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage128_query_loop<StagedSage128>(p, smem, smem_ptr, kb, bh, bh_kv, qb0, dv, dk);
}
template <>
__device__ __forceinline__ float staged_query_loop<StagedSage128TmaStage>(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                                   const QueryStager<StagedSage128TmaStage>&, int kb, int bh, int bh_kv,
                                                                   int qb0, float (*dv)[4], float (*dk)[4]) {
    return sage128_query_loop<StagedSage128TmaStage>(p, smem, smem_ptr, kb, bh, bh_kv, qb0, dv, dk);
}
#endif
