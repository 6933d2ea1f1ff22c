// Preparation kernels (ALGORITHM.md §3): the K token mean, the row offsets b_r, and the per-block
// quantization of Q, K, V and dO with optional smoothing. Layouts are those of
// `sagebwd::sim::Quantized`.
//
// Three launches for Q, K, V (plus the K mean: two small ones) and one for dO, each reading its
// input once with 16-byte loads: a group (B_q or B_kv rows × d) is staged in registers and in a
// padded shared tile, from which the transposed copies are written (64 contiguous bytes per column
// and warp for the BF16 copy, 32 for the INT8 one).

#define VEC_PER_ROW (HEAD_DIM / 8)   // 16-byte vectors (8 BF16 values) per row
#define TILE_STRIDE (HEAD_DIM + 2)   // u16 row stride of the shared tile: an odd number of 32-bit
                                     // words, so column reads of 8-row chunks are conflict-free
#define K_MEAN_CHUNK 512             // rows per partial sum of the K mean

__device__ __forceinline__ bool aligned16(const void* p) { return ((u64)p & 15) == 0; }

// The mean of `rows` BF16 values spaced `stride` apart. The specification allows any summation
// order; like the CPU simulator we sum in FP64 (exact for BF16 inputs of any realistic range, so
// independent of order), divide in FP64 and round once to FP32: K_m and Q_m then match the
// simulator bit for bit.
__device__ __forceinline__ double column_sum(const u16* col, int rows, int stride) {
    double sum = 0.0;
    for (int r = 0; r < rows; ++r) sum = __dadd_rn(sum, (double)bf16_to_f32(col[(long)r * stride]));
    return sum;
}

__device__ __forceinline__ float lo_bf16(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// Partial FP64 column sums of K over K_MEAN_CHUNK rows: partial[bh, chunk, d]. Grid (n_chunks,
// B·H_kv), THREADS threads; each thread sums 8 columns of every (THREADS / VEC_PER_ROW)-th row.
// Launched only with K-smoothing on.
extern "C" __global__ void __launch_bounds__(THREADS) sage_k_mean_partial(const u16* __restrict__ k,
                                                                         double* __restrict__ partial,
                                                                         int n_k, int n_chunks) {
    constexpr int ROW_STEP = THREADS / VEC_PER_ROW;
    __shared__ double s_part[ROW_STEP][HEAD_DIM];
    const int chunk = blockIdx.x, bh = blockIdx.y;
    const int lr = threadIdx.x / VEC_PER_ROW, c8 = threadIdx.x % VEC_PER_ROW;
    const int r_end = min((chunk + 1) * K_MEAN_CHUNK, n_k);
    const u16* base = k + (long)bh * n_k * HEAD_DIM + c8 * 8;
    const bool vec = aligned16(k);
    double acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.0;
#pragma unroll 4
    for (int r = chunk * K_MEAN_CHUNK + lr; r < r_end; r += ROW_STEP) {
        const u16* src = base + (long)r * HEAD_DIM;
        u32 w[4];
        if (vec) {
            const uint4 v = *(const uint4*)src;
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = (u32)src[2 * j] | ((u32)src[2 * j + 1] << 16);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] = __dadd_rn(acc[2 * j], (double)lo_bf16(w[j]));
            acc[2 * j + 1] = __dadd_rn(acc[2 * j + 1], (double)hi_bf16(w[j]));
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) s_part[lr][c8 * 8 + j] = acc[j];
    __syncthreads();
    if (threadIdx.x < HEAD_DIM) {
        double sum = 0.0;
        for (int i = 0; i < ROW_STEP; ++i) sum = __dadd_rn(sum, s_part[i][threadIdx.x]);
        partial[((long)bh * n_chunks + chunk) * HEAD_DIM + threadIdx.x] = sum;
    }
}

// K_m[b, h_kv, :] = mean over all n_k tokens of K, from the partial sums. Grid: B·H_kv blocks of
// HEAD_DIM threads.
extern "C" __global__ void sage_k_mean(const double* __restrict__ partial, float* __restrict__ k_mean,
                                       int n_k, int n_chunks, int smooth_k) {
    const int bh = blockIdx.x, c = threadIdx.x;
    float mean = 0.0f;  // 0 when smoothing is off: K_s = K
    if (smooth_k) {
        double sum = 0.0;
        for (int i = 0; i < n_chunks; ++i) sum = __dadd_rn(sum, partial[((long)bh * n_chunks + i) * HEAD_DIM + c]);
        mean = __double2float_rn(__ddiv_rn(sum, (double)n_k));
    }
    k_mean[bh * HEAD_DIM + c] = mean;
}

// Mirrored by `QuantRowsParams` in src/quantize.rs.
struct QuantRowsParams {
    const u16* x;            // [BH, n, d] BF16 input
    const float* head_mean;  // [BH / group, d] mean subtracted from every row (K-smoothing), or null
    float* block_mean;       // [BH, n_blk, d] per-block mean to compute and subtract (Q-smoothing), or null
    i8* x_hat;               // [BH, n, d]
    float* scale;            // [BH, n_blk]
    i8* x_hat_t;             // [BH, d, n_pad] transposed x̂, or null
    u16* x_t;                // [BH, d, n_pad] transposed BF16 input, or null
    const float* k_mean;     // [B·H_kv, d] K_m for the row offsets (x = Q), or null
    float* row_offset;       // [BH, n] b_r = fl(cλ · fl(Σ_d x[r]·K_m)), or null
    int n;                   // rows per (batch, head)
    int rows_per_block;      // B_q or B_kv
    int n_blk;
    int mean_group;          // head_mean is indexed by bh / mean_group
    int n_pad;               // row length of the transposed copies
    int heads_q, heads_kv;   // the kv head of the row offsets (as kv_head_of)
    float c_lambda;
};
// Layout contract with src/quantize.rs (which asserts the same size).
static_assert(sizeof(QuantRowsParams) == 104, "QuantRowsParams layout changed: update src/quantize.rs");

// b_r of one row (ALGORITHM.md §3.5): the sum in FP64 in column order (exact products), rounded
// once, like the simulator. `row` holds HEAD_DIM BF16 values.
__device__ __forceinline__ float row_offset_of(const u16* row, const float* km, float c_lambda) {
    double acc = 0.0;
    for (int c = 0; c < HEAD_DIM; ++c) acc = __dadd_rn(acc, __dmul_rn((double)bf16_to_f32(row[c]), (double)km[c]));
    return __fmul_rn(c_lambda, __double2float_rn(acc));
}

// One group = `rows_per_block` consecutive rows × d of one (batch, head). Grid (n_blk, BH),
// THREADS threads. x_s = fl(x − mean); scale from max |x_s| over the valid rows; x̂ = q(x_s).
extern "C" __global__ void __launch_bounds__(THREADS) sage_quantize_rows(QuantRowsParams p) {
    __shared__ float s_mean[HEAD_DIM];
    __shared__ float s_km[HEAD_DIM];
    __shared__ float s_scratch[THREADS / 32];
    __shared__ __align__(16) u16 s_x[BLOCK_KV * TILE_STRIDE];
    const int blk = blockIdx.x, bh = blockIdx.y;
    const int row0 = blk * p.rows_per_block;
    const int rows = min(p.rows_per_block, p.n - row0);
    const long base = ((long)bh * p.n + row0) * HEAD_DIM;
    const int count = rows * HEAD_DIM;
    const int kv = p.k_mean ? (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / (p.heads_q / p.heads_kv) : 0;

    // Full groups with aligned buffers take the staged path (the tile fits s_x); the last, partial
    // group of a sequence reads global memory element by element.
    const bool staged = rows == p.rows_per_block && rows <= BLOCK_KV && rows % 32 == 0 && p.n_pad % 8 == 0 &&
                        aligned16(p.x) && aligned16(p.x_t) && ((u64)p.x_hat & 7) == 0 && ((u64)p.x_hat_t & 7) == 0;

    if (staged) {
        constexpr int MAX_VEC = BLOCK_KV * VEC_PER_ROW / THREADS;
        const int n_vec = rows * VEC_PER_ROW;  // a multiple of THREADS
        uint4 v[MAX_VEC];
        const uint4* src = (const uint4*)(p.x + base);
#pragma unroll
        for (int i = 0; i < MAX_VEC; ++i) {
            const int e = i * THREADS + threadIdx.x;
            if (e < n_vec) {
                v[i] = src[e];
                u32* dst = (u32*)(s_x + (e / VEC_PER_ROW) * TILE_STRIDE + (e % VEC_PER_ROW) * 8);
                dst[0] = v[i].x, dst[1] = v[i].y, dst[2] = v[i].z, dst[3] = v[i].w;
            }
        }
        __syncthreads();
        if (threadIdx.x < HEAD_DIM) {
            const int c = threadIdx.x;
            float m = 0.0f;
            if (p.block_mean) {  // Q-smoothing: mean of the block's rows
                m = __double2float_rn(__ddiv_rn(column_sum(s_x + c, rows, TILE_STRIDE), (double)rows));
                p.block_mean[((long)bh * p.n_blk + blk) * HEAD_DIM + c] = m;
            } else if (p.head_mean) {  // K-smoothing: the per-(batch, kv head) token mean
                m = p.head_mean[(bh / p.mean_group) * HEAD_DIM + c];
            }
            s_mean[c] = m;
            if (p.k_mean) s_km[c] = p.k_mean[kv * HEAD_DIM + c];
        }
        __syncthreads();

        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_VEC; ++i) {
            const int e = i * THREADS + threadIdx.x;
            if (e < n_vec) {
                const int c0 = (e % VEC_PER_ROW) * 8;
                const u32 w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    amax = fmaxf(amax, fabsf(__fsub_rn(lo_bf16(w[j]), s_mean[c0 + 2 * j])));
                    amax = fmaxf(amax, fabsf(__fsub_rn(hi_bf16(w[j]), s_mean[c0 + 2 * j + 1])));
                }
            }
        }
        amax = block_max(amax, s_scratch);
        const GroupScale g = group_scale(amax);
        if (threadIdx.x == 0) p.scale[(long)bh * p.n_blk + blk] = g.scale;

        uint2* hat = (uint2*)(p.x_hat + base);
#pragma unroll
        for (int i = 0; i < MAX_VEC; ++i) {
            const int e = i * THREADS + threadIdx.x;
            if (e < n_vec) {
                const int c0 = (e % VEC_PER_ROW) * 8;
                const u32 w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
                u32 b[2] = {0u, 0u};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 lo = (u32)(unsigned char)(i8)quantize(__fsub_rn(lo_bf16(w[j]), s_mean[c0 + 2 * j]), g.inv);
                    const u32 hi = (u32)(unsigned char)(i8)quantize(__fsub_rn(hi_bf16(w[j]), s_mean[c0 + 2 * j + 1]), g.inv);
                    b[j >> 1] |= (lo | (hi << 8)) << ((j & 1) * 16);
                }
                hat[e] = make_uint2(b[0], b[1]);
            }
        }

        if (p.x_hat_t || p.x_t) {
            // Item = (column, 8-row chunk); a warp takes 8 columns × 4 consecutive chunks, so each
            // column's 32 rows go out as 64 contiguous bytes (x_t) and 32 (x̂ᵀ).
            const int items = rows / 8 * HEAD_DIM;
            for (int it = threadIdx.x; it < items; it += THREADS) {
                const int lane = it & 31, w = it >> 5;
                const int c = (w % (HEAD_DIM / 8)) * 8 + (lane >> 2);
                const int r0 = ((w / (HEAD_DIM / 8)) * 4 + (lane & 3)) * 8;
                u32 h[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) h[j] = s_x[(r0 + j) * TILE_STRIDE + c];
                const long t_idx = ((long)bh * HEAD_DIM + c) * p.n_pad + row0 + r0;
                if (p.x_t)
                    *(uint4*)(p.x_t + t_idx) = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16),
                                                          h[4] | (h[5] << 16), h[6] | (h[7] << 16));
                if (p.x_hat_t) {
                    const float m = s_mean[c];
                    u32 b[2] = {0u, 0u};
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        b[j >> 2] |= (u32)(unsigned char)(i8)quantize(__fsub_rn(bf16_to_f32((u16)h[j]), m), g.inv)
                                     << ((j & 3) * 8);
                    *(uint2*)(p.x_hat_t + t_idx) = make_uint2(b[0], b[1]);
                }
            }
        }
        if (p.row_offset && threadIdx.x < rows)
            p.row_offset[(long)bh * p.n + row0 + threadIdx.x] =
                row_offset_of(s_x + threadIdx.x * TILE_STRIDE, s_km, p.c_lambda);
        return;
    }

    // Element-wise path (partial groups, unaligned buffers).
    if (threadIdx.x < HEAD_DIM) {
        const int c = threadIdx.x;
        float m = 0.0f;
        if (p.block_mean) {  // Q-smoothing: mean of the block's valid rows
            m = __double2float_rn(__ddiv_rn(column_sum(p.x + base + c, rows, HEAD_DIM), (double)rows));
            p.block_mean[((long)bh * p.n_blk + blk) * HEAD_DIM + c] = m;
        } else if (p.head_mean) {  // K-smoothing: the per-(batch, kv head) token mean
            m = p.head_mean[(bh / p.mean_group) * HEAD_DIM + c];
        }
        s_mean[c] = m;
    }
    __syncthreads();

    float amax = 0.0f;
    for (int e = threadIdx.x; e < count; e += THREADS)
        amax = fmaxf(amax, fabsf(__fsub_rn(bf16_to_f32(p.x[base + e]), s_mean[e % HEAD_DIM])));
    amax = block_max(amax, s_scratch);
    const GroupScale g = group_scale(amax);
    if (threadIdx.x == 0) p.scale[(long)bh * p.n_blk + blk] = g.scale;

    for (int e = threadIdx.x; e < count; e += THREADS) {
        const float xs = __fsub_rn(bf16_to_f32(p.x[base + e]), s_mean[e % HEAD_DIM]);
        p.x_hat[base + e] = (i8)quantize(xs, g.inv);
    }
    if (p.x_hat_t || p.x_t) {
        // Transposed copies: consecutive threads take consecutive rows of one column, so the writes
        // are coalesced (the strided reads hit the cache lines the passes above just loaded).
        for (int e = threadIdx.x; e < count; e += THREADS) {
            const int r = e % rows, c = e / rows;
            const u16 x = p.x[base + (long)r * HEAD_DIM + c];
            const long t_idx = ((long)bh * HEAD_DIM + c) * p.n_pad + row0 + r;
            if (p.x_hat_t) p.x_hat_t[t_idx] = (i8)quantize(__fsub_rn(bf16_to_f32(x), s_mean[c]), g.inv);
            if (p.x_t) p.x_t[t_idx] = x;
        }
    }
    if (p.row_offset)
        for (int r = threadIdx.x; r < rows; r += THREADS)
            p.row_offset[(long)bh * p.n + row0 + r] =
                row_offset_of(p.x + base + (long)r * HEAD_DIM, p.k_mean + (long)kv * HEAD_DIM, p.c_lambda);
}

// Fills n values of a buffer with one 32-bit pattern: NaN poison before kernels write outputs,
// zeros for accumulators.
extern "C" __global__ void sage_fill_u32(u32* __restrict__ dst, u64 n, u32 value) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[i] = value;
}
