// ---------------------------------------------------------------------------------------------
// The staged paths: the same arithmetic as mma_tile_*, reorganised around the key block. Two
// product mixes have one: `sage` (#3, #4, #6, #7 INT8, #5 BF16; no Q-smoothing, no dQ correction:
// the sagebwd preset) and `bf16` (#3 to #7 all BF16: the fpa preset; the switches act on INT8
// products only, so they do not matter). Both share the skeleton `staged_backward_main<Path>`:
//
// - Stationary for the whole query loop (loaded once by cp.async): the key block's operand tiles
//   (sage: K̂ [128 keys][d] (A of Sᵀ), K̂ᵀ [d][128 keys] (B of dQ), BF16 V [128 keys][d] (A of dPᵀ);
//   bf16: K [128][d] (A of Sᵀ, B of dQ read transposed), V [128][d] (A of dPᵀ)).
// - Per query block, double-buffered by cp.async (block qb + 1 loads while qb computes): the
//   block's operand tiles (sage: Q̂ [64][d] (B of Sᵀ), dO [64][d] BF16 (B of dPᵀ), dÔᵀ [d][64] (B of
//   dV), Q̂ᵀ [d][64] (B of dK); bf16: Q [64][d] (B of Sᵀ; of dK read transposed), dO [64][d] (B of
//   dPᵀ; of dV read transposed)), and the rows' L and D by plain loads.
// - Warp w owns keys 16w..16w+15 and computes the transposed tile Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (16 keys ×
//   64 query rows) in registers; P and dS stay in registers and become the A fragments of dV = Pᵀ dO
//   and dK = dSᵀ Q directly (sage: P̂ᵀ and dŜᵀ, once the block knows the tile's amax; the query
//   rows are fed to ldmatrix in the forward's permuted order, accumulator column n of n-tile nt is
//   row qrow_of(nt, n), which makes the accumulator layout equal the m16n8k32 A layout. bf16: the
//   accumulators of n-tiles 2ks, 2ks + 1 packed to bf16x2 are the m16n8k16 A fragment of k-step ks,
//   natural row order, as in the forward's P·V).
// - dS goes once through shared memory, double-buffered by query-block parity (sage: dŜ bytes
//   [64 rows][128 keys]; bf16: bf16(dS)ᵀ [128 keys][64 rows], which the A fragments of dQ = dS K
//   read transposed) for dQ: warp w then owns rows 16(w mod 4).. × half of d and adds its tile to
//   the FP32 accumulator with 8-byte vector reductions. dQ of block qb − 1 runs at the end of
//   iteration qb, from the other dS buffer.
// Barriers per tile: one (operands, row constants and the previous dS ready), plus the tile amax's
// for sage. All operand tiles use XOR-swizzled 16-byte chunks, chosen so that each ldmatrix phase
// (8 rows of one chunk column) and each dS store hits 8 distinct bank groups.

// Dynamic shared memory of a staged path: the key block's tiles (KEY bytes), two query-block stages
// (STAGE bytes of operand tiles), two L[64], D[64] blocks, two dS tiles of DS bytes, the amax
// scratch, and ALIGN_SLACK bytes so that the start can be rounded up to 1024 (wgmma's swizzled
// tiles must start on a 1024-byte boundary; the operand tiles keep it, as KEY and STAGE are
// multiples of 1024). Mirrored by `staged_backward_smem_bytes` in src/backward.rs.
#define ALIGN_SLACK 1024
// NSTAGES = 3 (the sage path at d = 64) adds a third stage after the second and a second
// amax scratch after the first (the pipelined query loop, below); 2 is the layout above.
// DQST > 0 (the sage path at d = 64) adds two dQ staging tiles of DQST bytes after the scratches.
template <int KEY, int STAGE, int DS, int NSTAGES = 2, int DQST = 0>
struct StagedLayout {
    static constexpr int stage0 = KEY;                        // stage 0; stage 1 (and 2) follow
    static constexpr int stage_bytes = STAGE;
    static constexpr int rows0 = KEY + NSTAGES * STAGE;       // L, D of stage 0; stage 1's follow
    static constexpr int rows_bytes = 2 * BLOCK_Q * 4;
    static constexpr int ds0 = rows0 + 2 * rows_bytes;        // dS tile 0; tile 1 follows
    static constexpr int ds_bytes = DS;
    static constexpr int red = ds0 + 2 * DS;
    static constexpr int red_bytes = 2 * (THREADS / 32) * 4;  // one amax scratch (NSTAGES − 1 of them)
    static constexpr int dqst0 = red + (NSTAGES - 1) * red_bytes;  // dQ staging tile 0; tile 1 follows
    static constexpr int dqst_bytes = DQST;
    static constexpr int bytes = dqst0 + 2 * DQST + ALIGN_SLACK;
    static_assert(NSTAGES == 2 || NSTAGES == 3, "two or three query-block stages");
    static_assert(KEY % 1024 == 0 && STAGE % 1024 == 0, "operand tiles must stay 1024-byte aligned");
};

#define BF_QT (BLOCK_Q * HEAD_DIM)           // bytes of an INT8 [64][d] tile (a BF16 one is twice that)
#define BF_KT (BLOCK_KV * HEAD_DIM)          // bytes of an INT8 [128][d] tile
#define BF_ROW (2 * HEAD_DIM)                // bytes of one BF16 row of d values

// Which path `sage_bwd_main_sm80` takes (the host's `staged_backward` in src/backward.rs).
#define BWD_GATHER 0
#define BWD_STAGED_SAGE 1
#define BWD_STAGED_BF16 2
__device__ __forceinline__ int bwd_fast_path(int flags) {
    const int products = F_QK_BWD | F_DV | F_DP | F_DQ | F_DK;
    const int mask = products | F_SMOOTH_Q | F_DQ_CORR;
    if ((flags & mask) == (F_QK_BWD | F_DV | F_DQ | F_DK)) return BWD_STAGED_SAGE;
    if ((flags & products) == 0) return BWD_STAGED_BF16;
    return BWD_GATHER;
}

// Swizzles (common.cuh): physical 16-byte chunk of logical chunk c in row `row` of each tile.
// K̂ / V (A operands, ldmatrix reads 8 consecutive keys per chunk column): natural row order.
__device__ __forceinline__ int swz_key_i8(int row, int c) { return swz_i8_rows8(row, c); }
__device__ __forceinline__ int swz_key_bf16(int row, int c) { return swz_rows8(row, c); }
// Q̂ / dO (B operands read in the permuted row order: rows base + {0, 1, 4, 5, 8, 9, 12, 13}).
__device__ __forceinline__ int swz_qrow_i8(int row, int c) { return swz_i8_permuted(row, c); }
__device__ __forceinline__ int swz_qrow_bf16(int row, int c) { return swz_permuted(row, c); }
// dÔᵀ / Q̂ᵀ: [d][64] (64-byte rows); K̂ᵀ: [d][128] (128-byte rows); bf16(dS)ᵀ [128][64 BF16].
__device__ __forceinline__ int swz_t64(int row, int c) { return swz_rows8_half(row, c); }
__device__ __forceinline__ int swz_t128(int row, int c) { return swz_rows8(row, c); }
// dŜ [64][128] bytes: conflict-free for ldmatrix (8 consecutive rows) and for the byte stores of
// one instruction (rows r0 + 4t, t = 0..3).
__device__ __forceinline__ int swz_ds(int row, int c) { return c ^ ((row & 7) ^ ((row >> 2) & 2)); }

// Query row (0..63) of accumulator column n of n-tile nt in the permuted order (as the forward's keys).
__device__ __forceinline__ int qrow_of(int nt, int n) { return 16 * (nt >> 1) + 2 * (nt & 1) + 4 * (n >> 1) + (n & 1); }
// ... in the permuted (sage) or natural (bf16) order.
template <bool PERMUTED>
__device__ __forceinline__ int tile_row(int nt, int n) { return PERMUTED ? qrow_of(nt, n) : 8 * nt + n; }

struct SwzKeyI8 { __device__ int operator()(int r, int c) const { return swz_key_i8(r, c); } };
struct SwzKeyBf16 { __device__ int operator()(int r, int c) const { return swz_key_bf16(r, c); } };
struct SwzQrowI8 { __device__ int operator()(int r, int c) const { return swz_qrow_i8(r, c); } };
struct SwzQrowBf16 { __device__ int operator()(int r, int c) const { return swz_qrow_bf16(r, c); } };
struct SwzT64 { __device__ int operator()(int r, int c) const { return swz_t64(r, c); } };
struct SwzT128 { __device__ int operator()(int r, int c) const { return swz_t128(r, c); } };

// Copies ROWS rows of CH 16-byte chunks (source stride `stride` bytes) into a tile: chunk c of row
// `row` goes to byte dst + off(row, c); rows ≥ valid_rows are zero-filled without reading.
// Unrolled: every thread copies ROWS·CH/THREADS chunks.
template <int ROWS, int CH, class Off>
__device__ __forceinline__ void stage_rows_at(u32 dst, const void* src, long stride, int valid_rows, Off off) {
    static_assert((ROWS * CH) % THREADS == 0 && THREADS % CH == 0, "stage_rows_at: tile does not split evenly");
    const unsigned char* s = (const unsigned char*)src;
    const int c = threadIdx.x % CH, row0 = threadIdx.x / CH;
#pragma unroll
    for (int k = 0; k < ROWS * CH / THREADS; ++k) {
        const int row = row0 + k * (THREADS / CH);
        const bool valid = row < valid_rows;
        cp_async16(dst + off(row, c), valid ? s + row * stride + c * 16 : s, valid);
    }
}

// Byte offset of chunk c of row `row` in a tile of CH-chunk rows whose chunks are permuted by Swz.
template <int CH, class Swz>
struct SwizzledRows {
    Swz swz;
    __device__ u32 operator()(int row, int c) const { return row * CH * 16 + swz(row, c) * 16; }
};

// stage_rows_at into a swizzled tile of CH-chunk rows.
template <int ROWS, int CH, class Swz>
__device__ __forceinline__ void stage_rows(u32 dst, const void* src, long stride, int valid_rows, Swz swz) {
    stage_rows_at<ROWS, CH>(dst, src, stride, valid_rows, SwizzledRows<CH, Swz>{swz});
}

// [128][d] BF16 rows of the key block (rows past n_k zero) and [64][d] BF16 rows of query block qb
// (rows past n_q zero), natural row order unless given another swizzle.
template <class Swz = SwzKeyBf16>
__device__ __forceinline__ void stage_key_rows_bf16(u32 dst, const u16* x, const Dims& d, int bh_kv, int kb,
                                                    Swz swz = Swz()) {
    const int key0 = kb * BLOCK_KV;
    stage_rows<BLOCK_KV, HEAD_DIM / 8>(dst, x + ((long)bh_kv * d.n_k + key0) * HEAD_DIM, BF_ROW, d.n_k - key0, swz);
}
template <class Swz = SwzKeyBf16>
__device__ __forceinline__ void stage_query_rows_bf16(u32 dst, const u16* x, const Dims& d, int bh, int qb,
                                                      Swz swz = Swz()) {
    const int row0 = qb * BLOCK_Q;
    stage_rows<BLOCK_Q, HEAD_DIM / 8>(dst, x + ((long)bh * d.n_q + row0) * HEAD_DIM, BF_ROW, d.n_q - row0, swz);
}

// L and D of row `rl` of query block qb (threads 0..63): L = fl(lse2 − b_r) after an INT8 #3 (its
// scores are of the smoothed K, lower than the true ones by b_r, §5), lse2 after a BF16 #3;
// L = +∞, D = 0 past n_q, so that P = exp2(t − L) = 0 and dS = 0 there without a mask.
struct RowConsts {
    float L, D;
};
__device__ __forceinline__ RowConsts load_row_consts(const BackwardParams& p, int bh, int qb, int rl) {
    RowConsts rc;
    rc.L = pos_inf();
    rc.D = 0.0f;
    const int r = qb * BLOCK_Q + rl;
    if (r < p.dims.n_q) {
        const long row = (long)bh * p.dims.n_q + r;
        rc.L = (p.flags & F_QK_BWD) ? __fsub_rn(p.lse2[row], p.op.row_offset[row]) : p.lse2[row];
        rc.D = p.delta[row];
    }
    return rc;
}
__device__ __forceinline__ void store_row_consts(float* rows, const RowConsts& rc) {
    rows[threadIdx.x] = rc.L;
    rows[BLOCK_Q + threadIdx.x] = rc.D;
}

__device__ __forceinline__ void mma_acc(int* c, const u32* a, const u32* b) { mma_s8(c, a, b); }
__device__ __forceinline__ void mma_acc(float* c, const u32* a, const u32* b) { mma_bf16(c, a, b); }

// acc[nt] = the warp's 16 keys (A: rows of a [key][CH chunks] tile) × the 64 query rows of n-tiles
// nt = 0..7 (B: rows of a [row][CH chunks] stage tile, in the permuted or natural order), summed over
// all CH chunks: INT8 m16n8k32 or BF16 m16n8k16 by the accumulator type; either way one k-step is 2
// chunks, so one ldmatrix.x4 of B serves two k-steps. a_lane / b_lane: this lane's ldmatrix row
// (keys 8·(mi mod 2) + r; n-tile 0's row r), a_x / b_x: its swizzle term, which the rows of later
// n-tiles and k-steps share, so every address is a per-lane base plus a compile-time offset.
template <int CH, int ROW_BYTES, bool PERMUTED, class Acc>
__device__ __forceinline__ void keys_by_rows(Acc (*acc)[4], u32 a_lane, int a_x, u32 b_lane, int b_x) {
    const int mi = (threadIdx.x & 31) >> 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0;
#pragma unroll
    for (int cg = 0; cg < CH / 4; ++cg) {
        u32 a[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) ldmatrix_x4(a[h], a_lane + (((4 * cg + 2 * h + (mi >> 1)) ^ a_x) << 4));
        const u32 b_cg = b_lane + (((4 * cg + mi) ^ b_x) << 4);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            u32 b[4];
            ldmatrix_x4(b, b_cg + tile_row<PERMUTED>(nt, 0) * ROW_BYTES);
            mma_acc(acc[nt], a[0], b);
            mma_acc(acc[nt], a[1], b + 2);
        }
    }
}

// P of one score (§5) from the S accumulator and the row's L: INT8 #3 (an int accumulator) exp2(fma(a, scale, −L)),
// one rounding; BF16 #3 exp2(fl(fl(S·scale) − L)).
__device__ __forceinline__ float p_of_score(int acc, float scale, float L) { return exp2_ftz(__fmaf_rn((float)acc, scale, -L)); }
__device__ __forceinline__ float p_of_score(float acc, float scale, float L) {
    return exp2_ftz(__fsub_rn(__fmul_rn(acc, scale), L));
}

// P = exp2(fma(S, scale, −L)) (INT8) or exp2(fl(fl(S·scale) − L)) (BF16) of the warp's transposed tile (s: the Sᵀ accumulators, scale =
// fl(fl(s_Q·cλ)·s_K) for INT8, cλ for BF16), not yet masked.
template <bool PERMUTED, class Acc>
__device__ __forceinline__ void tile_p_regs(const float* rows, const Acc (*s)[4], float scale, float (*prob)[4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 L = *(const float2*)(rows + tile_row<PERMUTED>(nt, 2 * t));  // rows rl, rl + 1 (even)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            prob[nt][e] = p_of_score(s[nt][e], scale, (e & 1) ? L.y : L.x);
    }
}

// dS = fl(P·fl(dP − D)) (dp in, dS out), then P and dS masked → 0; rows past n_q need no mask
// (L = +∞, D = 0).
template <bool PERMUTED>
__device__ __forceinline__ void tile_ds_regs(const Dims& d, const float* rows, int qb, int kb, float (*prob)[4],
                                             float (*ds)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wkey0 = kb * BLOCK_KV + (threadIdx.x >> 5) * 16;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 D = *(const float2*)(rows + BLOCK_Q + tile_row<PERMUTED>(nt, 2 * t));
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D.y : D.x));
    }
    const int last_key = wkey0 + 15;
    const bool need_mask = last_key >= d.n_k || (d.causal && last_key > qb * BLOCK_Q + (d.n_k - d.n_q));
    if (need_mask) {  // warp-uniform: only tiles on the diagonal or past n_k
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!visible(d, qb * BLOCK_Q + tile_row<PERMUTED>(nt, 2 * t + (e & 1)), wkey0 + g + 8 * (e >> 1)))
                    prob[nt][e] = ds[nt][e] = 0.0f;
    }
}

// Both: P and dS of the warp's tile from the Sᵀ and dPᵀ accumulators (dp in, dS out), masked.
template <bool PERMUTED, class Acc>
__device__ __forceinline__ void tile_p_ds_regs(const Dims& d, const float* rows, int qb, int kb, const Acc (*s)[4],
                                               float scale, float (*prob)[4], float (*ds)[4]) {
    tile_p_regs<PERMUTED>(rows, s, scale, prob);
    tile_ds_regs<PERMUTED>(d, rows, qb, kb, prob, ds);
}

// Adds the 16 × 16 dQ columns c..c + 15 of the warp's rows (acc[0]: columns c.., acc[1]: c + 8..) to
// the FP32 accumulator, rows past n_q skipped. dq_lo: this lane's first element (row r_lo).
__device__ __forceinline__ void red_add_dq16(const Dims& d, float* dq_lo, int r_lo, const float (*v)[4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        if (r_lo < d.n_q) red_add_f32x2(dq_lo + 8 * j, v[j][0], v[j][1]);
        if (r_lo + 8 < d.n_q) red_add_f32x2(dq_lo + 8 * HEAD_DIM + 8 * j, v[j][2], v[j][3]);
    }
}

// This lane's first dQ row (r_lo; r_lo + 8 is its other) and element for the warp's dQ tile:
// rows 16(w mod 4).. of block qb, columns (w div 4)·d/2 + 2t...
__device__ __forceinline__ float* dq_lane_ptr(const BackwardParams& p, int bh, int qb, int& r_lo) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    r_lo = qb * BLOCK_Q + (warp & 3) * 16 + (lane >> 2);
    return p.dq_acc + ((long)bh * p.dims.n_q + r_lo) * HEAD_DIM + (warp >> 2) * (HEAD_DIM / 2) + 2 * (lane & 3);
}

// One query block's tile, as the paths see it.
struct StagedTile {
    u32 smem;           // shared address of the dynamic allocation
    u32 st;             // this block's stage
    const float* rows;  // its L[64], D[64]
    unsigned char* ds;  // its dS tile (generic pointer)
    float* red;         // the amax scratch
    int bh, bh_kv, qb;  // (batch, query head), its kv head, the query block
    int kb;             // the key block (staged_block_coords)
    u32 prev_ds;        // shared address of block qb − 1's dS tile (valid when qb > the first block)
    float prev_dq_scale;  // and its dQ scale (sage)
    bool has_prev;
    u32 next_st;        // the stage block qb + 1 goes to (a path with STAGES_NEXT stages it in tile())
    bool has_next;
};

// ---- wgmma operand tiles (sm_90a) -----------------------------------------------------------------
// On sm_90a the sage path computes Sᵀ and dPᵀ with wgmma (BWD_WGMMA): the warpgroup's 64 keys are
// the M rows, the 64 query rows the N columns; K̂, V (A) and Q̂, dO (B) are K-major tiles in the
// hardware's swizzled layout. The Q̂ and dO rows are stored in the permuted order (row 8nt + n holds
// query row qrow_of(nt, n)), so the accumulator is the mma.sync path's, permuted rows included.
#ifdef SAGE_WGMMA
#define BWD_WGMMA 1
// dQ = dŜ K̂ runs on wgmma too (A = the dŜ byte tile, B = K̂ᵀ, both in the 128-byte-swizzle layout), issued
// for block qb − 1 at the start of tile qb, before Sᵀ, and added while Sᵀ and dPᵀ run (as the fpa path).
// Issued early like this, the wgmma dQ is faster than the mma.sync one at both head dims.

// Tile row holding query row `row` (inverse of qrow_of: row = 16a + 4b + 2c + e sits at 8(2a + c) + 2b + e).
__device__ __forceinline__ int permuted_qrow(int row) {
    return (row & ~15) | (((row >> 1) & 1) << 3) | (((row >> 2) & 3) << 1) | (row & 1);
}

// Byte offset of 16-byte chunk c of row `row` in a K-major tile of ROWS rows of ROW_BYTES bytes.
// Rows of up to 128 bytes are one swizzle atom column (64-byte rows: 64-byte swizzle); 256-byte
// rows (BF16, d = 128) are two atom columns, each a [ROWS][128-byte] tile, the second after the first.
template <int ROWS, int ROW_BYTES, bool PERMUTED>
struct WgKmajor {
    static constexpr int ATOM = ROW_BYTES < 128 ? ROW_BYTES : 128;
    __device__ u32 operator()(int row, int c) const {
        const int prow = PERMUTED ? permuted_qrow(row) : row;
        const int byte = 16 * c;
        return (byte / ATOM) * (ROWS * ATOM) + swizzled_offset(prow * ATOM + byte % ATOM, ATOM);
    }
};

// Descriptor of k-step ks (32 bytes of every row) of a WgKmajor<ROWS, ROW_BYTES> tile at `tile`,
// from row row0 (a multiple of 8, one swizzle period) on.
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ u64 wg_kstep_desc(u32 tile, int row0, int ks) {
    constexpr int ATOM = ROW_BYTES < 128 ? ROW_BYTES : 128, STEPS = ATOM / 32;
    return kmajor_desc(tile + (ks / STEPS) * (ROWS * ATOM) + row0 * ATOM + 32 * (ks % STEPS), ATOM);
}

// Issues acc = A·Bᵀ of a BF16 product over d, no commit: A = rows 64wg.. of the [128][d] key tile
// at a_tile, B = the [64][d] query tile at b_tile, both WgKmajor. dPᵀ = V dOᵀ of both staged paths
// and the fpa path's Sᵀ = K Qᵀ (accumulators from zero; FP32 sums in the hardware's order, §1).
__device__ __forceinline__ void wg_issue_bf16_keys_by_rows(float (&acc)[8][4], u32 a_tile, u32 b_tile, int wg) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
        wgmma_bf16_ss_n64(acc, wg_kstep_desc<BLOCK_KV, BF_ROW>(a_tile, 64 * wg, ks), wg_kstep_desc<BLOCK_Q, BF_ROW>(b_tile, 0, ks), ks);
}
#else
#define BWD_WGMMA 0
#endif

// ---- Helpers of the staged INT8 tile (fewer CUDA-core instructions per tile) ---------------
// At d = 64 the sage tile is bound by its CUDA-core work, not by the tensor cores; these do the shared helpers'
// arithmetic in fewer, or less serial, instructions. Every value they produce is bit-identical to the shared
// helpers'.

// float(acc) in the dV, dK, dQ dequantizations (|acc| ≤ 127²·128 < 2^22: both forms below are exact).
// d = 64: one I2FP (1 issue slot, faster than i2f_exact there); d = 128 keeps i2f_exact (VIADD + FADD, off the
// conversion pipe).
__device__ __forceinline__ float sage_i2f(int a) { return HEAD_DIM == 64 ? (float)a : i2f_exact(a); }

// Max of a warp tile's 32 values (|values| with ABS), as 4 independent chains and a 2-level tree:
// fmax is exact and order-free, so the result is the sequential loop's; the chains cut the latency
// (instead of one serial FMNMX chain of 32).
// sm_90a, P's amax (ABS = false): P is finite and ≥ +0 (the inputs are checked, §9; masked
// entries are +0), and non-negative floats order as their bit patterns, so the integer max of the bits
// (with 0, as the chains' start) is the fmax, bit for bit: 11 + 4 + 2 three-way integer maxima
// (VIMNMX3, Hopper's DPX) instead of 32 + 3 FMNMX.
template <bool ABS>
__device__ __forceinline__ float sage_tile_max(const float (*v)[4]) {
#if defined(SAGE_WGMMA)
    if constexpr (!ABS) {
        auto x = [&](int i) { return __float_as_int(v[i >> 2][i & 3]); };
        int a[11];
#pragma unroll
        for (int k = 0; k < 10; ++k) a[k] = __vimax3_s32(x(3 * k), x(3 * k + 1), x(3 * k + 2));
        a[10] = __vimax3_s32(x(30), x(31), 0);
        const int b0 = __vimax3_s32(a[0], a[1], a[2]), b1 = __vimax3_s32(a[3], a[4], a[5]);
        const int b2 = __vimax3_s32(a[6], a[7], a[8]), b3 = __vimax3_s32(a[9], a[10], b0);
        return __int_as_float(__vimax3_s32(b1, b2, b3));
    }
#endif
    float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) m[e] = fmaxf(m[e], ABS ? fabsf(v[nt][e]) : v[nt][e]);
    return fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
}

// Block-wide max of two non-negative values; `red` (16-byte aligned) holds 2·(THREADS/32) floats. The
// caller's barriers keep `red` from being rewritten before everyone has read it (see
// staged_backward_main). The per-warp partials are read back as float4 and combined as a tree.
// sm_90a: the warp step as one redux.sync max of the bits per value: a and b are
// per-thread maxima from 0 (sage_tile_max: never NaN, never below +0), and non-negative floats
// order as their bit patterns, so the u32 max is the fmax, bit for bit (instead of 5 serial shuffle +
// fmax steps).
__device__ __forceinline__ void block_max2(float& a, float& b, float* red) {
#if defined(SAGE_WGMMA)
    a = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(a)));
    b = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(b)));
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, o));
    }
#endif
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        red[warp] = a;
        red[THREADS / 32 + warp] = b;
    }
    __syncthreads();
    static_assert(THREADS / 32 == 8, "block_max2 reads 8 partials per value");
    const float4* r4 = (const float4*)red;
    const float4 a0 = r4[0], a1 = r4[1], b0 = r4[2], b1 = r4[3];
    a = fmaxf(fmaxf(fmaxf(a0.x, a0.y), fmaxf(a0.z, a0.w)), fmaxf(fmaxf(a1.x, a1.y), fmaxf(a1.z, a1.w)));
    b = fmaxf(fmaxf(fmaxf(b0.x, b0.y), fmaxf(b0.z, b0.w)), fmaxf(fmaxf(b1.x, b1.y), fmaxf(b1.z, b1.w)));
}

// ATOMIC_AMAX: block_max2 of the pipelined d = 64 and d = 128 loops with the block step in shared atomics. Tile i's slot
// (2 floats, slot i mod 4 at byte 8(i mod 4) of the loop's 128-byte amax scratch, 32-byte aligned) is +0 when its first
// red arrives: the slots start at +0 (zeroed before the loop's first barrier) and tile i's thread 0 zeroes slot
// i + 2 mod 4 (its address: tile i's slot's XOR 16) after barrier (b) of tile i, when every read of it (tile i − 2,
// before (b) of tile i − 1) is done and before any red into it (tile i + 2, after (b) of tile i + 1). a and b are
// per-thread maxima from +0 (sage_tile_max: never NaN, never below +0), so the u32 max of their bits is their fmax,
// bit for bit, as redux's warp step is already: the same values as block_max2's. Every lane issues the two reds, lane 0
// to the slot and lanes 1..31 to sink words 32..92 bytes past it (within the scratch, never read; lane_off = lane 0: 0,
// else 32 + 4·(lane mod 16)): one ATOMS each, no branch (a lane-0 or elect.sync predicate became a branch around each
// ATOMS, and ptxas re-aggregated a lane-0 atomic over the active lanes by another redux). Leaves a and b as
// block_max2 does.
__device__ __forceinline__ void block_max2_atomic(float& a, float& b, u32 slot, u32 lane_off) {
    a = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(a)));
    b = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(b)));
    asm volatile("red.shared.max.u32 [%0], %1;\nred.shared.max.u32 [%0+4], %2;\n"
                 ::"r"(slot + lane_off), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)) : "memory");
    __syncthreads();
    float2 m;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(m.x), "=f"(m.y) : "r"(slot) : "memory");
    a = m.x;
    b = m.y;
    if (threadIdx.x == 0) asm volatile("st.shared.v2.f32 [%0], {%1, %1};\n" ::"r"(slot ^ 16u), "f"(0.0f) : "memory");
}
// With SPLIT_MASK, and in the d = 128 loop: the tile's group scales
// computed by every thread, without a division or a shuffle: fl(amax/127) by div127_rn (common.cuh, exact
// on every finite amax ≥ 0), fl(127/amax) by the branch-free division (common.cuh's inv127_rn, checked
// on the device against __fdiv_rn(127, amax) on every non-negative FP32). The same bits as
// sage_group_scales' (0 and 0 for amax = 0) for every finite amax (amax = +inf, only from an infinite dS:
// fl(amax/127) becomes NaN instead of +inf; every dequantized product of that tile is NaN either way, since
// all its quantized values are 0). Instead of the IEEE division (FCHK, its slow-path branch) and 4 shuffles
// after barrier (b), for 17 more instructions per tile.
__device__ __forceinline__ void group_scale_of_amax(float amax, GroupScale& g) {
    g.scale = div127_rn(amax);  // 0 for amax = 0
    g.inv = inv127_rn(amax);  // common.cuh
}

// group_scale(amax_p) and group_scale(amax_ds) with one division per lane instead of four per
// thread: lane k (mod 4) computes quotient k (0: amax_p/127, 1: 127/amax_p, 2: amax_ds/127,
// 3: 127/amax_ds; 0 for an all-zero group, as group_scale) and lanes 0..3 broadcast theirs. The
// same __fdiv_rn on the same operands, so the same bits; every lane holds both amax (block max).
__device__ __forceinline__ void sage_group_scales(float amax_p, float amax_ds, GroupScale& sp, GroupScale& sds) {
    const int k = threadIdx.x & 3;
    const float amax = k < 2 ? amax_p : amax_ds;
    const bool inv = k & 1;
    float q = __fdiv_rn(inv ? 127.0f : amax, inv ? amax : 127.0f);
    if (amax == 0.0f) q = 0.0f;
    sp.scale = __shfl_sync(0xffffffffu, q, 0);
    sp.inv = __shfl_sync(0xffffffffu, q, 1);
    sds.scale = __shfl_sync(0xffffffffu, q, 2);
    sds.inv = __shfl_sync(0xffffffffu, q, 3);
}

// The causal / n_k mask of tile_ds_regs (permuted row order) as one key limit per row: key j ≥ 0
// of row r is visible iff j < visible_end(d, r) (common.cuh). The lane's keys are wkey0 + g + 8h,
// so each entry is one compare of 8h against the row's limit less wkey0 + g. Sets P = dS = 0 where
// masked, as before; returns whether the warp's tile needed a mask (warp-uniform).
__device__ __forceinline__ bool sage_mask(const Dims& d, int qb, int kb, float (*prob)[4], float (*ds)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wkey0 = kb * BLOCK_KV + (threadIdx.x >> 5) * 16;
    const int last_key = wkey0 + 15;
    const bool need_mask = last_key >= d.n_k || (d.causal && last_key > qb * BLOCK_Q + (d.n_k - d.n_q));
    if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int lim = visible_end(d, qb * BLOCK_Q + qrow_of(nt, 2 * t + c)) - (wkey0 + g);
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (8 * h >= lim) prob[nt][2 * h + c] = ds[nt][2 * h + c] = 0.0f;
            }
    }
    return need_mask;
}

// dS = fl(P·fl(dP − D)) of tile_ds_regs (dp in, dS out), without its mask.
__device__ __forceinline__ void sage_ds_regs(const float* rows, const float (*prob)[4], float (*ds)[4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 D = *(const float2*)(rows + BLOCK_Q + qrow_of(nt, 2 * t));
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(prob[nt][e], __fsub_rn(ds[nt][e], (e & 1) ? D.y : D.x));
    }
}

// Adds fl(float(acc)·scale) of the warp's 16 × d/2 dQ tile of block qb (rows 16(w mod 4).., columns
// (w div 4)·d/2..; acc[2np + j]: columns 16np + 8j.., as red_add_dq16) to the FP32 accumulator.
// A block whose 64 rows are all below n_q (every one but a ragged last) takes a branch-free path
// from one lane pointer; before, every 8-byte reduction sat in its own guarded branch with its
// address rebuilt inside (~200 instructions per tile at d = 64, now ~70).
// I2FP: the INT32 → FP32 conversion by one I2FP at every d (the d = 128 pipelined path), else sage_i2f.
// ROT_ACC (StagedSage128, SAGE_DQ_ACC_ROT): n-tile n of rows r_lo, r_lo + 8 to chunk position n ^ (r_lo mod 4).
template <bool I2FP = false, bool ROT_ACC = false>
__device__ __forceinline__ void sage_add_dq(const BackwardParams& p, const int (*acc)[4], float scale, int bh, int qb) {
    float val[HEAD_DIM / 16][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) val[n][e] = __fmul_rn(I2FP ? (float)acc[n][e] : sage_i2f(acc[n][e]), scale);
    int r_lo;
    float* dq_lo = dq_lane_ptr(p, bh, qb, r_lo);
    if (ROT_ACC) {  // once per item (its last block): plain guards
        static_assert(!ROT_ACC || SAGE_DQ_ACC_ROT, "the rotated accumulator order is sm_90a's d = 128 one");
        const int k = (threadIdx.x >> 2) & 3;  // = sage_dq_acc_chunk_xor(r_lo), and of r_lo + 8 (from the lane: fewer instructions)
        const bool lo = r_lo < p.dims.n_q, hi = r_lo + 8 < p.dims.n_q;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 16; ++n) {
            float* at = dq_lo + 8 * (n ^ k);
            if (lo) red_add_f32x2(at, val[n][0], val[n][1]);
            if (hi) red_add_f32x2(at + 8 * HEAD_DIM, val[n][2], val[n][3]);
        }
        return;
    }
    if ((qb + 1) * BLOCK_Q <= p.dims.n_q) {  // block-uniform
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 16; ++n) {
            red_add_f32x2(dq_lo + 8 * n, val[n][0], val[n][1]);
            red_add_f32x2(dq_lo + 8 * HEAD_DIM + 8 * n, val[n][2], val[n][3]);
        }
    } else {
#pragma unroll
        for (int np = 0; np < HEAD_DIM / 32; ++np) red_add_dq16(p.dims, dq_lo + 16 * np, r_lo, val + 2 * np);
    }
}

#if BWD_WGMMA
// wgmma descriptors as one low word per operand block plus compile-time offsets. A shared address
// a is a multiple of 16 below 2^18 (228 KB), so kmajor_desc(a + off) = kmajor_desc(a) + off/16 in
// the low word (start address a >> 4 < 2^14 never carries into bit 16, the LBO field) and the high
// word is a constant of the row width. Before, each of the tile's 28 descriptors was rebuilt from
// its address (add, mask, shift, or, then two moves to uniform registers).
__device__ __forceinline__ u32 sage_desc_lo(u32 addr) { return (u32)kmajor_desc(addr, 128); }

// = wg_kstep_desc<ROWS, ROW_BYTES>(base + tile_off, row0, ks) for lo = sage_desc_lo(base).
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ u64 sage_kstep_desc(u32 lo, u32 tile_off, int row0, int ks) {
    constexpr int ATOM = ROW_BYTES < 128 ? ROW_BYTES : 128, STEPS = ATOM / 32;
    const u32 hi = (u32)(kmajor_desc(0, ATOM) >> 32);  // a constant
    const u32 off = tile_off + (ks / STEPS) * (ROWS * ATOM) + 32 * (ks % STEPS);
    return ((u64)hi << 32) | (u64)(lo + (off >> 4) + row0 * (ATOM / 16));
}
#endif

// ---- Query-block staging with per-thread copy offsets computed once per CTA ------------
// The staged driver stages block qb + 1 through a QueryStager<Path> built before its query loop. This
// default asks the path every time (its stage_query_block rebuilds every address from threadIdx);
// a path may specialize it to keep the per-thread parts of its copies (swizzled destinations, source
// offsets, row limits) in registers: StagedSage at d = 64 on sm_90a, below its section.
template <class Path>
struct QueryStager {
    __device__ __forceinline__ QueryStager(const BackwardParams&, int) {}
    __device__ __forceinline__ void operator()(const BackwardParams& p, u32 st, int bh, int qb) const {
        Path::stage_query_block(p, st, bh, qb);
    }
};

// ---- The dŜ tile by stmatrix at d = 64 -----------------------------------------------
// The Sᵀ accumulator gives lane (g, t) keys g and g + 8 of the warp's 16 (one 16-byte chunk of a dŜ
// row) for rows 4t + c (+ 16, 2 per n-tile): 32 one-byte stores per thread per tile before. Stored
// instead as 16-bit pairs {key g, key g + 8} by two stmatrix.trans, each 16-byte chunk of dŜ holds its
// 16 keys in the order byte 2g + h = key g + 8h; K̂ᵀ (dQ's B, K = the keys) gets the same order in
// every 16-byte chunk, once per CTA in its first tile. dQ's INT32 sums over the keys are exact, so
// the order of their terms does not change a bit. With the wgmma dQ (sm_90a), at d = 64 and d = 128 (the dŜ tile is [64][128] bytes at both head dims; the K̂ᵀ half of a warpgroup is d/2 rows
// of 128 bytes: 2 chunks per thread at d = 64, 4 at d = 128).
#if BWD_WGMMA
// Byte 2g + h of every 16-byte chunk of this warpgroup's half of the K̂ᵀ tile (rows wg·d/2.., the
// rows its dQ wgmma reads) := byte g + 8h. In place, each thread its own two chunks; then the proxy
// fence (the caller's next barrier makes it visible to the next dQ wgmma).
__device__ __forceinline__ void interleave_kt_for_dq(u32 kt_tile) {
    constexpr int CHUNKS = HEAD_DIM / 2 * BLOCK_KV / (128 * 16);  // per thread: 2 at d = 64, 4 at d = 128
    static_assert(THREADS == 256 && HEAD_DIM / 2 * BLOCK_KV == CHUNKS * 128 * 16, "whole chunks per thread");
    const u32 a = kt_tile + (threadIdx.x >> 7) * (HEAD_DIM / 2 * BLOCK_KV) + 16 * (threadIdx.x & 127);
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const uint4 w = ld_shared_u4(a + 2048 * k);
        st_shared_u4(a + 2048 * k, make_uint4(interleave_bytes<false>(w.x, w.z), interleave_bytes<true>(w.x, w.z),
                                              interleave_bytes<false>(w.y, w.w), interleave_bytes<true>(w.y, w.w)));
    }
    fence_proxy_async();
}
#endif

// ---- The warpgroup index as a value ptxas knows is warp-uniform --------------------------
// threadIdx.x / 128 is the same in every lane of a warp, but ptxas does not know it: each wgmma whose
// descriptor depends on it (Sᵀ's and dPᵀ's A: K̂, V rows 64·wg; dQ's B: K̂ᵀ rows wg·d/2) had its
// descriptor built in vector registers and moved by 2 R2UR (+ VIADD, IMAD.MOV) per wgmma. Broadcast
// from lane 0 by a full-mask shuffle (as CUTLASS's canonical_warp_group_idx), it is uniform to ptxas
// and the descriptors live in uniform registers. The same value, so the same operands.
// Off at d = 64, where it is slower (ptxas re-executes the shuffle in every tile, right before the first wgmma);
// on at d = 128, with the dŜ stmatrix and the redux amax.
#if BWD_WGMMA
#ifndef UNIFORM_WARPGROUP_INDEX
#define UNIFORM_WARPGROUP_INDEX (HEAD_DIM == 128)
#endif
__device__ __forceinline__ int warpgroup_index() {
#if UNIFORM_WARPGROUP_INDEX
    return __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
#else
    return threadIdx.x >> 7;
#endif
}
#endif

// ---- The INT8 query loop software-pipelined across query blocks (sm_90a, d = 64) -----------
// staged_query_loop<StagedSagePipelined> (sage64_query_loop, below the generic loop): Sᵀ of block qb + 1 is issued
// right after the dV/dK products of block qb, so it runs while they are dequantized; the stage of
// qb + 1 is waited for at the tile's amax barrier, and the tile has that one block barrier instead of
// two. Three query-block stages (qb + 2 loads while qb and qb + 1 are read) and two amax scratches (no
// second barrier separates one tile's reads from the next tile's writes). The same arithmetic in the
// same order (every product, every FP32 operation) as the generic loop.
#if BWD_WGMMA && HEAD_DIM == 64
#define SAGE64_PIPELINED_LOOP 1
#define SAGE_QUERY_STAGES 3
#else
#define SAGE64_PIPELINED_LOOP 0
#define SAGE_QUERY_STAGES 2
#endif
// The INT8 path at d = 128 on sm_90a as its own type StagedSage128 (below StagedSagePipelined) with its own
// query loop (dQ by bulk reduce-adds, raw row constants, scales a tile ahead).
#if BWD_WGMMA && HEAD_DIM == 128
#define SAGE128_PIPELINED_LOOP 1
#else
#define SAGE128_PIPELINED_LOOP 0
#endif
#if SAGE128_PIPELINED_LOOP != SAGE_DQ_ACC_ROT
#error "StagedSage128 writes the dQ accumulator in SAGE_DQ_ACC_ROT's order, which sage_bwd_post_dq_int8 reads"
#endif

