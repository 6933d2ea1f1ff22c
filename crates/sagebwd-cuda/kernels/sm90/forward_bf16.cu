// ---------------------------------------------------------------------------------------------
// Warp-specialized BF16 path (sm_90a), kernel `sage_fwd_sm90_bf16_pairs`: the staged BF16 path's
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

// The INT8 pairs kernel's schedule: ping-pong, S(kb + 1) during the O update of kb (faster than without the
// ping-pong, than S(kb + 1) after the O update, and than P·V as two n64 products).
__device__ void ws_consumer_bf16(const ForwardParams& p, const WsBf16Ring& sm, int w, int bh, int cta_end) {
    WsBf16 mx(p, sm.q, w);
    ws_consume<true, true>(p, sm, mx, w, bh, cta_end);
}
#endif  // SAGE_WGMMA

// The warp-specialized BF16 path (#1 and #2 BF16 on sm_90a) on a grid of query-block pairs. Launched
// by src/forward.rs with 384 threads, WsBf16Ring::kSmemBytes of dynamic shared memory and the
// tensor maps of Q, K, V.
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    sage_fwd_sm90_bf16_pairs(const __grid_constant__ TmaMapParam qmap, const __grid_constant__ TmaMapParam kmap,
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
// Persistent BF16 forward, kernels `sage_forward_ws_bf16_p*`: the arithmetic of
// sage_fwd_sm90_bf16_pairs except that P·V accumulates straight onto the rescaled O (§4, #2 BF16: one
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
// P·V(kb)), so 2 stages would leave the load of kb + 2 no slack: 3 at d = 128 (192 KB, hence one Q slot), 5 at d = 64 with two Q slots.
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
// get work closer to the mean than with the plain stride
// (a static count of key blocks per block). Either way the block's first tile is its
// heaviest.
template <bool SNAKE>
__device__ __forceinline__ int fp_block_tile(int i) {
    const int lane = SNAKE && (i & 1) ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    return i * (int)gridDim.x + lane;
}

// Head-grouped order (BF16 kernels only; `sage_fwd_sm90_bf16_persistent_grouped`): the tiles of G (batch·head)s form a group,
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
// pack_bf16x2_nan: one cvt per pair of products fl(O·fl(1/l)). If a row of the thread has
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
// keeps its own form: through this helper ptxas re-allocates the whole BF16 kernel
// and it is slower.
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
            // differently, so they keep this form.
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
// overlap, is slower.)
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
FP_ENTRY(sage_fwd_sm90_bf16_persistent, true, true, false)   // ping-pong, the snake tile order
FP_ENTRY(sage_fwd_sm90_bf16_persistent_grouped, true, true, true)    // the same with head-grouped tiles

