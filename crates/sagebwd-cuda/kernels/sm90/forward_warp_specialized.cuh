// ---------------------------------------------------------------------------------------------
// The wgmma INT8 helpers (sm_90a; #1 and #2 INT8 without Q-smoothing) of the warp-specialized kernels below:
// the staged INT8 path's arithmetic on Hopper's warpgroup tensor-core instruction. Warpgroup w takes one query
// block of 64 rows, its warp i rows 16i..16i+15, so each thread holds exactly the fragments of the mma.sync path:
// the S accumulator of wgmma m64n128k32 is the 16 n-tiles × 4 values t[nt][e] of a warp, and its A operand
// (from registers) is the m16n8k32 A layout. Hence:
// - S = Q̂ K̂ᵀ: A = the warpgroup's Q̂ tile [64 rows][d] and B = the K̂ tile [128 keys][d], both in
//   shared memory, K-major (d contiguous), through descriptors. The K̂ rows are stored in the permuted key order
//   kmap (row 8nt + n holds key kmap(nt, n)), so the accumulator comes out permuted exactly as in the
//   staged path and P̂ packs into A fragments with no shuffle (softmax_p_hat).
// - O += P̂ V̂: A = P̂ (registers), B = the V̂ᵀ tile [d][128 keys], K-major (keys contiguous).
// Tiles are 1024-byte aligned in the hardware's swizzled layout (128-byte rows: 128-byte swizzle;
// the 64-byte K̂ rows at d = 64: 64-byte swizzle).

#define WG_THREADS 128                     // one warpgroup
#define WG_TILE (BLOCK_KV * HEAD_DIM)       // bytes of one K̂ or V̂ᵀ tile (a multiple of 1024)
#define WG_Q_TILE (BLOCK_Q * HEAD_DIM)      // bytes of one warpgroup's Q̂ tile

#ifdef SAGE_WGMMA
// Row of the permuted K̂ tile that holds key `key` (inverse of kmap: key = 16a + 4b + 2c + e is
// column n = 2b + e of n-tile nt = 2a + c, i.e. row 8nt + n).
__device__ __forceinline__ int permuted_row(int key) {
    return (key & ~15) | (((key >> 1) & 1) << 3) | (((key >> 2) & 3) << 1) | (key & 1);
}

// Issues S = Q̂ K̂ᵀ (the warpgroup's 64 rows × 128 permuted keys) into acc, one commit group.
__device__ __forceinline__ void wg_issue_scores(int (&acc)[64], u32 qt, u32 kt) {
    const u64 qdesc = kmajor_desc(qt, HEAD_DIM), kdesc = kmajor_desc(kt, HEAD_DIM);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < HEAD_DIM / 32; ++s) wgmma_s8_ss_n128(acc, qdesc + 2 * s, kdesc + 2 * s, s);
    wgmma_commit();
}

// One k = 32 step of P·V at this head dim: s8 × s8 → s32 (INT32 accumulator) or e4m3 × e4m3 → f32 (FP32 one).
__device__ __forceinline__ void wgmma_pv_step(int (&acc)[HEAD_DIM / 2], const u32 (&a)[4], u64 desc, int accumulate) {
#if HEAD_DIM == 128
    wgmma_s8_rs_n128(acc, a, desc, accumulate);
#else
    wgmma_s8_rs_n64(acc, a, desc, accumulate);
#endif
}
__device__ __forceinline__ void wgmma_pv_step(float (&acc)[HEAD_DIM / 2], const u32 (&a)[4], u64 desc, int accumulate) {
#if HEAD_DIM == 128
    wgmma_e4m3_rs_n128(acc, a, desc, accumulate);
#else
    wgmma_e4m3_rs_n64(acc, a, desc, accumulate);
#endif
}

// Issues acc = P̂ V̂ (64 rows × d) from the P̂ fragments pa and the V̂ᵀ tile at vt, one commit group: INT8 (int acc) or
// e4m3 (float acc, the FP8 P·V forward).
template <class T>
__device__ __forceinline__ void wg_issue_pv(T (&acc)[HEAD_DIM / 2], const u32 (*pa)[4], u32 vt) {
    const u64 desc = kmajor_desc(vt, BLOCK_KV);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < BLOCK_KV / 32; ++s) wgmma_pv_step(acc, pa[s], desc + 2 * s, s);
    wgmma_commit();
}

// elect.sync: one lane of the warp (any one) true, by one ELECT instead of lane 0 by S2R of %tid.
__device__ __forceinline__ bool elect_one() {
    u32 e;
    asm volatile("{\n.reg .pred e;\nelect.sync _|e, 0xffffffff;\nselp.u32 %0, 1, 0, e;\n}\n" : "=r"(e));
    return e != 0;
}

// The score factors a = float(acc) of the finished S accumulators (base-2 scores t = fl(a·sc), §4),
// masked where needed (which may set sc = 1, mask_tile).
__device__ __forceinline__ void wg_scores(const Dims& d, float (*t)[4], const int (&acc)[64], float& sc, int row0, int key0) {
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) t[nt][e] = (float)acc[4 * nt + e];
    mask_permuted(d, t, row0, key0, sc);
}

#endif  // SAGE_WGMMA

// ---------------------------------------------------------------------------------------------
// Warp-specialized wgmma INT8 forward (sm_90a): the helpers above with the copies moved out of the consumers' issue
// slots. The ring, loads and consumer tile below serve the persistent INT8 kernels (sm90/forward_int8.cu) and the
// BF16 kernels. A block of 3 warpgroups (384 threads) owns 2 query blocks
// (128 rows) at a time:
// - warpgroup 0, the producer (setmaxnreg 24): K̂ tiles by cp.async in the permuted key order
//   (a TMA box cannot express that order for a key count that is not a multiple of 16 without
//   reading past the end of K̂; cp.async zero-fills keys ≥ n_k), V̂ᵀ tiles by TMA (one thread, a
//   2-D tensor map over [B·H_kv·d rows][n_kpad keys], 128-byte swizzle = the wgmma layout), Q̂ of
//   both query blocks, into a ring of stages. Stage s is "full" (mbarrier, 128
//   producer arrivals + the TMA's byte count) once this thread's cp.async group has landed and
//   been fenced for the async proxy, "empty" (8 arrivals: each consumer warp) once both consumer
//   warpgroups' wgmmas have read it. The producer completes stage kb after issuing stage kb + 1,
//   so two stages are in flight; the consumers are never blocked by a barrier of the whole block.
// - warpgroups 1, 2, the consumers (setmaxnreg 240): query block w of the pair; S(kb + 1) issued before the
//   O update of block kb, so that it runs meanwhile. With PINGPONG (FA3), named barriers make the two warpgroups issue
//   their wgmmas in turn, so one warpgroup's softmax runs while the other's products run.
// - EARLY_AMAX: the P̂ group amax as exp2(fma(a_max, sc, −m_new)) (§4) before the exponentials, so
//   the two IEEE divisions of its scale run beside them instead of after a max over 64 values and
//   two shuffles; the quantizer needs no clamp to 127 (exp2_ftz is monotone on [−∞, 16], tested
//   exhaustively: no p exceeds that amax).
// - The K̂/V̂ᵀ scales of the next block are loaded a block ahead, and the P̂V
//   accumulators convert to FP32 by one I2FP.

#define WS_THREADS 384
#define WS_BARS 2                   // named barriers 1, 2: the consumers' ping-pong
// A CUtensorMap (128 bytes, 64-byte aligned) as the kernel receives it: src/tma.rs encodes it.
struct __align__(64) TmaMapParam {
    unsigned long long words[16];
};

#ifdef SAGE_WGMMA
// Shared-memory addresses of a warp-specialized layout: the Q tile(s) of both query blocks
// (Q_BYTES), rings of STAGES K and V tiles (TILE bytes each), then STAGES full and STAGES empty
// mbarriers (8 B each); the first tile 1024-aligned (the swizzled layouts need it).
template <int Q_BYTES, int TILE, int STAGES>
struct WsRing {
    static constexpr int kStages = STAGES;
    static constexpr int kSmemBytes = Q_BYTES + 2 * STAGES * TILE + 16 * STAGES + 1024;
    u32 q, k, v, full, empty;
    __device__ __forceinline__ WsRing(unsigned char* smem) {
        q = (smem_addr(smem) + 1023u) & ~1023u;
        k = q + Q_BYTES;
        v = k + STAGES * TILE;
        full = v + STAGES * TILE;
        empty = full + 8 * STAGES;
    }
    __device__ __forceinline__ u32 k_stage(int s) const { return k + s * TILE; }
    __device__ __forceinline__ u32 v_stage(int s) const { return v + s * TILE; }
    __device__ __forceinline__ u32 full_bar(int s) const { return full + 8 * s; }
    __device__ __forceinline__ u32 empty_bar(int s) const { return empty + 8 * s; }
    // Consumers: blocks until key block kb's stage is loaded.
    __device__ __forceinline__ void wait_full(int kb) const { mbar_wait(full_bar(kb % STAGES), (kb / STAGES) & 1); }
    // The mbarriers (one thread): "full" completes after `full_count` arrivals (+ the TMA bytes),
    // "empty" after one arrival per consumer warp (8).
    __device__ __forceinline__ void init(u32 full_count) const {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar(s), full_count);
            mbar_init(empty_bar(s), 8);
        }
        fence_mbar_init();
    }
    // Producer: for each key block, waits until its stage is free (read by every consumer warp the
    // previous time round), then lets fill(kb, s) load it.
    template <class Fill>
    __device__ __forceinline__ void produce(int cta_end, Fill fill) const {
        for (int kb = 0; kb < cta_end; ++kb) {
            const int s = kb % STAGES;
            if (kb >= STAGES) mbar_wait(empty_bar(s), ((kb / STAGES) - 1) & 1);
            fill(kb, s);
        }
    }
};

// K̂ rows of key block kb, permuted and swizzled into the stage at kt (128 producer threads, tid).
__device__ __forceinline__ void ws_load_k(const ForwardParams& p, u32 kt, int bh_kv, int kb, int tid) {
    const Dims& d = p.dims;
    const int key0 = kb * BLOCK_KV;
    const i8* kg = p.op.k_hat + ((long)bh_kv * d.n_k + key0) * HEAD_DIM;
#pragma unroll
    for (int i = tid; i < BLOCK_KV * FK_CH; i += WG_THREADS) {
        const int key = i / FK_CH, c = i % FK_CH;
        const bool valid = key0 + key < d.n_k;
        const u32 off = permuted_row(key) * HEAD_DIM + c * 16;
        cp_async16(kt + swizzled_offset(off, HEAD_DIM), valid ? kg + key * HEAD_DIM + c * 16 : p.op.k_hat, valid);
    }
}

// Q̂ rows r0.. of NQ query blocks (rows past n_q zero-filled).
template <int NQ>
__device__ __forceinline__ void ws_load_q_rows(const ForwardParams& p, u32 qt, int bh, int r0, int tid) {
    const Dims& d = p.dims;
    const i8* qg = p.op.q_hat + ((long)bh * d.n_q + r0) * HEAD_DIM;
#pragma unroll
    for (int i = tid; i < NQ * BLOCK_Q * FK_CH; i += WG_THREADS) {
        const int row = i / FK_CH, c = i % FK_CH;
        const bool valid = r0 + row < d.n_q;
        cp_async16(qt + swizzled_offset(row * HEAD_DIM + c * 16, HEAD_DIM), valid ? qg + row * HEAD_DIM + c * 16 : p.op.q_hat,
                   valid);
    }
}
// Q̂ rows of the NQ query blocks of this thread block.

// This thread's cp.async group of a stage has landed: fence it for the wgmma (async proxy) and arrive.
__device__ __forceinline__ void ws_complete_stage(u32 full_bar) {
    fence_proxy_async();
    mbar_arrive(full_bar);
}



// P̂ with the group amax known before the exponentials (EARLY_AMAX above); otherwise softmax_p_hat.
// The quantizer needs no clamp to 127 (QuantPosBits): exp2_ftz is monotone on [−∞, 16] (the fused
// argument exceeds 0 by at most the lazy max's slack of 8 and two roundings; sagebwd-gpu-check's
// exhaustive ex2 self-test), so every p of the row is ≤ the amax computed here, and x·inv rounds to ≤ 127 exactly as in softmax_p_hat.
// BRANCHLESS (the persistent kernel): the group scales by div127_rn and inv127_rn (common.cuh; no
// branch), the same bits as group_scale.
// softmax_p_hat_early_mx: the same with the thread's row maxima mx (before the quad reduction) given
// (the persistent kernel takes them from its integer row max).
template <bool BRANCHLESS = false>
__device__ __forceinline__ void softmax_p_hat_early_mx(float (*t)[4], RowState& st, u32 (*pa)[4], float sc, float* mx) {
    float m_use[2], inv[2];
    quad_max_update<true>(st, mx, m_use, sc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // max_j exp2(fma(a_j, sc, −m_use)) = exp2(fma(a_max, sc, −m_use)): fma with sc ≥ 0 and exp2
        // are monotone (a masked row gives exp2(−∞) = 0, as the max over its zeros; sc > 0 there).
        const float amax = exp2_ftz(__fmaf_rn(mx[h], sc, -m_use[h]));
        if constexpr (BRANCHLESS) {
            st.p_scale[h] = div127_rn(amax);  // 0 for amax = 0, as group_scale
            inv[h] = inv127_rn(amax);
        } else {
            const GroupScale g = group_scale(amax);
            st.p_scale[h] = g.scale;
            inv[h] = g.inv;
        }
    }
    softmax_exp_sum<false, true>(t, st, m_use, nullptr, sc);
    quantize_p_tile(t, inv, pa);
}
template <bool BRANCHLESS = false>
__device__ __forceinline__ void softmax_p_hat_early(float (*t)[4], RowState& st, u32 (*pa)[4], float sc) {
    float mx[2];
    thread_row_max(t, mx);
    softmax_p_hat_early_mx<BRANCHLESS>(t, st, pa, sc, mx);
}

// Keeps the P̂ fragments' computation before this point: without it ptxas sank the quantization
// past the ping-pong barrier, between the wgmma issues, and serialized every wgmma (C7514).
template <int S>
__device__ __forceinline__ void pin_fragments(u32 (&pa)[S][4]) {
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(pa[s][i]));
}

// O = add(nd, e, fl(O·α)) for the warp's 16 rows × d, `add` adding the key block's contribution to
// the rescaled O; when no row of the warp changed its max, α = 1 and fl(O·1) = O exactly: the
// multiply is skipped.
template <class Add>
__device__ __forceinline__ void o_rescale_add(float (*o)[4], const RowState& st, Add add) {
    if (__all_sync(0xffffffffu, st.alpha[0] == 1.0f && st.alpha[1] == 1.0f)) {
#pragma unroll
        for (int nd = 0; nd < O_TILES; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[nd][e] = add(nd, e, o[nd][e]);
        return;
    }
#pragma unroll
    for (int nd = 0; nd < O_TILES; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nd][e] = add(nd, e, __fmul_rn(o[nd][e], st.alpha[e >> 1]));
}

// O = fma(float(acc), fl(s_P·s_V), fl(O·α)) (§2.3) from the finished P̂V accumulators, with s_V given (loaded a
// block ahead) and float(acc) by a plain conversion: |acc| ≤ 127²·128 < 2²⁴ is exact, and on sm_90
// it is one I2FP (the two-instruction trick of i2f_exact avoided sm_80's slow I2F).
__device__ __forceinline__ void ws_o_update(float (*o)[4], const int (&acc)[HEAD_DIM / 2], const RowState& st, float s_v) {
    const float dq0 = __fmul_rn(st.p_scale[0], s_v), dq1 = __fmul_rn(st.p_scale[1], s_v);  // fl(s_P·s_V)
    o_rescale_add(o, st, [&](int nd, int e, float base) { return __fmaf_rn((float)acc[4 * nd + e], e < 2 ? dq0 : dq1, base); });
}

// Ping-pong turn of consumer warpgroup w: wait for it (named barrier 1 + w, completed by the
// other warpgroup's pass_turn), then hand it over.
__device__ __forceinline__ void take_turn(int w) { named_sync(1 + w, 2 * WG_THREADS); }
__device__ __forceinline__ void pass_turn(int w) { named_arrive(1 + (w ^ 1), 2 * WG_THREADS); }

// The INT8 products of a consumer warpgroup (the wgmma path's arithmetic): S = Q̂ K̂ᵀ in INT32, P̂
// by softmax_p_hat(_early), P̂V in INT32, O = fma(float(acc), fl(s_P·s_V), fl(O·α)). The K̂ and V̂ᵀ
// scales of block kb + 1 are loaded during block kb: a load issued after a wgmma wait (a "memory"
// clobber) would put its L2 latency on every block's critical path.
// NB (the persistent kernel): the early amax with branch-free group scales (softmax_p_hat_early<true>).
template <bool EARLY_AMAX, bool NB = false>
struct WsInt8 {
    int sacc[64], pacc[HEAD_DIM / 2];
    u32 pa[BLOCK_KV / 32][4];
    u32 qt;
    float sq, k_sc, v_sc, k_sc_next, v_sc_next;
    const float *k_scales, *v_scales;
    __device__ __forceinline__ WsInt8(const ForwardParams& p, u32 q_tiles, int w, int bh, int bh_kv, int qb, int cta_end) {
        const Dims& d = p.dims;
        qt = q_tiles + w * WG_Q_TILE;
        sq = qb < d.n_qblk ? __fmul_rn(p.op.q_scale[bh * d.n_qblk + qb], p.c_lambda) : 0.0f;
        k_scales = p.op.k_scale + bh_kv * d.n_kblk;
        v_scales = p.v_scale + bh_kv * d.n_kblk;
        k_sc = cta_end > 0 ? k_scales[0] : 0.0f;
        v_sc = cta_end > 0 ? v_scales[0] : 0.0f;
    }
    __device__ __forceinline__ void begin_block(int kb, bool next) {
        k_sc_next = next ? k_scales[kb + 1] : 0.0f;
        v_sc_next = next ? v_scales[kb + 1] : 0.0f;
    }
    __device__ __forceinline__ void issue_scores(u32 kt) { wg_issue_scores(sacc, qt, kt); }
    __device__ __forceinline__ void softmax(const Dims& d, RowState& st, int row0, int key0) {
        float t[S_TILES][4];
        float sc = __fmul_rn(sq, k_sc);
        wg_scores(d, t, sacc, sc, row0, key0);
        if (EARLY_AMAX) softmax_p_hat_early<NB>(t, st, pa, sc);
        else softmax_p_hat(t, st, pa, sc);
    }
    __device__ __forceinline__ void pin() { pin_fragments(pa); }
    __device__ __forceinline__ void issue_pv(u32 vt) { wg_issue_pv(pacc, pa, vt); }
    __device__ __forceinline__ void o_update(float (*o)[4], const RowState& st) { ws_o_update(o, pacc, st, v_sc); }
    __device__ __forceinline__ void end_block() {
        k_sc = k_sc_next;
        v_sc = v_sc_next;
    }
    // The one lane of the warp that arrives on a stage's "empty" barrier (ws_tile).
    __device__ __forceinline__ bool warp_leader() const { return (threadIdx.x & 31) == 0; }
};

// One tile of the persistent INT8 kernel for consumer warpgroup w: ws_consume's loop
// (below, the same steps and the same arithmetic) over the `end` key blocks of its query block
// (rows from row0), which are the it0-th to the (it0 + end − 1)-th key blocks of the block's ring
// (counted over all its tiles); O and the row state in o, st (started by the caller). PINGPONG:
// end + 1 turns per tile; the caller passes the first and takes the last. (ws_consume itself does
// not call this: at d = 128 ptxas then schedules the BF16 pairs kernel's stage addresses
// differently, so it keeps its own copy.)
// EARLY_TEST (the persistent kernel without turns): the "full" phase of stage kb + 1 is tested
// (mbarrier.test_wait, no suspend) before block kb's softmax, and the blocking wait after it runs only
// if that test failed: the test's shared-memory latency overlaps the softmax.
template <bool PINGPONG, bool OVERLAP, class Mix, class Ring, bool EARLY_TEST = false>
__device__ __forceinline__ void ws_tile(const Dims& d, const Ring& sm, Mix& mx, int w, int row0, int it0, int end,
                                        RowState& st, float (*o)[4]) {
    if (end > 0) {
        sm.wait_full(it0);
        if (PINGPONG) take_turn(w);
        mx.issue_scores(sm.k_stage(it0 % Ring::kStages));
        if (PINGPONG) pass_turn(w);
        wgmma_wait<0>();
    }
    for (int kb = 0; kb < end; ++kb) {
        const int s = (it0 + kb) % Ring::kStages, s1 = (it0 + kb + 1) % Ring::kStages;
        const bool next = kb + 1 < end;
        bool ready = false;
        if constexpr (EARLY_TEST && OVERLAP) ready = next && sm.test_full(it0 + kb + 1);
        mx.begin_block(kb, next);
        mx.softmax(d, st, row0, kb * BLOCK_KV);
        if (OVERLAP && next && !ready) sm.wait_full(it0 + kb + 1);
        mx.pin();
        if (PINGPONG) take_turn(w);
        mx.issue_pv(sm.v_stage(s));
        if (OVERLAP && next) mx.issue_scores(sm.k_stage(s1));
        if (OVERLAP && next) wgmma_wait<1>();  // P·V(kb) done; S(kb + 1) may still run
        else wgmma_wait<0>();
        // The turn passes once P·V(kb) is done (FA3 passes it right after the issue; a bar.arrive
        // with two wgmma groups in flight made ptxas serialize every wgmma, C7514).
        if (PINGPONG) pass_turn(w);
        __syncwarp();
        if (mx.warp_leader()) mbar_arrive(sm.empty_bar(s));  // K(kb), V(kb) read by this warp
        mx.o_update(o, st);
        if (!OVERLAP && next) {
            sm.wait_full(it0 + kb + 1);
            if (PINGPONG) take_turn(w);
            mx.issue_scores(sm.k_stage(s1));
            if (PINGPONG) pass_turn(w);
        }
        wgmma_wait<0>();
        mx.end_block();
    }
}

// A consumer warpgroup w of the warp-specialized forward: query block 2·blockIdx.x + w, the
// products and softmax of `Mix` on the stages of `Ring`. OVERLAP (the `pipe` schedule): S(kb + 1)
// is issued right behind P·V(kb) and runs during the O update; otherwise it is issued after it.
// PINGPONG: the two consumer warpgroups issue their wgmmas in turn (named barriers 1, 2).
template <bool PINGPONG, bool OVERLAP, class Mix, class Ring>
__device__ void ws_consume(const ForwardParams& p, const Ring& sm, Mix& mx, int w, int bh, int cta_end) {
    const Dims& d = p.dims;
    const int warp = (threadIdx.x >> 5) & 3, qb = 2 * blockIdx.x + w;
    const int row0 = qb * BLOCK_Q + warp * 16;
    RowState st;
    float o[O_TILES][4];
    start_rows(st, o);
    // Ping-pong: warpgroup 0 issues first (warpgroup 1 passes it the first turn); each passes the
    // turn after every issue, and warpgroup 0 takes the last turn warpgroup 1 passes after the
    // loop, so that no barrier phase is left pending at exit. (A conditional pass between the
    // wgmma issue and its wait made ptxas serialize every wgmma, C7514.)
    if (PINGPONG && w == 1 && cta_end > 0) pass_turn(1);
    if (cta_end > 0) {
        sm.wait_full(0);
        if (PINGPONG) take_turn(w);
        mx.issue_scores(sm.k_stage(0));
        if (PINGPONG) pass_turn(w);
        wgmma_wait<0>();
    }
    for (int kb = 0; kb < cta_end; ++kb) {
        const int s = kb % Ring::kStages, s1 = (kb + 1) % Ring::kStages;
        const bool next = kb + 1 < cta_end;
        mx.begin_block(kb, next);
        mx.softmax(d, st, row0, kb * BLOCK_KV);
        if (OVERLAP && next) sm.wait_full(kb + 1);
        mx.pin();
        if (PINGPONG) take_turn(w);
        mx.issue_pv(sm.v_stage(s));
        if (OVERLAP && next) mx.issue_scores(sm.k_stage(s1));
        if (OVERLAP && next) wgmma_wait<1>();  // P·V(kb) done; S(kb + 1) may still run
        else wgmma_wait<0>();
        // The turn passes once P·V(kb) is done (FA3 passes it right after the issue; a bar.arrive
        // with two wgmma groups in flight made ptxas serialize every wgmma, C7514).
        if (PINGPONG) pass_turn(w);
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(sm.empty_bar(s));  // K(kb), V(kb) read by this warp
        mx.o_update(o, st);
        if (!OVERLAP && next) {
            sm.wait_full(kb + 1);
            if (PINGPONG) take_turn(w);
            mx.issue_scores(sm.k_stage(s1));
            if (PINGPONG) pass_turn(w);
        }
        wgmma_wait<0>();
        mx.end_block();
    }
    if (PINGPONG && w == 0 && cta_end > 0) take_turn(0);
    if (qb < d.n_qblk) mma_store(p, st, o, bh, row0);
}

// The start of the pairs kernels (one block per query-block pair: `sage_fwd_sm90_bf16_pairs`): checks the launch, initializes the ring's
// mbarriers, and returns the end of the key blocks the block's two query blocks walk (those of the
// later one: a block past the earlier one's end is fully masked for it and changes nothing).
template <class Ring>
__device__ __forceinline__ int ws_start(const Ring& sm, const Dims& d, u32 full_count) {
    require_dynamic_smem((u32)Ring::kSmemBytes);
    if (blockDim.x != WS_THREADS) __trap();
    if (threadIdx.x == 0) sm.init(full_count);
    __syncthreads();
    return key_block_end(d, min(2 * (int)blockIdx.x + 1, d.n_qblk - 1));
}
#endif  // SAGE_WGMMA

