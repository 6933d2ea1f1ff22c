// ---------------------------------------------------------------------------------------------
// Persistent INT8 forward, kernels `sage_forward_ws_p*`: the warp-specialized INT8 tile (ping-pong, early amax,
// S(kb + 1) overlapping the O update; WsInt8 and ws_tile, so the same bits as the query-block-pair schedule)
// on the persistent grid of the BF16 kernel (FpTile, fp_tile, fp_block_tile): min(tiles, SMs)
// blocks walk the tiles (query-block pair, batch·head) heaviest first (SNAKE: rounds alternate
// direction). The producer warpgroup streams Q̂ of the next tile into one of two Q slots and K̂, V̂ᵀ
// of every key block of every tile through one ring (its stage counter runs over all the block's
// tiles), so the next tile's loads overlap this tile's last blocks and O stores. A Q slot is
// loaded with the tile's first key block (same cp.async group: that stage's "full" barrier covers
// it) and released by the consumers (8 warps) at the tile's end. Tiles without key blocks (causal,
// N_q > N_k) load and release no Q slot: slots and their phases count the tiles with key blocks
// (j), so the producer never waits on a slot for a tile whose last stage it has not completed yet.
// The per-block scales (q_scale of the query block, k/v scales of key block 0) are loaded per tile
// by WsInt8's constructor.

// The tensor maps of the persistent INT8 kernel, its first parameters: V̂ᵀ (int8_v_map), for the TMA copies
// (F_TMA_KQ) K̂ as the 5-D view whose box lands in the permuted row order of the K̂ tile (permuted_row; src/tma.rs
// `permuted_rows_map`) and Q̂ as 2-D rows (src/forward.rs `int8_kq_maps`), and O for the TMA stores (`o_map`).
struct WspMaps {
    const void *v, *k, *q, *o;
};

#define WSP_STAGES (HEAD_DIM == 128 ? 4 : 8)  // 4 × 32 KB or 8 × 16 KB of K̂ and V̂ᵀ
#define WSP_Q_BYTES (2 * WG_Q_TILE)           // Q̂ of both query blocks of a tile
// d = 128: O stored by TMA from a staging box per consumer warp (wsp_store). d = 64 keeps the 4-byte pair stores: with
// the TMA stores ptxas allocates the d = 64 consumer's registers worse, and it is slower.
#define WSP_TMA_O (HEAD_DIM == 128)
#define WSP_OST_WARP (WSP_TMA_O ? 16 * HEAD_DIM * 2 : 0)  // a consumer warp's O staging: 16 rows × d BF16
// Option bits of the persistent kernel, the entries' V (wsp_consumer, WspInt8; described there).
#define WSP_INT_ROW_MAX 1
#define WSP_MASK_BY_LIMIT 2
#define WSP_NO_TURNS 4
// The issue-order options (wsp_softmax_p_hat_int_max, ws_tile's EARLY_TEST; described there).
#define WSP_ROW1_AFTER_INVERSES 8
#define WSP_EARLY_STAGE_TEST 32
#define WSP_QUAD_INT_MAX 64
#define WSP_ELECT_LANE 128
// Without turns: wsp_consumer with wsp_staggered_tile, the once-per-tile stagger of the two consumer
// warpgroups (described there).
#define WSP_TILE_STAGGER 8192

#ifdef SAGE_WGMMA
// WsRing's layout and interface (stage indices s, counters kb over the block's key blocks) with two
// Q̂ slots (the j-th tile with key blocks uses slot j & 1) and their "empty" mbarriers after the
// stages' ones.
struct WspSmem {
    static constexpr int kStages = WSP_STAGES;
    static constexpr int kSmemBytes =
        2 * WSP_Q_BYTES + 2 * WSP_STAGES * WG_TILE + 8 * WSP_OST_WARP + 8 * (2 * WSP_STAGES + 2) + 1024;
    u32 q, k, v, ost, full, empty, q_empty;
    __device__ __forceinline__ WspSmem(unsigned char* smem) {
        q = (smem_addr(smem) + 1023u) & ~1023u;
        k = q + 2 * WSP_Q_BYTES;
        v = k + WSP_STAGES * WG_TILE;
        ost = v + WSP_STAGES * WG_TILE;  // the 8 consumer warps' O staging (wsp_store)
        full = ost + 8 * WSP_OST_WARP;
        empty = full + 8 * WSP_STAGES;
        q_empty = empty + 8 * WSP_STAGES;
    }
    __device__ __forceinline__ u32 q_slot(int i) const { return q + (i & 1) * WSP_Q_BYTES; }
    __device__ __forceinline__ u32 k_stage(int s) const { return k + s * WG_TILE; }
    __device__ __forceinline__ u32 v_stage(int s) const { return v + s * WG_TILE; }
    __device__ __forceinline__ u32 full_bar(int s) const { return full + 8 * s; }
    __device__ __forceinline__ u32 empty_bar(int s) const { return empty + 8 * s; }
    __device__ __forceinline__ u32 q_empty_bar(int i) const { return q_empty + 8 * (i & 1); }
    __device__ __forceinline__ void wait_full(int kb) const { mbar_wait(full_bar(kb % WSP_STAGES), (kb / WSP_STAGES) & 1); }
    // Whether that phase has completed already (no wait; acquire when it has).
    __device__ __forceinline__ bool test_full(int kb) const {
        u32 r;
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(r)
            : "r"(full_bar(kb % WSP_STAGES)), "r"((u32)(kb / WSP_STAGES) & 1)
            : "memory");
        return r != 0;
    }
    // Producer: the previous use of the stage of the it-th key block / of the j-th Q slot was released.
    __device__ __forceinline__ void wait_empty(int it) const {
        if (it >= WSP_STAGES) mbar_wait(empty_bar(it % WSP_STAGES), ((it / WSP_STAGES) - 1) & 1);
    }
    __device__ __forceinline__ void wait_q_empty(int i) const {
        if (i >= 2) mbar_wait(q_empty_bar(i), ((i >> 1) - 1) & 1);  // i = j
    }
    // One thread: "full" completes on the 128 producer arrivals + the TMA's (with its bytes), with the TMA copies
    // (`tma_kq`) on the one arrival of the thread that issues them (with the bytes); the "empty" ones on one arrival
    // per consumer warp (8).
    __device__ __forceinline__ void init(bool tma_kq) const {
        for (int s = 0; s < WSP_STAGES; ++s) {
            mbar_init(full_bar(s), tma_kq ? 1 : WG_THREADS + 1);
            mbar_init(empty_bar(s), 8);
        }
        for (int s = 0; s < 2; ++s) mbar_init(q_empty + 8 * s, 8);
        fence_mbar_init();
    }
};

// F_TMA_KQ (where n_k is a non-zero multiple of 16): every copy of the producer by TMA from its one thread (tid 0): per
// key block K̂ and V̂ᵀ, per tile with key blocks Q̂ of both query blocks with its first block, on the stage's "full"
// barrier (one arrival with the bytes). The K̂ view folds the heads' 16-key groups together, so a head's last block
// may read the next head's first keys instead of zeros (the tensor's end reads zeros) and Q̂'s rows past n_q the next
// head's rows: such keys are masked (tile_needs_mask) and such rows are never stored. Instead of ws_load_k's ~40
// address instructions per 16-byte cp.async, which make the copies a large share of the kernel's issued instructions.
template <bool SNAKE>
__device__ void wsp_producer_tma(const WspMaps& m, const ForwardParams& p, const WspSmem& sm) {
    const Dims& d = p.dims;
    const int n_tiles = fp_tile_count(d);
    int it = 0, j = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile(d, t);
        if (x.end == 0) continue;
        const int bh_kv = kv_head_of(d, x.bh), g0 = bh_kv * (d.n_k / 16);  // the head's first 16-key group
        sm.wait_q_empty(j);
        for (int kb = 0; kb < x.end; ++kb, ++it) {
            const int s = it % WSP_STAGES;
            const u32 full = sm.full_bar(s);
            sm.wait_empty(it);
            mbar_arrive_expect_tx(full, 2 * WG_TILE + (kb == 0 ? WSP_Q_BYTES : 0));
            if (kb == 0) tma_load_2d(sm.q_slot(j), m.q, 0, x.bh * d.n_q + 2 * x.pair * BLOCK_Q, full);
            tma_load_5d(sm.k_stage(s), m.k, 0, 0, 0, 0, g0 + kb * (BLOCK_KV / 16), full);
            tma_load_2d(sm.v_stage(s), m.v, kb * BLOCK_KV, bh_kv * HEAD_DIM, full);
        }
        ++j;
    }
}

// The producer warpgroup (ws_producer's loads, over all the block's tiles): stage `it` is completed
// after stage it + 1 was issued (two in flight), across tile boundaries too. With F_TMA_KQ: wsp_producer_tma.
template <bool SNAKE>
__device__ void wsp_producer(const WspMaps& m, const ForwardParams& p, const WspSmem& sm) {
    const Dims& d = p.dims;
    const int tid = threadIdx.x, n_tiles = fp_tile_count(d);  // tid 0..127
    if (p.flags & F_TMA_KQ) {
        if (tid == 0) wsp_producer_tma<SNAKE>(m, p, sm);
        return;
    }
    int it = 0, j = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile(d, t);
        if (x.end == 0) continue;
        const int bh_kv = kv_head_of(d, x.bh);
        sm.wait_q_empty(j);
        for (int kb = 0; kb < x.end; ++kb, ++it) {
            const int s = it % WSP_STAGES;
            sm.wait_empty(it);
            if (tid == 0) {
                mbar_arrive_expect_tx(sm.full_bar(s), WG_TILE);
                tma_load_2d(sm.v_stage(s), m.v, kb * BLOCK_KV, bh_kv * HEAD_DIM, sm.full_bar(s));
            }
            if (kb == 0) ws_load_q_rows<2>(p, sm.q_slot(j), x.bh, 2 * x.pair * BLOCK_Q, tid);
            ws_load_k(p, sm.k_stage(s), bh_kv, kb, tid);
            cp_async_commit();
            if (it > 0) {
                cp_async_wait<1>();  // stage it − 1 (it may still be in flight)
                ws_complete_stage(sm.full_bar((it - 1) % WSP_STAGES));
            }
        }
        ++j;
    }
    if (it > 0) {
        cp_async_wait<0>();
        ws_complete_stage(sm.full_bar((it - 1) % WSP_STAGES));
    }
}

// The tile's O (BF16) and lse2, lse of a consumer warp (rows row0..row0 + 15): mma_store's values
// (the same bits) stored another way. mma_store writes each thread's 32 (d = 128: 64) BF16 as
// 2-byte stores, 8 rows per instruction, a quarter of each 32-byte sector: the consumer warps wait in the
// tile's epilogue for the store queue to take the next store's registers, and for the b_r load queued
// behind those stores; both warpgroups end a tile together, so nothing overlaps it. Here the
// thread's BF16 pairs (columns 2t, 2t + 1 of each n-tile, adjacent) go out as one 4-byte store each:
// half the stores, half the sector traffic. The b_r of the thread's rows (`ro`, row_offset, §3.5)
// come from wsp_row_offsets: at d = 64 loaded at the tile's start (WSP_EARLY_RO), at d = 128 just
// before the stores (early, ptxas spilled in the d = 128 key loop: that consumer is at its 240
// registers). Not staged in shared memory as 16-byte rows: with stmatrix or a __syncwarp / per-warp
// bar.sync ptxas treats the whole consumer as possibly divergent (WARPSYNC and collective shuffle paths
// in the key loop). The pairs are packed by cvt.rn.bf16x2.f32 (o_pack_pairs, in o_store_pairs).
// WSP_TMA_O (d = 128; d = 64 keeps o_store_pairs): the warp's BF16 pairs (o_pack_pairs, the same bits) go
// to its staging box in shared memory (16 rows × d in boxes of 64 columns = 128 bytes per row, 128-byte swizzle: the
// 16-byte chunk c of row r at c ^ (r mod 8), so that each 4-byte store of the warp hits 32 distinct banks), then one
// lane stores each box by a TMA tensor store (src/forward.rs `o_map`: rows past n_q are outside the map, not written). The lane that issued the previous tile's
// stores waits for their read of the box first (every lane waits: whichever lane elect.sync picked has them).
// Instead of o_store_pairs' 32 4-byte global stores per thread, whose LSU queue ("lg throttle") holds the
// d = 128 consumer.
__device__ __forceinline__ void wsp_stage_pair(u32 box, int row, int nt, u32 v) {
    const int c = nt % 8, t = threadIdx.x & 3;
    asm volatile("{\n.reg .b32 a;\nxor.b32 a, %1, %2;\nshl.b32 a, a, 4;\nadd.u32 a, a, %0;\nst.shared.b32 [a], %3;\n}\n"
                 ::"r"(box + (nt / 8) * 2048 + row * 128 + 4 * t), "r"(c), "r"(row & 7), "r"(v) : "memory");
}
__device__ void wsp_store(const ForwardParams& p, const void* omap, u32 ost, const RowState& st, const float (*o)[4], int bh,
                          int row0, const float (&ro)[2]) {
    if constexpr (!WSP_TMA_O) {
        o_store_pairs(p, st, o, bh, row0, [&](int h, long) { return ro[h]; });  // b_r loaded earlier
        return;
    }
    const float r_l[2] = {__frcp_rn(st.l[0]), __frcp_rn(st.l[1])};  // fl(1/l) once per row
    u32 pk[O_TILES][2];  // rows g (h = 0), g + 8 (h = 1): BF16 of columns 8nt + 2t (low half), + 1
    o_pack_pairs(st, o, r_l, pk);
    const u32 box = ost + ((threadIdx.x >> 5) - 4) * WSP_OST_WARP;  // consumer warps 0..7 (threads 128..383)
    bulk_wait_read();
    __syncwarp();
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int nt = 0; nt < O_TILES; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wsp_stage_pair(box, g + 8 * h, nt, pk[nt][h]);
    fence_proxy_async();
    __syncwarp();
#pragma unroll
    for (int half = 0; half < HEAD_DIM / 64; ++half) tma_store_3d_elect(omap, 64 * half, row0, bh, box + half * 2048);
    bulk_commit();
    store_lse_rows(p, st, bh, row0, [&](int h, long) { return ro[h]; });  // b_r loaded earlier
}

// row_offset (b_r) of the thread's two rows where wsp_store's lse needs them (quad leaders, rows < n_q,
// #1 INT8), 0 elsewhere.
__device__ __forceinline__ void wsp_row_offsets(const ForwardParams& p, int bh, int row0, float (&ro)[2]) {
    const Dims& d = p.dims;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + c_row(2 * h);
        const bool need = (threadIdx.x & 3) == 0 && r < d.n_q && (p.flags & F_QK);
        ro[h] = need ? p.op.row_offset[(long)bh * d.n_q + r] : 0.0f;
    }
}
// d = 64: the b_r loads at the tile's start, their latency hidden by the key loop (wsp_store).
#define WSP_EARLY_RO (HEAD_DIM == 64)

// The persistent consumer's key-block softmax (bits of V; the default WSP_INT_MAX_OPTS
// below). WSP_INT_ROW_MAX: the thread's row maxima of the score factors a = float(acc) as float(max acc),
// the integer max by VIMNMX3 (15 three-input + 1 two-input per row instead of 31 FMNMX on the floats),
// taken straight from the S accumulators before the mask test (so that ptxas interleaves them with
// the 64 I2FP; wasted on boundary blocks, which overwrite mx with the float max of the masked
// factors): the conversion is exact (|acc| ≤ 127²·64 < 2²⁴) and non-decreasing, so float(max acc) =
// max float(acc) bit for bit (I2FP of 0 is +0, no −0 arises). The same mx as before, hence the same
// m, α, P̂, l. WSP_MASK_BY_LIMIT (with WSP_INT_ROW_MAX): boundary blocks masked by wsp_mask_limit (one
// limit per row) instead of mask_permuted. WSP_NO_TURNS: no turns between the consumer warpgroups.
// (The option bits are defined above, outside SAGE_WGMMA: the entries use them on sm_80 too.)

// mask_permuted's −∞ by one limit per row (the BF16 mask's form, for the permuted key order):
// the key of entry (nt, e) is col0 + c with col0 = key0 + 4·(lane % 4) and the compile-time offset
// c = 16·(nt / 2) + 2·(nt % 2) + (e % 2) (permuted_key), and visible(d, r, j) ⇔ j < visible_end(d, r)
// for j ≥ 0 (common.cuh), so an entry is masked iff c ≥ visible_end(d, r) − col0: one compare and one
// select per entry instead of visible()'s three tests. Same entries, same sc = 0 rule (mask_tile).
// For boundary blocks only (the caller tests tile_needs_mask).
__device__ __forceinline__ void wsp_mask_limit(const Dims& d, float (*t)[4], int row0, int key0, float& sc) {
    masked_zero_scale(t, sc);
    const int col0 = key0 + 4 * (threadIdx.x & 3);
    const int limit[2] = {visible_end(d, row0 + c_row(0)) - col0, visible_end(d, row0 + c_row(2)) - col0};
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if ((nt >> 1) * 16 + 2 * (nt & 1) + (e & 1) >= limit[e >> 1]) t[nt][e] = neg_inf();
}

// The max of row h (0: elements 0, 1 of each n-tile; 1: elements 2, 3) of this thread's S
// accumulators: 32 → 11 → 4 → 2 → 1.
__device__ __forceinline__ int wsp_row_imax(const int (&acc)[64], int h) {
    int a[11];
#pragma unroll
    for (int k = 0; k < 11; ++k) {
        const int i = 3 * k;  // entries i, i + 1, i + 2 of the row: n-tile j / 2, element 2h + j % 2
        const int x0 = acc[4 * (i >> 1) + 2 * h + (i & 1)], x1 = acc[4 * ((i + 1) >> 1) + 2 * h + ((i + 1) & 1)];
        a[k] = k < 10 ? __vimax3_s32(x0, x1, acc[4 * ((i + 2) >> 1) + 2 * h + ((i + 2) & 1)]) : max(x0, x1);
    }
    const int b0 = __vimax3_s32(a[0], a[1], a[2]), b1 = __vimax3_s32(a[3], a[4], a[5]);
    const int b2 = __vimax3_s32(a[6], a[7], a[8]), b3 = max(a[9], a[10]);
    return max(__vimax3_s32(b0, b1, b2), b3);
}

// x with a data dependency on inv, x unchanged: the bits of x plus the sign bit of inv, which
// is 0 (inv127_rn gives +0, a positive value or +inf — fl(127/amax) overflows for amax < ~2^-121). As
// inline PTX so that neither NVVM nor ptxas folds it. (Not fma(0, inv, x): that is NaN for inv = +inf.)
__device__ __forceinline__ float wsp_depend_on(float x, float inv) {
    u32 r;
    asm("{\n.reg .u32 s;\nshr.u32 s, %2, 31;\nadd.u32 %0, %1, s;\n}\n" : "=r"(r) : "r"(__float_as_uint(x)), "r"(__float_as_uint(inv)));
    return __uint_as_float(r);
}

// softmax_p_hat_early_mx<true> (the same operations, the same order, the same bits) with the
// exponentials' scale sc of row 1 (WSP_ROW1_AFTER_INVERSES) made data-
// dependent on the group inverses inv of the quantizer (wsp_depend_on: the same value). Otherwise
// ptxas issues the two RCP chains of inv127_rn after all 64 EX2s (nothing waited on them before the
// quantization), so the 64 quantizing FFMAs + 48 PRMTs ran after the EX2 stream instead of in the
// issue slots between its MUFUs; with row 1's exponentials depending on inv, the chains run during
// row 0's exponentials and the quantization can interleave with row 1's.
// Alone (without the other issue-order options) it does not pay: the EX2s of the SMSP's two consumer warps share
// the XU, so the slots gained are not free.
// WSP_QUAD_INT_MAX: mx holds the quad's row maxima already (quad_fmax after the integer shuffles), so only
// row_max_commit is left.
template <int V>
__device__ __forceinline__ void wsp_softmax_p_hat_int_max(float (*t)[4], RowState& st, u32 (*pa)[4], float sc, float* mx) {
    float m_use[2], inv[2];
    if constexpr ((V & WSP_QUAD_INT_MAX) != 0) row_max_commit<true>(st, mx, m_use, sc);
    else quad_max_update<true>(st, mx, m_use, sc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float amax = exp2_ftz(__fmaf_rn(mx[h], sc, -m_use[h]));
        st.p_scale[h] = div127_rn(amax);
        inv[h] = inv127_rn(amax);
    }
    float sch[2] = {sc, sc};
    if constexpr ((V & WSP_ROW1_AFTER_INVERSES) != 0) sch[1] = wsp_depend_on(wsp_depend_on(sc, inv[0]), inv[1]);
    softmax_exp_sum_rows<false, true>(t, st, m_use, nullptr, sch);
    quantize_p_tile(t, inv, pa);
}

// The score factors t = float(acc) of a key block's finished S accumulators and the thread's (WSP_QUAD_INT_MAX: the
// quad's) row maxima mx, by WSP_INT_ROW_MAX's integer max; boundary blocks masked (which may set sc = 1, mask_tile)
// and their maxima taken again on the masked floats.
template <int V>
__device__ __forceinline__ void wsp_int_max_scores(const Dims& d, const int (&sacc)[64], float (*t)[4], float* mx, float& sc,
                                                   int row0, int key0) {
    if constexpr ((V & WSP_QUAD_INT_MAX) != 0) {
        // WSP_QUAD_INT_MAX: the quad's row maxima on the integers (float(max acc) = max float(acc), as above),
        // so that the shuffles' latency overlaps the 64 I2FP; boundary blocks redo them on the floats.
        int im[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) im[h] = wsp_row_imax(sacc, h);
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1)
#pragma unroll
            for (int h = 0; h < 2; ++h) im[h] = max(im[h], __shfl_xor_sync(0xffffffffu, im[h], o2));
#pragma unroll
        for (int h = 0; h < 2; ++h) mx[h] = (float)im[h];
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) mx[h] = (float)wsp_row_imax(sacc, h);
    }
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) t[nt][e] = (float)sacc[4 * nt + e];
    // (QUAD_IMAX: the test is warp-uniform — row0 and key0 are — and voted so that ptxas knows it: the
    // shuffles of the masked path then leave the rest of the loop convergent, without BRA.DIV paths.)
    const bool masked = tile_needs_mask(d, row0, key0);
    if ((V & WSP_QUAD_INT_MAX) != 0 ? __any_sync(0xffffffffu, masked) : masked) {
        if constexpr ((V & WSP_MASK_BY_LIMIT) != 0) wsp_mask_limit(d, t, row0, key0, sc);
        else mask_permuted(d, t, row0, key0, sc);
        thread_row_max(t, mx);
        if constexpr ((V & WSP_QUAD_INT_MAX) != 0) quad_fmax(mx);
    }
}

template <int V>
struct WspInt8 : WsInt8<true, true> {
    using Base = WsInt8<true, true>;
    __device__ __forceinline__ WspInt8(const ForwardParams& p, u32 q_tiles, int w, int bh, int bh_kv, int qb, int cta_end)
        : Base(p, q_tiles, w, bh, bh_kv, qb, cta_end) {}
    // WSP_ELECT_LANE: elect.sync (one ELECT, any one lane) instead of lane 0 by S2R of %tid, which ptxas
    // re-reads in every key block (its latency before the O update).
    __device__ __forceinline__ bool warp_leader() const {
        if constexpr ((V & WSP_ELECT_LANE) != 0) {
            return elect_one();
        } else {
            return Base::warp_leader();
        }
    }
    // O and the row state are final as they are (wsp_store normalizes).
    __device__ __forceinline__ void finish_rows(const ForwardParams&, RowState&, float (*)[4]) const {}
    __device__ __forceinline__ void softmax(const Dims& d, RowState& st, int row0, int key0) {
        if constexpr (V & WSP_INT_ROW_MAX) {
            float t[S_TILES][4], mx[2];
            float sc = __fmul_rn(sq, k_sc);
            wsp_int_max_scores<V>(d, sacc, t, mx, sc, row0, key0);
            if constexpr ((V & (WSP_ROW1_AFTER_INVERSES | WSP_QUAD_INT_MAX)) != 0) wsp_softmax_p_hat_int_max<V>(t, st, pa, sc, mx);
            else softmax_p_hat_early_mx<true>(t, st, pa, sc, mx);
        } else {
            Base::softmax(d, st, row0, key0);
        }
    }
};

// The once-per-tile stagger (WSP_TILE_STAGGER, without turns). Without turns the two
// consumer warpgroups run free and drift apart within a block's tiles, by different amounts on different
// SMs. Here warpgroup 1 starts each tile's first S only once warpgroup 0's S of its first key block of the
// tile is done (named barrier 3, warpgroup 0 arrives at the start of that block's softmax): the two are
// re-aligned, nearly in phase, at every tile; then they run free again, with no per-block barrier. So that
// warpgroup 0 never arrives twice on barrier 3 before warpgroup 1 waited there once, warpgroup 0 starts a
// tile only after warpgroup 1 has started the previous one (barrier 4: warpgroup 1 arrives once before its
// first tile and after each wait on 3, warpgroup 0 waits before each tile and once after its last). Tiles
// without key blocks take no part (both warpgroups skip them alike). The arithmetic is ws_tile's.
// In phase is what pays (warpgroup 1 half a block or more behind is slower); the gain is in the kernel's tail (the
// last SM finishes closer to the average one), not in the per-block stalls.
#define WSP_BAR_START_WG1 3  // warpgroup 0 → 1: the tile's start
#define WSP_BAR_STARTED_WG0 4  // warpgroup 1 → 0: the previous tile started
// bar.arrive on barrier 3 (256 threads) if p, predicated (no branch before the softmax's code).
__device__ __forceinline__ void wsp_stagger_arrive_if(bool p) {
    asm volatile("{\n.reg .pred q;\nsetp.ne.u32 q, %0, 0;\n@q bar.arrive 3, 256;\n}\n" ::"r"((u32)p) : "memory");
}

// ws_tile<false, true> (no turns, overlap; the same steps) with warpgroup 0's arrival on barrier 3 at the
// start of the tile's first key block when `arrive`.
template <class Mix>
__device__ __forceinline__ void wsp_staggered_tile(const Dims& d, const WspSmem& sm, Mix& mx, int row0, int it0, int end,
                                           RowState& st, float (*o)[4], bool arrive) {
    if (end > 0) {
        sm.wait_full(it0);
        mx.issue_scores(sm.k_stage(it0 % WspSmem::kStages));
        wgmma_wait<0>();
    }
    // arr: `arrive` in the first key block, false after it, opaque to NVVM (which otherwise peeled the first
    // block off the loop to resolve kb == 0: a second copy of the whole block's code).
    u32 arr = arrive;
    for (int kb = 0; kb < end; ++kb) {
        const int s = (it0 + kb) % WspSmem::kStages, s1 = (it0 + kb + 1) % WspSmem::kStages;
        const bool next = kb + 1 < end;
        mx.begin_block(kb, next);
        wsp_stagger_arrive_if(arr != 0);
        mx.softmax(d, st, row0, kb * BLOCK_KV);
        if (next) sm.wait_full(it0 + kb + 1);
        mx.pin();
        mx.issue_pv(sm.v_stage(s));
        if (next) mx.issue_scores(sm.k_stage(s1));
        if (next) wgmma_wait<1>();  // P·V(kb) done; S(kb + 1) may still run
        else wgmma_wait<0>();
        __syncwarp();
        if (mx.warp_leader()) mbar_arrive(sm.empty_bar(s));  // K(kb), V(kb) read by this warp
        mx.o_update(o, st);
        wgmma_wait<0>();
        mx.end_block();
        arr = 0;
        asm volatile("" : "+r"(arr));
    }
}

// Consumer warpgroup w: query block 2·pair + w of each of the block's tiles, one ws_tile each with
// WsInt8<early amax> (the per-tile scales), then its Q slot released and O stored. Ping-pong: the
// turns alternate over all tiles (end + 1 per tile for both warpgroups), so warpgroup 1 passes the
// first turn once and warpgroup 0 takes the last one once; the block's first tile is its heaviest,
// so it has turns iff any tile has. WSP_TILE_STAGGER (no turns): wsp_staggered_tile with the stagger's handshake
// (above) instead, whose first arrival and last wait follow the same rule.
// Mix: the products and softmax of a key block (WspInt8<V>, or WspFp8Pv<V> of sm90/forward_fp8.cu), whose
// finish_rows prepares O and the row state for wsp_store.
template <bool SNAKE, int V, class Mix>
__device__ void wsp_consumer(const ForwardParams& p, const WspMaps& maps, const WspSmem& sm, int w) {
    constexpr bool PP = !(V & WSP_NO_TURNS), STAGGER = (V & WSP_TILE_STAGGER) != 0;
    const Dims& d = p.dims;
    const int warp = (threadIdx.x >> 5) & 3, n_tiles = fp_tile_count(d);
    const bool turns = (PP || STAGGER) && (int)blockIdx.x < n_tiles && fp_tile(d, blockIdx.x).end > 0;
    if (turns && w == 1) {
        if constexpr (STAGGER) named_arrive(WSP_BAR_STARTED_WG0, 2 * WG_THREADS);
        else pass_turn(1);
    }
    int it = 0, j = 0;
    for (int i = 0, t = fp_block_tile<SNAKE>(0); t < n_tiles; t = fp_block_tile<SNAKE>(++i)) {
        const FpTile x = fp_tile(d, t);
        const int qb = 2 * x.pair + w, row0 = qb * BLOCK_Q + warp * 16;
        Mix mx(p, sm.q_slot(j), w, x.bh, kv_head_of(d, x.bh), qb, x.end);
        float ro[2];
        if (WSP_EARLY_RO) wsp_row_offsets(p, x.bh, row0, ro);
        RowState st;
        float o[O_TILES][4];
        start_rows(st, o);
        if constexpr (STAGGER) {
            // (The warpgroup test voted, so that ptxas knows it is warp-uniform: otherwise it treated the
            // softmax's shuffles as possibly divergent, a second, collective path for them.)
            const bool stag = x.end > 0;
            const bool w0 = __any_sync(0xffffffffu, stag && w == 0), w1 = __any_sync(0xffffffffu, stag && w != 0);
            if (w0) named_sync(WSP_BAR_STARTED_WG0, 2 * WG_THREADS);
            if (w1) {
                named_sync(WSP_BAR_START_WG1, 2 * WG_THREADS);
                named_arrive(WSP_BAR_STARTED_WG0, 2 * WG_THREADS);
            }
            wsp_staggered_tile(d, sm, mx, row0, it, x.end, st, o, w0);
        } else {
            ws_tile<PP, true, Mix, WspSmem, (V & WSP_EARLY_STAGE_TEST) != 0>(d, sm, mx, w, row0, it, x.end, st, o);
        }
        it += x.end;
        if (x.end > 0) {
            __syncwarp();
            if ((threadIdx.x & 31) == 0) mbar_arrive(sm.q_empty_bar(j));  // every S of the tile is done
            ++j;
        }
        // (Voted: warp-uniform, as qb is, but ptxas cannot know it (w comes from threadIdx.x); wsp_store's warp-wide
        // steps under a test it took as divergent gave the consumer collective fallback paths, key loop included.)
        if (WSP_TMA_O ? __any_sync(0xffffffffu, qb < d.n_qblk) : qb < d.n_qblk) {
            if (!WSP_EARLY_RO) wsp_row_offsets(p, x.bh, row0, ro);
            mx.finish_rows(p, st, o);
            wsp_store(p, maps.o, sm.ost, st, o, x.bh, row0, ro);
        }
    }
    if (turns && w == 0) {
        if constexpr (STAGGER) named_sync(WSP_BAR_STARTED_WG0, 2 * WG_THREADS);
        else take_turn(0);
    }
    if (WSP_TMA_O) bulk_wait();  // the O stores (wsp_store) have read their staging and written O before the CTA exits
}
#else
template <int V>
struct WspInt8 {};  // the entry's name for the sm_80 compilation, whose wsp_main traps
#endif  // SAGE_WGMMA

// The persistent INT8 path: launched by src/forward.rs with min(tiles, SMs) blocks of 384 threads,
// WspSmem::kSmemBytes of dynamic shared memory and the tensor maps (WspMaps).
template <bool SNAKE, int V, class Mix>
__device__ __forceinline__ void wsp_main(const WspMaps& maps, const ForwardParams& p, unsigned char* smem) {
#ifdef SAGE_WGMMA
    require_dynamic_smem((u32)WspSmem::kSmemBytes);
    if (blockDim.x != WS_THREADS) __trap();
    const WspSmem sm(smem);
    if (threadIdx.x == 0) sm.init((p.flags & F_TMA_KQ) != 0);
    __syncthreads();
    // Launched with PDL after the Q/K/V quantization (src/forward.rs): nothing of global memory is
    // read or written above, and every thread waits here for the quantization's grid (which itself
    // waits for the K mean's) before its role reads Q̂, K̂, V̂ᵀ or their scales.
    pdl_wait();
    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        setmaxnreg_dec<24>();
        wsp_producer<SNAKE>(maps, p, sm);
    } else {
        setmaxnreg_inc<240>();
        wsp_consumer<SNAKE, V, Mix>(p, maps, sm, wg - 1);
    }
#else
    __trap();  // not compiled for sm_90a
#endif
}

#define WSP_ENTRY(name, SNAKE, V, MIX)                                                                            \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                                   \
        name(const __grid_constant__ TmaMapParam vmap, const __grid_constant__ TmaMapParam kmap,                  \
             const __grid_constant__ TmaMapParam qmap, const __grid_constant__ TmaMapParam omap, ForwardParams p) {  \
        extern __shared__ __align__(128) unsigned char ws_smem[];                                                 \
        wsp_main<SNAKE, V, MIX<V>>(WspMaps{&vmap, &kmap, &qmap, &omap}, p, ws_smem);                              \
    }
// The entry's options:
// - WSP_INT_MAX_OPTS: the integer row max and the one-limit boundary mask.
// - WSP_ISSUE_OPTS: row 1's exponentials after the quantizer inverses, so that ptxas puts the quantization into the
//   EX2 stream's idle slots; the next stage's early test (active with the turns only); the quad maxima on the
//   integers; elect.sync.
// - WSP_NO_TURNS | WSP_TILE_STAGGER: no ping-pong turns between the consumer warpgroups (FA3's), the once-per-tile
//   stagger (wsp_staggered_tile) instead: once the producer's copies are off the schedulers the turns' barriers cost
//   more than they save, at both head dims. (The entry with the turns is in git history, commit a7b23b3.)
#define WSP_INT_MAX_OPTS (WSP_INT_ROW_MAX | WSP_MASK_BY_LIMIT)
#define WSP_ISSUE_OPTS (WSP_ROW1_AFTER_INVERSES | WSP_EARLY_STAGE_TEST | WSP_QUAD_INT_MAX | WSP_ELECT_LANE)
WSP_ENTRY(sage_fwd_sm90_int8_persistent, true, WSP_INT_MAX_OPTS | WSP_NO_TURNS | WSP_TILE_STAGGER | WSP_ISSUE_OPTS, WspInt8)

// Every path takes its shared memory from the dynamic allocation, its own size (src/forward.rs,
// `forward_mma_smem_bytes`, mirrors FAST_SMEM_BYTES, BF16_SMEM_BYTES and GATHER_SMEM_BYTES); a
// launch with less traps rather than corrupt memory.
// 128 threads (launch bounds of 256: its paths' verified machine code was compiled with those bounds, and other bounds
// would change it).
