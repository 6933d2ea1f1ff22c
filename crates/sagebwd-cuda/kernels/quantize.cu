// Preparation kernels (ALGORITHM.md §3): the K token mean, and the per-block quantization of
// Q, K, V and dO with optional smoothing. Layouts are those of `sagebwd::sim::Quantized`.

// The mean of `rows` BF16 values spaced HEAD_DIM apart. The specification allows any summation
// order; like the CPU simulator we sum in FP64 (exact for BF16 inputs of any realistic range, so
// independent of order), divide in FP64 and round once to FP32: K_m and Q_m then match the
// simulator bit for bit.
__device__ float column_mean(const u16* col, int rows) {
    double sum = 0.0;
    for (int r = 0; r < rows; ++r) sum = __dadd_rn(sum, (double)bf16_to_f32(col[(long)r * HEAD_DIM]));
    return __double2float_rn(__ddiv_rn(sum, (double)rows));
}

// K_m[b, h_kv, :] = mean over all n_k tokens of K. Grid: B·H_kv blocks of HEAD_DIM threads.
extern "C" __global__ void sage_k_mean(const u16* __restrict__ k, float* __restrict__ k_mean,
                                       int n_k, int smooth_k) {
    const int bh = blockIdx.x, c = threadIdx.x;
    float mean = 0.0f;  // 0 when smoothing is off: K_s = K
    if (smooth_k) mean = column_mean(k + (long)bh * n_k * HEAD_DIM + c, n_k);
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
    int n;                   // rows per (batch, head)
    int rows_per_block;      // B_q or B_kv
    int n_blk;
    int mean_group;          // head_mean is indexed by bh / mean_group
    int n_pad;               // row length of the transposed copies
};
// Layout contract with src/quantize.rs (which asserts the same size).
static_assert(sizeof(QuantRowsParams) == 80, "QuantRowsParams layout changed: update src/quantize.rs");

// One group = `rows_per_block` consecutive rows × d of one (batch, head). Grid (n_blk, BH),
// THREADS threads. x_s = fl(x − mean); scale from max |x_s| over the valid rows; x̂ = q(x_s).
extern "C" __global__ void __launch_bounds__(THREADS) sage_quantize_rows(QuantRowsParams p) {
    __shared__ float s_mean[HEAD_DIM];
    __shared__ float s_scratch[THREADS / 32];
    const int blk = blockIdx.x, bh = blockIdx.y;
    const int row0 = blk * p.rows_per_block;
    const int rows = min(p.rows_per_block, p.n - row0);
    const long base = ((long)bh * p.n + row0) * HEAD_DIM;
    const int count = rows * HEAD_DIM;

    if (threadIdx.x < HEAD_DIM) {
        const int c = threadIdx.x;
        float m = 0.0f;
        if (p.block_mean) {  // Q-smoothing: mean of the block's valid rows
            m = column_mean(p.x + base + c, rows);
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
}

// The row offset removed by K-smoothing, b_r = fl(cλ · fl(Σ_d Q[r]·K_m)) (ALGORITHM.md §3.5): the
// sum in FP64 (exact products), rounded once, like the simulator. One thread per query row.
extern "C" __global__ void sage_row_offset(const u16* __restrict__ q, const float* __restrict__ k_mean,
                                           float* __restrict__ row_offset, Dims d, float c_lambda) {
    const long rows = (long)d.batch * d.heads_q * d.n_q;
    const int group = d.heads_q / d.heads_kv;
    for (long row = (long)blockIdx.x * blockDim.x + threadIdx.x; row < rows; row += (long)gridDim.x * blockDim.x) {
        const long bh = row / d.n_q;
        const long bh_kv = (bh / d.heads_q) * d.heads_kv + (bh % d.heads_q) / group;
        const u16* qr = q + row * HEAD_DIM;
        const float* km = k_mean + bh_kv * HEAD_DIM;
        double acc = 0.0;
        for (int c = 0; c < HEAD_DIM; ++c) acc = __dadd_rn(acc, __dmul_rn((double)bf16_to_f32(qr[c]), (double)km[c]));
        row_offset[row] = __fmul_rn(c_lambda, __double2float_rn(acc));
    }
}

// Fills n values of a buffer with one 32-bit pattern: NaN poison before kernels write outputs,
// zeros for accumulators.
extern "C" __global__ void sage_fill_u32(u32* __restrict__ dst, u64 n, u32 value) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[i] = value;
}
