
// A key block's FP32 dV, dK accumulators (this thread's fragments) set to 0 before its query blocks.
__device__ __forceinline__ void zero_dv_dk(float (*dv)[4], float (*dk)[4]) {
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv[nd][e] = dk[nd][e] = 0.0f;
}

// What a path does before its CTA exits (StagedSagePipelined with BULK_DQ waits for its dQ bulk reductions).
template <class Path>
__device__ __forceinline__ void staged_finish() {}
#if BF16_BWD_EARLY_DV_PATH
template <>
__device__ __forceinline__ void staged_finish<StagedBf16Bulk>() {
    bulk_wait();  // the dQ reduce-adds complete before the CTA exits
}
#endif
#if SAGE64_PIPELINED_LOOP
template <>
__device__ __forceinline__ void staged_finish<StagedSage64>() {
    if (StagedSage64::BULK_DQ) bulk_wait();
}
template <>
__device__ __forceinline__ void staged_finish<StagedSage64Persistent>() {
    if (StagedSage64Persistent::BULK_DQ) bulk_wait();
}
template <>
__device__ __forceinline__ void staged_finish<StagedSage64TmaDq>() {
    if (StagedSage64TmaDq::BULK_DQ) bulk_wait();  // its dQ tensor reduces complete before the CTA exits
}
#endif
#if SAGE128_PIPELINED_LOOP
template <>
__device__ __forceinline__ void staged_finish<StagedSage128>() {
    if (StagedSage128::BULK_DQ) bulk_wait();
}
template <>
__device__ __forceinline__ void staged_finish<StagedSage128TmaStage>() {
    bulk_wait();
}
#endif

template <class Path>
__device__ void staged_backward_main(const BackwardParams& p, unsigned char* smem_ptr) {
    typedef typename Path::Layout Lay;
    const Dims& d = p.dims;
    const KeyBlockCoords at = staged_block_coords(d);
    const int kb = at.kb, bh = at.bh;
    const u32 raw = smem_addr(smem_ptr), smem = (raw + (ALIGN_SLACK - 1)) & ~(u32)(ALIGN_SLACK - 1);
    smem_ptr += smem - raw;  // the layout's offsets count from the 1024-byte aligned start
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };

    float dv[HEAD_DIM / 8][4], dk[HEAD_DIM / 8][4];
    zero_dv_dk(dv, dk);

    const int bh_kv = kv_head_of(d, bh);
    const int qb0 = query_block_begin(d, kb);
    if (qb0 < d.n_qblk) {
        Path::stage_key_block(p, smem, bh_kv, kb);
        Path::stage_query_block(p, stage(0), bh, qb0);
    }
    cp_async_commit();
    if (threadIdx.x < BLOCK_Q && qb0 < d.n_qblk) store_row_consts(rows_of(0), load_row_consts(p, bh, qb0, threadIdx.x));

    const QueryStager<Path> stage_next(p, bh);  // stages block qb + 1
    const float dq_scale = staged_query_loop<Path>(p, smem, smem_ptr, stage_next, kb, bh, bh_kv, qb0, dv, dk);
    if (qb0 < d.n_qblk)
        Path::dq(p, smem, smem + Lay::ds0 + ((d.n_qblk - 1 - qb0) & 1) * Lay::ds_bytes, dq_scale, bh, d.n_qblk - 1);
    Path::drain(dv, dk);  // the last block's dV, dK (a path with STAGES_NEXT leaves them in flight)

    store_dk_dv(p, kb, bh, dv, dk);
    staged_finish<Path>();
}
// A persistent grid (kernels sage_bwd_main_persist_{sage,bf16}; SAGEBWD_BWD_PERSIST in src/backward.rs). The grid
// is (G, 1) with G ≤ the CTAs that fit at once; CTA c starts on item c of the n_kblk × rows items (in
// staged_item_coords' order: heaviest first) and claims each next one from a counter (dynamic, as the
// hardware's block scheduler hands out the blocks of the plain grid: the tail stays short): one
// atomicAdd by thread 0 while the finished item's last dQ runs, broadcast through shared memory at the
// barrier that follows it. Past that barrier no warp reads the item's shared memory any more, so the
// next item's key block, first query block (cp.async) and row constants are issued before the
// finished item's dK, dV stores, which go out while those loads fly. The counter is the 32-bit word
// after the dQ accumulator's rows·n_q·d floats (the host allocates and zeroes it). The plain grid
// (n_kblk, rows) of sage_bwd_main_sm80, one item per CTA, keeps staged_backward_main unchanged.
template <class Path>
__device__ __forceinline__ void staged_prologue(const BackwardParams& p, u32 smem, int kb, int bh) {
    const Dims& d = p.dims;
    const int qb0 = query_block_begin(d, kb);
    if (qb0 < d.n_qblk) {
        Path::stage_key_block(p, smem, kv_head_of(d, bh), kb);
        Path::stage_query_block(p, smem + Path::Layout::stage0, bh, qb0);
    }
    cp_async_commit();
}

// UNIFORM: the item (and so kb, bh, qb0, the query loop's qb) as a value ptxas knows is warp-uniform, as
// in the plain grid where they come from blockIdx: broadcast from lane 0 by a full-mask shuffle at the
// top of every item. Carried as plain coordinates (updated in the divergent row-constant tail of the
// last item), ptxas keeps the query loop's counters, stage addresses and wgmma descriptors in
// vector registers and moves them by R2UR before every wgmma (more registers, spills in the INT8 kernel at
// d = 128). With it the query loop is about as long as the plain kernel's at d = 64 and 128, with no spill. Also
// the claim's gridDim.x is added after the barrier (added at the atomic, warp 0 would wait for the atomic right
// after issuing it, before its part of the last dQ). The INT8 path at d = 64 keeps the plain coordinates, which are
// faster there (PersistUniformItem below).
template <class Path>
struct PersistUniformItem {
    static constexpr bool value = true;
};
#if HEAD_DIM == 64
template <>
struct PersistUniformItem<StagedSage> {
    static constexpr bool value = false;
};
#if SAGE64_PIPELINED_LOOP
template <class Options>
struct PersistUniformItem<StagedSagePipelined<Options>> {
    static constexpr bool value = false;
};
#endif
#endif

template <class Path>
__device__ void staged_backward_persist(const BackwardParams& p, unsigned char* smem_ptr) {
    typedef typename Path::Layout Lay;
    constexpr bool UNIFORM = PersistUniformItem<Path>::value;
    const Dims& d = p.dims;
    const u32 raw = smem_addr(smem_ptr), smem = (raw + (ALIGN_SLACK - 1)) & ~(u32)(ALIGN_SLACK - 1);
    smem_ptr += smem - raw;  // the layout's offsets count from the 1024-byte aligned start
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };

    const int n_rows = d.batch * d.heads_q, n_items = d.n_kblk * n_rows;
    __shared__ int next_item;  // the claimed item (UNIFORM: the counter's value, the item − gridDim.x), thread 0 → the CTA
    int item = blockIdx.x;
    if (item >= n_items) return;  // (the host launches at most n_items CTAs)
    KeyBlockCoords at = staged_item_coords(d, item, d.n_kblk, n_rows);

    staged_prologue<Path>(p, smem, at.kb, at.bh);
    if (threadIdx.x < BLOCK_Q && query_block_begin(d, at.kb) < d.n_qblk)
        store_row_consts(rows_of(0), load_row_consts(p, at.bh, query_block_begin(d, at.kb), threadIdx.x));
    // Its per-thread parts do not depend on the head (the head goes to each call).
    const QueryStager<Path> stage_next(p, at.bh);  // stages block qb + 1
    for (;;) {
        if (UNIFORM) {
            item = __shfl_sync(0xffffffffu, item, 0);
            at = staged_item_coords(d, item, d.n_kblk, n_rows);
        }
        const int kb = at.kb, bh = at.bh;

        float dv[HEAD_DIM / 8][4], dk[HEAD_DIM / 8][4];
        zero_dv_dk(dv, dk);

        const int qb0 = query_block_begin(d, kb);
        const float dq_scale = staged_query_loop<Path>(p, smem, smem_ptr, stage_next, kb, bh, kv_head_of(d, bh), qb0, dv, dk);
        int claimed = UNIFORM ? 0 : n_items;
        if (threadIdx.x == 0)
            claimed = (int)atomicAdd((unsigned*)(p.dq_acc + (long)n_rows * d.n_q * HEAD_DIM), 1u) + (UNIFORM ? 0 : (int)gridDim.x);
        if (qb0 < d.n_qblk)
            Path::dq(p, smem, smem + Lay::ds0 + ((d.n_qblk - 1 - qb0) & 1) * Lay::ds_bytes, dq_scale, bh, d.n_qblk - 1);
        Path::drain(dv, dk);  // the last block's dV, dK (a path with STAGES_NEXT leaves them in flight)

        if (threadIdx.x == 0) next_item = claimed;
        __syncthreads();  // every warp done with this item's shared memory; next_item visible
        item = next_item + (UNIFORM ? (int)gridDim.x : 0);
        if (item < n_items) {
            at = staged_item_coords(d, item, d.n_kblk, n_rows);
            staged_prologue<Path>(p, smem, at.kb, at.bh);
            const int nqb0 = query_block_begin(d, at.kb);
            RowConsts rc = {pos_inf(), 0.0f};
            if (threadIdx.x < BLOCK_Q && nqb0 < d.n_qblk) rc = load_row_consts(p, at.bh, nqb0, threadIdx.x);
            store_dk_dv(p, kb, bh, dv, dk);  // while the next item's loads fly
            if (threadIdx.x < BLOCK_Q && nqb0 < d.n_qblk) store_row_consts(rows_of(0), rc);
        } else {
            store_dk_dv(p, kb, bh, dv, dk);
            staged_finish<Path>();
            return;
        }
    }
}
// The staged paths on the persistent grid, one entry per path (registers are allocated per kernel;
// sage_bwd_main_sm80's code and registers stay as they were).
// The sage path's type of these kernels (the pipelined loop at d = 64 on sm_90a).
#if SAGE64_PIPELINED_LOOP
typedef StagedSage64 StagedSageKernel;         // sage_bwd_main_sm90_int8
typedef StagedSage64Persistent StagedSagePersistKernel;  // sage_bwd_main_sm90_int8_persistent
#elif SAGE128_PIPELINED_LOOP
typedef StagedSage128 StagedSageKernel;         // sage_bwd_main_sm90_int8 at d = 128
typedef StagedSage128 StagedSagePersistKernel;  // sage_bwd_main_sm90_int8_persistent
#else
typedef StagedSage StagedSageKernel;
typedef StagedSage StagedSagePersistKernel;
#endif
// The body of the staged paths' entry points: launched with PDL after the preprocess (src/backward.rs), so no
// global access before the wait; the fast path the host chose (`path`); shared memory for S's layout; then
// S's loop on the persistent grid (PERSIST) or the plain one.
template <class S, bool PERSIST>
__device__ __forceinline__ void staged_entry(const BackwardParams& p, int path, unsigned char* smem) {
    pdl_wait();
    if (bwd_fast_path(p.flags) != path) __trap();
    require_dynamic_smem((u32)S::Layout::bytes);
    if constexpr (PERSIST) staged_backward_persist<S>(p, smem);
    else staged_backward_main<S>(p, smem);
}
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_sm90_int8_persistent(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSagePersistKernel, true>(p, BWD_STAGED_SAGE, smem_raw);
}
// The sage path on the plain grid in its own kernel (sage_bwd_main_sm80's grid and block order; the host takes it
// for the sage path on sm_90a), so that its pipelined loop does not change sage_bwd_main_sm80's registers and code
// for its other paths.
#if BWD_WGMMA && (HEAD_DIM == 64 || SAGE128_PIPELINED_LOOP)
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_sm90_int8(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSageKernel, false>(p, BWD_STAGED_SAGE, smem_raw);
}
#endif
// sage_bwd_main_sm90_int8 at d = 64 with its dQ by TMA tensor reduces (StagedSage64TmaDq; the default at d = 64,
// SAGEBWD_SAGE_TMA_DQ=0 in src/backward.rs selects sage_bwd_main_sm90_int8); the same grid, block order and shared memory.
#if BWD_WGMMA && HEAD_DIM == 64 && SAGE64_PIPELINED_LOOP
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_sm90_int8_tma_dq(const __grid_constant__ BwdParamsDqMap pm) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSage64TmaDq, false>(pm.p, BWD_STAGED_SAGE, smem_raw);
}
#endif
#if BWD_WGMMA && SAGE128_PIPELINED_LOOP
// The d = 128 plain-grid kernel with its in-loop stage copies by TMA (StagedSage128TmaStage; the host takes it at d = 128
// when n_q % 64 == 0).
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_sm90_int8_tma_stage(const __grid_constant__ BwdParamsStageMaps pm) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedSage128TmaStage, false>(pm.p, BWD_STAGED_SAGE, smem_raw);
}
#endif
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_sm90_bf16_persistent(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    pdl_wait();  // launched with PDL after the preprocess (src/backward.rs): no global access before it
    if (bwd_fast_path(p.flags) != BWD_STAGED_BF16) __trap();
    require_dynamic_smem((u32)StagedBf16::Layout::bytes);
#if BF16_BWD_EARLY_DV_PATH
    staged_backward_persist<StagedBf16Early>(p, smem_raw);
#else
    staged_backward_persist<StagedBf16>(p, smem_raw);
#endif
}
// The BF16 path at d = 128 on the persistent grid with dQ by TMA reduce-adds (StagedBf16Bulk);
// the host's default for fpa at d = 128 on sm_90a, every N (SAGEBWD_FPA_BULK_DQ=0: sage_bwd_main_sm90_bf16_persistent).
// The parameter is the dQ accumulator's tensor map followed
// by BackwardParams (BwdParamsDqMap).
#if BF16_BWD_EARLY_DV_PATH && HEAD_DIM == 128
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_sm90_bf16_persistent_tma_dq(const __grid_constant__ BwdParamsDqMap pm) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    staged_entry<StagedBf16Bulk, true>(pm.p, BWD_STAGED_BF16, smem_raw);
}
#endif

// Every path takes its shared memory from the dynamic allocation (`backward_smem_bytes` and
// `staged_backward_smem_bytes` in src/backward.rs); a launch with less traps rather than corrupt
// memory.
extern "C" __global__ void __launch_bounds__(THREADS) sage_bwd_main_sm80(BackwardParams p) {
    extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
    pdl_wait();  // launched with PDL after the preprocess (src/backward.rs): no global access before it
    const int path = bwd_fast_path(p.flags);
    if (path == BWD_STAGED_SAGE) {
        require_dynamic_smem((u32)StagedSage::Layout::bytes);
        staged_backward_main<StagedSage>(p, smem_raw);
        return;
    }
    if (path == BWD_STAGED_BF16) {
        require_dynamic_smem((u32)StagedBf16::Layout::bytes);
        staged_backward_main<StagedBf16>(p, smem_raw);
        return;
    }
    require_dynamic_smem((u32)sizeof(BackwardShared));
    BackwardShared& s = *reinterpret_cast<BackwardShared*>(smem_raw);

    const int kb = blockIdx.x, bh = blockIdx.y;
    const int bh_kv = kv_head_of(p.dims, bh);

    float dv[BWD_O_TILES][4], dk[BWD_O_TILES][4];
#pragma unroll
    for (int nt = 0; nt < BWD_O_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv[nt][e] = dk[nt][e] = 0.0f;

    for (int qb = query_block_begin(p.dims, kb); qb < p.dims.n_qblk; ++qb) {
        load_row_state(p, s, bh, bh_kv, qb, kb);
        const TileScales sc = mma_tile_p_ds(p, s, bh, bh_kv, qb, kb);  // ends with a barrier
        tile_ds_sums(p, s, bh, qb);
        mma_tile_dv_dk(p, s, sc, dv, dk, bh, qb);
        mma_tile_dq(p, s, sc, bh, bh_kv, qb, kb);
        __syncthreads();  // the tiles are overwritten by the next query block
    }

    const int key_base = kb * BLOCK_KV + (threadIdx.x >> 5) * 16;
#pragma unroll
    for (int nt = 0; nt < BWD_O_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = key_base + c_row(e);
            if (j >= p.dims.n_k) continue;
            const long idx = ((long)bh * p.dims.n_k + j) * HEAD_DIM + nt * 8 + c_col(e);
            p.dk_acc[idx] = dk[nt][e];
            p.dv_acc[idx] = dv[nt][e];
        }
}
