
// The staged skeleton (see the top of this section). Two barriers per tile at most: (a) at the top
// (block qb's operands, row constants and the dS of block qb − 1 visible), and the sage tile's amax.
// dS of block qb is complete at (a) of block qb + 1, so dQ of block qb − 1 runs at the end of
// iteration qb (where few registers are live), from the other dS buffer, which the next writes only
// after the next (a). Block qb + 1 is staged after (a), when every warp is done with its buffer
// (read last by qb − 1); its row constants are stored at the end of iteration qb, likewise.
// CTAs per chunk of the causal block order: about two waves of one CTA per SM (132 on the H200).
#ifndef CAUSAL_CHUNK_CTAS
#define CAUSAL_CHUNK_CTAS 256
#endif
struct KeyBlockCoords {
    int kb, bh;
};
// The (key block, (batch, query head)) a staged CTA works on. Not causal: (blockIdx.x, blockIdx.y),
// every block the same work. Causal: key block kb has n_qblk − query_block_begin(kb) tiles, fewer for
// later kb, and CTAs start roughly in linear block order, so the grid (n_kblk, rows) is walked in chunks
// of heads (about CAUSAL_CHUNK_CTAS CTAs) and inside a chunk every head's kb = 0 comes first, then kb = 1…
// Heaviest first: the grid ends on its lightest blocks (a short tail), while a chunk's Q, dO and dQ
// rows stay in L2 for the key blocks of its heads.
// staged_item_coords: the same order for work item `linear` of n_kb × rows (the persistent grid's
// items are these linear indices; staged_block_coords is it at blockIdx.y · gridDim.x + blockIdx.x).
__device__ __forceinline__ KeyBlockCoords staged_item_coords(const Dims& d, int linear, int n_kb, int rows) {
    if (!d.causal) return {linear % n_kb, linear / n_kb};
    const int chunk_heads = max(1, CAUSAL_CHUNK_CTAS / n_kb);
    const int first = linear / (chunk_heads * n_kb) * chunk_heads;  // the chunk's first head
    const int heads = min(chunk_heads, rows - first);
    const int r = linear - first * n_kb;  // within the chunk: heads × n_kb, key block slowest
    return {r / heads, first + r % heads};
}
__device__ __forceinline__ KeyBlockCoords staged_block_coords(const Dims& d) {
    if (!d.causal) return {(int)blockIdx.x, (int)blockIdx.y};
    const int n_kb = gridDim.x, rows = gridDim.y;
    const int chunk_heads = max(1, CAUSAL_CHUNK_CTAS / n_kb);
    const int linear = blockIdx.y * n_kb + blockIdx.x;
    const int first = linear / (chunk_heads * n_kb) * chunk_heads;  // the chunk's first head
    const int heads = min(chunk_heads, rows - first);
    const int r = linear - first * n_kb;  // within the chunk: heads × n_kb, key block slowest
    return {r / heads, first + r % heads};
}

// Writes the block's dK, dV (warp w: keys 16w..16w + 15 of key block kb; rows past n_k skipped):
// BF16 results when the host set dk_out (no GQA), else the FP32 per-query-head partials.
__device__ __forceinline__ void store_dk_dv(const BackwardParams& p, int kb, int bh, const float (*dv)[4],
                                            const float (*dk)[4]) {
    const Dims& d = p.dims;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3, wkey0 = kb * BLOCK_KV + warp * 16;
#pragma unroll
    for (int nd = 0; nd < HEAD_DIM / 8; ++nd)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = wkey0 + g + 8 * h;
            if (j >= d.n_k) continue;
            const long idx = ((long)bh * d.n_k + j) * HEAD_DIM + nd * 8 + 2 * t;
            if (p.dk_out) {
                // sage_bwd_post_dkdv's arithmetic for a group of one: fl(c·fl(0 + dK)), fl(0 + dV) (the
                // 0 + turns −0 into +0 as the postprocess's sum does), rounded to BF16.
                const float k0 = __fmul_rn(p.c, __fadd_rn(0.0f, dk[nd][2 * h])), k1 = __fmul_rn(p.c, __fadd_rn(0.0f, dk[nd][2 * h + 1]));
                const float v0 = __fadd_rn(0.0f, dv[nd][2 * h]), v1 = __fadd_rn(0.0f, dv[nd][2 * h + 1]);
                *(u32*)(p.dk_out + idx) = (u32)f32_to_bf16(k0) | ((u32)f32_to_bf16(k1) << 16);
                *(u32*)(p.dv_out + idx) = (u32)f32_to_bf16(v0) | ((u32)f32_to_bf16(v1) << 16);
            } else {
                *(float2*)(p.dk_acc + idx) = make_float2(dk[nd][2 * h], dk[nd][2 * h + 1]);
                *(float2*)(p.dv_acc + idx) = make_float2(dv[nd][2 * h], dv[nd][2 * h + 1]);
            }
        }
}

// The StagedTile of query block qb in stage buf (0 or 1) of layout Lay: its operands, row constants and dS
// tile, the other stage's dS tile (block qb − 1's) and stage (block qb + 1's).
template <class Lay>
__device__ __forceinline__ StagedTile staged_tile(u32 smem, unsigned char* smem_ptr, int buf, int bh, int bh_kv, int kb, int qb,
                                                  bool has_prev, float prev_dq_scale, bool has_next) {
    StagedTile x;
    x.smem = smem;
    x.st = smem + Lay::stage0 + buf * Lay::stage_bytes;
    x.rows = (const float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes);
    x.ds = smem_ptr + Lay::ds0 + buf * Lay::ds_bytes;
    x.red = (float*)(smem_ptr + Lay::red);
    x.bh = bh;
    x.bh_kv = bh_kv;
    x.qb = qb;
    x.kb = kb;
    x.prev_ds = smem + Lay::ds0 + (buf ^ 1) * Lay::ds_bytes;
    x.has_prev = has_prev;
    x.prev_dq_scale = prev_dq_scale;
    x.next_st = smem + Lay::stage0 + (buf ^ 1) * Lay::stage_bytes;
    x.has_next = has_next;
    return x;
}

// The query-block loop of one work item (key block kb of head bh, its key block and first query block
// staged, the row constants of qb0 stored): every tile, dQ of all blocks but the last, then the
// barrier after which the last block's dS is complete. Returns the pending dQ tile's scale. Shared by
// the plain grid (staged_backward_main) and the persistent one (staged_backward_persist).
template <class Path>
__device__ __forceinline__ float staged_query_loop(const BackwardParams& p, u32 smem, unsigned char* smem_ptr,
                                                   const QueryStager<Path>& stage_next, int kb, int bh, int bh_kv,
                                                   int qb0, float (*dv)[4], float (*dk)[4]) {
    typedef typename Path::Layout Lay;
    const Dims& d = p.dims;
    const auto stage = [&](int buf) { return smem + Lay::stage0 + buf * Lay::stage_bytes; };
    const auto rows_of = [&](int buf) { return (float*)(smem_ptr + Lay::rows0 + buf * Lay::rows_bytes); };
    float dq_scale = 0.0f;  // of the pending dQ tile
    for (int qb = qb0; qb < d.n_qblk; ++qb) {
        const int buf = (qb - qb0) & 1;
        const bool has_next = qb + 1 < d.n_qblk;
        cp_async_wait<0>();  // this thread's copies of block qb are done
#if BWD_WGMMA
        if (Path::WGMMA) fence_proxy_async();  // cp.async writes and dŜ stores → wgmma's (async proxy) reads
        if constexpr (Path::BULK_DQ) bulk_wait_read();  // the dQ staging area free after (a)
#endif
        __syncthreads();     // (a)
        if (has_next && !Path::STAGES_NEXT) stage_next(p, stage(buf ^ 1), bh, qb + 1);
        cp_async_commit();
        RowConsts next_rc = {pos_inf(), 0.0f};
        if (has_next && threadIdx.x < BLOCK_Q) next_rc = load_row_consts(p, bh, qb + 1, threadIdx.x);

        StagedTile x = staged_tile<Lay>(smem, smem_ptr, buf, bh, bh_kv, kb, qb, qb > qb0, dq_scale, has_next);
        const float tile_dq_scale = Path::tile(p, x, dv, dk);
        if (has_next && threadIdx.x < BLOCK_Q) store_row_consts(rows_of(buf ^ 1), next_rc);
        // With the wgmma dQ (sm_90a) tile() issues block qb − 1's dQ itself, before Sᵀ, and adds it while Sᵀ, dPᵀ run.
        if (qb > qb0 && !BWD_WGMMA) Path::dq(p, smem, x.prev_ds, dq_scale, bh, qb - 1);
        if (!Path::STAGES_NEXT) Path::drain(dv, dk);  // before the next (a): block qb + 2 is staged into this block's stage
        dq_scale = tile_dq_scale;
    }
    cp_async_wait<0>();
#if BWD_WGMMA
    fence_proxy_async();  // the dS stores → dQ's wgmma reads
    if constexpr (Path::BULK_DQ) bulk_wait_read();  // the dQ staging area free for the item's last dQ
#endif
    __syncthreads();  // dS of the last block complete
    return dq_scale;
}

