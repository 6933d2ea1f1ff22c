#if SAGE64_PIPELINED_LOOP || SAGE128_PIPELINED_LOOP
// The INT8 query loops of sm_90a, software-pipelined across query blocks (see the note on the pipelined loop in
// staged/backward_helpers.cuh; the d = 64 loop, sage64_query_loop, is StagedSagePipelined's, options there). Same contract as the generic loop: entered with the key block and
// block qb0 staged (one commit group) and qb0's row constants stored; leaves every dQ but the last
// added, the last block's dŜ complete behind a barrier, and no wgmma or copy in flight. Per tile,
// block qb (i = qb − qb0; stage i mod 3; L, D and dŜ buffers i mod 2; amax scratch i mod 2):
//   Sᵀ of qb was issued at the end of tile qb − 1 (before the loop for qb0); wait for it, issue dPᵀ
//   → P while dPᵀ runs; dS; the warps' amax; L, D of qb + 1 stored; this thread's copies of qb + 1
//   complete
//   → (b) the one block barrier of the tile: the tile amax; stage qb + 1, dŜ of qb − 1, L, D of qb + 1
//     visible; every warp past tile qb − 1's products (its stage, i + 2 mod 3, and its amax scratch
//     free) and past its dQ wgmma of qb − 2 (dŜ buffer i mod 2 free)
//   → group scales; dQ of qb − 1 issued (stale and not added on the first tile, as before); qb + 2
//     staged, its L, D loaded; P̂, dŜ quantized, dŜ stored; dV chunks issued; dQ of qb − 1 added;
//     dK chunks issued; Sᵀ of qb + 1 issued (of a stale stage and unused on the last tile: the commit
//     groups are the same on every tile); the dK chunks dequantized while it runs.
// No wgmma is read across the loop's back edge before a wait for all (wgmma_wait<0>): with a
// partial wait there, ptxas serializes every wgmma of the kernel (C7514). Only Sᵀ crosses it.
// Row constants travel as raw loads (lse2, row offset, D) and are subtracted when stored, a tile
// later: the subtraction waited for the global load right after it, in warps 0 and 1 only, and their
// warpgroup's next wgmma waited for them (ncu, base: ~4 % of the samples).
struct PipelinedRows {
    float lse2, off, D;
};
__device__ __forceinline__ PipelinedRows pipelined_load_rows(const BackwardParams& p, int bh, int qb, int rl) {
    PipelinedRows r = {pos_inf(), 0.0f, 0.0f};
    const int q = qb * BLOCK_Q + rl;
    if (q < p.dims.n_q) {
        const long row = (long)bh * p.dims.n_q + q;
        r.lse2 = p.lse2[row];
        if (p.flags & F_QK_BWD) r.off = p.op.row_offset[row];
        r.D = p.delta[row];
    }
    return r;
}

// ROWS_8: the row constants' thread: lanes 0..7 of each warp, row 8·warp + lane; else threads 0..63.
template <bool ROWS8>
__device__ __forceinline__ bool pipelined_row_thread() {
    return ROWS8 ? (threadIdx.x & 31) < 8 : threadIdx.x < BLOCK_Q;
}
template <bool ROWS8>
__device__ __forceinline__ int pipelined_row_of_thread() {
    return ROWS8 ? (threadIdx.x >> 5) * 8 + (threadIdx.x & 31) : threadIdx.x;
}
// Row rl's L, D as load_row_consts gives them: fl(lse2 − off) with F_QK_BWD, else lse2 (= fl(lse2 − 0), −0
// and ∞ included).
__device__ __forceinline__ void pipelined_store_rows_at(float* rows, const PipelinedRows& r, int rl) {
    rows[rl] = __fsub_rn(r.lse2, r.off);
    rows[BLOCK_Q + rl] = r.D;
}

// BULK_DQ: *dst += the `bytes` FP32 bytes at shared src, by one lane of the (converged)
// warp that elect.sync picks, where `pred`. Warp-uniform operands: ptxas issues it once per warp from
// uniform registers (a per-lane address became a loop over the active lanes, ~8 instructions per row).
__device__ __forceinline__ void pipelined_bulk_red_add(bool pred, float* dst, u32 src, u32 bytes) {
    asm volatile("{\n.reg .pred e, v;\nsetp.ne.b32 v, %0, 0;\nelect.sync _|e, 0xffffffff;\nand.pred e, e, v;\n"
                 "@e cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%1], [%2], %3;\n}\n"
                 ::"r"((int)pred), "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// The staged dQ tile of block qb added to the accumulator: rows 8w..8w + 7 (those < n_q, 2 KB contiguous)
// by warp w (warp_u = w, warp-uniform to ptxas) in one bulk reduce. One commit group per call per thread.
__device__ __forceinline__ void pipelined_bulk_dq(const BackwardParams& p, u32 tile, int bh, int qb, int warp_u) {
    const int q0 = qb * BLOCK_Q + 8 * warp_u;
    float* dst = p.dq_acc + ((long)bh * p.dims.n_q + q0) * HEAD_DIM;
    const u32 src = tile + 8 * warp_u * SAGE_DQ_STAGING_ROW;
    const int rows = min(8, p.dims.n_q - q0);  // warp-uniform
    pipelined_bulk_red_add(rows > 0, dst, src, (u32)max(rows, 0) * (HEAD_DIM * 4));
    bulk_commit();
}

// The d = 128 loop's staged dQ tile of block qb added by one bulk reduce of its rows < n_q
// (32 KB at d = 128, contiguous in the staging tile and in the accumulator), issued by warp SAGE_BULK_DQ_WARP alone instead
// of by every warp for its 8 rows (pipelined_bulk_dq, which the d = 64 kernels without TMA reduces keep). One commit group
// per call for that warp's threads; only they wait for its read before the next barrier (b). The copy engine
// serves 8 bulks one after another, and each warp waiting for its own costs more than their issue. Warp 5 rather than
// warp 4, which also issues the stage copies (SAGE128_TMA_THREAD).
#ifndef SAGE_BULK_DQ_WARP
#define SAGE_BULK_DQ_WARP 5
#endif
__device__ __forceinline__ void sage128_bulk_dq(const BackwardParams& p, u32 tile, int bh, int qb, int warp_u) {
    if (warp_u == SAGE_BULK_DQ_WARP) {
        const int q0 = qb * BLOCK_Q, rows = min(BLOCK_Q, p.dims.n_q - q0);  // ≥ 1: qb is a block of the sequence
        pipelined_bulk_red_add(true, p.dq_acc + ((long)bh * p.dims.n_q + q0) * HEAD_DIM, tile, (u32)rows * SAGE_DQ_STAGING_ROW);
        bulk_commit();
    }
}

// The pipelined loops' (d = 64 and d = 128) row constants of the thread's 16 rows (raw, from the
// staged row-constant block: L at `rows`, D at rows + BLOCK_Q) and P = exp2(fma(float(S), s, −L)) (tile_p_regs).
__device__ __forceinline__ void pipelined_row_pairs(float2 (&x)[8], const float* rows, int t) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) x[nt] = *(const float2*)(rows + qrow_of(nt, 2 * t));
}
__device__ __forceinline__ void pipelined_prob(float (&prob)[8][4], const int (&s_acc)[8][4], float s_qk, const float2 (&L)[8]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            prob[nt][e] = p_of_score(s_acc[nt][e], s_qk, (e & 1) ? L[nt].y : L[nt].x);
}
// The pipelined loops' start (d = 64 and d = 128): an item without query blocks drains its copies
// and returns; otherwise, after the first copies are issued, wait for the key block and block qb0 (the newest copy
// group, block qb0 + 1, may still fly) and put K̂ᵀ in dQ's byte order ((b) of tile qb0 orders it before the first dQ).
__device__ __forceinline__ bool pipelined_no_query_block(const Dims& d, int qb0) {
    if (qb0 < d.n_qblk) return false;
    cp_async_wait<0>();
    __syncthreads();
    return true;
}
__device__ __forceinline__ void pipelined_first_wait(u32 smem) {
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    interleave_kt_for_dq(smem + StagedSage::kt);
}
// The pipelined query loops' scales of key block kb (d = 64 and d = 128): s_K, and the rows of s_Q and
// s_dO of head bh over its query blocks.
struct PipelinedScales {
    float s_k;
    const float* q_scale;
    const float* do_scale;
    __device__ __forceinline__ PipelinedScales(const BackwardParams& p, int kb, int bh, int bh_kv)
        : s_k(p.op.k_scale[bh_kv * p.dims.n_kblk + kb]), q_scale(p.op.q_scale + bh * p.dims.n_qblk),
          do_scale(p.do_scale + bh * p.dims.n_qblk) {}
};
#endif  // SAGE64_PIPELINED_LOOP || SAGE128_PIPELINED_LOOP (the row-constant and bulk dQ helpers above serve both loops)
