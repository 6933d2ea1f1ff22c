// Preparation kernels (ALGORITHM.md §3): the K token mean, the row offsets b_r, and the per-block
// quantization of Q, K, V and dO with optional smoothing. Layouts are those of
// `sagebwd::sim::Quantized`.
//
// Three launches for Q, K, V (plus the K mean: two small ones) and one for dO, each reading its
// input once with 16-byte loads. What the staged kernel paths read (x̂ and x̂ᵀ, no BF16 copy, no
// Q-smoothing) comes from register tiles: a thread holds 8 rows × 8 columns of its group, quantizes
// them once and writes the INT8 tile as it is and byte-transposed. Q-smoothing and the BF16
// transposed copies of the gathering paths stage the group in a padded shared tile instead, from
// which the transposed copies are written (64 contiguous bytes per column and warp for the BF16
// copy, 32 for the INT8 one). Outputs with a null address are not written.

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

// V̂ᵀ in e4m3 for an FP8 P·V (ALGORITHM.md §10.1, `Fp8OperandScale::Channel`): one power-of-two scale s_V[c] per
// (batch, KV head, channel), from the channel's amax over all keys, reduced in two steps: per chunk of V8_CHUNK keys,
// then over the chunks. By default in two grids of their own after the INT8 quantization (sage_v_amax_partial,
// sage_quantize_v_e4m3); fused (SAGEBWD_V8_FUSED=1, not yet the default) in the K mean's grids
// (sage_k_mean_partial_v8, sage_k_mean_v8), the bytes then written by sage_quantize_qkv's V groups in place of the
// INT8 V̂ᵀ. A maximum does not depend on the order it is taken in, and each byte is one rounding of an exact
// quotient: every path gives the same bits.
#define V8_TILE 64                 // keys per block of sage_quantize_v_e4m3
#define V8_CHUNK K_MEAN_CHUNK      // keys per partial amax: the K mean's chunks, so that one grid computes both
#define V8_ZERO_CHANNEL (-1000)    // the exponent of an all-zero channel (every real exponent is ≥ −149)

// The exponent e of channel c's scale s_V[c] = 2^e (Fp8::pow2_scale) from its partial amaxes
// v_amax[(bh·n_chunks + i)·d + c]; V8_ZERO_CHANNEL for an all-zero channel.
__device__ __forceinline__ int v8_channel_exponent(const float* v_amax, int bh, int n_chunks, int c) {
    float a = 0.0f;
    for (int i = 0; i < n_chunks; ++i) a = fmaxf(a, v_amax[((long)bh * n_chunks + i) * HEAD_DIM + c]);
    return a == 0.0f ? V8_ZERO_CHANNEL : e4m3_scale_exponent(a);
}
// s_V[c] as stored for the forward (0 for an all-zero channel), and back to its exponent.
__device__ __forceinline__ float v8_scale_of(int e) { return e == V8_ZERO_CHANNEL ? 0.0f : ldexpf(1.0f, e); }
__device__ __forceinline__ int v8_exponent_of(float s) { return s == 0.0f ? V8_ZERO_CHANNEL : ilogbf(s); }
// The value e4m3 rounds for x in a channel of exponent e: x / s_V[c] (exact: ldexpf), 0 in an all-zero channel.
__device__ __forceinline__ float v8_input(float x, int e) { return e == V8_ZERO_CHANNEL ? 0.0f : ldexpf(x, -e); }

// Partial FP64 column sums of K over K_MEAN_CHUNK rows: partial[bh, chunk, d]. Grid (n_chunks, B·H_kv), THREADS
// threads; each thread sums 8 columns of every (THREADS / VEC_PER_ROW)-th row. Launched only with K-smoothing on, or
// as sage_k_mean_partial_v8 (V8) for the fused e4m3 V̂ᵀ (opt-in, SAGEBWD_V8_FUSED=1): then also the partial channel
// amaxes of V over the same rows, v_amax[bh, chunk, d] (V8_CHUNK = K_MEAN_CHUNK), and the K sums only where partial
// is not null (K-smoothing on).
template <bool V8>
__device__ __forceinline__ void k_mean_partial_body(const u16* __restrict__ k, double* __restrict__ partial, int n_k,
                                               int n_chunks, const u16* __restrict__ v, float* __restrict__ v_amax) {
    constexpr int ROW_STEP = THREADS / VEC_PER_ROW;
    __shared__ double s_part[ROW_STEP][HEAD_DIM];
    pdl_trigger();  // sage_k_mean (PDL) may take its place on the SMs; it waits for this grid
    const int chunk = blockIdx.x, bh = blockIdx.y;
    const int lr = threadIdx.x / VEC_PER_ROW, c8 = threadIdx.x % VEC_PER_ROW;
    const int r_end = min((chunk + 1) * K_MEAN_CHUNK, n_k);
    if constexpr (V8) {  // V first: its loads do not depend on the K sums below
        __shared__ float s_vmax[ROW_STEP][HEAD_DIM];
        const u16* vbase = v + (long)bh * n_k * HEAD_DIM + c8 * 8;
        const bool vvec = aligned16(v);
        float mx[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) mx[j] = 0.0f;
#pragma unroll 4
        for (int r = chunk * K_MEAN_CHUNK + lr; r < r_end; r += ROW_STEP) {
            const u16* src = vbase + (long)r * HEAD_DIM;
            u32 w[4];
            if (vvec) {
                const uint4 x = *(const uint4*)src;
                w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) w[j] = (u32)src[2 * j] | ((u32)src[2 * j + 1] << 16);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                mx[2 * j] = fmaxf(mx[2 * j], fabsf(lo_bf16(w[j])));
                mx[2 * j + 1] = fmaxf(mx[2 * j + 1], fabsf(hi_bf16(w[j])));
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) s_vmax[lr][c8 * 8 + j] = mx[j];
        __syncthreads();
        if (threadIdx.x < HEAD_DIM) {
            float a = 0.0f;
            for (int i = 0; i < ROW_STEP; ++i) a = fmaxf(a, s_vmax[i][threadIdx.x]);
            v_amax[((long)bh * n_chunks + chunk) * HEAD_DIM + threadIdx.x] = a;
        }
        if (!partial) return;
    }
    const u16* base = k + (long)bh * n_k * HEAD_DIM + c8 * 8;
    const bool vec = aligned16(k);
    double acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.0;
    const auto add = [&](const u32 (&w)[4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] = __dadd_rn(acc[2 * j], (double)lo_bf16(w[j]));
            acc[2 * j + 1] = __dadd_rn(acc[2 * j + 1], (double)hi_bf16(w[j]));
        }
    };
    int r = chunk * K_MEAN_CHUNK + lr;
    if (vec) {
        // KM_BATCH rows' 16-byte loads issued before their sums (the loop unrolled by 4
        // interleaved loads and FP64 adds, 2–3 loads in flight per thread with 3 blocks per SM);
        // each column still sums its rows in increasing order, so the same bits.
        constexpr int KM_BATCH = 4;
        const auto full = [&](int r0) { return r0 + (KM_BATCH - 1) * ROW_STEP < r_end; };
        if (full(r)) {
            uint4 v[KM_BATCH];
#pragma unroll
            for (int b = 0; b < KM_BATCH; ++b) v[b] = *(const uint4*)(base + (long)(r + b * ROW_STEP) * HEAD_DIM);
            while (true) {  // the next batch's loads issued before this batch's sums
                const int next = r + KM_BATCH * ROW_STEP;
                const bool more = full(next);
                uint4 nv[KM_BATCH];
                if (more) {
#pragma unroll
                    for (int b = 0; b < KM_BATCH; ++b) nv[b] = *(const uint4*)(base + (long)(next + b * ROW_STEP) * HEAD_DIM);
                }
#pragma unroll
                for (int b = 0; b < KM_BATCH; ++b) {
                    const u32 w[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
                    add(w);
                }
                r = next;
                if (!more) break;
#pragma unroll
                for (int b = 0; b < KM_BATCH; ++b) v[b] = nv[b];
            }
        }
        for (; r < r_end; r += ROW_STEP) {
            const uint4 v = *(const uint4*)(base + (long)r * HEAD_DIM);
            const u32 w[4] = {v.x, v.y, v.z, v.w};
            add(w);
        }
    } else {
        for (; r < r_end; r += ROW_STEP) {
            const u16* src = base + (long)r * HEAD_DIM;
            u32 w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = (u32)src[2 * j] | ((u32)src[2 * j + 1] << 16);
            add(w);
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
extern "C" __global__ void __launch_bounds__(THREADS) sage_k_mean_partial(const u16* __restrict__ k,
                                                                         double* __restrict__ partial,
                                                                         int n_k, int n_chunks) {
    k_mean_partial_body<false>(k, partial, n_k, n_chunks, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(THREADS) sage_k_mean_partial_v8(const u16* __restrict__ k,
                                                                            double* __restrict__ partial, int n_k,
                                                                            int n_chunks, const u16* __restrict__ v,
                                                                            float* __restrict__ v_amax) {
    k_mean_partial_body<true>(k, partial, n_k, n_chunks, v, v_amax);
}

// K_m[b, h_kv, :] = mean over all n_k tokens of K, from the partial sums. Grid: B·H_kv blocks of
// HEAD_DIM threads. As sage_k_mean_v8 (the fused e4m3 V̂ᵀ) also each channel's s_V[c] = v_scale[bh·d + c] from
// sage_k_mean_partial_v8's partial amaxes.
template <bool V8>
__device__ __forceinline__ void k_mean_body(const double* __restrict__ partial, float* __restrict__ k_mean, int n_k,
                                       int n_chunks, int smooth_k, const float* __restrict__ v_amax,
                                       float* __restrict__ v_scale) {
    const int bh = blockIdx.x, c = threadIdx.x;
    // sage_quantize_qkv (PDL) may start now: its groups' loads overlap the partial sums; its K and Q
    // groups wait for this grid (which waits for the partial sums), its V groups need no K_m (INT8 V̂ᵀ).
    pdl_trigger();
    pdl_wait();  // the partial sums (launched with PDL after sage_k_mean_partial; else a no-op)
    float mean = 0.0f;  // 0 when smoothing is off: K_s = K
    if (smooth_k) {
        double sum = 0.0;
        for (int i = 0; i < n_chunks; ++i) sum = __dadd_rn(sum, partial[((long)bh * n_chunks + i) * HEAD_DIM + c]);
        mean = __double2float_rn(__ddiv_rn(sum, (double)n_k));
    }
    k_mean[bh * HEAD_DIM + c] = mean;
    if constexpr (V8) v_scale[bh * HEAD_DIM + c] = v8_scale_of(v8_channel_exponent(v_amax, bh, n_chunks, c));
}
extern "C" __global__ void sage_k_mean(const double* __restrict__ partial, float* __restrict__ k_mean_out, int n_k,
                                       int n_chunks, int smooth_k) {
    k_mean_body<false>(partial, k_mean_out, n_k, n_chunks, smooth_k, nullptr, nullptr);
}
extern "C" __global__ void sage_k_mean_v8(const double* __restrict__ partial, float* __restrict__ k_mean_out, int n_k,
                                          int n_chunks, int smooth_k, const float* __restrict__ v_amax,
                                          float* __restrict__ v_scale) {
    k_mean_body<true>(partial, k_mean_out, n_k, n_chunks, smooth_k, v_amax, v_scale);
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

// The same sum for the register-tile path: the row 16-byte aligned in shared memory, K_m already in
// FP64. One fused multiply-add per column rounds exactly as the separate multiply and add above: the
// product of a BF16 and an FP32 value has at most 32 significant bits, exact in FP64.
__device__ __forceinline__ float row_offset_of_vec(const u16* row, const double* km, float c_lambda) {
    double acc = 0.0;
#pragma unroll 4
    for (int c8 = 0; c8 < VEC_PER_ROW; ++c8) {
        const uint4 v = *(const uint4*)(row + c8 * 8);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc = __fma_rn((double)lo_bf16(w[j]), km[c8 * 8 + 2 * j], acc);
            acc = __fma_rn((double)hi_bf16(w[j]), km[c8 * 8 + 2 * j + 1], acc);
        }
    }
    return __fmul_rn(c_lambda, __double2float_rn(acc));
}

// Block-wide max of non-negative values over the block's blockDim.x threads (a multiple of 32; all
// must call it). `scratch` holds one float per warp. Max is exact and order-independent.
__device__ __forceinline__ float block_max_any(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();  // scratch may still be read by a previous call
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, scratch[w]);
    return m;
}

// Max of non-negative values over the `group_warps` warps of group `group` of the block (all the
// block's threads must call it; groups are consecutive runs of warps). `scratch` holds one float
// per warp of the block. With one group per block this is block_max_any.
__device__ __forceinline__ float group_max(float v, float* scratch, int group, int group_warps) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();  // scratch may still be read by a previous call
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    const float* mine = scratch + group * group_warps;
    float m = mine[0];
    for (int w = 1; w < group_warps; ++w) m = fmaxf(m, mine[w]);
    return m;
}

// The BF16 halves of a word as FP32, by instructions the compiler may not merge with earlier
// identical ones: the register-tile path unpacks its 64 values twice (for amax, then to quantize)
// rather than keep 64 FP32 values live across the block reduction (twice the registers).
__device__ __forceinline__ float lo_bf16_again(u32 w) {
    u32 r;
    asm volatile("shl.b32 %0, %1, 16;" : "=r"(r) : "r"(w));
    return __uint_as_float(r);
}
__device__ __forceinline__ float hi_bf16_again(u32 w) {
    u32 r;
    asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(r) : "r"(w));
    return __uint_as_float(r);
}

// x_s = fl(x − m), or x itself without smoothing (fl(x − 0) = x, −0 included: the same bits).
template <bool MEAN>
__device__ __forceinline__ float smoothed(float x, float m) { return MEAN ? __fsub_rn(x, m) : x; }

// Byte transpose of a 4 × 4 block: a[r] holds row r's 4 bytes (byte k = column k); b[k] gets
// column k's 4 bytes (byte r = row r). Eight byte permutes.
__device__ __forceinline__ void transpose4x4_bytes(const u32 a[4], u32 b[4]) {
    u32 t0, t1, t2, t3;
    asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(t0) : "r"(a[0]), "r"(a[1]));  // a0.0 a1.0 a0.1 a1.1
    asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(t1) : "r"(a[2]), "r"(a[3]));  // a2.0 a3.0 a2.1 a3.1
    asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(t2) : "r"(a[0]), "r"(a[1]));  // a0.2 a1.2 a0.3 a1.3
    asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(t3) : "r"(a[2]), "r"(a[3]));  // a2.2 a3.2 a2.3 a3.3
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(b[0]) : "r"(t0), "r"(t1));
    asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(b[1]) : "r"(t0), "r"(t1));
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(b[2]) : "r"(t2), "r"(t3));
    asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(b[3]) : "r"(t2), "r"(t3));
}

// An 8 × 8 byte tile (row i: the 8 bytes nat[i][0..1]) stored transposed: column c of the tile to
// dst + c · stride, its 8 bytes (one per row) as one 8-byte store.
__device__ __forceinline__ void store_tile8_transposed(i8* dst, long stride, const u32 (&nat)[8][2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 top[4] = {nat[0][h], nat[1][h], nat[2][h], nat[3][h]};
        const u32 bottom[4] = {nat[4][h], nat[5][h], nat[6][h], nat[7][h]};
        u32 t_top[4], t_bottom[4];
        transpose4x4_bytes(top, t_top);
        transpose4x4_bytes(bottom, t_bottom);
#pragma unroll
        for (int k = 0; k < 4; ++k) *(uint2*)(dst + (4 * h + k) * stride) = make_uint2(t_top[k], t_bottom[k]);
    }
}

// u16 row stride of the Q rows staged for b_r on the register-tile path: 16-byte rows, and both the
// 16-byte stores of a quarter warp (8 column chunks of one row) and the 16-byte loads of 8
// consecutive rows (one per thread) fall on 8 distinct 4-bank groups.
#define ROW_TILE_STRIDE (HEAD_DIM + 8)

// The largest |value| of a thread's 8 rows × 8 columns (value(w, c) as for quantize_tile8; max is exact).
template <class Value>
__device__ __forceinline__ float tile8_amax(const uint4 (&v)[8], Value value) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int c = 0; c < 8; ++c) amax = fmaxf(amax, fabsf(value(w[c >> 1], c)));
    }
    return amax;
}

// A thread's 8 rows × 8 columns (8 BF16 per uint4) quantized with inv into packed bytes nat[row][half];
// value(w, c) is column c's value from the 32-bit word w holding columns c & ~1 (low) and c | 1 (high).
template <class Value>
__device__ __forceinline__ void quantize_tile8(const uint4 (&v)[8], float inv, u32 (&nat)[8][2], Value value) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
        u32 qb[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) qb[c] = quant_bits(value(w[c >> 1], c), inv);
        nat[i][0] = pack_lo_bytes(qb[0], qb[1], qb[2], qb[3]);
        nat[i][1] = pack_lo_bytes(qb[4], qb[5], qb[6], qb[7]);
    }
}

// A thread's 8 rows × 8 columns of x̂ (packed bytes, nat[row][half]) into x̂ and/or x̂ᵀ, as the job asks.
__device__ __forceinline__ void store_tile8(const QuantRowsParams& p, long base, int bh, int row0, int r_first, int c0,
                                            const u32 (&nat)[8][2]) {
    if (p.x_hat) {
        i8* dst = p.x_hat + base + (long)r_first * HEAD_DIM + c0;
#pragma unroll
        for (int i = 0; i < 8; ++i) *(uint2*)(dst + i * HEAD_DIM) = make_uint2(nat[i][0], nat[i][1]);
    }
    if (p.x_hat_t) {
        i8* dst = p.x_hat_t + ((long)bh * HEAD_DIM + c0) * p.n_pad + row0 + r_first;
        store_tile8_transposed(dst, p.n_pad, nat);
    }
}

// The 8 rows × 8 columns of a group that thread t of its group holds on the register-tile path (the layout described
// below), loaded with eight 16-byte loads into v.
struct Tile8 {
    int r_first, c0;
};
__device__ __forceinline__ Tile8 load_tile8(const QuantRowsParams& p, long base, int t, uint4 (&v)[8]) {
    constexpr int WARPS_PER_BAND = HEAD_DIM / 64;
    const int warp = t >> 5, lane = t & 31;
    const Tile8 at = {(warp / WARPS_PER_BAND) * 32 + (lane >> 3) * 8, ((warp % WARPS_PER_BAND) * 8 + (lane & 7)) * 8};
    const u16* src = p.x + base + (long)at.r_first * HEAD_DIM + at.c0;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = *(const uint4*)(src + i * HEAD_DIM);
    return at;
}

// Register-tile path for a full group (the launch has rows_per_block/8 · HEAD_DIM/8 threads): each
// thread owns 8 consecutive rows × 8 consecutive columns, read once with eight 16-byte loads and
// kept in registers until the group's amax is known (one block reduction), then quantized once;
// the 8 × 8 INT8 tile is written as it is (x̂) and byte-transposed in registers (x̂ᵀ). Lane =
// column chunk (8 per warp) + 8 · row chunk (4 per warp): a warp covers 32 rows × 64 columns (two
// warps per band of 32 rows at d = 128), so per warp instruction the loads read 4 rows × 128
// contiguous bytes, the x̂ stores write 4 rows × 64 bytes and the x̂ᵀ stores 8 columns × 32 bytes:
// whole sectors. No shared-memory tile except the Q rows for b_r.
//
// A block may hold several groups side by side (the fused Q/K/V launch puts two B_q groups of Q in
// one block of a B_kv group's size): `t` is the thread's index within its group, `group` the
// group's index within the block, `group_warps` its warps. s_kmd is written by the block's first
// HEAD_DIM threads: the groups of one block share their (batch, head), hence K_m.
//
// PDL (K and Q of sage_quantize_qkv, launched with PDL after sage_k_mean): the group's loads of x
// (an input, written before the K mean's kernels started) are issued before pdl_wait(); K_m
// (head_mean, k_mean) is read and every output written after it.
template <bool MEAN, bool PDL = false>
__device__ __forceinline__ void quantize_group_tiles(const QuantRowsParams& p, int blk, int bh, int row0, long base,
                                                     int kv, int t, int group, int group_warps, float* s_scratch,
                                                     double* s_kmd, u16* s_rows) {
    uint4 v[8];
    const Tile8 at = load_tile8(p, base, t, v);
    const int r_first = at.r_first, c0 = at.c0;
    if (PDL) pdl_wait();  // K_m is sage_k_mean's output
    float m[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) m[j] = MEAN ? p.head_mean[(bh / p.mean_group) * HEAD_DIM + c0 + j] : 0.0f;

    float amax = tile8_amax(v, [&](u32 w, int c) { return smoothed<MEAN>((c & 1) ? hi_bf16(w) : lo_bf16(w), m[c]); });
    if (p.row_offset) {  // x = Q: stage the rows for b_r (read after the reduction's barrier)
#pragma unroll
        for (int i = 0; i < 8; ++i) *(uint4*)(s_rows + (r_first + i) * ROW_TILE_STRIDE + c0) = v[i];
        if (threadIdx.x < HEAD_DIM) s_kmd[threadIdx.x] = (double)p.k_mean[kv * HEAD_DIM + threadIdx.x];
    }
    const GroupScale g = group_scale(group_max(amax, s_scratch, group, group_warps));
    if (t == 0) p.scale[(long)bh * p.n_blk + blk] = g.scale;

    // x̂ (quant_bits = the §2.2 quantizer for |x_s| ≤ amax, the INT8 value in the low byte).
    u32 nat[8][2];
    quantize_tile8(v, g.inv, nat, [&](u32 w, int c) {
        return smoothed<MEAN>((c & 1) ? hi_bf16_again(w) : lo_bf16_again(w), m[c]);
    });
    store_tile8(p, base, bh, row0, r_first, c0, nat);
    if (p.row_offset && t < p.rows_per_block)
        p.row_offset[(long)bh * p.n + row0 + t] = row_offset_of_vec(s_rows + t * ROW_TILE_STRIDE, s_kmd, p.c_lambda);
}

// The e4m3 V̂ᵀ of one full B_kv group of V from register tiles (quantize_group_tiles' thread layout; the fused
// Q/K/V launch of the FP8 P·V forward): p.scale holds the channel scales s_V [B·H_kv, d] that sage_k_mean wrote
// (read after pdl_wait), and the group's keys go to x̂ᵀ as sage_quantize_v_e4m3 writes them, the same bytes. No x̂,
// no per-block scale. n_pad = n (full groups), so there are no padding keys to zero.
__device__ __forceinline__ void quantize_v_tiles_e4m3(const QuantRowsParams& p, int bh, int row0, long base, int t) {
    uint4 v[8];
    const Tile8 at = load_tile8(p, base, t, v);
    const int r_first = at.r_first, c0 = at.c0;
    pdl_wait();  // s_V is sage_k_mean's output
    int e[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = v8_exponent_of(p.scale[(long)bh * HEAD_DIM + c0 + j]);
    u32 nat[8][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
        float x[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) x[c] = v8_input((c & 1) ? hi_bf16(w[c >> 1]) : lo_bf16(w[c >> 1]), e[c]);
        nat[i][0] = e4m3x2(x[0], x[1]) | (e4m3x2(x[2], x[3]) << 16);
        nat[i][1] = e4m3x2(x[4], x[5]) | (e4m3x2(x[6], x[7]) << 16);
    }
    store_tile8_transposed(p.x_hat_t + ((long)bh * HEAD_DIM + c0) * p.n_pad + row0 + r_first, p.n_pad, nat);
}

// Element-wise path (partial groups, unaligned buffers), any block size of whole warps ≥ HEAD_DIM.
__device__ void quantize_group_elementwise(const QuantRowsParams& p, int blk, int bh, int row0, int rows, long base,
                                           int kv, float* s_mean, float* s_scratch) {
    const int count = rows * HEAD_DIM, nt = blockDim.x;
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
    for (int e = threadIdx.x; e < count; e += nt)
        amax = fmaxf(amax, fabsf(__fsub_rn(bf16_to_f32(p.x[base + e]), s_mean[e % HEAD_DIM])));
    amax = block_max_any(amax, s_scratch);
    const GroupScale g = group_scale(amax);
    if (threadIdx.x == 0) p.scale[(long)bh * p.n_blk + blk] = g.scale;

    if (p.x_hat) {
        for (int e = threadIdx.x; e < count; e += nt) {
            const float xs = __fsub_rn(bf16_to_f32(p.x[base + e]), s_mean[e % HEAD_DIM]);
            p.x_hat[base + e] = (i8)quantize(xs, g.inv);
        }
    }
    if (p.x_hat_t || p.x_t) {
        // Transposed copies: consecutive threads take consecutive rows of one column, so the writes
        // are coalesced (the strided reads hit the cache lines the passes above just loaded).
        for (int e = threadIdx.x; e < count; e += nt) {
            const int r = e % rows, c = e / rows;
            const u16 x = p.x[base + (long)r * HEAD_DIM + c];
            const long t_idx = ((long)bh * HEAD_DIM + c) * p.n_pad + row0 + r;
            if (p.x_hat_t) p.x_hat_t[t_idx] = (i8)quantize(__fsub_rn(bf16_to_f32(x), s_mean[c]), g.inv);
            if (p.x_t) p.x_t[t_idx] = x;
        }
    }
    if (p.row_offset)
        for (int r = threadIdx.x; r < rows; r += nt)
            p.row_offset[(long)bh * p.n + row0 + r] =
                row_offset_of(p.x + base + (long)r * HEAD_DIM, p.k_mean + (long)kv * HEAD_DIM, p.c_lambda);
}

// The kv head of query head bh (whose K_m b_r reads).
__device__ __forceinline__ int kv_row_of(const QuantRowsParams& p, int bh) {
    return (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / (p.heads_q / p.heads_kv);
}

// One group = `rows_per_block` consecutive rows × d of one (batch, head). Grid (n_blk, BH).
// x_s = fl(x − mean); scale from max |x_s| over the valid rows; x̂ = q(x_s). Two layouts of the
// launch (src/quantize.rs picks them):
// - register tiles (no Q-smoothing, no BF16 transposed copy: what the staged kernel paths need):
//   rows_per_block/8 · HEAD_DIM/8 threads, dynamic shared memory for b_r's Q rows only;
// - shared tile (Q-smoothing or x_t): THREADS threads, BLOCK_KV · TILE_STRIDE u16 of dynamic
//   shared memory.
// Partial groups and unaligned buffers take the element-wise path in both.
extern "C" __global__ void __launch_bounds__(THREADS, 4) sage_quantize_rows(QuantRowsParams p) {
    extern __shared__ __align__(16) unsigned char s_dyn[];
    __shared__ float s_mean[HEAD_DIM];
    __shared__ float s_km[HEAD_DIM];
    __shared__ double s_kmd[HEAD_DIM];
    __shared__ float s_scratch[THREADS / 32];
    // K (smoothed) runs right after the K mean read all of K: walking its groups in reverse order
    // meets first the heads whose rows are still in L2.
    const bool reverse = p.head_mean != nullptr;
    const int blk = reverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int bh = reverse ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
    const int row0 = blk * p.rows_per_block;
    const int rows = min(p.rows_per_block, p.n - row0);
    const long base = ((long)bh * p.n + row0) * HEAD_DIM;
    const int kv = p.k_mean ? kv_row_of(p, bh) : 0;

    if (!p.block_mean && !p.x_t) {
        const bool full = rows == p.rows_per_block && rows % 32 == 0 &&
                          (int)blockDim.x == rows / 8 * (HEAD_DIM / 8) && p.n_pad % 8 == 0 && aligned16(p.x) &&
                          ((u64)p.x_hat & 7) == 0 && ((u64)p.x_hat_t & 7) == 0;
        if (!full) {
            quantize_group_elementwise(p, blk, bh, row0, rows, base, kv, s_mean, s_scratch);
        } else if (p.head_mean) {
            quantize_group_tiles<true>(p, blk, bh, row0, base, kv, threadIdx.x, 0, blockDim.x >> 5, s_scratch, s_kmd,
                                       (u16*)s_dyn);
        } else {
            quantize_group_tiles<false>(p, blk, bh, row0, base, kv, threadIdx.x, 0, blockDim.x >> 5, s_scratch, s_kmd,
                                        (u16*)s_dyn);
        }
        return;
    }

    u16* s_x = (u16*)s_dyn;  // BLOCK_KV × TILE_STRIDE
    // Full groups with aligned buffers take the staged path (the tile fits s_x); the last, partial
    // group of a sequence reads global memory element by element.
    const bool staged = rows == p.rows_per_block && rows <= BLOCK_KV && rows % 32 == 0 && p.n_pad % 8 == 0 &&
                        aligned16(p.x) && aligned16(p.x_t) && ((u64)p.x_hat & 7) == 0 && ((u64)p.x_hat_t & 7) == 0;
    if (!staged) {
        quantize_group_elementwise(p, blk, bh, row0, rows, base, kv, s_mean, s_scratch);
        return;
    }
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
        if (e < n_vec && p.x_hat) {
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
}

// Mirrored by `QuantQkvParams` in src/quantize.rs.
struct QuantQkvParams {
    QuantRowsParams k, v, q;  // register-tile jobs: K (smoothed or not), V, Q (with b_r)
    int k_blocks, v_blocks;   // blocks of the K and V jobs: one B_kv group each
    int v_first;              // grid order V, K, Q (opt-in, with PDL) instead of K, V, Q
    int pad;
};
static_assert(sizeof(QuantQkvParams) == 3 * 104 + 16, "QuantQkvParams layout changed: update src/quantize.rs");

// Group g of a job (groups numbered head by head): its block index within the head, the head, its
// first row and the element offset of that row.
struct GroupAt {
    int blk, bh, row0;
    long base;
};
__device__ __forceinline__ GroupAt group_at(const QuantRowsParams& p, int g) {
    const int blk = g % p.n_blk, bh = g / p.n_blk, row0 = blk * p.rows_per_block;
    return {blk, bh, row0, ((long)bh * p.n + row0) * HEAD_DIM};
}

// K, V and Q in one launch, for the register-tile layout with every group full (src/quantize.rs
// checks: n_k a multiple of B_kv, n_q of 2·B_q, aligned buffers, no Q-smoothing, no BF16 copies):
// the same per-group code as sage_quantize_rows, so the same bits, without two launch gaps and two
// grid tails. Blocks have a B_kv group's threads (rows_per_block/8 · HEAD_DIM/8). The flat grid
// holds the K groups first, in reverse order (the heads the K mean read last are still in L2),
// then V's, then Q's two at a time: block half h quantizes Q group 2·i + h (n_blk is even, so
// both halves share their (batch, head)). Dynamic shared memory: the Q rows of both groups for b_r.
//
// With PDL (src/quantize.rs: launched after sage_k_mean, which triggers at its start) the grid may
// start while the K mean's partial sums still run (everything queued before them is complete). K's
// and Q's groups issue their loads of K, Q first and wait for sage_k_mean (whose threads wait for the
// partial sums) before they read K_m or write anything (quantize_group_tiles' PDL); V's groups read
// V and write V̂ᵀ and s_V, which neither K-mean kernel touches, so they run whole before pdl_wait().
// v_first (opt-in, SAGEBWD_QKV_VFIRST=1) puts V's groups first so that they run during the K mean:
// measured slower than the K, V, Q order (K's reuse of L2 after the partial sums is lost).
//
// V8 (sage_quantize_qkv_v8, the FP8 P·V forward's fused e4m3 V̂ᵀ, opt-in): V's groups write the e4m3 V̂ᵀ with the
// channel scales s_V that sage_k_mean_v8 wrote (quantize_v_tiles_e4m3) in place of the INT8 V̂ᵀ; a kernel of its own
// so that the INT8 path's code is unchanged.
template <bool V8>
__device__ __forceinline__ void quantize_qkv(const QuantQkvParams p, unsigned char* s_dyn) {
    __shared__ double s_kmd[HEAD_DIM];
    __shared__ float s_scratch[THREADS / 32];
    // The persistent INT8 forward (launched with PDL next, src/forward.rs) reads nothing before it
    // waits for this grid: its blocks may take the SMs this grid's last wave leaves idle.
    pdl_trigger();
    const int warps = blockDim.x >> 5;
    // b: the block's index in the K, V, Q order of the grid without PDL
    int b = blockIdx.x;
    if (p.v_first) b = b < p.v_blocks ? b + p.k_blocks : b < p.v_blocks + p.k_blocks ? b - p.v_blocks : b;
    if (b < p.k_blocks) {
        const GroupAt k = group_at(p.k, p.k_blocks - 1 - b);
        if (p.k.head_mean)
            quantize_group_tiles<true, true>(p.k, k.blk, k.bh, k.row0, k.base, 0, threadIdx.x, 0, warps, s_scratch, s_kmd, nullptr);
        else
            quantize_group_tiles<false, true>(p.k, k.blk, k.bh, k.row0, k.base, 0, threadIdx.x, 0, warps, s_scratch, s_kmd, nullptr);
    } else if (b < p.k_blocks + p.v_blocks) {
        const GroupAt v = group_at(p.v, b - p.k_blocks);
        if constexpr (V8) {
            quantize_v_tiles_e4m3(p.v, v.bh, v.row0, v.base, threadIdx.x);  // waits for sage_k_mean_v8 (s_V)
        } else {
            quantize_group_tiles<false>(p.v, v.blk, v.bh, v.row0, v.base, 0, threadIdx.x, 0, warps, s_scratch, s_kmd, nullptr);
            pdl_wait();  // last: the grid completes only after sage_k_mean
        }
    } else {
        const int q_threads = blockDim.x / 2, half = threadIdx.x / q_threads;
        const GroupAt q = group_at(p.q, 2 * (b - p.k_blocks - p.v_blocks) + half);
        u16* s_rows = (u16*)s_dyn + half * p.q.rows_per_block * ROW_TILE_STRIDE;
        quantize_group_tiles<false, true>(p.q, q.blk, q.bh, q.row0, q.base, kv_row_of(p.q, q.bh), threadIdx.x - half * q_threads,
                                    half, warps / 2, s_scratch, s_kmd, s_rows);
    }
}
extern "C" __global__ void __launch_bounds__(THREADS, 4) sage_quantize_qkv(QuantQkvParams p) {
    extern __shared__ __align__(16) unsigned char s_dyn[];
    quantize_qkv<false>(p, s_dyn);
}
extern "C" __global__ void __launch_bounds__(THREADS, 4) sage_quantize_qkv_v8(QuantQkvParams p) {
    extern __shared__ __align__(16) unsigned char s_dyn[];
    quantize_qkv<true>(p, s_dyn);
}

// Backward preprocess of one head group in one pass over dO (full B_q groups, aligned buffers, no
// BF16 dOᵀ: src/quantize.rs `quantize_do_delta` checks): per B_q group of dO rows, the dO
// quantization of sage_quantize_rows' register-tile path (the same steps as quantize_group_tiles
// without smoothing or b_r: block amax, group_scale, quant_bits, dÔ as it is and byte-transposed,
// s_dO) plus what sage_bwd_delta (backward_pre.cu) does for these rows: D[r] = Σ_d O[r]·dO[r] and
// the zeroing of the rows' FP32 dQ accumulator. dO is read once instead of twice, one launch fewer.
//
// Thread layout of quantize_group_tiles: 8 rows × 8 columns per thread, lane & 7 = the column chunk
// within the warp's 64 columns, lane >> 3 the row chunk; at d = 128 two warps (halves) share a band
// of 32 rows. D is sage_bwd_delta's FP32 tree, bit for bit. There, lane j < 4 of a row's d/8 lanes
// sums chunks j, j + 4, j + 8, … in order (fl(0 + s_j) first), then a butterfly over j (xor 2, 1)
// and the slots. Here the 8 lanes of equal lane >> 3 hold chunks j = lane & 7 of one row like
// sage_bwd_delta's 8 lanes at d = 64: the same shuffles (down 4, xor 2, xor 1). At d = 128 the first
// half's lanes j < 4 hold fl(fl(0 + s_j) + s_{j+4}) and pass it through shared memory (s_part, read
// after group_max's barriers) to the second half, whose lane j continues with its chunks j + 8 and
// j + 12 (its own and lane j + 4's), then the butterfly and the slots.
#define PRE_WARPS_PER_BAND (HEAD_DIM / 64)
extern "C" __global__ void __launch_bounds__(HEAD_DIM) sage_bwd_pre_do(QuantRowsParams p, const u16* __restrict__ o,
                                                                     float* __restrict__ delta, float* __restrict__ dq_zero) {
    __shared__ float s_scratch[HEAD_DIM / 32];
#if HEAD_DIM == 128
    __shared__ float s_part[2 * 8 * 8 * 16];  // [band][row i][slot k][row chunk · 4 + lane j]
#endif
    const int blk = blockIdx.x, bh = blockIdx.y, row0 = blk * p.rows_per_block;
    const long base = ((long)bh * p.n + row0) * HEAD_DIM;
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    // The Q̂ᵀ, K̂ᵀ transposes (sage_transpose_qk_hat, launched with PDL next when one head group runs)
    // read and write nothing of this kernel's: they may fill the SMs this grid's last wave leaves idle.
    pdl_trigger();
    const int band = warp / PRE_WARPS_PER_BAND, half = warp % PRE_WARPS_PER_BAND;
    const int r_first = band * 32 + (lane >> 3) * 8;
    const int j = lane & 7, c0 = (half * 8 + j) * 8;
    uint4 v[8], ov[8];
    const u16* src = p.x + base + (long)r_first * HEAD_DIM + c0;
    const u16* osrc = o + base + (long)r_first * HEAD_DIM + c0;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = *(const uint4*)(src + i * HEAD_DIM);
#pragma unroll
    for (int i = 0; i < 8; ++i) ov[i] = *(const uint4*)(osrc + i * HEAD_DIM);
    {
        float* z = dq_zero + base + (long)r_first * HEAD_DIM + c0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float4* zi = (float4*)(z + i * HEAD_DIM);
            zi[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            zi[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    const auto value = [](u32 w, int c) { return (c & 1) ? hi_bf16(w) : lo_bf16(w); };  // column c of dO
    float amax = tile8_amax(v, value);
    // The products O·dO of the thread's row i, chunk c0 / 8 (exact: two BF16 values).
    auto products = [&](int i, float (&s)[8]) {
        const u32 ow[4] = {ov[i].x, ov[i].y, ov[i].z, ov[i].w}, dw[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u16 oh = (u16)(ow[k >> 1] >> (16 * (k & 1))), dh = (u16)(dw[k >> 1] >> (16 * (k & 1)));
            s[k] = __fmul_rn(bf16_to_f32(oh), bf16_to_f32(dh));
        }
    };
    // The butterfly over lanes j < 4 and the slots; lane j = 0 writes D of row i if `writes`.
    auto finish = [&](int i, float (&s)[8], bool writes) {
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] = __fadd_rn(s[k], __shfl_xor_sync(0xffffffffu, s[k], 2));
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] = __fadd_rn(s[k], __shfl_xor_sync(0xffffffffu, s[k], 1));
#pragma unroll
        for (int k = 0; k < 4; ++k) s[k] = __fadd_rn(s[k], s[k + 4]);
#pragma unroll
        for (int k = 0; k < 2; ++k) s[k] = __fadd_rn(s[k], s[k + 2]);
        if (writes && j == 0) delta[(long)bh * p.n + row0 + r_first + i] = __fadd_rn(s[0], s[1]);
    };
    // Every warp runs every shuffle (no shuffle under a branch on the half: the compiler cannot
    // tell that it is warp-uniform and would add divergence handling); stores are predicated.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float s[8];
        products(i, s);
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] = __fadd_rn(__fadd_rn(0.0f, s[k]), __shfl_down_sync(0xffffffffu, s[k], 4));
#if HEAD_DIM == 64
        finish(i, s, true);
#else
        if (half == 0 && j < 4) {
#pragma unroll
            for (int k = 0; k < 8; ++k) s_part[((band * 8 + i) * 8 + k) * 16 + (lane >> 3) * 4 + j] = s[k];
        }
#endif
    }
    const GroupScale g = group_scale(group_max(amax, s_scratch, 0, HEAD_DIM / 32));  // (barriers)
    if (t == 0) p.scale[(long)bh * p.n_blk + blk] = g.scale;
#if HEAD_DIM == 128
    // The second half's lanes j continue the first half's sums (its values are not used in the first).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float s[8];
        products(i, s);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float a = s_part[((band * 8 + i) * 8 + k) * 16 + (lane >> 3) * 4 + (j & 3)];
            s[k] = __fadd_rn(__fadd_rn(a, s[k]), __shfl_down_sync(0xffffffffu, s[k], 4));
        }
        finish(i, s, half == 1);
    }
#endif
    u32 nat[8][2];
    quantize_tile8(v, g.inv, nat, value);
    store_tile8(p, base, bh, row0, r_first, c0, nat);
}

// Fills n values of a buffer with one 32-bit pattern: NaN poison before kernels write outputs,
// zeros for accumulators.
extern "C" __global__ void sage_fill_u32(u32* __restrict__ dst, u64 n, u32 value) {
    // The backward main kernel (PDL, src/backward.rs) may follow this fill (the dS row sums' zeroing): it
    // waits for this grid before any global access, so its blocks may take the SMs early.
    pdl_trigger();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[i] = value;
}

// Byte transpose of the saved Q̂ and K̂ of a group of (batch, head) rows, [rows, n, d] → [rows, d,
// n_pad] (the quantizer's x̂ᵀ layout): the staged sagebwd backward makes Q̂ᵀ and K̂ᵀ per head group
// from the saved Q̂, K̂ instead of keeping the forward's copies (less memory held between the passes
// and at the backward's peak). Bytes are copied, so Q̂ᵀ, K̂ᵀ hold the very bits the quantizer's
// x̂ᵀ held; the padding columns n..n_pad are not written (nor are they by the quantizer). Grid
// (⌈max(n_q, n_k) / 64⌉, rows, 2): z = 0 transposes Q̂, z = 1 K̂. HEAD_DIM threads, each 8 rows × 8
// columns in registers with the lane layout of quantize_group_tiles (whole sectors per warp).
extern "C" __global__ void __launch_bounds__(HEAD_DIM) sage_transpose_qk_hat(const i8* __restrict__ q_hat,
                                                                          i8* __restrict__ q_hat_t, int n_q, int n_qpad,
                                                                          const i8* __restrict__ k_hat,
                                                                          i8* __restrict__ k_hat_t, int n_k, int n_kpad) {
    constexpr int WARPS_PER_BAND = HEAD_DIM / 64;
    const bool is_k = blockIdx.z == 1;
    const i8* x = is_k ? k_hat : q_hat;
    i8* x_t = is_k ? k_hat_t : q_hat_t;
    const int n = is_k ? n_k : n_q, n_pad = is_k ? n_kpad : n_qpad;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r_first = blockIdx.x * 64 + (warp / WARPS_PER_BAND) * 32 + (lane >> 3) * 8;
    const int c0 = ((warp % WARPS_PER_BAND) * 8 + (lane & 7)) * 8;
    if (r_first >= n) return;
    const i8* src = x + ((long)blockIdx.y * n + r_first) * HEAD_DIM + c0;
    i8* dst = x_t + ((long)blockIdx.y * HEAD_DIM + c0) * n_pad + r_first;
    const bool vec = r_first + 8 <= n && ((u64)src & 7) == 0 && ((u64)dst & 7) == 0 && n_pad % 8 == 0;
    if (!vec) {  // the last, partial chunk of rows (or unaligned buffers): byte by byte
        for (int r = 0; r < min(8, n - r_first); ++r)
            for (int c = 0; c < 8; ++c) dst[(long)c * n_pad + r] = src[(long)r * HEAD_DIM + c];
        return;
    }
    u32 nat[8][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint2 v = *(const uint2*)(src + (long)i * HEAD_DIM);
        nat[i][0] = v.x, nat[i][1] = v.y;
    }
    store_tile8_transposed(dst, n_pad, nat);
}

// sage_transpose_qk_hat with 16 rows × 16 columns per thread (the one-group backward, src/quantize.rs):
// sixteen 16-byte loads and sixteen 16-byte stores per thread instead of eight 8-byte ones of each
// (ncu at the training shape: the 8 × 8 kernel moved its 25 MB of reads at 1.75 TB/s, its warps
// stalled on the loads' latency, the LSU queue and the stores' drain at exit of 64-thread blocks of
// 4 KB each). HEAD_DIM threads per block cover 256 rows: lane % (d/16) = the column chunk, lane /
// (d/16) the row chunk; per warp instruction the loads read 8 (d 64) or 4 (d 128) whole rows and
// the stores write 4 or 8 columns × 128 contiguous bytes. Grid (⌈max(n_q, n_k) / 256⌉, rows, 2).
// The same bytes (a copy); rows past a 16-row boundary at the end (or unaligned buffers) byte by
// byte.
//
// PDL (launched with PDL right after the backward preprocess, src/backward.rs): Q̂, K̂ were written
// by the forward, before the (normally launched) preprocess started, and Q̂ᵀ, K̂ᵀ are touched by
// neither the preprocess nor anything still running; so the transpose needs nothing of its primary
// and runs whole before pdl_wait(), which every thread executes last, so that the grid completes
// only after its primary (the main kernel, launched normally after it, then finds the preprocess's
// D, dÔᵀ and zeroed dQ accumulator complete as before).
__device__ __forceinline__ void transpose_qk_hat_tile16(const i8* __restrict__ q_hat, i8* __restrict__ q_hat_t, int n_q,
                                                        int n_qpad, const i8* __restrict__ k_hat, i8* __restrict__ k_hat_t,
                                                        int n_k, int n_kpad) {
    constexpr int COL_CHUNKS = HEAD_DIM / 16, ROW_CHUNKS = 32 / COL_CHUNKS;
    const bool is_k = blockIdx.z == 1;
    const i8* x = is_k ? k_hat : q_hat;
    i8* x_t = is_k ? k_hat_t : q_hat_t;
    const int n = is_k ? n_k : n_q, n_pad = is_k ? n_kpad : n_qpad;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r_first = blockIdx.x * 256 + (warp * ROW_CHUNKS + lane / COL_CHUNKS) * 16;
    const int c0 = (lane % COL_CHUNKS) * 16;
    if (r_first >= n) return;
    const i8* src = x + ((long)blockIdx.y * n + r_first) * HEAD_DIM + c0;
    i8* dst = x_t + ((long)blockIdx.y * HEAD_DIM + c0) * n_pad + r_first;
    const bool vec = r_first + 16 <= n && ((u64)src & 15) == 0 && ((u64)dst & 15) == 0 && n_pad % 16 == 0;
    if (!vec) {
        for (int r = 0; r < min(16, n - r_first); ++r)
            for (int c = 0; c < 16; ++c) dst[(long)c * n_pad + r] = src[(long)r * HEAD_DIM + c];
        return;
    }
    uint4 v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = *(const uint4*)(src + (long)i * HEAD_DIM);
#pragma unroll
    for (int cb = 0; cb < 4; ++cb) {  // columns 4cb .. 4cb + 3 of the thread's 16
        u32 out[4][4];                 // out[k][rb]: column 4cb + k, rows 4rb .. 4rb + 3
#pragma unroll
        for (int rb = 0; rb < 4; ++rb) {
            u32 a[4], b[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const uint4 row = v[4 * rb + r];
                a[r] = cb == 0 ? row.x : cb == 1 ? row.y : cb == 2 ? row.z : row.w;
            }
            transpose4x4_bytes(a, b);
#pragma unroll
            for (int k = 0; k < 4; ++k) out[k][rb] = b[k];
        }
#pragma unroll
        for (int k = 0; k < 4; ++k)
            *(uint4*)(dst + (long)(4 * cb + k) * n_pad) = make_uint4(out[k][0], out[k][1], out[k][2], out[k][3]);
    }
}

extern "C" __global__ void __launch_bounds__(HEAD_DIM, 768 / HEAD_DIM) sage_transpose_qk_hat16(const i8* __restrict__ q_hat,
                                                                            i8* __restrict__ q_hat_t, int n_q, int n_qpad,
                                                                            const i8* __restrict__ k_hat,
                                                                            i8* __restrict__ k_hat_t, int n_k, int n_kpad) {
    pdl_trigger();  // the backward main kernel (PDL) may follow: it waits for this grid before any global access
    transpose_qk_hat_tile16(q_hat, q_hat_t, n_q, n_qpad, k_hat, k_hat_t, n_k, n_kpad);
    pdl_wait();  // every thread, last (see above)
}

// V̂ᵀ in e4m3 in two grids over (key chunks, batch · KV head), so that the whole GPU works on it (one block per head
// left most SMs idle: 380 µs at B 4 H 16 N 4k d 128 on an H100, against 126 µs for the whole INT8 Q/K/V quantization).
// The default path (after the INT8 quantization, overwriting its V̂ᵀ in the same buffer):
// sage_v_amax_partial: block (c, bh) writes the amax of each channel over keys [c·V8_CHUNK, (c + 1)·V8_CHUNK) to
// v_amax[(bh·n_chunks + c)·d + channel];
// sage_quantize_v_e4m3: block (t, bh) reduces those to the channel's s_V[c] (block t = 0 stores it in
// v_scale[bh·d + c]), then writes its tile of V8_TILE keys transposed, v_hat_t[(bh·d + c)·n_kpad + j] =
// e4m3(V[j][c] / s_V[c]) (the division exact: ldexpf), 0 for the padding keys j ≥ n_k and for an all-zero channel.
// sage_quantize_v_e4m3_scaled (the fused path where its Q/K/V launch does not apply) reads s_V from v_scale instead
// (sage_k_mean_v8 wrote it).
extern "C" __global__ void __launch_bounds__(THREADS) sage_v_amax_partial(const u16* __restrict__ v,
                                                                         float* __restrict__ v_amax, Dims d) {
    constexpr int ROWS = THREADS / HEAD_DIM;  // key rows read at once
    __shared__ float s_amax[THREADS];
    const int c = blockIdx.x, bh = blockIdx.y, t = threadIdx.x, n_chunks = gridDim.x;
    const u16* vb = v + (long)bh * d.n_k * HEAD_DIM;
    const int j_end = min(d.n_k, (c + 1) * V8_CHUNK);
    float m = 0.0f;
    for (int j = c * V8_CHUNK + t / HEAD_DIM; j < j_end; j += ROWS)
        m = fmaxf(m, fabsf(bf16_to_f32(vb[(long)j * HEAD_DIM + t % HEAD_DIM])));
    s_amax[t] = m;
    __syncthreads();
    if (t < HEAD_DIM) {
        float a = s_amax[t];
        for (int i = 1; i < ROWS; ++i) a = fmaxf(a, s_amax[t + i * HEAD_DIM]);
        v_amax[((long)bh * n_chunks + c) * HEAD_DIM + t] = a;
    }
}

template <bool GIVEN>
__device__ __forceinline__ void quantize_v_e4m3(const u16* __restrict__ v, const float* __restrict__ v_amax,
                                                u32* __restrict__ v_hat_t, float* __restrict__ v_scale, Dims d) {
    __shared__ int s_exp[HEAD_DIM];
    __shared__ u16 s_tile[V8_TILE][HEAD_DIM + 2];
    const int bh = blockIdx.y, t = threadIdx.x, j0 = blockIdx.x * V8_TILE;
    const int n_chunks = (d.n_k + V8_CHUNK - 1) / V8_CHUNK;
    const u16* vb = v + (long)bh * d.n_k * HEAD_DIM;
    if (t < HEAD_DIM) {
        if constexpr (GIVEN) {
            s_exp[t] = v8_exponent_of(v_scale[(long)bh * HEAD_DIM + t]);
        } else {
            float a = 0.0f;
            for (int c = 0; c < n_chunks; ++c) a = fmaxf(a, v_amax[((long)bh * n_chunks + c) * HEAD_DIM + t]);
            const bool zero = a == 0.0f;
            const int e = zero ? 0 : e4m3_scale_exponent(a);
            if (blockIdx.x == 0) v_scale[(long)bh * HEAD_DIM + t] = zero ? 0.0f : ldexpf(1.0f, e);
            s_exp[t] = zero ? V8_ZERO_CHANNEL : e;  // = v8_channel_exponent, v8_scale_of
        }
    }
    for (int i = t; i < V8_TILE * HEAD_DIM / 2; i += THREADS) {
        const int r = i / (HEAD_DIM / 2), c = 2 * (i % (HEAD_DIM / 2));
        const u32 w = j0 + r < d.n_k ? *(const u32*)(vb + (long)(j0 + r) * HEAD_DIM + c) : 0u;
        s_tile[r][c] = (u16)(w & 0xffffu);
        s_tile[r][c + 1] = (u16)(w >> 16);
    }
    __syncthreads();
    u32* out = v_hat_t + (long)bh * HEAD_DIM * (d.n_kpad / 4);
    for (int i = t; i < HEAD_DIM * V8_TILE / 4; i += THREADS) {
        const int c = i / (V8_TILE / 4), q = 4 * (i % (V8_TILE / 4)), e = s_exp[c];
        float x[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = v8_input(bf16_to_f32(s_tile[q + k][c]), e);
        out[(long)c * (d.n_kpad / 4) + (j0 + q) / 4] = e4m3x2(x[0], x[1]) | (e4m3x2(x[2], x[3]) << 16);
    }
}
extern "C" __global__ void __launch_bounds__(THREADS) sage_quantize_v_e4m3(const u16* __restrict__ v,
                                                                          const float* __restrict__ v_amax,
                                                                          u32* __restrict__ v_hat_t,
                                                                          float* __restrict__ v_scale, Dims d) {
    quantize_v_e4m3<false>(v, v_amax, v_hat_t, v_scale, d);
}
// The fused path's (s_V given in v_scale; v_amax unused).
extern "C" __global__ void __launch_bounds__(THREADS) sage_quantize_v_e4m3_scaled(const u16* __restrict__ v,
                                                                                 const float* __restrict__ v_amax,
                                                                                 u32* __restrict__ v_hat_t,
                                                                                 float* __restrict__ v_scale, Dims d) {
    quantize_v_e4m3<true>(v, v_amax, v_hat_t, v_scale, d);
}
