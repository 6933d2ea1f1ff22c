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

// Sums of partial rows run on blocks of COL_TILE columns × PARTIAL_LANES row lanes: 32 consecutive
// columns keep each row's loads coalesced, and the row lanes give each of the few blocks (one per 32
// columns) many independent loads in flight (a thread per column alone would walk its rows one
// dependent load at a time). The lanes' sums meet in shared memory in a fixed order, so the result
// does not depend on scheduling.
#define COL_TILE 32
#define PARTIAL_LANES 32

template <int LANES>
__device__ __forceinline__ float sum_row_lanes(float v, float (*s)[COL_TILE]) {
    s[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    float total = 0.0f;
    for (int k = 0; k < LANES; k++) total += s[k][threadIdx.x];
    return total;
}

// out[c] += Σ_k partial[k, c] (row lanes take every PARTIAL_LANES-th chunk; fixed order).
__device__ __forceinline__ void sum_partials_into(const float* partial, float* out, int n, int chunks) {
    __shared__ float s[PARTIAL_LANES][COL_TILE];
    const int c = blockIdx.x * COL_TILE + threadIdx.x;
    float acc = 0.0f;
    if (c < n)
#pragma unroll 4
        for (int k = threadIdx.y; k < chunks; k += PARTIAL_LANES) acc += partial[(long)k * n + c];
    const float total = sum_row_lanes<PARTIAL_LANES>(acc, s);
    if (threadIdx.y == 0 && c < n) out[c] += total;
}

extern "C" __global__ void sum_partials(const float* partial, float* out, int n, int chunks) {
    sum_partials_into(partial, out, n, chunks);
}

// Two column sums in one launch (blockIdx.y = 0: out0 from partial[0 .. chunks), 1: out1 from the
// next `chunks` rows): the QK-norm gains' gradients from qkv_heads_backward's block partials.
extern "C" __global__ void sum_partials_pair(const float* partial, float* out0, float* out1, int n, int chunks) {
    sum_partials_into(partial + (long)blockIdx.y * chunks * n, blockIdx.y ? out1 : out0, n, chunks);
}

// ---- Q/K/V heads: QK-norm, rotary, layout --------------------------------------------------

struct HeadsDims {
    int batch, seq, heads_q, heads_kv, head_dim, qk_norm;
    float eps;
};

// Each head vector (one (token, head)) is handled by a group of head_dim / 8 consecutive lanes (8 at
// d = 64, 16 at d = 128; the host checks head_dim / 8 divides 32). Lane j of the group holds the PAIRS
// rotary pairs (i, i + half), i = PAIRS·j … PAIRS·j + PAIRS − 1: two 8-byte loads or stores per
// tensor, and the QK-norm sums reduce within the group by shuffles.
//
// A group holds ONE TOKEN and walks all of its heads (Q heads, then K heads with the V copy): the
// rotary table, the gains and the addresses are loaded or computed once per token, not once per
// head vector, and there is no per-vector "which tensor" selection. A warp's groups hold consecutive
// positions of one sequence (4 at d = 64), so a head's vectors of the warp are one contiguous piece
// of the heads layout. (One block per token with one head vector per group was bound by issued
// instructions: ~40 per BF16 element, most of them that per-vector overhead.)
#define PAIRS 4
// Threads per block (kernels.rs HEADS_THREADS: 4 positions per warp at d = 64) and the blocks per SM
// the registers must allow (64 at most each), so that the base model's grid (16 × 1024 positions /
// 16 per block = 1,024 blocks) is resident in one wave on 132 SMs (8 × 132 = 1,056).
#define HEADS_THREADS 128
#define HEADS_BLOCKS_PER_SM 8

struct TokenLane {
    int tok;     // b · seq + t
    int b, t;    // t clamped to the sequence's last position: every lane's loads stay in bounds
    int i0;      // the lane's first pair
    bool valid;  // false past the sequence's end: such lanes store nothing and add no gain terms
                 // (they still take part in the shuffles)
};

// Grid: x over chunks of blockDim.x / lanes positions, y = sequence b (HeadsDims::launch on the host).
__device__ __forceinline__ TokenLane token_lane(const HeadsDims& d) {
    const int lanes = d.head_dim / (2 * PAIRS);
    // lanes is a power of two dividing 32 (the host checks): a shift, and no group straddles a block.
    const int lanes_log2 = __ffs(lanes) - 1;
    const int t = (blockIdx.x * blockDim.x + threadIdx.x) >> lanes_log2;
    TokenLane l;
    l.valid = t < d.seq;
    l.b = blockIdx.y;
    l.t = min(t, d.seq - 1);
    l.tok = l.b * d.seq + l.t;
    l.i0 = PAIRS * (threadIdx.x & (lanes - 1));
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

// `vec` points at the lane's first element (head vector + i0).
__device__ __forceinline__ Pairs load_pairs(const u16* vec, int half) {
    Pairs p;
    unpack4(*(const uint2*)vec, p.a);
    unpack4(*(const uint2*)(vec + half), p.b);
    return p;
}

__device__ __forceinline__ void store_pairs(u16* vec, int half, const Pairs& p) {
    *(uint2*)vec = pack4(p.a);
    *(uint2*)(vec + half) = pack4(p.b);
}

// The lane's elements of a head vector, moved as they are (V: the same BF16 bits).
__device__ __forceinline__ void copy_pairs(const u16* src, u16* dst, int half) {
    const uint2 a = *(const uint2*)src, b = *(const uint2*)(src + half);
    *(uint2*)dst = a;
    *(uint2*)(dst + half) = b;
}

__device__ __forceinline__ Pairs load_gain_pairs(const float* gain, int i0, int half) {
    const float4 a = *(const float4*)(gain + i0), b = *(const float4*)(gain + half + i0);
    return Pairs{{a.x, a.y, a.z, a.w}, {b.x, b.y, b.z, b.w}};
}

// The rotary table's cos and sin of the lane's pairs at position t (the same for all heads).
struct Rotary {
    float c[PAIRS], s[PAIRS];
};

__device__ __forceinline__ Rotary load_rotary(const float* cos_t, const float* sin_t, const TokenLane& l, int half) {
    const int at = l.t * half + l.i0;
    const float4 c4 = *(const float4*)(cos_t + at), s4 = *(const float4*)(sin_t + at);
    return Rotary{{c4.x, c4.y, c4.z, c4.w}, {s4.x, s4.y, s4.z, s4.w}};
}

// The lane's first element of the token's head vectors: in the fused projection row
// `[q heads | k heads | v heads]` (slot s at row + s · hd), and head 0 of the token in the
// `[batch, heads, seq, head_dim]` tensors (head h at + h · head_stride). In elements, 32-bit: the
// host checks that every tensor has < 2^31 elements (HeadsDims::launch).
struct TokenRows {
    int row, q_at, kv_at;
    int head_stride;  // seq · head_dim
};

__device__ __forceinline__ TokenRows token_rows(const HeadsDims& d, const TokenLane& l) {
    const int slots = d.heads_q + 2 * d.heads_kv;
    TokenRows r;
    r.row = l.tok * slots * d.head_dim + l.i0;
    r.q_at = (l.b * d.heads_q * d.seq + l.t) * d.head_dim + l.i0;
    r.kv_at = (l.b * d.heads_kv * d.seq + l.t) * d.head_dim + l.i0;
    r.head_stride = d.seq * d.head_dim;
    return r;
}

// One Q or K head vector (the lane's raw BF16 pairs x_a, x_b): QK-norm (optional; rstd saved by the
// group's first lane), then rotation (half-split pairs, as src/layers/rotary.rs).
__device__ __forceinline__ void forward_head(const HeadsDims& d, const TokenLane& l, uint2 x_a, uint2 x_b,
                                             const Pairs& g, const Rotary& r, u16* y_vec, float* rstd) {
    const int hd = d.head_dim, half = hd / 2;
    Pairs x;
    unpack4(x_a, x.a);
    unpack4(x_b, x.b);
    if (d.qk_norm) {  // uniform
        float ss = 0.0f;
#pragma unroll
        for (int p = 0; p < PAIRS; p++) ss += x.a[p] * x.a[p] + x.b[p] * x.b[p];
        // hd = 8 · lanes is a power of two, so · inv_hd is the division by hd exactly.
        const float rs = rsqrtf(group_sum(ss, hd / (2 * PAIRS)) * inv_head_dim(hd) + d.eps);
#pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            x.a[p] = x.a[p] * rs * g.a[p];
            x.b[p] = x.b[p] * rs * g.b[p];
        }
        if (l.valid && l.i0 == 0) *rstd = rs;
    }
    Pairs y;
#pragma unroll
    for (int p = 0; p < PAIRS; p++) {
        y.a[p] = x.a[p] * r.c[p] - x.b[p] * r.s[p];
        y.b[p] = x.a[p] * r.s[p] + x.b[p] * r.c[p];
    }
    if (l.valid) store_pairs(y_vec, half, y);
}

// `heads` consecutive Q (or K) heads of the lane's token, x loaded one head ahead. Head h: x at
// qkv[x_at + h · hd], y to y[y_at + h · head_stride], rstd to rstd[h]. With v (the K heads), also
// copies slot x_at + h · hd + v_from_k (V head h) to v[y_at + h · head_stride]. Leaves x_at at the
// next slot.
__device__ __forceinline__ void forward_heads(const HeadsDims& d, const TokenLane& l, int heads, int head_stride,
                                              const u16* qkv, int& x_at, const Pairs& g, const Rotary& r, u16* y,
                                              int y_at, float* rstd, u16* v, int v_from_k) {
    const int hd = d.head_dim, half = hd / 2;
    uint2 next_a = *(const uint2*)(qkv + x_at), next_b = *(const uint2*)(qkv + x_at + half);
    for (int h = 0; h < heads; h++) {
        const uint2 x_a = next_a, x_b = next_b;
        if (h + 1 < heads) next_a = *(const uint2*)(qkv + x_at + hd), next_b = *(const uint2*)(qkv + x_at + hd + half);
        forward_head(d, l, x_a, x_b, g, r, y + y_at, rstd + h);
        // The V copy after the arithmetic: the next head's loads are in flight while it waits.
        if (v && l.valid) copy_pairs(qkv + x_at + v_from_k, v + y_at, half);
        x_at += hd, y_at += head_stride;
    }
}

// qkv: `[tokens, (heads_q + 2 heads_kv) · head_dim]` BF16 (the fused projection). Writes Q, K, V as
// BF16 `[batch, heads, seq, head_dim]`: Q and K normalized (QK-norm, optional) then rotated; V copied.
extern "C" __global__ void __launch_bounds__(HEADS_THREADS, HEADS_BLOCKS_PER_SM)
qkv_heads_forward(HeadsDims d, const u16* __restrict__ qkv, const float* __restrict__ q_gain,
                  const float* __restrict__ k_gain, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                  u16* __restrict__ q, u16* __restrict__ k, u16* __restrict__ v, float* __restrict__ q_rstd,
                  float* __restrict__ k_rstd) {
    const TokenLane l = token_lane(d);
    const TokenRows at = token_rows(d, l);
    const int hd = d.head_dim, half = hd / 2;
    const Rotary r = load_rotary(cos_t, sin_t, l, half);
    int x_at = at.row;  // Q head 0's slot, then (after the Q loop) K head 0's
    Pairs g = {};
    if (d.qk_norm) g = load_gain_pairs(q_gain, l.i0, half);
    forward_heads(d, l, d.heads_q, at.head_stride, qkv, x_at, g, r, q, at.q_at, q_rstd + l.tok * d.heads_q, nullptr, 0);
    if (d.qk_norm) g = load_gain_pairs(k_gain, l.i0, half);
    // A token's V head h follows its K head h by heads_kv slots.
    forward_heads(d, l, d.heads_kv, at.head_stride, qkv, x_at, g, r, k, at.kv_at, k_rstd + l.tok * d.heads_kv, v,
                  d.heads_kv * hd);
}

// The lane's loads for the backward of one Q or K head vector: ∂y and (QK-norm) x and the saved rstd.
// The loop issues them one head ahead (prefetch), so each warp has two heads' loads in flight.
struct HeadLoads {
    uint2 dy_a, dy_b, x_a, x_b;
    float rs;
};

// Offsets in elements (32-bit: the host checks that every tensor has < 2^31 elements) keep the
// loop's addresses to one register each, so the prefetch fits 64 registers (8 blocks per SM).
template <bool QK_NORM>
__device__ __forceinline__ HeadLoads load_head(const u16* dy, int dy_at, const u16* x, int x_at, const float* rstd,
                                               int rstd_at, int half) {
    HeadLoads h;
    h.dy_a = *(const uint2*)(dy + dy_at);
    h.dy_b = *(const uint2*)(dy + dy_at + half);
    if (QK_NORM) {
        h.x_a = *(const uint2*)(x + x_at);
        h.x_b = *(const uint2*)(x + x_at + half);
        h.rs = rstd[rstd_at];
    }
    return h;
}

// ∂ of one Q or K head vector: inverse rotation (a rotation's Jacobian is the rotation), then the
// RMSNorm backward with the saved rstd. Adds the gains' gradient terms ∂y_i · x_i · rstd to `terms`
// (the caller walks the heads in order, so `terms` is the token's sum over heads in head order).
template <bool QK_NORM>
__device__ __forceinline__ void backward_head(const HeadsDims& d, const TokenLane& l, const HeadLoads& in,
                                              const Pairs& g, const Rotary& r, u16* dx_vec, Pairs& terms) {
    const int hd = d.head_dim, half = hd / 2;
    Pairs dy;
    unpack4(in.dy_a, dy.a);
    unpack4(in.dy_b, dy.b);
    Pairs dn;  // ∂ of the normalized vector
#pragma unroll
    for (int p = 0; p < PAIRS; p++) {
        dn.a[p] = dy.a[p] * r.c[p] + dy.b[p] * r.s[p];
        dn.b[p] = dy.b[p] * r.c[p] - dy.a[p] * r.s[p];
    }
    if (!QK_NORM) {
        if (l.valid) store_pairs(dx_vec, half, dn);
        return;
    }
    Pairs x;
    unpack4(in.x_a, x.a);
    unpack4(in.x_b, x.b);
    const float rs = in.rs;
    float ux = 0.0f;
#pragma unroll
    for (int p = 0; p < PAIRS; p++) ux += dn.a[p] * g.a[p] * x.a[p] + dn.b[p] * g.b[p] * x.b[p];
    ux = group_sum(ux, hd / (2 * PAIRS));
    const float coef = rs * rs * rs * ux * inv_head_dim(hd);
    const float rs_terms = l.valid ? rs : 0.0f;  // past the end: adds 0
    Pairs dx;
#pragma unroll
    for (int p = 0; p < PAIRS; p++) {
        dx.a[p] = rs * g.a[p] * dn.a[p] - x.a[p] * coef;
        dx.b[p] = rs * g.b[p] * dn.b[p] - x.b[p] * coef;
        // __fadd_rn: each term is rounded before the sum (never fused into an FMA), as when the
        // terms went through memory.
        terms.a[p] = __fadd_rn(terms.a[p], dn.a[p] * x.a[p] * rs_terms);
        terms.b[p] = __fadd_rn(terms.b[p], dn.b[p] * x.b[p] * rs_terms);
    }
    if (l.valid) store_pairs(dx_vec, half, dx);
}

// The backward of `heads` consecutive Q (or K) heads of the lane's token, loads one head ahead.
// Head h: ∂y at dy[dy_at + h · head_stride] (heads layout), x and ∂x at x_at + h · hd of the fused
// rows (qkv, d_qkv), saved rstd at rstd[rstd_at + h]. With dv (the K heads), also copies dV head h
// (dv[dy_at + h · head_stride]) to d_qkv[x_at + h · hd + v_from_k]. Leaves x_at at the next slot
// (Q → K: one offset less to keep in a register across the loop).
template <bool QK_NORM>
__device__ __forceinline__ void backward_heads(const HeadsDims& d, const TokenLane& l, int heads, int head_stride,
                                               const u16* dy, int dy_at, const u16* qkv, int& x_at, const float* rstd,
                                               int rstd_at, const Pairs& g, const Rotary& r, u16* d_qkv,
                                               const u16* dv, int v_from_k, Pairs& terms) {
    const int hd = d.head_dim, half = hd / 2;
    HeadLoads next = load_head<QK_NORM>(dy, dy_at, qkv, x_at, rstd, rstd_at, half);
    for (int h = 0; h < heads; h++) {
        const HeadLoads cur = next;
        if (h + 1 < heads) next = load_head<QK_NORM>(dy, dy_at + head_stride, qkv, x_at + hd, rstd, rstd_at + 1, half);
        backward_head<QK_NORM>(d, l, cur, g, r, d_qkv + x_at, terms);
        // The V copy after the arithmetic: the next head's loads are in flight while it waits.
        if (dv && l.valid) copy_pairs(dv + dy_at, d_qkv + x_at + v_from_k, half);
        dy_at += head_stride, x_at += hd, rstd_at++;
    }
}

// The warp's sum of `terms` over its tokens, stored by its first group at s_terms[warp][key][:]
// (`[warps][2][hd]` floats, dynamic shared memory). An xor butterfly: each add commutes, so every
// lane ends with the same bits (fixed order).
__device__ __forceinline__ void stage_warp_terms(const HeadsDims& d, const TokenLane& l, Pairs terms, int key) {
    extern __shared__ float s_terms[];
    const int hd = d.head_dim, half = hd / 2, lanes = hd / (2 * PAIRS);
    for (int o = lanes; o < WARP; o <<= 1) {
#pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            terms.a[p] += __shfl_xor_sync(0xffffffffu, terms.a[p], o);
            terms.b[p] += __shfl_xor_sync(0xffffffffu, terms.b[p], o);
        }
    }
    if (threadIdx.x % WARP < lanes) {
        float* s = s_terms + ((threadIdx.x / WARP) * 2 + key) * hd;
#pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            s[l.i0 + p] = terms.a[p];
            s[half + l.i0 + p] = terms.b[p];
        }
    }
}

// The block's sums of the gain terms over its tokens: partial[(key · blocks + block) · hd + c] (key 0:
// the query gain, 1: the key gain; blocks = gridDim.x · gridDim.y), summed over the warps in order;
// sum_partials_pair adds the blocks up. Every thread of the block must call it (one barrier).
__device__ __forceinline__ void store_block_terms(const HeadsDims& d, float* partial) {
    extern __shared__ float s_terms[];
    const int hd = d.head_dim, warps = blockDim.x / WARP;
    __syncthreads();
    const int blocks = gridDim.x * gridDim.y, block = blockIdx.y * gridDim.x + blockIdx.x;
    for (int i = threadIdx.x; i < 2 * hd; i += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < warps; w++) sum += s_terms[w * 2 * hd + i];
        const int key = i >= hd, c = i - key * hd;
        partial[((long)key * blocks + block) * hd + c] = sum;
    }
}

// The backward of qkv_heads_forward: dQ, dK, dV (BF16, heads layout) → d_qkv (BF16, the fused
// projection's layout). With QK-norm, gain_partial receives the block sums of the gains' gradient
// terms (`[2, blocks, head_dim]`, store_block_terms).
extern "C" __global__ void __launch_bounds__(HEADS_THREADS, HEADS_BLOCKS_PER_SM)
qkv_heads_backward(HeadsDims d, const u16* __restrict__ dq, const u16* __restrict__ dk, const u16* __restrict__ dv,
                   const u16* __restrict__ qkv, const float* __restrict__ q_gain, const float* __restrict__ k_gain,
                   const float* __restrict__ q_rstd, const float* __restrict__ k_rstd,
                   const float* __restrict__ cos_t, const float* __restrict__ sin_t, u16* __restrict__ d_qkv,
                   float* __restrict__ gain_partial) {
    const TokenLane l = token_lane(d);
    const TokenRows at = token_rows(d, l);
    const int hd = d.head_dim, half = hd / 2;
    const Rotary r = load_rotary(cos_t, sin_t, l, half);
    int x_at = at.row;  // Q head 0's slot, then (after the Q loop) K head 0's
    const int v_from_k = d.heads_kv * hd;  // a token's V head h follows its K head h by heads_kv slots
    const int hs = at.head_stride;
    Pairs terms = {};
    if (!d.qk_norm) {  // uniform: two loops without the norm's loads, shuffles and barrier
        const Pairs no_gain = {};
        backward_heads<false>(d, l, d.heads_q, hs, dq, at.q_at, qkv, x_at, q_rstd, 0, no_gain, r, d_qkv, nullptr, 0, terms);
        backward_heads<false>(d, l, d.heads_kv, hs, dk, at.kv_at, qkv, x_at, k_rstd, 0, no_gain, r, d_qkv, dv, v_from_k, terms);
        return;
    }
    const Pairs g_q = load_gain_pairs(q_gain, l.i0, half);
    backward_heads<true>(d, l, d.heads_q, hs, dq, at.q_at, qkv, x_at, q_rstd, l.tok * d.heads_q, g_q, r, d_qkv, nullptr, 0, terms);
    stage_warp_terms(d, l, terms, 0);
    terms = Pairs{};
    const Pairs g_k = load_gain_pairs(k_gain, l.i0, half);
    backward_heads<true>(d, l, d.heads_kv, hs, dk, at.kv_at, qkv, x_at, k_rstd, l.tok * d.heads_kv, g_k, r, d_qkv, dv, v_from_k, terms);
    stage_warp_terms(d, l, terms, 1);
    store_block_terms(d, gain_partial);
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
