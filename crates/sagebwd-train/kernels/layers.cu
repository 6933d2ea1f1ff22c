// Kernels of the transformer layers (forward and backward): embedding, RMSNorm, the Q/K/V head
// split with QK-norm and rotary, the head/token permutations around attention, SwiGLU, casts.
// The matrix products run in cuBLASLt; attention in sagebwd-cuda. Every formula mirrors the CPU
// layer of the same name in src/layers/ (the GPU-vs-CPU check compares them).

// ---- embedding -----------------------------------------------------------------------------

// x[t, :] = table[tokens[t], :]. One block per token.
extern "C" __global__ void embed_forward(const u32* tokens, const float* table, float* x, int dim) {
    const long t = blockIdx.x;
    const float* src = table + (long)tokens[t] * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) x[t * dim + c] = src[c];
}

// d_table[tokens[t], :] += dx[t, :]. Atomics: the order of additions into a repeated token's row
// varies from run to run (the CPU path adds in token order).
extern "C" __global__ void embed_backward(const u32* tokens, const float* dx, float* d_table, int dim) {
    const long t = blockIdx.x;
    float* dst = d_table + (long)tokens[t] * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) atomicAdd(dst + c, dx[t * dim + c]);
}

// ---- RMSNorm -------------------------------------------------------------------------------

// V consecutive floats (V = 4: one 16-byte access) and their BF16 rounding (V = 4: one 8-byte store).
template <int V>
__device__ __forceinline__ void load_floats(const float* p, float (&a)[V]) {
    if constexpr (V == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
    } else {
        for (int i = 0; i < V; i++) a[i] = p[i];
    }
}
template <int V>
__device__ __forceinline__ void store_floats(float* p, const float (&a)[V]) {
    if constexpr (V == 4) *reinterpret_cast<float4*>(p) = make_float4(a[0], a[1], a[2], a[3]);
    else for (int i = 0; i < V; i++) p[i] = a[i];
}
template <int V>
__device__ __forceinline__ void store_bf16(u16* p, const float (&a)[V]) {
    if constexpr (V == 4)
        *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]));
    else for (int i = 0; i < V; i++) p[i] = f32_to_bf16(a[i]);
}

template <int V>
__device__ __forceinline__ void load_bf16(const u16* p, float (&a)[V]) {
    if constexpr (V == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        a[0] = bf16_to_f32((u16)(w.x & 0xffffu)), a[1] = bf16_to_f32((u16)(w.x >> 16));
        a[2] = bf16_to_f32((u16)(w.y & 0xffffu)), a[3] = bf16_to_f32((u16)(w.y >> 16));
    } else {
        for (int i = 0; i < V; i++) a[i] = bf16_to_f32(p[i]);
    }
}

// y = x · rstd · g (BF16, the next product's operand), rstd = 1/sqrt(mean(x²) + eps). One warp per row;
// lane `lane` takes columns V·lane + V·WARP·k, V at a time (V = 4 needs n % 4 == 0).
// ADD: the row is first the residual sum x = x_in + branch (the BF16 output of the block's last
// product), written to x_out in FP32: the product writes BF16 (cuBLASLt's FP32-output-plus-C
// products ran at ~200–400 TFLOP/s) and the sum costs this kernel one more BF16 read. The second
// pass re-reads the thread's own x_out columns (written by this thread: no barrier needed).
template <int V, bool ADD>
__device__ __forceinline__ void rmsnorm_forward_row(const float* xr, const u16* br, float* sr, const float* gain, u16* yr,
                                                    float* rstd, int n, float eps) {
    const int lane = threadIdx.x % WARP;
    float ss = 0.0f;
    for (int c = V * lane; c < n; c += V * WARP) {
        float v[V];
        load_floats<V>(xr + c, v);
        if constexpr (ADD) {
            float b[V];
            load_bf16<V>(br + c, b);
            for (int i = 0; i < V; i++) v[i] += b[i];
            store_floats<V>(sr + c, v);
        }
        for (int i = 0; i < V; i++) ss += v[i] * v[i];
    }
    const float rs = 1.0f / sqrtf(warp_sum(ss) / n + eps);
    const float* xs = ADD ? sr : xr;
    for (int c = V * lane; c < n; c += V * WARP) {
        float v[V], g[V];
        load_floats<V>(xs + c, v), load_floats<V>(gain + c, g);
        for (int i = 0; i < V; i++) v[i] = v[i] * rs * g[i];
        store_bf16<V>(yr + c, v);
    }
    if (lane == 0) *rstd = rs;
}

// The same row with all of it in registers (n == V·WARP·ITERS): every load of the row is issued
// before the first use, where the loop above has one iteration's loads in flight per lane; ncu
// showed the loop latency-bound (~3.2 TB/s of ~4.8, 41 cycles per issued instruction). Same
// arithmetic in the same order.
template <int V, bool ADD, int ITERS>
__device__ __forceinline__ void rmsnorm_forward_row_regs(const float* xr, const u16* br, float* sr, const float* gain,
                                                         u16* yr, float* rstd, float eps) {
    const int lane = threadIdx.x % WARP, n = V * WARP * ITERS;
    float v[ITERS][V];
#pragma unroll
    for (int k = 0; k < ITERS; k++) load_floats<V>(xr + V * (lane + WARP * k), v[k]);
    if constexpr (ADD) {
        float b[ITERS][V];
#pragma unroll
        for (int k = 0; k < ITERS; k++) load_bf16<V>(br + V * (lane + WARP * k), b[k]);
#pragma unroll
        for (int k = 0; k < ITERS; k++) {
            for (int i = 0; i < V; i++) v[k][i] += b[k][i];
            store_floats<V>(sr + V * (lane + WARP * k), v[k]);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < ITERS; k++)
        for (int i = 0; i < V; i++) ss += v[k][i] * v[k][i];
    const float rs = 1.0f / sqrtf(warp_sum(ss) / n + eps);
#pragma unroll
    for (int k = 0; k < ITERS; k++) {
        float g[V];
        load_floats<V>(gain + V * (lane + WARP * k), g);
        for (int i = 0; i < V; i++) v[k][i] = v[k][i] * rs * g[i];
        store_bf16<V>(yr + V * (lane + WARP * k), v[k]);
    }
    if (lane == 0) *rstd = rs;
}

// Widths whose rows the norm kernels hold in registers (n = 128 · ITERS with 16-byte accesses): the
// train-check models (128, 256) and small, base, medium (384, 768, 1024). The dispatchers return
// false for other widths (the loop versions then run). ROW_WIDTHS(F) calls F(n, ITERS) per width.
#define ROW_WIDTHS(F) F(128, 1) F(256, 2) F(384, 3) F(768, 6) F(1024, 8)

template <bool ADD>
__device__ __forceinline__ bool rmsnorm_forward_in_registers(const float* xr, const u16* br, float* sr,
                                                             const float* gain, u16* yr, float* rstd, int n, float eps) {
#define FORWARD_WIDTH(N, I) \
    case N: rmsnorm_forward_row_regs<4, ADD, I>(xr, br, sr, gain, yr, rstd, eps); return true;
    switch (n) {
        ROW_WIDTHS(FORWARD_WIDTH)
        default: return false;
    }
#undef FORWARD_WIDTH
}

// `branch` null: normalize x. Otherwise normalize x_out = x + branch (BF16), written to x_out.
extern "C" __global__ void rmsnorm_forward(const float* x, const u16* branch, float* x_out, const float* gain, u16* y,
                                           float* rstd, int n, long rows, float eps, int vec) {
    const long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    if (row >= rows) return;
    const long o = row * n;
    if (vec && (branch ? rmsnorm_forward_in_registers<true>(x + o, branch + o, x_out + o, gain, y + o, rstd + row, n, eps)
                       : rmsnorm_forward_in_registers<false>(x + o, nullptr, nullptr, gain, y + o, rstd + row, n, eps)))
        return;
    if (branch) {
        if (vec) rmsnorm_forward_row<4, true>(x + o, branch + o, x_out + o, gain, y + o, rstd + row, n, eps);
        else rmsnorm_forward_row<1, true>(x + o, branch + o, x_out + o, gain, y + o, rstd + row, n, eps);
    } else {
        if (vec) rmsnorm_forward_row<4, false>(x + o, nullptr, nullptr, gain, y + o, rstd + row, n, eps);
        else rmsnorm_forward_row<1, false>(x + o, nullptr, nullptr, gain, y + o, rstd + row, n, eps);
    }
}

// The RMSNorm backward, with what the next steps need fused in (each would otherwise re-read the
// FP32 rows): from dy (BF16, as the dx products write it — autocast's gradient type; an FP32 dy cost
// each of the 25 norms 25 MB more to read and its product 25 MB more to write), dx += rstd · g ∘ dy − x · rstd³ · (Σ g ∘ dy ∘ x) / n, its BF16 copy dx_bf16 (the operand
// of the preceding layer's dx product), and the gain gradient's partial column sums
// partial[block, c] = Σ_{rows of the block} dy · x · rstd (finished by sum_partials). Block: NORM_WARPS
// warps over rows_per_block consecutive rows, one warp per row at a time; each warp sums its rows'
// gain terms into its own shared-memory row (n floats, dynamic), and the warps' rows are added in a
// fixed order at the end, so the result does not depend on scheduling.
#define NORM_WARPS 8

// Lane `lane` of a warp takes columns V·lane + V·WARP·k, V at a time (V = 4 needs n % 4 == 0).
template <int V>
__device__ __forceinline__ void rmsnorm_backward_rows(const u16* dy, const float* x, const float* gain,
                                                      const float* rstd, float* dx, u16* dx_bf16, float* my_gain,
                                                      int n, long rows, long r0, int rows_per_block) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (long row = r0 + warp; row < min(rows, r0 + rows_per_block); row += NORM_WARPS) {
        const u16* dyr = dy + row * n;
        const float* xr = x + row * n;
        float ux = 0.0f;
        for (int c = V * lane; c < n; c += V * WARP) {
            float g[V], xv[V], w[V];
            load_bf16<V>(dyr + c, g), load_floats<V>(xr + c, xv), load_floats<V>(gain + c, w);
            for (int i = 0; i < V; i++) ux += g[i] * w[i] * xv[i];
        }
        const float rs = rstd[row];
        const float coef = rs * rs * rs * warp_sum(ux) / n;
        for (int c = V * lane; c < n; c += V * WARP) {
            float g[V], xv[V], w[V], v[V];
            load_bf16<V>(dyr + c, g), load_floats<V>(xr + c, xv), load_floats<V>(gain + c, w);
            load_floats<V>(dx + row * n + c, v);
            for (int i = 0; i < V; i++) {
                v[i] += rs * w[i] * g[i] - xv[i] * coef;
                my_gain[c + i] += g[i] * xv[i] * rs;
            }
            store_floats<V>(dx + row * n + c, v);
            store_bf16<V>(dx_bf16 + row * n + c, v);
        }
    }
}

// The same rows with each row's dy, x and dx in registers (n == V·WARP·ITERS), all loaded before
// the first use (ncu: the loop version reached ~3.3 TB/s of ~4.8 at 47 % occupancy). Same
// arithmetic in the same order.
template <int V, int ITERS>
__device__ __forceinline__ void rmsnorm_backward_rows_regs(const u16* dy, const float* x, const float* gain,
                                                           const float* rstd, float* dx, u16* dx_bf16, float* my_gain,
                                                           long rows, long r0, int rows_per_block) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n = V * WARP * ITERS;
    for (long row = r0 + warp; row < min(rows, r0 + rows_per_block); row += NORM_WARPS) {
        const u16* dyr = dy + row * n;
        const float* xr = x + row * n;
        float* dxr = dx + row * n;
        float g[ITERS][V], xv[ITERS][V], v[ITERS][V];
#pragma unroll
        for (int k = 0; k < ITERS; k++) {
            const int c = V * (lane + WARP * k);
            load_bf16<V>(dyr + c, g[k]), load_floats<V>(xr + c, xv[k]), load_floats<V>(dxr + c, v[k]);
        }
        float ux = 0.0f;
#pragma unroll
        for (int k = 0; k < ITERS; k++) {
            float w[V];
            load_floats<V>(gain + V * (lane + WARP * k), w);
            for (int i = 0; i < V; i++) ux += g[k][i] * w[i] * xv[k][i];
        }
        const float rs = rstd[row];
        const float coef = rs * rs * rs * warp_sum(ux) / n;
#pragma unroll
        for (int k = 0; k < ITERS; k++) {
            const int c = V * (lane + WARP * k);
            float w[V];
            load_floats<V>(gain + c, w);
            for (int i = 0; i < V; i++) {
                v[k][i] += rs * w[i] * g[k][i] - xv[k][i] * coef;
                my_gain[c + i] += g[k][i] * xv[k][i] * rs;
            }
            store_floats<V>(dxr + c, v[k]);
            store_bf16<V>(dx_bf16 + row * n + c, v[k]);
        }
    }
}

__device__ __forceinline__ bool rmsnorm_backward_in_registers(const u16* dy, const float* x, const float* gain,
                                                              const float* rstd, float* dx, u16* dx_bf16, float* my_gain,
                                                              int n, long rows, long r0, int rows_per_block) {
#define BACKWARD_WIDTH(N, I) \
    case N: rmsnorm_backward_rows_regs<4, I>(dy, x, gain, rstd, dx, dx_bf16, my_gain, rows, r0, rows_per_block); return true;
    switch (n) {
        ROW_WIDTHS(BACKWARD_WIDTH)
        default: return false;
    }
#undef BACKWARD_WIDTH
}

extern "C" __global__ void __launch_bounds__(NORM_WARPS * WARP)
rmsnorm_backward(const u16* dy, const float* x, const float* gain, const float* rstd, float* dx, u16* dx_bf16,
                 float* partial, int n, long rows, int rows_per_block, int vec) {
    extern __shared__ float s_gain[];  // [NORM_WARPS][n]
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float* my_gain = s_gain + warp * n;
    for (int c = lane; c < n; c += WARP) my_gain[c] = 0.0f;
    __syncwarp();
    const long r0 = (long)blockIdx.x * rows_per_block;
    if (!(vec && rmsnorm_backward_in_registers(dy, x, gain, rstd, dx, dx_bf16, my_gain, n, rows, r0, rows_per_block))) {
        if (vec) rmsnorm_backward_rows<4>(dy, x, gain, rstd, dx, dx_bf16, my_gain, n, rows, r0, rows_per_block);
        else rmsnorm_backward_rows<1>(dy, x, gain, rstd, dx, dx_bf16, my_gain, n, rows, r0, rows_per_block);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        float total = 0.0f;
        for (int w = 0; w < NORM_WARPS; w++) total += s_gain[w * n + c];
        partial[(long)blockIdx.x * n + c] = total;
    }
}

// Column sums run on blocks of COL_TILE columns × ROW_LANES row lanes: 32 consecutive columns keep each
// row's loads coalesced, and the row lanes give every block 8 independent load streams (a thread per
// column alone would walk its rows one dependent load at a time). The lanes' sums meet in shared
// memory in a fixed order, so the result does not depend on scheduling.
#define COL_TILE 32
#define ROW_LANES 8
// sum_partials' row lanes: its few blocks (one per 32 columns) each need many loads in flight.
#define PARTIAL_LANES 32

template <int LANES>
__device__ __forceinline__ float sum_row_lanes(float v, float (*s)[COL_TILE]) {
    s[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    float total = 0.0f;
    for (int k = 0; k < LANES; k++) total += s[k][threadIdx.x];
    return total;
}

// partial[chunk, c] = Σ_{rows r of the chunk} a[r, c]: column sums in fixed-order partial sums (the
// QK-norm gains' gradients, from the terms qkv_heads_backward writes). Grid: x over column tiles, y
// over chunks of rows.
extern "C" __global__ void column_sum_partial(const float* a, Rows a_rows, float* partial, long rows, int rows_per_chunk) {
    __shared__ float s[ROW_LANES][COL_TILE];
    const int c = blockIdx.x * COL_TILE + threadIdx.x;
    const int n = a_rows.n;
    const long r0 = (long)blockIdx.y * rows_per_chunk;
    const long r1 = min(rows, r0 + rows_per_chunk);
    float acc = 0.0f;
    if (c < n) {
        RowWalk walk(a_rows, r0 + threadIdx.y, ROW_LANES);
#pragma unroll 4
        for (long r = r0 + threadIdx.y; r < r1; r += ROW_LANES, walk.next(a_rows)) acc += a[walk.offset(a_rows) + c];
    }
    const float total = sum_row_lanes<ROW_LANES>(acc, s);
    if (threadIdx.y == 0 && c < n) partial[(long)blockIdx.y * n + c] = total;
}

// out[c] += Σ_k partial[k, c] (row lanes take every PARTIAL_LANES-th chunk; fixed order).
extern "C" __global__ void sum_partials(const float* partial, float* out, int n, int chunks) {
    __shared__ float s[PARTIAL_LANES][COL_TILE];
    const int c = blockIdx.x * COL_TILE + threadIdx.x;
    float acc = 0.0f;
    if (c < n)
#pragma unroll 4
        for (int k = threadIdx.y; k < chunks; k += PARTIAL_LANES) acc += partial[(long)k * n + c];
    const float total = sum_row_lanes<PARTIAL_LANES>(acc, s);
    if (threadIdx.y == 0 && c < n) out[c] += total;
}

// ---- Q/K/V heads: QK-norm, rotary, layout --------------------------------------------------

struct HeadsDims {
    int batch, seq, heads_q, heads_kv, head_dim, qk_norm;
    float eps;
};

// Slot s of a token's fused projection row `[q heads | k heads | v heads]`: which tensor, which head.
__device__ __forceinline__ void slot_of(const HeadsDims& d, int s, int& kind, int& h) {
    if (s < d.heads_q) { kind = 0; h = s; }
    else if (s < d.heads_q + d.heads_kv) { kind = 1; h = s - d.heads_q; }
    else { kind = 2; h = s - d.heads_q - d.heads_kv; }
}

// Offset of (b, h, t) in a `[batch, heads, seq, head_dim]` tensor.
__device__ __forceinline__ long head_offset(const HeadsDims& d, int heads, int b, int t, int h) {
    return (((long)b * heads + h) * d.seq + t) * d.head_dim;
}

// Each head vector (one (token, slot)) is handled by a group of head_dim / 8 consecutive lanes (8 at
// d = 64, 16 at d = 128; the host checks head_dim / 8 divides 32). Lane j of the group holds the PAIRS
// rotary pairs (i, i + half), i = PAIRS·j … PAIRS·j + PAIRS − 1: two 8-byte loads or stores per
// tensor, and the QK-norm sums reduce within the group by shuffles.
#define PAIRS 4

struct HeadLane {
    long tok;               // b · seq + t
    int b, t;
    int slot, kind, h, i0;  // i0: the lane's first pair
    bool valid;             // false for the lanes past the token's last head vector (they still shuffle)
};

// Grid: x over one token's slots × lanes, y = position t, z = sequence b (HeadsDims::launch), so no
// thread divides by the token count (64-bit divisions made these kernels instruction-bound).
__device__ __forceinline__ HeadLane head_lane(const HeadsDims& d) {
    const int lanes = d.head_dim / (2 * PAIRS), slots = d.heads_q + 2 * d.heads_kv;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    HeadLane l;
    l.valid = idx < slots * lanes;
    l.b = blockIdx.z;
    l.t = blockIdx.y;
    l.tok = (long)l.b * d.seq + l.t;
    // lanes is a power of two (the host: head_dim / 8 divides 32): a shift, not a 32-bit division.
    const int lanes_log2 = __ffs(lanes) - 1;
    l.slot = l.valid ? idx >> lanes_log2 : 0;
    slot_of(d, l.slot, l.kind, l.h);
    l.i0 = PAIRS * (idx & (lanes - 1));
    return l;
}

// 1 / hd for a power of two hd (exact: 2^-log2(hd) built from its exponent bits).
__device__ __forceinline__ float inv_head_dim(int hd) { return __int_as_float((127 - (__ffs(hd) - 1)) << 23); }

// Sum over the lane's group (aligned groups of `lanes` lanes; every lane of the warp must call it).
__device__ __forceinline__ float group_sum(float v, int lanes) {
    for (int o = lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Elements i0 … i0 + 3 (a) and half + i0 … (b) of a head vector.
struct Pairs {
    float a[PAIRS], b[PAIRS];
};

__device__ __forceinline__ void unpack4(uint2 w, float* out) {
    out[0] = bf16_to_f32((u16)(w.x & 0xffffu));
    out[1] = bf16_to_f32((u16)(w.x >> 16));
    out[2] = bf16_to_f32((u16)(w.y & 0xffffu));
    out[3] = bf16_to_f32((u16)(w.y >> 16));
}

__device__ __forceinline__ uint2 pack4(const float* v) {
    return make_uint2(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]));
}

__device__ __forceinline__ Pairs load_pairs(const u16* vec, int i0, int half) {
    Pairs p;
    unpack4(*(const uint2*)(vec + i0), p.a);
    unpack4(*(const uint2*)(vec + half + i0), p.b);
    return p;
}

__device__ __forceinline__ void store_pairs(u16* vec, int i0, int half, const Pairs& p) {
    *(uint2*)(vec + i0) = pack4(p.a);
    *(uint2*)(vec + half + i0) = pack4(p.b);
}

__device__ __forceinline__ Pairs load_gain_pairs(const float* gain, int i0, int half) {
    const float4 a = *(const float4*)(gain + i0), b = *(const float4*)(gain + half + i0);
    return Pairs{{a.x, a.y, a.z, a.w}, {b.x, b.y, b.z, b.w}};
}

// qkv: `[tokens, (heads_q + 2 heads_kv) · head_dim]` BF16 (the fused projection). Writes Q, K, V as
// BF16 `[batch, heads, seq, head_dim]`: Q and K normalized (QK-norm, optional) then rotated (half-split
// pairs, as src/layers/rotary.rs); V copied.
extern "C" __global__ void qkv_heads_forward(HeadsDims d, const u16* qkv, const float* q_gain, const float* k_gain,
                                             const float* cos_t, const float* sin_t, u16* q, u16* k, u16* v,
                                             float* q_rstd, float* k_rstd) {
    const HeadLane l = head_lane(d);
    const int hd = d.head_dim, half = hd / 2, slots = d.heads_q + 2 * d.heads_kv;
    Pairs x = {};
    if (l.valid) x = load_pairs(qkv + (l.tok * slots + l.slot) * hd, l.i0, half);
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < PAIRS; p++) ss += x.a[p] * x.a[p] + x.b[p] * x.b[p];
    // hd = 8 · lanes is a power of two, so · inv_hd is the division by hd exactly.
    const float rs = rsqrtf(group_sum(ss, hd / (2 * PAIRS)) * inv_head_dim(hd) + d.eps);
    if (!l.valid) return;
    if (l.kind == 2) {  // V: the same BF16 values, moved into the heads layout
        store_pairs(v + head_offset(d, d.heads_kv, l.b, l.t, l.h), l.i0, half, x);
        return;
    }
    if (d.qk_norm) {
        const Pairs g = load_gain_pairs(l.kind == 0 ? q_gain : k_gain, l.i0, half);
#pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            x.a[p] = x.a[p] * rs * g.a[p];
            x.b[p] = x.b[p] * rs * g.b[p];
        }
        if (l.i0 == 0) (l.kind == 0 ? q_rstd : k_rstd)[l.tok * (l.kind == 0 ? d.heads_q : d.heads_kv) + l.h] = rs;
    }
    const long t = l.t;
    const float4 c4 = *(const float4*)(cos_t + t * half + l.i0), s4 = *(const float4*)(sin_t + t * half + l.i0);
    const float c[PAIRS] = {c4.x, c4.y, c4.z, c4.w}, s[PAIRS] = {s4.x, s4.y, s4.z, s4.w};
    Pairs y;
#pragma unroll
    for (int p = 0; p < PAIRS; p++) {
        y.a[p] = x.a[p] * c[p] - x.b[p] * s[p];
        y.b[p] = x.a[p] * s[p] + x.b[p] * c[p];
    }
    u16* dst = l.kind == 0 ? q + head_offset(d, d.heads_q, l.b, l.t, l.h) : k + head_offset(d, d.heads_kv, l.b, l.t, l.h);
    store_pairs(dst, l.i0, half, y);
}

// The block's token: out[(tok·2 + k)·hd + c] = Σ_h terms of head h (k = 0: the query heads, 1: the
// key heads), summed in head order (deterministic) through shared memory (`[heads_q + heads_kv][hd]`
// floats, dynamic). Every thread of the block must call it (one barrier).
__device__ __forceinline__ void sum_gain_terms_over_heads(const HeadsDims& d, const HeadLane& l, bool has_terms,
                                                          const Pairs& term, float* out) {
    extern __shared__ float s_terms[];
    const int hd = d.head_dim, half = hd / 2;
    if (has_terms) {
#pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            s_terms[l.slot * hd + l.i0 + p] = term.a[p];
            s_terms[l.slot * hd + half + l.i0 + p] = term.b[p];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * hd; i += blockDim.x) {
        const int key = i >= hd, c = i - key * hd;
        const int h0 = key ? d.heads_q : 0, heads = key ? d.heads_kv : d.heads_q;
        float sum = 0.0f;
        for (int h = 0; h < heads; h++) sum += s_terms[(h0 + h) * hd + c];
        out[(l.tok * 2 + key) * hd + c] = sum;
    }
}

// The backward of qkv_heads_forward: dQ, dK, dV (BF16, heads layout) → d_qkv (BF16, the fused
// projection's layout). Inverse rotation (a rotation's Jacobian is the rotation), then the RMSNorm
// backward with the saved rstd; the gains' gradient terms ∂y_i · x_i · rstd go to gain_terms (FP32),
// whose column sums are the gains' gradients. When one block holds a whole token (gridDim.x == 1,
// the host's `gain_terms_per_token`), the block sums them over the heads first, in head order:
// `[tokens, 2, head_dim]` (query gain, key gain) — 1/heads of the bytes to write and to sum later.
// Otherwise `[tokens, heads_q + heads_kv, head_dim]`, one row per head.
extern "C" __global__ void qkv_heads_backward(HeadsDims d, const u16* dq, const u16* dk, const u16* dv,
                                              const u16* qkv, const float* q_gain, const float* k_gain,
                                              const float* q_rstd, const float* k_rstd, const float* cos_t,
                                              const float* sin_t, u16* d_qkv, float* gain_terms) {
    const HeadLane l = head_lane(d);
    const int hd = d.head_dim, half = hd / 2, slots = d.heads_q + 2 * d.heads_kv;
    const bool rotated = l.valid && l.kind != 2;
    const u16* src = l.kind == 0 ? dq + head_offset(d, d.heads_q, l.b, l.t, l.h)
                   : l.kind == 1 ? dk + head_offset(d, d.heads_kv, l.b, l.t, l.h)
                                 : dv + head_offset(d, d.heads_kv, l.b, l.t, l.h);
    Pairs dy = {};
    if (l.valid) dy = load_pairs(src, l.i0, half);
    Pairs dn = dy;  // ∂ of the normalized vector: inverse rotation (V: unchanged)
    if (rotated) {
        const long t = l.t;
        const float4 c4 = *(const float4*)(cos_t + t * half + l.i0), s4 = *(const float4*)(sin_t + t * half + l.i0);
        const float c[PAIRS] = {c4.x, c4.y, c4.z, c4.w}, s[PAIRS] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            dn.a[p] = dy.a[p] * c[p] + dy.b[p] * s[p];
            dn.b[p] = dy.b[p] * c[p] - dy.a[p] * s[p];
        }
    }
    u16* out = d_qkv + (l.tok * slots + l.slot) * hd;
    if (!d.qk_norm) {  // uniform: no shuffle below
        if (l.valid) store_pairs(out, l.i0, half, dn);
        return;
    }
    Pairs x = {}, g = {};
    if (rotated) {
        x = load_pairs(qkv + (l.tok * slots + l.slot) * hd, l.i0, half);
        g = load_gain_pairs(l.kind == 0 ? q_gain : k_gain, l.i0, half);
    }
    float ux = 0.0f;
#pragma unroll
    for (int p = 0; p < PAIRS; p++) ux += dn.a[p] * g.a[p] * x.a[p] + dn.b[p] * g.b[p] * x.b[p];
    ux = group_sum(ux, hd / (2 * PAIRS));
    if (l.valid && l.kind == 2) store_pairs(out, l.i0, half, dn);
    Pairs term = {};
    if (rotated) {
        const float rs = l.kind == 0 ? q_rstd[l.tok * d.heads_q + l.h] : k_rstd[l.tok * d.heads_kv + l.h];
        const float coef = rs * rs * rs * ux * inv_head_dim(hd);
        Pairs dx;
#pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            dx.a[p] = rs * g.a[p] * dn.a[p] - x.a[p] * coef;
            dx.b[p] = rs * g.b[p] * dn.b[p] - x.b[p] * coef;
            term.a[p] = dn.a[p] * x.a[p] * rs;
            term.b[p] = dn.b[p] * x.b[p] * rs;
        }
        store_pairs(out, l.i0, half, dx);
    }
    if (gridDim.x == 1) {
        sum_gain_terms_over_heads(d, l, rotated, term, gain_terms);
    } else if (rotated) {
        float* terms = gain_terms + (l.tok * (d.heads_q + d.heads_kv) + l.slot) * hd;
        *(float4*)(terms + l.i0) = make_float4(term.a[0], term.a[1], term.a[2], term.a[3]);
        *(float4*)(terms + half + l.i0) = make_float4(term.b[0], term.b[1], term.b[2], term.b[3]);
    }
}

// `[batch, heads, seq, hd]` ↔ `[batch·seq, heads·hd]` (BF16), 8 elements (16 bytes) per thread.
// Grid: x over one token's heads × 16-byte pieces, y = position t, z = sequence b.
extern "C" __global__ void permute_heads(const u16* src, u16* dst, int batch, int seq, int heads, int head_dim,
                                         int to_tokens) {
    const int vecs = head_dim / 8;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= heads * vecs) return;
    const int c = idx % vecs, h = idx / vecs;
    const long t = blockIdx.y, b = blockIdx.z, bh = b * heads + h;
    const long head_idx = (bh * seq + t) * head_dim + c * 8;
    const long tok_idx = ((b * seq + t) * heads + h) * head_dim + c * 8;
    const long from = to_tokens ? head_idx : tok_idx, to = to_tokens ? tok_idx : head_idx;
    *(uint4*)(dst + to) = *(const uint4*)(src + from);
}

// ---- SwiGLU --------------------------------------------------------------------------------

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// VEC consecutive BF16 values; VEC = 8 is one 16-byte load or store.
template <int VEC>
struct __align__(2 * VEC) Bf16s {
    u16 h[VEC];
};

// The SwiGLU kernels handle VEC consecutive columns j of one token per thread (the host takes VEC = 8
// when f is a multiple of 8, else VEC = 1). Grid: x over a token's columns, y = position, z = sequence
// (token_grid on the host), so the token index needs no division.
// gu: `[tokens, gate (f) | up (f)]` BF16 (the product's output) → act = silu(gate) ∘ up, BF16 `[tokens, f]`.
template <int VEC>
__device__ __forceinline__ void swiglu_forward_vec(const u16* gu, u16* act, int f) {
    const long t = (long)blockIdx.z * gridDim.y + blockIdx.y, j = ((long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (j >= f) return;
    const long e = t * f + j;
    const Bf16s<VEC> g = *(const Bf16s<VEC>*)(gu + t * 2 * f + j), u = *(const Bf16s<VEC>*)(gu + t * 2 * f + f + j);
    Bf16s<VEC> out;
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        const float gi = bf16_to_f32(g.h[i]);
        out.h[i] = f32_to_bf16(gi * sigmoid(gi) * bf16_to_f32(u.h[i]));
    }
    *(Bf16s<VEC>*)(act + e) = out;
}

// d_gu = [∂gate | ∂up] (BF16) from ∂act (BF16): silu'(g) = σ(g) · (1 + g · (1 − σ(g))).
template <int VEC>
__device__ __forceinline__ void swiglu_backward_vec(const u16* d_act, const u16* gu, u16* d_gu, int f) {
    const long t = (long)blockIdx.z * gridDim.y + blockIdx.y, j = ((long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (j >= f) return;
    const long e = t * f + j;
    const Bf16s<VEC> g = *(const Bf16s<VEC>*)(gu + t * 2 * f + j), u = *(const Bf16s<VEC>*)(gu + t * 2 * f + f + j);
    const Bf16s<VEC> da = *(const Bf16s<VEC>*)(d_act + e);
    Bf16s<VEC> d_gate, d_up;
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        const float gi = bf16_to_f32(g.h[i]), ui = bf16_to_f32(u.h[i]), dai = bf16_to_f32(da.h[i]), s = sigmoid(gi);
        d_gate.h[i] = f32_to_bf16(dai * ui * s * (1.0f + gi * (1.0f - s)));
        d_up.h[i] = f32_to_bf16(dai * gi * s);
    }
    *(Bf16s<VEC>*)(d_gu + t * 2 * f + j) = d_gate;
    *(Bf16s<VEC>*)(d_gu + t * 2 * f + f + j) = d_up;
}

extern "C" __global__ void swiglu_forward(const u16* gu, u16* act, int f) { swiglu_forward_vec<1>(gu, act, f); }
extern "C" __global__ void swiglu_forward_x8(const u16* gu, u16* act, int f) { swiglu_forward_vec<8>(gu, act, f); }
extern "C" __global__ void swiglu_backward(const u16* d_act, const u16* gu, u16* d_gu, int f) {
    swiglu_backward_vec<1>(d_act, gu, d_gu, f);
}
extern "C" __global__ void swiglu_backward_x8(const u16* d_act, const u16* gu, u16* d_gu, int f) {
    swiglu_backward_vec<8>(d_act, gu, d_gu, f);
}

// ---- casts ---------------------------------------------------------------------------------

extern "C" __global__ void cast_bf16(const float* x, u16* y, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = f32_to_bf16(x[i]);
}
