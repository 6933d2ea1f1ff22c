#if SAGE64_PIPELINED_LOOP
// ---- The INT8 path at d = 64 (sm_90a) with its pipelined query loop, as its own types ----------------------------
// StagedSagePipelined<Options> = StagedSage with the pipelined loop (sage64_query_loop, sm90/backward_int8_d64.cu) and
// its layout: three query-block stages, two amax scratches and, with bulk_dq, two dQ staging tiles of 64 rows ×
// (d FP32 + 32 bytes); the stores use the first 4d bytes of a row, and the host reserves every kernel the same shared
// memory. The options, one struct per kernel:
// - bulk_dq: the loop writes a landed dQ tile to a staging tile (the FP32 values sage_add_dq adds) and, after the
//   next tile's barrier, warp w adds rows 8w..8w + 7 to the accumulator by one bulk reduce (cp.reduce.async.bulk
//   .add.f32, 2 KB), instead of 8 red.global.add.v2.f32 per thread;
// - rows8: the row constants of block qb + 2 loaded and stored by lanes 0..7 of every warp (8 rows each) instead of
//   threads 0..63;
// - dp_ahead: dPᵀ of block qb + 1 also issued at the end of tile qb (P after both products);
// - rotated_dq: with bulk_dq, the staging stores in a per-row order that makes them conflict-free
//   (pipelined_stage_dq_rot: same values, same addresses; the tile stays row-major, so each warp's 8 rows stay one
//   2 KB bulk source);
// - split_mask: the query loop as two loops, the tiles that may need the causal / n_k mask first, then the rest
//   without any mask code: in one loop ptxas puts the register moves of P and the mask test into every tile. Plain
//   grid only: in the persistent kernel (252 registers) the second copy of the loop body makes ptxas spill;
// - atomic_amax (the plain grid's kernels): the tile amax of P and dS by one red.shared.max.u32 per value per warp
//   into a 2-float slot, then one 8-byte load after the barrier (block_max2_atomic), instead of 8 partials per value
//   stored, read back and combined after it;
// - tma_dq (with bulk_dq; sage_bwd_main_sm90_int8_tma_dq): each warp stores its own landed dQ fragment (16 rows × 32 FP32)
//   into its 2 KB box in the 128-byte swizzle (conflict-free without the rotated order's selects), and after the next
//   tile's barrier the tile's boxes go out as tensor reduces (dq_box_stage, sage64_tma_reduce_dq); the boxes are
//   double-buffered like the staging tiles.
// sage_bwd_main_sm80 keeps StagedSage with the generic loop.
struct SagePipelinedPlain {  // sage_bwd_main_sm90_int8: the plain grid, dQ by row bulk reduces
    static constexpr bool bulk_dq = true, rows8 = false, dp_ahead = false, rotated_dq = true, split_mask = true;
    static constexpr bool atomic_amax = true, tma_dq = false;
};
struct SagePipelinedPersistent {  // sage_bwd_main_sm90_int8_persistent: the persistent grid
    static constexpr bool bulk_dq = true, rows8 = true, dp_ahead = true, rotated_dq = false, split_mask = false;
    static constexpr bool atomic_amax = false, tma_dq = false;
};
struct SagePipelinedTmaDq : SagePipelinedPlain {  // sage_bwd_main_sm90_int8_tma_dq: the plain grid, dQ by tensor reduces
    static constexpr bool tma_dq = true;
};
template <class Options>
struct StagedSagePipelined : StagedSage {
    static constexpr bool BULK_DQ = Options::bulk_dq, ROWS_8 = Options::rows8, DP_AHEAD = Options::dp_ahead,
                          ROT_DQ = Options::bulk_dq && Options::rotated_dq, SPLIT_MASK = Options::split_mask;
    static constexpr bool ATOMIC_AMAX = Options::atomic_amax;
    static constexpr bool TMA_DQ = Options::tma_dq && Options::bulk_dq;
    typedef StagedLayout<4 * BF_KT, 5 * BF_QT, BLOCK_Q * BLOCK_KV, 3,
                         Options::bulk_dq ? BLOCK_Q * (HEAD_DIM * 4 + 32) : 0> Layout;
};
typedef StagedSagePipelined<SagePipelinedPlain> StagedSage64;
typedef StagedSagePipelined<SagePipelinedPersistent> StagedSage64Persistent;
typedef StagedSagePipelined<SagePipelinedTmaDq> StagedSage64TmaDq;
template <class Options>
struct QueryStager<StagedSagePipelined<Options>> : QueryStager<StagedSage> {
    __device__ __forceinline__ QueryStager(const BackwardParams& p, int bh) : QueryStager<StagedSage>(p, bh) {}
};
#endif

#if SAGE128_PIPELINED_LOOP
// ---- The INT8 path at d = 128 (sm_90a) as its own type, with its own query loop -----------------
// StagedSage128 = StagedSage (two query-block stages, the same tile: dQ of block qb − 1 issued before Sᵀ, dPᵀ)
// with its own query loop (sage128_query_loop, sm90/backward_int8_d128.cu):
// - Bulk dQ: the landed dQ of block qb − 1 (the values sage_add_dq adds, fl(float(acc)·scale)) goes to a staging
//   tile [64][d] FP32 instead of 16 red.global.add.v2.f32 per thread, and warp w adds rows 8w..8w + 7 (4 KB) to the
//   accumulator by one bulk reduce (pipelined_bulk_dq), in the permuted chunk order of pipelined_stage_dq_rot (2
//   shared wavefronts per STS.64 instead of 8): the per-thread reductions wait for the LSU. The permuted order is
//   kept in the accumulator (SAGE_DQ_ACC_ROT, common.cuh; the postprocess reads it back in order) rather than undone
//   by 64 selects per thread and tile.
// - Raw row constants: those of block qb + 1 loaded raw (lse2, offset, D) early and subtracted when stored at the
//   end of the tile, so that no warp waits for global loads inside the tile.
// - Scales ahead: s_Q, s_dO of block qb + 1 loaded in tile qb and s_K once per item (else the scale loads sit behind
//   the stage's copies in the LSU queue).
// - One I2FP per float(acc) in the dV, dK, dQ dequantizations (exact, |acc| < 2^22) instead of i2f_exact's VIADD +
//   FADD: 160 instructions fewer per thread per tile.
// - Pipelined: Sᵀ of block qb + 1 issued at the end of tile qb, one block barrier per tile (the amax barrier (b)),
//   and each stage split by lifetime: its Sᵀ/dPᵀ operands (Q̂, dO: part A, free once every warp has waited for dPᵀ,
//   i.e. at (b)) and its dV/dK operands (dÔᵀ, Q̂ᵀ: part B, free at the next (b)). After (b) of tile qb, A of block
//   qb + 2 goes to the A part of stage qb mod 2 and B of block qb + 1 to the B part of stage (qb + 1) mod 2, so block
//   j's operands still sit in stage j mod 2 and two stages (80 KB) suffice where the d = 64 loop has three.
// - P̂, then dV's first two chunks issued, then dŜ quantized and stored while they run. (At d = 64 this order is
//   slower, so that loop keeps quantize_tile.) The work after (b) that no product waits for (the next blocks'
//   copies, the row loads, the bulk dQ of qb − 2) stays before those chunks: behind them ptxas spills.
// The same products and FP32 operations as StagedSage, in the same order (only the unordered FP32 additions of dQ
// into the accumulator happen in another order). Shared memory: StagedSage's layout, a second amax scratch and two
// 32 KB staging tiles.
// Which thread issues the TMA copies (SAGE128_TMA_THREAD) and which 64 threads load and store the row constants
// (SAGE128_ROW_THREAD0 .. + 63) in the loop: both duties on warpgroup 1 (warps 4 and 5). The warpgroup that carries
// an extra duty reaches the tile's barrier and issues its wgmma late; one late warpgroup costs less than two, so the
// duties are not split between the warpgroups.
#ifndef SAGE128_TMA_THREAD
#define SAGE128_TMA_THREAD 128
#endif
#ifndef SAGE128_ROW_THREAD0
#define SAGE128_ROW_THREAD0 128
#endif
struct StagedSage128 : StagedSage {
    static constexpr bool BULK_DQ = true;
    typedef StagedLayout<4 * BF_KT, 5 * BF_QT, BLOCK_Q * BLOCK_KV, 2, BLOCK_Q * HEAD_DIM * 4> Layout128;
    // With a second amax scratch before the dQ staging tiles (one barrier per tile).
    struct Layout : Layout128 {
        static constexpr int dqst0 = Layout128::red + 2 * Layout128::red_bytes;
        static constexpr int bytes = dqst0 + 2 * Layout128::dqst_bytes + ALIGN_SLACK;
    };

    // StagedSage::stage_query_block in two parts, copied at different times by the pipelined loop: A = Q̂, dO (Sᵀ's and
    // dPᵀ's B operands), B = dÔᵀ, Q̂ᵀ (the key products'). (Not shared with stage_query_block: written as two
    // calls there, ptxas scheduled the d = 64 and d = 128 kernels differently.)
    static __device__ __forceinline__ void stage_query_a(const BackwardParams& p, u32 st, int bh, int qb) {
        const Dims& d = p.dims;
        const int row0 = qb * BLOCK_Q;
        const i8* q_hat = p.op.q_hat + ((long)bh * d.n_q + row0) * HEAD_DIM;
        stage_rows_at<BLOCK_Q, HEAD_DIM / 16>(st, q_hat, HEAD_DIM, d.n_q - row0, WgKmajor<BLOCK_Q, HEAD_DIM, true>());
        stage_rows_at<BLOCK_Q, HEAD_DIM / 8>(st + d_o, p.d_o + ((long)bh * d.n_q + row0) * HEAD_DIM, BF_ROW, d.n_q - row0,
                                             WgKmajor<BLOCK_Q, BF_ROW, true>());
    }
    static __device__ __forceinline__ void stage_query_b(const BackwardParams& p, u32 st, int bh, int qb) {
        const Dims& d = p.dims;
        const long t_off = (long)bh * HEAD_DIM * d.n_qpad + qb * BLOCK_Q;
        stage_rows_at<HEAD_DIM, BLOCK_Q / 16>(st + dot, p.tr.do_hat_t + t_off, d.n_qpad, HEAD_DIM,
                                              WgKmajor<HEAD_DIM, BLOCK_Q, false>());
        stage_rows_at<HEAD_DIM, BLOCK_Q / 16>(st + qt, p.tr.q_hat_t + t_off, d.n_qpad, HEAD_DIM,
                                              WgKmajor<HEAD_DIM, BLOCK_Q, false>());
    }

    // The landed dQ tile's values fl(float(acc)·scale) into a staging tile (one I2FP per value), each row's
    // chunks in the accumulator's order (SAGE_DQ_ACC_ROT).
    static __device__ __forceinline__ void stage_dq(unsigned char* tile, const int (*acc)[4], float scale) {
        pipelined_stage_dq_rot<true, false, false>((u32)__cvta_generic_to_shared(tile), acc, scale);
    }

    // StagedSage::dq (the item's last dQ tile, after the loop) with one I2FP per value, to the accumulator's order.
    static __device__ __forceinline__ void dq(const BackwardParams& p, u32 smem, u32 ds_tile, float scale, int bh, int qb) {
        StagedSage::dq<true, true>(p, smem, ds_tile, scale, bh, qb);
    }
    static constexpr bool TMA_STAGE = false;
};
// ---- The d = 128 loop's stage copies by TMA (plain grid: sage_bwd_main_sm90_int8_tma_stage) -------------------------------
// With cp.async, after barrier (b) every thread rebuilds the swizzled destinations and guarded sources of its 10
// chunks (~110 instructions per thread per tile), on the stretch between (b) and the first dV/dK chunk where the
// tensor pipe has only dQ(qb − 1) to run. Here one thread (SAGE128_TMA_THREAD) issues the same bytes as 5 TMA boxes
// completing on one mbarrier, waited for where the cp.async wait was (before the next tile's (b)).
// The four maps (src/backward.rs `sage128_stage_maps`) sit in front of BackwardParams in the kernel's one parameter:
//   0: Q̂ [rows·n_q][d] INT8 as 5-D {d, e: 2, b: 4, c: 2, a}, strides {1, 4, 2, 16} rows, box {d, 2, 4, 2, 4}: query
//      row 16a + 4b + 2c + e lands in tile row 16a + 8c + 2b + e, which is permuted_qrow's order; the 128-byte
//      swizzle is WgKmajor's;
//   1: dO [rows·n_q][d] BF16, the same view, box {64, 2, 4, 2, 4}: two boxes, WgKmajor's two atom columns;
//   2, 3: dÔᵀ, Q̂ᵀ [rows][d][n_qpad] INT8 as 3-D {n_qpad, d, rows}, box {64, d, 1}, 64-byte swizzle.
// The host takes it only when n_q % 64 == 0: the rows of consecutive heads are then whole 16-row groups and no query
// block is ragged (the cp.async copies zero-fill rows past n_q; here no such row exists).
// Not at d = 64: there the per-thread cp.async copies are cheap already (QueryStager's precomputed parts), the TMA
// form adds instructions to the loop, and the issuing warp delays its warpgroup on a shorter tile.
struct __align__(64) StageMapsParam {
    unsigned long long w[4][16];
};
struct BwdParamsStageMaps {
    StageMapsParam maps;
    BackwardParams p;
};
static_assert(sizeof(StageMapsParam) == 512 && sizeof(BwdParamsStageMaps) == 832, "BwdParamsStageMaps layout: src/backward.rs");
struct StagedSage128TmaStage : StagedSage128 {
    static constexpr bool TMA_STAGE = true;
    static constexpr u32 A_BYTES = 3 * BF_QT, B_BYTES = 2 * BF_QT;  // Q̂ + dO, dÔᵀ + Q̂ᵀ

    static __device__ __forceinline__ const unsigned long long* maps(const BackwardParams& p) {
        return ((const StageMapsParam*)((const char*)&p - sizeof(StageMapsParam)))->w[0];
    }
    // The issuing thread (SAGE128_TMA_THREAD), once per CTA before a block barrier: the mbarrier (one arrival, its own,
    // with the bytes).
    static __device__ __forceinline__ void init(const BackwardParams& p, u32 bar) {
        mbar_init(bar, 1);
        fence_mbar_init();
#pragma unroll
        for (int m = 0; m < 4; ++m) tma_prefetch_map(maps(p) + 16 * m);
    }

    // A of block qa (if `a`) into the stage at st_a, B of block qb into the stage at st_b, on mbarrier bar (one thread).
    static __device__ __forceinline__ void stage_copies(const BackwardParams& p, u32 bar, u32 st_a, u32 st_b, int bh, int qa,
                                                        int qb, bool a) {
        const unsigned long long* m = maps(p);
        mbar_arrive_expect_tx(bar, (a ? A_BYTES : 0) + B_BYTES);
        if (a) {
            const int grp = (bh * p.dims.n_q + qa * BLOCK_Q) / 16;  // rows·n_q < 2^31 (the host checks)
            tma_load_5d(st_a, m, 0, 0, 0, 0, grp, bar);
            tma_load_5d(st_a + d_o, m + 16, 0, 0, 0, 0, grp, bar);
            tma_load_5d(st_a + d_o + BLOCK_Q * 128, m + 16, 64, 0, 0, 0, grp, bar);
        }
        tma_load_3d(st_b + dot, m + 32, qb * BLOCK_Q, 0, bh, bar);
        tma_load_3d(st_b + qt, m + 48, qb * BLOCK_Q, 0, bh, bar);
    }
};
#endif

