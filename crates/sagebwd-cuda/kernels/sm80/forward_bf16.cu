// ---------------------------------------------------------------------------------------------
// The staged BF16 path (#1 and #2 both BF16: the fpa preset, and the isolations of the backward
// products, whose forward is fpa's): FlashAttention-2's forward with the arithmetic of §4. The
// K tile [128 keys][d] (double-buffered) and the V tile [128 keys][d] of each key block are staged
// in shared memory by cp.async from the original BF16 inputs (rows past n_k zero-filled), with
// XOR-swizzled 16-byte chunks (chunk c of row `key` at c ^ (key % 8): each ldmatrix phase reads 8
// consecutive rows of one logical chunk, so 8 distinct bank groups). The warp's Q fragments stay
// in registers; S = Q Kᵀ by m16n8k16 with B from ldmatrix; t = fl(cλ·S) (the BF16 #1 score);
// the online softmax of the INT8 path (staged_softmax, no amax). P·V takes bf16(p) straight from
// registers: the accumulators of S tiles 2ks and 2ks + 1 (row g / g + 8, keys 16ks + 2t, +1 and
// 16ks + 8 + 2t, +1) are the m16n8k16 A fragment of k-step ks once packed to bf16x2, in natural key
// order. V's B fragments by ldmatrix.trans (k = key). Per d-tile, O = fl(fl(O·α) + PV_block), PV
// summed in its own FP32 accumulator as §4 writes it; l sums the unrounded p.
//
// Schedule per key block kb (two barriers): wait for K(kb); barrier (a) (everyone is done with
// V(kb − 1) and K(kb − 1)); issue V(kb) and K(kb + 1); S and softmax; wait for V(kb); barrier (b);
// P·V. V(kb) loads while S is computed, K(kb + 1) during the whole block.

#define FB_ROW (HEAD_DIM * 2)                  // bytes of one BF16 K or V row
#define FB_CH (HEAD_DIM / 8)                   // 16-byte chunks per row
#define FB_TILE (BLOCK_KV * FB_ROW)            // bytes of one K or V tile
#define BF16_SMEM_BYTES (3 * FB_TILE)          // K twice, V once: 96 KB at d = 128, 48 KB at d = 64

// Copies rows [0, 128) of a [rows][d] BF16 operand into a swizzled tile at `dst`; rows ≥ n_rows
// are zero-filled (nothing read).
__device__ __forceinline__ void bf16_tile_load(u32 dst, const u16* src, int n_rows) {
#pragma unroll
    for (int it = 0; it < BLOCK_KV * FB_CH / MMA_THREADS; ++it) {
        const int i = threadIdx.x + it * MMA_THREADS;
        const int row = i / FB_CH, c = i % FB_CH;
        const bool valid = row < n_rows;
        cp_async16(dst + row * FB_ROW + (swz_rows8(row, c) << 4), valid ? src + row * HEAD_DIM + c * 8 : src, valid);
    }
}

// S = Q Kᵀ for the warp's 16 rows × 128 keys as base-2 scores t = fl(cλ·S) (unmasked). Lane
// (mi = lane / 8, r = lane % 8) addresses row nt·8 + r, chunk 4·cg + mi: the x4 load gives the
// B fragments of k-steps 2cg and 2cg + 1.
__device__ __forceinline__ void bf16_scores(float (*t)[4], const u32 (*qa)[4], u32 kbuf, int mi, int r, float c_lambda) {
#pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt) {
        const u32 rowa = kbuf + (nt * 8 + r) * FB_ROW;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int cg = 0; cg < FB_CH / 4; ++cg) {
            u32 b[4];
            ldmatrix_x4(b, rowa + (((cg * 4 + mi) ^ r) << 4));
            mma_bf16(acc, qa[2 * cg], b);
            mma_bf16(acc, qa[2 * cg + 1], b + 2);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) t[nt][e] = __fmul_rn(c_lambda, acc[e]);
    }
}

// O = fl(fl(O·α) + Σ_keys bf16(p)·V) for the warp's 16 rows × d, pa the bf16(p) A fragments. Lane
// (mi, r) addresses key 16·ks + 8·(mi % 2) + r, chunk 2·np + mi / 2: the transposed x4 load gives
// the B fragments (both key halves) of d-tiles 2np and 2np + 1.
__device__ __forceinline__ void bf16_pv(float (*o)[4], const u32 (*pa)[4], const RowState& st, u32 vbuf, int mi, int r) {
    const u32 lane_row = vbuf + (8 * (mi & 1) + r) * FB_ROW;
#pragma unroll
    for (int np = 0; np < O_TILES / 2; ++np) {
        const u32 chunk = ((2 * np + (mi >> 1)) ^ r) << 4;
        float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int ks = 0; ks < BLOCK_KV / 16; ++ks) {
            u32 b[4];
            ldmatrix_x4_trans(b, lane_row + ks * 16 * FB_ROW + chunk);
            mma_bf16(acc[0], pa[ks], b);
            mma_bf16(acc[1], pa[ks], b + 2);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[2 * np + j][e] = __fadd_rn(__fmul_rn(o[2 * np + j][e], st.alpha[e >> 1]), acc[j][e]);
    }
}

// The BF16 path's softmax of the base-2 scores t (natural key order): mask, the online softmax
// (staged_softmax, no amax), and bf16(p) packed as the A fragments of P·V: the accumulators of S
// tiles 2kk and 2kk + 1 (keys 16kk..16kk + 15) are the m16n8k16 (and wgmma k16) A fragment kk.
__device__ __forceinline__ void bf16_softmax(const Dims& d, float (*t)[4], RowState& st, u32 (*pa)[4], int row0, int key0) {
    float unused = 1.0f;  // BF16 #1: t itself, not fused (§4)
    mask_tile<false>(d, t, row0, key0, unused);
    staged_softmax<false, false>(t, st, nullptr, 1.0f);
#pragma unroll
    for (int kk = 0; kk < BLOCK_KV / 16; ++kk) {
        pa[kk][0] = pack_bf16x2(t[2 * kk][0], t[2 * kk][1]);
        pa[kk][1] = pack_bf16x2(t[2 * kk][2], t[2 * kk][3]);
        pa[kk][2] = pack_bf16x2(t[2 * kk + 1][0], t[2 * kk + 1][1]);
        pa[kk][3] = pack_bf16x2(t[2 * kk + 1][2], t[2 * kk + 1][3]);
    }
}

__device__ void forward_mma_bf16(const ForwardParams& p, unsigned char* smem) {
    const Dims& d = p.dims;
    const int qb = blockIdx.x, bh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh_kv = kv_head_of(d, bh);
    const int row0 = qb * BLOCK_Q + warp * 16;
    const u32 ks = smem_addr(smem), vs = ks + 2 * FB_TILE;
    const u16* kg = p.op.k + (long)bh_kv * d.n_k * HEAD_DIM;  // unsmoothed K (§1)
    const u16* vg = p.v + (long)bh_kv * d.n_k * HEAD_DIM;

    const int kb_end = key_block_end(d, qb);
    if (kb_end > 0) bf16_tile_load(ks, kg, d.n_k);
    cp_async_commit();

    // The warp's Q fragments, once for the whole key loop (rows past n_q read as 0).
    u32 qa[HEAD_DIM / 16][4];
    {
        const View vq = view(p.op.q + ((long)bh * d.n_q + row0) * HEAD_DIM, HEAD_DIM, 1, d.n_q - row0, HEAD_DIM);
#pragma unroll
        for (int s = 0; s < HEAD_DIM / 16; ++s) frag_a_bf16(qa[s], ReadBf16(), vq, 0, s * 16);
    }
    RowState st;
    float o[O_TILES][4];
    start_rows(st, o);
    const int mi = lane >> 3, r = lane & 7;

    for (int kb = 0; kb < kb_end; ++kb) {
        const int key0 = kb * BLOCK_KV;
        cp_async_wait<0>();  // this thread's copies of K(kb)
        __syncthreads();     // (a): everyone's K(kb) visible; V(kb − 1), K(kb − 1) no longer read
        bf16_tile_load(vs, vg + (long)key0 * HEAD_DIM, d.n_k - key0);
        cp_async_commit();
        if (kb + 1 < kb_end)
            bf16_tile_load(ks + ((kb + 1) & 1) * FB_TILE, kg + (long)(key0 + BLOCK_KV) * HEAD_DIM, d.n_k - key0 - BLOCK_KV);
        cp_async_commit();

        float t[S_TILES][4];
        bf16_scores(t, qa, ks + (kb & 1) * FB_TILE, mi, r, p.c_lambda);
        u32 pa[BLOCK_KV / 16][4];
        bf16_softmax(d, t, st, pa, row0, key0);
        cp_async_wait<1>();  // this thread's copies of V(kb) (K(kb + 1) may still be in flight)
        __syncthreads();     // (b): everyone's V(kb) visible
        bf16_pv(o, pa, st, vs, mi, r);
    }
    cp_async_wait<0>();
    mma_store(p, st, o, bh, row0);
}

